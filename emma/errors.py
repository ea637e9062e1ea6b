"""Errors that teach: what was wrong and what is valid."""

from __future__ import annotations

import difflib
from typing import Iterable


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name when the message is empty)."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class EmmaError(Exception):
    """Base class of the harness's user-facing errors (printed without a traceback)."""


class UnknownChoiceError(EmmaError, KeyError):
    """An unknown name for something that has a fixed set of valid names."""

    def __init__(self, what: str, given: str, valid: Iterable[str], where: str = "") -> None:
        self.what, self.given, self.where = what, given, where
        self.valid = sorted(str(v) for v in valid)
        super().__init__(self.__str__())

    def __str__(self) -> str:
        msg = f"unknown {self.what} {self.given!r}{f' in {self.where}' if self.where else ''}."
        close = difflib.get_close_matches(str(self.given), self.valid, n=3, cutoff=0.5)
        if close:
            msg += f" Did you mean {' or '.join(repr(c) for c in close)}?"
        shown = self.valid if len(self.valid) <= 40 else self.valid[:40] + ["..."]
        return msg + f" Available: {', '.join(shown)}"


class WeightsUnavailableError(EmmaError):
    """Model weights that cannot be loaded here (offline, missing, or wrong hash)."""


class ConfigError(EmmaError):
    """A configuration value that cannot work."""


class NonFiniteError(EmmaError):
    """NaN/inf where a number must be finite (weights, images, probabilities): the cell
    stops rather than write a plausible-looking result."""
