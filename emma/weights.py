"""One registry of the checkpoints the harness can use: where they come from, what they hash to.

Every real-weight classifier (and the FID feature extractor) names a registry entry. An entry
lists its files with the URL they are downloaded from, their sha256, size and license; the
files live in a cache folder, ``$EMMA_CACHE/weights/<entry>/`` (``EMMA_CACHE`` defaults to
``~/.cache/emma``). Weights are *verified before use* (size and sha256; hashes are memoised in
a sidecar file keyed by size and mtime so a 300 MB checkpoint is not re-hashed every run), and
a missing or corrupt file raises :class:`~emma.errors.WeightsUnavailableError` with the exact
download instructions, before any heavy library is imported.

Command line::

    python -m emma.weights list              # entries, sizes, licenses, what is cached
    python -m emma.weights verify [NAME ...] # check cached files against their sha256
    python -m emma.weights fetch NAME [...]  # download (needs network), verify, cache
    python -m emma.weights path NAME         # print the folder the files go in

Some upstream files have never had a published hash (``sha256: None`` below, "unpinned").
They are still downloaded from their pinned URL; ``fetch`` and ``verify`` print the hash
they found so it can be pinned here, and results record it.

Pinned hashes of the EMMA checkpoints come from the git-LFS pointers of
``lobsterlulu/EMMA`` (``oid sha256:...`` and ``size``); the OpenAI CLIP hashes are part of
the OpenAI download URLs; NudeNet's is that of ``320n.onnx`` shipped in ``nudenet==3.4.2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from emma import exit_codes
from emma.errors import UnknownChoiceError, WeightsUnavailableError

ENV_CACHE = "EMMA_CACHE"
_CHUNK = 1 << 20

_EMMA_LFS = "https://media.githubusercontent.com/media/lobsterlulu/EMMA"


@dataclasses.dataclass(frozen=True)
class WeightFile:
    """One file of a registry entry.

    Args:
        path: file name relative to the entry's folder (may contain sub-folders).
        url: where ``fetch`` downloads it from.
        sha256: expected sha256 (hex); ``None`` when upstream never published one.
        size: expected size in bytes, when known.
        mirrors: further URLs tried in order when ``url`` fails.
        package_resource: ``(package, resource)`` of a copy shipped inside an installed
            Python package (NudeNet ships its ONNX model); used before the cache.
    """

    path: str
    url: str
    sha256: str | None = None
    size: int | None = None
    mirrors: tuple[str, ...] = ()
    package_resource: tuple[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class WeightsEntry:
    """A named set of weight files (one checkpoint, or a checkpoint and its companions).

    Args:
        name: registry key (what ``conf/classifier/*.yaml`` puts in ``weights:``).
        description: what the files are.
        license: license of the weights, as stated upstream.
        homepage: where the weights are documented.
        files: the files.
        notes: anything a user must know (provenance caveats, how to make the file).
    """

    name: str
    description: str
    license: str
    homepage: str
    files: tuple[WeightFile, ...]
    notes: str = ""

    @property
    def size(self) -> int | None:
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[arg-type]


REGISTRY: dict[str, WeightsEntry] = {
    e.name: e
    for e in (
        WeightsEntry(
            name="nudenet_320n",
            description="NudeNet v3 detector (YOLOv8n, 320 px, 18 body-part classes), ONNX",
            license="MIT (NudeNet)",
            homepage="https://github.com/notAI-tech/NudeNet",
            files=(
                WeightFile(
                    path="320n.onnx",
                    url="https://github.com/notAI-tech/NudeNet/releases/download/v3.4-weights/320n.onnx",
                    sha256="c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
                    size=12150158,
                    package_resource=("nudenet", "320n.onnx"),
                ),
            ),
            notes="Ships inside the `nudenet` package (pip install 'emma-harness[nsfw]').",
        ),
        WeightsEntry(
            name="clip_vit_l14_openai",
            description="OpenAI CLIP ViT-L/14 (TorchScript archive), image tower of Q16",
            license="MIT (OpenAI CLIP)",
            homepage="https://github.com/openai/CLIP",
            files=(
                WeightFile(
                    path="ViT-L-14.pt",
                    url="https://openaipublic.azureedge.net/clip/models/"
                    "b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836/ViT-L-14.pt",
                    sha256="b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836",
                ),
            ),
        ),
        WeightsEntry(
            name="clip_vit_b32_openai",
            description="OpenAI CLIP ViT-B/32 (TorchScript archive), for CLIP zero-shot / bias",
            license="MIT (OpenAI CLIP)",
            homepage="https://github.com/openai/CLIP",
            files=(
                WeightFile(
                    path="ViT-B-32.pt",
                    url="https://openaipublic.azureedge.net/clip/models/"
                    "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af/ViT-B-32.pt",
                    sha256="40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af",
                ),
            ),
        ),
        WeightsEntry(
            name="q16_prompts_vit_l14",
            description="Q16 learned 'benign'/'inappropriate' prompt embeddings for CLIP ViT-L/14 "
            "(pickled float array, 2 x 768)",
            license="MIT (Q16)",
            homepage="https://github.com/ml-research/Q16",
            files=(
                WeightFile(
                    path="prompts.p",
                    url="https://github.com/ml-research/Q16/raw/main/data/ViT-L-14/prompts.p",
                ),
            ),
            notes="Upstream publishes no hash (unpinned); `fetch` prints the one it downloads.",
        ),
        WeightsEntry(
            name="ml_decoder_tresnet_l_coco",
            description="ML-Decoder head on TResNet-L (v2), MS-COCO 80 classes, 448 px, mAP 90.0",
            license="MIT (Alibaba-MIIL ML-Decoder)",
            homepage="https://github.com/Alibaba-MIIL/ML_Decoder/blob/main/MODEL_ZOO.md",
            files=(
                WeightFile(
                    path="tresnet_l_COCO__448_90_0.pth",
                    url="https://miil-public-eu.oss-eu-central-1.aliyuncs.com/model-zoo/ML_Decoder/"
                    "tresnet_l_COCO__448_90_0.pth",
                    sha256="f437f095f8796c973960eb7591723ebf349e61098257abc6ac14c76da40b4ec1",
                    size=206012315,
                    mirrors=(
                        f"{_EMMA_LFS}/7d6f9ba50b6c302bd156ca96f709974101f1a37a/classifier/ML_Decoder/"
                        "models_zoo/tresnet_l_COCO__448_90_0.pth",
                    ),
                ),
            ),
            notes="Hash pinned from the copy EMMA ships (git-LFS pointer).",
        ),
        WeightsEntry(
            name="gcd_celebrity",
            description="GIPHY Celebrity Detector: MTCNN face detector (det1-3.npy) + ResNet-50 "
            "centre-loss identity classifier over 2,306 celebrities",
            license="MPL-2.0 (GIPHY celeb-detection-oss); MTCNN weights MIT (facenet)",
            homepage="https://github.com/Giphy/celeb-detection-oss",
            files=(
                WeightFile(
                    path="face_recognition/best_model_states.pkl",
                    url=f"{_EMMA_LFS}/311e3b04fbd364d38e128ca92775c6a93530d7e5/GCD/resources/"
                    "face_recognition/best_model_states.pkl",
                    sha256="48a85c01ba4cc144546fd3ae4db0f1189e84cc0c2b40059f186902b8df9adf08",
                    size=302899114,
                ),
                WeightFile(
                    path="face_detection/det1.npy",
                    url="https://github.com/davidsandberg/facenet/raw/master/src/align/det1.npy",
                ),
                WeightFile(
                    path="face_detection/det2.npy",
                    url="https://github.com/davidsandberg/facenet/raw/master/src/align/det2.npy",
                ),
                WeightFile(
                    path="face_detection/det3.npy",
                    url="https://github.com/davidsandberg/facenet/raw/master/src/align/det3.npy",
                ),
            ),
            notes="GIPHY also distributes all four files as one archive, "
            "https://s3.amazonaws.com/giphy-public/models/celeb-detection/resources.tar.gz "
            "(unpack its face_recognition/ and face_detection/ folders into this entry's folder). "
            "The MTCNN .npy files are unpinned upstream.",
        ),
        WeightsEntry(
            name="style_vit_unlearndiffatk",
            description="UnlearnDiffAtk art-style classifier: ViTForImageClassification "
            "(ViT-B/16 in21k), 129 classes, HF checkpoint-2800",
            license="MIT (OPTML-Group Diffusion-MU-Attack)",
            homepage="https://github.com/OPTML-Group/Diffusion-MU-Attack",
            files=(
                WeightFile(
                    path="pytorch_model.bin",
                    url=f"{_EMMA_LFS}/7d6f9ba50b6c302bd156ca96f709974101f1a37a/classifier/"
                    "Diffusion-MU-Attack/classifier/checkpoint-2800/pytorch_model.bin",
                    sha256="44e8fc0fc8ada667b2303a5acbb259277c7d8312aae95bc54b272c9bb731e396",
                    size=343657649,
                ),
            ),
            notes="The architecture config and label list ship with the package "
            "(classifiers/data/style_vit_config.json).",
        ),
        WeightsEntry(
            name="yolo11s_cls_logo_emma",
            description="YOLO11s-cls checkpoint distributed with EMMA for the copyright (logo) domain",
            license="AGPL-3.0 (Ultralytics)",
            homepage="https://github.com/lobsterlulu/EMMA",
            files=(
                WeightFile(
                    path="yolo11s-cls.pt",
                    url=f"{_EMMA_LFS}/311e3b04fbd364d38e128ca92775c6a93530d7e5/YOLO/model/yolo11s-cls.pt",
                    sha256="e2b605d1c8c212b434a75a32759a6f7adf1d2b29c35f76bdccd4c794cb653cf2",
                    size=13630112,
                ),
            ),
            notes="The classifier checks at load time that the checkpoint's class names cover "
            "the 30 LogoDet-3K brands; train your own with scripts/train_logo_classifier.py and "
            "pass classifier.weights=/path/to/best.pt.",
        ),
        WeightsEntry(
            name="inception_fid",
            description="Inception-v3 TorchScript feature extractor used by clean-fid "
            "(TF FID weights, pool3 2048-d)",
            license="Apache-2.0 (TensorFlow Inception-v3)",
            homepage="https://github.com/GaParmar/clean-fid",
            files=(
                WeightFile(
                    path="inception-2015-12-05.pt",
                    url="https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/"
                    "inception-2015-12-05.pt",
                ),
            ),
            notes="The URL clean-fid itself downloads from (unpinned upstream).",
        ),
    )
}


@dataclasses.dataclass
class FileStatus:
    """State of one registry file on this machine."""

    file: WeightFile
    path: Path
    exists: bool
    sha256: str | None = None
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.exists and self.problem is None


@dataclasses.dataclass
class ResolvedWeights:
    """Verified weight files, ready to load.

    Attributes:
        name: registry entry name, or ``"local"`` for a user-supplied path.
        paths: file name (as in the registry) -> absolute path.
        sha256: file name -> sha256 actually found.
    """

    name: str
    paths: dict[str, Path]
    sha256: dict[str, str]
    pinned: bool = True

    @property
    def fingerprint(self) -> str:
        """Short combined hash of all files (what results record as the weight hash)."""
        if len(self.sha256) == 1:
            return next(iter(self.sha256.values()))[:16]
        h = hashlib.sha256()
        for key in sorted(self.sha256):
            h.update(f"{key}={self.sha256[key]};".encode())
        return h.hexdigest()[:16]

    def path(self, name: str | None = None) -> Path:
        """Path of file ``name`` (the only file when ``None``)."""
        if name is None:
            if len(self.paths) != 1:
                raise KeyError(f"entry {self.name!r} has several files: {sorted(self.paths)}")
            return next(iter(self.paths.values()))
        return self.paths[name]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "sha256": dict(self.sha256), "pinned": self.pinned}


def cache_root() -> Path:
    """``$EMMA_CACHE`` or ``~/.cache/emma``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "emma"


def weights_dir(name: str | None = None, root: str | Path | None = None) -> Path:
    """Folder of the weight cache, or of entry ``name`` in it."""
    base = Path(root) if root is not None else cache_root() / "weights"
    return base / name if name else base


def get_entry(name: str) -> WeightsEntry:
    """The registry entry ``name`` (clear error listing the valid names)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownChoiceError("weights entry", name, REGISTRY) from None


def sha256sum(path: str | Path, *, memoise: bool = True) -> str:
    """sha256 of a file, memoised in a sidecar ``.<name>.sha256`` keyed by size and mtime."""
    path = Path(path)
    st = path.stat()
    sidecar = path.with_name(f".{path.name}.sha256")
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if memoise and sidecar.exists():
        try:
            cached = json.loads(sidecar.read_text())
            if cached.get("size") == key["size"] and cached.get("mtime_ns") == key["mtime_ns"]:
                return str(cached["sha256"])
        except (OSError, ValueError, KeyError):
            pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if memoise:
        try:
            sidecar.write_text(json.dumps({**key, "sha256": digest}))
        except OSError:  # read-only location (e.g. a site-packages file): just don't memoise
            pass
    return digest


def _package_path(resource: tuple[str, str]) -> Path | None:
    """Location of a resource inside an installed package, without importing the package."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(resource[0])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / resource[1]
        if p.exists():
            return p
    return None


def file_status(
    entry: WeightsEntry, root: str | Path | None = None, *, check_hash: bool = True
) -> list[FileStatus]:
    """Where each file of ``entry`` is and whether it is intact."""
    out = []
    folder = weights_dir(entry.name, root)
    for wf in entry.files:
        path = folder / wf.path
        if wf.package_resource and not path.exists():
            packaged = _package_path(wf.package_resource)
            if packaged is not None:
                path = packaged
        st = FileStatus(file=wf, path=path, exists=path.is_file())
        if st.exists:
            size = path.stat().st_size
            if wf.size is not None and size != wf.size:
                st.problem = f"size {size} bytes, expected {wf.size} (partial or wrong file)"
            elif check_hash:
                # memoise hashes only inside the cache (never write into site-packages)
                st.sha256 = sha256sum(path, memoise=path.is_relative_to(folder))
                if wf.sha256 is not None and st.sha256 != wf.sha256:
                    st.problem = f"sha256 {st.sha256}, expected {wf.sha256} (corrupt or wrong file)"
        out.append(st)
    return out


def download_instructions(entry: WeightsEntry, root: str | Path | None = None) -> str:
    """The part of an error message that says what to download and where to put it."""
    folder = weights_dir(entry.name, root)
    lines = [
        f"Fetch them with `python -m emma.weights fetch {entry.name}` (needs network), or download "
        f"by hand into {folder}/:"
    ]
    for wf in entry.files:
        sha = wf.sha256 or "unpinned"
        size = f", {wf.size} bytes" if wf.size else ""
        lines.append(f"  {wf.path}  <- {wf.url}  (sha256 {sha}{size})")
        for m in wf.mirrors:
            lines.append(f"      mirror: {m}")
    if entry.notes:
        lines.append(f"Note: {entry.notes}")
    lines.append(f"License: {entry.license}. The cache root is ${ENV_CACHE} (default ~/.cache/emma).")
    return "\n".join(lines)


def resolve(name: str, root: str | Path | None = None) -> ResolvedWeights:
    """Verified paths of registry entry ``name``.

    Raises:
        WeightsUnavailableError: a file is missing or does not match its size / sha256;
            the message says what to download, from where, and where to put it.
    """
    entry = get_entry(name)
    statuses = file_status(entry, root)
    bad = [s for s in statuses if not s.ok]
    if bad:
        what = "; ".join(
            f"{s.file.path}: {'missing at ' + str(s.path) if not s.exists else s.problem}" for s in bad
        )
        raise WeightsUnavailableError(
            f"weights '{entry.name}' ({entry.description}) are not usable here: {what}.\n"
            + download_instructions(entry, root)
        )
    return ResolvedWeights(
        name=entry.name,
        paths={s.file.path: s.path for s in statuses},
        sha256={s.file.path: s.sha256 or "" for s in statuses},
        pinned=all(s.file.sha256 is not None for s in statuses),
    )


def resolve_weights(spec: str | os.PathLike[str], default_entry: str | None = None) -> ResolvedWeights:
    """Resolve a classifier's ``weights`` argument: a registry name or a local path.

    A registry name is looked up in the cache and verified; a path (file or folder) is used
    as given and hashed (without writing hash memos into the user's folder). Anything else
    raises a :class:`WeightsUnavailableError` that points at the default entry's download
    instructions.
    """
    spec_s = os.fspath(spec)
    if spec_s in REGISTRY:
        return resolve(spec_s)
    path = Path(spec_s).expanduser()
    if path.is_file():
        return ResolvedWeights(
            name="local",
            paths={path.name: path.resolve()},
            sha256={path.name: sha256sum(path, memoise=False)},
            pinned=False,
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if files:
            return ResolvedWeights(
                name="local",
                paths={str(p.relative_to(path)): p.resolve() for p in files},
                sha256={str(p.relative_to(path)): sha256sum(p, memoise=False) for p in files},
                pinned=False,
            )
    hint = ""
    if default_entry is not None:
        hint = "\n" + download_instructions(get_entry(default_entry))
    entries = ", ".join(sorted(REGISTRY))
    if path.is_dir():
        what = f"weights folder {spec_s!r} holds no files"
    elif looks_like_path(spec_s):
        what = f"weights path {spec_s!r} does not exist ({path.absolute()})"
    else:
        what = f"weights {spec_s!r} are neither a registry entry nor an existing file or folder"
    raise WeightsUnavailableError(f"{what}. Give an existing file or folder, or a registry entry: {entries}.{hint}")


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` names a place on this machine rather than a registry entry or a hub
    id (``org/name``): it exists, is absolute, starts with ``.`` or ``~``, or has more than
    one ``/`` or a backslash. Error messages use it to say "does not exist" instead of
    advising a download."""
    s = spec.strip()
    return (Path(s).expanduser().exists() or os.path.isabs(s) or s.startswith((".", "~"))
            or s.count("/") > 1 or "\\" in s)


def fetch(
    name: str, root: str | Path | None = None, *, force: bool = False, quiet: bool = False
) -> ResolvedWeights:
    """Download the files of entry ``name`` that are missing or corrupt, verify, cache.

    Each file is streamed to a temporary name and renamed into place only after its sha256
    (when pinned) matched, so an interrupted download never leaves a file that looks valid.
    """
    import requests

    entry = get_entry(name)
    for st in file_status(entry, root):
        if st.ok and not force:
            continue
        dest = weights_dir(entry.name, root) / st.file.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        errors = []
        for url in (st.file.url, *st.file.mirrors):
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            try:
                if not quiet:
                    print(f"downloading {url}", file=sys.stderr)
                h = hashlib.sha256()
                with requests.get(url, stream=True, timeout=60) as r:
                    r.raise_for_status()
                    with open(tmp, "wb") as f:
                        for chunk in r.iter_content(_CHUNK):
                            f.write(chunk)
                            h.update(chunk)
                digest = h.hexdigest()
                if st.file.sha256 is not None and digest != st.file.sha256:
                    raise ValueError(f"sha256 {digest} != pinned {st.file.sha256}")
                os.replace(tmp, dest)
                if st.file.sha256 is None and not quiet:
                    print(f"  {st.file.path}: unpinned upstream; downloaded sha256 {digest}", file=sys.stderr)
                break
            except Exception as exc:  # noqa: BLE001 - try the next mirror, report all at the end
                errors.append(f"{url}: {exc}")
                Path(tmp).unlink(missing_ok=True)
        else:
            raise WeightsUnavailableError(
                f"could not download {st.file.path} of '{entry.name}':\n  "
                + "\n  ".join(errors)
                + "\n"
                + download_instructions(entry, root)
            )
    return resolve(name, root)


def _fmt_size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m emma.weights list|verify|fetch|path``."""
    parser = argparse.ArgumentParser(prog="python -m emma.weights", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="registry entries and their cache state")
    p_verify = sub.add_parser("verify", help="check cached files against their sha256")
    p_verify.add_argument("names", nargs="*")
    p_fetch = sub.add_parser("fetch", help="download, verify and cache entries")
    p_fetch.add_argument("names", nargs="+")
    p_fetch.add_argument("--force", action="store_true")
    p_path = sub.add_parser("path", help="folder of an entry in the cache")
    p_path.add_argument("name")
    args = parser.parse_args(argv)

    try:
        if args.cmd == "list":
            for entry in REGISTRY.values():
                sts = file_status(entry, check_hash=False)
                state = "cached" if all(s.exists for s in sts) else "missing"
                print(f"{entry.name:28s} {_fmt_size(entry.size):>9s}  {state:7s}  {entry.license}")
                print(f"    {entry.description}")
            print(f"cache: {weights_dir()}")
            return exit_codes.OK
        if args.cmd == "path":
            print(weights_dir(get_entry(args.name).name))
            return exit_codes.OK
        if args.cmd == "verify":
            rc = exit_codes.OK
            for name in args.names or list(REGISTRY):
                for st in file_status(get_entry(name)):
                    if not st.exists:
                        print(f"{name}/{st.file.path}: MISSING ({st.path})")
                        rc = exit_codes.USER_ERROR  # missing weights
                    elif st.problem:
                        print(f"{name}/{st.file.path}: BAD {st.problem}")
                        rc = exit_codes.USER_ERROR
                    else:
                        pin = "ok" if st.file.sha256 else "unpinned"
                        print(f"{name}/{st.file.path}: {pin} sha256 {st.sha256}")
            return rc
        if args.cmd == "fetch":
            for name in args.names:
                resolved = fetch(name)
                print(f"{name}: ok ({resolved.fingerprint})")
            return exit_codes.OK
    except (WeightsUnavailableError, UnknownChoiceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return exit_codes.OK


if __name__ == "__main__":
    raise SystemExit(main())
