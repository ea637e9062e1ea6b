"""A CLIP BPE tokenizer built from the vocabulary that open_clip ships.

open_clip carries ``bpe_simple_vocab_16e6.txt.gz`` (the same BPE merges as OpenAI CLIP and
``openai/clip-vit-large-patch14``), but no HuggingFace ``vocab.json``/``merges.txt``. This
module rebuilds those two files with the vocabulary order of OpenAI CLIP, maps the start and
end tokens to ``<|startoftext|>``/``<|endoftext|>``, and returns a
``transformers.CLIPTokenizer`` with ``model_max_length=77`` — the tokenizer SD v1.x uses.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 77


def _bytes_to_unicode() -> dict[int, str]:
    # The reversible byte -> printable-unicode table of GPT-2 / CLIP BPE.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def _open_clip_bpe_path() -> Path:
    try:
        import open_clip
    except ImportError as err:  # pragma: no cover - open-clip-torch is a core dependency
        raise ImportError(
            "The local CLIP tokenizer needs open-clip-torch (it ships the BPE vocabulary): "
            "pip install open-clip-torch"
        ) from err
    path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    if not path.exists():
        raise FileNotFoundError(f"open_clip does not ship {path.name} at {path.parent}")
    return path


def write_clip_tokenizer_files(out_dir: str | os.PathLike) -> Path:
    """Write ``vocab.json``, ``merges.txt`` and tokenizer configs into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(_open_clip_bpe_path(), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m.split()) for m in merges]
    vocab += [BOS_TOKEN, EOS_TOKEN]
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
        "do_lower_case": True,
        "tokenizer_class": "CLIPTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return out


@lru_cache(maxsize=1)
def _tokenizer_dir() -> str:
    d = Path(tempfile.gettempdir()) / f"emma-clip-tokenizer-{os.getuid() if hasattr(os, 'getuid') else 0}"
    if not (d / "merges.txt").exists():
        tmp = Path(tempfile.mkdtemp(prefix="emma-tok-"))
        write_clip_tokenizer_files(tmp)
        try:
            os.replace(tmp, d)
        except OSError:  # another process won the race; its copy is identical
            pass
    return str(d)


def local_clip_tokenizer():
    """A ``CLIPTokenizer`` equal to SD v1.x's, built offline from open_clip's vocabulary."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(_tokenizer_dir())
