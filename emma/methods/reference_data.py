"""Reference data of the erasure methods: the word lists, prompt lists, templates and mappings
their papers ran with, each with its provenance.

A method's config names a set as ``"<data:NAME>"`` wherever it takes a list or a mapping
(``preserve_concepts: {style: ["<data:artists1734>"]}``, ``vocabulary: "<data:en3k>"``); the
per-domain look-ups of :mod:`emma.methods._common` replace the token by the set's contents.
Two kinds of set:

- **shipped**: small lists whose licence allows it live in ``emma/methods/data/`` (source,
  commit, licence and sha256 in ``emma/methods/data/PROVENANCE.md``, checked by the tests);
- **pinned**: lists whose licence does not allow redistribution (or that say nothing) are
  pinned downloads (:mod:`emma.datasets.download`: a file at a fixed commit, checked by
  sha256, cached under ``$EMMA_CACHE``), fetched on first use or ahead of time with
  ``python -m emma.suites download set=NAME``. Offline, a set that is not cached stops the
  cell before any work with an error naming the set and that command.

``python -m emma.suites download set=all`` fetches every pinned set (an unknown name lists them all).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from emma.datasets.download import DataUnavailableError, RemoteFile, fetch
from emma.errors import ConfigError, UnknownChoiceError, first_line

#: Where the shipped sets live.
DATA_DIR = Path(__file__).resolve().parent / "data"
_TOKEN = re.compile(r"^<data:([A-Za-z0-9_]+)>$")

MACE_REPO, MACE_COMMIT = "Shilin-LU/MACE", "057e7a6edadc6bbb5ca94700f416372e35bed083"
EAP_REPO, EAP_COMMIT = "tuananhbui89/Erasing-Adversarial-Preservation", "7222925bc31348c00ed0896eb3148acf2d669d7d"
CA_REPO, CA_COMMIT = "nupurkmr9/concept-ablation", "c11fb1bdc7cd97ea65877b0d41722f5e3ef2561f"


# --------------------------------------------------------------------------- parsers
def parse_lines(data: bytes) -> list[str]:
    """One entry per non-empty line (``#`` starts a comment line)."""
    out = []
    for line in data.decode("utf-8").splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            out.append(s)
    return out


def parse_yaml_mapping(data: bytes) -> dict[str, Any]:
    import yaml

    value = yaml.safe_load(data.decode("utf-8"))
    if not isinstance(value, dict):
        raise ConfigError("a reference mapping file must hold a YAML mapping")
    return {str(k): v for k, v in value.items()}


def csv_column(column: str) -> Callable[[bytes], list[str]]:
    """A parser returning one CSV column, in file order, blanks dropped."""
    def parse(data: bytes) -> list[str]:
        import pandas as pd

        frame = pd.read_csv(io.BytesIO(data), keep_default_na=False)
        if column not in frame.columns:
            raise ConfigError(f"the CSV has no column {column!r}; columns: {', '.join(map(str, frame.columns))}")
        return [str(v).strip() for v in frame[column] if str(v).strip()]
    parse.__qualname__ = f"csv_column({column!r})"
    return parse


def mace_templates(concept_type: str) -> Callable[[bytes], list[str]]:
    """A parser of MACE's ``src/cfr_utils.py`` returning the prompt templates of
    ``prompt_augmentation`` for ``concept_type`` (``object`` or ``style``), each with ``{}``
    for the concept. The source is read as text (:mod:`ast`), never run."""
    def parse(data: bytes) -> list[str]:
        tree = ast.parse(data.decode("utf-8"))
        func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                     and n.name == "prompt_augmentation"), None)
        if func is None:
            raise ConfigError("MACE's cfr_utils.py has no prompt_augmentation function")
        for node in ast.walk(func):
            if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
                continue
            right = node.test.comparators[0] if node.test.comparators else None
            if not (isinstance(right, ast.Constant) and right.value == concept_type):
                continue
            out = []
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.List):
                    for item in stmt.value.elts:
                        call = item.elts[0] if isinstance(item, ast.Tuple) and item.elts else None
                        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                                and isinstance(call.func.value, ast.Constant)):
                            out.append(str(call.func.value.value))
            if out:
                return out
        raise ConfigError(f"MACE's cfr_utils.py has no {concept_type!r} templates in prompt_augmentation")
    parse.__qualname__ = f"mace_templates({concept_type!r})"
    return parse


# --------------------------------------------------------------------------- the sets
@dataclasses.dataclass(frozen=True)
class ReferenceSet:
    """One reference list or mapping.

    Args:
        name: the name configs use (``"<data:NAME>"``).
        description: what it is and whose.
        file: a shipped file under ``emma/methods/data/`` (or ``None``).
        remote: a pinned download (or ``None``); exactly one of ``file`` / ``remote``.
        parse: bytes -> the list or mapping.
        licence: the licence the source is under (why it is shipped or downloaded).
    """

    name: str
    description: str
    file: str | None = None
    remote: RemoteFile | None = None
    parse: Callable[[bytes], Any] = parse_lines
    licence: str = ""

    @property
    def shipped(self) -> bool:
        return self.file is not None

    def path(self) -> Path:
        """The local file (fetched first for a pinned set)."""
        if self.file is not None:
            return DATA_DIR / self.file
        assert self.remote is not None
        return fetch(self.remote)


def _pinned(name: str, repo: str, commit: str, path: str, sha256: str, description: str,
            parse: Callable[[bytes], Any], licence: str) -> ReferenceSet:
    return ReferenceSet(name, description, remote=RemoteFile(repo, commit, path, sha256, description),
                        parse=parse, licence=licence)


_MACE_SHA = "195ba39ca0995c17d97b04c41bd2cb1ed5cccd314b7ecbd37a19e274b9444f81"
_MACE_LICENCE = "NTUitive non-commercial licence: downloaded, not redistributed"

#: Every reference set, by name.
SETS: dict[str, ReferenceSet] = {s.name: s for s in (
    ReferenceSet("artists1734", "UCE's 1,734 artists (data/artists1734_prompts.csv, column artist): the "
                 "artists UCE and RECE preserve when erasing a style", file="artists1734.txt", licence="MIT"),
    ReferenceSet("advunlearn_coco_object_retain", "AdvUnlearn's 243 COCO-object retain prompts "
                 "(data/prompts/train/coco_object_retain.csv, column prompt)",
                 file="advunlearn_coco_object_retain.txt", licence="CC BY 4.0"),
    ReferenceSet("coco_supercategories", "EMMA's COCO classes -> their COCO super-category (CA anchors)",
                 file="coco_supercategories.yaml", parse=parse_yaml_mapping, licence="CC BY 4.0 (COCO)"),
    _pinned("en3k", EAP_REPO, EAP_COMMIT, "data/english_3000.csv",
            "9a49188d55cebd1a6c4b47bfbb247555e4e1a737e0ccf782c9286fdd8ae63534",
            "EAP's 3,000 English words (EN3K), its candidate vocabulary", csv_column("word"),
            "no licence stated: downloaded, not redistributed"),
    _pinned("mace_templates_object", MACE_REPO, MACE_COMMIT, "src/cfr_utils.py", _MACE_SHA,
            "MACE's 31 object prompt templates (src/cfr_utils.py, prompt_augmentation)",
            mace_templates("object"), _MACE_LICENCE),
    _pinned("mace_templates_style", MACE_REPO, MACE_COMMIT, "src/cfr_utils.py", _MACE_SHA,
            "MACE's 31 style prompt templates (src/cfr_utils.py, prompt_augmentation)",
            mace_templates("style"), _MACE_LICENCE),
    _pinned("coco_captions_30k", "rohitgandikota/erasing", "25613d27892326e0c7770f7f3555bea4be150089",
            "data/coco_30k.csv", "42c57b188c8f1f8a77cddfa11cde89e83fcbdd4dcd4fc6c840fb4e046d395383",
            "30,000 COCO captions (ESD's data/coco_30k.csv, column prompt): MACE's prior cache", csv_column("prompt"),
            "MIT repository, COCO captions CC BY 4.0; 2.3 MB: downloaded, not shipped"),
    _pinned("ca_captions_painting", CA_REPO, CA_COMMIT, "assets/finetune_prompts/painting.txt",
            "2a6814db785536abe83ed83a1d8031a0f5018a96ccf50034904837c913350db7",
            "Concept Ablation's 199 painting captions (anchor prompts for styles)", parse_lines,
            "MIT repository of third-party (LAION) captions: downloaded, not redistributed"),
    _pinned("ca_captions_people", CA_REPO, CA_COMMIT, "assets/finetune_prompts/people.txt",
            "899e849cd10466048049749bb255d03ba505a63c2dfcd8c6d9fb52863ea53ac2",
            "Concept Ablation's 203 people captions (anchor prompts for nudity)", parse_lines,
            "MIT repository of third-party (LAION) captions: downloaded, not redistributed"),
)}


# --------------------------------------------------------------------------- reading
def reference_set(name: str) -> ReferenceSet:
    """The set called ``name`` (:class:`UnknownChoiceError` naming the valid ones)."""
    if name not in SETS:
        raise UnknownChoiceError("reference data set", name, SETS, "<data:...>")
    return SETS[name]


def fetch_command(name: str) -> str:
    """The command that fetches set ``name`` ahead of time."""
    return f"python -m emma.suites download set={name}"


def local_path(name: str) -> Path:
    """The local file of set ``name``; a pinned set not cached offline raises
    :class:`DataUnavailableError` naming the set and the command that fetches it."""
    ref = reference_set(name)
    try:
        return ref.path()
    except DataUnavailableError as err:
        raise DataUnavailableError(
            f"reference data '{name}' is needed and not here: {first_line(err)} "
            f"Fetch it where the network is reachable with: {fetch_command(name)}") from None


@functools.lru_cache(maxsize=64)
def _load(name: str, path: str, size: int, mtime: float) -> Any:
    return reference_set(name).parse(Path(path).read_bytes())


def load(name: str) -> Any:
    """The contents of set ``name``: a list of strings or a mapping (a fresh copy)."""
    path = local_path(name)
    stat = path.stat()
    value = _load(name, str(path), stat.st_size, stat.st_mtime)
    return dict(value) if isinstance(value, dict) else list(value)


def token_name(value: Any) -> str | None:
    """``"en3k"`` for the string ``"<data:en3k>"``, else ``None``."""
    if isinstance(value, str):
        m = _TOKEN.match(value.strip())
        if m:
            return m.group(1)
    return None


def resolve(value: Any) -> Any:
    """``value`` with its reference-data tokens replaced: a token string becomes the set's
    contents; in a list, a token naming a list is spliced in place. Anything else is returned
    as it is."""
    name = token_name(value)
    if name is not None:
        return load(name)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        out: list[Any] = []
        for item in value:
            inner = token_name(item)
            if inner is None:
                out.append(item)
                continue
            data = load(inner)
            if not isinstance(data, list):
                raise ConfigError(f"'<data:{inner}>' is a mapping; inside a list only list sets can be named")
            out.extend(data)
        return out
    return value


# --------------------------------------------------------------------------- pre-flight
def tokens_for_domain(config: Any, domain: str | None, domains: Iterable[str]) -> set[str]:
    """The set names ``config`` uses for ``domain``: a mapping keyed by domain names (and
    ``default``) contributes only its entry for ``domain`` (else its ``default``)."""
    known = set(domains) | {"default"}
    found: set[str] = set()

    def walk(node: Any) -> None:
        name = token_name(node)
        if name is not None:
            found.add(name)
        elif isinstance(node, Mapping):
            keys = {str(k) for k in node}
            if keys and keys <= known and ("default" in keys or domain in keys):
                walk(node.get(domain, node.get("default")) if domain in keys else node.get("default"))
            else:
                for v in node.values():
                    walk(v)
        elif isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
            for v in node:
                walk(v)

    walk(config)
    return found


def check_available(config: Mapping[str, Any], domain: str | None) -> list[str]:
    """Fetch (or find cached) every set ``config`` uses for ``domain``; returns their names.
    Raises :class:`DataUnavailableError` (offline, not cached) naming the set and the command
    that fetches it, or :class:`UnknownChoiceError` for a set that does not exist."""
    from emma import registry

    names = sorted(tokens_for_domain(config, domain, registry.choices("domain")))
    for name in names:
        local_path(name)
    return names
