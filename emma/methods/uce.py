"""UCE — Unified Concept Editing (Gandikota et al., WACV 2024).

A closed-form edit of every cross-attention key and value projection ``W`` (``attn2.to_k``,
``attn2.to_v``). Erase pairs map the text embeddings ``c`` of a concept to the outputs
``v* = W_old c*`` of its guide concept; preserve prompts keep ``W_old c``:

    W = (λ W_old + s_e Σ v* cᵀ + s_p Σ W_old c_p c_pᵀ) (λ I + s_e Σ c cᵀ + s_p Σ c_p c_pᵀ)⁻¹

which minimises ``s_e Σ |W c − v*|² + s_p Σ |W c_p − W_old c_p|² + λ |W − W_old|²``. As in
the paper's code (rohitgandikota/unified-concept-editing, ``train_erase.py``) an erase pair
uses the tokens from the concept's last word token to the end of the context, aligned with
those of the guide; a preserve prompt uses all tokens; the empty prompt is always
preserved. Defaults: λ = 0.5, erase scale 1, preserve scale ``max(0.1, 1/len(preserve))``,
keys and values edited, ``replace`` technique. Guide and preserved concepts per domain are
the paper's (``conf/method/uce.yaml``, card ``docs/protocols/methods/uce.md``): objects and
nudity → the unconditional prompt, styles → "art" preserving every other artist of UCE's
1,734-artist list (``"<data:artists1734>"``); celebrities → "a celebrity" and logos →
"logo" (EMMA's guides; the paper has no such runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError, UnknownChoiceError
from emma.methods._common import (
    attn2_modules,
    check_concepts,
    expand_others,
    for_concept,
    for_domain,
    is_style_domain,
    require_sd_pipeline,
)

TECHNIQUES = ("replace", "tensor")
# Prompt expansion of the reference code (``--add_prompts``).
EXPANSIONS: dict[str, tuple[str, ...]] = {
    "style": ("painting by {}", "art by {}", "artwork by {}", "picture by {}", "style of {}"),
    "object": ("image of {}", "photo of {}", "portrait of {}", "picture of {}", "painting of {}"),
}


def uce_closed_form(
    weight: torch.Tensor,
    erase_keys: torch.Tensor,
    erase_values: torch.Tensor,
    preserve_keys: torch.Tensor,
    preserve_values: torch.Tensor,
    *,
    lamb: float,
    erase_scale: float,
    preserve_scale: float,
) -> torch.Tensor:
    """The UCE solution for one projection, computed in float64.

    Args:
        weight: ``W_old``, ``(d_out, d_in)``.
        erase_keys / erase_values: ``(N, d_in)`` text embeddings and their targets ``(N, d_out)``.
        preserve_keys / preserve_values: ``(M, d_in)`` and ``(M, d_out)`` (``M`` may be 0).
        lamb: λ, the pull towards ``W_old``.
        erase_scale / preserve_scale: weights of the two sums.

    Returns:
        The edited weight, float64 ``(d_out, d_in)``.
    """
    w = weight.detach().double()
    d_in = w.shape[1]
    ck, cv = erase_keys.double(), erase_values.double()
    pk, pv = preserve_keys.double(), preserve_values.double()
    mat1 = lamb * w + erase_scale * cv.T @ ck + preserve_scale * pv.T @ pk
    mat2 = lamb * torch.eye(d_in, dtype=torch.float64, device=w.device)
    mat2 = mat2 + erase_scale * ck.T @ ck + preserve_scale * pk.T @ pk
    # W mat2 = mat1 with mat2 symmetric positive definite (λ > 0 or enough keys).
    return torch.linalg.solve(mat2, mat1.T).T


class UCEMethod(ErasureMethod):
    """Unified Concept Editing (closed-form cross-attention edit).

    Args:
        guide_concepts: per domain, what each erased concept is mapped to: a string, or
            ``{concept: guide, _default: guide}``.
        preserve_concepts: per domain, prompts whose key/value outputs are kept (the empty
            prompt is always added).
        erase_scale: weight of the erase term.
        preserve_scale: weight of the preserve term; ``None`` -> ``max(0.1, 1/len(preserve))``.
        lamb: λ, the regulariser towards the original weights.
        with_to_k: edit the key projections too (not only the values).
        technique: ``replace`` (targets are the guide's outputs) or ``tensor`` (the guide's
            outputs with their component along the concept's removed).
        add_prompts: also edit template expansions of each concept ("image of {}", ...; the
            ``style`` set for style domains).
    """

    name = "uce"
    version = "1"
    edited_components = ("unet",)

    def __init__(
        self,
        guide_concepts: Any = "",
        preserve_concepts: Any = None,
        erase_scale: float = 1.0,
        preserve_scale: float | None = None,
        lamb: float = 0.5,
        with_to_k: bool = True,
        technique: str = "replace",
        add_prompts: bool = False,
    ) -> None:
        if technique not in TECHNIQUES:
            raise UnknownChoiceError("UCE technique", technique, TECHNIQUES)
        if float(lamb) < 0:
            raise ConfigError(f"UCE lamb must be >= 0, got {lamb}")
        super().__init__(
            guide_concepts=to_python(guide_concepts), preserve_concepts=to_python(preserve_concepts),
            erase_scale=float(erase_scale),
            preserve_scale=None if preserve_scale is None else float(preserve_scale),
            lamb=float(lamb), with_to_k=bool(with_to_k), technique=technique, add_prompts=bool(add_prompts),
        )

    # ------------------------------------------------------------------ prompt pairs
    def edit_pairs(self, concepts: Sequence[str], domain: Domain | None) -> list[tuple[str, str]]:
        """(erase prompt, guide prompt) pairs, with the template expansion when enabled."""
        guides = for_domain(self.hparams["guide_concepts"], domain, what="UCE guide_concepts")
        pairs = []
        for c in concepts:
            g = for_concept(guides, c, what="UCE guide_concepts")
            if not isinstance(g, str):
                raise ConfigError(f"UCE guide for {c!r} must be a string, got {g!r}")
            pairs.append((c, g))
        if self.hparams["add_prompts"]:
            kind = "style" if is_style_domain(domain) else "object"
            pairs += [(t.format(c), t.format(g)) for c, g in list(pairs) for t in EXPANSIONS[kind]]
        return pairs

    def preserve_prompts(self, concepts: Sequence[str], domain: Domain | None) -> list[str]:
        """The empty prompt plus the domain's preserve concepts (never an erased concept, in
        any spelling the domain knows; ``"<others>"`` and ``"<data:NAME>"`` expanded)."""
        pres = for_domain(self.hparams["preserve_concepts"], domain, what="UCE preserve_concepts") or []
        return [""] + [p for p in expand_others(pres, domain, concepts) if p != ""]

    # ------------------------------------------------------------------ erase
    @torch.no_grad()
    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Edit ``pipe.unet``'s cross-attention keys/values in closed form (``seed`` is unused:
        UCE draws nothing at random)."""
        require_sd_pipeline(pipe, "UCE")
        concepts = check_concepts(concepts, pipe.tokenizer, method="UCE")
        hp = self.hparams
        pairs = self.edit_pairs(concepts, domain)
        retain = self.preserve_prompts(concepts, domain)
        preserve_scale = hp["preserve_scale"]
        if preserve_scale is None:
            preserve_scale = max(0.1, 1.0 / len(retain))

        erase_keys, guide_embs = self._aligned_tokens(pipe, pairs)
        retain_embs = self._embed(pipe, retain).reshape(-1, erase_keys.shape[-1])

        layers = [m.to_v for _, m in attn2_modules(pipe.unet)]
        if hp["with_to_k"]:
            layers += [m.to_k for _, m in attn2_modules(pipe.unet)]
        new_weights = []
        for layer in layers:
            w = layer.weight.detach()
            wd = w.double()
            vals = guide_embs.to(wd) @ wd.T
            if hp["technique"] == "tensor":
                vals = tensor_targets(erase_keys.to(wd) @ wd.T, vals, _span_lengths(pipe, pairs))
            new_weights.append(uce_closed_form(
                w, erase_keys.to(w.device), vals, retain_embs.to(w.device), retain_embs.to(wd) @ wd.T,
                lamb=hp["lamb"], erase_scale=hp["erase_scale"], preserve_scale=preserve_scale,
            ))
        # Write only after every solve succeeded: a failure leaves the UNet untouched.
        for w_new in new_weights:
            if not torch.isfinite(w_new).all():
                raise ConfigError("UCE produced non-finite weights; raise lamb (λ) above 0")
        for layer, w_new in zip(layers, new_weights, strict=True):
            layer.weight.copy_(w_new.to(layer.weight.dtype))
        return pipe

    @staticmethod
    def _embed(pipe: Any, prompts: Sequence[str], chunk: int = 256) -> torch.Tensor:
        """Text-encoder outputs of ``prompts`` in float64, in chunks (a style's 1,733 preserved
        artists are one list)."""
        tok = pipe.tokenizer
        out = []
        for s in range(0, len(prompts), chunk):
            ids = tok(list(prompts[s : s + chunk]), padding="max_length", max_length=tok.model_max_length,
                      truncation=True, return_tensors="pt").input_ids
            out.append(pipe.text_encoder(ids.to(pipe.text_encoder.device))[0].double())
        return torch.cat(out)

    @classmethod
    def _aligned_tokens(cls, pipe: Any, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated (concept, guide) token embeddings from each one's last word token on.

        The reference code maps an empty guide to ``" "``, whose last "word token" is the start
        token; the longer prompt's tail is cut so both spans have the same length.
        """
        tok = pipe.tokenizer
        n = tok.model_max_length
        keys, guides = [], []
        for old, new in pairs:
            emb = cls._embed(pipe, [old, new if new != "" else " "])
            last_old = len(tok(old, add_special_tokens=False).input_ids)
            last_new = len(tok(new if new != "" else " ", add_special_tokens=False).input_ids)
            far = max(last_old, last_new)
            keys.append(emb[0, last_old : n - (far - last_old)])
            guides.append(emb[1, last_new : n - (far - last_new)])
        return torch.cat(keys), torch.cat(guides)

def tensor_targets(old_vals: torch.Tensor, new_vals: torch.Tensor, spans: Sequence[int]) -> torch.Tensor:
    """UCE's ``tensor`` targets: per span of rows (one erased prompt's tokens), the guide's
    outputs ``new_vals`` less their component along the erased prompt's outputs ``old_vals``,
    taken as one unit direction over all tokens of the span (the reference's "tensor" mode)."""
    out, start = [], 0
    for n in spans:
        o, g = old_vals[start : start + n], new_vals[start : start + n]
        u = o / o.norm()
        out.append(g - (u * g).sum() * u)
        start += n
    return torch.cat(out)


def _span_lengths(pipe: Any, pairs: list[tuple[str, str]]) -> list[int]:
    tok = pipe.tokenizer
    out = []
    for old, new in pairs:
        lo = len(tok(old, add_special_tokens=False).input_ids)
        ln = len(tok(new if new != "" else " ", add_special_tokens=False).input_ids)
        out.append(tok.model_max_length - max(lo, ln))
    return out
