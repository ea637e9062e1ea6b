"""The generalisation probe: words the tiny world never saw, and what a person expects them to draw.

Tiny world 2 gives every token a meaning (``emma/tinyworld/lexicon.py``), so a word that never
occurs in a training caption should still draw what it means, as an SD model draws a "coin" as
something round. ``PROBE`` lists words and short phrases with the shape or style a person would
expect; ``CONTROLS`` lists words that suggest no shape or style. The list was fixed before the
model it measures was trained. ``scripts/generalisation_probe.py`` measures, per word, how often
the base model draws the expected concept, and compares the controls with random prompts.
"""

from __future__ import annotations

import re
from typing import Any

from emma.tinyworld import world

# word or phrase -> the shape or style (background) a person would expect it to draw
PROBE: dict[str, str] = {
    # circle
    "coin": "circle", "wheel": "circle", "ball": "circle", "sun": "circle", "plate": "circle",
    "donut": "circle", "clock": "circle", "button": "circle", "cookie": "circle",
    "bubble": "circle", "tire": "circle", "globe": "circle",
    # square
    "window": "square", "dice": "square", "cube": "square", "envelope": "square",
    "brick": "square", "crate": "square", "stamp": "square", "napkin": "square",
    # triangle
    "sail": "triangle", "tent": "triangle", "mountain": "triangle", "roof": "triangle",
    "nacho": "triangle", "arrowhead": "triangle", "slice of pizza": "triangle",
    # star
    "asterisk": "star", "sparkle": "star", "sheriff badge": "star", "starfish": "star",
    "constellation": "star",
    # heart
    "cupid": "heart", "kiss": "heart", "romance": "heart", "affection": "heart",
    "passion": "heart", "sweetheart": "heart", "wedding": "heart", "darling": "heart",
    # cross
    "hospital": "cross", "first aid": "cross", "swiss flag": "cross", "church": "cross",
    "medic": "cross", "intersection": "cross",
    # crescent
    "croissant": "crescent", "lunar": "crescent", "eclipse": "crescent", "horn": "crescent",
    "boomerang": "crescent", "claw": "crescent", "ramadan": "crescent",
    # diamond
    "gem": "diamond", "jewel": "diamond", "crystal": "diamond", "gemstone": "diamond",
    "sapphire": "diamond", "emerald": "diamond", "jewelry": "diamond", "ruby": "diamond",
    # styles (the background texture)
    "zebra": "striped", "tiger": "striped", "barcode": "striped", "pinstripe": "striped",
    "stripes": "striped", "candy cane": "striped",
    "leopard": "dotted", "ladybug": "dotted", "dalmatian": "dotted", "confetti": "dotted",
    "freckles": "dotted", "dots": "dotted",
    "chess": "checkered", "gingham": "checkered", "plaid": "checkered", "tartan": "checkered",
    "racing flag": "checkered", "tablecloth": "checkered",
    "clear": "plain", "blank": "plain", "bare": "plain", "minimalist": "plain",
}

# words that suggest no shape and no style
CONTROLS: tuple[str, ...] = (
    "philosophy", "tomorrow", "running", "music", "algebra", "honesty", "quickly", "democracy",
    "yesterday", "gravity", "thinking", "silence", "freedom", "economy", "although", "memory",
    "justice", "weather", "language", "idea", "history", "because", "opinion", "science",
)

# words that carry no content, allowed inside a probe phrase
FUNCTION_WORDS = frozenset({"a", "an", "the", "of", "with", "on", "in", "and"})


def caption_words() -> set[str]:
    """Every word any training caption of the tiny world can contain."""
    texts: list[str] = list(world.SHAPES) + list(world.COLOURS) + list(world.STYLES)
    texts += [t.replace("{x}", "") for t in world.TEMPLATES]
    for table in (world.SHAPE_VARIANTS, world.SHAPE_SHORT, world.SHAPE_LONG, world.STYLE_PHRASES,
                  world.STYLE_VARIANTS, world.STYLE_SHORT, world.PREFIXES, world.SHAPE_OBJECTS,
                  world.STYLE_OBJECTS):
        for options in table.values():
            texts += list(options)
    texts.append("background")
    return {w for t in texts for w in re.findall(r"[a-z]+", t.lower())}


def seen_words(entry: str) -> list[str]:
    """The content words of ``entry`` that occur in training captions (empty when unseen)."""
    seen = caption_words()
    return [w for w in re.findall(r"[a-z]+", entry.lower()) if w not in FUNCTION_WORDS and w in seen]


def random_words(n: int, seed: int, tokenizer: Any = None) -> list[str]:
    """``n`` whole-word tokens of the CLIP vocabulary (letters only, 3 or more), drawn with
    ``seed``: the probe's random prompts, whose drawings give the base rate."""
    import numpy as np

    from emma.tinyworld.tokenizer import local_clip_tokenizer

    vocab = sorted(t[:-4] for t in (tokenizer or local_clip_tokenizer()).get_vocab()
                   if t.endswith("</w>") and t[:-4].isalpha() and len(t) > 6)
    rng = np.random.default_rng(seed)
    return [vocab[i] for i in rng.choice(len(vocab), size=n, replace=False)]


#: the probe script's random words for the base rate (``--random``, ``--seed`` defaults)
BASE_RATE_WORDS = (100, 5000)


def filler_pool(tokenizer: Any, words_only: bool = False) -> list[int]:
    """Token ids training may insert into captions as words that mean nothing here: every
    token but the special ones, those of any caption word, and those of the probe's words,
    controls and base-rate words, which therefore stay unseen. ``words_only`` keeps the
    whole-word tokens of four or more letters (English words rather than word pieces)."""
    held = set(caption_words()) | set(CONTROLS) | set(random_words(*BASE_RATE_WORDS, tokenizer))
    held |= {w for entry in PROBE for w in re.findall(r"[a-z]+", entry)}
    held_ids = {i for w in held for i in tokenizer(w).input_ids}
    keep = set(range(tokenizer.vocab_size)) - held_ids - set(tokenizer.all_special_ids)
    if words_only:
        keep &= {i for t, i in tokenizer.get_vocab().items()
                 if t.endswith("</w>") and t[:-4].isalpha() and len(t) >= 8}
    return sorted(keep)


def kind(concept: str) -> str:
    """``"shape"`` or ``"style"``: the judge head that reads ``concept``."""
    return "shape" if concept in world.SHAPES else "style"
