"""``python -m stace.library build``: PaperCards from the papers a user supplies.

The PaperCard agent (:func:`stace.library.draft_card`, the prompt ``stace/prompts/papercard.md``)
reads each paper's text with the configured LLM and writes one card, checked against the
:class:`stace.schemas.PaperCard` schema (one repair round, as every STACE agent call). The
library folder it builds::

    <out>/papercards.yaml   the built cards (load_cards() format; attacker.library=<out>)
    <out>/sources.json      one entry per paper text, keyed by the sha256 of its text:
                            card (its key), duplicate (of which card) or refused (why)
    <out>/trace.jsonl       every LLM call (secrets redacted)
    <out>/index/<key>.npy   the embedding index of the shipped cards plus the built ones

The build is incremental and content-addressed: a paper whose text hash already has a card or
a duplicate verdict in ``sources.json`` costs no LLM call; a refused one is tried again.
Duplicates are refused twice over: the same text (hash), and a card whose normalised title
is already in the library (shipped or built). A card whose key is taken by another paper gets
``-2``, ``-3`` ... A reply that fails the schema after the repair round is refused, counted and
named in the summary, never stored.

Inputs: ``.txt`` / ``.md`` (a paper's text or abstract), ``.pdf`` (text extracted with pypdf,
``pip install pypdf``; image-only PDFs give no text and are refused), ``.jsonl`` / ``.json``
(several papers: objects with ``text``, or ``title`` and ``abstract``), or folders of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Sequence

import yaml

from emma.errors import ConfigError, EmmaError
from emma.files import atomic_write_text
from stace.schemas import PaperCard

SUFFIXES = (".txt", ".md", ".pdf", ".jsonl", ".json")
CARDS_NAME = "papercards.yaml"
SOURCES_NAME = "sources.json"
KEY_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@dataclasses.dataclass
class PaperText:
    """One paper's text and where it came from (``source``: file, or file#line)."""

    source: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(normalise_text(self.text).encode("utf-8")).hexdigest()


@dataclasses.dataclass
class BuildSummary:
    """What one build did."""

    papers: int = 0          # paper texts read
    built: list[str] = dataclasses.field(default_factory=list)       # keys of new cards
    skipped: int = 0         # already built (or already known duplicates): no LLM call
    duplicates: list[str] = dataclasses.field(default_factory=list)  # "source: duplicate of key"
    refused: list[str] = dataclasses.field(default_factory=list)     # "source: why"
    llm_calls: int = 0       # requests sent (repair rounds included)
    cards_total: int = 0     # cards in the built library after the build
    index: str | None = None  # the index file

    def lines(self) -> list[str]:
        out = [f"{self.papers} paper texts: {len(self.built)} new cards, {self.skipped} already in the library "
               f"(no LLM call), {len(self.duplicates)} duplicates, {len(self.refused)} refused; "
               f"{self.llm_calls} LLM requests; {self.cards_total} built cards in all"]
        out += [f"  duplicate: {d}" for d in self.duplicates]
        out += [f"  refused: {r}" for r in self.refused]
        if self.index:
            out.append(f"  index: {self.index}")
        return out


def normalise_text(text: str) -> str:
    return " ".join(text.split())


def normalise_title(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", title.lower()).strip()


def read_pdf(path: Path) -> str:
    """The text of every page of a PDF (pypdf)."""
    try:
        import pypdf
    except ImportError:
        raise ConfigError(f"{path.name}: reading PDFs needs pypdf (pip install pypdf, or pip install "
                          "'emma-harness[stace]'); or give the paper's text as a .txt file") from None
    try:
        reader = pypdf.PdfReader(str(path))
        return "\n".join((page.extract_text() or "") for page in reader.pages)
    except Exception as exc:  # pypdf raises many kinds on a damaged file
        raise ConfigError(f"{path.name}: not a readable PDF ({type(exc).__name__}: {exc})") from None


def _records(path: Path) -> list[PaperText]:
    """Papers of a .jsonl / .json file: objects with ``text``, or ``title`` and ``abstract``."""
    raw = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            items = [(f"{path.name}#{i + 1}", json.loads(line)) for i, line in enumerate(raw.splitlines())
                     if line.strip()]
        else:
            data = json.loads(raw)
            data = data if isinstance(data, list) else [data]
            items = [(f"{path.name}#{i + 1}", d) for i, d in enumerate(data)]
    except ValueError as exc:
        raise ConfigError(f"{path.name}: not valid JSON ({exc})") from None
    out = []
    for where, d in items:
        if not isinstance(d, dict) or not (d.get("text") or d.get("abstract")):
            raise ConfigError(f"{where}: each paper needs 'text', or 'title' and 'abstract'")
        text = d.get("text") or f"{d.get('title', '')}\n\n{d['abstract']}".strip()
        out.append(PaperText(where, str(text)))
    return out


def read_papers(paths: Sequence[str | Path]) -> list[PaperText]:
    """Every paper text under ``paths`` (files or folders, searched recursively, sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
        elif p.is_file():
            if p.suffix.lower() not in SUFFIXES:
                raise ConfigError(f"{p.name}: unknown paper format {p.suffix!r}; valid: {', '.join(SUFFIXES)}")
            files.append(p)
        else:
            raise ConfigError(f"{p}: no such file or folder")
    papers: list[PaperText] = []
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".pdf":
            papers.append(PaperText(f.name, read_pdf(f)))
        elif suffix in (".jsonl", ".json"):
            papers += _records(f)
        else:
            papers.append(PaperText(f.name, f.read_text(encoding="utf-8", errors="replace")))
    return papers


def load_built(out: Path) -> tuple[list[PaperCard], dict[str, Any]]:
    """The cards and the sources record of a library folder (empty when it is new)."""
    cards_file, sources_file = out / CARDS_NAME, out / SOURCES_NAME
    cards = []
    if cards_file.exists():
        from stace.library import load_cards

        cards = load_cards(cards_file)
    sources = json.loads(sources_file.read_text(encoding="utf-8")) if sources_file.exists() else {}
    return cards, sources


def _save(out: Path, cards: Sequence[PaperCard], sources: dict[str, Any]) -> None:
    header = ("# PaperCards built by `python -m stace.library build` (stace/library_builder.py); "
              "fields follow stace.schemas.PaperCard\n")
    body = yaml.safe_dump([c.model_dump() for c in cards], sort_keys=False, allow_unicode=True, width=100)
    atomic_write_text(out / CARDS_NAME, header + (body if cards else "[]\n"))
    atomic_write_text(out / SOURCES_NAME, json.dumps(sources, indent=1, sort_keys=True) + "\n")


def _check_card(card: PaperCard) -> None:
    """What the schema cannot say: a key that names the paper, prose where prose belongs, a URL
    where the repository belongs."""
    if not KEY_PATTERN.match(card.key) or not re.search(r"[a-z]", card.key):
        raise ValueError(f"key {card.key!r} must be lower-case letters, digits, '_', '.' or '-', with a letter "
                         "(e.g. 'esd' or 'ring_a_bell')")
    if len(card.title.split()) < 2:
        raise ValueError(f"title {card.title!r} must be the paper's title")
    for name in ("task", "method"):
        text = getattr(card, name)
        if len(text.split()) < 4 or re.match(r"^\s*https?://", text):
            raise ValueError(f"{name} must describe the paper's {name} in a sentence, not {text[:60]!r}")
    if card.code is not None and card.code.strip() and not re.match(r"^https?://\S+$", card.code.strip()):
        raise ValueError(f"code must be the repository's URL or null, not {card.code[:60]!r}")


def build_library(papers: Sequence[PaperText], out: str | Path, gateway: Any, *, shipped: Sequence[PaperCard] = (),
                  index: bool = True, max_chars: int = 12000) -> BuildSummary:
    """Add a card per new paper to the library folder ``out`` (see the module's doc).

    Args:
        papers: the paper texts (:func:`read_papers`).
        out: the library folder (created; an existing one is extended).
        gateway: a :class:`stace.gateway.Gateway` with a ``papercard`` role.
        shipped: cards already in the library the built one joins (titles there are duplicates).
        index: embed the shipped and built cards into ``out/index`` (all-MiniLM-L6-v2).
        max_chars: characters of each paper the agent reads.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cards, sources = load_built(out)
    summary = BuildSummary(papers=len(papers))
    titles = {normalise_title(c.title): c.key for c in [*shipped, *cards]}
    keys = {c.key for c in [*shipped, *cards]}
    for paper in papers:
        digest = paper.sha256
        known = sources.get(digest)
        if known and known.get("status") in ("card", "duplicate"):
            summary.skipped += 1
            continue
        if not normalise_text(paper.text):
            sources[digest] = {"source": paper.source, "status": "refused", "error": "no text"}
            summary.refused.append(f"{paper.source}: no text (an image-only PDF? give its text as .txt)")
            continue
        calls0 = sum(u.calls for u in gateway.usage.values())
        card = gateway.ask("papercard", "papercard", {"paper_text": paper.text[:max_chars]}, PaperCard, _check_card)
        summary.llm_calls += sum(u.calls for u in gateway.usage.values()) - calls0
        if card is None:
            last = gateway.trace.events("llm_call")[-1:]
            why = " ".join(str((last[0].get("invalid") or last[0].get("error")) if last else "no usable reply")
                           .split())
            why = f"the reply failed the PaperCard schema after the repair round: {why}" \
                if last and last[0].get("invalid") else f"no usable reply: {why}"
            sources[digest] = {"source": paper.source, "status": "refused", "error": why[:300]}
            summary.refused.append(f"{paper.source}: {why[:200]}")
            _save(out, cards, sources)
            continue
        title = normalise_title(card.title)
        if title in titles:
            sources[digest] = {"source": paper.source, "status": "duplicate", "duplicate_of": titles[title]}
            summary.duplicates.append(f"{paper.source}: duplicate of {titles[title]!r} (same title)")
            _save(out, cards, sources)
            continue
        key, n = card.key, 2
        while key in keys:
            key, n = f"{card.key}-{n}", n + 1
        card = card.model_copy(update={"key": key})
        cards.append(card)
        keys.add(key)
        titles[title] = key
        sources[digest] = {"source": paper.source, "status": "card", "key": key,
                           "model": gateway.roles["papercard"].model}
        summary.built.append(key)
        _save(out, cards, sources)  # after each card: a killed build keeps what it paid for
    _save(out, cards, sources)
    summary.cards_total = len(cards)
    if index:
        from stace.library import Library

        lib = Library([*shipped, *cards], cache_dir=out / "index")
        _ = lib.matrix
        summary.index = str(out / "index" / f"{lib.key()}.npy")
    return summary


def library_cards(library: str | Path | None) -> list[PaperCard]:
    """The cards STACE retrieves from: the shipped ones, plus a built library's
    (``library``: its folder or its ``papercards.yaml``; ``None``: the shipped ones only)."""
    from stace.library import load_cards

    shipped = load_cards()
    if library is None:
        return shipped
    path = Path(library)
    path = path / CARDS_NAME if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"attacker.library={str(library)!r}: no {CARDS_NAME} there; build one with "
                          "python -m stace.library build PAPERS --out DIR, or set null (the shipped cards)")
    extra = load_cards(path)
    taken = {c.key for c in shipped}
    clash = sorted(c.key for c in extra if c.key in taken)
    if clash:
        raise ConfigError(f"{path}: card key {clash[0]!r} is a shipped card's; rename it")
    return [*shipped, *extra]


def build_gateway(llm: str, overrides: Sequence[str], out: Path) -> tuple[Any, Any]:
    """(gateway, backend) for the PaperCard role from ``conf/llm/<llm>.yaml`` with ``key=value``
    overrides; the role's model, temperature and token limit follow conf/attacker/stace.yaml."""
    from omegaconf import OmegaConf

    from emma import registry
    from stace.gateway import Gateway, Redactor, RoleSettings, Trace, build_backend, pop_deadline

    if llm not in registry.choices("llm"):
        raise ConfigError(f"--llm {llm!r}: no such LLM config; valid: {', '.join(registry.choices('llm'))}")
    llm_file = registry.config_path("llm", llm)
    cfg = OmegaConf.load(llm_file)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: must be key=value (e.g. --set model=gpt-4o-mini)")
        k, v = item.split("=", 1)
        if k not in cfg:
            raise ConfigError(f"--set {k}: not a setting of llm={llm}; valid: {', '.join(sorted(cfg))}")
        cfg[k] = yaml.safe_load(v)
    llm_cfg = OmegaConf.to_container(cfg)
    deadline = pop_deadline(llm_cfg)
    backend = build_backend(llm_cfg)
    backend.check_available()
    stace_cfg = OmegaConf.to_container(OmegaConf.load(registry.config_path("attacker", "stace")))
    model = (stace_cfg["presets"]["default"]["papercard"] if getattr(backend, "per_role_models", False)
             else backend.model)
    role = RoleSettings(model=model, temperature=float(stace_cfg["temperatures"]["papercard"]),
                        max_tokens=int(backend.max_tokens or 1024))
    redact = Redactor([getattr(backend, "api_key_env", None)], [getattr(backend, "base_url", None)])
    # no reply cache: a refused paper is asked again (sources.json is what makes the build incremental)
    gateway = Gateway(backend, {"papercard": role}, trace=Trace(out / "trace.jsonl", redact), deadline_s=deadline)
    return gateway, backend


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stace.library build PAPERS... --out DIR [--llm NAME] [--set key=value]``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m stace.library",
        description="Build PaperCards from papers (PDF, text or abstracts) with the configured LLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="add a PaperCard per new paper to a library folder")
    b.add_argument("papers", nargs="+", help=f"files ({', '.join(SUFFIXES)}) or folders of them")
    b.add_argument("--out", required=True, help="the library folder (papercards.yaml, sources.json, index/)")
    b.add_argument("--llm", default="embedded", help="conf/llm/<name>.yaml (embedded, local, openai, openrouter)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of the LLM config (model, base_url, api_key_env, ...)")
    b.add_argument("--no-index", action="store_true", help="do not embed the cards")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from stace.library import load_cards

    out = Path(args.out)
    try:
        papers = read_papers(args.papers)
        if not papers:
            raise ConfigError(f"no paper files ({', '.join(SUFFIXES)}) in {' '.join(args.papers)}")
        if args.llm == "embedded":
            print("note: llm=embedded (SmolLM2-135M, offline) writes cards that rarely describe the paper "
                  "faithfully (the checks refuse the worst); build with an API model (--llm openrouter)",
                  file=sys.stderr)
        gateway, backend = build_gateway(args.llm, args.set, out)
        summary = build_library(papers, out, gateway, shipped=load_cards(), index=not args.no_index)
    except EmmaError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    for line in summary.lines():
        print(line)
    print(f"use it: python -m emma.run ... attacker=stace attacker.library={out}")
    return 1 if summary.refused else 0
