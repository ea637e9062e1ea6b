"""Image seeds: every image a cell draws gets its own seed, derived from (cell seed, the
identity of its prompt, the image's index, the stream it belongs to).

The derivation (version :data:`VERSION`)::

    digest = sha256(json.dumps(["emma.seeds", VERSION, stream, cell_seed, identity, index, attempt]))
    value  = int.from_bytes(digest[:4], "big") & 0x7FFFFFFF      # 31 bits
    seed   = value                 for the evaluation stream      # [0, 2**31)
           = value | 0x80000000    for the search stream          # [2**31, 2**32)

``json.dumps`` with its default separators, UTF-8; ``attempt`` is 0 unless an earlier image
of the same prompt and stream already drew that value (then 1, 2, ... until it is new), so
the images of one prompt never share a seed and image ``i``'s seed does not depend on how
many images follow it.

Why this shape:

- **No overlap between cells.** Seeds hash the cell seed, so cells with seeds 43 and 44 draw
  unrelated images (the former ``seed + i`` scheme shared all but one image per prompt).
  Two cells share an image only when a 31-bit hash collides for the same prompt
  (probability about n**2 / 2**32 for n images per prompt).
- **The generator's real range.** torch's CPU generator (Mersenne Twister) keeps a seed's
  low 32 bits, so every derived seed is below 2**32 and none wraps onto another.
- **Search and evaluation never meet.** An attack's search draws from the search stream,
  its final images from the evaluation stream: the top bit tells them apart, so the two
  sets are disjoint by construction, not by chance (:func:`stream_of`).
- **Paired images.** The identity is the prompt's text by default; an attacked request's
  adversarial prompt keeps its original prompt's identity (image ``i`` of the attack and of
  the static suite share a seed), and a bias set's groups share the identity of their prompt
  index (image ``i`` of "a person" and of "a woman" share a seed, EMMA's paired reading).
"""

from __future__ import annotations

import hashlib
import json

#: Bumped whenever the derivation changes (every image then changes); recorded in results.json.
VERSION = "1"
EVALUATION = "evaluation"
SEARCH = "search"
STREAMS: tuple[str, ...] = (EVALUATION, SEARCH)
#: torch's CPU generator keeps a seed's low 32 bits: derived seeds stay below this.
GENERATOR_SEED_LIMIT = 2**32
_LOW31 = 0x7FFFFFFF
_TOP = 0x80000000
#: A cell seed is hashed, never added to: any value in this range derives distinct seeds. It
#: also seeds erasure and the bootstrap directly (torch / NumPy generators), so it stays in the
#: generator's range too, with room for the offsets erasure methods add to it.
MAX_CELL_SEED = 2**31 - 1


def _value(stream: str, cell_seed: int, identity: str, index: int, attempt: int) -> int:
    text = json.dumps(["emma.seeds", VERSION, stream, int(cell_seed), str(identity), int(index), int(attempt)])
    v = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big") & _LOW31
    return v | _TOP if stream == SEARCH else v


def _check_stream(stream: str) -> None:
    if stream not in STREAMS:
        raise ValueError(f"seed stream {stream!r}: valid streams are {', '.join(STREAMS)}")


def image_seeds(cell_seed: int, identity: str, n: int, stream: str = EVALUATION) -> list[int]:
    """The seeds of images ``0 .. n-1`` of prompt ``identity`` in a cell with ``cell_seed``:
    distinct, below 2**32, in the stream's half of the range."""
    _check_stream(stream)
    out: list[int] = []
    used: set[int] = set()
    for i in range(int(n)):
        attempt = 0
        while (s := _value(stream, cell_seed, identity, i, attempt)) in used:
            attempt += 1
        used.add(s)
        out.append(s)
    return out


def image_seed(cell_seed: int, identity: str, index: int, stream: str = EVALUATION) -> int:
    """The seed of image ``index`` of prompt ``identity`` (:func:`image_seeds`' ``index``-th)."""
    return image_seeds(cell_seed, identity, int(index) + 1, stream)[-1]


def stream_of(seed: int) -> str:
    """The stream a derived seed belongs to (its top bit)."""
    return SEARCH if int(seed) & _TOP else EVALUATION
