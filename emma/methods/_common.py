"""Building blocks shared by the erasure methods.

Input checks, per-domain guide/anchor look-ups, text encoding, seeded sampling of training
data, the cross-attention processor that records attention probabilities (FMN, MACE) and
carries LoRA deltas (MACE), parameter selection and fp32 master-weight training. Everything
here edits pipeline *components*; nothing subclasses or patches the pipeline.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from emma.api.domain import Domain
from emma.api.method import OTHERS
from emma.config import to_python
from emma.errors import ConfigError, UnknownChoiceError
from emma.methods import reference_data

DEFAULT_DOMAIN = "default"
PER_CONCEPT_DEFAULT = "_default"
# Domains whose concepts are looks rather than things (MACE trains them without masks and
# with style prompt templates, as the MACE repository does for artists).
STYLE_DOMAINS = ("style", "tinyworld_style")


# --------------------------------------------------------------------------- config values
def domain_name(domain: Domain | str | None) -> str | None:
    """The name per-domain hyper-parameter tables are keyed by: the Domain's name (a bare name
    is taken as is, for table look-ups outside an erasure), or ``None``."""
    if domain is None or isinstance(domain, str):
        return domain
    if not isinstance(domain, Domain):
        raise TypeError(f"domain must be an emma.api.domain.Domain (e.g. emma.domains.load_domain('tinyworld')) "
                        f"or None, got {domain!r} ({type(domain).__name__})")
    return domain.name


def is_style_domain(domain: Domain | str | None) -> bool:
    """Whether ``domain``'s concepts are looks rather than things (:data:`STYLE_DOMAINS`)."""
    return domain_name(domain) in STYLE_DOMAINS


def for_domain(mapping: Any, domain: Domain | str | None, *, what: str) -> Any:
    """The entry of a per-domain mapping (``{object: ..., style: ..., default: ...}``).

    Args:
        mapping: a dict keyed by domain name; a plain string or list applies to every domain.
        domain: the domain being erased, or its name (``None`` -> the ``default`` entry).
        what: the hyper-parameter's name, for the error message.

    A ``"<data:NAME>"`` token in the entry (or spliced in a list) is replaced by that
    reference data set (:mod:`emma.methods.reference_data`).
    """
    name = domain_name(domain)
    if not isinstance(mapping, Mapping):
        return reference_data.resolve(mapping)
    key = DEFAULT_DOMAIN if name is None else name
    if key in mapping:
        return reference_data.resolve(mapping[key])
    if DEFAULT_DOMAIN in mapping:
        return reference_data.resolve(mapping[DEFAULT_DOMAIN])
    raise UnknownChoiceError(f"domain for {what} (add an entry for it, or a 'default' entry)",
                             key, mapping.keys())


def domain_template(mapping: Any, domain: Domain | str | None, *, what: str) -> str:
    """:func:`for_domain`'s entry for a prompt template: a string with exactly one ``{}`` (the
    concept); anything else is a :class:`ConfigError` naming ``what`` and the domain."""
    template = for_domain(mapping, domain, what=what)
    if not isinstance(template, str) or template.count("{}") != 1:
        raise ConfigError(f"{what} for domain {domain_name(domain)!r} must be a string with one '{{}}' "
                          f"(the concept), got {template!r}")
    return template


def for_concept(value: Any, concept: str, *, what: str) -> Any:
    """Resolve a per-concept value: a string, or ``{concept: value, _default: value}``."""
    if not isinstance(value, Mapping):
        return value
    if concept in value:
        return value[concept]
    low = {str(k).lower(): v for k, v in value.items()}
    if concept.lower() in low:
        return low[concept.lower()]
    if PER_CONCEPT_DEFAULT in value:
        return value[PER_CONCEPT_DEFAULT]
    raise ConfigError(f"{what} has no entry for concept {concept!r} and no '{PER_CONCEPT_DEFAULT}' "
                      f"entry; known concepts: {', '.join(sorted(map(str, value)))}")


def domain_hparams(hparams: dict[str, Any], overrides: Any, domain: Domain | None) -> dict[str, Any]:
    """``hparams`` updated with ``overrides[<domain name>]`` (per-domain defaults of a reference repo)."""
    out = dict(hparams)
    name = domain_name(domain)
    if overrides and name is not None and name in overrides:
        extra = dict(overrides[name])
        unknown = sorted(set(extra) - set(hparams))
        if unknown:
            raise ConfigError(f"domain_overrides.{name} sets unknown hyper-parameters {unknown}; "
                              f"valid: {', '.join(sorted(hparams))}")
        out.update(extra)
    return out


# --------------------------------------------------------------------------- input checks
def require_sd_pipeline(pipe: Any, method: str) -> None:
    """Methods edit SD v1.x/2.x-style pipelines (one CLIP text encoder + UNet)."""
    missing = [c for c in ("unet", "text_encoder", "tokenizer") if getattr(pipe, c, None) is None]
    if missing:
        raise ConfigError(f"{method} needs a pipeline with unet, text_encoder and tokenizer; "
                          f"this {type(pipe).__name__} lacks {', '.join(missing)}")
    if getattr(pipe, "text_encoder_2", None) is not None:
        raise ConfigError(f"{method} is implemented for single-text-encoder pipelines (SD v1.x/2.x); "
                          f"{type(pipe).__name__} (SDXL) is not supported yet")


def check_concepts(concepts: Any, tokenizer: Any, *, method: str) -> list[str]:
    """Validate the concept list; return it as a list of stripped strings.

    Raises :class:`ConfigError` for an empty list, a bare string, a non-string, a duplicate,
    a concept that tokenizes to nothing or only to unknown tokens, or one too long for the
    tokenizer's context.
    """
    if isinstance(concepts, str):
        raise ConfigError(f"{method}: concepts must be a list of strings, got the string {concepts!r}; "
                          f"use [{concepts!r}]")
    concepts = list(to_python(concepts) or [])
    if not concepts:
        raise ConfigError(f"{method}: the concept list is empty; give at least one concept to erase, "
                          "e.g. concepts=['circle']")
    out: list[str] = []
    for c in concepts:
        if not isinstance(c, str):
            raise ConfigError(f"{method}: concepts must be strings, got {c!r} ({type(c).__name__})")
        s = c.strip()
        if s in out:
            raise ConfigError(f"{method}: concept {s!r} is listed twice")
        ids = token_ids(tokenizer, s)
        if not ids:
            raise ConfigError(f"{method}: concept {c!r} tokenizes to nothing; give a word or phrase "
                              "the text encoder can read")
        unk = getattr(tokenizer, "unk_token_id", None)
        specials = {unk, getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None),
                    getattr(tokenizer, "pad_token_id", None)} - {None}
        if all(i in specials for i in ids):
            raise ConfigError(f"{method}: concept {c!r} tokenizes only to unknown/special tokens {ids}; "
                              "the text encoder cannot represent it")
        limit = int(getattr(tokenizer, "model_max_length", 77)) - 2
        if len(ids) > limit:
            raise ConfigError(f"{method}: concept {c[:40]!r}... is {len(ids)} tokens long; the text "
                              f"encoder reads at most {limit}")
        out.append(s)
    return out


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without start/end tokens."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def concept_positions(tokenizer: Any, prompt: str, concept: str, *, use_pooler: bool,
                      pooler: str = "all") -> torch.Tensor:
    """Bool mask (model_max_length,) over the padded prompt's tokens that spell ``concept``.

    With ``use_pooler`` the end-of-text tokens are included too. ``pooler="all"`` takes every
    token equal to end-of-text: with the SD v1.x tokenizer, whose padding token *is*
    end-of-text, that is every position after the prompt (what the MACE repository does on
    SD v1.4). ``pooler="first"`` takes only the end token itself, the pooled token (what FMN
    does on SD 2.1, whose tokenizer pads with "!").
    """
    n = int(tokenizer.model_max_length)
    ids = list(tokenizer(prompt, padding="max_length", max_length=n, truncation=True).input_ids)
    cids = token_ids(tokenizer, concept)
    pos = torch.zeros(n, dtype=torch.bool)
    for i in range(n - len(cids) + 1):
        if ids[i : i + len(cids)] == cids:
            pos[i : i + len(cids)] = True
    if use_pooler:
        eos = tokenizer.eos_token_id
        ends = torch.tensor([t == eos for t in ids])
        if pooler == "first" and ends.any():
            ends = torch.zeros_like(ends).index_fill_(0, ends.nonzero()[0], True)
        elif pooler not in ("first", "all"):
            raise ConfigError(f"pooler must be 'first' or 'all', got {pooler!r}")
        pos |= ends
    if not pos.any():
        raise ConfigError(f"concept {concept!r} does not occur in prompt {prompt!r} token by token")
    return pos


# --------------------------------------------------------------------------- text encoding
@torch.no_grad()
def encode_text(pipe: Any, prompts: Sequence[str]) -> torch.Tensor:
    """Last hidden states ``(N, model_max_length, D)`` of the pipeline's text encoder."""
    tok = pipe.tokenizer
    ids = tok(list(prompts), padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids
    enc = pipe.text_encoder
    return enc(ids.to(enc.device))[0]


# --------------------------------------------------------------------------- randomness
def cpu_generator(seed: int) -> torch.Generator:
    """All random draws of the methods come from CPU generators (device-independent)."""
    return torch.Generator(device="cpu").manual_seed(int(seed))


def randn(shape: Sequence[int], generator: torch.Generator, like: torch.Tensor | None = None,
          device: Any = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
    if like is not None:
        return t.to(like.device, like.dtype)
    return t.to(device=device, dtype=dtype or torch.float32)


def randint(high: int, generator: torch.Generator, low: int = 0) -> int:
    return int(torch.randint(low, high, (1,), generator=generator).item())


# --------------------------------------------------------------------------- parameters
def attn2_modules(unet: nn.Module) -> list[tuple[str, nn.Module]]:
    """The cross-attention modules (``...attn2``) of a UNet, in named-module order."""
    from diffusers.models.attention_processor import Attention

    out = [(n, m) for n, m in unet.named_modules() if n.endswith("attn2") and isinstance(m, Attention)]
    if not out:
        raise ConfigError(f"{type(unet).__name__} has no cross-attention ('attn2') modules")
    return out


def train_only(module: nn.Module, keep: Callable[[str], bool]) -> dict[str, nn.Parameter]:
    """Make exactly the parameters for which ``keep(name)`` holds require gradients, and return
    them by name; error if none. The others are frozen, so that backward passes compute no
    weight gradients for them (pipelines load with every parameter requiring gradients)."""
    out = {n: p for n, p in module.named_parameters() if keep(n)}
    if not out:
        raise ConfigError("the parameter selection matched no UNet parameter")
    module.requires_grad_(False)
    for p in out.values():
        p.requires_grad_(True)
    return out


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter (for restoring on failure / comparing)."""
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@contextlib.contextmanager
def fp32_training(module: nn.Module) -> Iterator[nn.Module]:
    """Train in fp32 master weights and cast back (fp16/bf16 pipelines on GPUs).

    Parameters that training does not touch survive the round trip bit for bit (fp16/bf16
    -> fp32 -> fp16/bf16 is exact). On an exception the module is restored exactly.
    """
    dtype = next(module.parameters()).dtype
    backup = snapshot(module)
    was_training = module.training
    try:
        if dtype != torch.float32:
            _cast(module, torch.float32)
        module.eval()  # SD has no dropout/batch-norm at train time that matters; keep it exact
        yield module
    except BaseException:
        with torch.no_grad():
            _cast(module, dtype)
            for n, p in module.named_parameters():
                p.copy_(backup[n])
        raise
    finally:
        module.requires_grad_(False)
        module.train(was_training)
        if dtype != torch.float32:
            _cast(module, dtype)


def _cast(module: nn.Module, dtype: torch.dtype) -> None:
    # nn.Module.to, not diffusers' ModelMixin.to, which warns on every dtype cast; the round
    # trip restores the dtype the pipeline was loaded with.
    nn.Module.to(module, dtype)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Half-precision autocast on GPUs for fp16/bf16 pipelines; a no-op on CPUs."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return torch.autocast(device_type="cuda", dtype=dtype)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- sampling
@torch.no_grad()
def generate_latents(
    pipe: Any,
    prompts: Sequence[str],
    seeds: Sequence[int],
    *,
    num_inference_steps: int,
    guidance_scale: float,
    batch_size: int = 8,
    progress: bool = False,
    desc: str = "generate",
    negative_prompts: Sequence[str] | None = None,
) -> torch.Tensor:
    """Generate ``x_0`` latents (scaled as the UNet sees them), one CPU generator per image
    (``negative_prompts``: one per prompt, or ``None`` for the unconditional prompt)."""
    from tqdm.auto import tqdm

    out = []
    for s in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress, leave=False):
        gens = [cpu_generator(x) for x in seeds[s : s + batch_size]]
        extra = {} if negative_prompts is None else {"negative_prompt": list(negative_prompts[s : s + batch_size])}
        res = pipe(prompt=list(prompts[s : s + batch_size]), generator=gens, output_type="latent",
                   num_inference_steps=int(num_inference_steps), guidance_scale=float(guidance_scale), **extra)
        out.append(res.images.float().cpu())
    return torch.cat(out)


@torch.no_grad()
def decode_latents(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """Latents -> images in [0, 1], ``(N, 3, H, W)`` float32 on the CPU."""
    vae = pipe.vae
    x = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
    img = vae.decode(x).sample
    return (img.float() / 2 + 0.5).clamp(0, 1).cpu()


def training_scheduler(pipe: Any) -> Any:
    """The DDPM noise schedule of the pipeline (``add_noise`` / ``prediction_type``)."""
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_config(pipe.scheduler.config)


def diffusion_target(scheduler: Any, latents: torch.Tensor, noise: torch.Tensor,
                     timesteps: torch.Tensor) -> torch.Tensor:
    """What the UNet should predict for ``latents`` noised with ``noise`` at ``timesteps``."""
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ConfigError(f"unsupported prediction_type {kind!r}; valid: epsilon, v_prediction")


def mace_importance_weights(num_train_timesteps: int, temperature: float = 0.05) -> torch.Tensor:
    """MACE's relation-focal importance sampling density over timesteps (peaks in 200..400)."""
    t = torch.arange(num_train_timesteps, dtype=torch.float64)
    f = 1 / (1 + torch.exp(-temperature * (t - 200))) - 1 / (1 + torch.exp(-temperature * (t - 400)))
    return f / f.sum()


# --------------------------------------------------------------------------- cross-attention
class LoRADelta(nn.Module):
    """A low-rank update ``x -> up(down(x))`` (``down`` ~ N(0, 1/rank), ``up`` = 0 at init)."""

    def __init__(self, in_features: int, out_features: int, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.randn(rank, in_features, generator=generator) / rank)
        self.up = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.down.t().to(x.dtype)) @ self.up.t().to(x.dtype)

    def delta_weight(self) -> torch.Tensor:
        return self.up @ self.down


class CrossAttnRecorder:
    """Receives the attention probabilities of every cross-attention call.

    ``callback(name, probs, batch_size)`` is called with ``probs`` of shape
    ``(batch * heads, queries, tokens)`` (with gradients) while ``active``.
    """

    def __init__(self, callback: Callable[[str, torch.Tensor, int], None]) -> None:
        self.callback = callback
        self.active = True


class Attn2Processor:
    """Cross-attention as diffusers' ``AttnProcessor`` computes it, plus two hooks: the
    attention probabilities go to a :class:`CrossAttnRecorder`, and optional LoRA deltas are
    added to the key and value projections."""

    def __init__(self, name: str, recorder: CrossAttnRecorder | None = None,
                 lora_k: LoRADelta | None = None, lora_v: LoRADelta | None = None) -> None:
        self.name = name
        self.recorder = recorder
        self.lora_k = lora_k
        self.lora_v = lora_v

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            b, c, h, w = hidden_states.shape
            hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        if self.lora_k is not None:
            key = key + self.lora_k(encoder_hidden_states)
        if self.lora_v is not None:
            value = value + self.lora_v(encoder_hidden_states)
        query = attn.head_to_batch_dim(query)
        key = attn.head_to_batch_dim(key)
        value = attn.head_to_batch_dim(value)
        probs = attn.get_attention_scores(query, key, attention_mask)
        if self.recorder is not None and self.recorder.active:
            self.recorder.callback(self.name, probs, batch_size)
        hidden_states = torch.bmm(probs, value)
        hidden_states = attn.batch_to_head_dim(hidden_states)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


@contextlib.contextmanager
def attn2_processors(unet: nn.Module, make: Callable[[str, nn.Module], Any]) -> Iterator[dict[str, Any]]:
    """Temporarily give every cross-attention module of ``unet`` the processor ``make(name, module)``;
    the original processors are put back on exit (the UNet leaves exactly as it came)."""
    mods = attn2_modules(unet)
    originals = {n: m.processor for n, m in mods}
    procs = {}
    try:
        for n, m in mods:
            procs[n] = make(n, m)
            m.set_processor(procs[n])
        yield procs
    finally:
        for n, m in mods:
            m.set_processor(originals[n])


def attention_side(num_queries: int, height: int, width: int) -> tuple[int, int]:
    """Spatial (h, w) of a cross-attention map with ``num_queries`` pixels for a latent of
    ``height`` x ``width``."""
    scale = math.sqrt(height * width / num_queries)
    h, w = round(height / scale), round(width / scale)
    if h * w != num_queries:
        raise ValueError(f"cannot lay {num_queries} queries out on a {height}x{width} latent")
    return h, w


# --------------------------------------------------------------------------- domain concepts


def domain_concept_names(domain: Domain | None) -> list[str]:
    """The concepts of ``domain`` as prompts write them (their labels: "Vincent van Gogh" for
    ``vincent-van-gogh``), in its order (what ``"<others>"`` expands from)."""
    if domain is None:
        raise ConfigError(f"'{OTHERS}' stands for the domain's other concepts, but no domain was given; "
                          "pass the Domain being erased (domain=...) or list the concepts by name")
    if not isinstance(domain, Domain):
        raise ConfigError(f"'{OTHERS}' needs the Domain object, not {domain!r}, to know its concepts; build "
                          "it with emma.domains.load_domain(name)")
    return [domain.concept(name).label for name in domain.concepts]


def erased_spellings(erased: Sequence[str], domain: Domain | None) -> set[str]:
    """Lower-cased spellings of the erased concepts: each as given and, when ``domain`` knows
    it, its name, label and aliases (a reference list may spell an artist otherwise)."""
    low = {c.lower() for c in erased}
    if isinstance(domain, Domain):
        for c in erased:
            try:
                concept = domain.concept(c)
            except (KeyError, ConfigError):
                continue
            low |= {t.lower() for t in (concept.name, concept.label, *concept.aliases) if t}
    return low


def expand_others(names: Any, domain: Domain | None, erased: Sequence[str]) -> list[str]:
    """A list of concept names with ``"<others>"`` replaced by the domain's concepts that are
    not erased and ``"<data:NAME>"`` by a reference list; erased concepts (in any spelling the
    domain knows) are dropped from the result either way (order kept, no duplicates)."""
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    names = reference_data.resolve(list(names))
    low = erased_spellings(erased, domain)
    out: list[str] = []
    for n in names:
        items = domain_concept_names(domain) if n == OTHERS else [n]
        for x in items:
            if x.lower() not in low and x not in out:
                out.append(x)
    return out
