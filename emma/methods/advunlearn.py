"""AdvUnlearn — adversarial unlearning of the text encoder (Zhang et al., NeurIPS 2024).

ESD's erasure objective, trained into the *text encoder* (the UNet stays frozen), against
adversarial prompts found by an attack in the loop, with a retain set keeping other prompts'
embeddings (``train-scripts/AdvUnlearn.py`` of OPTML-Group/AdvUnlearn). Per iteration, for a
concept ``c`` (redrawn every ``adv_prompt_update_step`` iterations):

- **attack** (after ``warmup_iter`` iterations, when the concept is redrawn):
  ``adv_prompt_num`` adversarial tokens are inserted into ``c``'s prompt (``attack_type``:
  UnlearnDiffAtk's insertions, prefix by default) and optimised for ``attack_step`` steps so
  that the current text encoder makes the UNet predict what the original model predicts for
  ``c``: minimise ``|ε(x_t, E_θ(adv)) − ε(x_t, E_0(c))|²`` at ``x_t`` drawn from ``c``. The
  tokens are either continuous word embeddings (``attack_space: embedding``, the reference's
  ``word_embd``; ``attack_method`` ``pgd`` = Adam steps, ``fast_at`` = Adam on the gradient's
  sign) or UnlearnDiffAtk's hard tokens (``attack_space: tokens``: points on the vocabulary
  simplex drawn straight-through and projected back after every step, the attacker's own
  :class:`emma.token_search.StraightThroughSample` and :func:`emma.token_search.project_simplex`);
- **unlearning**: ``|ε(x_t, E_θ(p)) − (ε(x_t, E_0("")) − η (ε(x_t, E_0(c)) − ε(x_t, E_0("")))|²``
  with ``p`` the adversarial prompt (the plain concept during warm-up), plus
  ``retain_loss_w · |ε(x_r, E_θ(r)) − ε(x_r, E_0(r))|²`` over ``retain_batch`` retain prompts
  ``r`` (``retain_train: reg``; ``x_r`` drawn from ``r``).

``E_0`` is the original text encoder, ``E_θ`` the one being trained; every ``x_t`` is drawn by
DDIM (guidance ``start_guidance``) for a random number of ``ddim_steps`` steps from the
original conditioning, and the loss is taken at the timestep reached. Defaults are the
reference's README command (``--attack_init random --attack_step 30 --retain_train reg
--train_method text_encoder_full --retain_loss_w 0.3``) on its argparse defaults: 1000
iterations, Adam 1e-5, η 1, start guidance 3, 50 DDIM steps, 1 adversarial prefix token, PGD
with Adam 1e-3, warm-up 200, a new attack every iteration, 5 retain prompts. The reference's
retain set is COCO object captions; here retain prompts are templates over the domain's other
concepts (``"<others>"``) or given prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError, UnknownChoiceError
from emma.methods._common import (
    autocast,
    check_concepts,
    cpu_generator,
    domain_name,
    domain_template,
    encode_text,
    expand_others,
    for_domain,
    fp32_training,
    randint,
    randn,
    require_sd_pipeline,
)
from emma.methods.esd import ESDMethod

ATTACK_SPACES = ("embedding", "tokens")
ATTACK_METHODS = ("pgd", "fast_at")
ATTACK_INITS = ("random", "latest")
COMPONENTS = ("all", "attn", "ffn")


def text_encoder_parameter_filter(layers: Sequence[int] | None, component: str, norm_layer: bool):
    """Which text-encoder parameters (names inside ``text_model``) AdvUnlearn trains: the
    transformer layers ``layers`` (``None``: all; ``component``: all of each layer, its
    self-attention or its MLP), and the final layer norm with ``component == "all"`` over all
    layers (the reference's ``text_encoder_full``) or with ``norm_layer``. Token and position
    embeddings are never trained."""
    if component not in COMPONENTS:
        raise UnknownChoiceError("AdvUnlearn component", component, COMPONENTS)
    wanted = None if layers is None else {int(i) for i in layers}

    def keep(name: str) -> bool:
        if name.startswith("final_layer_norm."):
            return bool(norm_layer) or (component == "all" and wanted is None)
        if not name.startswith("encoder.layers."):
            return False
        if wanted is not None and int(name.split(".")[2]) not in wanted:
            return False
        return component == "all" or (component == "attn" and ".self_attn." in name) or (
            component == "ffn" and ".mlp." in name)

    return keep


class AdvUnlearnMethod(ErasureMethod):
    """AdvUnlearn: adversarial training of the text encoder, with a retain set.

    Args:
        iterations: unlearning steps.
        learning_rate: Adam learning rate of the text encoder.
        layers: text-encoder layers trained (``None``: all, the reference's ``text_encoder_full``).
        component: ``all``, ``attn`` or ``ffn`` of those layers.
        norm_layer: also train the final layer norm when not all of every layer is trained.
        negative_guidance / start_guidance / ddim_steps: η of the ESD target; guidance and DDIM
            steps of the sampler that draws ``x_t``.
        neutral_concepts: per domain, the prompt of ``ε(x_t, E_0(""))`` (``""``, as ESD).
        concept_templates: per domain, the prompt the concept is unlearned in (``{}``: the
            concept's name alone, as the reference's ``--prompt``).
        retain_concepts: per domain, the concepts of the retain prompts (``"<others>"`` = the
            domain's other concepts); ``retain_templates`` puts each in a prompt (``{}``).
        retain_batch: retain prompts per step; retain_loss_w: their weight (0: no retain term).
        adv_prompt_num: adversarial tokens; attack_type: where they go (UnlearnDiffAtk's insertions).
        attack_space: ``embedding`` (continuous word embeddings) or ``tokens`` (UnlearnDiffAtk's
            simplex over the vocabulary, hard tokens in the forward pass).
        attack_method: ``pgd`` or ``fast_at`` (embedding space); attack_step: attack steps;
        attack_lr: the attack's Adam learning rate; attack_weight_decay: its weight decay
            (UnlearnDiffAtk's 0.1 in token space); attack_init: ``random`` tokens or the
            ``latest`` attack's.
        warmup_iter: iterations before the first attack; adv_prompt_update_step: iterations
            between attacks.
        progress: show a progress bar (not a hyper-parameter).
    """

    name = "advunlearn"
    version = "1"
    edited_components = ("text_encoder",)

    def __init__(
        self,
        iterations: int = 1000,
        learning_rate: float = 1e-5,
        layers: Sequence[int] | None = None,
        component: str = "all",
        norm_layer: bool = False,
        negative_guidance: float = 1.0,
        start_guidance: float = 3.0,
        ddim_steps: int = 50,
        neutral_concepts: Any = "",
        concept_templates: Any = "{}",
        retain_concepts: Any = "<others>",
        retain_templates: Any = "a photo of a {}",
        retain_batch: int = 5,
        retain_loss_w: float = 0.3,
        adv_prompt_num: int = 1,
        attack_type: str = "prefix_k",
        attack_space: str = "embedding",
        attack_method: str = "pgd",
        attack_step: int = 30,
        attack_lr: float = 1e-3,
        attack_weight_decay: float = 0.0,
        attack_init: str = "random",
        warmup_iter: int = 200,
        adv_prompt_update_step: int = 1,
        progress: bool = True,
    ) -> None:
        from emma.token_search import check_insertion

        check_insertion(attack_type)
        for value, valid, what in ((attack_space, ATTACK_SPACES, "attack_space"),
                                   (attack_method, ATTACK_METHODS, "attack_method"),
                                   (attack_init, ATTACK_INITS, "attack_init")):
            if value not in valid:
                raise UnknownChoiceError(f"AdvUnlearn {what}", value, valid)
        layers = to_python(layers)
        text_encoder_parameter_filter(layers, component, norm_layer)
        if int(iterations) < 0 or int(ddim_steps) < 1 or int(retain_batch) < 1 or int(adv_prompt_num) < 1 \
                or int(attack_step) < 0 or int(adv_prompt_update_step) < 1 or int(warmup_iter) < 0:
            raise ConfigError("AdvUnlearn needs iterations >= 0, ddim_steps >= 1, retain_batch >= 1, "
                              "adv_prompt_num >= 1, attack_step >= 0, adv_prompt_update_step >= 1 and "
                              f"warmup_iter >= 0; got {iterations}, {ddim_steps}, {retain_batch}, "
                              f"{adv_prompt_num}, {attack_step}, {adv_prompt_update_step}, {warmup_iter}")
        super().__init__(
            iterations=int(iterations), learning_rate=float(learning_rate), layers=layers, component=component,
            norm_layer=bool(norm_layer), negative_guidance=float(negative_guidance),
            start_guidance=float(start_guidance), ddim_steps=int(ddim_steps),
            neutral_concepts=to_python(neutral_concepts), concept_templates=to_python(concept_templates),
            retain_concepts=to_python(retain_concepts),
            retain_templates=to_python(retain_templates), retain_batch=int(retain_batch),
            retain_loss_w=float(retain_loss_w), adv_prompt_num=int(adv_prompt_num), attack_type=attack_type,
            attack_space=attack_space, attack_method=attack_method, attack_step=int(attack_step),
            attack_lr=float(attack_lr), attack_weight_decay=float(attack_weight_decay), attack_init=attack_init,
            warmup_iter=int(warmup_iter), adv_prompt_update_step=int(adv_prompt_update_step),
        )
        self.progress = bool(progress)
        # hard-token attacks of the last erase (attack_space tokens): token ids and text
        self.adversarial_ids: list[list[int]] = []
        self.adversarial_prompts: list[str] = []

    def retain_prompts(self, concepts: Sequence[str], domain: Domain | None) -> list[str]:
        """The retain prompts: every template over every retain concept."""
        hp = self.hparams
        names = expand_others(for_domain(hp["retain_concepts"], domain, what="AdvUnlearn retain_concepts"),
                              domain, concepts)
        t = for_domain(hp["retain_templates"], domain, what="AdvUnlearn retain_templates")
        templates = [t] if isinstance(t, str) else list(t or [])
        if not names or not templates or any(x.count("{}") > 1 for x in templates):
            raise ConfigError(f"AdvUnlearn needs retain concepts (got {names!r} for domain {domain_name(domain)!r} "
                              "once the erased concepts are removed) and templates with at most one '{}' "
                              f"(got {templates!r})")
        return [x.format(n) if "{}" in x else x for n in names for x in templates]

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Fine-tune ``pipe.text_encoder`` in place so that no prompt found by the attack (nor
        the concept's own) draws ``concepts``."""
        from emma.attack import DiffusersWhiteBox

        require_sd_pipeline(pipe, "AdvUnlearn")
        concepts = check_concepts(concepts, pipe.tokenizer, method="AdvUnlearn")
        hp = self.hparams
        neutral = for_domain(hp["neutral_concepts"], domain, what="AdvUnlearn neutral_concepts")
        if not isinstance(neutral, str):
            raise ConfigError(f"AdvUnlearn neutral_concepts for domain {domain_name(domain)!r} must be a string, "
                              f"got {neutral!r}")
        template = domain_template(hp["concept_templates"], domain, what="AdvUnlearn concept_templates")
        retain = self.retain_prompts(concepts, domain)
        concepts = [template.format(c) for c in concepts]
        gen = cpu_generator(seed)
        frozen_before = {c: {n: p.requires_grad for n, p in getattr(pipe, c).named_parameters()}
                         for c in ("unet", "vae")}
        original = _OriginalModel(pipe, concepts, neutral, retain, hp["ddim_steps"], hp["start_guidance"], gen)
        with fp32_training(pipe.text_encoder):
            wb = DiffusersWhiteBox(pipe)  # freezes every component; the chosen encoder weights thaw below
            opt = torch.optim.Adam(self._thaw_trained(pipe.text_encoder), lr=hp["learning_rate"])
            self._train(wb, pipe.text_encoder, original, opt, gen)
        for c, flags in frozen_before.items():  # the white box froze them for the attack
            for n, p in getattr(pipe, c).named_parameters():
                p.requires_grad_(flags[n])
        return pipe

    def _thaw_trained(self, enc: Any) -> list[torch.nn.Parameter]:
        """The text-encoder parameters ``layers``/``component``/``norm_layer`` select, made to
        require gradients."""
        hp = self.hparams
        tm = enc.text_model if hasattr(enc, "text_model") else enc
        keep = text_encoder_parameter_filter(hp["layers"], hp["component"], hp["norm_layer"])
        params = [p for n, p in tm.named_parameters() if keep(n)]
        if not params:
            raise ConfigError(f"AdvUnlearn: layers={hp['layers']} component={hp['component']!r} selects no "
                              "text-encoder parameter")
        for p in params:
            p.requires_grad_(True)
        return params

    def _train(self, wb: Any, enc: Any, original: _OriginalModel, opt: torch.optim.Optimizer,
               gen: torch.Generator) -> None:
        """``iterations`` unlearning steps; every ``adv_prompt_update_step`` a concept is drawn
        and, after ``warmup_iter``, attacked."""
        hp = self.hparams
        concepts = original.concepts
        adv = None  # the current adversarial prompt: (sequences, slot embeddings or simplex)
        self.adversarial_ids, self.adversarial_prompts = [], []
        i_c = 0
        bar = tqdm(range(hp["iterations"]), desc="AdvUnlearn", disable=not self.progress)
        for it in bar:
            if it % hp["adv_prompt_update_step"] == 0:
                i_c = randint(len(concepts), gen)
                if it >= hp["warmup_iter"] and hp["attack_step"] > 0:
                    adv = self._attack(wb, concepts[i_c], original.cond0[i_c : i_c + 1], original.draw,
                                       original.predict, original.timesteps, gen,
                                       adv if hp["attack_init"] == "latest" else None)
            loss, unlearn, k = self._step_loss(wb, enc, original, i_c, adv, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.set_postfix(unlearn=f"{unlearn.item():.4g}", loss=f"{loss.item():.4g}", k=k)

    def _step_loss(self, wb: Any, enc: Any, original: _OriginalModel, i_c: int, adv: dict[str, Any] | None,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The loss of one unlearning step on concept ``i_c``'s adversarial prompt (the plain
        concept before the first attack), with the retain term; also its unlearning term and
        the DDIM step ``k`` drawn."""
        hp = self.hparams
        k = randint(hp["ddim_steps"], gen)
        t = original.timesteps[k].to(original.device)
        cond = original.cond0[i_c : i_c + 1]
        with torch.no_grad():
            xt = original.draw(cond, k)
            e_0 = original.predict(xt, t, original.neutral0)
            e_p = original.predict(xt, t, cond)
            target = e_0 - hp["negative_guidance"] * (e_p - e_0)
        if adv is None:
            emb_n = enc(wb.token_ids([original.concepts[i_c]]))[0]
        else:
            emb_n = wb.encode_embeds(self._adv_embeds(wb, adv))
        loss = unlearn = F.mse_loss(original.predict(xt, t, emb_n), target)
        if hp["retain_loss_w"] > 0:
            retain, retain0 = original.retain, original.retain0
            idx = [randint(len(retain), gen) for _ in range(hp["retain_batch"])]
            with torch.no_grad():
                xr = original.draw(retain0[idx], k)
                r_p = original.predict(xr, t, retain0[idx])
            r_n = original.predict(xr, t, enc(wb.token_ids([retain[j] for j in idx]))[0])
            loss = loss + hp["retain_loss_w"] * F.mse_loss(r_n, r_p)
        return loss, unlearn, k

    # ------------------------------------------------------------------ the attack in the loop
    def _adv_embeds(self, wb: Any, adv: dict[str, Any], gen: torch.Generator | None = None) -> torch.Tensor:
        """The adversarial prompt's token embeddings: while attacking, differentiable in the
        attack's variable (``gen`` draws the straight-through tokens); after it, its result
        (``adv["slot"]``: the embeddings, or the argmax tokens' embeddings)."""
        from emma.token_search import StraightThroughSample

        base = wb.embed_ids(adv["seqs"].ids.to(wb.device)).float()
        if "slot" in adv:
            slot = adv["slot"]
        elif adv["space"] == "embedding":
            slot = adv["var"]
        else:
            one_hot = StraightThroughSample.apply(adv["var"], gen)
            slot = one_hot @ wb.token_embedding_matrix().float()
        return adv["seqs"].embed(base, slot)

    def _attack(self, wb: Any, concept: str, cond0: torch.Tensor, draw: Any, predict: Any,
                timesteps: torch.Tensor, gen: torch.Generator, latest: dict[str, Any] | None) -> dict[str, Any]:
        """Optimise the adversarial tokens against the current text encoder (weights untouched)."""
        from emma.token_search import build_sequences, layout, project_simplex

        hp = self.hparams
        k_adv = hp["adv_prompt_num"]
        prompt_ids = wb.tokenizer(concept, truncation=False).input_ids[1:-1]
        seqs = build_sequences([layout(prompt_ids, k_adv, hp["attack_type"])], wb.context_length, wb.bos_token_id,
                               wb.eos_token_id, wb.pad_token_id,
                               what=f"AdvUnlearn adv_prompt_num={k_adv} on {concept!r}")
        vocab = wb.token_embedding_matrix().float()
        if latest is not None:
            init = latest["var"].detach().clone()
        elif hp["attack_space"] == "embedding":  # random vocabulary tokens (the reference's random init)
            init = vocab[torch.randint(0, vocab.shape[0], (1, k_adv), generator=gen)].clone()
        else:  # UnlearnDiffAtk starts each token at the uniform point of the simplex
            init = torch.full((1, k_adv, vocab.shape[0]), 1.0 / vocab.shape[0])
        var = torch.nn.Parameter(init.to(wb.device))
        adv = {"seqs": seqs, "space": hp["attack_space"], "var": var}
        opt = torch.optim.Adam([var], lr=hp["attack_lr"], weight_decay=hp["attack_weight_decay"])
        enc_grad = [p.requires_grad for p in wb.text_encoder.parameters()]
        wb.text_encoder.requires_grad_(False)
        try:
            for _ in range(hp["attack_step"]):
                k = randint(hp["ddim_steps"], gen)
                t = timesteps[k].to(wb.device)
                with torch.no_grad():
                    xt = draw(cond0, k)
                    e_p = predict(xt, t, cond0)
                e_n = predict(xt, t, wb.encode_embeds(self._adv_embeds(wb, adv, gen)))
                loss = F.mse_loss(e_n, e_p)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if hp["attack_space"] == "embedding" and hp["attack_method"] == "fast_at":
                    var.grad.sign_()
                opt.step()
                if hp["attack_space"] == "tokens":
                    with torch.no_grad():
                        var.data = project_simplex(var.data)
        finally:
            for p, g in zip(wb.text_encoder.parameters(), enc_grad):
                p.requires_grad_(g)
        if hp["attack_space"] == "tokens":
            hard = var.data.argmax(-1)
            adv["slot"] = vocab[hard]
            ids = seqs.fill(hard.cpu())[0].tolist()
            self.adversarial_ids.append(ids)
            self.adversarial_prompts.append(wb.decode_ids(ids))
        else:
            adv["slot"] = var.data.detach().clone()
        return adv


class _OriginalModel:
    """What the unedited model says, computed once: the original text encoder's embeddings of
    the concepts, the empty, neutral and retain prompts; and, through the UNet (which stays
    frozen, so the original model's predictions need no copy of it), latents ``x_t`` drawn
    with such conditioning (:meth:`draw`) and noise predictions (:meth:`predict`)."""

    def __init__(self, pipe: Any, concepts: list[str], neutral: str, retain: list[str], ddim_steps: int,
                 start_guidance: float, gen: torch.Generator) -> None:
        from diffusers import DDIMScheduler

        self.concepts, self.retain = concepts, retain
        self.unet, self.gen, self.start_guidance = pipe.unet, gen, start_guidance
        self.device, self.dtype = pipe.unet.device, pipe.unet.dtype
        self.cond0 = encode_text(pipe, concepts).float()
        self.blank0 = encode_text(pipe, [""]).float()
        self.neutral0 = encode_text(pipe, [neutral]).float()
        self.retain0 = encode_text(pipe, retain).float()
        self.sampler = DDIMScheduler.from_config(pipe.scheduler.config)
        self.sampler.set_timesteps(ddim_steps, device="cpu")
        self.timesteps = self.sampler.timesteps.clone()
        size = self.unet.config.sample_size
        self.shape = (self.unet.config.in_channels, size, size)

    def draw(self, cond: torch.Tensor, k: int) -> torch.Tensor:
        """``x_t`` after ``k`` DDIM steps from fresh noise (drawn from ``gen``) under ``cond``."""
        z = randn((len(cond), *self.shape), self.gen, device=self.device) * self.sampler.init_noise_sigma
        return ESDMethod._sample_until(self.unet, self.sampler, self.timesteps[:k], z, cond,
                                       self.blank0.expand(len(cond), -1, -1), self.start_guidance, self.dtype)

    def predict(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """The UNet's noise prediction for ``x`` at ``t`` under the text embeddings ``ctx``."""
        with autocast(self.device, self.dtype):
            return self.unet(x.to(self.dtype), t, encoder_hidden_states=ctx.to(self.dtype)).sample.float()
