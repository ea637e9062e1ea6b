"""EMMA's published prompt files (``suite.source=emma_official``).

EMMA (lobsterlulu/EMMA) publishes, per domain, ``prompts/<dir>/{1_name, 2_prefix, 3_variant,
4_short, 5_long, 6_random, 7_hard}.json``, each a list of ``{concept_key: [prompts]}``
(``art/`` and ``celebrity/`` have no ``3_variant``). The files are downloaded on first use at
a pinned commit, checked by sha256 and cached (:mod:`emma.datasets.download`).

The published files have defects. :func:`read_emma_prompts` never crashes on them and never
absorbs them silently: each one becomes a :class:`Defect` in the result, saying what was
found, where, and what the reader did about it (``dropped``, ``kept`` or ``repaired``):

- keys that are not concepts of the domain (``celebrity/1_name.json`` carries 28 artists);
- concepts the paper excludes (``person`` in ``object/``), and files that lack a key the
  others have (``object/7_hard.json``);
- prompt counts that differ from EMMA's protocol;
- name prompts that de-space or slug the name (``an image of the baseballbat``,
  ``a photo of barack-obama``) and prefix prompts that de-space it (``smartAmericaFerrera``);
- descriptions that repeat their hint prefix (celebrity short prompts);
- descriptions that contain the concept's name;
- RA prompts naming a concept outside the domain (its classifier cannot judge it);
- concepts the domain's classifier cannot detect (3 celebrities are not among GCD's labels).

With ``repair=True`` the reader also fixes what has one right answer (repeated hints are
collapsed, name prompts are re-rendered with the display name); by default prompts are kept
verbatim so that numbers stay comparable with EMMA's.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import logging
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from emma.api.domain import Concept, Domain, PromptSuite
from emma.datasets.download import DataUnavailableError, RemoteFile, fetch
from emma.domains.text import extract, fold, normalize, render
from emma.domains.validate import validate_descriptions
from emma.errors import ConfigError, EmmaError

logger = logging.getLogger(__name__)

EMMA_REPO = "lobsterlulu/EMMA"
EMMA_COMMIT = "ecf46c0a5d3d952b677903afe0ec915befdef55a"

#: EMMA prompt type -> file name.
PROMPT_FILES: dict[str, str] = {
    "name": "1_name.json",
    "prefix": "2_prefix.json",
    "variant": "3_variant.json",
    "short": "4_short.json",
    "long": "5_long.json",
    "random": "6_random.json",
    "similar": "7_hard.json",
}

#: Prompts per concept in EMMA's protocol (RA counts come from the domain: n_random, n_similar).
EXPECTED_COUNTS: dict[str, int] = {"name": 1, "prefix": 10, "variant": 10, "short": 5, "long": 5}

#: sha256 of every published prompt file at :data:`EMMA_COMMIT` ("<dir>/<file>").
PROMPT_SHA256: dict[str, str] = {
    "art/1_name.json": "63542f78ef7db0c908040a627d376aef036c575d514da923ea60330f36e25aec",
    "art/2_prefix.json": "a8d69a7bc8a966840033a50a5427a13c5e7523657062a5e553dfc25965514efa",
    "art/4_short.json": "cc639872bb823fa6b187866a89c63bbc9bf2d439fb9aa0396c2c7a663a37c202",
    "art/5_long.json": "25d6923c0934c76d07b47e69f752bfb49b9d620c3542088214df7a15c6ef9d0d",
    "art/6_random.json": "0a5e7b964eeb23308d52dbf3cd25d79b4c2ef17df2b8501da0209ac980dd28ef",
    "art/7_hard.json": "c18fdf2c4a17b1802f6b259576220db771df18fa6151f259b9b44a375f382629",
    "celebrity/1_name.json": "14426c1f65d72fe2e12ef043cbf349cc6c370995c68cdcb7b37a3ac1ec4f650b",
    "celebrity/2_prefix.json": "07e9f8c8775c30c59e52133b18758cd1a76d5ad96485267243a2dded2e9b690c",
    "celebrity/4_short.json": "b0c3d98c7cde99a7ccbc1d2d37943ff7e94904f62be5968ec54e81412a71f4df",
    "celebrity/5_long.json": "3c2c50935b5fd27f702de77c47f23a00aa84208e5d74bbcb45383d3a26376592",
    "celebrity/6_random.json": "c81ba71a7ceeb4ee3fefb9d73093a653a507da2b2ab78c0c81b540a8a4d38098",
    "celebrity/7_hard.json": "b4fa2d72437113e4ef117910386ffbf1cbcc9cf614c8640cc5af43337bb4a74b",
    "copyright/1_name.json": "8a649bc619b585f9951fc2f05b7ed779e0195733713f689b80fc43d4785c2f16",
    "copyright/2_prefix.json": "b8e73d10f0308de32672ef4e996bba7a74411320b292434f476acbb52b34241a",
    "copyright/3_variant.json": "58c43819c845efb4d33fb7cc05e6628de2b88f89b3710785ddc27ba5848f745c",
    "copyright/4_short.json": "a4c5d7d6d87e4969bc96c05292bf066c9a9b8a967c80ae3c752dc31c9f78aba5",
    "copyright/5_long.json": "fe63391397849fe32b6008d843aba0908da141bf10b9a36d2d372d3338e437a8",
    "copyright/6_random.json": "3c04110a17dadfca12c3058aac115f40eb65aceec6e5155a376aa22cfd65d942",
    "copyright/7_hard.json": "6ecc1f6efcf3c61572205aab9584586c7dd499d05f720acd6e1891f2dc8548a8",
    "nsfw/1_name.json": "b1c647222aeccee0c13d58c21a6ddda12eb3c0e6c784c5f2021513a327d69cbb",
    "nsfw/2_prefix.json": "a87e277eeb0913a0ce6d057f0c8725b894bc7956a7fa28a408d7d3e0023c8024",
    "nsfw/3_variant.json": "4a3069224f67c36c670d7a436a3cbcb290c260c4b19026d76cbd5254846a6ee2",
    "nsfw/4_short.json": "4340a2a29a1f95593b95182bb3bbcfd085a1c8c49034b2681ddb29d3b4dfac15",
    "nsfw/5_long.json": "a1d8bce5ad2110b099e63ef5ee2d3a85bd7b4ea6109c47a66a110ae25800bf55",
    "nsfw/6_random.json": "6de40b559184524a7884c5040cacf8a2a85a33e63a58bb475908609bf662f4f3",
    "nsfw/7_hard.json": "97213282a2a2a311d8abb6d41f6689331ade90ed22b1d4ab084f10ff145d1a04",
    "object/1_name.json": "72244a27d367c984cf7a0dc58667a292e5bfcc515868a8399f214333d7dfc815",
    "object/2_prefix.json": "1e02711326f93591331bd489a47c32554de7c06685a747d214d50b506d372dcd",
    "object/3_variant.json": "37c7ef8549025b1b9f969428cb9b0d6f7a36362065f3c74b200cb094f133c794",
    "object/4_short.json": "b95748ce39e138e3a30aae6736d132982cc62c6a98a5a78df63a13d5d11e6b6c",
    "object/5_long.json": "b9f00586b994c7670731e0b12a55e8f6ade809a7c98ae14074e1e82259e0ccee",
    "object/6_random.json": "c8dcf57ca56f4d5ffe98e9f0a0f1f1b8267c5be814d9e28907d26ce2645c67f4",
    "object/7_hard.json": "092c91995fd50563ec96d2676483860d3b739b1c2f443043d5862cb81380f5ba",
}

#: Label lists of EMMA's classifiers, used to find concepts a classifier can never detect.
LABEL_LISTS: dict[str, RemoteFile] = {
    "gcd": RemoteFile(
        EMMA_REPO, EMMA_COMMIT, "classifier/GCD/resources/face_recognition/labels.csv",
        "f751a80150db7e51de1815bf4a7e0df212b357b8cca9954af42b303345c556cc",
        "GIPHY Celebrity Detector label list (2,306 identities)"),
    "style_vit": RemoteFile(
        EMMA_REPO, EMMA_COMMIT,
        "classifier/Diffusion-MU-Attack/classifier/checkpoint-2800/config.json",
        "7f8ac31786feb73a13e00bf02801e880d066555de7c2207228916e4d731fc338",
        "UnlearnDiffAtk 129-class style ViT config (label list)"),
}

Severity = Literal["info", "warning", "error"]


def prompt_file(emma_dir: str, kind: str) -> RemoteFile:
    """The pinned :class:`RemoteFile` of one EMMA prompt file."""
    rel = f"{emma_dir}/{PROMPT_FILES[kind]}"
    if rel not in PROMPT_SHA256:
        raise ConfigError(f"EMMA publishes no {rel}; published files: {sorted(PROMPT_SHA256)}")
    return RemoteFile(EMMA_REPO, EMMA_COMMIT, f"prompts/{rel}", PROMPT_SHA256[rel],
                      f"EMMA prompt file prompts/{rel}")


def parse_label_list(name: str, data: bytes) -> list[str]:
    """Human-readable labels of a classifier label file (``"Tom_Hanks_[m.0bxtg]"`` -> ``"Tom Hanks"``)."""
    if name == "gcd":
        rows = csv.DictReader(io.StringIO(data.decode("utf-8")))
        return [re.sub(r"_\[[^\]]*\]$", "", r["Labels"]).replace("_", " ") for r in rows]
    if name == "style_vit":
        id2label = json.loads(data)["id2label"]
        return [id2label[k] for k in sorted(id2label, key=int)]
    raise ConfigError(f"unknown label list {name!r}; known: {sorted(LABEL_LISTS)}")


@dataclasses.dataclass(frozen=True)
class Defect:
    """One defect found in EMMA's published files.

    Args:
        code: kind of defect (``extra_keys``, ``excluded_concept``, ``missing_prompts``,
            ``count_mismatch``, ``name_spelling``, ``prefix_despaced``, ``repeated_hint``,
            ``name_leak``, ``unknown_ra_concept``, ``undetectable_concept``, ...).
        file: ``"<dir>/<file>"`` it was found in (``""`` for domain-wide findings).
        message: what was found, in words.
        concepts: the affected keys or concept names.
        count: how many prompts or keys are affected.
        severity: ``info`` (by design or harmless), ``warning`` (numbers are affected),
            ``error`` (a whole file is unusable).
        action: what the reader did: ``dropped``, ``kept``, ``repaired`` or ``skipped``.
        example: one affected prompt or key, verbatim.
    """

    code: str
    file: str
    message: str
    concepts: tuple[str, ...] = ()
    count: int = 0
    severity: Severity = "warning"
    action: str = "kept"
    example: str = ""

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        text = f"[{self.severity}] {self.code}: {where}{self.message} ({self.action})"
        return text + (f" e.g. {self.example!r}" if self.example else "")


@dataclasses.dataclass
class EmmaPromptFiles:
    """EMMA's prompts of one domain after defect handling.

    Args:
        domain: harness domain name.
        emma_dir: EMMA's folder name.
        prompts: concept name -> prompt type -> ``(prompt, concept_to_check)`` pairs.
        keys: EMMA key -> concept name, for the keys that are concepts of the domain.
        defects: everything found (see :class:`Defect`).
        sha256: ``"<dir>/<file>"`` -> sha256 of the bytes read.
    """

    domain: str
    emma_dir: str
    prompts: dict[str, dict[str, list[tuple[str, str]]]]
    keys: dict[str, str]
    defects: list[Defect]
    sha256: dict[str, str]

    def counts(self) -> dict[str, int]:
        """Total prompts per type over all concepts."""
        out: dict[str, int] = defaultdict(int)
        for kinds in self.prompts.values():
            for kind, items in kinds.items():
                out[kind] += len(items)
        return dict(out)

    def counts_per_concept(self) -> dict[str, set[int]]:
        """Per type, the set of per-concept prompt counts (one value when uniform)."""
        out: dict[str, set[int]] = defaultdict(set)
        for kinds in self.prompts.values():
            for kind, items in kinds.items():
                out[kind].add(len(items))
        return dict(out)

    def find(self, code: str, file: str | None = None) -> list[Defect]:
        """Defects with ``code`` (and in ``file``, given as ``"<dir>/<file>"`` or a file name)."""
        return [d for d in self.defects if d.code == code and (
            file is None or d.file == file or d.file.endswith("/" + file))]

    def summary(self) -> dict[str, int]:
        """Number of defects per code."""
        out: dict[str, int] = defaultdict(int)
        for d in self.defects:
            out[d.code] += 1
        return dict(out)

    def report(self) -> str:
        """All defects, one per line."""
        return "\n".join(str(d) for d in self.defects) or "no defects"


_HINT = re.compile(r"^(?P<hint>[^\n]{5,400}?:)\s*(?P=hint)\s*", re.DOTALL)


def _spelling_issue(written: str, display: str) -> str | None:
    """Why ``written`` is not a faithful spelling of ``display`` (None if it is)."""
    if fold(written) == fold(display):
        return None
    if normalize(written) != normalize(display):
        return f"names {written!r} instead of {display!r}"
    if "-" in written and "-" not in display:
        return "slugged"
    if " " not in written.strip() and " " in display:
        return "de-spaced"
    return None


def _entries(obj: Any, rel: str, defects: list[Defect]) -> dict[str, list[str]]:
    """Merge EMMA's ``[{key: [prompts]}, ...]`` (or a plain object) into one mapping."""
    out: dict[str, list[str]] = {}
    pairs: list[tuple[Any, Any]] = []
    if isinstance(obj, dict):
        defects.append(Defect(
            "format", rel, "is a JSON object, not EMMA's list of single-key objects; read as is",
            count=len(obj), severity="info", action="kept"))
        pairs = list(obj.items())
    elif isinstance(obj, list):
        multi = 0
        for item in obj:
            if isinstance(item, dict):
                multi += len(item) > 1
                pairs.extend(item.items())
            else:
                defects.append(Defect("bad_entry", rel, "an entry is not an object",
                                      action="dropped", example=repr(item)[:80]))
        if multi:
            defects.append(Defect("format", rel, f"{multi} entries hold more than one key",
                                  count=multi, severity="info"))
    else:
        raise EmmaError(f"{rel}: expected a JSON list of {{concept: [prompts]}}, "
                        f"got {type(obj).__name__}")
    for key, value in pairs:
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            defects.append(Defect("bad_entry", rel, f"prompts of {key!r} are not a list of strings",
                                  concepts=(str(key),), action="dropped"))
            continue
        if key in out:
            defects.append(Defect("duplicate_key", rel, f"{key!r} appears twice; the first is used",
                                  concepts=(str(key),), action="dropped"))
            continue
        out[str(key)] = list(value)
    return out


def read_emma_prompts(
    root: str | Path,
    domain: Domain,
    *,
    repair: bool = False,
    classifier_labels: Sequence[str] | None = None,
) -> EmmaPromptFiles:
    """Read and check EMMA's prompt files of ``domain``.

    Args:
        root: folder holding EMMA's ``prompts/`` content (``<root>/<emma_dir>/1_name.json``).
        domain: the harness domain with EMMA's extras (an :class:`~emma.domains.EmmaDomain`:
            ``emma_dir``, ``has_variants``, ``excluded``, ``resolve``, RA counts).
        repair: collapse repeated hint prefixes and re-render misspelt name prompts.
        classifier_labels: labels the domain's classifier detects; concepts missing from
            them are reported as ``undetectable_concept``.

    Returns:
        The prompts per concept and type with their concept to check, and every defect.

    Raises:
        ConfigError: the domain has no EMMA folder.
        EmmaError: a file is not JSON or not a list/object at all.
    """
    if not domain.emma_dir:
        raise ConfigError(f"domain {domain.name!r} has no EMMA prompt files (emma_dir is null)")
    defects: list[Defect] = []
    raw, digests = _read_files(Path(root) / domain.emma_dir, domain, defects)
    key_to_name, excluded_keys = _match_keys(raw, domain, defects)
    defects.extend(_missing_keys(raw, domain, key_to_name, excluded_keys))
    prompts: dict[str, dict[str, list[tuple[str, str]]]] = {n: {} for n in domain.concepts}
    for kind, entries in raw.items():
        checked = _check_file(kind, entries, domain, key_to_name, excluded_keys, repair, defects)
        for name, items in checked.items():
            prompts[name][kind] = items
    if classifier_labels is not None:
        blind = _undetectable(domain, classifier_labels)
        if blind is not None:
            defects.append(blind)
    prompts = {name: kinds for name, kinds in prompts.items() if kinds}
    return EmmaPromptFiles(domain=domain.name, emma_dir=domain.emma_dir, prompts=prompts,
                           keys=key_to_name, defects=defects, sha256=digests)


def _rel(domain: Domain, kind: str) -> str:
    """``"<dir>/<file>"`` of one prompt type (how defects name a file)."""
    return f"{domain.emma_dir}/{PROMPT_FILES[kind]}"


def _read_files(folder: Path, domain: Domain, defects: list[Defect],
                ) -> tuple[dict[str, dict[str, list[str]]], dict[str, str]]:
    """The entries of every prompt file of ``domain`` in ``folder`` (per type, key -> prompts)
    and the sha256 of each file read; unreadable or unexpected files become defects."""
    raw: dict[str, dict[str, list[str]]] = {}
    digests: dict[str, str] = {}
    kinds = [k for k in PROMPT_FILES if k != "variant" or domain.has_variants]
    if not domain.has_variants and (folder / PROMPT_FILES["variant"]).is_file():
        defects.append(Defect("ignored_file", _rel(domain, "variant"),
                              f"the {domain.name} domain has no variant prompts", severity="info",
                              action="skipped"))
    for kind in kinds:
        rel = _rel(domain, kind)
        path = folder / PROMPT_FILES[kind]
        if not path.is_file():
            defects.append(Defect("missing_file", rel, f"not found under {folder}; no {kind} prompts",
                                  severity="error", action="skipped"))
            continue
        data = path.read_bytes()
        digests[rel] = hashlib.sha256(data).hexdigest()
        pinned = PROMPT_SHA256.get(rel)
        if pinned and digests[rel] != pinned:
            defects.append(Defect(
                "checksum_mismatch", rel, f"sha256 {digests[rel][:12]}… differs from the pinned "
                f"{pinned[:12]}… of {EMMA_REPO}@{EMMA_COMMIT[:7]}; counts may differ", severity="warning"))
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise EmmaError(f"{path} is not valid JSON ({exc}); expected EMMA's "
                            "[{concept: [prompts]}, ...] format") from exc
        raw[kind] = _entries(obj, rel, defects)
    return raw, digests


def _match_keys(raw: dict[str, dict[str, list[str]]], domain: Domain, defects: list[Defect],
                ) -> tuple[dict[str, str], dict[str, str]]:
    """Which keys of the files are concepts of ``domain``: ``(key -> concept name, key ->
    excluded concept)``; keys that are neither are reported as ``extra_keys`` and dropped."""
    excluded = {normalize(k): k for k in getattr(domain, "excluded", {})}
    key_to_name: dict[str, str] = {}
    excluded_keys: dict[str, str] = {}  # key -> excluded concept
    for kind, entries in raw.items():
        rel = _rel(domain, kind)
        extra, dropped = [], []
        for key in entries:
            name = domain.resolve(key)
            if name is not None:
                previous = next((k for k, n in key_to_name.items() if n == name and k != key), None)
                if previous is not None:
                    defects.append(Defect("duplicate_key", rel, f"{key!r} and {previous!r} are both "
                                          f"{name!r}; {previous!r} is used", concepts=(key,),
                                          action="dropped"))
                    continue
                key_to_name[key] = name
            elif normalize(key) in excluded:
                excluded_keys[key] = excluded[normalize(key)]
                dropped.append(key)
            else:
                extra.append(key)
        if extra:
            defects.append(Defect(
                "extra_keys", rel, f"{len(extra)} keys are not concepts of the {domain.name} domain",
                concepts=tuple(extra), count=len(extra), action="dropped", example=extra[0]))
        for key in dropped:
            reason = domain.excluded[excluded_keys[key]]
            defects.append(Defect(
                "excluded_concept", rel, f"{key!r} is excluded from the {domain.name} domain: {reason}",
                concepts=(key,), count=1, action="dropped", example=key))
    return key_to_name, excluded_keys


def _missing_keys(raw: dict[str, dict[str, list[str]]], domain: Domain,
                  key_to_name: dict[str, str], excluded_keys: dict[str, str]) -> list[Defect]:
    """A ``missing_prompts`` defect for every file that lacks concepts (or excluded concepts
    that the other files have)."""
    defects = []
    for kind, entries in raw.items():
        rel = _rel(domain, kind)
        present = {key_to_name[k] for k in entries if k in key_to_name}
        lacking = [n for n in domain.concepts if n not in present]
        lacking_excluded = [k for k in excluded_keys if k not in entries]
        if lacking:
            defects.append(Defect(
                "missing_prompts", rel, f"no {kind} prompts for {len(lacking)} concept(s)",
                concepts=tuple(lacking), count=len(lacking), action="skipped", example=lacking[0]))
        if lacking_excluded:
            defects.append(Defect(
                "missing_prompts", rel, f"no {kind} prompts for {lacking_excluded} although the other "
                "files have them (the concept is excluded anyway)", concepts=tuple(lacking_excluded),
                count=len(lacking_excluded), severity="info", action="skipped",
                example=lacking_excluded[0]))
    return defects


class _Findings:
    """The prompts of one file that show a defect, per defect code (in the order first seen)."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[str]] = defaultdict(list)  # code -> affected prompts
        self.concepts: dict[str, list[str]] = defaultdict(list)  # code -> affected concepts
        self.notes: dict[str, set[str]] = defaultdict(set)  # code -> what exactly was wrong

    def add(self, code: str, prompt: str, concept: str, note: str | None = None) -> None:
        self.prompts[code].append(prompt)
        self.concepts[code].append(concept)
        if note is not None:
            self.notes[code].add(note)


def _check_file(kind: str, entries: dict[str, list[str]], domain: Domain,
                key_to_name: dict[str, str], excluded_keys: dict[str, str], repair: bool,
                defects: list[Defect]) -> dict[str, list[tuple[str, str]]]:
    """The ``(prompt, concept_to_check)`` pairs of one file per concept name, after checking
    prompt counts and every prompt; what was found is appended to ``defects``."""
    rel = _rel(domain, kind)
    expected = {**EXPECTED_COUNTS, "random": domain.n_random,
                "similar": getattr(domain, "n_similar", 5)}[kind]
    wrong_counts = [(k, len(entries[k])) for k in [*key_to_name, *excluded_keys] if k in entries
                    and len(entries[k]) != expected]
    if wrong_counts:
        desc = ", ".join(f"{k!r} has {n}" for k, n in wrong_counts)
        defects.append(Defect(
            "count_mismatch", rel, f"{desc}; EMMA's protocol has {expected} {kind} "
            "prompts per concept", concepts=tuple(k for k, _ in wrong_counts),
            count=len(wrong_counts), action="kept"))
    findings = _Findings()
    out: dict[str, list[tuple[str, str]]] = {}
    for key, name in key_to_name.items():
        if key not in entries:
            continue
        items = [item for prompt in entries[key]
                 if (item := _check_prompt(kind, prompt, name, domain, repair, findings)) is not None]
        if len({p for p, _ in items}) < len(items):
            findings.add("duplicate_prompts", items[0][0], name)
        out[name] = items
    defects.extend(_finding_defects(rel, findings, domain, repair))
    return out


def _check_prompt(kind: str, prompt: str, name: str, domain: Domain, repair: bool,
                  findings: _Findings) -> tuple[str, str] | None:
    """One prompt of concept ``name`` as ``(prompt, concept_to_check)``, repaired when asked;
    ``None`` for an RA prompt whose concept cannot be read off the template."""
    concept = domain.concepts[name]
    if kind == "name":
        return _check_name_prompt(prompt, concept, domain, repair, findings), name
    if kind == "prefix":
        _check_prefix_prompt(prompt, concept, domain, findings)
    elif kind in ("short", "long"):
        return _check_description(prompt, concept, repair, findings), name
    elif kind in ("random", "similar"):
        return _check_ra_prompt(kind, prompt, name, domain, findings)
    return prompt, name


def _check_name_prompt(prompt: str, concept: Concept, domain: Domain, repair: bool,
                       findings: _Findings) -> str:
    """A *name* prompt must be the template with the display name (re-rendered on repair)."""
    written = extract(domain.template, prompt)
    issue = _spelling_issue(written, concept.label) if written is not None else "template"
    if not issue:
        return prompt
    code = "template_mismatch" if issue == "template" else "name_spelling"
    findings.add(code, prompt, concept.name, note=issue)
    if repair and code == "name_spelling":
        return render(domain.template, concept.label)
    return prompt


def _check_prefix_prompt(prompt: str, concept: Concept, domain: Domain, findings: _Findings) -> None:
    """A *prefix* prompt must end with the concept as the template puts it, spaces kept."""
    written = extract(domain.template, prompt)
    if written is None or not normalize(written).endswith(normalize(concept.label)):
        findings.add("template_mismatch", prompt, concept.name)
    elif not fold(written).endswith(fold(concept.label)):
        findings.add("prefix_despaced", prompt, concept.name)


def _check_description(prompt: str, concept: Concept, repair: bool, findings: _Findings) -> str:
    """A *short*/*long* description: a repeated hint prefix (collapsed on repair) and the
    concept's name in it are findings."""
    text = prompt
    m = _HINT.match(prompt)
    if m:
        findings.add("repeated_hint", prompt, concept.name)
        if repair:
            text = m.group("hint") + " " + prompt[m.end():]
    if validate_descriptions(concept, [prompt]):
        findings.add("name_leak", prompt, concept.name)
    return text


def _check_ra_prompt(kind: str, prompt: str, name: str, domain: Domain,
                     findings: _Findings) -> tuple[str, str] | None:
    """An RA prompt with the concept it names (resolved in the domain or the random pool, else
    as written); ``None`` when it does not fit the template."""
    written = extract(domain.template, prompt)
    if written is None:
        findings.add("template_mismatch", prompt, name)
        return None
    other = domain.resolve(written, "random" if kind == "random" else "domain")
    if other == name:
        findings.add("ra_is_target", prompt, name)
    if other is None:
        other = written
        if kind == "random" or getattr(domain, "similar_in_domain", True):
            findings.add("unknown_ra_concept", prompt, written)
    return prompt, other


def _finding_defects(rel: str, findings: _Findings, domain: Domain, repair: bool) -> list[Defect]:
    """One :class:`Defect` per code found in file ``rel``."""
    defects = []
    for code, examples in findings.prompts.items():
        concepts = tuple(dict.fromkeys(findings.concepts[code]))
        fixed = repair and code in ("name_spelling", "repeated_hint")
        severity: Severity = "info" if code == "prefix_despaced" else "warning"
        defects.append(Defect(code, rel, _finding_message(code, len(examples), concepts, findings, domain),
                              concepts=concepts, count=len(examples), severity=severity,
                              action="repaired" if fixed else "kept", example=examples[0][:160]))
    return defects


def _finding_message(code: str, n: int, concepts: tuple[str, ...], findings: _Findings,
                     domain: Domain) -> str:
    """What a finding means, in words (``n`` affected prompts of ``concepts``)."""
    return {
        "name_spelling": f"{n} name prompts do not spell the concept's display "
                         f"name ({', '.join(sorted(findings.notes['name_spelling']))})",
        "template_mismatch": f"{n} prompts do not fit the template "
                             f"{domain.template!r} with the concept",
        "prefix_despaced": f"{n} prefix prompts glue the prefix to a de-spaced "
                           f"concept name, for {len(concepts)} multi-word concepts",
        "repeated_hint": f"{n} prompts repeat their hint prefix twice, for "
                         f"{len(concepts)} concepts",
        "name_leak": f"{n} descriptions contain the concept's name or an alias, "
                     f"for {len(concepts)} concepts",
        "unknown_ra_concept": f"{n} RA prompts name concepts outside the "
                              f"{domain.name} domain {list(concepts)}; the domain's "
                              f"classifier ({domain.classifier}) may not judge them",
        "ra_is_target": f"{n} RA prompts name the target concept itself",
        "duplicate_prompts": f"{len(concepts)} concepts have duplicate prompts",
    }[code]


def _undetectable(domain: Domain, classifier_labels: Sequence[str]) -> Defect | None:
    """The concepts none of whose spellings is among the classifier's labels, if any."""
    labels = {normalize(label) for label in classifier_labels}
    blind = [n for n, c in domain.concepts.items()
             if not any(normalize(t) in labels for t in (c.name, c.display, *c.aliases) if t)]
    if not blind:
        return None
    return Defect(
        "undetectable_concept", "", f"{len(blind)} concepts are not among the "
        f"{len(classifier_labels)} labels of the {domain.classifier} classifier, so it can "
        "never detect them (EA is trivially perfect, RA trivially zero)",
        concepts=tuple(blind), count=len(blind), action="kept", example=blind[0])


class EmmaOfficialSuite(PromptSuite):
    """EMMA's published prompts, downloaded at a pinned commit and checked by sha256.

    Args:
        root: a local folder holding EMMA's ``prompts/`` content instead of the download
            (files that differ from the pinned ones are reported as ``checksum_mismatch``).
        repair: fix the defects that have one right answer (see :func:`read_emma_prompts`).
        labels_file: local copy of the domain's classifier label list (default: the pinned
            download; when unavailable, the check is reported as skipped).
    """

    name: ClassVar[str] = "emma_official"
    version: ClassVar[str] = "1"

    def __init__(self, root: str | None = None, repair: bool = False,
                 labels_file: str | None = None) -> None:
        self.root = root
        self.repair = bool(repair)
        self.labels_file = labels_file
        self._files: dict[str, EmmaPromptFiles] = {}

    def _download(self, domain: Domain) -> Path:
        kinds = [k for k in PROMPT_FILES if k != "variant" or domain.has_variants]
        paths = [fetch(prompt_file(domain.emma_dir, k)) for k in kinds]
        return paths[0].parent.parent

    def _labels(self, domain: Domain) -> tuple[list[str] | None, Defect | None]:
        name = getattr(domain, "classifier_labels", None)
        if not name:
            return None, None
        try:
            path = Path(self.labels_file).expanduser() if self.labels_file else fetch(LABEL_LISTS[name])
            return parse_label_list(name, path.read_bytes()), None
        except (DataUnavailableError, OSError) as exc:
            return None, Defect("labels_unchecked", "", f"could not check concepts against the "
                                f"{name} label list: {exc}", severity="info", action="skipped")

    def files(self, domain: Domain) -> EmmaPromptFiles:
        """EMMA's prompts of ``domain`` with their defect report (read once, then cached)."""
        if domain.name not in self._files:
            emma_dir = getattr(domain, "emma_dir", None)
            if not emma_dir:
                raise ConfigError(f"EMMA publishes no prompts for domain {domain.name!r}; use "
                                  "domain.suite.source=generated")
            root = Path(self.root).expanduser() if self.root else self._download(domain)
            labels, skipped = self._labels(domain)
            result = read_emma_prompts(root, domain, repair=self.repair, classifier_labels=labels)
            if skipped is not None:
                result.defects.append(skipped)
            warnings = [d for d in result.defects if d.severity != "info"]
            if warnings:
                logger.warning("EMMA %s prompts: %d defects handled (%s); `python -m emma.suites "
                               "defects domain=%s` lists them", domain.name, len(warnings),
                               ", ".join(sorted({d.code for d in warnings})), domain.name)
            self._files[domain.name] = result
        return self._files[domain.name]

    def defects(self, domain: Domain) -> list[Defect]:
        """The defects found in ``domain``'s files."""
        return list(self.files(domain).defects)

    def prompts(self, domain: Domain, concept: str) -> dict[str, list[tuple[str, str]]]:
        files = self.files(domain)
        if concept not in files.prompts:
            raise ConfigError(f"EMMA's {domain.emma_dir}/ files have no prompts for concept {concept!r} "
                              f"of domain {domain.name!r}; use domain.suite.source=generated")
        return {kind: list(items) for kind, items in files.prompts[concept].items()}

    def config(self) -> dict[str, Any]:
        return {
            **super().config(), "repo": EMMA_REPO, "commit": EMMA_COMMIT, "repair": self.repair,
            "root": self.root,
            "sha256": {k: v for f in self._files.values() for k, v in f.sha256.items()},
            "defects": {name: f.summary() for name, f in self._files.items()},
        }

