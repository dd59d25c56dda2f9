"""Method hyperparameters validated by their type annotations (issue 58 item 2): a ``Literal``
field refuses a value outside it, an ``Annotated`` bound refuses a value past it, each with one
line naming the key; ``hyperfed schema`` describes every method's hyperparameters."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

import annotated_types as at
import pytest

from hyperfed.algorithms import registry
from hyperfed.config import (
    MAX_HPARAM_INT,
    AlgorithmConfig,
    ConfigError,
    ExperimentConfig,
    build_hparams,
)


def _unwrap(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    """(the type without None / Annotated, the Annotated metadata)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            annotation = rest[0]
    if typing.get_origin(annotation) is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        return base, tuple(meta)
    return annotation, ()


def _bad_values(annotation: Any) -> list[tuple[Any, str]]:
    """Values the annotation refuses, each with the text its error must show: a string that
    is no choice of a Literal; bound - 1 for Ge, the bound for Gt / Lt, bound + 1 for Le."""
    base, meta = _unwrap(annotation)
    if typing.get_origin(base) is typing.Literal:
        choices = [str(c) for c in typing.get_args(base) if c is not None]
        return [("no-such-choice", "one of " + ", ".join(choices))]
    out = []
    for m in meta:
        if isinstance(m, at.Ge) and base is int:  # integers are capped at MAX_HPARAM_INT
            out.append((m.ge - 1, f"a whole number from {m.ge} to {MAX_HPARAM_INT}"))
        elif isinstance(m, at.Ge):
            out.append((m.ge - 1, f">= {m.ge}"))
        elif isinstance(m, at.Gt):
            out.append((m.gt, f"> {m.gt}"))
        elif isinstance(m, at.Le):
            out.append((m.le + 1, f"<= {m.le}"))
        elif isinstance(m, at.Lt):
            out.append((m.lt, f"< {m.lt}"))
    return out


def _cases() -> list[Any]:
    cases = []
    for name, alg in sorted(registry().items()):
        hints = typing.get_type_hints(alg.hparams, include_extras=True)
        for f in dataclasses.fields(alg.hparams):
            for bad, shown in _bad_values(hints[f.name]):
                cases.append(pytest.param(name, f.name, bad, shown, id=f"{name}.{f.name}={bad}"))
    return cases


CASES = _cases()


def test_the_cases_cover_the_methods():
    # by hand from PFedKTParams: 6 Literal fields (hn_training, hn_optimizer, hn_init,
    # distance, loss, kl_reduction) and 13 bounds (mu and hn_momentum two each; alpha, hn_lr,
    # hn_steps, hn_grad_clip, chunk, emb_dim, hidden, n_hidden, tau one each)
    pfedkt = [c for c in CASES if c.values[0] == "pfedkt"]
    assert len(pfedkt) == 6 + 13, [c.id for c in pfedkt]
    assert len({c.values[0] for c in CASES}) >= 30


@pytest.mark.parametrize(("method", "field", "bad", "shown"), CASES)
def test_a_value_outside_the_annotation_is_one_line_naming_the_key(method, field, bad, shown):
    with pytest.raises(ConfigError) as err:
        build_hparams(AlgorithmConfig(name=method, **{field: bad}))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"algorithm.{field}: allowed: "), msg
    assert shown in msg and msg.endswith(f"(got {bad!r})"), msg


def test_a_value_in_a_method_table_is_named_as_spelled():
    cfg = AlgorithmConfig(name="pfedkt", pfedkt={"kl_reduction": "max"})
    with pytest.raises(ConfigError, match=r"^algorithm\.pfedkt\.kl_reduction: allowed: one of "):
        build_hparams(cfg)
    assert str(pytest.raises(ConfigError, build_hparams, cfg).value) == (
        "algorithm.pfedkt.kl_reduction: allowed: one of mean, sum (got 'max')"
    )


def test_the_bounds_keep_the_values_they_allow():
    # the edges themselves are allowed (Ge(1): 1, Lt(1): just below 1, Le(0.5): 0.5)
    hp = build_hparams(AlgorithmConfig(name="pfedkt", hn_steps=1, mu=0.999, chunk=0))
    assert (hp.hn_steps, hp.mu, hp.chunk) == (1, 0.999, 0)
    assert build_hparams(AlgorithmConfig(name="pfedes", mu=0.5)).mu == 0.5


# fields whose value is free text by design: a zoo model's name (checked where it is built)
MODEL_NAMES = {"distill_model", "shared_model", "embed_model", "global_model"}


def test_every_number_and_text_field_of_a_method_declares_what_it_allows():
    """Removing a field's annotation fails here (the cases above would just lose it). Fields
    of the shared GossipParams / DDParams (outside hyperfed.algorithms) are not yet typed."""
    loose = []
    for name, alg in sorted(registry().items()):
        hints = typing.get_type_hints(alg.hparams, include_extras=True)
        for f in dataclasses.fields(alg.hparams):
            owner = next(
                c for c in alg.hparams.__mro__ if f.name in vars(c).get("__annotations__", {})
            )
            if not owner.__module__.startswith("hyperfed.algorithms"):
                continue
            base, meta = _unwrap(hints[f.name])
            if base in (int, float) and not _bad_values(hints[f.name]):
                loose.append(f"{name}.{f.name}")
            if base is str and not meta and f.name not in MODEL_NAMES:
                loose.append(f"{name}.{f.name}")
    assert not loose


def test_cross_field_rules_stay_one_line():
    with pytest.raises(ConfigError, match=r"^algorithm: head_epochs and body_epochs cannot"):
        build_hparams(AlgorithmConfig(name="fedrep", head_epochs=0, body_epochs=0))
    with pytest.raises(ConfigError, match=r"^algorithm: new_clients and adapt_rounds"):
        build_hparams(AlgorithmConfig(name="pefll", new_clients=0.2))


def test_custom_checks_name_the_key():
    with pytest.raises(ConfigError, match=r"^algorithm\.extractor_kernel: must be odd \(got 4\)$"):
        build_hparams(AlgorithmConfig(name="pfedes", extractor_kernel=4))
    with pytest.raises(ConfigError, match=r"^algorithm\.head_layers: names no layer"):
        build_hparams(AlgorithmConfig(name="fedrep", head_layers=" , "))
    with pytest.raises(ConfigError, match=r"^algorithm\.include_own: .*\(got 'yes'\)$"):
        build_hparams(AlgorithmConfig(name="fedfomo", include_own="yes"))


def test_head_modes_match_the_hypernetwork():
    from hyperfed.algorithms.mh_pfedhn import HeadMode
    from hyperfed.hypernet.multihead import HEAD_MODES

    assert typing.get_args(HeadMode) == HEAD_MODES


def test_the_schema_describes_every_method():
    schema = ExperimentConfig.model_json_schema()
    methods = schema["$defs"]["AlgorithmConfig"]["properties"]
    assert set(registry()) <= set(methods)
    kt = methods["pfedkt"]["properties"]
    # by hand from PFedKTParams: kl_reduction in {mean, sum}, hn_steps >= 1 (Alg. 1: one)
    assert kt["kl_reduction"]["enum"] == ["mean", "sum"]
    assert kt["kl_reduction"]["default"] == "mean"
    assert kt["hn_steps"] == {**kt["hn_steps"], "type": "integer", "minimum": 1, "default": 1}
    assert kt["mu"]["minimum"] == 0 and kt["mu"]["exclusiveMaximum"] == 1
    assert kt["hn_steps"]["description"].startswith("paper seed 001 Alg. 1")
    assert methods["pfedkt"]["additionalProperties"] is False
    assert re.search("chosen here", kt["kl_reduction"]["description"])
