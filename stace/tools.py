"""The harness side of the probe API beyond rendering text prompts: tokenizer and
text-encoder queries (for embedding-level hypotheses) and the project's attackers as tools.

Everything here runs in the harness process, on the cell's attack target; the sandboxed
program only sends requests (:mod:`stace.sandbox_child`) and receives JSON-able answers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from emma.api.attacker import Attacker
from emma.api.types import PromptRequest
from emma.cache import tensor_hash

TOOL_ATTACKERS = ("unlearndiffatk", "p4d_n", "p4d_k", "ring_a_bell")


def attacker_factory(name: str, scale: str | None, overrides: Mapping[str, Any] | None = None) -> Attacker:
    """Build ``attacker=<name>`` as the cell would: ``conf/attacker/<name>.yaml``, then the
    preset ``conf/preset/attacker/<name>_<scale>.yaml`` when there is one, then ``overrides``."""
    from emma import registry
    from emma.errors import UnknownChoiceError

    if name not in registry.choices("attacker"):
        raise UnknownChoiceError("STACE tool attacker", name, TOOL_ATTACKERS, "attacker.tools")
    return registry.build("attacker", name, scale=scale, overrides=overrides)


@dataclasses.dataclass
class AttackCall:
    """One ``probe.attack`` call, for the trace."""

    attacker: str
    prompt: str
    seed: int
    adversarial_prompt: str | None = None
    queries: int = 0
    iterations: int = 0
    time_s: float = 0.0
    cached: bool = False
    error: str | None = None


class ProbeTools:
    """Tokenizer, text-encoder and attacker queries on the attack target.

    Args:
        target: the cell's attack target (``pipe`` for the tokenizer, ``white_box()`` for the
            text encoder; attackers get the target itself).
        concept: the erased concept (the attackers' request concept).
        default_prompt: the prompt an attack starts from when the program gives none.
        attackers: tool name -> a function building that attacker (``{}``: no attack tools).
        attack_cache: where finished attacks are stored (:class:`emma.attack.AttackCache`
            root), so that a repeated call costs nothing; ``None``: no cache.
    """

    def __init__(self, target: Any, concept: str, default_prompt: str,
                 attackers: Mapping[str, Callable[[], Attacker]] | None = None,
                 attack_cache: str | Path | None = None) -> None:
        self.target = target
        self.concept = concept
        self.default_prompt = default_prompt
        self.attackers = dict(attackers or {})
        self.attack_cache = attack_cache
        self.calls: list[AttackCall] = []
        self._built: dict[str, Attacker] = {}

    # -- tokenizer and text encoder ------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        tok = getattr(getattr(self.target, "pipe", None), "tokenizer", None)
        if tok is None:
            raise ValueError("this target exposes no tokenizer")
        return tok

    def _white_box(self) -> Any:
        if not hasattr(self.target, "white_box"):
            raise ValueError("this target gives no text-encoder access (black-box)")
        return self.target.white_box()  # AttackTargetError names why not

    def tokenize(self, text: str) -> list[str]:
        return list(self.tokenizer.tokenize(str(text)))

    def token_ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(str(text), truncation=True).input_ids]

    @torch.no_grad()
    def encode(self, text: str) -> torch.Tensor:
        """The text encoder's output for ``text`` (L x D): what the UNet is conditioned on."""
        wb = self._white_box()
        return wb.encode_ids(wb.token_ids([str(text)]))[0].float().cpu()

    def embed_shape(self) -> tuple[int, int]:
        wb = self._white_box()
        return int(wb.context_length), int(wb.text_encoder.config.hidden_size)

    @torch.no_grad()
    def nearest_tokens(self, text: str, n: int = 10) -> list[list[Any]]:
        """Vocabulary tokens whose input embeddings are nearest (cosine) the mean input
        embedding of ``text``'s tokens; ``[[token, cosine], ...]``, nearest first."""
        n = int(n)
        if not 1 <= n <= 200:
            raise ValueError(f"n={n}: must be in [1, 200]")
        wb = self._white_box()
        ids = [i for i in self.token_ids(text) if i not in (wb.bos_token_id, wb.eos_token_id, wb.pad_token_id)]
        if not ids:
            raise ValueError(f"{text!r} has no tokens")
        table = wb.token_embedding_matrix().float()
        q = table[ids].mean(0)
        cos = torch.nn.functional.cosine_similarity(table, q[None], dim=1)
        top = torch.topk(cos, n)
        return [[self.tokenizer.decode([int(i)]).strip(), round(float(c), 6)]
                for c, i in zip(top.values, top.indices)]

    def check_embeds(self, embeds: Sequence[Sequence[Sequence[float]]]) -> torch.Tensor:
        """The program's embeddings as an ``(N, L, D)`` tensor; their shape must be the text
        encoder's and every value finite."""
        L, D = self.embed_shape()
        try:
            t = torch.tensor(embeds, dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"embeds must be L x D lists of numbers ({L} x {D}): {exc}") from None
        if t.dim() != 3 or tuple(t.shape[1:]) != (L, D):
            raise ValueError(f"embeds have shape {tuple(t.shape)}; each must be {L} x {D} (probe.encode's shape)")
        if not torch.isfinite(t).all():
            raise ValueError("embeds hold NaN or infinite values")
        return t

    # -- the project's attackers -----------------------------------------------------------------
    def attack(self, name: str, prompt: str | None, seed: int) -> dict[str, Any]:
        """Run attacker ``name`` on the erased model from ``prompt``; return its adversarial
        prompt (the program may then render it with ``probe.generate``)."""
        if name not in self.attackers:
            raise ValueError(f"unknown attacker {name!r}; available: {', '.join(sorted(self.attackers)) or 'none'}")
        from emma.attack import AttackCache, run_attack

        prompt = str(prompt) if prompt else self.default_prompt
        call = AttackCall(attacker=name, prompt=prompt, seed=int(seed))
        self.calls.append(call)
        try:
            if name not in self._built:
                self._built[name] = self.attackers[name]()
            attacker = self._built[name]
            req = PromptRequest(prompt=prompt, concept=self.concept, group="attack", kind=f"stace-tool/{name}",
                                seed=int(seed), n_images=1)
            cache = AttackCache(self.attack_cache) if self.attack_cache is not None else None
            run = run_attack(attacker, self.target, [req], cache)
        except Exception as exc:  # the program is told; the harness carries on
            call.error = f"{type(exc).__name__}: {exc}"
            raise
        out = run.outputs[0]
        call.adversarial_prompt, call.queries, call.iterations = out.adversarial_prompt, out.queries, out.iterations
        call.time_s, call.cached = round(float(out.time_s), 3), bool(run.requests_cached)
        return {"adversarial_prompt": out.adversarial_prompt, "queries": out.queries, "iterations": out.iterations}


def embeds_key(t: torch.Tensor) -> str:
    """A content address of one prompt embedding (its float32 values and shape)."""
    return tensor_hash(t.detach().float().cpu().contiguous())[:24]
