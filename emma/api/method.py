"""The ErasureMethod role: edit a pipeline's components so a concept can no longer be drawn."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

if TYPE_CHECKING:
    from emma.api.domain import Domain
    from emma.api.guidance import InferenceGuidance

#: In a method's settings, the concepts of the erased concept's domain that are not erased
#: (anchors, preserved concepts): one preset serves every concept of a domain.
OTHERS = "<others>"

class ErasureMethod(abc.ABC):
    """Edits UNet / text-encoder weights of a diffusers pipeline (or, for inference-time
    methods, returns an :meth:`inference_guidance`); never subclasses or monkey-patches the
    pipeline itself.

    Subclasses set ``name`` and ``version`` (bump on any change that moves numbers), take
    their hyper-parameters as constructor keyword arguments (these are hashed into the
    erased-model cache key through :meth:`config`), and implement :meth:`erase`.
    ``edited_components`` lists the pipeline components that :meth:`erase` changes; only
    those are saved to the erased-model cache.
    """

    name: ClassVar[str] = "method"
    version: ClassVar[str] = "0"
    edited_components: ClassVar[tuple[str, ...]] = ("unet",)

    def __init__(self, **hparams: Any) -> None:
        self.hparams = dict(hparams)

    def config(self) -> dict[str, Any]:
        """Everything that determines the erased weights (besides base model and concepts)."""
        return {"name": self.name, "version": self.version, **self.hparams}

    @abc.abstractmethod
    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Erase ``concepts`` from ``pipe`` in place and return it.

        Args:
            pipe: a diffusers pipeline (its ``unet`` / ``text_encoder`` are edited).
            concepts: concept names as the domain spells them.
            seed: seed of every random draw the method makes.
            domain: the concept domain the concepts belong to, or ``None``. Methods key their
                per-domain hyper-parameters (guide/anchor concepts, templates) by its
                ``name`` and expand ``"<others>"`` from its ``concepts``; they read no
                config file.
        """

    def save_state(self, folder: Path) -> None:
        """Write what :meth:`inference_guidance` needs besides the edited components (SPM's
        membranes for its per-prompt scaling) into ``folder``; the erase cache stores it with
        the entry (hashed like the weights) and hands it back to :meth:`load_state` when the
        entry is reused. The default writes nothing."""
        return None

    def load_state(self, folder: Path) -> None:
        """Read what :meth:`save_state` wrote (called when a cached erasure is reused)."""
        return None

    def inference_guidance(self, pipe: Any, concepts: Sequence[str], *,
                           domain: Domain | None = None) -> InferenceGuidance | None:
        """The sampling procedure images of the erased model must be drawn with, or ``None``
        (the pipeline's own). Methods that erase at inference time (SLD) return one; the
        generation stage honours it (see :mod:`emma.api.guidance`). ``domain`` as for
        :meth:`erase`.
        """
        return None


class NoErasure(ErasureMethod):
    """The identity: the base model, for baselines."""

    name = "none"
    version = "1"
    edited_components = ()

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        return pipe
