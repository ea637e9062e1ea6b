"""The weights registry: entries, cache location, verification, download messages, fetch, CLI."""

from __future__ import annotations

import hashlib
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from emma import weights as W
from emma.errors import UnknownChoiceError, WeightsUnavailableError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def toy_entry(monkeypatch):
    """A registry entry for a 32-byte file whose sha256 we know."""
    payload = bytes(range(32))
    entry = W.WeightsEntry(
        name="toy",
        description="toy weights",
        license="CC0",
        homepage="https://example.org",
        files=(
            W.WeightFile(
                path="sub/toy.bin",
                url="https://example.org/toy.bin",
                sha256=hashlib.sha256(payload).hexdigest(),
                size=len(payload),
                mirrors=("https://mirror.example.org/toy.bin",),
            ),
        ),
    )
    monkeypatch.setitem(W.REGISTRY, "toy", entry)
    return entry, payload


def test_registry_entries_are_well_formed():
    for name, entry in W.REGISTRY.items():
        assert entry.name == name
        assert entry.license and entry.homepage.startswith("https://")
        assert entry.files
        for f in entry.files:
            assert f.url.startswith("https://"), f.url
            assert f.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", f.sha256), f.sha256
            assert f.size is None or f.size > 0


def test_registry_pins_the_known_hashes():
    # hashes published upstream: EMMA's git-LFS pointers, OpenAI's URL, the nudenet wheel
    assert W.REGISTRY["ml_decoder_tresnet_l_coco"].files[0].sha256.startswith("f437f095")
    assert W.REGISTRY["ml_decoder_tresnet_l_coco"].files[0].size == 206012315
    assert W.REGISTRY["style_vit_unlearndiffatk"].files[0].sha256.startswith("44e8fc0f")
    assert W.REGISTRY["gcd_celebrity"].files[0].sha256.startswith("48a85c01")
    clip = W.REGISTRY["clip_vit_l14_openai"].files[0]
    assert clip.sha256 in clip.url  # OpenAI's URLs carry the file's sha256
    assert W.REGISTRY["nudenet_320n"].files[0].sha256.startswith("c15d8273")


def test_every_classifier_default_is_registered():
    from classifiers.gcd import GCDClassifier
    from classifiers.ml_decoder import MLDecoderClassifier
    from classifiers.nudenet import NudeNetClassifier
    from classifiers.q16 import Q16Classifier
    from classifiers.style_vit import StyleViTClassifier
    from classifiers.yolo_logo import YOLOLogoClassifier

    for cls in (GCDClassifier, MLDecoderClassifier, NudeNetClassifier, Q16Classifier, StyleViTClassifier,
                YOLOLogoClassifier):  # fmt: skip
        assert cls.default_weights in W.REGISTRY


def test_cache_root_follows_env(cache):
    assert W.cache_root() == cache
    assert W.weights_dir("toy") == cache / "weights" / "toy"


def test_cache_root_default(monkeypatch):
    monkeypatch.delenv("EMMA_CACHE", raising=False)
    assert W.cache_root() == W.Path.home() / ".cache" / "emma"


def test_missing_weights_message_says_what_where_and_how(cache, toy_entry):
    with pytest.raises(WeightsUnavailableError) as err:
        W.resolve("toy")
    msg = str(err.value)
    assert "sub/toy.bin: missing" in msg
    assert "python -m emma.weights fetch toy" in msg
    assert "https://example.org/toy.bin" in msg and "mirror: https://mirror.example.org/toy.bin" in msg
    assert toy_entry[0].files[0].sha256 in msg
    assert str(cache / "weights" / "toy") in msg
    assert "License: CC0" in msg


def test_resolve_verifies_size_and_hash(cache, toy_entry):
    entry, payload = toy_entry
    path = cache / "weights" / "toy" / "sub" / "toy.bin"
    path.parent.mkdir(parents=True)
    path.write_bytes(payload)
    r = W.resolve("toy")
    assert r.path() == path and r.path("sub/toy.bin") == path
    assert r.sha256 == {"sub/toy.bin": entry.files[0].sha256}
    assert r.fingerprint == entry.files[0].sha256[:16] and r.pinned

    path.write_bytes(payload[::-1])  # same size, other bytes
    with pytest.raises(WeightsUnavailableError, match=r"sha256 [0-9a-f]{64}, expected"):
        W.resolve("toy")
    path.write_bytes(payload[:10])
    with pytest.raises(WeightsUnavailableError, match="size 10 bytes, expected 32"):
        W.resolve("toy")


def test_sha256_is_memoised_by_size_and_mtime(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    assert W.sha256sum(f) == hashlib.sha256(b"abc").hexdigest()
    assert (tmp_path / ".w.bin.sha256").exists()
    os.utime(f, ns=(1, 1))
    f.write_bytes(b"abd")  # new content and mtime: the memo must not be reused
    assert W.sha256sum(f) == hashlib.sha256(b"abd").hexdigest()


def test_fingerprint_combines_files_in_name_order():
    a = W.ResolvedWeights("x", {}, {"b": "2" * 64, "a": "1" * 64})
    b = W.ResolvedWeights("x", {}, {"a": "1" * 64, "b": "2" * 64})
    expected = hashlib.sha256(f"a={'1' * 64};b={'2' * 64};".encode()).hexdigest()[:16]
    assert a.fingerprint == b.fingerprint == expected


def test_unknown_entry_suggests_names():
    with pytest.raises(UnknownChoiceError, match="Did you mean 'nudenet_320n'"):
        W.get_entry("nudenet_320")


def test_resolve_weights_accepts_paths(tmp_path):
    f = tmp_path / "model.pth"
    f.write_bytes(b"weights")
    r = W.resolve_weights(f)
    assert r.name == "local" and not r.pinned and r.path() == f.resolve()
    assert r.sha256["model.pth"] == hashlib.sha256(b"weights").hexdigest()
    (tmp_path / "d" / "face_detection").mkdir(parents=True)
    (tmp_path / "d" / "face_detection" / "det1.npy").write_bytes(b"1")
    assert set(W.resolve_weights(tmp_path / "d").paths) == {os.path.join("face_detection", "det1.npy")}
    with pytest.raises(WeightsUnavailableError, match="fetch ml_decoder_tresnet_l_coco"):
        W.resolve_weights(tmp_path / "nope.pth", default_entry="ml_decoder_tresnet_l_coco")


class _FakeResponse:
    def __init__(self, data: bytes, status: int = 200) -> None:
        self.data, self.status = data, status

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def raise_for_status(self):
        if self.status != 200:
            raise OSError(f"HTTP {self.status}")

    def iter_content(self, n):
        for i in range(0, len(self.data), 7):
            yield self.data[i : i + 7]


def test_fetch_downloads_verifies_and_falls_back_to_mirrors(cache, toy_entry, monkeypatch):
    import requests

    entry, payload = toy_entry
    calls = []

    def fake_get(url, stream, timeout):
        calls.append(url)
        return _FakeResponse(b"", 404) if "mirror" not in url else _FakeResponse(payload)

    monkeypatch.setattr(requests, "get", fake_get)
    r = W.fetch("toy", quiet=True)
    assert calls == ["https://example.org/toy.bin", "https://mirror.example.org/toy.bin"]
    assert r.path().read_bytes() == payload
    W.fetch("toy", quiet=True)  # already valid: nothing downloaded
    assert len(calls) == 2


def test_fetch_rejects_a_wrong_hash_and_leaves_no_file(cache, toy_entry, monkeypatch):
    import requests

    monkeypatch.setattr(requests, "get", lambda url, stream, timeout: _FakeResponse(b"x" * 32))
    with pytest.raises(WeightsUnavailableError, match="!= pinned"):
        W.fetch("toy", quiet=True)
    folder = cache / "weights" / "toy" / "sub"
    assert not any(folder.iterdir())


def test_cli_list_verify_fetch(cache, toy_entry, capsys):
    assert W.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "ml_decoder_tresnet_l_coco" in out and "196.5 MB" in out and "missing" in out
    assert W.main(["verify", "toy"]) == 2  # missing weights: a user error
    assert "toy/sub/toy.bin: MISSING" in capsys.readouterr().out
    assert W.main(["fetch", "nudenet_32"]) == 2
    assert "Did you mean" in capsys.readouterr().err
    assert W.main(["path", "toy"]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "weights" / "toy")


def test_nudenet_weights_resolve_to_the_packaged_file(cache):
    pytest.importorskip("nudenet")
    r = W.resolve("nudenet_320n")
    assert r.path().name == "320n.onnx" and "nudenet" in str(r.path())
    assert r.sha256["320n.onnx"] == W.REGISTRY["nudenet_320n"].files[0].sha256
