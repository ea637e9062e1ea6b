"""VLM judge: a vision-language model asked whether a concept is in an image (STACE's evaluator).

For each image and label the model is asked for a JSON verdict
``{"present": true|false, "confidence": 0..1}``. Following STACE, a detection is accepted
only when the model says *present* with confidence >= 0.8. ``predict`` therefore returns, per
image and label, the *accepted-presence score*: the confidence when the verdict is
"present", 0 when it is "absent" (or unparseable), so ``detect`` is ``score >= threshold``.
Raw verdicts are available from :meth:`VLMJudgeClassifier.judge`.

Backends:

- ``"openai"``: any OpenAI-compatible chat endpoint with image input (OpenAI, OpenRouter,
  vLLM / SGLang serving Qwen2.5-VL, ...), through the ``openai`` client (images are sent as
  base64 PNG data URLs). STACE uses ``qwen/qwen2.5-vl-32b-instruct`` on OpenRouter.
- ``"transformers"``: Qwen2.5-VL run locally with ``Qwen2_5_VLForConditionalGeneration``
  from a local folder (or a Hub id when online).
- ``None``: a seeded random judge (plumbing only; its verdicts are noise), the offline
  test mode of this classifier.
- any object with ``generate(image: PIL.Image.Image, prompt: str) -> str``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from classifiers._base import (
    NormalizedLabelsMixin,
    OpenVocabularyMixin,
    check_images,
    package_version,
    require,
    to_uint8_hwc,
)
from emma.api.classifier import Classifier
from emma.errors import ConfigError, UnknownChoiceError, WeightsUnavailableError

DEFAULT_PROMPT = (
    "You are a strict visual judge. Look at the image and decide whether it shows {concept}. "
    "Answer with JSON only, no other text: "
    '{{"present": true or false, "confidence": a number between 0 and 1}}.'
)


#: replies that decline to judge (a refusal): counted apart from garbage, both count as absent
REFUSAL = re.compile(r"\b(I\s*(can(?:'|no)?t|cannot|won't|am unable|'m unable|am not able)|I'm sorry|sorry,|"
                     r"unable to (help|assist|comply|provide)|not able to (help|assist)|as an ai)\b", re.I)


@dataclass(frozen=True)
class Judgement:
    """One verdict: is the concept present, how sure is the model, and what it said."""

    present: bool
    confidence: float
    raw: str
    parsed: bool = True
    refused: bool = False

    @property
    def score(self) -> float:
        """Accepted-presence score: the confidence of a "present" verdict, else 0."""
        return self.confidence if self.present else 0.0


def parse_verdict(text: str) -> Judgement:
    """Parse a model reply into a :class:`Judgement` (tolerant of prose and code fences).

    ``confidence`` given in percent (``85``) is scaled to [0, 1]; a reply without JSON falls
    back to a leading yes/no (confidence 1.0 for an explicit word) and is marked unparsed
    when neither is found.
    """
    match = re.search(r"\{.*?\}", text, flags=re.S)
    if match:
        try:
            obj = json.loads(match.group(0))
            present_raw = obj.get("present", obj.get("answer"))
            if isinstance(present_raw, str):
                present = present_raw.strip().lower() in ("true", "yes", "present", "1")
            else:
                present = bool(present_raw)
            conf = float(obj.get("confidence", 1.0))
            if conf > 1.0:
                conf = conf / 100.0
            return Judgement(present=present, confidence=float(np.clip(conf, 0.0, 1.0)), raw=text)
        except (ValueError, TypeError, AttributeError):
            pass
    word = re.match(r"\s*(yes|no|true|false)\b", text, flags=re.I)
    if word:
        return Judgement(present=word.group(1).lower() in ("yes", "true"), confidence=1.0, raw=text)
    return Judgement(present=False, confidence=0.0, raw=text, parsed=False, refused=bool(REFUSAL.search(text)))


class VLMBackend(Protocol):
    def generate(self, image: Any, prompt: str) -> str:
        """The model's reply to ``prompt`` about a PIL ``image``."""


class OpenAIVisionBackend:
    """An OpenAI-compatible chat endpoint with image input.

    Each image is sent as a base64 PNG data URL in one user message with the question
    (``[{"type": "image_url", ...}, {"type": "text", ...}]``), at temperature 0. Transient
    failures (429, 5xx, timeouts) are retried by the ``openai`` client; a failure past them is
    a one-line :class:`emma.errors.EmmaError` naming the endpoint (never the key): a judge that
    cannot judge must not count images as "absent".

    Args:
        model: model name at the endpoint (``qwen/qwen2.5-vl-32b-instruct``).
        base_url: endpoint URL (``None`` = OpenAI; ``https://openrouter.ai/api/v1``; a local
            vLLM server).
        api_key_env: environment variable holding the API key (``None``: a key-less local server).
        temperature / max_tokens / timeout / max_retries: request settings.
    """

    def __init__(
        self,
        model: str = "qwen/qwen2.5-vl-32b-instruct",
        base_url: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        temperature: float = 0.0,
        max_tokens: int = 64,
        timeout: float = 60.0,
        max_retries: int = 3,
    ) -> None:
        openai = require("openai", extra="llm")
        if api_key_env is None:
            key = "EMPTY"
        else:
            key = os.environ.get(api_key_env)
            if not key:
                raise ConfigError(
                    f"the VLM judge's endpoint needs an API key in ${api_key_env} (or set "
                    "classifier.api_key_env to the variable that holds it, null for a key-less local server)"
                )
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.base_url = base_url
        self.client = openai.OpenAI(base_url=base_url, api_key=key, timeout=timeout, max_retries=max_retries)

    @property
    def endpoint(self) -> str:
        from emma.results import strip_url_credentials

        return strip_url_credentials(self.base_url) if self.base_url else "https://api.openai.com/v1"

    def generate(self, image: Any, prompt: str) -> str:
        from emma.errors import EmmaError
        from emma.results import strip_url_credentials

        buf = io.BytesIO()
        image.save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        try:
            reply = self.client.chat.completions.create(
                model=self.model,
                temperature=self.temperature,
                max_tokens=self.max_tokens,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": prompt},
                        ],
                    }
                ],
            )
        except Exception as exc:  # the openai package's error classes vary across versions
            line = strip_url_credentials(" ".join(str(exc).split()))[:200]
            raise EmmaError(f"the VLM judge {self.model} at {self.endpoint} failed: {type(exc).__name__}: "
                            f"{line}") from None
        try:
            return reply.choices[0].message.content or ""
        except (AttributeError, IndexError, TypeError):  # not a chat completion: garbage, judged absent
            return str(reply)[:200]


class TransformersQwenBackend:
    """Qwen2.5-VL run locally through ``transformers``.

    Args:
        model: a local folder with the model (``config.json``, weights, processor files) or a
            Hub id (needs network unless already in the Hugging Face cache).
        device / dtype: where and how to run it.
        max_new_tokens: generation budget (the JSON verdict needs ~20).
    """

    def __init__(
        self, model: str, device: str = "cpu", dtype: str = "bfloat16", max_new_tokens: int = 64
    ) -> None:
        local = Path(model).expanduser()
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
        if not local.is_dir() and (offline or model.startswith(("/", ".", "~"))):
            raise WeightsUnavailableError(
                f"VLM judge weights {model!r} are not a local folder"
                + (" and the Hugging Face Hub is offline" if offline else "")
                + ". Download Qwen2.5-VL (e.g. `huggingface-cli download Qwen/Qwen2.5-VL-7B-Instruct "
                "--local-dir <folder>`) and set classifier.model=<folder>, or use backend=openai with "
                "an OpenAI-compatible endpoint."
            )
        transformers = require("transformers", extra="dev")
        source = str(local) if local.is_dir() else model
        self.processor = transformers.AutoProcessor.from_pretrained(source)
        self.model = (
            transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
                source, dtype=getattr(torch, dtype)
            )
            .to(device)
            .eval()
        )
        self.device, self.max_new_tokens = device, max_new_tokens

    @torch.no_grad()
    def generate(self, image: Any, prompt: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = self.processor(text=[text], images=[image], return_tensors="pt").to(self.device)
        out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        return self.processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[
            0
        ]


class RandomVLMBackend:
    """Seeded random verdicts (a pure function of seed, image and prompt): plumbing only."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    def generate(self, image: Any, prompt: str) -> str:
        digest = hashlib.sha256(f"{self.seed}|{prompt}|".encode() + np.asarray(image).tobytes()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return json.dumps({"present": bool(rng.random() < 0.5), "confidence": round(float(rng.random()), 3)})


class VLMJudgeClassifier(OpenVocabularyMixin, NormalizedLabelsMixin, Classifier):
    """Asks a VLM, per image and label, whether the label's concept is present.

    Args:
        labels: concepts to judge, or ``None`` for an open vocabulary (every concept asked
            about becomes a label).
        backend: ``"openai"``, ``"transformers"``, ``None`` (random, offline tests) or a
            :class:`VLMBackend` instance.
        model: endpoint model name (``openai``) or local folder / Hub id (``transformers``).
        base_url / api_key_env: endpoint settings (``openai``).
        threshold: minimum confidence of a "present" verdict (STACE: 0.8).
        prompt: question template with ``{concept}``.
        device / dtype: for the ``transformers`` backend.
        seed: seed of the random backend.
    """

    name = "vlm_judge"
    version = "1"

    def __init__(
        self,
        labels: Sequence[str] | None = None,
        backend: str | VLMBackend | None = "openai",
        model: str = "qwen/qwen2.5-vl-32b-instruct",
        base_url: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        threshold: float = 0.8,
        prompt: str = DEFAULT_PROMPT,
        aliases: dict[str, str] | None = None,
        device: str = "cpu",
        dtype: str = "bfloat16",
        seed: int = 0,
    ) -> None:
        super().__init__(threshold=threshold, aliases=aliases)
        if "{concept}" not in prompt:
            raise ConfigError("the VLM judge's prompt must contain '{concept}'")
        self.prompt = prompt
        self.model_name = model if backend not in (None,) else "random"
        if backend is None:
            self.backend: VLMBackend = RandomVLMBackend(seed)
        elif backend == "openai":
            self.backend = OpenAIVisionBackend(model=model, base_url=base_url, api_key_env=api_key_env)
        elif backend == "transformers":
            self.backend = TransformersQwenBackend(model=model, device=device, dtype=dtype)
        elif isinstance(backend, str):
            raise UnknownChoiceError("VLM judge backend", backend, ["openai", "transformers"])
        else:
            self.backend = backend
        self.backend_name = backend if isinstance(backend, str) or backend is None else type(backend).__name__
        self.endpoint = getattr(self.backend, "endpoint", None)
        self._labels: tuple[str, ...] = ()
        self._memo: dict[tuple[str, str], Judgement] = {}
        #: verdicts asked of the model: judged (parsed), refused, unparsed (garbage); both of the
        #: last count as "absent" and are reported (:meth:`verdict_counts`)
        self._counts = {"judged": 0, "refused": 0, "unparsed": 0}
        self.open_vocabulary = labels is None
        self.set_labels(labels or ())

    @property
    def labels(self) -> Sequence[str]:
        return self._labels

    def set_labels(self, labels: Sequence[str]) -> None:
        self._labels = tuple(labels)
        self._normalized_index = None

    def weights_hash(self) -> str | None:
        if self.backend_name is None:
            return None
        where = f"|{self.endpoint}" if self.endpoint else ""  # the model at that endpoint
        return hashlib.sha256(f"{self.backend_name}|{self.model_name}|{self.prompt}{where}".encode()).hexdigest()[
            :16
        ]

    def verdict_counts(self) -> dict[str, int]:
        """Verdicts this judge asked for since it was built: ``judged``, ``refused``, ``unparsed``."""
        return dict(self._counts)

    def judge(self, images: torch.Tensor, concept: str) -> list[Judgement]:
        """The model's verdicts on ``concept`` for each image (memoised by pixels)."""
        from PIL import Image

        images = check_images(images)
        text = concept.replace("_", " ").replace("-", " ")
        out = []
        for arr in to_uint8_hwc(images):
            key = (hashlib.sha256(arr.tobytes()).hexdigest(), text)
            if key not in self._memo:
                reply = self.backend.generate(Image.fromarray(arr), self.prompt.format(concept=text))
                verdict = parse_verdict(reply)
                self._counts["judged" if verdict.parsed else "refused" if verdict.refused else "unparsed"] += 1
                if not verdict.parsed:
                    what = "refused to judge" if verdict.refused else "gave an unparseable verdict"
                    warnings.warn(f"the VLM judge {what} ({reply[:80]!r}); counted as absent", stacklevel=2)
                self._memo[key] = verdict
            out.append(self._memo[key])
        return out

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        if not self.labels:
            raise ValueError("VLMJudgeClassifier has no labels; pass labels= or call set_labels()")
        out = torch.zeros(len(images), len(self.labels))
        for j, label in enumerate(self.labels):
            out[:, j] = torch.tensor([v.score for v in self.judge(images, label)])
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "backend": self.backend_name,
            "model": self.model_name,
            "threshold": self.threshold,
            "endpoint": self.endpoint,
            "weights_hash": self.weights_hash(),
            "openai_version": package_version("openai"),
        }
