"""The tiny world: procedurally rendered scenes and their captions.

A scene is one coloured shape on a textured background. The background texture plays the
role of an art *style*. Captions name the shape directly, through a synonym, or through a
description that never uses the name, which mirrors EMMA's name / variant / short / long
prompt types, so that "erased by name, still reachable by description" can really happen.

Everything is a pure function of a seed: ``render_scene(SceneSpec)`` and
``sample_specs(n, seed)`` are deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

IMAGE_SIZE = 32
# Bumped whenever rendering or captions change (cached references depend on it).
WORLD_VERSION = "1"

SHAPES: tuple[str, ...] = (
    "circle",
    "square",
    "triangle",
    "star",
    "heart",
    "cross",
    "crescent",
    "diamond",
)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (35, 70, 225),
    "yellow": (240, 210, 20),
    "purple": (140, 40, 180),
    "orange": (245, 130, 20),
}
STYLES: tuple[str, ...] = ("plain", "striped", "dotted", "checkered")

# Synonyms (EMMA "variant"): never contain the canonical name.
SHAPE_VARIANTS: dict[str, tuple[str, ...]] = {
    "circle": ("disc", "orb", "round blob", "ring"),
    "square": ("box", "block", "quadrate", "tile"),
    "triangle": ("trigon", "delta", "wedge", "pyramid outline"),
    "star": ("pentagram", "starburst", "twinkle", "five-pointed figure"),
    "heart": ("valentine", "love symbol", "cardioid", "love sign"),
    "cross": ("plus sign", "plus symbol", "crucifix", "plus"),
    "crescent": ("moon sliver", "sickle", "lunula", "waning moon"),
    "diamond": ("rhombus", "lozenge", "rhomb", "kite"),
}
# Short descriptions (EMMA "short"): never contain the name or a synonym.
SHAPE_SHORT: dict[str, tuple[str, ...]] = {
    "circle": (
        "a round shape with no corners",
        "a perfectly round form",
        "a shape with one smooth curved edge",
    ),
    "square": (
        "a shape with four equal sides",
        "a shape with four right angles",
        "a boxy four-sided shape",
    ),
    "triangle": (
        "a shape with three corners",
        "a three-sided shape",
        "a shape with three straight edges",
    ),
    "star": (
        "a shape with five pointed tips",
        "a spiky shape with five points",
        "a shape like a twinkling night light",
    ),
    "heart": (
        "a shape with two rounded lobes and a point",
        "the shape of love",
        "a romantic symbol shape",
    ),
    "cross": (
        "two bars crossing at right angles",
        "a shape made of a vertical and a horizontal bar",
        "an addition symbol shape",
    ),
    "crescent": (
        "a thin curved sliver like a new moon",
        "a curved shape like a banana",
        "a shape like a bitten round",
    ),
    "diamond": (
        "a tilted shape with four pointed tips",
        "a four-sided shape standing on its corner",
        "a four-sided shape with sharp top and bottom points",
    ),
}
# Long descriptions (EMMA "long"): longer, still without name or synonym.
SHAPE_LONG: dict[str, tuple[str, ...]] = {
    "circle": (
        "a smooth round shape with no corners at all, the same width in every direction",
        "a round flat form whose single curved edge is everywhere the same distance from the middle",
    ),
    "square": (
        "a flat shape with four equal straight sides that meet at four right angles",
        "a boxy flat form with four straight edges of the same length and right-angled corners",
    ),
    "triangle": (
        "a flat shape with three straight edges and three corners, wide at the bottom",
        "a pointed flat form made of three straight sides that meet at three corners",
    ),
    "star": (
        "a spiky flat shape with five sharp points radiating out from the middle",
        "a flat figure with five pointed arms spreading evenly around the centre",
    ),
    "heart": (
        "a flat romantic symbol with two rounded lobes on top and a sharp point at the bottom",
        "a flat form with two round bumps at the top that narrow down to a single point",
    ),
    "cross": (
        "a flat shape made of one vertical bar and one horizontal bar crossing in the middle",
        "two thick straight bars of equal length that meet in the middle at right angles",
    ),
    "crescent": (
        "a thin curved sliver like the new moon, thick in the middle and pointed at both ends",
        "a curved flat form like a round with a bite taken out of one side",
    ),
    "diamond": (
        "a flat four-sided shape standing on one corner, with sharp points at top and bottom",
        "a tilted flat form with four equal sides and pointed tips above, below and at the sides",
    ),
}
STYLE_PHRASES: dict[str, tuple[str, ...]] = {
    "plain": ("on a plain background", "in plain style"),
    "striped": ("on a striped background", "in striped style"),
    "dotted": ("on a dotted background", "in dotted style"),
    "checkered": ("on a checkered background", "in checkered style"),
}
STYLE_VARIANTS: dict[str, tuple[str, ...]] = {
    "plain": ("solid", "flat", "uniform"),
    "striped": ("lined", "banded", "streaked"),
    "dotted": ("polka-dot", "spotted", "speckled"),
    "checkered": ("chessboard", "checkerboard", "tiled"),
}
STYLE_SHORT: dict[str, tuple[str, ...]] = {
    "plain": ("with an empty backdrop of a single tone",),
    "striped": ("with parallel bands in the backdrop",),
    "dotted": ("with small spots all over the backdrop",),
    "checkered": ("with alternating light and dark squares in the backdrop",),
}
# Things that have a shape or a pattern (tiny world 2's wider training language): ordinary
# words a person would draw as the shape, or see in the background texture. Captions use them
# only with ``caption(..., objects=p)``. They share no word, and no stem, with the
# generalisation probe (``emma.tinyworld.generalisation``), whose words stay unseen.
SHAPE_OBJECTS: dict[str, tuple[str, ...]] = {
    "circle": ("pearl", "marble", "pancake", "bagel", "frisbee", "drum", "lid", "saucer", "medal",
               "bullseye", "wreath", "halo", "planet", "vinyl", "dial", "lens", "porthole", "manhole",
               "tambourine", "cymbal", "lollipop", "pupil", "hoop", "pie", "tortilla", "roundabout",
               "sphere", "loop"),
    "square": ("cracker", "waffle", "cushion", "pillow", "frame", "screen", "monitor", "postcard",
               "photo", "quilt", "pixel", "checkbox", "toast", "tofu", "parcel", "package", "gift",
               "locker", "drawer", "cabinet", "microwave", "television", "keycap", "canvas", "sticky"),
    "triangle": ("teepee", "spire", "cone", "prism", "gable", "pennant", "fin", "chip", "ramp", "pine",
                 "funnel", "volcano", "peak", "summit", "samosa", "hanger", "triangular", "obelisk"),
    "star": ("nova", "supernova", "starlight", "celebrity", "sirius", "polaris", "comet", "stellar",
             "astral", "superstar", "starry", "glitter", "shine", "twinkling", "christmas", "pentacle",
             "anise", "carambola", "glimmer", "hollywood", "fame", "astronomy", "wish"),
    "heart": ("love", "lover", "beloved", "crush", "adore", "honey", "cardiac", "pulse", "cherish",
              "devotion", "amour", "flirt", "hug", "girlfriend", "boyfriend", "lovely", "fondness",
              "heartbeat", "tender", "caring", "cuddle", "bride", "marriage"),
    "cross": ("ambulance", "nurse", "doctor", "pharmacy", "chapel", "cathedral", "christian",
              "gravestone", "junction", "crosshair", "multiply", "addition", "clinic", "priest",
              "bishop", "steeple", "cemetery", "altar", "jesus", "crossing"),
    "crescent": ("banana", "moonlight", "islam", "mosque", "scythe", "fingernail", "hook", "arc",
                 "smile", "cashew", "muslim", "ottoman", "tusk", "fang", "crook", "curve", "moonrise",
                 "eyebrow", "rind", "nightfall", "turkish"),
    "diamond": ("rhinestone", "topaz", "amethyst", "carat", "argyle", "bling", "treasure", "quartz",
                "opal", "garnet", "tiara", "necklace", "brooch", "luxury", "precious", "wealth", "facet",
                "zircon", "onyx", "pendant", "diamante", "diamonds"),
}
STYLE_OBJECTS: dict[str, tuple[str, ...]] = {
    "plain": ("empty", "void", "monochrome", "vacant", "unadorned", "bland", "matte", "neutral",
              "pure", "basic", "undecorated", "spotless", "clean", "austere", "sparse", "ordinary",
              "vanilla", "pristine", "untextured"),
    "striped": ("lines", "corduroy", "striation", "awning", "ribbed", "streaks", "blinds", "referee",
                "bumblebee", "wasp", "pajamas", "barber", "fence", "grille", "railing", "piano", "skunk",
                "okapi", "tabby"),
    "dotted": ("spots", "pimples", "measles", "chickenpox", "sprinkles", "cheetah", "domino",
               "pointillism", "speckles", "pebbles", "raindrops", "stippled", "acne", "moles",
               "strawberry", "fawn", "jaguar", "sequins", "braille"),
    "checkered": ("checkers", "draughts", "grid", "mosaic", "picnic", "harlequin", "houndstooth",
                  "lattice", "taxi", "gridiron", "madras", "diner"),
}
# Filler words, used in training captions and as EMMA-style prefixes (noun, adjective,
# emotion, verb-ing, preposition).
PREFIXES: dict[str, tuple[str, ...]] = {
    "noun": ("toy", "paper", "sticker", "icon"),
    "adjective": ("small", "big", "bright", "simple"),
    "emotion": ("happy", "calm", "angry", "sad"),
    "verb_ing": ("floating", "spinning", "glowing", "resting"),
    "preposition": ("above", "inside", "near", "under"),
}
TEMPLATES: tuple[str, ...] = ("a {x}", "an image of a {x}", "a picture of a {x}", "{x}")


@dataclasses.dataclass(frozen=True)
class SceneSpec:
    """All that determines one rendered scene."""

    shape: str
    colour: str
    style: str
    cx: float
    cy: float
    radius: float
    bg_seed: int


def sample_specs(n: int, seed: int) -> list[SceneSpec]:
    """Draw ``n`` scene specifications, uniformly over shape, colour and style."""
    rng = np.random.default_rng(seed)
    specs = []
    colours = list(COLOURS)
    for _ in range(n):
        radius = float(rng.uniform(8.0, 12.5))
        margin = radius + 1.0
        specs.append(
            SceneSpec(
                shape=SHAPES[rng.integers(len(SHAPES))],
                colour=colours[rng.integers(len(colours))],
                style=STYLES[rng.integers(len(STYLES))],
                cx=float(rng.uniform(margin, IMAGE_SIZE - margin)),
                cy=float(rng.uniform(margin, IMAGE_SIZE - margin)),
                radius=radius,
                bg_seed=int(rng.integers(2**31)),
            )
        )
    return specs


def _background(style: str, rng: np.random.Generator, size: int) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size]
    light = rng.uniform(200, 240)
    dark = rng.uniform(90, 140)
    if style == "plain":
        mask = np.zeros((size, size), dtype=bool)
        light = rng.uniform(150, 235)
    elif style == "striped":
        period = int(rng.integers(4, 7))
        phase = int(rng.integers(period))
        coord = xx if rng.random() < 0.5 else yy
        mask = ((coord + phase) % period) < period // 2
    elif style == "dotted":
        period = int(rng.integers(5, 7))
        ox, oy = rng.integers(period, size=2)
        dx = (xx + ox) % period - period / 2 + 0.5
        dy = (yy + oy) % period - period / 2 + 0.5
        mask = dx**2 + dy**2 <= 1.6**2
    elif style == "checkered":
        cell = int(rng.integers(3, 5))
        ox, oy = rng.integers(cell, size=2)
        mask = (((xx + ox) // cell + (yy + oy) // cell) % 2) == 0
    else:
        raise ValueError(f"unknown style {style!r}; valid: {', '.join(STYLES)}")
    img = np.where(mask, dark, light).astype(np.float32)
    return np.repeat(img[..., None], 3, axis=2)


def _polygon_mask(xx, yy, pts) -> np.ndarray:
    """Even-odd rule point-in-polygon on pixel centres."""
    inside = np.zeros(xx.shape, dtype=bool)
    n = len(pts)
    for i in range(n):
        x1, y1 = pts[i]
        x2, y2 = pts[(i + 1) % n]
        cond = (y1 > yy) != (y2 > yy)
        with np.errstate(divide="ignore", invalid="ignore"):
            xint = (x2 - x1) * (yy - y1) / (y2 - y1 + 1e-12) + x1
        inside ^= cond & (xx < xint)
    return inside


def shape_mask(shape: str, cx: float, cy: float, r: float, size: int = IMAGE_SIZE) -> np.ndarray:
    """Boolean (size, size) mask of ``shape`` centred at (cx, cy) with radius ``r``."""
    ss = 4  # supersampling for smooth edges
    coords = (np.arange(size * ss) + 0.5) / ss
    xx, yy = np.meshgrid(coords, coords)
    x, y = xx - cx, yy - cy
    if shape == "circle":
        m = x**2 + y**2 <= r**2
    elif shape == "square":
        h = r * 0.8
        m = (np.abs(x) <= h) & (np.abs(y) <= h)
    elif shape == "diamond":
        m = np.abs(x) / (r * 0.8) + np.abs(y) / r <= 1.0
    elif shape == "triangle":
        pts = [(0, -r), (r * 0.95, r * 0.7), (-r * 0.95, r * 0.7)]
        m = _polygon_mask(x, y, pts)
    elif shape == "star":
        pts = []
        for k in range(10):
            ang = -math.pi / 2 + k * math.pi / 5
            rad = r if k % 2 == 0 else r * 0.45
            pts.append((rad * math.cos(ang), rad * math.sin(ang)))
        m = _polygon_mask(x, y, pts)
    elif shape == "cross":
        w = r * 0.33
        m = ((np.abs(x) <= w) & (np.abs(y) <= r)) | ((np.abs(y) <= w) & (np.abs(x) <= r))
    elif shape == "crescent":
        outer = x**2 + y**2 <= r**2
        inner = (x - r * 0.5) ** 2 + (y - r * 0.15) ** 2 <= (r * 0.85) ** 2
        m = outer & ~inner
    elif shape == "heart":
        lobe = r * 0.5
        left = (x + lobe) ** 2 + (y + r * 0.3) ** 2 <= lobe**2
        right = (x - lobe) ** 2 + (y + r * 0.3) ** 2 <= lobe**2
        tri = _polygon_mask(x, y, [(-r, -r * 0.2), (r, -r * 0.2), (0, r)])
        m = left | right | tri
    else:
        raise ValueError(f"unknown shape {shape!r}; valid: {', '.join(SHAPES)}")
    return m.reshape(size, ss, size, ss).mean(axis=(1, 3))


def render_scene(spec: SceneSpec, size: int = IMAGE_SIZE) -> np.ndarray:
    """Render one scene as a uint8 (size, size, 3) array."""
    rng = np.random.default_rng(spec.bg_seed)
    img = _background(spec.style, rng, size)
    alpha = shape_mask(spec.shape, spec.cx, spec.cy, spec.radius, size)[..., None]
    colour = np.asarray(COLOURS[spec.colour], dtype=np.float32)
    img = img * (1 - alpha) + colour * alpha
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def render_batch(specs: Sequence[SceneSpec], size: int = IMAGE_SIZE) -> np.ndarray:
    """Render specs as a float32 (N, 3, H, W) array in [0, 1]."""
    arr = np.stack([render_scene(s, size) for s in specs]).astype(np.float32) / 255.0
    return arr.transpose(0, 3, 1, 2)


def caption(spec: SceneSpec, rng: np.random.Generator, objects: float = 0.0) -> str:
    """A random training caption for ``spec``.

    The shape is referred to by name (50%), synonym (20%), short (15%) or long (15%)
    description; colour, style and a filler prefix word are each present at random. With
    ``objects`` > 0, that fraction of captions names the shape by a thing of its shape
    (``SHAPE_OBJECTS``: "a red bagel"), that fraction of style phrases names the background by a
    thing with its pattern (``STYLE_OBJECTS``: "on a cheetah background"), and a quarter of that
    fraction is a pattern thing alone ("a picture of a corduroy"); ``objects=0`` draws exactly
    the captions of tiny world 1.
    """
    if objects and rng.random() < objects * 0.25:
        return with_template(_pick(rng, TEMPLATES), _pick(rng, STYLE_OBJECTS[spec.style]))
    u = rng.random()
    if objects and rng.random() < objects:
        noun = _pick(rng, SHAPE_OBJECTS[spec.shape])
    elif u < 0.5:
        noun = spec.shape
    elif u < 0.7:
        noun = _pick(rng, SHAPE_VARIANTS[spec.shape])
    elif u < 0.85:
        noun = _pick(rng, SHAPE_SHORT[spec.shape])
    else:
        noun = _pick(rng, SHAPE_LONG[spec.shape])
    descriptive = not (noun == spec.shape or noun in SHAPE_VARIANTS[spec.shape]
                       or noun in SHAPE_OBJECTS[spec.shape])
    words = []
    if rng.random() < 0.25:
        cat = _pick(rng, tuple(PREFIXES))
        words.append(_pick(rng, PREFIXES[cat]))
    if rng.random() < 0.6:
        words.append(spec.colour)
    if descriptive:
        # "a red shape with three corners" reads better than "red a shape ..."
        body = noun[2:] if noun.startswith("a ") else noun
        body = body[4:] if body.startswith("the ") else body
        phrase = " ".join(words + [body])
    else:
        phrase = " ".join(words + [noun])
    s = rng.random()
    if objects and s < 0.6 and rng.random() < objects:
        thing = _pick(rng, STYLE_OBJECTS[spec.style])
        article = "an" if thing[0] in "aeiou" else "a"
        phrase = f"{phrase} {_pick(rng, (f'on {article} {thing} background', f'in {thing} style', f'with {thing}'))}"
    elif s < 0.35:
        phrase = f"{phrase} {_pick(rng, STYLE_PHRASES[spec.style])}"
    elif s < 0.5:
        phrase = f"{phrase}, {_pick(rng, STYLE_VARIANTS[spec.style])} background"
    elif s < 0.6:
        phrase = f"{phrase} {_pick(rng, STYLE_SHORT[spec.style])}"
    return with_template(_pick(rng, TEMPLATES), phrase)


def with_template(template: str, phrase: str) -> str:
    """Fill ``template`` ("a {x}", ...) with ``phrase``, fixing the article."""
    text = template.format(x=phrase)
    if phrase[:1].lower() in "aeiou":
        text = text.replace(f"a {phrase}", f"an {phrase}")
    return text


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]
