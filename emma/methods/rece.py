"""RECE — Reliable and Efficient Concept Erasure (Gong et al., ECCV 2024).

RECE starts from a UCE edit of the cross-attention keys and values (``attn2.to_k``,
``attn2.to_v``) and then repeats, ``epochs`` times, two closed-form steps:

1. **Adversarial embedding.** The text embedding that makes the *edited* projections
   reproduce what the *original* projections made of the concept,

       e' = argmin_e  Σ_l |W_l e − W⁰_l c|² + γ |e|²  =  (Σ_l W_lᵀW_l + γ I)⁻¹ (Σ_l W_lᵀ W⁰_l) c

   (the repository's "regzero" regularisation, γ = ``regular_scale``), per token of the
   concept prompt's full embedding ``c`` (every prompt the UCE edit erased: the concepts,
   and their template expansions with ``uce_add_prompts``): the embedding that would bring
   the concept back.
2. **Erase it.** The UCE closed form maps ``e'`` to the guide's outputs ``W_l g`` (or, with
   ``technique="tensor"``, those less their component along ``W_l e'``) while the preserve
   prompts keep ``W_l c_p`` and λ pulls towards the current weights:

       W_l ← (λ W_l + s_e Σ W_l g e'ᵀ + s_p Σ W_l c_p c_pᵀ)(λ I + s_e Σ e' e'ᵀ + s_p Σ c_p c_pᵀ)⁻¹

   With ``keep_erased`` the erased prompts join the preserve prompts (their current, erased
   outputs are kept), so the round cannot undo the UCE edit (not in the reference).

Defaults follow the reference code (CharlesGong12/RECE, ``train_object.py``): 1 epoch,
λ = 0.1, erase scale 1, preserve scale 0.1, γ = 1e-3, ``replace`` targets, keys and values
edited, the guide the unconditional prompt (``" "``), starting from UCE (the reference loads
a separately trained UCE model; here ``uce_*`` are that edit's UCE settings, by default UCE's
own: λ = 0.5, erase scale 1, ``replace``) towards the same guide. Only ``attn2.to_k`` /
``attn2.to_v`` weights change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

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
    require_sd_pipeline,
)
from emma.methods.uce import TECHNIQUES, UCEMethod, tensor_targets, uce_closed_form


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
        technique: targets of those rounds: ``replace`` (the guide's outputs) or ``tensor`` (the
            guide's outputs less their component along the adversarial embedding's, one unit
            direction over all tokens, as the reference's ``edit_model_adversarial``).
        keep_erased: the rounds also keep the current outputs of the prompts UCE erased (at
            ``preserve_scale``), so that erasing the adversarial embedding cannot undo their
            erasure; not in the reference (off by default).
        uce_lamb: λ of the initial UCE edit.
        uce_preserve_scale: preserve scale of the initial UCE edit (``None``: UCE's rule).
        uce_erase_scale / uce_technique / uce_add_prompts: erase scale, technique
            (``replace`` | ``tensor``) and template expansion of the initial UCE edit (UCE's
            ``erase_scale``, ``technique``, ``add_prompts``): the reference starts from a UCE
            checkpoint trained on its own, so this stage takes UCE's settings.
        with_to_k: edit the key projections too.
    """

    name = "rece"
    version = "2"
    edited_components = ("unet",)

    def __init__(
        self,
        guide_concepts: Any = "",
        preserve_concepts: Any = None,
        epochs: int = 1,
        lamb: float = 0.1,
        erase_scale: float = 1.0,
        preserve_scale: float = 0.1,
        regular_scale: float = 1e-3,
        uce_lamb: float = 0.5,
        uce_preserve_scale: float | None = None,
        technique: str = "replace",
        keep_erased: bool = False,
        uce_erase_scale: float = 1.0,
        uce_technique: str = "replace",
        uce_add_prompts: bool = False,
        with_to_k: bool = True,
    ) -> None:
        if int(epochs) < 0:
            raise ConfigError(f"RECE epochs must be >= 0, got {epochs}")
        if technique not in TECHNIQUES:
            raise UnknownChoiceError("RECE technique", technique, TECHNIQUES)
        if uce_technique not in TECHNIQUES:
            raise UnknownChoiceError("RECE uce_technique", uce_technique, TECHNIQUES)
        if float(regular_scale) <= 0 or float(lamb) < 0 or float(uce_lamb) < 0:
            raise ConfigError(f"RECE needs regular_scale > 0, lamb >= 0 and uce_lamb >= 0; got "
                              f"{regular_scale}, {lamb}, {uce_lamb}")
        super().__init__(
            guide_concepts=to_python(guide_concepts), preserve_concepts=to_python(preserve_concepts),
            epochs=int(epochs), lamb=float(lamb), erase_scale=float(erase_scale),
            preserve_scale=float(preserve_scale), regular_scale=float(regular_scale),
            uce_lamb=float(uce_lamb),
            uce_preserve_scale=None if uce_preserve_scale is None else float(uce_preserve_scale),
            technique=str(technique), keep_erased=bool(keep_erased),
            uce_erase_scale=float(uce_erase_scale), uce_technique=str(uce_technique),
            uce_add_prompts=bool(uce_add_prompts), with_to_k=bool(with_to_k),
        )

    def layers(self, pipe: Any) -> list[torch.nn.Linear]:
        """The edited projections: every ``attn2.to_v``, then every ``attn2.to_k``."""
        mods = attn2_modules(pipe.unet)
        return [m.to_v for _, m in mods] + ([m.to_k for _, m in mods] if self.hparams["with_to_k"] else [])

    def preserve_prompts(self, concepts: Sequence[str], domain: Domain | None) -> list[str]:
        pres = for_domain(self.hparams["preserve_concepts"], domain, what="RECE preserve_concepts") or []
        return [""] + [p for p in expand_others(pres, domain, concepts) if p != ""]

    @torch.no_grad()
    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
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
                        preserve_scale=hp["uce_preserve_scale"], with_to_k=hp["with_to_k"],
                        erase_scale=hp["uce_erase_scale"], technique=hp["uce_technique"],
                        add_prompts=hp["uce_add_prompts"])
        try:
            uce.erase(pipe, concepts, domain=domain)
            # The prompts UCE erased (the concepts, plus their template expansions with
            # uce_add_prompts), each with its guide; the reference maps an empty guide to " ".
            pairs = uce.edit_pairs(concepts, domain)
            c_emb = UCEMethod._embed(pipe, [old for old, _ in pairs])  # (N, T, D)
            g_emb = UCEMethod._embed(pipe, [new or " " for _, new in pairs])
            r_emb = UCEMethod._embed(pipe, retain).reshape(-1, c_emb.shape[-1])
            # Kept outputs of the rounds: the preserve prompts, and with keep_erased the erased
            # prompts themselves (all their tokens), at what the current weights make of them.
            keep = torch.cat([r_emb, c_emb.reshape(-1, c_emb.shape[-1])]) if hp["keep_erased"] else r_emb
            for _ in tqdm(range(hp["epochs"]), desc="RECE", disable=hp["epochs"] < 2, leave=False):
                current = [layer.weight.detach() for layer in layers]
                adv = torch.cat([rece_adversarial_embedding(current, original, c_emb[i],
                                                            regular_scale=hp["regular_scale"])
                                 for i in range(len(pairs))])
                guide = g_emb.reshape(-1, g_emb.shape[-1])
                new = []
                for w in current:
                    wd = w.double()
                    targets = guide.to(wd) @ wd.T
                    if hp["technique"] == "tensor":
                        # one span per erased prompt: all its T tokens
                        targets = tensor_targets(adv.to(wd) @ wd.T, targets, [c_emb.shape[1]] * len(pairs))
                    new.append(uce_closed_form(
                        w, adv.to(w.device), targets, keep.to(w.device), keep.to(wd) @ wd.T,
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

