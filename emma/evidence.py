"""Image evidence of a cell: copies of the images in which the judge found the erased concept
(and a few where it did not), each beside the base model's image of the same prompt and seed.

Written next to results.json as ``evidence/<image hash>.png`` + ``evidence/index.json``
(prompt, seed, group, kind, judge score per image; ``base_file``: the base model's image of
the same prompt and seed, where the cell's model was erased), so leaderboards and W&B show
the images from the result folder alone, without the cache.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from PIL import Image

from emma.files import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from emma.api.types import Sample

EVIDENCE_DIR = "evidence"
log = logging.getLogger(__name__)


def select_evidence(samples: Sequence[Sample], limit: int = 16, context: int = 4) -> list[Sample]:
    """Erasure-probing images the judge flagged (EA and attack samples), highest score
    first, up to ``limit``; plus up to ``context`` unflagged EA images, so a cell whose concept
    never came back still shows what the erased model draws instead."""
    probing = [s for s in samples if s.group in ("ea", "attack")]
    hits = sorted((s for s in probing if s.detected), key=lambda s: -s.score)[:limit]
    misses = sorted((s for s in probing if not s.detected), key=lambda s: -s.score)[:context]
    seen: set[str] = set()
    out = []
    for s in hits + misses:
        if s.image_hash not in seen:
            seen.add(s.image_hash)
            out.append(s)
    return out


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.asarray(image)).save(buf, format="PNG")
    return buf.getvalue()


def _base_images(base: Any, chosen: Sequence[Sample], negative_prompt: str | None) -> list[Any]:
    """The base model's images of ``chosen``'s prompts and seeds (drawn, or read from the image
    cache), as uint8 HWC arrays; ``[]`` when the base model cannot draw here."""
    if base is None or not chosen:
        return []
    from emma.cache import to_uint8

    try:
        drawn = base.generate([s.prompt for s in chosen], [s.seed for s in chosen], negative_prompt=negative_prompt)
    except Exception as err:  # noqa: BLE001 - pairs are a courtesy: the evidence stands without them
        log.warning("evidence: the base model's images of the same prompts were not drawn (%s: %s)",
                    type(err).__name__, err)
        return []
    return list(to_uint8(drawn.images))


def write_evidence(generator: Any, samples: Sequence[Sample], output_dir: str | Path,
                   limit: int | None = 16, base: Any = None, pairs: int = 8) -> dict[str, str]:
    """Copy the selected images out of ``generator``'s image cache.

    Args:
        generator: the erased model's cached generator.
        samples: the cell's judged samples (suite and attack).
        output_dir: the cell folder (``evidence/`` goes there).
        limit: flagged images at most (:func:`select_evidence`); ``None``: every judged image
            drawn from a text prompt.
        base: the base model (``generate(prompts, seeds)``) where it differs from the cell's
            model: the first ``pairs`` images get the base model's image of the same prompt
            and seed beside them (``base_file``).
        pairs: how many images get their base-model twin.

    Returns:
        image hash -> its path relative to ``output_dir`` (``evidence/<hash>.png``). Images
        drawn from prompt embeddings (white-box attacks) have no text key and are skipped.
    """
    folder = Path(output_dir) / EVIDENCE_DIR
    chosen = list({s.image_hash: s for s in samples}.values()) if limit is None else select_evidence(samples, limit)
    index: list[dict[str, Any]] = []
    exported: dict[str, str] = {}
    found = []
    for s in chosen:
        image = generator.cache.get(generator.image_key(s.prompt, s.seed, generator.negative_prompt))
        if image is not None:
            found.append((s, image))
    twins = _base_images(base, [s for s, _ in found[:pairs]], generator.negative_prompt)
    for i, (s, image) in enumerate(found):
        name = f"{s.image_hash[:16]}.png"
        atomic_write_bytes(folder / name, _png(image), fsync=False, what="an evidence image")
        record = {"file": name, "prompt": s.prompt, "seed": s.seed, "group": s.group, "kind": s.kind,
                  "concept": s.concept, "detected": s.detected, "score": s.score}
        if i < len(twins):
            record["base_file"] = f"base-{s.image_hash[:16]}.png"
            atomic_write_bytes(folder / record["base_file"], _png(twins[i]), fsync=False, what="an evidence image")
        index.append(record)
        exported[s.image_hash] = f"{EVIDENCE_DIR}/{name}"
    if index:
        atomic_write_text(folder / "index.json", json.dumps(index, indent=2) + "\n")
    return exported


class EvidenceError(ValueError):
    """An evidence index that cannot be read (not JSON, not a list of records)."""


EVIDENCE_FIELDS = ("file", "prompt", "seed", "group", "kind", "detected", "score")


def read_evidence(cell_dir: str | Path) -> list[dict[str, Any]]:
    """The evidence index of a result folder (empty when the cell wrote none), each record's
    image file present. Raises :class:`EvidenceError` naming the index when it is damaged;
    records whose image file is gone, or that name a path rather than a file of the folder, are
    left out (:func:`missing_evidence` counts them)."""
    path = Path(cell_dir) / EVIDENCE_DIR / "index.json"
    if not path.exists():
        return []
    try:
        items = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise EvidenceError(f"{path}: unreadable evidence index ({type(err).__name__}: {err})") from None
    if not isinstance(items, list) or not all(
            isinstance(e, dict) and all(k in e for k in EVIDENCE_FIELDS) for e in items):
        raise EvidenceError(f"{path}: not a list of evidence records with {', '.join(EVIDENCE_FIELDS)}")
    # a file name only (never a path out of the folder), and the file there
    return [e for e in items
            if str(e["file"]) == Path(str(e["file"])).name and (path.parent / str(e["file"])).is_file()]


def missing_evidence(cell_dir: str | Path) -> int:
    """How many records of the evidence index name an image file that is not there."""
    path = Path(cell_dir) / EVIDENCE_DIR / "index.json"
    try:
        return len(json.loads(path.read_text())) - len(read_evidence(cell_dir))
    except (OSError, ValueError, TypeError):
        return 0
