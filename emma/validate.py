"""Validation before work: every setting of a cell (and of every cell of a sweep) is checked
against typed, bounded rules before a model loads, and every problem is reported at once,
one line each (key, value, what is valid).

Two entry points:

- :func:`validate_cell` / :func:`check_cell`: a composed cell config (``DictConfig``) ->
  the list of :class:`Violation` / an :class:`InvalidConfigError` listing them. ``run_cell``
  calls :func:`check_cell` first, so every caller (CLI, SLURM job, test) gets it.
- :func:`validate_overrides`: command-line overrides (``concept=circle,hexagon``) -> compose
  every cell of the sweep with Hydra's compose API and validate it; raises before any job
  starts, naming the offending cell. ``python -m emma.run`` calls it before Hydra starts;
  launchers that bypass the CLI call it themselves.

Hydra's own composition errors (a misspelt key, a value of the wrong type, an override that
does not parse, ``+group=choice`` of a group that is not an axis) become violations too, with
"did you mean" over the keys of that node instead of Hydra's ``+key`` advice.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from emma import registry
from emma.api.types import EA_TYPES, RA_TYPES
from emma.config import to_python
from emma.errors import ConfigError, EmmaError, UnknownChoiceError, WeightsUnavailableError, first_line
from emma.seeds import MAX_CELL_SEED as SEEDS_MAX_CELL

#: Upper bounds that keep a typo (``images_per_prompt=1000000000``) from eating the machine.
MAX_IMAGES_PER_PROMPT = 10_000
MAX_BATCH_SIZE = 4_096
MAX_INFERENCE_STEPS = 1_000
MAX_SIZE = 8_192
#: A seed handed to a generator as it is: torch's CPU generator (Mersenne Twister) keeps only
#: a seed's low 32 bits, so 2**32 would draw what 0 draws.
MAX_SEED = 2**32 - 1
#: The cell seed. Image seeds hash it (:mod:`emma.seeds`: every derived seed is below 2**32,
#: so none wraps); erasure methods and the bootstrap use it directly, some with offsets added
#: (an LLM baseline's probe j: attacker seed + j), so half the 32-bit range leaves them room.
MAX_CELL_SEED = SEEDS_MAX_CELL
SEED_BOUND = (" (torch's CPU generator keeps a seed's low 32 bits; the cell seed and the offsets erasure adds "
              "to it stay below 2**32)")
#: torch CPU threads of a cell.
MAX_THREADS = 1_024
PROMPT_TYPES: tuple[str, ...] = (*EA_TYPES, *RA_TYPES)
BIAS_ATTRIBUTES: tuple[str, ...] = ("colour", "gender", "ethnicity")
MODEL_KINDS = ("diffusers", "tinyworld", "tiny_random")
DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")

# Hyper-parameters of methods, attackers and classifiers, bounded by name wherever they occur.
POSITIVE_INTS = {"iterations", "batch_size", "train_batch_size", "sample_steps", "max_train_steps",
                 "ddim_steps", "image_size", "top_k", "num_images", "num_class_images", "rank",
                 "max_faces", "face_size", "max_train_steps_ti", "train_batch_size_ti", "num_tokens_ti"}
POSITIVE_FLOATS = {"learning_rate", "lr", "max_grad_norm", "learning_rate_ti"}
NONNEGATIVE = {"adam_weight_decay", "lamb", "prior_loss_weight", "sample_guidance", "start_guidance",
               "erase_scale", "weight_decay_ti", "init_sigma_ti"}
SEEDS = {"seed"}  # a component's first seed (an attacker's probe j uses seed + j)
UNIT_INTERVAL = {"threshold", "attention_mask_threshold"}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One invalid setting.

    Args:
        key: dotted config key (``model.batch_size``), or the override as typed.
        value: the offending value.
        valid: what would be valid (a range, the choices, a hint).
        message: the whole line, when it reads better than ``key=value: valid``.
    """

    key: str
    value: Any
    valid: str
    message: str | None = None

    def line(self) -> str:
        return self.message or f"{self.key}={_show(self.value)}: {self.valid}"


class InvalidConfigError(ConfigError):
    """One or more invalid settings, reported together (one line each)."""

    def __init__(self, violations: Sequence[Violation], where: str = "") -> None:
        self.violations = list(violations)
        self.where = where
        super().__init__(self.__str__())

    def __str__(self) -> str:
        lines = [v.line() for v in self.violations]
        where = f" ({self.where})" if self.where else ""
        if len(lines) == 1:
            return f"{lines[0]}{where}"
        return f"{len(lines)} invalid settings{where}:\n" + "\n".join(f"  {line}" for line in lines)


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    if isinstance(value, list):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)


def _did_you_mean(given: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(given), list(valid), n=3, cutoff=0.5)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


# --------------------------------------------------------------------------- value rules
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_in(out: list[Violation], key: str, v: Any, lo: int, hi: int, extra: str = "") -> None:
    if not _is_int(v) or not lo <= v <= hi:
        out.append(Violation(key, v, f"must be an integer in [{lo}, {hi:,}]{extra}"))


def _float_in(out: list[Violation], key: str, v: Any, lo: float, hi: float | None = None,
              lo_open: bool = False) -> None:
    ok = _is_number(v) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        hi_s = f"{hi}]" if hi is not None else "inf)"
        out.append(Violation(key, v, f"must be a finite number in {lo_s}, {hi_s}"))


def _nonempty_str(out: list[Violation], key: str, v: Any, what: str) -> bool:
    if not isinstance(v, str) or not v.strip():
        out.append(Violation(key, v, f"must be a non-empty string ({what})"))
        return False
    return True


def _enum(out: list[Violation], key: str, v: Any, valid: Sequence[str], allow_null: bool = False) -> None:
    if v is None and allow_null:
        return
    if v not in valid:
        out.append(Violation(key, v, f"{_did_you_mean(str(v), valid)}valid: "
                                     f"{', '.join(valid)}{' or null' if allow_null else ''}"))


def _get(node: Any, key: str, default: Any = None) -> Any:
    try:
        return node.get(key, default) if node is not None else default
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve
        return default


# --------------------------------------------------------------------------- sections
def _check_missing(cfg: DictConfig, out: list[Violation]) -> None:
    """``???`` values; ``method=checkpoint`` without a path gets its own message."""
    for key in sorted(OmegaConf.missing_keys(cfg)):
        if key == "method.path":
            out.append(Violation("method.path", "???", "method=checkpoint needs method.path=/path/to/erased "
                                 "(a diffusers pipeline or component folder, or a .safetensors/.pt/.ckpt "
                                 "state dict)"))
        else:
            out.append(Violation(key, "???", "required: give a value on the command line"))


def _check_finite(node: Any, prefix: str, out: list[Violation]) -> None:
    """No NaN or inf anywhere: Hydra parses ``nan``/``inf`` as floats."""
    if isinstance(node, dict):
        for k, v in node.items():
            _check_finite(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_finite(v, f"{prefix}[{i}]", out)
    elif isinstance(node, float) and not math.isfinite(node):
        out.append(Violation(prefix, node, "must be a finite number"))


def _check_root(cfg: DictConfig, out: list[Violation]) -> None:
    concept = _get(cfg, "concept")
    if concept is not None and (not isinstance(concept, str) or not concept.strip()):
        out.append(Violation("concept", concept, "must be a concept name of the domain, or null for the "
                                                 "domain's default (an empty value is not a concept)"))
    _int_in(out, "seed", _get(cfg, "seed"), 0, MAX_CELL_SEED, SEED_BOUND)
    threads = _get(cfg, "threads")
    if threads is not None:
        _int_in(out, "threads", threads, 1, MAX_THREADS, " or null (torch's default)")
    ipp = _get(cfg, "images_per_prompt")
    if ipp is not None:
        _int_in(out, "images_per_prompt", ipp, 1, MAX_IMAGES_PER_PROMPT, " or null (the domain's default)")
    evidence = _get(cfg, "evidence_images")
    if evidence is not None:
        _int_in(out, "evidence_images", evidence, 0, 10**6, " or null (every judged image)")
    types = to_python(_get(cfg, "prompt_types"))
    if types is not None:
        if not isinstance(types, list) or not types:
            out.append(Violation("prompt_types", types, f"a non-empty list of {', '.join(PROMPT_TYPES)}, "
                                                        "or null for every type"))
        else:
            unknown = [str(t) for t in types if t not in PROMPT_TYPES]
            if unknown:
                hints = "".join(_did_you_mean(t, PROMPT_TYPES) for t in unknown)
                out.append(Violation("prompt_types", types, f"unknown prompt type(s) {', '.join(map(repr, unknown))}; "
                                     f"{hints}valid: {', '.join(PROMPT_TYPES)}"))
            dupes = sorted({t for t in types if types.count(t) > 1})
            if dupes:
                out.append(Violation("prompt_types", types, f"{', '.join(map(str, dupes))} listed twice"))
    overwrite = _get(cfg, "overwrite", False)
    if not isinstance(overwrite, bool):
        out.append(Violation("overwrite", overwrite, "true or false"))


def _check_model(model: Any, out: list[Violation]) -> None:
    if model is None:
        return
    kind = _get(model, "kind")
    _enum(out, "model.kind", kind, MODEL_KINDS)
    if kind == "diffusers":
        pretrained = _get(model, "pretrained")
        from emma.model_config import PIPELINE_CLASSES, check_local_pretrained

        if _nonempty_str(out, "model.pretrained", pretrained, "a hub id or a local folder"):
            try:  # a local folder is checked now: a sweep refuses it before any job starts
                check_local_pretrained(pretrained, _get(model, "pipeline_class"))
            except WeightsUnavailableError as err:
                out.append(Violation("model.pretrained", pretrained, str(err), message=str(err)))
        _enum(out, "model.pipeline_class", _get(model, "pipeline_class"), PIPELINE_CLASSES)
    from emma.model_config import DTYPE_NAMES, SCHEDULERS

    _enum(out, "model.dtype", _get(model, "dtype"), list(DTYPE_NAMES))
    _enum(out, "model.scheduler", _get(model, "scheduler"), SCHEDULERS, allow_null=True)
    device = _get(model, "device")
    if not isinstance(device, str) or not DEVICE.match(device):
        out.append(Violation("model.device", device, "cpu, cuda, cuda:N or mps"))
    elif device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            out.append(Violation("model.device", device, "no CUDA device is available here; use model.device=cpu"))
    _int_in(out, "model.num_inference_steps", _get(model, "num_inference_steps"), 1, MAX_INFERENCE_STEPS)
    _float_in(out, "model.guidance_scale", _get(model, "guidance_scale"), 0.0, 100.0)
    for side in ("height", "width"):
        v = _get(model, side)
        if not _is_int(v) or not 8 <= v <= MAX_SIZE or v % 8:
            out.append(Violation(f"model.{side}", v, f"must be a multiple of 8 in [8, {MAX_SIZE}] "
                                                     "(the VAE and UNet downsample by 8)"))
    _int_in(out, "model.batch_size", _get(model, "batch_size"), 1, MAX_BATCH_SIZE)
    _int_in(out, "model.init_seed", _get(model, "init_seed", 0), 0, MAX_SEED)
    neg = _get(model, "negative_prompt")
    if neg is not None and not isinstance(neg, str):
        out.append(Violation("model.negative_prompt", neg, "a string or null"))


def _check_metrics(metrics: Any, out: list[Violation]) -> None:
    if metrics is None:
        return
    fid, bias = _get(metrics, "fid"), _get(metrics, "bias")
    for name, node in (("fid", fid), ("bias", bias)):
        if node is not None and not isinstance(_get(node, "enabled"), bool):
            out.append(Violation(f"metrics.{name}.enabled", _get(node, "enabled"), "true or false"))
    if fid is not None:
        _nonempty_str(out, "metrics.fid.reference", _get(fid, "reference"), "a reference statistics name")
        _int_in(out, "metrics.fid.n_ref", _get(fid, "n_ref"), 2, 1_000_000, " (a covariance needs 2)")
        _int_in(out, "metrics.fid.reference_seed", _get(fid, "reference_seed"), 0, MAX_SEED)
    if bias is not None:
        attrs = to_python(_get(bias, "attributes"))
        if attrs is not None:
            if not isinstance(attrs, list) or not attrs:
                out.append(Violation("metrics.bias.attributes", attrs,
                                     f"a non-empty list of {', '.join(BIAS_ATTRIBUTES)}, or null"))
            else:
                for a in attrs:
                    if a not in BIAS_ATTRIBUTES:
                        out.append(Violation("metrics.bias.attributes", attrs, f"unknown attribute {a!r}; "
                                             f"{_did_you_mean(str(a), BIAS_ATTRIBUTES)}valid: "
                                             f"{', '.join(BIAS_ATTRIBUTES)}"))
        _int_in(out, "metrics.bias.images_per_prompt", _get(bias, "images_per_prompt"), 1, 1_000)
        _int_in(out, "metrics.bias.n_resamples", _get(bias, "n_resamples"), 1, 1_000_000)


def _check_cache(paths: Any, out: list[Violation]) -> None:
    cache_dir = _get(paths, "cache_dir")
    if not _nonempty_str(out, "paths.cache_dir", cache_dir, "the cache folder; or set $EMMA_CACHE"):
        return
    root = Path(cache_dir).expanduser()
    above = next((p for p in (root, *root.parents) if p.exists()), None)
    if above is not None and not above.is_dir():
        where = "it is a file" if above == root else f"it is inside {above}, which is a file"
        out.append(Violation("paths.cache_dir", cache_dir, f"cannot write there: {where}; give a folder "
                                                           "(or set $EMMA_CACHE)"))
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write-check-", suffix=".tmp"):
            pass
    except OSError as err:
        out.append(Violation("paths.cache_dir", cache_dir, f"cannot write there ({err.strerror or err}); "
                                                           "set $EMMA_CACHE or paths.cache_dir to a writable folder"))


def _target_params(target: str) -> tuple[list[str] | None, str | None]:
    """Keyword parameters of a ``_target_`` (``None``: it takes ``**kwargs``), or an error."""
    module, _, attr = str(target).rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        return None, f"cannot import {target} ({type(err).__name__}: {err})"
    fn = obj.__init__ if inspect.isclass(obj) else obj
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None, None
    return [p.name for p in params if p.name != "self"], None


def _check_hparams(node: Any, prefix: str, out: list[Violation]) -> None:
    """Name-bounded hyper-parameters, anywhere in a component node."""
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}.{k}"
            if isinstance(v, (dict, list)):
                _check_hparams(v, key, out)
            elif v is None or isinstance(v, str):
                continue
            elif k in POSITIVE_INTS:
                _int_in(out, key, v, 1, 10**9)
            elif k in SEEDS:
                _int_in(out, key, v, 0, MAX_CELL_SEED, SEED_BOUND)
            elif k in POSITIVE_FLOATS:
                _float_in(out, key, v, 0.0, lo_open=True)
            elif k in NONNEGATIVE:
                _float_in(out, key, v, 0.0)
            elif k in UNIT_INTERVAL:
                _float_in(out, key, v, 0.0, 1.0)


def _check_component(group: str, node: Any, out: list[Violation]) -> None:
    """Keys of a ``_target_`` node against the constructor's parameters, then value bounds."""
    if node is None:
        return
    plain = to_python(node)
    _check_keys(group, plain, out)
    _check_hparams(plain, group, out)


def _check_keys(group: str, plain: Any, out: list[Violation]) -> None:
    """Keys of a ``_target_`` node (plain Python) against the constructor's parameters."""
    target = plain.get("_target_") if isinstance(plain, dict) else None
    if target:
        params, err = _target_params(target)
        if err:
            out.append(Violation(f"{group}._target_", target, err))
        elif params is not None:
            for key in plain:
                if key.startswith("_") or key in params:
                    continue
                out.append(Violation(f"{group}.{key}", plain[key], f"unknown key of {group} "
                                     f"({target.rsplit('.', 1)[-1]}); {_did_you_mean(key, params)}"
                                     f"valid keys: {', '.join(params)}"))


def _check_domain_and_classifier(cfg: DictConfig, out: list[Violation]) -> None:
    """Instantiate the domain (cheap: no prompt files are read) to check the concept, and
    bound the judge's settings (the domain's judge when ``classifier=auto``)."""
    import hydra

    before = len(out)
    _check_keys("domain", to_python(cfg.domain), out)  # a key added with +domain.KEY=...
    if len(out) > before:
        return  # the domain cannot be built with it
    try:
        domain = hydra.utils.instantiate(cfg.domain, _convert_="all")
    except Exception as err:  # noqa: BLE001 - reported as a violation, not a traceback
        cause = err.__cause__ if isinstance(err.__cause__, EmmaError) else err
        out.append(Violation("domain", _get(cfg.domain, "name", "?"), f"cannot be built: {first_line(cause)}"))
        return
    concept = _get(cfg, "concept")
    name = concept if concept is not None else domain.default_concept
    if isinstance(name, str) and name.strip():
        try:
            domain.concept(name)
        except UnknownChoiceError as err:
            out.append(Violation("concept", name, f"valid: {', '.join(err.valid)}", message=str(err)))
    classifier = _get(cfg, "classifier")
    if classifier is None:
        return
    if _get(classifier, "_target_") is None:  # auto: the domain's judge(s) with the overrides merged
        from emma.registry import classifier_config

        names = {domain.classifier, *(v for m in getattr(domain, "classifier_overrides", {}).values()
                                      for v in m.values())}
        for cname in sorted(names):
            try:
                ccfg = classifier_config(cfg, cname, domain)
            except UnknownChoiceError as err:
                out.append(Violation("classifier", cname, str(err)))
                continue
            before = len(out)
            _check_component("classifier", ccfg, out)
            for v in out[before:]:
                object.__setattr__(v, "valid", f"{v.valid} (judge '{cname}' of domain '{domain.name}')")
    else:
        _check_component("classifier", classifier, out)


def _check_protocol(node: Any, out: list[Violation]) -> None:
    """The attack protocol's keys and values (:mod:`emma.protocol`)."""
    if node is None:
        return
    from emma.protocol import check

    try:
        check(node)
    except ConfigError as err:
        out.append(Violation("protocol", "", "", message=first_line(err)))


def validate_cell(cfg: DictConfig) -> list[Violation]:
    """Every violation of a composed cell config (empty when it can run)."""
    out: list[Violation] = []
    _check_missing(cfg, out)
    if out:  # an unresolved ``???`` makes the rest unreadable
        return out
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except Exception as err:  # noqa: BLE001 - an interpolation that does not resolve
        return [Violation("config", "?", f"does not resolve: {first_line(err)}")]
    plain.pop("hydra", None)
    _check_finite(plain, "", out)
    _check_root(cfg, out)
    _check_model(_get(cfg, "model"), out)
    _check_metrics(_get(cfg, "metrics"), out)
    _check_cache(_get(cfg, "paths"), out)
    for group in ("method", "attacker"):
        _check_component(group, _get(cfg, group), out)
    _check_protocol(_get(cfg, "protocol"), out)
    if _get(cfg, "domain") is not None:
        _check_domain_and_classifier(cfg, out)
    seen: set[str] = set()
    unique = []
    for v in out:  # the first problem of each key (a NaN is not also "out of range")
        if v.key not in seen:
            seen.add(v.key)
            unique.append(v)
    return unique


def without_hydra(cfg: DictConfig) -> DictConfig:
    """The cell's own config: ``cfg`` without Hydra's node (which resolves only in a job)."""
    return OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])


def check_cell(cfg: DictConfig) -> None:
    """Raise :class:`InvalidConfigError` listing every violation of ``cfg``."""
    violations = validate_cell(cfg)
    if violations:
        raise InvalidConfigError(violations)


# --------------------------------------------------------------------------- overrides
HYDRA_FLAGS_WITH_VALUE = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                          "--experimental-rerun")


def _node_keys(cfg: DictConfig, dotted: str) -> list[str]:
    """Keys of the node that holds ``dotted``; for a ``_target_`` node, its constructor's
    parameters too."""
    parent = dotted.rpartition(".")[0]
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return []
    keys = {str(k) for k in node.keys() if str(k) != "hydra"}
    target = node.get("_target_") if "_target_" in node else None
    if target:
        params, _ = _target_params(str(target))
        keys = (keys | set(params or [])) - {"_target_"}
    return sorted(keys)


def _parse_each(overrides: Sequence[str], out: list[Violation]) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    good = []
    for ov in overrides:
        try:
            parser.parse_overrides([ov])
        except Exception as err:  # noqa: BLE001 - Hydra's grammar errors have several types
            msg = first_line(err)
            out.append(Violation(ov.split("=", 1)[0], ov.split("=", 1)[1] if "=" in ov else "",
                                 f"does not parse ({msg}); quote values with spaces or brackets, "
                                 "e.g. 'concept=\"a b\"'"))
            continue
        good.append(ov)
    return good


def _check_repeats(overrides: Sequence[str], out: list[Violation]) -> None:
    """A key set twice (``concept=circle concept=star``): Hydra would keep the last silently."""
    values: dict[str, list[str]] = {}
    for ov in overrides:
        key, eq, value = ov.partition("=")
        if eq and not key.startswith("~"):
            values.setdefault(key.lstrip("+"), []).append(value)
    for key, given in values.items():
        if len(given) > 1:
            shown = ", ".join(f"{key}={_show(v)}" for v in given)
            out.append(Violation(key, given, "", message=f"{key} is given {len(given)} times ({shown}); give it "
                                 f"once (a sweep takes one override with the values joined: -m {key}=a,b)"))


def _check_groups(overrides: Sequence[str], out: list[Violation]) -> list[str]:
    """Unknown choices of config groups (``method=esdd``), with "did you mean"."""
    good = []
    for ov in overrides:
        if "=" not in ov:
            good.append(ov)
            continue
        key, value = ov.split("=", 1)
        bare = key.lstrip("+~")
        group = bare.split("@")[0]
        if group in registry.GROUPS and not (group == "experiment" and value in registry.NULL_CHOICES):
            valid = registry.choices(group)
            bad = [c for c in value.split(",") if c and c != "null" and c not in valid]
            if bad:
                for c in bad:
                    err = UnknownChoiceError(group, c, valid)
                    out.append(Violation(group, c, f"valid: {', '.join(valid)}", message=str(err)))
                continue
        elif key.startswith("+") and "." not in bare and "/" not in group and registry.is_group(group):
            out.append(Violation(key, value, f"'{group}' is not an axis of a cell (conf/{group} configures "
                                             "a component that uses it, not the cell); axes: "
                                             f"{', '.join(registry.GROUPS)}"))
            continue
        good.append(ov)
    return good


def compose_cell(overrides: Sequence[str], out: list[Violation], config_name: str = "config",
                 return_hydra_config: bool = False) -> DictConfig | None:
    """Compose one cell (:func:`emma.registry.compose`), turning each composition error into a
    violation and retrying without the offending override, so that every problem is
    reported at once. ``None`` when no config could be composed. A cell without errors is
    composed once."""
    def compose(overrides: Sequence[str]) -> DictConfig:
        return registry.compose(overrides, config_name=config_name, return_hydra_config=return_hydra_config)

    overrides = _check_groups(_parse_each(list(overrides), out), out)
    base: DictConfig | None = None
    for _ in range(len(overrides) + 1):
        try:
            cfg = compose(overrides)
            _check_added_keys(overrides, cfg, out, compose)
            return cfg
        except EmmaError as err:  # an include folder that does not exist, ...
            out.append(Violation("", None, "", message=str(err)))
            return None
        except Exception as err:  # noqa: BLE001 - Hydra raises several exception types
            if base is None:
                base = _compose_base(overrides, compose)
            culprit, violation = _explain_compose_error(err, overrides, base)
            out.append(violation)
            if culprit is None:
                return None
            overrides = [o for o in overrides if o != culprit]
    return None


def _check_added_keys(overrides: Sequence[str], cfg: DictConfig, out: list[Violation], compose: Any) -> None:
    """``+key=value`` / ``++key=value`` adds a key Hydra's struct mode would refuse as a
    misspelling: it is refused the same way (valid keys, "did you mean"), unless the node
    takes it. A node takes a key its ``_target_``'s constructor names, or any key when the
    constructor takes ``**kwargs``; a mapping inside a component (an attacker's ``roles``,
    ``prices``) is that component's argument, free-form; ``classifier=auto`` merges added keys
    into the domain's judge, checked against it by :func:`validate_cell`; Hydra's own node is
    Hydra's. The ``method``, ``attacker``, ``classifier`` and ``domain`` nodes are left to
    :func:`validate_cell`, which checks every key of them."""
    added = []
    for ov in overrides:
        key, eq, value = ov.partition("=")
        bare = key.lstrip("+")
        if not key.startswith("+") or not eq or "@" in bare or "/" in bare or bare.split(".")[0] == "hydra":
            continue
        if "." not in bare and registry.is_group(bare):
            continue  # +group=choice: _check_groups
        added.append((key, bare, value))
    base: DictConfig | None = None
    for key, bare, value in added:
        parent, _, leaf = bare.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not isinstance(node, DictConfig) or parent in ("method", "attacker", "classifier", "domain"):
            continue
        parts = parent.split(".") if parent else []
        if any("_target_" in (OmegaConf.select(cfg, ".".join(parts[:i])) or {}) for i in range(1, len(parts))):
            continue  # a mapping argument of a component
        if "_target_" in node:
            params, _ = _target_params(str(node["_target_"]))
            if params is None or leaf in params:
                continue
            valid = params
        else:
            if key.startswith("++"):  # ++ also sets a key that exists: was it there before?
                if base is None:
                    base = compose([o for o in overrides if not o.startswith("++")])
                before = OmegaConf.select(base, parent) if parent else base
                if isinstance(before, DictConfig) and leaf in before:
                    continue
            valid = [str(k) for k in node.keys() if str(k) != "hydra" and str(k) != leaf]
        where = f"'{parent}'" if parent else "the top level"
        out.append(Violation(bare, value, f"unknown key (a leading '+' adds only a setting its component "
                                          f"takes); {_did_you_mean(leaf, valid)}valid keys at {where}: "
                                          f"{', '.join(sorted(valid))}"))


def _compose_base(overrides: Sequence[str], compose: Any) -> DictConfig | None:
    """The config with only the group choices applied (to list the keys of a node)."""
    groups = [o for o in overrides if o.split("=", 1)[0].lstrip("+~").split("@")[0] in registry.GROUPS]
    try:
        return compose(groups)
    except Exception:  # noqa: BLE001
        try:
            return compose([])
        except Exception:  # noqa: BLE001
            return None


def _explain_compose_error(err: BaseException, overrides: Sequence[str],
                           base: DictConfig | None) -> tuple[str | None, Violation]:
    text = str(err)
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None) or getattr(err, "full_key", None)
    m = re.search(r"override '?([^'\s]+?)'?(?:\.|$|\s)", text.splitlines()[0] if text else "")
    culprit = None
    key = full_key or (m.group(1).split("=", 1)[0] if m else None)
    if key is not None:
        for ov in overrides:
            if ov.split("=", 1)[0].lstrip("+~") == key:
                culprit = ov
                break
    if culprit is None:  # "In 'llm/openai': ..." — a group added with +group=choice
        m2 = re.match(r"In '([^/']+)/([^']+)'", text)
        if m2:
            for ov in overrides:
                if ov.lstrip("+~").split("=", 1)[0].split("@")[0] == m2.group(1):
                    culprit, key = ov, m2.group(1)
    value = culprit.split("=", 1)[1] if culprit and "=" in culprit else None
    name = (culprit.split("=", 1)[0] if culprit else key) or "override"
    m3 = re.search(r"Could not append to config\. An item is already at '([^']+)'", text)
    if m3:
        key = m3.group(1)
        culprit = next((o for o in overrides if o.split("=", 1)[0] in (f"+{key}", f"+{key}@_global_")), None)
        value = culprit.split("=", 1)[1] if culprit else None
        return culprit, Violation(key, value, "", message=f"+{key}={_show(value)}: {key} is already a setting; "
                                                          f"set it without the '+': {key}={_show(value)}")
    if cause is not None and type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError") or \
            "not in struct" in text or "not in '" in text:
        valid = _node_keys(base, key) if base is not None and key else []
        where = f"'{key.rpartition('.')[0]}'" if key and "." in key else "the top level"
        hint = _auto_judge_hint(base, key, value)
        if hint:
            return culprit, Violation(name, value, hint)
        if not valid:
            return culprit, Violation(name, value, f"unknown key; {where} takes no settings")
        return culprit, Violation(name, value, f"unknown key; {_did_you_mean(key.rpartition('.')[2], valid)}"
                                               f"valid keys at {where}: {', '.join(sorted(valid))}")
    if cause is not None and type(cause).__name__ == "ValidationError":
        return culprit, Violation(name, value, first_line(cause).replace("Value ", "value ", 1))
    return culprit, Violation(name, value, first_line(err))


def _auto_judge_hint(base: DictConfig | None, key: str | None, value: Any) -> str | None:
    """For ``classifier.KEY=V`` with ``classifier=auto`` (which takes no settings): the message
    that names the domain's concrete judge, whose settings KEY belongs to."""
    if base is None or not key or not key.startswith("classifier.") or key.count(".") != 1:
        return None
    node = OmegaConf.select(base, "classifier")
    if not isinstance(node, DictConfig) or "_target_" in node:
        return None
    judge = OmegaConf.select(base, "domain.classifier", default=None)
    domain = OmegaConf.select(base, "domain.name", default="?")
    if not judge:
        return None
    leaf = key.split(".", 1)[1]
    return (f"unknown key: classifier=auto takes no settings of its own; it stands for the domain's judge "
            f"(domain '{domain}': '{judge}'), so name the judge to set its {leaf}: classifier={judge} "
            f"classifier.{leaf}={_show(value)}")


def is_multirun(argv: Sequence[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in argv) or "hydra.mode=MULTIRUN" in argv


def sweeper_params(overrides: Sequence[str], config_name: str = "config") -> list[str]:
    """The sweep an experiment file declares (``hydra.sweeper.params``) as overrides, for the
    keys the command line does not set itself (the command line wins, as in Hydra's sweeper)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        given = {o.get_key_element() for o in OverridesParser.create().parse_overrides(list(overrides))}
        cfg = registry.compose(overrides, config_name=config_name, return_hydra_config=True)
        params = cfg.hydra.sweeper.get("params") or {}
    except Exception:  # noqa: BLE001 - a composition error is reported by the cell checks
        return []
    return [f"{k}={v}" for k, v in params.items() if k not in given and v is not None]


def cell_overrides(overrides: Sequence[str], multirun: bool, config_name: str = "config") -> list[list[str]]:
    """The cells of a command line: one for a run, the cartesian product for a sweep (with the
    sweep an experiment file declares)."""
    if not multirun:
        return [list(overrides)]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [*sweeper_params(overrides, config_name), *overrides]
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [cell for batch in BasicSweeper.split_arguments(parsed, None) for cell in batch]


def _finished(cfg: DictConfig) -> bool:
    """A cell whose inputs (configuration, harness code, local files) hash to a stored result
    ran before with this very configuration: the component checks, which import every
    component's module (torch), are skipped so that serving it stays fast (emma/finished.py)."""
    from omegaconf.errors import OmegaConfBaseException

    from emma import finished

    try:
        return finished.entry(cfg) is not None
    except (OSError, ValueError, TypeError, OmegaConfBaseException, EmmaError):
        return False  # an unresolvable or unreadable input: the checks below name it


def validate_overrides(overrides: Sequence[str], multirun: bool = False, config_name: str = "config", *,
                       defer: bool = False) -> DictConfig | None:
    """Compose and validate every cell of a command line before any job starts.

    Args:
        overrides: Hydra overrides as typed (``concept=circle,hexagon``, ``-m`` removed).
        multirun: expand sweeps (``a,b``, ``range()``) into cells.
        config_name: the primary config.
        defer: one cell (not a sweep) that composes cleanly is returned unvalidated, with
            its ``hydra`` node: the caller validates it once, after its finished-cell lookup
            (:func:`emma.stages.setup.setup`). Composition errors are still reported here,
            with every violation of the rest.

    Returns:
        The composed cell when ``defer`` (else ``None``).

    Raises:
        InvalidConfigError: listing every violation; for a sweep, per offending cell.
    """
    problems: list[Violation] = []
    good = _check_groups(_parse_each(list(overrides), problems), problems)
    _check_repeats(good, problems)
    if problems:  # grammar and group-choice errors are the same for every cell: report them with
        # what else the remaining overrides get wrong, leaving out keys of the groups in question
        bad = {v.key.lstrip("+~").split(".")[0].split("@")[0] for v in problems}
        found: list[Violation] = []
        cfg = compose_cell(good if not multirun else cell_overrides(good, True, config_name)[0], found, config_name)
        if cfg is not None:
            found += validate_cell(cfg)
        problems += [v for v in found if v.key.lstrip("+~").split(".")[0].split("[")[0] not in bad]
        raise InvalidConfigError(problems)
    if defer and not multirun:
        found = []
        cfg = compose_cell(good, found, config_name, return_hydra_config=True)
        if cfg is not None and not found:
            return cfg
        if cfg is not None:
            found += validate_cell(without_hydra(cfg))
        raise InvalidConfigError(found)
    cells = cell_overrides(good, multirun, config_name)
    memo: dict[tuple[str, ...], list[Violation]] = {}
    bad_cells: list[tuple[int, list[str], list[Violation]]] = []
    for i, cell in enumerate(cells):
        relevant = tuple(o for o in cell if not o.lstrip("+~").startswith("hydra"))
        if relevant not in memo:
            found: list[Violation] = []
            cfg = compose_cell(cell, found, config_name)
            if cfg is not None and not _finished(cfg):
                found += validate_cell(cfg)
            memo[relevant] = found
        if memo[relevant]:
            bad_cells.append((i, cell, memo[relevant]))
    if not bad_cells:
        return None
    if not multirun:
        raise InvalidConfigError(bad_cells[0][2])
    lines = []
    for i, cell, found in bad_cells:
        swept = [o for o in cell if o not in overrides or "," in o]
        label = " ".join(o for o in cell if o.split("=", 1)[0] in _swept_keys(overrides)) or " ".join(swept)
        for v in found:
            lines.append(Violation(f"cell #{i} ({label}): {v.key}", v.value, v.valid,
                                   message=f"cell #{i} ({label}): {v.message}" if v.message else None))
    raise InvalidConfigError(lines, where=f"{len(bad_cells)} of {len(cells)} cells; no job was started")


def _swept_keys(overrides: Sequence[str]) -> set[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.get_key_element() for o in parsed if o.is_sweep_override()}


def split_argv(argv: Sequence[str]) -> tuple[list[str], bool, bool]:
    """``(overrides, multirun, checkable)``: Hydra flags other than ``-m`` (``--cfg``,
    ``--help``, ``--config-name``) leave the command to Hydra (``checkable`` false)."""
    overrides, checkable = [], True
    for a in argv:
        if a in ("-m", "--multirun"):
            continue
        if a.startswith("-"):
            checkable = False
            continue
        overrides.append(a)
    return overrides, is_multirun(argv), checkable


def check_output_dirs(overrides: Sequence[str], multirun: bool) -> None:
    """Before Hydra starts (it writes ``.hydra/`` into the run directory): refuse an explicit
    ``hydra.run.dir`` that holds results.json unless ``overwrite=true``. A ``hydra.sweep.dir``
    is not refused: running a sweep again into its folder resumes it, and each finished cell
    keeps its results.json (emma/run.py). Default directories carry a timestamp."""
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    for k in ("hydra.run.dir", "hydra.sweep.dir"):
        if k in values and not values[k].strip().strip("'\""):  # Hydra would write into the current folder
            raise ConfigError(f"{k}={values[k]!r} is empty; give a folder (or leave {k} out for a new "
                              "timestamped one)")
    folder = values.get(key)
    if folder and "$" not in folder:
        check_writable_dir(key, folder)
    if values.get("overwrite", "false").lower() == "true" or multirun:
        return  # a sweep run again into its folder resumes it: finished cells keep their results
    if not folder or "$" in folder:
        return
    found = sorted(Path(folder).expanduser().rglob("results.json")) if multirun else \
        [p for p in [Path(folder).expanduser() / "results.json"] if p.exists()]
    if found:
        raise ConfigError(
            f"{key}={folder} already holds results.json of an earlier "
            f"{'sweep' if multirun else 'cell'} ({found[0]}{', ...' if len(found) > 1 else ''}); choose another "
            f"{key}, or add overwrite=true to replace it")


def check_writable_dir(key: str, folder: str) -> None:
    """Refuse an output folder that is a file, or under a file, or that cannot be created or
    written (Hydra would fail with a traceback when it writes ``.hydra/`` there)."""
    path = Path(folder).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={folder} is a file; give a folder")
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={folder} is inside {existing}, which is a file; give a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "read-only" if existing == path else f"{existing} is read-only"
        raise ConfigError(f"cannot write to {key}={folder} ({reason}); give a folder you can write to")


def check_output_dir(output_dir: str | os.PathLike, overwrite: bool) -> None:
    """Refuse a run directory that already holds a finished cell's ``results.json``."""
    results = Path(output_dir) / "results.json"
    if results.exists() and not overwrite:
        raise ConfigError(
            f"hydra.run.dir={output_dir} already holds results.json of an earlier cell; choose another "
            "hydra.run.dir, or add overwrite=true to replace it")
