"""``python -m stace.library build``: PaperCards from supplied papers, through the scripted
chat-completions server (tests/stace_server.py) standing in for the configured LLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stace_server import Fault, ScriptedChatServer, user_message  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ABSTRACTS = ROOT / "tests" / "fixtures" / "stace_abstracts"
FAKE_KEY = "sk-canary-library-7f3e9a1b2c4d"


def card(key: str, title: str, year: int = 2024) -> dict:
    return {"key": key, "title": title, "year": year, "kind": "erasure", "task": f"{title}: erase a concept.",
            "model_types": ["Stable Diffusion v1.4"], "method": f"The method of {key}.",
            "settings": "Nudity and styles.", "limitations": "Adversarial prompts.", "code": None}


CARDS = {"Safe Self-Distillation": card("sdd", "Towards Safe Self-Distillation of Internet-Scale Text-to-Image "
                                                "Diffusion Models", 2023),
         "Scissorhands": card("scissorhands", "Scissorhands: Scrub Data Influence via Connection Sensitivity"),
         "ConceptPrune": card("conceptprune", "ConceptPrune: Concept Editing in Diffusion Models via Skilled "
                                              "Neuron Pruning"),
         "ESD again": card("esd_copy", "Erasing Concepts from Diffusion Models (ESD)", 2023),
         "Another SDD": card("sdd", "Another Paper Whose Card Key Is Taken")}


def paper_message(body: dict) -> str:
    """The first user message (the paper's text; a repair round appends another)."""
    return [m["content"] for m in body["messages"] if m["role"] == "user"][0]


def scripted(body: dict, n: int) -> str | Fault:
    text = paper_message(body)
    for marker, c in CARDS.items():
        if marker in text:
            return json.dumps(c)
    return Fault(status=500)


def gateway(url: str, out: Path):
    from stace.library_builder import build_gateway

    return build_gateway("local", [f"base_url={url}", "model=card-writer", "max_retries=0", "timeout=5"], out)[0]


def test_builds_cards_from_three_fixture_abstracts_then_only_new_papers(tmp_path):
    from stace.library import Library, load_cards
    from stace.library_builder import build_library, library_cards, read_papers

    out = tmp_path / "lib"
    papers = read_papers([ABSTRACTS])
    assert [p.source for p in papers] == ["conceptprune.txt", "scissorhands.txt", "sdd.txt"]
    with ScriptedChatServer(scripted) as srv:
        s = build_library(papers, out, gateway(srv.url, out), shipped=load_cards())
        assert len(srv.requests) == 3  # one PaperCard call per paper, no repair needed
        assert {r["model"] for r in srv.requests} == {"card-writer"}
        # the request asks for the PaperCard schema and carries the paper's text
        assert srv.requests[0]["response_format"]["json_schema"]["schema"]["title"] == "PaperCard"
        assert "Wanda-style importance" in user_message(srv.requests[0])
    assert s.built == ["conceptprune", "scissorhands", "sdd"] and s.refused == [] and s.skipped == 0
    assert s.llm_calls == 3 and s.cards_total == 3
    built = yaml.safe_load((out / "papercards.yaml").read_text())
    assert [c["key"] for c in built] == ["conceptprune", "scissorhands", "sdd"]
    assert built[2]["year"] == 2023 and built[2]["title"].startswith("Towards Safe Self-Distillation")
    sources = json.loads((out / "sources.json").read_text())
    assert sorted(v["status"] for v in sources.values()) == ["card"] * 3
    assert papers[0].sha256 in sources  # content-addressed: keyed by the text's hash
    # indexed with the existing embedder: shipped + built cards, one row each
    import numpy as np

    everything = library_cards(out)
    assert len(everything) == len(load_cards()) + 3
    lib = Library(everything, cache_dir=out / "index")
    assert Path(s.index) == out / "index" / f"{lib.key()}.npy"
    assert np.load(s.index).shape == (len(everything), 384)
    top = lib.search(["prune the skilled neurons of the feed-forward layers"], top_k=1)[0][0]
    assert top.key == "conceptprune"

    # a second run: nothing new, no LLM call (the same texts under other names too)
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "renamed.txt").write_text("  " + (ABSTRACTS / "sdd.txt").read_text() + "\n\n")
    with ScriptedChatServer(scripted) as srv:
        again = build_library(read_papers([ABSTRACTS, tmp_path / "more"]), out, gateway(srv.url, out),
                              shipped=load_cards())
        assert srv.requests == []
    assert again.built == [] and again.skipped == 4 and again.llm_calls == 0

    # new papers: one is a shipped card's paper (duplicate by title), one's key is taken
    (tmp_path / "new.jsonl").write_text(
        json.dumps({"title": "ESD again", "abstract": "Fine-tunes the UNet with negative guidance."}) + "\n"
        + json.dumps({"text": "Another SDD-like paper, different text."}) + "\n")
    with ScriptedChatServer(scripted) as srv:
        third = build_library(read_papers([ABSTRACTS, tmp_path / "new.jsonl"]), out, gateway(srv.url, out),
                              shipped=load_cards(), index=False)
        assert len(srv.requests) == 2  # only the two new texts
    assert third.duplicates == ["new.jsonl#1: duplicate of 'esd' (same title)"]
    assert third.built == ["sdd-2"] and third.skipped == 3
    assert [c["key"] for c in yaml.safe_load((out / "papercards.yaml").read_text())] == \
        ["conceptprune", "scissorhands", "sdd", "sdd-2"]
    # the duplicate is remembered: a fourth run asks nothing
    with ScriptedChatServer(scripted) as srv:
        build_library(read_papers([tmp_path / "new.jsonl"]), out, gateway(srv.url, out), shipped=load_cards(),
                      index=False)
        assert srv.requests == []


def test_malformed_replies_are_refused_counted_and_retried_later(tmp_path):
    from stace.library import load_cards
    from stace.library_builder import build_library, read_papers

    out = tmp_path / "lib"

    def bad(body: dict, n: int) -> str:
        text = paper_message(body)
        if "Scissorhands" in text:
            return "Sure! Here is the card: key scissorhands, a pruning method."  # no JSON, twice
        if "ConceptPrune" in text:
            return json.dumps({**CARDS["ConceptPrune"], "key": "Concept Prune!"})  # fails the key check
        if "Self-Distillation" in text:
            return json.dumps({**CARDS["Safe Self-Distillation"], "year": 1999})  # fails the schema
        return "{}"

    with ScriptedChatServer(bad) as srv:
        s = build_library(read_papers([ABSTRACTS]), out, gateway(srv.url, out), shipped=load_cards(), index=False)
        assert len(srv.requests) == 6  # each paper: a request and its repair round
    assert s.built == [] and len(s.refused) == 3
    refused = dict(r.split(": ", 1) for r in s.refused)
    assert refused["scissorhands.txt"].startswith("the reply failed the PaperCard schema after the repair round: "
                                                  "the reply is not valid JSON")
    assert "key 'Concept Prune!' must be lower-case letters" in refused["conceptprune.txt"]
    assert "year" in refused["sdd.txt"] and "greater than or equal to 2000" in refused["sdd.txt"]
    assert yaml.safe_load((out / "papercards.yaml").read_text()) == []  # nothing malformed is stored
    statuses = json.loads((out / "sources.json").read_text())
    assert sorted(v["status"] for v in statuses.values()) == ["refused"] * 3
    assert "0 new cards, 0 already in the library (no LLM call), 0 duplicates, 3 refused" in s.lines()[0]
    # refused papers are tried again; good replies are stored
    with ScriptedChatServer(scripted) as srv:
        again = build_library(read_papers([ABSTRACTS]), out, gateway(srv.url, out), shipped=load_cards(),
                              index=False)
        assert len(srv.requests) == 3
    assert again.built == ["conceptprune", "scissorhands", "sdd"] and again.refused == []


def test_card_checks_refuse_what_the_schema_lets_through():
    """The card SmolLM2-135M (llm=embedded) wrote for conceptprune.txt passes the schema; the
    content checks refuse it (and so send it to the repair round)."""
    from stace.library_builder import _check_card
    from stace.schemas import PaperCard

    garbage = PaperCard(key="1", title="ConceptPrune: ConceptEd:", year=2023, kind="safety",
                        task="https://github.com/STACE", model_types=["conceptEd"], method="https://github.com/STACE",
                        settings="100", limitations="100", code="https://github.com/STACE")
    with pytest.raises(ValueError, match="key '1' must be lower-case letters, digits, '_', '.' or '-', with a letter"):
        _check_card(garbage)
    with pytest.raises(ValueError, match="task must describe the paper's task in a sentence, not 'https://"):
        _check_card(garbage.model_copy(update={"key": "conceptprune"}))
    with pytest.raises(ValueError, match="code must be the repository's URL or null, not 'see the paper'"):
        _check_card(PaperCard(**{**CARDS["ConceptPrune"], "code": "see the paper"}))
    _check_card(PaperCard(**CARDS["ConceptPrune"]))  # a proper card passes


def test_cli_builds_offline_and_no_key_reaches_any_output(tmp_path):
    """The command line end to end, the key read from the variable the config names (the canary)."""
    out = tmp_path / "lib"
    env = {**os.environ, "LIBRARY_TEST_KEY": FAKE_KEY, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with ScriptedChatServer(scripted, key=FAKE_KEY) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "stace.library", "build", str(ABSTRACTS), "--out", str(out), "--llm", "local",
             "--set", f"base_url={srv.url}", "--set", "model=card-writer", "--set", "api_key_env=LIBRARY_TEST_KEY",
             "--no-index"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert srv.headers and all({k.lower(): v for k, v in h.items()}["authorization"] == f"Bearer {FAKE_KEY}"
                                   for h in srv.headers)
    assert proc.returncode == 0, proc.stderr
    assert "3 paper texts: 3 new cards, 0 already in the library (no LLM call)" in proc.stdout
    assert f"attacker.library={out}" in proc.stdout
    for f in out.rglob("*"):
        if f.is_file():
            assert FAKE_KEY not in f.read_text(errors="replace"), f
    assert FAKE_KEY not in proc.stdout + proc.stderr
    # bad input: one line naming what is wrong and what is valid, exit code 2
    (tmp_path / "paper.docx").write_text("x")
    bad = subprocess.run([sys.executable, "-m", "stace.library", "build", str(tmp_path / "paper.docx"), "--out",
                          str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("error: paper.docx: unknown paper format '.docx'; valid: .txt, .md, .pdf, "
                                  ".jsonl, .json")
    nollm = subprocess.run([sys.executable, "-m", "stace.library", "build", str(ABSTRACTS), "--out", str(out),
                            "--llm", "gpt"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert nollm.returncode == 2 and "--llm 'gpt': no such LLM config; valid: embedded, local" in nollm.stderr


def _pdf(text: str) -> bytes:
    """A one-page PDF showing ``text`` in Helvetica, with a correct cross-reference table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>",
            b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = b"%PDF-1.4\n", []
    for i, o in enumerate(objs, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + o + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return out


def test_pdf_text_is_read_and_unreadable_pdfs_are_named(tmp_path):
    pytest.importorskip("pypdf")
    from emma.errors import ConfigError
    from stace.library_builder import read_papers

    (tmp_path / "paper.pdf").write_bytes(_pdf("ConceptPrune prunes skilled neurons"))
    (papers,) = read_papers([tmp_path / "paper.pdf"])
    assert papers.source == "paper.pdf" and "ConceptPrune prunes skilled neurons" in papers.text
    (tmp_path / "broken.pdf").write_bytes(b"not a pdf at all")
    with pytest.raises(ConfigError, match=r"^broken.pdf: not a readable PDF"):
        read_papers([tmp_path / "broken.pdf"])


def test_attacker_library_setting_adds_built_cards_or_names_the_problem(tmp_path):
    from emma.errors import ConfigError
    from stace.library import load_cards
    from stace.library_builder import library_cards

    assert [c.key for c in library_cards(None)] == [c.key for c in load_cards()]
    with pytest.raises(ConfigError, match=r"attacker.library='.*nowhere': no papercards.yaml there; build one"):
        library_cards(tmp_path / "nowhere")
    (tmp_path / "clash.yaml").write_text(yaml.safe_dump([card("esd", "A different ESD")]))
    with pytest.raises(ConfigError, match="card key 'esd' is a shipped card's"):
        library_cards(tmp_path / "clash.yaml")
