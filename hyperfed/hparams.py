"""Where a hyperparameter default comes from: the method's paper, or a choice made here.

Every field of a method's hyperparameter dataclass is declared with :func:`paper` or
:func:`chosen`; ``hyperfed list algorithms`` shows the mark and ``tests/test_hparam_sources.py``
fails on an unmarked field. What a field allows is its type annotation: ``Literal[...]`` for a
choice, ``Annotated[int, Ge(1)]`` (or :data:`Count`, :data:`Unit`, ...) for a bound; pydantic
checks them where the config becomes the dataclass, ``hyperfed schema`` shows them. (A bottom-layer module: shared parameter classes below the
algorithms, such as the gossip settings, use it too.)
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import AfterValidator


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


# Declared bounds of a hyperparameter (``Annotated[int, Ge(1)]``): pydantic checks them where
# ``[algorithm]`` becomes the method's dataclass (hyperfed.config), and ``hyperfed schema``
# shows them. Cross-field rules stay in the dataclass's ``__post_init__``.
Count = Annotated[int, Ge(1)]  # sizes, widths, epochs that must happen: >= 1
NonNegInt = Annotated[int, Ge(0)]  # epochs / rounds / layers where 0 means "none"
Positive = Annotated[float, Gt(0)]  # rates, temperatures, clipping norms
NonNeg = Annotated[float, Ge(0)]  # loss weights, margins
Unit = Annotated[float, Ge(0), Le(1)]  # a weight or share in [0, 1]


def _names_a_layer(value: str) -> str:
    if not [p for p in value.split(",") if p.strip()]:
        raise ValueError("names no layer; allowed: 'head', 'norm' or parameter-name prefixes")
    return value


# comma-separated layer names ("head", "norm", parameter-name prefixes): at least one
Layers = Annotated[str, AfterValidator(_names_a_layer)]

_BOUND_WORDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


@dataclasses.dataclass(frozen=True)
class FieldRule:
    """What a hyperparameter's annotation allows beyond its plain type."""

    choices: tuple[Any, ...] = ()  # a Literal's values (None left out)
    bounds: dict[str, Any] = dataclasses.field(default_factory=dict)  # ge / gt / le / lt
    integer: bool = False
    optional: bool = False  # None (unset) allowed

    def describe(self) -> str:
        """``one of mean, sum`` / ``a whole number >= 1`` / ``a number > 0 and <= 1``."""
        low, high = self.bounds.get("ge"), self.bounds.get("le")
        if self.choices:
            text = "one of " + ", ".join(str(c) for c in self.choices)
        elif self.integer and low is not None and high is not None and len(self.bounds) == 2:
            text = f"a whole number from {low} to {high}"
        else:
            kind = "a whole number" if self.integer else "a number"
            text = (
                kind
                + " "
                + " and ".join(
                    f"{word} {self.bounds[key]}" for key, word in _BOUND_WORDS if key in self.bounds
                )
            )
        return text + (", or unset" if self.optional else "")


def field_rules(cls: type) -> dict[str, FieldRule]:
    """The fields of hyperparameter dataclass ``cls`` that declare choices or bounds."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = {}
    for f in dataclasses.fields(cls):
        rule = _rule(hints[f.name])
        if rule is not None:
            out[f.name] = rule
    return out


def _rule(annotation: Any) -> FieldRule | None:
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(rest) < len(typing.get_args(annotation))
        if len(rest) != 1:
            return None
        annotation = rest[0]
    meta: tuple[Any, ...] = ()
    if typing.get_origin(annotation) is Annotated:
        annotation, *extra = typing.get_args(annotation)
        meta = tuple(extra)
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        choices = tuple(v for v in values if v is not None)
        return FieldRule(choices=choices, optional=optional or len(choices) < len(values))
    bounds = {key: getattr(m, key) for m in meta for key, _ in _BOUND_WORDS if hasattr(m, key)}
    if not bounds:
        return None
    return FieldRule(bounds=bounds, integer=annotation is int, optional=optional)
