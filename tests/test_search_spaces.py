"""Every declared search space (``Algorithm.tune``, issue 36) is one its method accepts.

A study samples anywhere in a space; a value the method's hyperparameters refuse turns a
trial into an error instead of a measurement (pFedES offered mu = 1.0 while Eq. 5 allows
(0, 0.5]). Each space's ends (or every choice) must build the method's hyperparameters, and
each tuned name must be one of them.
"""

from __future__ import annotations

import dataclasses

import pytest

from hyperfed.algorithms import registry
from hyperfed.config import validate_hparams
from hyperfed.hparams import Space
from hyperfed.tune import LOCAL_LR, search_space

TUNED = {name: alg for name, alg in registry().items() if alg.tune}


def _values(space: Space) -> list[object]:
    if space.choices:
        return list(space.choices)
    return [int(space.low), int(space.high)] if space.integer else [space.low, space.high]


def test_the_methods_whose_papers_tune_a_hyperparameter_declare_it() -> None:
    # the hypernetwork methods of the seed tables tune their hypernetwork's step as well
    for name in ("pfedhn", "mh_pfedhn", "pfedlhn", "pefll", "pfedla", "dfedhp", "pfedkt"):
        assert name in TUNED, f"{name} declares no search space beyond the local lr"


@pytest.mark.parametrize("name", sorted(TUNED))
def test_every_value_at_the_ends_of_a_space_is_accepted(name: str) -> None:
    alg = TUNED[name]
    fields = {f.name for f in dataclasses.fields(alg.hparams)}
    for key, space in alg.tune.items():
        assert key in fields, f"{name}: tunes {key!r}, not one of its hyperparameters"
        for value in _values(space):
            validate_hparams(alg.hparams, {key: value})  # raises where the method refuses it
    assert search_space(name).get("local.lr", LOCAL_LR) == LOCAL_LR


def test_a_space_outside_what_the_method_accepts_is_caught() -> None:
    """The check above on a space that offers pFedES mu = 1.0 (Eq. 5: mu in (0, 0.5])."""
    alg = TUNED["pfedes"]
    with pytest.raises(ValueError, match=r"mu: allowed: a number > 0 and <= 0.5 \(got 1.0\)"):
        for value in _values(Space(choices=(0.1, 1.0))):
            validate_hparams(alg.hparams, {"mu": value})
