"""Image evidence of a cell: copies of the images in which the erased concept came back.

Written next to results.json as ``evidence/<image hash>.png`` + ``evidence/index.json``
(prompt, seed, group, kind, judge score per image), so leaderboards and W&B show the images
from the result folder alone, without the cache.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from PIL import Image

from emma.files import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from emma.api.types import Sample

EVIDENCE_DIR = "evidence"


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


def write_evidence(generator: Any, samples: Sequence[Sample], output_dir: str | Path,
                   limit: int = 16) -> int:
    """Copy the selected images out of ``generator``'s image cache; returns how many.

    Images drawn from prompt embeddings (white-box attacks) have no text key and are skipped.
    """
    folder = Path(output_dir) / EVIDENCE_DIR
    index: list[dict[str, Any]] = []
    for s in select_evidence(samples, limit):
        key = generator.image_key(s.prompt, s.seed, generator.negative_prompt)
        image = generator.cache.get(key)
        if image is None:
            continue
        name = f"{s.image_hash[:16]}.png"
        buf = io.BytesIO()
        Image.fromarray(np.asarray(image)).save(buf, format="PNG")
        atomic_write_bytes(folder / name, buf.getvalue(), fsync=False, what="an evidence image")
        index.append({"file": name, "prompt": s.prompt, "seed": s.seed, "group": s.group, "kind": s.kind,
                      "concept": s.concept, "detected": s.detected, "score": s.score})
    if index:
        atomic_write_text(folder / "index.json", json.dumps(index, indent=2) + "\n")
    return len(index)


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
