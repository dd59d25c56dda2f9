"""Where a hyperparameter default comes from: the method's paper, or a choice made here.

Every field of a method's hyperparameter dataclass is declared with :func:`paper` or
:func:`chosen`; ``hyperfed list algorithms`` shows the mark and ``tests/test_hparam_sources.py``
fails on an unmarked field. (A bottom-layer module: shared parameter classes below the
algorithms, such as the gossip settings, use it too.)
"""

from __future__ import annotations

import dataclasses
from typing import Any


def _marked(default: Any, source: str) -> Any:
    if isinstance(default, list | dict | set):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"source": source}
        )
    return dataclasses.field(default=default, metadata={"source": source})


def paper(default: Any, where: str = "") -> Any:
    """A hyperparameter whose default is the method paper's own (``where``: table/section)."""
    return _marked(default, f"paper {where}".strip())


def chosen(default: Any, why: str = "") -> Any:
    """A hyperparameter whose default was chosen here (the paper gives none, or its value does
    not work in hyperfed's setting); ``why`` says on what evidence."""
    return _marked(default, f"chosen here: {why}" if why else "chosen here")


def hparam_sources(cls: type) -> dict[str, str]:
    """Where each hyperparameter's default comes from ("paper ..." / "chosen here ...";
    "unmarked" for a field declared without :func:`paper` or :func:`chosen`)."""
    return {f.name: f.metadata.get("source", "unmarked") for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class Space:
    """A hyperparameter's search range for ``hyperfed tune`` (declared beside the method's
    hyperparameters, in ``Algorithm.tune``): ``low..high`` (log-uniform with ``log``, integers
    with ``integer``), or one of ``choices`` (a paper's own grid)."""

    low: float = 0.0
    high: float = 0.0
    log: bool = False
    integer: bool = False
    choices: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if not self.choices and not (self.low < self.high):
            raise ValueError(f"Space({self.low}, {self.high}): need low < high, or choices")
        if self.log and not self.choices and self.low <= 0:
            raise ValueError(f"Space({self.low}, {self.high}, log=True): need low > 0")

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is one of the points this space can draw."""
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and value != int(value):
            return False
        return self.low <= value <= self.high

    def describe(self) -> str:
        """``0.001..0.3 (log)`` / ``one of 0.1, 1.0``: the space in an error or note."""
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        return f"{self.low:g}..{self.high:g}" + (" (log)" if self.log else "")
