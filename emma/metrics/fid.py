"""FID: Fréchet distance between generated images and a reference set, in a feature space.

EMMA (§quality) computes FID with Inception-v3 features between the images generated from
the EA and RA prompts and a reference set (COCO validation images):

    FID = ||mu_gen - mu_ref||^2 + Tr(Sigma_gen + Sigma_ref - 2 (Sigma_gen Sigma_ref)^(1/2))

:class:`FrechetDistance` accumulates features batch by batch (torchmetrics-style) from an
*injected* feature extractor, a callable ``(N, 3, H, W) float [0, 1] -> (N, D)``, so the
same metric serves:

- real FID: :class:`CleanFIDInception`, clean-fid's Inception-v3 in its "clean" mode (PIL
  bicubic resize of the uint8 image to 299 px, TF-Inception pool3 features), against
  reference statistics cached on disk (:func:`reference_statistics`; COCO-30k by default);
- the tiny world: :func:`tinyworld_fid`, with the tiny-world classifier's penultimate
  features against procedurally rendered reference scenes.

Statistics and the distance itself are clean-fid's (``np.cov`` with ``ddof=1``,
``cleanfid.fid.frechet_distance``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from emma.errors import ConfigError
from emma.metrics.base import Metric, MetricValue

FeatureExtractor = Callable[[torch.Tensor], torch.Tensor]
#: EMMA's reference set: the 40,504 COCO val2014 images (build its statistics once with
#: ``python -m emma.metrics.fid build coco-val2014 /path/to/val2014``)
DEFAULT_REFERENCE = "coco-val2014"
CLUSTER_BIAS_CORRECTED = "cluster-bootstrap-bias-corrected-percentile"


# ---------------------------------------------------------------------------------------------
# functional core


def gaussian_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (unbiased, ``ddof=1``) covariance of ``(N, D)`` features, as clean-fid."""
    feats = np.asarray(features, dtype=np.float64)
    if feats.ndim != 2 or feats.shape[0] < 2:
        raise ValueError(f"need at least 2 feature vectors of shape (N, D), got {feats.shape}")
    return feats.mean(axis=0), np.cov(feats, rowvar=False)


def _frechet_distance_scipy(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray, eps: float = 1e-6
) -> float:
    from scipy import linalg

    diff = mu1 - mu2
    covmean, _ = linalg.sqrtm(sigma1.dot(sigma2), disp=False)
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"Fréchet distance: imaginary component {np.max(np.abs(covmean.imag))}")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """Fréchet distance between two Gaussians (clean-fid's implementation when installed)."""
    import contextlib
    import io

    try:
        from cleanfid.fid import frechet_distance as _clean_fid_frechet
    except ImportError:  # same formula and regularisation as clean-fid (pytorch-fid's)
        _clean_fid_frechet = _frechet_distance_scipy

    import warnings

    from scipy.linalg import LinAlgWarning

    # clean-fid prints, and scipy warns (LinAlgWarning: "singular matrix"), when the product of
    # covariances is singular -- always so with fewer images than feature dimensions; the
    # regularised square root it then takes is the documented computation, not a fault
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", LinAlgWarning)
        return float(
            _clean_fid_frechet(
                np.atleast_1d(mu1), np.atleast_2d(sigma1), np.atleast_1d(mu2), np.atleast_2d(sigma2)
            )
        )


def _fid_compute(
    fake: np.ndarray,
    ref_mu: np.ndarray,
    ref_sigma: np.ndarray,
    n_bootstrap: int = 0,
    seed: int = 0,
) -> MetricValue:
    mu, sigma = gaussian_statistics(fake)
    value = frechet_distance(mu, sigma, ref_mu, ref_sigma)
    lo = hi = None
    if n_bootstrap > 0:
        rng = np.random.default_rng(seed)
        stats = []
        for _ in range(n_bootstrap):
            idx = rng.integers(0, len(fake), size=len(fake))
            m, s = gaussian_statistics(fake[idx])
            stats.append(frechet_distance(m, s, ref_mu, ref_sigma))
        lo, hi = (float(q) for q in np.quantile(stats, [0.025, 0.975]))
    return MetricValue(value=value, ci_low=lo, ci_high=hi, n=len(fake))


def fid_with_interval(
    features: np.ndarray,
    clusters: Sequence[Any],
    ref_mu: np.ndarray,
    ref_sigma: np.ndarray,
    n_resamples: int = 200,
    seed: int = 0,
    confidence: float = 0.95,
) -> MetricValue:
    """FID of ``features`` with a bias-corrected cluster-bootstrap interval.

    Prompts (``clusters``, one id per image) are resampled with replacement; each replicate is
    the FID of all images of the drawn prompts against the fixed reference. A resample holds
    duplicate images, which shrinks its covariance and raises its FID: the replicates sit
    above the estimate by ``b = mean(replicates) - F``, often by more than their spread, so
    neither the percentile nor the basic interval contains ``F``. The interval is the
    percentile interval of the replicates shifted by ``-b``: ``[q_lo - b, q_hi - b]`` (floored
    at 0). It covers the sampling of prompts and seeds, not the reference's own noise.
    """
    from emma.metrics.intervals import FEW_CLUSTERS_NOTE

    feats = np.asarray(features, dtype=np.float64)
    mu, sigma = gaussian_statistics(feats)
    value = frechet_distance(mu, sigma, ref_mu, ref_sigma)
    ids = list(dict.fromkeys(list(clusters)))
    k = len(ids)
    if k < 2 or n_resamples <= 0:
        return MetricValue(value=value, n=len(feats), n_clusters=k,
                           note=FEW_CLUSTERS_NOTE if k < 2 else None)
    members: dict[Any, list[int]] = {c: [] for c in ids}
    for i, c in enumerate(clusters):
        members[c].append(i)
    rng = np.random.default_rng(seed)
    reps = []
    for row in rng.integers(0, k, size=(n_resamples, k)):
        idx = np.concatenate([members[ids[j]] for j in row])
        m, s = gaussian_statistics(feats[idx])
        reps.append(frechet_distance(m, s, ref_mu, ref_sigma))
    alpha = (1 - confidence) / 2
    q_lo, q_hi = np.quantile(reps, [alpha, 1 - alpha])
    shift = float(np.mean(reps)) - value
    return MetricValue(value=value, ci_low=max(0.0, float(q_lo - shift)), ci_high=float(q_hi - shift),
                       n=len(feats), method=CLUSTER_BIAS_CORRECTED, n_clusters=k)


# ---------------------------------------------------------------------------------------------
# reference statistics


@dataclasses.dataclass
class ReferenceStatistics:
    """Gaussian statistics of a reference image set in one feature space.

    Args:
        mu / sigma: mean ``(D,)`` and covariance ``(D, D)``.
        n: number of reference images.
        name: reference set (``coco30k``, ``tinyworld``, ...).
        extractor: feature extractor id (statistics of different extractors never mix).
        key: cache key of what the statistics were computed from (verified on load).
    """

    mu: np.ndarray
    sigma: np.ndarray
    n: int
    name: str = ""
    extractor: str = ""
    key: str = ""

    @classmethod
    def from_features(cls, features: np.ndarray, name: str = "", extractor: str = "") -> ReferenceStatistics:
        mu, sigma = gaussian_statistics(features)
        return cls(mu=mu, sigma=sigma, n=len(features), name=name, extractor=extractor)

    def sha256(self) -> str:
        """Hash of the statistics themselves (mu and sigma, float64): what a result used."""
        import hashlib

        h = hashlib.sha256(np.ascontiguousarray(self.mu, dtype=np.float64).tobytes())
        h.update(np.ascontiguousarray(self.sigma, dtype=np.float64).tobytes())
        return h.hexdigest()

    def describe(self) -> dict[str, Any]:
        """The record of the reference a FID was computed against (results' provenance)."""
        from importlib import metadata

        try:
            clean_fid = metadata.version("clean-fid")
        except metadata.PackageNotFoundError:
            clean_fid = None
        return {"name": self.name, "n_images": int(self.n), "feature_extractor": self.extractor,
                "clean_fid_version": clean_fid, "stats_sha256": self.sha256()}

    def checksum(self) -> str:
        """sha256 of the statistics (stored in the ``.npz`` and verified on load)."""
        import hashlib

        h = hashlib.sha256()
        for arr in (np.ascontiguousarray(self.mu, np.float64), np.ascontiguousarray(self.sigma, np.float64)):
            h.update(f"{arr.shape}".encode())
            h.update(arr.tobytes())
        h.update(f"{int(self.n)}|{self.name}|{self.extractor}|{self.key}".encode())
        return h.hexdigest()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write an ``.npz`` atomically (temp file + rename), with its checksum."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, mu=self.mu, sigma=self.sigma, n=self.n, name=self.name, extractor=self.extractor,
                     key=self.key, checksum=self.checksum())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], require_checksum: bool = False,
             key: str | None = None) -> ReferenceStatistics:
        """Read and verify statistics (shapes, finite values, and the checksum when stored).

        Args:
            path: the ``.npz``.
            require_checksum: refuse a file without a checksum.
            key: the key the statistics must have been stored under.

        Raises:
            DamagedStatisticsError: the file is unreadable, inconsistent, or altered; or it has
                no checksum and ``require_checksum`` is set.
        """
        try:
            with np.load(path, allow_pickle=False) as z:
                stats = cls(
                    mu=np.array(z["mu"]),
                    sigma=np.array(z["sigma"]),
                    n=int(z["n"]) if "n" in z else 0,
                    name=str(z["name"]) if "name" in z else "",
                    extractor=str(z["extractor"]) if "extractor" in z else "",
                    key=str(z["key"]) if "key" in z else "",
                )
                stored = str(z["checksum"]) if "checksum" in z else None
        except Exception as err:  # noqa: BLE001 - zip/npy errors of many types all mean "damaged"
            raise DamagedStatisticsError(path, f"unreadable: {type(err).__name__}: {err}") from None
        d = stats.mu.shape[0] if stats.mu.ndim == 1 else -1
        if d < 1 or stats.sigma.shape != (d, d):
            raise DamagedStatisticsError(path, f"mu {stats.mu.shape} and sigma {stats.sigma.shape} do not fit")
        if not (np.isfinite(stats.mu).all() and np.isfinite(stats.sigma).all()):
            raise DamagedStatisticsError(path, "NaN/inf in mu or sigma")
        if stored is None and require_checksum:
            raise DamagedStatisticsError(path, "no checksum (written by an older harness or not by it)")
        if stored is not None and stored != stats.checksum():
            raise DamagedStatisticsError(path, "statistics differ from the stored checksum")
        if key is not None and stats.key != key:
            raise DamagedStatisticsError(path, f"statistics of {stats.key[:12] or 'another set'}..., not {key[:12]}...")
        return stats


class DamagedStatisticsError(ConfigError):
    """Cached FID statistics that fail verification."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"FID statistics {path} are damaged ({reason})")


def reference_statistics_path(name: str, extractor: str, root: str | os.PathLike[str] | None = None) -> Path:
    """Cache location ``<root>/fid_stats/<name>__<extractor>.npz`` (``root``: the cell's
    ``paths.cache_dir``; default ``$EMMA_CACHE``)."""
    from emma.weights import cache_root

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in extractor)
    return (Path(root).expanduser() if root is not None else cache_root()) / "fid_stats" / f"{name}__{safe}.npz"


def iter_image_folder(
    folder: str | os.PathLike[str], limit: int | None = None, batch_size: int = 32, size: int | None = None
) -> Iterable[torch.Tensor]:
    """Batches ``(B, 3, H, W)`` in [0, 1] of the images in ``folder`` (sorted, recursive)."""
    from PIL import Image

    exts = {".png", ".jpg", ".jpeg", ".bmp", ".webp"}
    paths = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in exts)[:limit]
    batch: list[torch.Tensor] = []
    for p in paths:
        with Image.open(p) as im:
            im = im.convert("RGB")
            if size is not None:
                im = im.resize((size, size), Image.BICUBIC)
            batch.append(torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255.0)
        # without a common size, images of different shapes cannot share a batch
        if len(batch) == batch_size or size is None:
            yield torch.stack(batch)
            batch = []
    if batch:
        yield torch.stack(batch)


def build_reference_statistics(
    images: Iterable[torch.Tensor] | str | os.PathLike[str],
    extractor: FeatureExtractor,
    name: str = DEFAULT_REFERENCE,
    extractor_id: str | None = None,
    limit: int | None = None,
    cache: bool = True,
    root: str | os.PathLike[str] | None = None,
) -> ReferenceStatistics:
    """Compute (and cache) reference statistics from image batches or an image folder.

    For EMMA's default, point it at the COCO images of the COCO-30k captions (or the 40,504
    val2014 images the paper uses): ``build_reference_statistics("/data/coco/val2014",
    CleanFIDInception())``.
    """
    extractor_id = extractor_id or getattr(extractor, "id", type(extractor).__name__)
    batches = iter_image_folder(images, limit=limit) if isinstance(images, (str, os.PathLike)) else images
    feats = [np.asarray(extractor(b).detach().cpu().double()) for b in batches]
    if not feats:
        raise ConfigError(f"no reference images found for FID reference '{name}'")
    stats = ReferenceStatistics.from_features(np.concatenate(feats), name=name, extractor=extractor_id)
    if cache:
        stats.save(reference_statistics_path(name, extractor_id, root))
    return stats


def reference_statistics(
    name: str = DEFAULT_REFERENCE, extractor_id: str = "clean-fid-inception-v3",
    root: str | os.PathLike[str] | None = None,
) -> ReferenceStatistics:
    """Cached reference statistics, or a clear error saying how to build them."""
    path = reference_statistics_path(name, extractor_id, root)
    if not path.exists():
        raise ReferenceUnavailableError(
            f"FID reference statistics '{name}' for extractor '{extractor_id}' are not cached at {path}. "
            f"Build them once from the reference images: `python -m emma.metrics.fid build {name} "
            "/path/to/coco/val2014 --cache-dir <paths.cache_dir>` (the images are not downloaded by the harness)."
        )
    try:
        return ReferenceStatistics.load(path)
    except DamagedStatisticsError as err:  # built from images the harness does not have: cannot heal
        from emma.cache import quarantine
        from emma.weights import cache_root

        repair = quarantine(path, Path(root) if root is not None else cache_root(), "fid_statistics", err.reason)
        raise ConfigError(f"{err}; moved to {repair.moved_to}. Build them again from the reference images "
                          f"(see `reference_statistics`'s message when they are absent)") from None


class ReferenceUnavailableError(ConfigError):
    """FID reference statistics are not cached (an expected condition offline)."""


# ---------------------------------------------------------------------------------------------
# feature extractors


class CleanFIDInception:
    """clean-fid's Inception-v3 feature extractor ("clean" mode), 2048-d pool3 features.

    Images are quantised to uint8 (as if saved), resized to 299x299 with clean-fid's PIL
    bicubic resizer, and fed as [0, 255] floats to the TF-Inception TorchScript model. The
    weights come from the registry (``python -m emma.weights fetch inception_fid``) and are
    verified in the constructor.
    """

    id = "clean-fid-inception-v3"

    def __init__(
        self, weights: str | os.PathLike[str] = "inception_fid", device: str = "cpu", batch_size: int = 32
    ) -> None:
        from emma.weights import resolve_weights

        self.resolved = resolve_weights(weights, default_entry="inception_fid")
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self._model = None
        self._resizer = None

    def _load(self) -> None:
        from cleanfid.inception_torchscript import InceptionV3W
        from cleanfid.resize import build_resizer

        path = self.resolved.path()
        if path.name != "inception-2015-12-05.pt":
            raise ConfigError(f"clean-fid expects the file to be named inception-2015-12-05.pt, got {path}")
        self._model = (
            InceptionV3W(str(path.parent), download=False, resize_inside=False).to(self.device).eval()
        )
        self._resizer = build_resizer("clean")

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self._model is None:
            self._load()
        arr = (
            (images.detach().float().clamp(0, 1) * 255)
            .round()
            .to(torch.uint8)
            .permute(0, 2, 3, 1)
            .cpu()
            .numpy()
        )
        out = []
        for i in range(0, len(arr), self.batch_size):
            resized = np.stack([self._resizer(a) for a in arr[i : i + self.batch_size]])
            x = torch.from_numpy(resized).permute(0, 3, 1, 2).float().to(self.device)
            out.append(self._model(x).float().cpu())
        return torch.cat(out) if out else torch.zeros(0, 2048)


# ---------------------------------------------------------------------------------------------
# the metric


class FrechetDistance(Metric):
    """FID between generated and reference images in an injected feature space.

    ``update(images)`` adds generated images, ``update(images, real=True)`` reference images
    (or pass precomputed ``reference`` statistics). ``compute`` returns the distance with an
    optional bootstrap interval over the generated images (``n_bootstrap`` resamples; each
    costs one matrix square root, so it is off by default for 2048-d features).

    Args:
        feature_extractor: callable ``(N, 3, H, W) [0, 1] -> (N, D)``; default
            :class:`CleanFIDInception` (built on first update).
        reference: precomputed reference statistics (e.g. :func:`reference_statistics`).
        n_bootstrap: bootstrap resamples for the confidence interval (0 = none).
        seed: bootstrap seed.
    """

    name: ClassVar[str] = "fid"
    higher_is_better: ClassVar[bool | None] = False

    def __init__(
        self,
        feature_extractor: FeatureExtractor | None = None,
        reference: ReferenceStatistics | None = None,
        n_bootstrap: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self._extractor = feature_extractor
        self.reference = reference
        self.n_bootstrap = int(n_bootstrap)
        self.seed = int(seed)
        self.add_state("fake_features", [])
        self.add_state("real_features", [])

    @property
    def feature_extractor(self) -> FeatureExtractor:
        if self._extractor is None:
            self._extractor = CleanFIDInception()
        return self._extractor

    def update(self, images: torch.Tensor, real: bool = False) -> None:
        """Args:
        images: float ``(N, 3, H, W)`` in [0, 1].
        real: ``True`` for reference images, ``False`` for generated ones.
        """
        self.update_features(self.feature_extractor(images), real=real)

    def update_features(self, features: torch.Tensor | np.ndarray, real: bool = False) -> None:
        """Add precomputed features ``(N, D)``."""
        arr = (
            features.detach().cpu().double().numpy()
            if isinstance(features, torch.Tensor)
            else np.asarray(features, float)
        )
        (self.real_features if real else self.fake_features).append(arr.reshape(len(arr), -1))

    def compute(self) -> MetricValue:
        fake = np.concatenate(self.fake_features) if self.fake_features else np.zeros((0, 0))
        if len(fake) < 2:  # a covariance needs two images; report "undefined", not a crash
            return MetricValue(value=float("nan"), n=len(fake))
        if self.real_features:
            mu, sigma = gaussian_statistics(np.concatenate(self.real_features))
        elif self.reference is not None:
            mu, sigma = self.reference.mu, self.reference.sigma
        else:
            raise ConfigError(
                "FrechetDistance has no reference: update(images, real=True) or pass reference="
            )
        return _fid_compute(fake, mu, sigma, self.n_bootstrap, self.seed)


def tinyworld_fid(
    images: torch.Tensor,
    classifier: Any,
    n_ref: int = 1000,
    seed: int = 12345,
    n_bootstrap: int = 0,
) -> MetricValue:
    """FID of tiny-world images against procedurally rendered scenes.

    The feature space is the tiny-world classifier's penultimate layer
    (``TinyWorldClassifier.features``, 64-d); the reference set is ``n_ref`` scenes drawn with
    ``sample_specs(n_ref, seed)`` and rendered with ``render_batch``. Seeded, so the reference
    is the same in every cell.

    Args:
        images: generated images, float ``(N, 3, H, W)`` in [0, 1] (``N < 2`` gives NaN).
        classifier: a ``TinyWorldClassifier`` (anything with ``features(images) -> (N, D)``).
        n_ref: number of reference scenes.
        seed: seed of the reference scenes.
        n_bootstrap: bootstrap resamples of the generated images for a 95% interval.
    """
    from emma.tinyworld.world import render_batch, sample_specs

    refs = torch.from_numpy(render_batch(sample_specs(n_ref, seed)))
    metric = FrechetDistance(feature_extractor=classifier.features, n_bootstrap=n_bootstrap, seed=seed)
    metric.update(refs, real=True)
    metric.update(images)
    return metric.compute()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m emma.metrics.fid build NAME FOLDER [--cache-dir DIR] [--limit N]``: the
    statistics of a local image folder (EMMA: COCO val2014, 40,504 images) with clean-fid's
    Inception, cached where cells look for them."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m emma.metrics.fid")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build reference statistics from an image folder")
    b.add_argument("name")
    b.add_argument("folder")
    b.add_argument("--cache-dir", default=None)
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    stats = build_reference_statistics(args.folder, CleanFIDInception(device=args.device), name=args.name,
                                       limit=args.limit, root=args.cache_dir)
    print(f"{args.name}: {stats.n} images -> "
          f"{reference_statistics_path(args.name, CleanFIDInception.id, args.cache_dir)} "
          f"(sha256 {stats.sha256()[:16]})")


if __name__ == "__main__":
    main()


__all__: Sequence[str] = (
    "CleanFIDInception",
    "FrechetDistance",
    "ReferenceStatistics",
    "build_reference_statistics",
    "fid_with_interval",
    "frechet_distance",
    "gaussian_statistics",
    "reference_statistics",
    "tinyworld_fid",
)
