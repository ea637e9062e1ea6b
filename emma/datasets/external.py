"""External prompt sets with pinned downloads: I2P, COCO-30k, UnlearnDiffAtk's attack sets.

Each set is one CSV at a fixed commit of its origin repository (see
``../shared/data/PROVENANCE.md`` in the development checkout), checked by sha256::

    i2p = load_prompt_set("i2p")                      # 4,703 prompts, 7 categories
    nudity = load_prompt_set("unlearndiffatk/nudity")  # 142 prompts
    requests = nudity.requests(concept="sexual", kind="unlearndiffatk")
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from emma.api.types import PromptRequest
from emma.datasets.download import RemoteFile, fetch
from emma.errors import UnknownChoiceError
from emma.files import sha256_file

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

ESD_REPO, ESD_COMMIT = "rohitgandikota/erasing", "25613d27892326e0c7770f7f3555bea4be150089"
MU_ATTACK_REPO = "OPTML-Group/Diffusion-MU-Attack"
MU_ATTACK_COMMIT = "5a3e5d37fb8787113e5d479204ab593a60e303e0"
UCE_REPO, UCE_COMMIT = "rohitgandikota/unified-concept-editing", "28c81ed5a3e41277c1a0dc55f738e7ab188e9718"

#: The I2P categories (Schramowski et al., 2023), as spelt in the CSV.
I2P_CATEGORIES: tuple[str, ...] = (
    "sexual", "shocking", "self-harm", "violence", "illegal activity", "harassment", "hate",
)


@dataclasses.dataclass(frozen=True)
class SetSpec:
    """One pinned external prompt set.

    Args:
        remote: the pinned CSV.
        concept: the concept the set probes (``""`` for general prompts such as COCO).
        n_rows: rows the pinned file has (checked on load).
        group: :class:`~emma.api.types.PromptRequest` group its requests belong to.
    """

    remote: RemoteFile
    concept: str
    n_rows: int
    group: str = "attack"


def _mu(name: str, sha: str, concept: str, n: int) -> SetSpec:
    return SetSpec(RemoteFile(MU_ATTACK_REPO, MU_ATTACK_COMMIT, f"prompts/{name}.csv", sha,
                              f"UnlearnDiffAtk prompt set {name}"), concept, n)


#: Every external prompt set, by name.
PROMPT_SETS: dict[str, SetSpec] = {
    "i2p": SetSpec(RemoteFile(
        ESD_REPO, ESD_COMMIT, "data/unsafe-prompts4703.csv",
        "6c1821aeeb20beb276b4e20ce4c4b801f9106dc935bafc9f6fd5e12aa2651e6f",
        "I2P inappropriate prompts (4,703)"), "", 4703),
    "coco_30k": SetSpec(RemoteFile(
        ESD_REPO, ESD_COMMIT, "data/coco_30k.csv",
        "42c57b188c8f1f8a77cddfa11cde89e83fcbdd4dcd4fc6c840fb4e046d395383",
        "COCO-30k captions"), "", 30000, group="fid"),
    "unlearndiffatk/nudity": _mu(
        "nudity", "0a40f6e63bca976513d1d56df71480239ba1eb5c7a9de4df2f535d80f6e0eccd", "nudity", 142),
    "unlearndiffatk/violence": _mu(
        "violence", "548c603038d559e71d9b0ecce8aa5867e41869ef948a227fb4be29d4c2bb1b13", "violence", 756),
    "unlearndiffatk/illegal": _mu(
        "illegal", "2de0690881b50d072f634c77159152ea4fb2d4adbfed1d717f2232c5c68f1100",
        "illegal activity", 727),
    "unlearndiffatk/vangogh": _mu(
        "vangogh", "9d0b141b6674b5ef93be5a38c4d220ec56ca1ec096cdfdb5baf0932deca72362",
        "Vincent van Gogh", 50),
    "unlearndiffatk/church": _mu(
        "church", "4987e201148cfa3bd3dabfb67e5681ca09e64155cdadf03b0a0c295269d2c18c", "church", 50),
    "unlearndiffatk/tench": _mu(
        "tench", "6d5fc0988e40e7ef97e035031badf52e6a0e971b96be4bf277c2eee3c55f546d", "tench", 50),
    "unlearndiffatk/parachute": _mu(
        "parachute", "f44fdef671aecf3f759ef53101e23b5cd614e3da6e2021c3c3d0a1c35a5fe0e5", "parachute", 50),
    "unlearndiffatk/garbage_truck": _mu(
        "garbage_truck", "e561240be67ea653bac8dd22bc31d44ae6ccb88268b2e306448eea39feefa6cd",
        "garbage truck", 50),
    "uce/gender_bias": SetSpec(RemoteFile(
        UCE_REPO, UCE_COMMIT, "data/gender_bias.csv",
        "817d659fa50481c76c8fcacc4198634f333dd6633a4528162ed979852c7c399a",
        "UCE gender-bias profession prompts"), "", 225, group="bias"),
    "uce/profession10": SetSpec(RemoteFile(
        UCE_REPO, UCE_COMMIT, "data/profession10_prompts.csv",
        "4b523cecf2b0053d08423bd63fe3a9d26e2d5e331f0f58965ac77012fdebcd1c",
        "UCE profession prompts (10)"), "", 10, group="bias"),
    "uce/biases_compare": SetSpec(RemoteFile(
        UCE_REPO, UCE_COMMIT, "data/biases_compare.csv",
        "6758d85ccd6f7aefa473bcc360850377b5d54d4e07780138bd9a6601a6aa2a9d",
        "UCE per-profession bias comparison table"), "", 37, group="bias"),
}


@dataclasses.dataclass(frozen=True)
class ExternalPrompt:
    """One row of an external prompt set.

    Args:
        prompt: the text prompt (I2P has one empty prompt; it is kept as ``""``).
        seed: the set's evaluation seed, if it has one.
        guidance_scale: the set's evaluation guidance, if it has one.
        case_number: the row's id in the set.
        categories: I2P categories of the prompt (empty for other sets).
        extra: the remaining columns (``nudity_percentage``, ``image_id``, ``artist``, ...).
    """

    prompt: str
    seed: int | None = None
    guidance_scale: float | None = None
    case_number: int | None = None
    categories: tuple[str, ...] = ()
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PromptSet:
    """A loaded external prompt set.

    Args:
        name: registry name (``"i2p"``, ``"unlearndiffatk/nudity"``, ...).
        concept: the concept the set probes (``""`` if general).
        prompts: the rows, in file order.
        sha256: sha256 of the file read.
        source: the pinned origin.
        notes: anything odd found while loading (empty prompts, checksum differences).
    """

    name: str
    concept: str
    prompts: list[ExternalPrompt]
    sha256: str
    source: RemoteFile
    group: str = "attack"
    notes: list[str] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[ExternalPrompt]:
        return iter(self.prompts)

    def category_counts(self) -> dict[str, int]:
        """Prompts per category (a prompt with several categories counts for each)."""
        return dict(Counter(c for p in self.prompts for c in p.categories))

    def filter(self, category: str) -> PromptSet:
        """The prompts tagged with ``category`` (I2P's taxonomy)."""
        if category not in I2P_CATEGORIES:
            raise UnknownChoiceError("I2P category", category, I2P_CATEGORIES)
        kept = [p for p in self.prompts if category in p.categories]
        return dataclasses.replace(self, name=f"{self.name}[{category}]", concept=category,
                                   prompts=kept)

    def requests(self, *, concept: str | None = None, kind: str | None = None,
                 n_images: int = 1, seed: int = 0) -> list[PromptRequest]:
        """One :class:`~emma.api.types.PromptRequest` per row, keeping the row's seed and
        guidance (``seed`` is used for rows without one)."""
        return [
            PromptRequest(prompt=p.prompt, concept=concept if concept is not None else self.concept,
                          group=self.group, kind=kind or self.name,  # type: ignore[arg-type]
                          seed=p.seed if p.seed is not None else seed, n_images=n_images,
                          guidance_scale=p.guidance_scale)
            for p in self.prompts
        ]


def _int(value: Any) -> int | None:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return None
    return int(float(value))


def _float(value: Any) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return None
    return float(value)


def _rows(df: pd.DataFrame) -> list[ExternalPrompt]:
    out = []
    standard = {"prompt", "evaluation_seed", "evaluation_guidance", "case_number", "categories"}
    for record in df.to_dict("records"):
        prompt = record.get("prompt")
        cats = record.get("categories")
        categories = tuple(c.strip() for c in str(cats).split(",") if c.strip()) if isinstance(
            cats, str) else ()
        extra = {k: v for k, v in record.items()
                 if k not in standard and not str(k).startswith("Unnamed") and not (
                     isinstance(v, float) and math.isnan(v))}
        out.append(ExternalPrompt(
            prompt=prompt if isinstance(prompt, str) else "",
            seed=_int(record.get("evaluation_seed")),
            guidance_scale=_float(record.get("evaluation_guidance")),
            case_number=_int(record.get("case_number")),
            categories=categories, extra=extra,
        ))
    return out


def load_prompt_set(name: str, path: str | os.PathLike | None = None) -> PromptSet:
    """Load an external prompt set by name.

    Args:
        name: a key of :data:`PROMPT_SETS` (``"i2p"``, ``"coco_30k"``,
            ``"unlearndiffatk/nudity"``, ``"uce/gender_bias"``, ...).
        path: a local copy of the file instead of the pinned download; a copy whose sha256
            differs from the pin is loaded with a note (and a logged warning).

    Raises:
        UnknownChoiceError: no such set.
        DataUnavailableError: offline and not cached (names the URL and where to put it).
    """
    if name not in PROMPT_SETS:
        raise UnknownChoiceError("prompt set", name, PROMPT_SETS)
    spec = PROMPT_SETS[name]
    file = Path(path) if path is not None else fetch(spec.remote)
    digest = sha256_file(file)
    notes = []
    if digest != spec.remote.sha256:
        notes.append(f"{file} has sha256 {digest}, not the pinned {spec.remote.sha256} "
                     f"({spec.remote.url})")
        logger.warning("prompt set %s: %s", name, notes[-1])
    # ids such as COCO's "000000203564" must stay strings
    import pandas as pd  # only where a prompt file is read

    df = pd.read_csv(file, dtype={"image_id": str})
    prompts = _rows(df)
    if len(prompts) != spec.n_rows:
        notes.append(f"{len(prompts)} rows, the pinned file has {spec.n_rows}")
    empty = [p.case_number for p in prompts if not p.prompt.strip()] if "prompt" in df else []
    if empty:
        notes.append(f"{len(empty)} empty prompt(s) kept as '' (case_number {empty})")
    return PromptSet(name=name, concept=spec.concept, prompts=prompts, sha256=digest,
                     source=spec.remote, group=spec.group, notes=notes)


def load_i2p(path: str | os.PathLike | None = None, category: str | None = None) -> PromptSet:
    """I2P's 4,703 prompts with categories, evaluation seeds and guidance (optionally one
    category: ``"sexual"``, ``"violence"``, ...)."""
    i2p = load_prompt_set("i2p", path)
    return i2p.filter(category) if category else i2p


def load_coco30k(path: str | os.PathLike | None = None, limit: int | None = None) -> PromptSet:
    """COCO-30k captions with evaluation seeds (general prompts for FID and retention)."""
    coco = load_prompt_set("coco_30k", path)
    if limit is not None:
        coco.prompts = coco.prompts[:limit]
    return coco


def load_unlearndiffatk(name: str, path: str | os.PathLike | None = None) -> PromptSet:
    """One of UnlearnDiffAtk's attack prompt sets (``nudity``, ``vangogh``, ``church``, ...)."""
    sets = [k.split("/", 1)[1] for k in PROMPT_SETS if k.startswith("unlearndiffatk/")]
    if name not in sets:
        raise UnknownChoiceError("UnlearnDiffAtk prompt set", name, sets)
    return load_prompt_set(f"unlearndiffatk/{name}", path)
