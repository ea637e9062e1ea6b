"""EAP — erasure with adversarial preservation (Bui et al., NeurIPS 2024).

ESD's erasure objective plus the preservation of the concept the erasure hurts most, found
adversarially. For each erased concept ``c`` a candidate set of preserved concepts is built
once: the ``k_closest`` vocabulary words whose prompt embeddings lie nearest to ``c``'s (L2
over the whole ``(tokens, dim)`` embedding), reduced by one-dimensional k-means over those
distances to ``num_centers`` representatives (the word nearest each centre). A preserved
embedding is a Gumbel-softmax mixture ``e_r = g(π) · E`` of the candidates' embeddings
(``E``), with logits ``π`` learned. The two players alternate, ``pgd_num_steps`` steps per
iteration (``train_adversarial_gumbel.py`` of tuananhbui89/Erasing-Adversarial-Preservation):

- step 0 (the model): with ``x_t`` drawn by the model being fine-tuned from ``c`` and from
  ``e_r`` (same start noise, DDIM at guidance ``start_guidance``, a random number of steps),
  and ``x̂_0(ε)`` the clean latent an ε-prediction implies at ``t``,

      L = |x̂_0(ε_θ(x_t, c)) − x̂_0(ε*(x_t, "") − η (ε*(x_t, c) − ε*(x_t, "")))|²
          + λ |x̂_0(ε_θ(x_t^r, e_r)) − x̂_0(ε*(x_t^r, e_r))|²

  (``*`` = the frozen model, η = ``negative_guidance``, λ = ``preserve_weight``);
- steps 1 .. ``pgd_num_steps`` − 1 (the adversary): one Adam step on ``π`` that *increases*
  the preservation term, so the next model step preserves the candidate the erasure moves
  most.

Defaults are those of the paper's runs (``run_imagenette.sh``): ESD-x, 1000 iterations, Adam
1e-5, η 1, start guidance 3, 50 DDIM steps, Gumbel lr 1e-2, temperature 2, hard samples,
1000 closest words, 100 centres, 2 steps per iteration, the reference's 3,000 English words
(``vocabulary: "<data:en3k>"``, a pinned download; ``"tokenizer"`` = the tokenizer's
whole-word alphabetic tokens, the reference's ``CLIP`` option). Per domain (nudity: ESD-u,
2000 closest words, 50 centres) see ``conf/preset/method_domain/`` and the protocol card
``docs/protocols/methods/eap.md``. Candidate words equal to a word of the erased concept are
left out (preserving the concept itself would undo the erasure).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError
from emma.methods import reference_data
from emma.methods._common import (
    autocast,
    check_concepts,
    cpu_generator,
    encode_text,
    for_concept,
    for_domain,
    fp32_training,
    randint,
    randn,
    require_sd_pipeline,
    train_only,
)
from emma.methods.esd import ESDMethod, esd_parameter_filter

VOCABULARIES = ("tokenizer",)
_WORD = re.compile(r"^[a-z]{2,}$")


def vocabulary_words(tokenizer: Any, vocabulary: Any) -> list[str]:
    """The candidate words: ``"tokenizer"`` = every whole-word token of the tokenizer made of
    two or more letters (its ``</w>`` marker dropped), in token-id order; a list = those words;
    ``"<data:en3k>"`` = the reference's 3,000 English words (:mod:`emma.methods.reference_data`)."""
    vocabulary = reference_data.resolve(vocabulary)
    if isinstance(vocabulary, str):
        if vocabulary != "tokenizer":
            raise ConfigError(f"EAP vocabulary {vocabulary!r}: use 'tokenizer' (the tokenizer's whole-word "
                              "tokens) or a list of words")
        vocab = tokenizer.get_vocab()
        words = [t[: -len("</w>")] for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t.endswith("</w>")]
        return [w for w in words if _WORD.match(w)]
    words = [str(w).strip() for w in to_python(vocabulary) or []]
    if not words or any(not w for w in words):
        raise ConfigError(f"EAP vocabulary must be 'tokenizer' or a non-empty list of words, got {vocabulary!r}")
    return list(dict.fromkeys(words))


def kmeans_1d(values: torch.Tensor, k: int, iterations: int = 100) -> torch.Tensor:
    """Lloyd's k-means on scalars, centres started at evenly spaced quantiles (deterministic);
    returns the ``k`` centres in ascending order."""
    x = values.double().flatten()
    centers = torch.quantile(x, torch.linspace(0, 1, k, dtype=torch.float64))
    for _ in range(iterations):
        assign = (x[:, None] - centers[None, :]).abs().argmin(1)
        new = centers.clone()
        for j in range(k):
            if (assign == j).any():
                new[j] = x[assign == j].mean()
        if torch.equal(new, centers):
            break
        centers = new
    return centers.sort().values


def closest_words(pipe: Any, concept: str, words: Sequence[str], k: int,
                  batch_size: int = 256) -> tuple[list[str], torch.Tensor]:
    """The ``k`` words whose prompt embeddings are nearest (L2 over the whole embedding) to
    ``concept``'s, nearest first, with their distances."""
    target = encode_text(pipe, [concept]).float().flatten(1)
    dists = []
    for s in range(0, len(words), batch_size):
        emb = encode_text(pipe, list(words[s : s + batch_size])).float().flatten(1)
        dists.append(torch.cdist(emb, target).squeeze(1).cpu())
    d = torch.cat(dists)
    order = torch.argsort(d, stable=True)[:k]
    return [words[i] for i in order.tolist()], d[order]


def preserved_candidates(pipe: Any, concept: str, words: Sequence[str], k_closest: int,
                         num_centers: int) -> list[str]:
    """EAP's candidate set for ``concept``: the ``k_closest`` nearest words, reduced by 1-D
    k-means over their distances to the word nearest each of ``num_centers`` centres (in
    centre order, duplicates dropped)."""
    near, dist = closest_words(pipe, concept, words, k_closest)
    if num_centers <= 0 or len(near) <= num_centers:
        return near
    centers = kmeans_1d(dist, num_centers)
    picks = [int((dist.double() - c).abs().argmin()) for c in centers]
    return [near[i] for i in dict.fromkeys(picks)]


def gumbel_softmax(logits: torch.Tensor, temperature: float, hard: bool, generator: torch.Generator) -> torch.Tensor:
    """Gumbel-softmax sample of ``logits`` with noise from ``generator``; ``hard``: the one-hot
    of the argmax in the forward pass, the soft sample's gradient (straight-through)."""
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float32).to(logits.device, logits.dtype)
    g = -torch.log(-torch.log(u + 1e-10) + 1e-10)
    y = F.softmax((logits + g) / temperature, dim=-1)
    if hard:
        one = torch.zeros_like(y).scatter_(-1, y.argmax(-1, keepdim=True), 1.0)
        y = (one - y).detach() + y
    return y


def predicted_x0(scheduler: Any, xt: torch.Tensor, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The clean latent a UNet output at ``x_t`` implies (ε- or v-prediction)."""
    a = scheduler.alphas_cumprod.to(xt.device, torch.float32)[t.long()].reshape(-1, 1, 1, 1)
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return (xt - (1 - a).sqrt() * out) / a.sqrt()
    if kind == "v_prediction":
        return a.sqrt() * xt - (1 - a).sqrt() * out
    raise ConfigError(f"unsupported prediction_type {kind!r}; valid: epsilon, v_prediction")


class EAPMethod(ErasureMethod):
    """Erasing undesirable concepts with adversarial preservation (EAP).

    Args:
        train_method: UNet parameters fine-tuned (``esd-x``, ``esd-u``, ``esd-x-strict``,
            ``esd-all``; see :func:`emma.methods.esd.esd_parameter_filter`).
        iterations: model updates.
        learning_rate: Adam learning rate of the model.
        negative_guidance: η of the erasure target.
        start_guidance: classifier-free guidance of the sampler that draws ``x_t``.
        ddim_steps: DDIM steps of that sampler.
        neutral_concepts: per domain, the prompt of ``ε*(x_t, "")`` (``""``, as ESD).
        vocabulary: ``"tokenizer"``, a reference list (``"<data:en3k>"``) or a list of candidate words.
        k_closest: words nearest to the concept kept as candidates.
        num_centers: k-means centres (candidates preserved); ``<= 0``: all ``k_closest`` words.
        gumbel_lr / gumbel_temp / gumbel_hard: Adam learning rate, temperature and hard
            (straight-through) sampling of the candidate logits.
        pgd_num_steps: steps per iteration: one model step, then ``pgd_num_steps − 1``
            adversary steps.
        preserve_weight: λ, the weight of the preservation term.
        progress: show a progress bar (not a hyper-parameter).
    """

    name = "eap"
    version = "1"
    edited_components = ("unet",)

    def __init__(
        self,
        train_method: str = "esd-x",
        iterations: int = 1000,
        learning_rate: float = 1e-5,
        negative_guidance: float = 1.0,
        start_guidance: float = 3.0,
        ddim_steps: int = 50,
        neutral_concepts: Any = "",
        vocabulary: Any = "tokenizer",
        k_closest: int = 1000,
        num_centers: int = 100,
        gumbel_lr: float = 1e-2,
        gumbel_temp: float = 2.0,
        gumbel_hard: bool = True,
        pgd_num_steps: int = 2,
        preserve_weight: float = 1.0,
        progress: bool = True,
    ) -> None:
        esd_parameter_filter(train_method)
        if int(iterations) < 0 or int(ddim_steps) < 1 or int(k_closest) < 1 or int(pgd_num_steps) < 1:
            raise ConfigError(f"EAP needs iterations >= 0, ddim_steps >= 1, k_closest >= 1 and pgd_num_steps >= 1; "
                              f"got {iterations}, {ddim_steps}, {k_closest}, {pgd_num_steps}")
        if float(gumbel_temp) <= 0:
            raise ConfigError(f"EAP gumbel_temp must be > 0, got {gumbel_temp}")
        vocabulary = to_python(vocabulary)
        named = reference_data.token_name(vocabulary) is not None
        if isinstance(vocabulary, str) and vocabulary not in VOCABULARIES and not named:
            raise ConfigError(f"EAP vocabulary {vocabulary!r}: use 'tokenizer', a reference list ('<data:en3k>') "
                              "or a list of words")
        super().__init__(
            train_method=train_method, iterations=int(iterations), learning_rate=float(learning_rate),
            negative_guidance=float(negative_guidance), start_guidance=float(start_guidance),
            ddim_steps=int(ddim_steps), neutral_concepts=to_python(neutral_concepts), vocabulary=vocabulary,
            k_closest=int(k_closest), num_centers=int(num_centers), gumbel_lr=float(gumbel_lr),
            gumbel_temp=float(gumbel_temp), gumbel_hard=bool(gumbel_hard), pgd_num_steps=int(pgd_num_steps),
            preserve_weight=float(preserve_weight),
        )
        self.progress = bool(progress)
        # per concept: the candidate words and the final logits of the last erase (inspection, tests)
        self.candidates: dict[str, list[str]] = {}
        self.logits: dict[str, torch.Tensor] = {}

    def candidate_words(self, pipe: Any, concept: str) -> list[str]:
        """The preserved-concept candidates of ``concept`` (words of the concept itself excluded)."""
        hp = self.hparams
        own = {w.lower() for w in re.findall(r"[A-Za-z]+", concept)}
        words = [w for w in vocabulary_words(pipe.tokenizer, hp["vocabulary"]) if w.lower() not in own]
        if not words:
            raise ConfigError(f"EAP: no candidate word is left for {concept!r} once its own words are removed")
        return preserved_candidates(pipe, concept, words, hp["k_closest"], hp["num_centers"])

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Fine-tune ``pipe.unet`` in place: ESD erasure of ``concepts`` while preserving the
        adversarially chosen candidate concepts."""
        from diffusers import DDIMScheduler

        require_sd_pipeline(pipe, "EAP")
        concepts = check_concepts(concepts, pipe.tokenizer, method="EAP")
        hp = self.hparams
        neutral = for_domain(hp["neutral_concepts"], domain, what="EAP neutral_concepts")
        unet = pipe.unet
        device, dtype = unet.device, unet.dtype
        gen = cpu_generator(seed)

        cond = encode_text(pipe, concepts).float()
        uncond = encode_text(pipe, [for_concept(neutral, c, what="EAP neutral_concepts") for c in concepts]).float()
        blank = encode_text(pipe, [""]).float()
        self.candidates = {c: self.candidate_words(pipe, c) for c in concepts}
        matrices = [encode_text(pipe, self.candidates[c]).float() for c in concepts]  # (n_c, L, D) each
        logits = [torch.full((1, len(m)), 1.0 / len(m), device=device, requires_grad=True) for m in matrices]
        opt_adv = torch.optim.Adam(logits, lr=hp["gumbel_lr"])

        sampler = DDIMScheduler.from_config(pipe.scheduler.config)
        sampler.set_timesteps(hp["ddim_steps"], device="cpu")
        timesteps = sampler.timesteps.clone()
        size = unet.config.sample_size
        latent_shape = (1, unet.config.in_channels, size, size)
        eta, lam = hp["negative_guidance"], hp["preserve_weight"]

        frozen = copy.deepcopy(unet).requires_grad_(False).eval()
        with fp32_training(unet):
            params = train_only(unet, esd_parameter_filter(hp["train_method"]))
            opt = torch.optim.Adam(params.values(), lr=hp["learning_rate"])
            steps = hp["iterations"] * hp["pgd_num_steps"]
            bar = tqdm(range(steps), desc=f"EAP ({hp['train_method']})", disable=not self.progress)
            for step in bar:
                model_step = step % hp["pgd_num_steps"] == 0
                i = randint(len(concepts), gen)
                k = randint(hp["ddim_steps"], gen)
                z = randn(latent_shape, gen, device=device) * sampler.init_noise_sigma
                mix = gumbel_softmax(logits[i], hp["gumbel_temp"], hp["gumbel_hard"], gen)
                e_r = (mix @ matrices[i].to(device).flatten(1)).reshape(1, *matrices[i].shape[1:])
                t = timesteps[k].to(device)
                with torch.no_grad():
                    xr = ESDMethod._sample_until(unet, sampler, timesteps[:k], z, e_r.detach(), blank,
                                                 hp["start_guidance"], dtype)
                    with autocast(device, dtype):
                        r_frozen = frozen(xr.to(dtype), t, encoder_hidden_states=e_r.detach().to(dtype)).sample.float()
                    x0_r_target = predicted_x0(sampler, xr, r_frozen, t)
                if model_step:
                    with torch.no_grad():
                        xt = ESDMethod._sample_until(unet, sampler, timesteps[:k], z, cond[i : i + 1], blank,
                                                     hp["start_guidance"], dtype)
                        with autocast(device, dtype):
                            e_0 = frozen(xt.to(dtype), t, encoder_hidden_states=uncond[i : i + 1].to(dtype)).sample
                            e_p = frozen(xt.to(dtype), t, encoder_hidden_states=cond[i : i + 1].to(dtype)).sample
                        target = e_0.float() - eta * (e_p.float() - e_0.float())
                        x0_target = predicted_x0(sampler, xt, target, t)
                    with autocast(device, dtype):
                        e_n = unet(xt.float(), t, encoder_hidden_states=cond[i : i + 1]).sample.float()
                        e_rn = unet(xr.float(), t, encoder_hidden_states=e_r.detach()).sample.float()
                    erase_loss = F.mse_loss(predicted_x0(sampler, xt, e_n, t), x0_target)
                    keep_loss = F.mse_loss(predicted_x0(sampler, xr, e_rn, t), x0_r_target)
                    loss = erase_loss + lam * keep_loss
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    bar.set_postfix(erase=f"{erase_loss.item():.4g}", keep=f"{keep_loss.item():.4g}", k=k)
                else:
                    # the adversary: move the logits towards the candidate the model changes most
                    with autocast(device, dtype):
                        e_rn = unet(xr.float(), t, encoder_hidden_states=e_r).sample.float()
                    keep_loss = F.mse_loss(predicted_x0(sampler, xr, e_rn, t), x0_r_target)
                    (grad,) = torch.autograd.grad(-keep_loss, [logits[i]])
                    opt_adv.zero_grad(set_to_none=True)
                    logits[i].grad = grad
                    opt_adv.step()
        del frozen
        self.logits = {c: lg.detach().cpu()[0] for c, lg in zip(concepts, logits)}
        return pipe

    def preserved_concepts(self) -> dict[str, str]:
        """Per concept of the last erase: the candidate with the largest logit (the concept
        the adversary settled on)."""
        return {c: self.candidates[c][int(lg.argmax())] for c, lg in self.logits.items()}
