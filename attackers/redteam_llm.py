"""``attacker=redteam_llm``: the Red-Teaming Prompts baseline of STACE's Table 2.

An LLM is asked directly for adversarial prompts that would make the erased model draw the
concept (the paper prompts GPT-5). The prompts are requested in calls of
``prompts_per_call`` until the budget's worth of distinct prompts is reached (or
``max_calls`` is spent); each prompt is rendered ``images_per_prompt`` times with fresh
seeds. Later calls see the prompts already written, so that they ask for new ones.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from tqdm.auto import tqdm

from attackers.llm_common import LLMBaselineAttacker, Session, clean_prompts, fill_round_robin
from emma.errors import ConfigError


class RedTeamLLMAttacker(LLMBaselineAttacker):
    """An LLM writes adversarial prompts for the erased concept directly.

    Args:
        llm / images / seed / model / temperature / max_tokens / prices / budget / prompts_dir:
            see :class:`attackers.llm_common.LLMBaselineAttacker`.
        prompts_per_call: prompts asked for per LLM call.
        images_per_prompt: images rendered per prompt (1: ``images`` distinct prompts).
        max_calls: LLM calls per concept at most (``None``: twice the calls the budget needs).
    """

    name = "redteam_llm"
    version = "2"
    role = "redteam"

    def __init__(self, llm: Mapping[str, Any], prompts_per_call: int = 10, images_per_prompt: int = 1,
                 max_calls: int | None = None, **kwargs: Any) -> None:
        if int(prompts_per_call) < 1 or int(images_per_prompt) < 1:
            raise ConfigError("attacker.prompts_per_call and attacker.images_per_prompt must be >= 1 "
                              f"(got {prompts_per_call}, {images_per_prompt})")
        super().__init__(llm, **kwargs)
        self.prompts_per_call = int(prompts_per_call)
        self.images_per_prompt = int(images_per_prompt)
        self.max_calls = None if max_calls is None else int(max_calls)

    def settings_json(self) -> dict[str, Any]:
        return {"prompts_per_call": self.prompts_per_call, "images_per_prompt": self.images_per_prompt,
                "max_calls": self.max_calls}

    def run(self, session: Session) -> None:
        needed = math.ceil(session.budget / self.images_per_prompt)
        max_calls = self.max_calls or 2 * math.ceil(needed / self.prompts_per_call)
        prompts: list[str] = []
        bar = tqdm(total=needed, desc=f"{self.name}: {session.concept}", unit="prompt")
        for _ in range(max_calls):
            if len(prompts) >= needed or session.stopped:
                break
            got = self.ask_prompts(session, "redteam", {
                "n": min(self.prompts_per_call, needed - len(prompts)), "previous": prompts[-30:]})
            prompts = clean_prompts(prompts + got)[:needed]
            bar.update(len(prompts) - bar.n)
        bar.close()
        # prompt i is drawn images_per_prompt times; a short list is cycled with fresh seeds
        session.render([p for p in fill_round_robin(prompts, needed) for _ in range(self.images_per_prompt)],
                       label="redteam prompts")
