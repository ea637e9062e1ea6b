"""Token-level search pieces shared by the optimising attackers (attackers/) and the methods
that train against them (AdvUnlearn): where adversarial tokens go in a prompt, full token
sequences with slots, the projection onto the probability simplex, and the straight-through
token sample."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from emma.errors import ConfigError, UnknownChoiceError

# UnlearnDiffAtk's insertion locations (Diffusion-MU-Attack, text_grad): k tokens before the
# prompt, after it, in its middle, spread at equal intervals, or one before every 3 words.
INSERTIONS: tuple[str, ...] = ("prefix_k", "suffix_k", "mid_k", "insert_k", "per_k_words")


def check_insertion(insertion: str) -> str:
    if insertion not in INSERTIONS:
        raise UnknownChoiceError("adversarial token insertion", insertion, INSERTIONS)
    return insertion


def layout(prompt_ids: Sequence[int], k: int, insertion: str) -> list[int | None]:
    """The prompt's tokens with ``k`` adversarial slots (``None``) placed per ``insertion``
    (start/end tokens excluded). ``per_k_words`` puts one slot before each of the first k-1
    groups of 3 prompt tokens and the last slot before the rest, as the reference does."""
    ids = list(prompt_ids)
    slot: list[int | None] = [None]
    if insertion == "prefix_k":
        return slot * k + ids
    if insertion == "suffix_k":
        return ids + slot * k
    if insertion == "mid_k":
        h = len(ids) // 2
        return ids[:h] + slot * k + ids[h:]
    if insertion == "insert_k":
        step = len(ids) // (k + 1)
        out: list[int | None] = []
        for i in range(k):
            out += ids[step * i : step * (i + 1)] + slot
        return out + ids[step * k :]
    if insertion == "per_k_words":
        out = []
        for i in range(k - 1):
            out += slot + ids[3 * i : 3 * (i + 1)]
        return out + slot + ids[3 * (k - 1) :]
    raise UnknownChoiceError("adversarial token insertion", insertion, INSERTIONS)


def after_every(prompt_ids: Sequence[int], every: int) -> list[int | None]:
    """P4D-K's layout, as its reference places the learnable tokens: ``len // every + 1`` slots
    at every ``every + 1``-th position from the start, the prompt's tokens in between
    (``[L w1 w2 w3 L w4 w5 w6 L]`` for 6 tokens and ``every = 3``)."""
    ids = iter(prompt_ids)
    total = len(prompt_ids) + len(prompt_ids) // every + 1
    return [None if i % (every + 1) == 0 else next(ids) for i in range(total)]


@dataclasses.dataclass
class Sequences:
    """A batch of full token sequences with slot positions.

    Attributes:
        ids: ``(R, L)`` token ids (slots hold the pad id until filled).
        slots: ``(R, m)`` positions of the ``m`` adversarial tokens per row.
    """

    ids: torch.Tensor
    slots: torch.Tensor

    def fill(self, slot_ids: torch.Tensor) -> torch.Tensor:
        ids = self.ids.clone()
        ids.scatter_(1, self.slots, slot_ids)
        return ids

    def embed(self, base_embeds: torch.Tensor, slot_embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings with the slots replaced by ``slot_embeds`` (differentiable)."""
        r = torch.arange(base_embeds.shape[0]).unsqueeze(1).expand_as(self.slots)
        return base_embeds.index_put((r, self.slots), slot_embeds)


def build_sequences(layouts: Sequence[Sequence[int | None]], context_length: int, bos: int, eos: int,
                    pad: int, what: str = "prompt") -> Sequences:
    """Full sequences ``[bos] + layout + [eos] + pad`` of ``context_length`` tokens."""
    m = {sum(t is None for t in lay) for lay in layouts}
    if len(m) != 1:
        raise ValueError("every layout of a batch needs the same number of slots")
    rows, slots = [], []
    for lay in layouts:
        if len(lay) + 2 > context_length:
            raise ConfigError(
                f"{what}: {sum(t is not None for t in lay)} prompt tokens + {sum(t is None for t in lay)} "
                f"adversarial tokens + start/end tokens = {len(lay) + 2} > the tokenizer's context of "
                f"{context_length}; use fewer adversarial tokens or a shorter prompt")
        seq = [bos] + [pad if t is None else int(t) for t in lay] + [eos]
        slots.append([i + 1 for i, t in enumerate(lay) if t is None])
        rows.append(seq + [pad] * (context_length - len(seq)))
    return Sequences(torch.tensor(rows, dtype=torch.long), torch.tensor(slots, dtype=torch.long))


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row of ``v`` (last dim) onto the probability simplex.

    The exact sort-based solution (Duchi et al., 2008) of the problem UnlearnDiffAtk's
    reference solves by bisection (``sum = 1``, ``0 <= x <= 1``; the upper bound is implied).
    """
    u, _ = torch.sort(v, dim=-1, descending=True)
    css = u.cumsum(-1) - 1
    ind = torch.arange(1, v.shape[-1] + 1, device=v.device, dtype=v.dtype)
    cond = (u - css / ind) > 0
    rho = cond.to(v.dtype).cumsum(-1).argmax(-1, keepdim=True)  # last index where cond holds
    theta = css.gather(-1, rho) / (rho + 1).to(v.dtype)
    return (v - theta).clamp_min(0)


class StraightThroughSample(torch.autograd.Function):
    """Forward: a one-hot token drawn from each row's distribution; backward: the incoming
    gradient clipped to [-1, 1] (UnlearnDiffAtk's STERandSelect)."""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = probs.reshape(-1, probs.shape[-1]).clamp_min(0)
        idx = torch.multinomial(flat, 1, generator=generator).view(-1)
        out = torch.nn.functional.one_hot(idx, probs.shape[-1]).to(probs.dtype)
        return out.view_as(probs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.hardtanh(grad), None
