"""FMN — Forget-Me-Not (Zhang et al., 2023): attention re-steering.

On images of the concept (drawn by the model itself) noised at a random timestep, the UNet
is run with a prompt naming the concept, and the loss is the norm of the cross-attention
probabilities that the image's pixels put on the concept's tokens (and, with ``use_pooler``,
on the end-of-text token), over every cross-attention layer. Minimising it teaches the model
to ignore the concept's words; there is no replacement concept.

With ``use_ti`` (the repository's configuration), a textual-inversion stage runs first: for
each concept, ``num_tokens_ti`` new token vectors are learned on the same images with the
standard diffusion loss (text encoder and UNet frozen), initialised from the concept's own
word pieces and, for the slots left over, from Gaussian noise of ``init_sigma_ti``; after every
step their norms are pulled a fraction ``min(1, 100 * lr)`` of the way to 0.4
(``clip_ti_decay``). The attention stage then prompts "a photo of <s1>...<sN>" and re-steers
the attention on those learned tokens (plus the pooled end token). The learned vectors live
only during erasure: the returned pipeline's tokenizer and text encoder are the input's,
bit for bit (the reference saves them with its pipeline; no evaluation prompt spells them).

Defaults follow the repository (SHI-Labs/Forget-Me-Not, ``configs/attn.yaml`` and
``configs/ti.yaml``): the whole UNet (``only_optimize_ca: false``; EMMA fine-tuned
cross-attention only, ``true``), AdamW at 2e-6 (weight decay 0.01), 35 steps, batch 1,
gradient clipping at 1, pooler token included, prompt "a photo of {}" ("a photo in the style
of {}" for styles); textual inversion on, 4 tokens, 500 steps of AdamW at 1e-3 (weight decay
0.1), batch 1, random horizontal flips (card: ``docs/protocols/methods/fmn.md``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError
from emma.methods._common import (
    Attn2Processor,
    CrossAttnRecorder,
    attn2_processors,
    autocast,
    check_concepts,
    concept_positions,
    cpu_generator,
    diffusion_target,
    domain_template,
    encode_text,
    fp32_training,
    generate_latents,
    randint,
    randn,
    require_sd_pipeline,
    token_ids,
    train_only,
    training_scheduler,
)

#: The norm the learned token vectors are pulled towards after every step (the reference's
#: ``clip_ti_decay``, src/train_ti.py:329-346), by ``min(1, 100 * lr)`` of the gap.
TI_TARGET_NORM = 0.4
TI_INITIALIZERS = ("concept", "random")


class TIPrompt:
    """A training prompt whose concept slot holds ``n`` learned token vectors.

    ``ids``: the padded token ids (the slots hold a stand-in id that the embedding hook
    replaces); ``slots``: bool mask of the slot positions; ``end``: index of the end token.
    """

    def __init__(self, tokenizer: Any, template: str, n: int) -> None:
        pre, post = template.split("{}")
        length = int(tokenizer.model_max_length)
        eos = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        pad = eos if pad is None else int(pad)
        head = [int(tokenizer.bos_token_id), *token_ids(tokenizer, pre)]
        ids = [*head, *([0] * n), *token_ids(tokenizer, post), eos]
        if len(ids) > length:
            raise ConfigError(f"FMN: the textual-inversion prompt {template!r} with {n} learned tokens is "
                              f"{len(ids)} tokens long; the text encoder reads at most {length}")
        self.end = len(ids) - 1
        self.ids = torch.tensor(ids + [pad] * (length - len(ids)))
        self.slots = torch.zeros(length, dtype=torch.bool)
        self.slots[len(head) : len(head) + n] = True


@contextlib.contextmanager
def learned_tokens(text_encoder: Any, slots: torch.Tensor, vectors: torch.Tensor) -> Iterator[None]:
    """While active, the text encoder's token embeddings at ``slots`` ((B, L) bool, ``N`` per
    row) are ``vectors`` ((B, N, D), gradients flow to them); its weights are not touched."""
    emb = text_encoder.get_input_embeddings()

    def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[slots.to(out.device)] = vectors.reshape(-1, out.shape[-1]).to(out.device, out.dtype)
        return out

    handle = emb.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def encode_learned(text_encoder: Any, prompt: TIPrompt, vectors: torch.Tensor) -> torch.Tensor:
    """Last hidden states ``(B, L, D)`` of ``prompt`` with each row's slots reading ``vectors[b]``."""
    b = vectors.shape[0]
    slots = prompt.slots.expand(b, -1)
    with learned_tokens(text_encoder, slots, vectors):
        return text_encoder(prompt.ids.expand(b, -1).to(text_encoder.device))[0]


def ti_loss(pipe: Any, prompt: TIPrompt, vectors: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor,
            t: torch.Tensor, scheduler: Any) -> torch.Tensor:
    """The diffusion loss of the textual-inversion stage (mean squared error to the UNet's
    target) on latents ``x0`` noised with ``noise`` at ``t``, the prompt reading ``vectors``
    ((N, D), one set for the whole batch)."""
    unet = pipe.unet
    device = unet.device
    x0, noise, t = x0.to(device, torch.float32), noise.to(device, torch.float32), t.to(device)
    xt = scheduler.add_noise(x0, noise, t)
    with autocast(device, unet.dtype):
        hidden = encode_learned(pipe.text_encoder, prompt, vectors[None].expand(len(x0), -1, -1))
        pred = unet(xt, t, encoder_hidden_states=hidden.float()).sample
    return F.mse_loss(pred.float(), diffusion_target(scheduler, x0, noise, t).float())


class ForgetMeNotMethod(ErasureMethod):
    """Forget-Me-Not attention re-steering, with the reference's optional textual inversion.

    Args:
        prompt_templates: per domain, the training prompt template with ``{}`` for the concept.
        only_optimize_ca: fine-tune the cross-attention modules (``attn2``) only; otherwise the
            whole UNet.
        use_pooler: add the end-of-text token to the re-steered tokens.
        learning_rate / max_train_steps / train_batch_size / adam_weight_decay / max_grad_norm:
            training (AdamW).
        num_images: images of each concept drawn before training.
        sample_steps / sample_guidance: sampler settings for those images.
        use_ti: learn token vectors for each concept first and re-steer the attention on them.
        num_tokens_ti: learned token vectors per concept.
        initializer_ti: ``concept`` (slot i starts as the concept's i-th word piece, the rest
            as noise) or ``random`` (every slot noise).
        init_sigma_ti: standard deviation of the noise initialisation.
        learning_rate_ti / max_train_steps_ti / train_batch_size_ti / weight_decay_ti: the
            inversion's training (AdamW, constant rate, steps per concept).
        clip_ti_decay: pull the vectors' norms towards 0.4 after every step.
        h_flip_ti: flip each training image horizontally with probability 0.5.
        progress: show progress bars (not a hyper-parameter).
    """

    name = "fmn"
    version = "3"
    edited_components = ("unet",)

    def __init__(
        self,
        prompt_templates: Any = "a photo of {}",
        only_optimize_ca: bool = True,
        use_pooler: bool = True,
        learning_rate: float = 2e-6,
        max_train_steps: int = 35,
        train_batch_size: int = 1,
        adam_weight_decay: float = 0.01,
        max_grad_norm: float = 1.0,
        num_images: int = 8,
        sample_steps: int = 50,
        sample_guidance: float = 7.5,
        use_ti: bool = False,
        num_tokens_ti: int = 4,
        initializer_ti: str = "concept",
        init_sigma_ti: float = 1.0,
        learning_rate_ti: float = 1e-3,
        max_train_steps_ti: int = 500,
        train_batch_size_ti: int = 1,
        weight_decay_ti: float = 0.1,
        clip_ti_decay: bool = True,
        h_flip_ti: bool = True,
        progress: bool = True,
    ) -> None:
        if int(train_batch_size) < 1 or int(num_images) < 1:
            raise ConfigError("FMN needs train_batch_size >= 1 and num_images >= 1")
        for key, value in (("num_tokens_ti", num_tokens_ti), ("max_train_steps_ti", max_train_steps_ti),
                           ("train_batch_size_ti", train_batch_size_ti)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"FMN {key}={value!r}: must be an integer >= 1")
        for key, value, low_open in (("learning_rate_ti", learning_rate_ti, True),
                                     ("init_sigma_ti", init_sigma_ti, False),
                                     ("weight_decay_ti", weight_decay_ti, False)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (low_open and value == 0):
                raise ConfigError(f"FMN {key}={value!r}: must be a finite number "
                                  f"{'> 0' if low_open else '>= 0'}")
        if initializer_ti not in TI_INITIALIZERS:
            raise ConfigError(f"FMN initializer_ti={initializer_ti!r}: valid: {', '.join(TI_INITIALIZERS)}")
        super().__init__(
            prompt_templates=to_python(prompt_templates), only_optimize_ca=bool(only_optimize_ca),
            use_pooler=bool(use_pooler), learning_rate=float(learning_rate),
            max_train_steps=int(max_train_steps),
            train_batch_size=int(train_batch_size), adam_weight_decay=float(adam_weight_decay),
            max_grad_norm=float(max_grad_norm), num_images=int(num_images), sample_steps=int(sample_steps),
            sample_guidance=float(sample_guidance), use_ti=bool(use_ti), num_tokens_ti=int(num_tokens_ti),
            initializer_ti=str(initializer_ti), init_sigma_ti=float(init_sigma_ti),
            learning_rate_ti=float(learning_rate_ti), max_train_steps_ti=int(max_train_steps_ti),
            train_batch_size_ti=int(train_batch_size_ti), weight_decay_ti=float(weight_decay_ti),
            clip_ti_decay=bool(clip_ti_decay), h_flip_ti=bool(h_flip_ti),
        )
        self.progress = bool(progress)
        #: What the last :meth:`erase` trained on (for inspection): ``positions`` (C, L) of the
        #: re-steered tokens; with ``use_ti`` also ``ti_vectors`` (C, N, D) and ``ti_losses``.
        self.last_run: dict[str, Any] = {}

    def template(self, domain: Domain | None) -> str:
        """The training prompt template of ``domain``."""
        return domain_template(self.hparams["prompt_templates"], domain, what="FMN prompt_templates")

    def prompts(self, concepts: Sequence[str], domain: Domain | None) -> list[str]:
        """One training prompt per concept."""
        template = self.template(domain)
        return [template.format(c) for c in concepts]

    def initial_vectors(self, pipe: Any, concept: str, gen: torch.Generator) -> torch.Tensor:
        """The starting token vectors ``(N, D)`` of ``concept`` (float32, CPU)."""
        hp = self.hparams
        table = pipe.text_encoder.get_input_embeddings().weight.detach()
        words = token_ids(pipe.tokenizer, concept) if hp["initializer_ti"] == "concept" else []
        rows = []
        for i in range(hp["num_tokens_ti"]):
            if i < len(words):
                rows.append(table[words[i]].float().cpu())
            else:
                rows.append(randn((table.shape[1],), gen) * hp["init_sigma_ti"])
        return torch.stack(rows)

    def invert(self, pipe: Any, prompt: TIPrompt, latents: torch.Tensor, init: torch.Tensor,
               gen: torch.Generator) -> tuple[torch.Tensor, list[float]]:
        """Learn one concept's token vectors on its image ``latents`` (textual inversion).

        Returns the vectors ``(N, D)`` (float32, CPU) and the loss of every step. The UNet and
        the text encoder are frozen and come back bit for bit.
        """
        hp = self.hparams
        unet, text_encoder = pipe.unet, pipe.text_encoder
        sched = training_scheduler(pipe)
        n_t = sched.config.num_train_timesteps
        lr = hp["learning_rate_ti"]
        decay = min(1.0, 100 * lr)
        losses: list[float] = []
        with fp32_training(unet), fp32_training(text_encoder):
            unet.requires_grad_(False)
            text_encoder.requires_grad_(False)
            vectors = torch.nn.Parameter(init.clone().to(unet.device, torch.float32))
            opt = torch.optim.AdamW([vectors], lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=hp["weight_decay_ti"])
            order: list[int] = []
            bar = tqdm(range(hp["max_train_steps_ti"]), desc="FMN inversion", disable=not self.progress)
            for _ in bar:
                idx = []
                for _ in range(hp["train_batch_size_ti"]):
                    if not order:
                        order = torch.randperm(len(latents), generator=gen).tolist()
                    idx.append(order.pop())
                x0 = latents[idx].float()
                if hp["h_flip_ti"]:
                    flip = torch.rand(len(idx), generator=gen) < 0.5
                    x0 = torch.where(flip[:, None, None, None], x0.flip(-1), x0)
                noise = randn(x0.shape, gen)
                t = torch.randint(0, n_t, (len(idx),), generator=gen)
                loss = ti_loss(pipe, prompt, vectors, x0, noise, t, sched)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if hp["clip_ti_decay"]:
                    with torch.no_grad():
                        norm = vectors.norm(dim=-1, keepdim=True)
                        vectors.copy_(F.normalize(vectors, dim=-1) * (norm + decay * (TI_TARGET_NORM - norm)))
                losses.append(float(loss.item()))
                bar.set_postfix(loss=f"{losses[-1]:.4g}")
        return vectors.detach().float().cpu(), losses

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Fine-tune ``pipe.unet`` so that images no longer attend to the concepts' tokens."""
        require_sd_pipeline(pipe, "FMN")
        concepts = check_concepts(concepts, pipe.tokenizer, method="FMN")
        hp = self.hparams
        gen = cpu_generator(seed)
        prompts = self.prompts(concepts, domain)
        n = hp["num_images"]
        # Image j shows concept j // n (drawn by the unedited model).
        seeds = [randint(2**31 - 1, gen) for _ in range(n * len(concepts))]
        owner = [j // n for j in range(n * len(concepts))]
        latents = generate_latents(pipe, [prompts[o] for o in owner], seeds,
                                   num_inference_steps=hp["sample_steps"],
                                   guidance_scale=hp["sample_guidance"], progress=self.progress,
                                   desc="FMN images")
        self.last_run = {}
        if hp["use_ti"]:
            # The reference learns each concept's tokens in its own run (exps_ti/<concept>),
            # then prompts "a photo of <s1>...<sN>" and re-steers those tokens.
            ti_prompt = TIPrompt(pipe.tokenizer, self.template(domain), hp["num_tokens_ti"])
            learned, losses = [], []
            for k, c in enumerate(concepts):
                v, lk = self.invert(pipe, ti_prompt, latents[k * n : (k + 1) * n],
                                    self.initial_vectors(pipe, c, gen), gen)
                learned.append(v)
                losses.append(lk)
            vectors = torch.stack(learned)
            with torch.no_grad():
                emb = encode_learned(pipe.text_encoder, ti_prompt, vectors)
            pos = ti_prompt.slots.clone()
            if hp["use_pooler"]:
                pos[ti_prompt.end] = True
            positions = pos.expand(len(concepts), -1).clone()
            self.last_run.update(ti_vectors=vectors, ti_losses=losses)
        else:
            emb = encode_text(pipe, prompts)
            # The pooled end token only: FMN's repository (SD 2.1) pads with "!", so its pooler
            # mask never covered padding; with SD v1.x's end-token padding we keep that meaning.
            positions = torch.stack([concept_positions(pipe.tokenizer, p, c, use_pooler=hp["use_pooler"],
                                                       pooler="first")
                                     for p, c in zip(prompts, concepts, strict=True)])
        self.last_run.update(positions=positions, attn_losses=[])

        unet = pipe.unet
        device, dtype = unet.device, unet.dtype
        sched = training_scheduler(pipe)
        n_t = sched.config.num_train_timesteps
        state: dict[str, Any] = {"probs": [], "pos": None}

        def record(name: str, probs: torch.Tensor, batch: int) -> None:
            heads = probs.shape[0] // batch
            pos = state["pos"].to(probs.device)
            for b in range(batch):
                state["probs"].append(probs[b * heads : (b + 1) * heads][:, :, pos[b]].reshape(-1))

        recorder = CrossAttnRecorder(record)
        keep = (lambda name: ".attn2." in name) if hp["only_optimize_ca"] else (lambda name: True)
        bs = hp["train_batch_size"]
        with fp32_training(unet), attn2_processors(unet, lambda name, m: Attn2Processor(name, recorder)):
            params = train_only(unet, keep)
            opt = torch.optim.AdamW(params.values(), lr=hp["learning_rate"],
                                    weight_decay=hp["adam_weight_decay"])
            order: list[int] = []
            bar = tqdm(range(hp["max_train_steps"]), desc="FMN", disable=not self.progress)
            for _ in bar:
                idx = []
                for _ in range(bs):
                    if not order:
                        order = torch.randperm(len(latents), generator=gen).tolist()
                    idx.append(order.pop())
                who = [owner[i] for i in idx]
                x0 = latents[idx].to(device, torch.float32)
                noise = randn(x0.shape, gen, like=x0)
                t = torch.randint(0, n_t, (len(idx),), generator=gen).to(device)
                xt = sched.add_noise(x0, noise, t)
                state["pos"], state["probs"] = positions[who], []
                with autocast(device, dtype):
                    unet(xt, t, encoder_hidden_states=emb[who].to(device, torch.float32))
                loss = torch.cat(state["probs"]).float().norm()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(params.values()), hp["max_grad_norm"])
                opt.step()
                self.last_run["attn_losses"].append(float(loss.item()))
                bar.set_postfix(loss=f"{loss.item():.4g}")
        return pipe
