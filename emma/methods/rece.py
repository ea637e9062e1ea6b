"""RECE — Reliable and Efficient Concept Erasure (Gong et al., ECCV 2024).

RECE starts from a UCE edit of the cross-attention keys and values (``attn2.to_k``,
``attn2.to_v``) and then repeats, ``epochs`` times, two closed-form steps:

1. **Adversarial embedding.** The text embedding that makes the *edited* projections
   reproduce what the *original* projections made of the concept,

       e' = argmin_e  Σ_l |W_l e − W⁰_l c|² + γ |e|²  =  (Σ_l W_lᵀW_l + γ I)⁻¹ (Σ_l W_lᵀ W⁰_l) c

   (the repository's "regzero" regularisation, γ = ``regular_scale``), per token of the
   concept prompt's full embedding ``c``: the embedding that would bring the concept back.
2. **Erase it.** The UCE closed form maps ``e'`` to the guide's outputs ``W_l g`` while the
   preserve prompts keep ``W_l c_p`` and λ pulls towards the current weights:

       W_l ← (λ W_l + s_e Σ W_l g e'ᵀ + s_p Σ W_l c_p c_pᵀ)(λ I + s_e Σ e' e'ᵀ + s_p Σ c_p c_pᵀ)⁻¹

Defaults follow the reference code (CharlesGong12/RECE, ``train_object.py``): 5 epochs,
λ = 0.1, erase scale 1, preserve scale 0.1, γ = 1e-3, keys and values edited, the guide the
unconditional prompt (``" "``), starting from UCE at its own defaults (λ = 0.5) towards the
same guide. Only ``attn2.to_k`` / ``attn2.to_v`` weights change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from emma.api.method import ErasureMethod
from emma.errors import ConfigError
from emma.methods._common import (
    attn2_modules,
    check_concepts,
    expand_others,
    for_concept,
    for_domain,
    plain,
    require_sd_pipeline,
)
from emma.methods.uce import UCEMethod, uce_closed_form


def rece_adversarial_embedding(
    weights: Sequence[torch.Tensor],
    original_weights: Sequence[torch.Tensor],
    embedding: torch.Tensor,
    *,
    regular_scale: float,
) -> torch.Tensor:
    """RECE's closed-form adversarial embedding, in float64.

    Args:
        weights: the edited projections ``W_l``, each ``(d_out_l, d_in)``.
        original_weights: the original projections ``W⁰_l``, same shapes.
        embedding: ``(T, d_in)`` token embeddings ``c`` of the concept prompt.
        regular_scale: γ, the pull of ``e'`` towards 0.

    Returns:
        ``(T, d_in)``: per token, ``argmin_e Σ_l |W_l e − W⁰_l c|² + γ |e|²``.
    """
    if len(weights) != len(original_weights) or not weights:
        raise ConfigError("RECE needs as many original as edited projections (at least one)")
    d_in = weights[0].shape[1]
    lhs = regular_scale * torch.eye(d_in, dtype=torch.float64, device=weights[0].device)
    rhs = torch.zeros(d_in, d_in, dtype=torch.float64, device=weights[0].device)
    for w, w0 in zip(weights, original_weights, strict=True):
        w, w0 = w.detach().double(), w0.detach().double().to(w.device)
        lhs = lhs + w.T @ w
        rhs = rhs + w.T @ w0
    # lhs e = rhs c for every token (lhs symmetric positive definite for γ > 0)
    return torch.linalg.solve(lhs, rhs @ embedding.detach().double().to(lhs.device).T).T


class RECEMethod(ErasureMethod):
    """Reliable and Efficient Concept Erasure (UCE + closed-form adversarial embeddings).

    Args:
        guide_concepts: per domain, what each concept is mapped to (a string or
            ``{concept: guide, _default: guide}``; ``""`` = the unconditional prompt).
        preserve_concepts: per domain, prompts whose key/value outputs are kept (the empty
            prompt is always added; ``"<others>"`` = the domain's other concepts).
        epochs: adversarial rounds after the UCE edit.
        lamb: λ of the adversarial rounds (pull towards the current weights).
        erase_scale / preserve_scale: weights of the erase and preserve terms of those rounds.
        regular_scale: γ of the adversarial embedding.
        uce_lamb: λ of the initial UCE edit.
        uce_preserve_scale: preserve scale of the initial UCE edit (``None``: UCE's rule).
        with_to_k: edit the key projections too.
    """

    name = "rece"
    version = "1"
    edited_components = ("unet",)

    def __init__(
        self,
        guide_concepts: Any = "",
        preserve_concepts: Any = None,
        epochs: int = 5,
        lamb: float = 0.1,
        erase_scale: float = 1.0,
        preserve_scale: float = 0.1,
        regular_scale: float = 1e-3,
        uce_lamb: float = 0.5,
        uce_preserve_scale: float | None = None,
        with_to_k: bool = True,
    ) -> None:
        if int(epochs) < 0:
            raise ConfigError(f"RECE epochs must be >= 0, got {epochs}")
        if float(regular_scale) <= 0 or float(lamb) < 0 or float(uce_lamb) < 0:
            raise ConfigError(f"RECE needs regular_scale > 0, lamb >= 0 and uce_lamb >= 0; got "
                              f"{regular_scale}, {lamb}, {uce_lamb}")
        super().__init__(
            guide_concepts=plain(guide_concepts), preserve_concepts=plain(preserve_concepts),
            epochs=int(epochs), lamb=float(lamb), erase_scale=float(erase_scale),
            preserve_scale=float(preserve_scale), regular_scale=float(regular_scale),
            uce_lamb=float(uce_lamb),
            uce_preserve_scale=None if uce_preserve_scale is None else float(uce_preserve_scale),
            with_to_k=bool(with_to_k),
        )

    def layers(self, pipe: Any) -> list[torch.nn.Linear]:
        """The edited projections: every ``attn2.to_v``, then every ``attn2.to_k``."""
        mods = attn2_modules(pipe.unet)
        return [m.to_v for _, m in mods] + ([m.to_k for _, m in mods] if self.hparams["with_to_k"] else [])

    def preserve_prompts(self, concepts: Sequence[str], domain: str | None) -> list[str]:
        pres = for_domain(self.hparams["preserve_concepts"], domain, what="RECE preserve_concepts") or []
        return [""] + [p for p in expand_others(pres, domain, concepts) if p != ""]

    @torch.no_grad()
    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: str | None = None) -> Any:
        """UCE, then ``epochs`` rounds of adversarial-embedding erasure (``seed`` is unused:
        every step is closed form)."""
        require_sd_pipeline(pipe, "RECE")
        concepts = check_concepts(concepts, pipe.tokenizer, method="RECE")
        hp = self.hparams
        guides = for_domain(hp["guide_concepts"], domain, what="RECE guide_concepts")
        guide_of = {}
        for c in concepts:
            g = for_concept(guides, c, what="RECE guide_concepts")
            if not isinstance(g, str):
                raise ConfigError(f"RECE guide for {c!r} must be a string, got {g!r}")
            guide_of[c] = g
        retain = self.preserve_prompts(concepts, domain)

        layers = self.layers(pipe)
        original = [layer.weight.detach().clone() for layer in layers]
        uce = UCEMethod(guide_concepts={"default": guide_of},
                        preserve_concepts=retain[1:], lamb=hp["uce_lamb"],
                        preserve_scale=hp["uce_preserve_scale"], with_to_k=hp["with_to_k"])
        try:
            uce.erase(pipe, concepts, domain=domain)
            c_emb = UCEMethod._embed(pipe, concepts)  # (N, T, D)
            # The reference maps an empty guide to " " (the start/end tokens only).
            g_emb = UCEMethod._embed(pipe, [guide_of[c] or " " for c in concepts])
            r_emb = UCEMethod._embed(pipe, retain).reshape(-1, c_emb.shape[-1])
            for _ in tqdm(range(hp["epochs"]), desc="RECE", disable=hp["epochs"] < 2, leave=False):
                current = [layer.weight.detach() for layer in layers]
                adv = torch.cat([rece_adversarial_embedding(current, original, c_emb[i],
                                                            regular_scale=hp["regular_scale"])
                                 for i in range(len(concepts))])
                guide = g_emb.reshape(-1, g_emb.shape[-1])
                new = []
                for w in current:
                    wd = w.double()
                    new.append(uce_closed_form(
                        w, adv.to(w.device), guide.to(wd) @ wd.T, r_emb.to(w.device), r_emb.to(wd) @ wd.T,
                        lamb=hp["lamb"], erase_scale=hp["erase_scale"], preserve_scale=hp["preserve_scale"]))
                if not all(torch.isfinite(w).all() for w in new):
                    raise ConfigError("RECE produced non-finite weights; raise lamb or regular_scale")
                for layer, w in zip(layers, new, strict=True):
                    layer.weight.copy_(w.to(layer.weight.dtype))
        except BaseException:
            for layer, w in zip(layers, original, strict=True):
                layer.weight.copy_(w)
            raise
        return pipe
