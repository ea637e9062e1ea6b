"""Inspect domains and their prompt suites from the command line.

Usage::

    python -m emma.suites list
    python -m emma.suites show domain=object concept=airplane [source=generated] [kind=prefix]
    python -m emma.suites counts domain=celebrity [source=emma_official]
    python -m emma.suites defects domain=celebrity
    python -m emma.suites download domain=object        # prefetch pinned files (or set=i2p, or all)
    python -m emma.suites download set=en3k             # a method's reference data (set=all: every set)

Options are ``key=value``: ``domain``, ``concept``, ``kind``, ``source`` (= ``suite.source``),
``root`` (= ``suite.root``, a local copy of EMMA's ``prompts/``), ``set``; any other dotted
key overrides the domain config (``suite.repair=true``; a leading ``domain.`` is accepted).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Sequence

from emma import exit_codes
from emma.errors import EmmaError, UnknownChoiceError

COMMANDS = ("list", "show", "counts", "defects", "download")
_SHORTCUTS = {"source": "suite.source", "root": "suite.root", "repair": "suite.repair",
              "labels_file": "suite.labels_file", "descriptions": "suite.descriptions"}
_OWN = ("domain", "concept", "kind", "set")


def _parse(args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    options: dict[str, str] = {}
    overrides: list[str] = []
    for arg in args:
        if "=" not in arg:
            raise EmmaError(f"expected key=value, got {arg!r} (e.g. domain=object concept=airplane)")
        key, value = arg.split("=", 1)
        key = key.strip()
        if key in _OWN:
            options[key] = value
        else:
            key = _SHORTCUTS.get(key, key.removeprefix("domain."))
            overrides.append(f"{key}={value}")
    return options, overrides


def _domain(options: dict[str, str], overrides: list[str]):
    from emma.domains import load_domain

    if "domain" not in options:
        raise EmmaError("this command needs domain=<name>; `python -m emma.suites list` shows them")
    return load_domain(options["domain"], overrides)


def _cmd_list(options: dict[str, str], overrides: list[str]) -> None:
    from emma.domains import available_domains, load_domain_config

    print(f"{'domain':<12} {'version':<8} {'concepts':>8}  {'source':<14} {'classifier':<12} template")
    for name in available_domains():
        cfg = load_domain_config(name)
        n = len(cfg.get("concepts") or [])
        source = cfg.get("suite", {}).get("source", "-") if cfg.get("suite") else "-"
        print(f"{name:<12} {str(cfg.get('version', '-')):<8} {n:>8}  {str(source):<14} "
              f"{str(cfg.get('classifier', '-')):<12} {cfg.get('template', '-')}")


def _cmd_show(options: dict[str, str], overrides: list[str]) -> None:
    domain = _domain(options, overrides)
    if "concept" in options and not options["concept"].strip():
        raise UnknownChoiceError("concept", "", domain.concepts, where=f"domain '{domain.name}' (concept= is "
                                 "empty; leave it out for the domain's default)")
    concept = domain.concept(options["concept"] if "concept" in options else domain.default_concept)
    prompts = domain.suite.prompts(domain, concept.name)
    kind = options.get("kind")
    if kind is not None and kind not in prompts:
        raise UnknownChoiceError(f"prompt type of {domain.name}/{concept.name}", kind, prompts)
    print(f"domain {domain.name} v{domain.version} | suite {domain.suite.name} v{domain.suite.version}"
          f" | concept {concept.name} ({concept.label}) | classifier {domain.classifier}"
          f" | {domain.images_per_prompt} images per prompt")
    for k, items in prompts.items():
        if kind is not None and k != kind:
            continue
        print(f"\n[{k}] {len(items)} prompt(s)")
        for prompt, checked in items:
            suffix = f"   -> {checked}" if checked != concept.name else ""
            print(f"  {prompt}{suffix}")
    missing = getattr(domain.suite, "missing", None)
    if missing is not None:
        absent = missing(domain, concept.name)
        if absent:
            print(f"\n(no authored {', '.join(absent)} prompts for {concept.name}; "
                  "scripts/generate_descriptions.py writes them)")


def _cmd_counts(options: dict[str, str], overrides: list[str]) -> None:
    domain = _domain(options, overrides)
    totals: dict[str, int] = defaultdict(int)
    per: dict[str, set[int]] = defaultdict(set)
    concepts: dict[str, int] = defaultdict(int)
    for name in domain.concepts:
        for kind, items in domain.suite.prompts(domain, name).items():
            totals[kind] += len(items)
            per[kind].add(len(items))
            concepts[kind] += 1
    print(f"domain {domain.name} v{domain.version} | suite {domain.suite.name} | "
          f"{len(domain.concepts)} concepts")
    print(f"{'type':<10} {'concepts':>8} {'per concept':>12} {'total':>7}")
    for kind in totals:
        each = "/".join(str(n) for n in sorted(per[kind]))
        print(f"{kind:<10} {concepts[kind]:>8} {each:>12} {totals[kind]:>7}")


def _cmd_defects(options: dict[str, str], overrides: list[str]) -> None:
    domain = _domain(options, overrides)
    defects = getattr(domain.suite, "defects", None)
    if defects is None:
        print(f"suite {domain.suite.name} of domain {domain.name} reads no published files")
        return
    found = defects(domain)
    print(f"{len(found)} defect report(s) for EMMA's {domain.name} prompts")
    for defect in found:
        print(f"  {defect}")


def _cmd_download(options: dict[str, str], overrides: list[str]) -> None:
    from emma.datasets import PROMPT_SETS, fetch
    from emma.domains import available_domains, load_domain_config
    from emma.domains.emma_official import LABEL_LISTS, PROMPT_FILES, prompt_file
    from emma.methods.reference_data import SETS as REFERENCE_SETS

    remotes = []
    if "set" in options:
        name = options["set"]
        if name == "all":
            remotes.extend(spec.remote for spec in PROMPT_SETS.values())
            remotes.extend(dict.fromkeys(r.remote for r in REFERENCE_SETS.values() if r.remote is not None))
        elif name in REFERENCE_SETS:
            ref = REFERENCE_SETS[name]
            if ref.remote is None:
                print(f"{ref.path()}  (shipped with the package: {ref.description})")
                return
            remotes.append(ref.remote)
        elif name in PROMPT_SETS:
            remotes.append(PROMPT_SETS[name].remote)
        else:
            raise UnknownChoiceError("prompt set", name, [*PROMPT_SETS, *REFERENCE_SETS, "all"])
    names = available_domains() if options.get("domain", "all") == "all" else [options["domain"]]
    if "set" not in options:
        for name in names:
            cfg = load_domain_config(name)
            emma_dir = cfg.get("emma_dir")
            if emma_dir:
                kinds = [k for k in PROMPT_FILES if k != "variant" or cfg.get("has_variants", True)]
                remotes.extend(prompt_file(emma_dir, k) for k in kinds)
            if cfg.get("classifier_labels"):
                remotes.append(LABEL_LISTS[cfg.classifier_labels])
        if "domain" not in options:
            remotes.extend(spec.remote for spec in PROMPT_SETS.values())
    for remote in remotes:
        print(f"{fetch(remote)}  <- {remote.url}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return exit_codes.OK
    command, rest = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            raise UnknownChoiceError("command", command, COMMANDS)
        options, overrides = _parse(rest)
        {"list": _cmd_list, "show": _cmd_show, "counts": _cmd_counts, "defects": _cmd_defects,
         "download": _cmd_download}[command](options, overrides)
    except EmmaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
