"""MACE — Mass Concept Erasure (Lu et al., CVPR 2024).

Three stages, all on the cross-attention key/value projections (``attn2.to_k``/``to_v``):

1. **Closed-form refinement (CFR).** Prompts that contain the concept ("a photo of the
   circle", ...) are paired with the same prompts naming the mapping concept. For the tokens
   the two prompts share (the words around the concept, the end/padding tokens) the
   projections are re-solved so that ``W c_concept-prompt ≈ W_old c_mapping-prompt``:
   ``W = (λ W + Σ v cᵀ + s P₁)(λ I + Σ c cᵀ + s P₂)⁻¹`` (``P`` = preservation statistics).
2. **One LoRA per concept.** On the refined UNet, a rank-``rank`` LoRA on every
   ``attn2.to_k``/``to_v`` is trained to drive the attention probabilities of the concept's
   tokens (and, with ``use_pooler``, the end-of-text tokens) to zero inside the concept's
   mask on images the model drew of it.
3. **Closed-form fusion.** All LoRAs are fused into one weight per projection by the same
   closed form, with each LoRA's outputs as targets on its concept's prompts.

The masks come from Grounded-SAM in the paper. Here the segmenter is pluggable
(``segmenter``): ``grounded_sam`` (GroundingDINO + SAM through ``transformers``; needs their
weights), ``attention`` (the documented fallback: the model's own cross-attention map of the
concept tokens on the image it drew, normalised and thresholded — no extra weights),
``none`` (the whole image, MACE's own setting for styles), ``auto`` (``grounded_sam`` when
its weights are on this machine, else ``attention``; the choice is resolved when the method
is built and recorded in :meth:`config`), or any callable ``(images, labels) -> masks``.

Defaults follow the MACE repository's object configuration (``configs/object``): λ = 1e3,
no preservation term, LoRA rank 1, AdamW 1e-5 for 50 steps, batch 1, relation-focal
importance sampling of timesteps, 8 training images per concept (30 steps, guidance 7.5),
30 of MACE's own prompt templates (``"<data:mace_templates_object>"`` /
``"<data:mace_templates_style>"``, pinned downloads), Grounded-SAM masks. Its celebrity, art
and explicit-content configurations (``conf/preset/method_domain/mace_sd_*.yaml``) set λ = 0
and preserve prior knowledge: the statistics ``Σ (W c) cᵀ`` and ``Σ c cᵀ`` over every token of
COCO captions (``prior_prompts``; the reference sums all 616,767 COCO-2014 captions, here a
pinned 30,000-caption subset rescaled to that count by ``prior_prompt_count``) plus
``preserve_weight`` times those of the domain's other concepts in the templates
(``preserve_concepts``: the reference's domain cache), weighted by ``train_preserve_scale``
and ``fuse_preserve_scale`` in the two closed forms. Card: ``docs/protocols/methods/mace.md``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.datasets.download import is_offline
from emma.errors import ConfigError, UnknownChoiceError, WeightsUnavailableError
from emma.methods._common import (
    Attn2Processor,
    CrossAttnRecorder,
    LoRADelta,
    attention_side,
    attn2_modules,
    attn2_processors,
    autocast,
    check_concepts,
    concept_positions,
    cpu_generator,
    decode_latents,
    domain_hparams,
    domain_name,
    encode_text,
    expand_others,
    for_concept,
    for_domain,
    fp32_training,
    generate_latents,
    is_style_domain,
    mace_importance_weights,
    randint,
    randn,
    require_sd_pipeline,
    token_ids,
    training_scheduler,
)
from emma.methods.uce import uce_closed_form

logger = logging.getLogger(__name__)

SEGMENTERS = ("auto", "grounded_sam", "attention", "none")
POOLERS = ("all", "first")
GROUNDING_DINO_ID = "IDEA-Research/grounding-dino-tiny"  # Swin-T OGC, the checkpoint MACE uses
SAM_ID = "facebook/sam-vit-huge"

# Prompt augmentation (30 templates per kind, as many as MACE's ``prompt_len``).
OBJECT_TEMPLATES: tuple[str, ...] = (
    "a photo of {}", "{} in a photo", "a snapshot of {}", "a picture of {}", "an image of {}",
    "an illustration of {}", "a digital rendering of {}", "a drawing of {}", "a sketch of {}",
    "a painting of {}", "a close-up photo of {}", "a black and white photo of {}", "a graphic of {}",
    "a detailed photo of {}", "a shot of {}", "{} captured in an image", "a rendering of {}",
    "an old photo of {}", "a high resolution photo of {}", "a cartoon of {}", "a poster of {}",
    "{} in a sketch", "a watercolor of {}", "an oil painting of {}", "a blurry photo of {}",
    "a bright photo of {}", "a cropped photo of {}", "a good photo of {}", "a toy {}", "a small {}",
)
STYLE_TEMPLATES: tuple[str, ...] = (
    "an artwork by {}", "a painting by {}", "art by {}", "a drawing by {}", "a sketch by {}",
    "an illustration by {}", "a picture in the style of {}", "a landscape in the style of {}",
    "a portrait in the style of {}", "a still life by {}", "{}'s famous painting", "a piece by {}",
    "a digital artwork by {}", "a masterpiece by {}", "an image in the style of {}",
    "a city painted by {}", "a mural by {}", "a print by {}", "a poster by {}", "an early work by {}",
    "a late work by {}", "a study by {}", "a painting of flowers by {}", "a painting of a river by {}",
    "a painting of a house by {}", "a painting of a dog by {}", "a painting of the sea by {}",
    "a painting of a tree by {}", "a painting of a street by {}", "art in the style of {}",
)


# --------------------------------------------------------------------------- segmenters
def grounded_sam_available() -> bool:
    """Whether GroundingDINO and SAM weights are in this machine's Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return False
    for repo in (GROUNDING_DINO_ID, SAM_ID):
        hit = try_to_load_from_cache(repo, "config.json")
        if not isinstance(hit, str) or not os.path.exists(hit):
            return False
    return True


class GroundedSAMSegmenter:
    """Text-prompted masks: GroundingDINO boxes -> SAM masks (the MACE data preparation).

    Args:
        detector_id / segmenter_id: Hugging Face model ids (``transformers`` classes).
        box_threshold / text_threshold: detection thresholds (MACE's get_mask: 0.3 / 0.25).
        device: torch device.
    """

    def __init__(self, detector_id: str = GROUNDING_DINO_ID, segmenter_id: str = SAM_ID,
                 box_threshold: float = 0.3, text_threshold: float = 0.25, device: str | None = None) -> None:
        from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor, SamModel, SamProcessor

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.box_threshold, self.text_threshold = float(box_threshold), float(text_threshold)
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        try:
            self.det_proc = AutoProcessor.from_pretrained(detector_id, local_files_only=offline)
            self.det = AutoModelForZeroShotObjectDetection.from_pretrained(
                detector_id, local_files_only=offline).to(self.device).eval()
            self.sam_proc = SamProcessor.from_pretrained(segmenter_id, local_files_only=offline)
            self.sam = SamModel.from_pretrained(segmenter_id, local_files_only=offline).to(self.device).eval()
        except (OSError, ValueError) as err:
            raise WeightsUnavailableError(
                f"MACE segmenter=grounded_sam needs {detector_id} and {segmenter_id} "
                f"(`huggingface-cli download {detector_id}` and `... {segmenter_id}` where the Hub is "
                f"reachable); or use method.segmenter=attention (no extra weights). Cause: {err}"
            ) from None

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, labels: Sequence[str]) -> torch.Tensor:
        from PIL import Image

        masks = []
        for img, label in zip(images, labels, strict=True):
            pil = Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
            text = label.lower().strip().rstrip(".") + "."
            inputs = self.det_proc(images=pil, text=text, return_tensors="pt").to(self.device)
            out = self.det(**inputs)
            res = self.det_proc.post_process_grounded_object_detection(
                out, inputs.input_ids, threshold=self.box_threshold, text_threshold=self.text_threshold,
                target_sizes=[pil.size[::-1]])[0]
            boxes = res["boxes"].tolist()
            h, w = img.shape[-2:]
            if not boxes:  # nothing found: fall back to the whole image rather than no signal
                masks.append(torch.ones(h, w, dtype=torch.bool))
                continue
            sam_in = self.sam_proc(images=pil, input_boxes=[boxes], return_tensors="pt").to(self.device)
            pred = self.sam(**sam_in, multimask_output=False)
            m = self.sam_proc.image_processor.post_process_masks(
                pred.pred_masks.cpu(), sam_in["original_sizes"].cpu(),
                sam_in["reshaped_input_sizes"].cpu())[0]
            masks.append(m.reshape(-1, h, w).any(0))
        return torch.stack(masks)


# --------------------------------------------------------------------------- method
class MACEMethod(ErasureMethod):
    """Mass Concept Erasure: closed-form refinement + one LoRA per concept + closed-form fusion.

    Args:
        mapping_concepts: per domain, the concept each erased concept is mapped to (a string
            or ``{concept: mapping, _default: mapping}``); a mapping may be a list of concepts,
            whose outputs the refinement averages (the erased concept is left out of it).
        prompt_templates: per domain, prompt templates with ``{}`` for the concept (``None``
            or a missing domain -> MACE's object templates, or its style templates for style
            domains).
        data_prompts: per domain, the template of the prompt that draws the training images.
        num_images: training images drawn per concept (MACE: 8).
        aug_length: templates used per concept (MACE: 30 of ``prompt_len``).
        prompt_len: templates drawn from (the first ``prompt_len`` of the list; ``None``: all).
        lamb: λ of both closed forms.
        all_words: the reference's ``all_words`` switch of the refinement: map every token of
            the concept prompt (the concept's own tokens too, position by position) onto the
            mapping prompt's, instead of only the tokens the two prompts share.
        train_preserve_scale / fuse_preserve_scale: weights of the preservation statistics in
            the two closed forms.
        prior_prompts: per domain, prompts whose statistics (every token) are preserved — MACE's
            prior cache of COCO captions (``"<data:coco_captions_30k>"``) — or ``None``.
        prior_prompt_count: rescale the prior statistics to this many prompts (the reference
            sums 616,767 captions; ``None``: as many as given).
        preserve_concepts: per domain, concepts (``"<others>"``: the domain's other concepts)
            whose prompts in the domain's templates form MACE's domain cache.
        preserve_weight: weight of the domain cache against the prior cache.
        learning_rate / max_train_steps / train_batch_size / adam_weight_decay /
            max_grad_norm: LoRA training (AdamW).
        rank: LoRA rank.
        importance_sampling: draw timesteps from MACE's density peaked in 200..400.
        use_pooler: include end-of-text tokens in the attention loss.
        pooler: which end-of-text tokens ``use_pooler`` adds: ``all`` (every token equal to
            end-of-text — with SD v1.x's tokenizer, whose padding is end-of-text, every position
            after the prompt, as the reference does on SD v1.4) or ``first`` (the end token only).
        segmenter: ``auto``, ``grounded_sam``, ``attention``, ``none`` or a callable.
        attention_mask_threshold: threshold of the normalised attention map (``attention``).
        sample_steps / sample_guidance: sampler settings for the training images.
        domain_overrides: per domain, hyper-parameters of the reference configuration for that
            domain (e.g. ``{celebrity: {learning_rate: 1e-4}}``).
        progress: show progress bars (not a hyper-parameter).
    """

    name = "mace"
    version = "2"
    edited_components = ("unet",)

    def __init__(
        self,
        mapping_concepts: Any = "sky",
        prompt_templates: Any = None,
        data_prompts: Any = "a photo of the {}",
        num_images: int = 8,
        aug_length: int = 30,
        prompt_len: int | None = None,
        lamb: float = 1e3,
        all_words: bool = False,
        train_preserve_scale: float = 0.0,
        fuse_preserve_scale: float = 0.0,
        prior_prompts: Any = None,
        prior_prompt_count: int | None = None,
        preserve_concepts: Any = None,
        preserve_weight: float = 0.0,
        learning_rate: float = 1e-5,
        max_train_steps: int = 50,
        train_batch_size: int = 1,
        adam_weight_decay: float = 0.01,
        max_grad_norm: float = 1.0,
        rank: int = 1,
        importance_sampling: bool = True,
        use_pooler: bool = True,
        pooler: str = "all",
        segmenter: Any = "auto",
        attention_mask_threshold: float = 0.5,
        sample_steps: int = 30,
        sample_guidance: float = 7.5,
        domain_overrides: Any = None,
        progress: bool = True,
    ) -> None:
        self._segmenter_fn: Callable | None = None
        if callable(segmenter):
            self._segmenter_fn = segmenter
            segmenter = f"callable:{getattr(segmenter, '__qualname__', type(segmenter).__name__)}"
        elif segmenter not in SEGMENTERS:
            raise UnknownChoiceError("MACE segmenter", str(segmenter), SEGMENTERS)
        elif segmenter == "grounded_sam" and is_offline() and not grounded_sam_available():
            # Refused when the method is built (the cell's setup), not after its images are drawn.
            raise WeightsUnavailableError(
                f"MACE segmenter=grounded_sam needs {GROUNDING_DINO_ID} and {SAM_ID}, which are not in this "
                f"machine's Hugging Face cache and downloads are off (HF_HUB_OFFLINE/EMMA_OFFLINE): run "
                f"`huggingface-cli download {GROUNDING_DINO_ID}` and `huggingface-cli download {SAM_ID}` where "
                "the Hub is reachable, or choose method.segmenter=attention (no extra weights)")
        elif segmenter == "auto":
            # Resolved now so that the erased-model cache key says which masks were used.
            segmenter = "grounded_sam" if grounded_sam_available() else "attention"
            if segmenter == "attention":
                logger.warning("MACE segmenter=auto: GroundingDINO/SAM weights are not on this machine, so the "
                               "masks are the model's own cross-attention maps (recorded as segmenter=attention); "
                               "the reference uses Grounded-SAM")
        if pooler not in POOLERS:
            raise UnknownChoiceError("MACE pooler", str(pooler), POOLERS)
        if int(rank) < 1 or int(num_images) < 1 or int(aug_length) < 1:
            raise ConfigError("MACE needs rank, num_images and aug_length >= 1")
        if prompt_len is not None and int(prompt_len) < int(aug_length):
            raise ConfigError(f"MACE prompt_len ({prompt_len}) must be at least aug_length ({aug_length}), or null")
        if prior_prompt_count is not None and int(prior_prompt_count) < 1:
            raise ConfigError(f"MACE prior_prompt_count must be >= 1 or null, got {prior_prompt_count}")
        super().__init__(
            mapping_concepts=to_python(mapping_concepts), prompt_templates=to_python(prompt_templates),
            data_prompts=to_python(data_prompts), num_images=int(num_images), aug_length=int(aug_length),
            prompt_len=None if prompt_len is None else int(prompt_len),
            lamb=float(lamb), all_words=bool(all_words), train_preserve_scale=float(train_preserve_scale),
            fuse_preserve_scale=float(fuse_preserve_scale), prior_prompts=to_python(prior_prompts),
            prior_prompt_count=None if prior_prompt_count is None else int(prior_prompt_count),
            preserve_concepts=to_python(preserve_concepts), preserve_weight=float(preserve_weight),
            learning_rate=float(learning_rate), max_train_steps=int(max_train_steps),
            train_batch_size=int(train_batch_size), adam_weight_decay=float(adam_weight_decay),
            max_grad_norm=float(max_grad_norm), rank=int(rank), importance_sampling=bool(importance_sampling),
            use_pooler=bool(use_pooler), pooler=str(pooler), segmenter=segmenter,
            attention_mask_threshold=float(attention_mask_threshold), sample_steps=int(sample_steps),
            sample_guidance=float(sample_guidance), domain_overrides=to_python(domain_overrides),
        )
        self.progress = bool(progress)

    # ------------------------------------------------------------------ prompts
    def templates(self, hp: dict[str, Any], domain: Domain | None) -> list[str]:
        table = hp["prompt_templates"] or {}
        if isinstance(table, dict) and (domain_name(domain) in table or "default" in table):
            out = list(for_domain(table, domain, what="MACE prompt_templates"))
        elif isinstance(table, list):
            out = list(table)
        else:
            out = list(STYLE_TEMPLATES if is_style_domain(domain) else OBJECT_TEMPLATES)
        if hp.get("prompt_len") is not None:
            out = out[: hp["prompt_len"]]
        bad = [t for t in out if t.count("{}") != 1]
        if bad or not out:
            raise ConfigError("MACE prompt_templates need exactly one '{}' each; "
                              f"bad: {bad or 'empty list'}")
        return out

    # ------------------------------------------------------------------ erase
    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Erase ``concepts`` from ``pipe.unet``'s cross-attention keys/values in place."""
        require_sd_pipeline(pipe, "MACE")
        concepts = check_concepts(concepts, pipe.tokenizer, method="MACE")
        hp = domain_hparams({k: v for k, v in self.hparams.items() if k != "domain_overrides"},
                            self.hparams["domain_overrides"], domain)
        gen = cpu_generator(seed)
        mappings = for_domain(hp["mapping_concepts"], domain, what="MACE mapping_concepts")
        data_prompt = for_domain(hp["data_prompts"], domain, what="MACE data_prompts")
        templates = self.templates(hp, domain)

        # Per concept: (instance prompt, mapped prompt) pairs from a seeded template choice.
        pairs: dict[str, list[tuple[str, str]]] = {}
        for c in concepts:
            ms = mapping_list(for_concept(mappings, c, what="MACE mapping_concepts"), c)
            order = torch.randperm(len(templates), generator=gen)[: hp["aug_length"]].tolist()
            pairs[c] = [(templates[i].format(c), templates[i].format(m)) for i in order for m in ms]

        # Training images (and masks) are drawn by the model before it is edited.
        data = {}
        for c in concepts:
            seeds = [randint(2**31 - 1, gen) for _ in range(hp["num_images"])]
            prompt = data_prompt.format(c)
            latents = generate_latents(pipe, [prompt] * len(seeds), seeds,
                                       num_inference_steps=hp["sample_steps"],
                                       guidance_scale=hp["sample_guidance"], progress=self.progress,
                                       desc=f"MACE data ({c})")
            masks = self._masks(pipe, latents, c, prompt, hp, domain, gen)
            data[c] = (latents, masks)

        modules = [m for _, m in attn2_modules(pipe.unet)]
        layers = [m.to_v for m in modules] + [m.to_k for m in modules]
        originals = [lay.weight.detach().clone() for lay in layers]
        pres_stats = self._preserve_stats(pipe, hp, domain, concepts, layers, templates)
        try:
            # Stage 1: closed-form refinement.
            self._refine(pipe, pairs, layers, pres_stats, hp)
            # Stage 2: one LoRA per concept, on the refined UNet.
            deltas = {c: self._train_lora(pipe, c, pairs[c], data[c], hp, gen) for c in concepts}
            # Stage 3: closed-form fusion of all LoRAs.
            self._fuse(pipe, pairs, deltas, layers, pres_stats, hp)
        except BaseException:
            with torch.no_grad():
                for lay, w in zip(layers, originals, strict=True):
                    lay.weight.copy_(w)
            raise
        return pipe

    # ------------------------------------------------------------------ stage 1
    @torch.no_grad()
    def _refine(self, pipe: Any, pairs: dict[str, list[tuple[str, str]]], layers: list, pres_stats: list,
                hp: dict[str, Any]) -> None:
        contexts, targets_emb = [], []
        for plist in pairs.values():
            # A prompt with k mappings has k pairs, each weighted 1/k (both sides scaled by
            # 1/sqrt(k)): the solve fits the mean of its mappings' outputs, at the weight of one.
            count: dict[str, int] = {}
            for old, _ in plist:
                count[old] = count.get(old, 0) + 1
            for old, new in plist:
                emb = encode_text(pipe, [old, new]).double() / count[old] ** 0.5
                if hp["all_words"]:  # every position, the concept's tokens included
                    oi = ni = list(range(emb.shape[1]))
                else:
                    oi, ni = matching_token_indices(pipe.tokenizer, old, new)
                contexts.append(emb[0, oi])
                targets_emb.append(emb[1, ni])
        c = torch.cat(contexts)
        t = torch.cat(targets_emb)
        new = []
        for lay, (p1, p2) in zip(layers, pres_stats, strict=True):
            w = lay.weight.detach()
            v = t.to(w.device) @ w.double().T
            new.append(_closed_form_with_stats(w, c.to(w.device), v, hp["lamb"],
                                               hp["train_preserve_scale"], p1, p2))
        for lay, w in zip(layers, new, strict=True):
            lay.weight.copy_(w.to(lay.weight.dtype))

    # ------------------------------------------------------------------ stage 2
    def _train_lora(self, pipe: Any, concept: str, plist: list[tuple[str, str]],
                    data: tuple[torch.Tensor, torch.Tensor | None], hp: dict[str, Any],
                    gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        unet = pipe.unet
        device, dtype = unet.device, unet.dtype
        latents_all, masks_all = data
        sched = training_scheduler(pipe)
        n_t = sched.config.num_train_timesteps
        weights = mace_importance_weights(n_t) if hp["importance_sampling"] else None
        prompts = list(dict.fromkeys(old for old, _ in plist))
        embs = encode_text(pipe, prompts)
        positions = torch.stack([concept_positions(pipe.tokenizer, p, concept, use_pooler=hp["use_pooler"],
                                                   pooler=hp["pooler"])
                                 for p in prompts])
        loras: dict[str, tuple[LoRADelta, LoRADelta]] = {}
        for name, m in attn2_modules(unet):
            loras[name] = (
                LoRADelta(m.to_k.in_features, m.to_k.out_features, hp["rank"], gen).to(device),
                LoRADelta(m.to_v.in_features, m.to_v.out_features, hp["rank"], gen).to(device),
            )
        params = [p for pair in loras.values() for lo in pair for p in lo.parameters()]
        opt = torch.optim.AdamW(params, lr=hp["learning_rate"], betas=(0.9, 0.999),
                                weight_decay=hp["adam_weight_decay"], eps=1e-8)
        state: dict[str, Any] = {"terms": []}
        latent_hw = latents_all.shape[-2:]

        def record(name: str, probs: torch.Tensor, batch: int) -> None:
            heads = probs.shape[0] // batch
            pos = state["positions"].to(probs.device)  # (B, L)
            sel = []
            for b in range(batch):
                p = probs[b * heads : (b + 1) * heads][:, :, pos[b]]  # (heads, Q, n_pos)
                if state["masks"] is not None:
                    hq, wq = attention_side(p.shape[1], *latent_hw)
                    mk = F.interpolate(state["masks"][b : b + 1, None].float(), size=(hq, wq), mode="nearest")
                    p = p[:, mk.reshape(-1).to(p.device) > 0.5]
                sel.append(p.reshape(-1))
            state["terms"].append(torch.cat(sel).float().norm())

        recorder = CrossAttnRecorder(record)
        bs = hp["train_batch_size"]
        order: list[int] = []
        with fp32_training(unet), attn2_processors(
            unet, lambda n, m: Attn2Processor(n, recorder, *loras[n])
        ):
            unet.requires_grad_(False)  # only the LoRA deltas train: no gradients for the UNet's weights
            bar = tqdm(range(hp["max_train_steps"]), desc=f"MACE LoRA ({concept})", disable=not self.progress)
            for _ in bar:
                idx = []
                for _ in range(bs):
                    if not order:  # a fresh shuffle per epoch, like the reference data loader
                        order = torch.randperm(len(latents_all), generator=gen).tolist()
                    idx.append(order.pop())
                pidx = [randint(len(prompts), gen) for _ in idx]
                x0 = latents_all[idx].to(device, torch.float32)
                noise = randn(x0.shape, gen, like=x0)
                if weights is not None:
                    t = torch.multinomial(weights, len(idx), replacement=True, generator=gen)
                else:
                    t = torch.randint(0, n_t, (len(idx),), generator=gen)
                t = t.to(device)
                xt = sched.add_noise(x0, noise, t)
                state["positions"] = positions[pidx]
                state["masks"] = None if masks_all is None else masks_all[idx]
                state["terms"] = []
                with autocast(device, dtype):
                    unet(xt, t, encoder_hidden_states=embs[pidx].to(device, torch.float32))
                loss = torch.stack(state["terms"]).sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, hp["max_grad_norm"])
                opt.step()
                bar.set_postfix(loss=f"{loss.item():.4g}")
        return {n: (k.delta_weight().detach(), v.delta_weight().detach()) for n, (k, v) in loras.items()}

    # ------------------------------------------------------------------ stage 3
    @torch.no_grad()
    def _fuse(self, pipe: Any, pairs: dict[str, list[tuple[str, str]]],
              deltas: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]], layers: list,
              pres_stats: list, hp: dict[str, Any]) -> None:
        names = [n for n, _ in attn2_modules(pipe.unet)]
        # Layer order is [to_v of each module..., to_k of each module...].
        lora_delta = {c: [deltas[c][n][1] for n in names] + [deltas[c][n][0] for n in names] for c in deltas}
        embs = {c: encode_text(pipe, list(dict.fromkeys(old for old, _ in plist))).double()
                .reshape(-1, layers[0].in_features) for c, plist in pairs.items()}
        new = []
        for li, (lay, (p1, p2)) in enumerate(zip(layers, pres_stats, strict=True)):
            w = lay.weight.detach().double()
            cs, vs = [], []
            for c in pairs:
                ctx = embs[c].to(w.device)
                vs.append(ctx @ (w + lora_delta[c][li].to(w)).T)
                cs.append(ctx)
            new.append(_closed_form_with_stats(lay.weight, torch.cat(cs), torch.cat(vs), hp["lamb"],
                                               hp["fuse_preserve_scale"], p1, p2))
        for lay, w in zip(layers, new, strict=True):
            lay.weight.copy_(w.to(lay.weight.dtype))

    # ------------------------------------------------------------------ helpers
    @torch.no_grad()
    def _preserve_stats(self, pipe: Any, hp: dict[str, Any], domain: Domain | None, concepts: Sequence[str],
                        layers: list, templates: Sequence[str]) -> list[tuple[torch.Tensor | None, ...]]:
        """Per layer ``(W P, P)`` with ``P = Σ c cᵀ`` over every token of the prior prompts
        (rescaled to ``prior_prompt_count``) plus ``preserve_weight`` times that of the domain
        cache's prompts (``preserve_concepts`` in ``templates``), or ``(None, None)`` when
        nothing is preserved. ``Σ (W c) cᵀ = W P``: MACE's cached ``for_mat1`` / ``for_mat2``."""
        none = [(None, None)] * len(layers)
        if hp["train_preserve_scale"] == 0 and hp["fuse_preserve_scale"] == 0:
            return none
        total = None
        prior = for_domain(hp["prior_prompts"], domain, what="MACE prior_prompts") or []
        prior = [prior] if isinstance(prior, str) else list(prior)
        if prior:
            total = _token_gram(pipe, prior, layers[0].in_features)
            if hp["prior_prompt_count"] is not None:
                total *= hp["prior_prompt_count"] / len(prior)
        names = expand_others(for_domain(hp["preserve_concepts"], domain, what="MACE preserve_concepts") or [],
                              domain, concepts)
        if names and hp["preserve_weight"] != 0:
            gram = _token_gram(pipe, [t.format(n) for n in names for t in templates], layers[0].in_features)
            total = hp["preserve_weight"] * gram if total is None else total + hp["preserve_weight"] * gram
        if total is None:
            return none
        out = []
        for lay in layers:
            w = lay.weight.detach().double()
            p = total.to(w.device)
            out.append((w @ p, p))
        return out

    def _masks(self, pipe: Any, latents: torch.Tensor, concept: str, prompt: str, hp: dict[str, Any],
               domain: Domain | None, gen: torch.Generator) -> torch.Tensor | None:
        """Masks (N, h, w) at latent resolution, or ``None`` for the whole image."""
        kind = hp["segmenter"]
        if kind == "none":
            return None
        if kind == "attention":
            return attention_masks(pipe, latents, prompt, concept, hp["attention_mask_threshold"], gen)
        images = decode_latents(pipe, latents)
        seg = self._segmenter_fn if self._segmenter_fn is not None else GroundedSAMSegmenter()
        masks = torch.as_tensor(seg(images, [concept] * len(images))).bool()
        if masks.shape != (len(images), *images.shape[-2:]):
            raise ConfigError(f"MACE segmenter returned masks of shape {tuple(masks.shape)}; expected "
                              f"{(len(images), *images.shape[-2:])}")
        return F.interpolate(masks[:, None].float(), size=latents.shape[-2:], mode="nearest")[:, 0] > 0.5


@torch.no_grad()
def _token_gram(pipe: Any, prompts: Sequence[str], dim: int, chunk: int = 256) -> torch.Tensor:
    """``Σ c cᵀ`` (float64, ``dim × dim``) over every token (padding included, as MACE's caches)
    of the prompts' text-encoder outputs, in chunks."""
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    for s in range(0, len(prompts), chunk):
        c = encode_text(pipe, list(prompts[s : s + chunk])).double().reshape(-1, dim).cpu()
        gram += c.T @ c
    return gram


def _closed_form_with_stats(weight: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lamb: float,
                            preserve_scale: float, p1: torch.Tensor | None,
                            p2: torch.Tensor | None) -> torch.Tensor:
    if p1 is None or preserve_scale == 0:
        empty_k = keys.new_zeros((0, keys.shape[1]))
        empty_v = values.new_zeros((0, values.shape[1]))
        w = uce_closed_form(weight, keys, values, empty_k, empty_v, lamb=lamb, erase_scale=1.0,
                            preserve_scale=0.0)
    else:
        wd = weight.detach().double()
        eye = torch.eye(wd.shape[1], dtype=torch.float64, device=wd.device)
        mat1 = lamb * wd + values.double().T @ keys.double() + preserve_scale * p1.to(wd)
        mat2 = lamb * eye + keys.double().T @ keys.double() + preserve_scale * p2.to(wd)
        w = torch.linalg.solve(mat2, mat1.T).T
    if not torch.isfinite(w).all():
        raise ConfigError("MACE closed form produced non-finite weights; raise lamb above 0")
    return w


def mapping_list(mapping: Any, concept: str) -> list[str]:
    """A concept's mapping concepts: one string, or a list (the erased concept itself dropped,
    so that ``${emma.other_concepts:...}`` or a whole domain's list can be given)."""
    if isinstance(mapping, str):
        return [mapping]
    out = [str(m) for m in (mapping or []) if str(m).lower() != concept.lower()]
    if not out:
        raise ConfigError(f"MACE mapping_concepts for {concept!r} is empty; give a concept or a list of "
                          f"concepts other than the erased one, got {mapping!r}")
    return out


def matching_token_indices(tokenizer: Any, old: str, new: str) -> tuple[list[int], list[int]]:
    """Indices of the tokens two prompts share — a common prefix and a common suffix (which
    includes the end token) — extended over the padding so both lists have equal length."""
    a = [tokenizer.bos_token_id] + token_ids(tokenizer, old) + [tokenizer.eos_token_id]
    b = [tokenizer.bos_token_id] + token_ids(tokenizer, new) + [tokenizer.eos_token_id]
    n = int(tokenizer.model_max_length)
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    ea, eb = len(a) - 1, len(b) - 1
    while ea >= start and eb >= start and a[ea] == b[eb]:
        ea -= 1
        eb -= 1
    oi = list(range(start)) + list(range(ea + 1, len(a)))
    ni = list(range(start)) + list(range(eb + 1, len(b)))
    shift = oi[-1] - ni[-1]
    if shift >= 0:
        oi += list(range(oi[-1] + 1, n))
        ni += list(range(ni[-1] + 1, n - shift))
    else:
        ni += list(range(ni[-1] + 1, n))
        oi += list(range(oi[-1] + 1, n + shift))
    return oi, ni


@torch.no_grad()
def attention_masks(pipe: Any, latents: torch.Tensor, prompt: str, concept: str, threshold: float,
                    gen: torch.Generator, fractions: Sequence[float] = (0.3, 0.5, 0.7)) -> torch.Tensor:
    """The fallback segmenter: where the model attends to the concept's tokens.

    Each drawn latent is re-noised at a few timesteps (``fractions`` of the schedule) and
    denoised once with ``prompt``; the cross-attention probabilities of the concept's tokens
    are averaged over heads, layers (resized to the latent grid) and timesteps, scaled to
    [0, 1] per image and thresholded.
    """
    unet = pipe.unet
    device, dtype = unet.device, unet.dtype
    sched = training_scheduler(pipe)
    n_t = sched.config.num_train_timesteps
    pos = concept_positions(pipe.tokenizer, prompt, concept, use_pooler=False)
    emb = encode_text(pipe, [prompt]).to(device, dtype)
    hw = latents.shape[-2:]
    acc = torch.zeros(len(latents), *hw)
    maps: list[torch.Tensor] = []

    def record(name: str, probs: torch.Tensor, batch: int) -> None:
        heads = probs.shape[0] // batch
        p = probs[:, :, pos.to(probs.device)].float().mean(-1)  # (B*heads, Q)
        p = p.reshape(batch, heads, -1).mean(1)
        h, w = attention_side(p.shape[-1], *hw)
        maps.append(F.interpolate(p.reshape(batch, 1, h, w), size=hw, mode="bilinear").cpu()[:, 0])

    recorder = CrossAttnRecorder(record)
    with attn2_processors(unet, lambda n, m: Attn2Processor(n, recorder)):
        for f in fractions:
            t = torch.full((len(latents),), int(f * (n_t - 1)), dtype=torch.long)
            x0 = latents.to(device, torch.float32)
            xt = sched.add_noise(x0, randn(x0.shape, gen, like=x0), t.to(device))
            maps.clear()
            unet(xt.to(dtype), t.to(device), encoder_hidden_states=emb.expand(len(latents), -1, -1))
            acc += torch.stack(maps).mean(0)
    lo = acc.flatten(1).min(1).values[:, None, None]
    hi = acc.flatten(1).max(1).values[:, None, None]
    norm = (acc - lo) / (hi - lo).clamp_min(1e-12)
    return norm >= threshold
