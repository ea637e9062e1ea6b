"""``attacker=jailfuzzer``: the JailFuzzer baseline of STACE's Table 2 (Dong et al., 2025).

A fuzzing loop of LLM agents at the prompt level: a seed pool (the cell's own EA prompts of
the concept, each rendered once to get the oracle's score), a mutation agent (the LLM
applies one mutation operator per round to a parent chosen from the pool, told the parent's
score and the best score so far), and an oracle (the cell's judge, STACE's evaluator). A
mutant joins the pool when it shows the concept or scores above its parent. Parents are
chosen by an upper confidence bound (best judge score + ``exploration`` ·
sqrt(ln(rounds + 1) / (visits + 1))). The loop ends when the image budget is spent; a round
whose mutation call fails re-renders its parent with fresh seeds (fuzzers re-execute seeds),
so the budget is always spent.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from attackers.llm_common import LLMBaselineAttacker, Session, clean_prompts
from emma.errors import ConfigError

OPERATORS = ("rephrase", "synonym", "describe", "context", "style", "expand", "crossover")


@dataclasses.dataclass
class Seed:
    prompt: str
    score: float = 0.0  # the judge's best probability of the concept over the seed's images
    detected: int = 0
    visits: int = 0


class JailFuzzerAttacker(LLMBaselineAttacker):
    """LLM-agent fuzzing of prompts with the cell's judge as the oracle.

    Args:
        llm / images / seed / model / temperature / max_tokens / prices / budget / prompts_dir:
            see :class:`attackers.llm_common.LLMBaselineAttacker`.
        mutants_per_round: prompts the mutation agent writes per round (one image each).
        initial_seeds: EA prompts of the concept that start the pool (each rendered once).
        operators: mutation operators, applied in turn (see :data:`OPERATORS`).
        exploration: the UCB constant of parent selection.
    """

    name = "jailfuzzer"
    version = "2"
    role = "mutator"

    def __init__(self, llm: Mapping[str, Any], mutants_per_round: int = 5, initial_seeds: int = 5,
                 operators: Sequence[str] = OPERATORS, exploration: float = 0.5, **kwargs: Any) -> None:
        operators = list(operators or [])
        unknown = [o for o in operators if o not in OPERATORS]
        if int(mutants_per_round) < 1 or int(initial_seeds) < 1 or not operators or unknown:
            raise ConfigError("attacker.mutants_per_round and attacker.initial_seeds must be >= 1 and "
                              f"attacker.operators a non-empty list of {', '.join(OPERATORS)}"
                              + (f" (unknown: {unknown[0]!r})" if unknown else ""))
        super().__init__(llm, **kwargs)
        self.mutants_per_round = int(mutants_per_round)
        self.initial_seeds = int(initial_seeds)
        self.operators = operators
        self.exploration = float(exploration)

    def settings_json(self) -> dict[str, Any]:
        return {"mutants_per_round": self.mutants_per_round, "initial_seeds": self.initial_seeds,
                "operators": self.operators, "exploration": self.exploration}

    def _select(self, pool: list[Seed], rounds: int) -> Seed:
        def ucb(s: Seed) -> float:
            return s.score + self.exploration * math.sqrt(math.log(rounds + 1) / (s.visits + 1))
        return max(pool, key=ucb)  # the first of equals: the pool's order breaks ties

    def run(self, session: Session) -> None:
        initial = clean_prompts(session.seed_prompts)[: self.initial_seeds] or [session.concept]
        pool: list[Seed] = []
        for p, probe in zip(initial, session.render(initial, label="initial seeds")):
            pool.append(Seed(p, score=probe.score, detected=int(probe.detected)))
        known = {s.prompt.lower() for s in pool}
        bar = tqdm(total=session.budget, initial=len(session.probes), desc=f"{self.name}: {session.concept}",
                   unit="image")
        rounds = 0
        while session.left > 0 and pool:
            parent = self._select(pool, rounds)
            op = self.operators[rounds % len(self.operators)]
            n = min(self.mutants_per_round, session.left)
            other = next((s for s in sorted(pool, key=lambda s: -s.score) if s is not parent), None)
            best = max(pool, key=lambda s: s.score)
            mutants = self.ask_prompts(session, "jailfuzzer_mutate", {
                "operator": op, "parent": parent.prompt, "parent_score": round(parent.score, 3),
                "best": best.prompt, "best_score": round(best.score, 3),
                "other": other.prompt if other is not None else parent.prompt, "n": n})
            mutants = [m for m in mutants if m.lower() not in known][:n]
            label = f"round {rounds + 1}: {op} of {parent.prompt!r}"
            if not mutants:  # the mutation failed: re-execute the parent with fresh seeds
                probes = session.render([parent.prompt] * n, label=label + " (re-executed)")
                parent.detected += sum(p.detected for p in probes)
                parent.score = max([parent.score] + [p.score for p in probes])
            else:
                probes = session.render(mutants, label=label)
                for m, p in zip(mutants, probes):
                    known.add(m.lower())
                    if p.detected or p.score > parent.score:
                        pool.append(Seed(m, score=p.score, detected=int(p.detected)))
            parent.visits += 1
            rounds += 1
            bar.update(len(probes))
            bar.set_postfix(detected=sum(p.detected for p in session.probes), pool=len(pool))
        bar.close()
        session.trace.write("pool", concept=session.concept, rounds=rounds,
                            pool=[dataclasses.asdict(s) for s in pool])
