"""The registry: the one reader of ``conf/``.

Every component of a cell is a file in a config group (``conf/method/esd.yaml``) whose
``_target_`` names the class that implements it; a component's tiny-world or SD settings are a
preset beside it (``conf/preset/method/esd_tiny.yaml``). This module answers every question
about those files — which choices a group has, a component's config with the preset of a model
scale, the built component, the composed cell — so that nothing else in the harness opens a
path under ``conf/``::

    registry.choices("method")                       # ['advunlearn', 'ca', ...]
    registry.build("attacker", "p4d_n", scale="tiny")
    registry.compose(["method=esd", "concept=star"])  # the cell's DictConfig

**Components outside the package.** ``$EMMA_INCLUDE`` lists folders (``os.pathsep``
separated) laid out like ``conf/`` — ``method/toy.yaml``, ``classifier/toy.yaml`` — holding
the Python modules their ``_target_`` names at their top level. Their choices join the
groups (``method=toy`` on the command line, in ``--list``, in sweeps and Slurm jobs, which
inherit the environment), and the folder joins ``sys.path``. The contributor guides in
``docs/`` walk through one of each kind.

This module imports neither torch nor Hydra at import time, so listing and pre-flight
checks stay fast.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from emma.errors import ConfigError, UnknownChoiceError

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: The shipped config tree (the ``conf`` package).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
#: Folders of components outside the package (see the module docstring).
ENV_INCLUDE = "EMMA_INCLUDE"
#: The axes of a cell: config groups a command line chooses from.
GROUPS: tuple[str, ...] = ("model", "method", "domain", "attacker", "protocol", "classifier", "metrics",
                           "logger", "paths", "experiment", "llm")
#: Choices that exist for every group without a file (``experiment=null``).
NULL_CHOICES = ("null", "")
#: What ``--list`` prints, and the group each word lists.
LISTABLE: dict[str, str] = {"methods": "method", "attackers": "attacker", "domains": "domain",
                            "classifiers": "classifier", "models": "model", "metrics": "metrics",
                            "experiments": "experiment", "llms": "llm", "loggers": "logger",
                            "protocols": "protocol"}


# --------------------------------------------------------------------------- where configs live
def include_dirs() -> list[Path]:
    """The folders of ``$EMMA_INCLUDE``, each checked to exist (a typo is named, not ignored)."""
    raw = os.environ.get(ENV_INCLUDE, "")
    out = []
    for part in (p for p in raw.split(os.pathsep) if p.strip()):
        folder = Path(part).expanduser().resolve()
        if not folder.is_dir():
            raise ConfigError(f"${ENV_INCLUDE} names {part!r}, which is not a folder; give folders laid out "
                              "like conf/ (method/NAME.yaml, ...), separated by ':'")
        out.append(folder)
    return out


def conf_dirs() -> list[Path]:
    """Where configs are found, the package's first (a shipped name cannot be shadowed)."""
    return [CONF_DIR, *include_dirs()]


def activate_includes() -> list[Path]:
    """Put every include folder on ``sys.path`` (their modules are ``_target_``s); returns them."""
    folders = include_dirs()
    for folder in folders:
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
    return folders


def choices(group: str) -> list[str]:
    """The choices of a config group (``method`` -> ``['advunlearn', 'ca', ...]``), sorted."""
    names: set[str] = set()
    for root in conf_dirs():
        folder = root / group
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.yaml"))
    return sorted(names)


def is_group(group: str) -> bool:
    """Whether ``group`` is a config folder (an axis, or a group components compose, like ``llm``)."""
    return any((root / group).is_dir() for root in conf_dirs())


def check_choice(group: str, name: str, what: str | None = None) -> None:
    """Raise :class:`UnknownChoiceError` (with "did you mean") unless ``name`` is a choice of ``group``."""
    if name in NULL_CHOICES and group == "experiment":
        return
    valid = choices(group)
    if name not in valid:
        raise UnknownChoiceError(what or group, name, valid)


def config_path(group: str, name: str, what: str | None = None) -> Path:
    """The file of choice ``name`` in ``group``; :class:`UnknownChoiceError` when there is none."""
    for root in conf_dirs():
        path = root / group / f"{name}.yaml"
        if path.is_file():
            return path
    raise UnknownChoiceError(what or group, name, choices(group))


def preset_path(group: str, name: str, scale: str | None, domain: str | None = None) -> Path | None:
    """The preset of component ``name`` for a model scale (``preset/method/esd_tiny.yaml``), or
    with ``domain`` its preset for that scale and domain (``preset/method_domain/esd_sd_object.yaml``:
    a reference's per-domain settings), if any."""
    if not scale:
        return None
    folder, stem = (f"{group}_domain", f"{name}_{scale}_{domain}") if domain else (group, f"{name}_{scale}")
    for root in conf_dirs():
        path = root / "preset" / folder / f"{stem}.yaml"
        if path.is_file():
            return path
    return None


def preset_chain(group: str, name: str, scale: str, domain: str | None = None) -> list[DictConfig]:
    """The preset files of component ``name`` at ``scale`` (with ``domain``: its per-domain preset,
    ``preset/<group>_domain/<name>_<scale>_<domain>.yaml``) as written (``defaults`` kept): its
    own, then each preset it extends (a preset extends at most one other)."""
    from omegaconf import OmegaConf

    out = []
    folder = f"{group}_domain" if domain else group
    preset: str | None = f"{name}_{scale}_{domain}" if domain else f"{name}_{scale}"
    while preset is not None:
        path = next((r / "preset" / folder / f"{preset}.yaml" for r in conf_dirs()
                     if (r / "preset" / folder / f"{preset}.yaml").is_file()), None)
        if path is None:
            break
        node = OmegaConf.load(path)
        out.append(node)
        parents = [d for d in node.get("defaults", []) if d != "_self_"]
        preset = str(parents[0]) if parents else None
    return out


# --------------------------------------------------------------------------- one component
def load(group: str, name: str, *, scale: str | None = None, domain: str | None = None,
         overrides: Mapping[str, Any] | None = None, what: str | None = None) -> DictConfig:
    """A component's config as a cell composes it: the file, then the preset for ``scale``
    (when there is one), then the preset for ``scale`` and ``domain`` (when there is one), then
    ``overrides``; Hydra's ``defaults`` list is dropped.

    Args:
        group: config group (``method``, ``attacker``, ``classifier``, ``domain``, ...).
        name: the choice (file name without ``.yaml``).
        scale: model scale whose preset applies (``tiny``, ``sd``, ``sdxl``; ``None``: none).
        domain: the domain whose preset at ``scale`` applies (``object``; ``None``: none).
        overrides: values merged last (nested mappings merge key by key).
        what: how an unknown choice is named in the error (``"STACE tool attacker"``).
    """
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config_path(group, name, what))
    for preset in (preset_path(group, name, scale), preset_path(group, name, scale, domain) if domain else None):
        if preset is not None:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(preset))
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(dict(overrides)))
    if "defaults" in cfg:
        cfg.pop("defaults")
    return cfg


def build(group: str, name: str, *, scale: str | None = None, domain: str | None = None,
          overrides: Mapping[str, Any] | None = None, what: str | None = None) -> Any:
    """The component :func:`load` configures, instantiated (its ``_target_``)."""
    import hydra.utils
    from hydra.errors import InstantiationException

    from emma.errors import EmmaError

    activate_includes()
    cfg = load(group, name, scale=scale, domain=domain, overrides=overrides, what=what)
    try:
        return hydra.utils.instantiate(cfg, _convert_="all")
    except InstantiationException as err:  # Hydra wraps the constructor's own error
        cause = err.__cause__
        if isinstance(cause, EmmaError):
            raise cause from None
        first = str(cause or err).strip().splitlines()[0] if str(cause or err).strip() else type(err).__name__
        raise ConfigError(f"{group} {name!r} ({config_path(group, name)}) cannot be built: {first}") from None


# --------------------------------------------------------------------------- what conf/ resolves
_DOMAINS: dict[str, Any] = {}


def build_domain(domain_cfg: DictConfig) -> Any:
    """The Domain a ``conf/domain`` node builds (cached per config: suites read files)."""
    import hydra
    from omegaconf import OmegaConf

    key = OmegaConf.to_yaml(domain_cfg)
    if key not in _DOMAINS:
        _DOMAINS[key] = hydra.utils.instantiate(domain_cfg, _convert_="all")
    return _DOMAINS[key]


def other_concepts(domain: str, _root_: DictConfig) -> Any:
    """``${emma.other_concepts:tinyworld}``: every concept of domain ``domain`` except the
    cell's concept (the domain's default concept when ``concept`` is null).

    Presets use it for the concepts a method preserves or contrasts with, so that one preset
    serves every concept of a domain. The resolved list shows in ``--cfg job`` and
    results.json, and is hashed into the erased-model cache key with the method's config.
    """
    from omegaconf import ListConfig
    if _root_.domain.get("name") == domain:
        dcfg = _root_.domain
    else:
        dcfg = load("domain", domain, what="domain (in ${emma.other_concepts:...})")
    built = build_domain(dcfg)
    concept = _root_.get("concept")
    if concept is None and _root_.domain.get("name") == domain:
        concept = built.default_concept
    if concept is not None:
        try:
            concept = built.concept(concept).name
        except UnknownChoiceError:
            pass  # the cell's own concept check reports it
    return ListConfig([c for c in built.concepts if c != concept])


#: characters a sweep folder's name must not hold: glob patterns (``datasets``, ``fsspec`` and
#: shells read ``[...]``, ``*``, ``?`` and ``{...}`` as patterns), quotes, spaces, separators
_UNSAFE_IN_NAMES = re.compile(r"[\[\]{}*?'\"\s/\\$`!&;|<>()#~]")


def dirname(text: str) -> str:
    """A sweep job's folder name from its overrides (``${emma.dirname:${hydra.job.override_dirname}}``):
    a list value ``[name,random]`` becomes ``name+random``, and every other character a glob
    or a shell would read specially becomes ``_``."""
    text = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1).replace(",", "+"), str(text))
    return _UNSAFE_IN_NAMES.sub("_", text)


def register_configs() -> None:
    """Register what conf/ needs before Hydra composes it: the ``${emma.other_concepts:...}``
    and ``${emma.dirname:...}`` resolvers and the structured-config schemas (:mod:`emma.config`)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from emma.config import PathsConfig, RunConfig
    from emma.model_config import ModelConfig

    if not OmegaConf.has_resolver("emma.other_concepts"):
        OmegaConf.register_new_resolver("emma.other_concepts", other_concepts)
    if not OmegaConf.has_resolver("emma.dirname"):
        OmegaConf.register_new_resolver("emma.dirname", dirname)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="paths", name="paths_schema", node=PathsConfig)


def classifier_config(cfg: DictConfig, name: str | None, domain: Any) -> DictConfig:
    """The classifier config: the ``classifier`` group's choice, or — when that choice is
    ``auto`` — the file ``conf/classifier/<name>.yaml`` the domain asks for, with keys added
    on the command line (``+classifier.threshold=0.6``) merged in."""
    from omegaconf import OmegaConf
    ccfg = cfg.classifier
    if ccfg.get("_target_") is None:
        if name == "auto" or name not in choices("classifier"):
            valid = [c for c in choices("classifier") if c != "auto"]
            raise UnknownChoiceError(f"classifier (asked for by domain '{domain.name}')", str(name), valid)
        base = load("classifier", name)
        overrides = {k: v for k, v in OmegaConf.to_container(ccfg).items() if k != "name"}
        ccfg = OmegaConf.merge(base, overrides)
    return ccfg



# --------------------------------------------------------------------------- whole cells
def searchpath_override() -> list[str]:
    """The Hydra override that adds the include folders to Hydra's config search path
    (``[]`` without ``$EMMA_INCLUDE``)."""
    folders = include_dirs()
    if not folders:
        return []
    return ["hydra.searchpath=[" + ",".join(f"file://{f}" for f in folders) + "]"]


@contextlib.contextmanager
def hydra_context() -> Iterator[None]:
    """Hydra's global state set to conf/ (a no-op inside a running Hydra app, which has it)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    activate_includes()
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="run"):
        yield


def compose(overrides: Sequence[str] = (), *, config_name: str = "config",
            return_hydra_config: bool = False) -> DictConfig:
    """Compose one cell from command-line overrides, as ``python -m emma.run`` does.

    Raises Hydra's own errors; :func:`emma.validate.compose_cell` turns them into one line
    each for the command line.
    """
    from hydra import compose as hydra_compose

    with hydra_context():
        return hydra_compose(config_name=config_name,
                             overrides=[*searchpath_override(), *overrides],
                             return_hydra_config=return_hydra_config)


def preset_choices(runtime_choices: Mapping[str, Any]) -> dict[str, str]:
    """The presets a composed cell merged (``{"method": "esd_tiny", "scale": "tiny"}``), from
    Hydra's ``runtime.choices``; an optional preset with no file is left out."""
    out = {}
    for key, value in runtime_choices.items():
        if key.startswith("preset/") and value:
            group = key.split("/", 1)[1]
            if any((root / key / f"{value}.yaml").is_file() for root in conf_dirs()):
                out[group] = str(value)
    scale = runtime_choices.get("scale@_global_")
    return {**out, "scale": str(scale)} if scale else out


# --------------------------------------------------------------------------- listing
def listing(what: str, domain: str | None = None) -> str:
    """What ``python -m emma.run --list WHAT`` prints: one choice a line with its one-line
    description (the first comment line of its file), or a domain's concepts."""
    if what == "concepts":
        built = build("domain", domain or "tinyworld")
        default = getattr(built, "default_concept", None)
        return "\n".join(f"{c}{'  (default)' if c == default else ''}" for c in built.concepts)
    if what not in LISTABLE:
        raise UnknownChoiceError("listing", what, [*LISTABLE, "concepts"], "--list")
    group = LISTABLE[what]
    rows = [(name, _summary(config_path(group, name))) for name in choices(group)]
    width = max((len(n) for n, _ in rows), default=0)
    return "\n".join(f"{n:<{width}}  {s}".rstrip() for n, s in rows)


def _summary(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if text.startswith("#") and not text.startswith("# @package"):
            return text.lstrip("#").strip()
        if text and not text.startswith("#"):
            break
    return ""
