"""Robust aggregation as a server option (issue 55, item 2): ``defense.aggregation``.

Hand-sized examples, the expected values computed by hand from the definitions:

- **median** (Yin et al. 2018): per coordinate the middle value (the mean of the two middle ones
  for an even count);
- **trimmed mean** (Yin et al. 2018): per coordinate drop the ``floor(beta n)`` largest and
  smallest values, average the rest;
- **Krum / Multi-Krum** (Blanchard et al. 2017): ``score_i`` = the sum of squared distances to
  its ``n - f - 2`` nearest neighbours; Krum keeps the lowest score, Multi-Krum averages the
  ``m`` lowest.

Five client vectors, one an outlier::

    v0 = [1, 2], v1 = [2, 1], v2 = [3, 1], v3 = [6, 5], v4 = [100, -50]

coordinate 0 sorted: 1 2 3 6 100 -> median 3, trimmed (beta 0.2, drop 1 each end) 11/3;
coordinate 1 sorted: -50 1 1 2 5 -> median 1, trimmed 4/3. Squared distances:
d01 2, d02 5, d03 34, d04 12505, d12 1, d13 32, d14 12205, d23 25, d24 12010, d34 11861; with
f = 1 each score sums the 2 nearest: s0 = 2 + 5 = 7, s1 = 1 + 2 = 3, s2 = 1 + 5 = 6,
s3 = 25 + 32 = 57, s4 = 11861 + 12010 = 23871. Krum picks v1; Multi-Krum (m = 3) averages
v1, v2, v0 = [2, 4/3]; with m = n - f = 4 also v3: [3, 9/4].
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import Tensor
from toy import fedavg, tiny_mlp

from hyperfed.algorithms.base import Payload
from hyperfed.config import ConfigError, DefenseConfig, load_config
from hyperfed.engine.robust import (
    RobustRule,
    coordinate_median,
    krum_scores,
    krum_select,
    robust_average,
    trimmed_mean,
)
from hyperfed.runtime.driver import RoundDriver

V = torch.tensor(
    [[1.0, 2.0], [2.0, 1.0], [3.0, 1.0], [6.0, 5.0], [100.0, -50.0]], dtype=torch.float64
)
ONES = torch.ones(5, dtype=torch.float64)


def close(got: Tensor, want: list[float]) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=0, atol=1e-12)


def test_coordinate_median_by_hand():
    close(coordinate_median(V), [3.0, 1.0])
    # an even count: the mean of the two middle values
    close(coordinate_median(torch.tensor([[1.0], [2.0], [10.0], [3.0]])), [2.5])


def test_trimmed_mean_by_hand():
    close(trimmed_mean(V, 0.2), [11 / 3, 4 / 3])
    close(trimmed_mean(V, 0.0), [22.4, -8.2])  # beta 0: the plain mean
    # beta 0.45 of 5 drops floor(2.25) = 2 at each end: the median's coordinate
    close(trimmed_mean(V, 0.45), [3.0, 1.0])
    # too few values to drop floor(beta n) at both ends: one is always left
    close(trimmed_mean(V[:2], 0.49), [1.5, 1.5])


def test_krum_scores_and_choice_by_hand():
    close(krum_scores(V, byzantine=1), [7.0, 3.0, 6.0, 57.0, 23871.0])
    assert krum_select(V, 1, keep=1) == [1]
    assert krum_select(V, 1, keep=3) == [1, 2, 0]
    close(robust_average(V, ONES, RobustRule("krum", byzantine=1)), [2.0, 1.0])
    close(robust_average(V, ONES, RobustRule("multi_krum", byzantine=1, krum_keep=3)), [2, 4 / 3])
    # m = n - f = 4 by default
    close(robust_average(V, ONES, RobustRule("multi_krum", byzantine=1)), [3.0, 9 / 4])
    # f = 2: one neighbour each (n - f - 2 = 1): s = [2, 1, 1, 25, 11861]; ties -> lower index
    close(krum_scores(V, byzantine=2), [2.0, 1.0, 1.0, 25.0, 11861.0])
    assert krum_select(V, 2, keep=1) == [1]


def test_small_rounds_never_fail():
    # Krum's n > 2f + 2 does not hold: the neighbour count is clamped to [1, n - 1]
    one = V[:1]
    for rule in ("median", "trimmed_mean", "krum", "multi_krum"):
        close(robust_average(one, ONES[:1], RobustRule(rule, byzantine=3)), [1.0, 2.0])
    two = V[:2]
    close(robust_average(two, ONES[:2], RobustRule("krum", byzantine=3)), [1.0, 2.0])
    close(robust_average(two, ONES[:2], RobustRule("median")), [1.5, 1.5])


def test_mean_is_fedavg_and_robust_rules_ignore_the_declared_counts():
    w = torch.tensor([1.0, 1.0, 1.0, 1.0, 1000.0], dtype=torch.float64)
    # FedAvg: sum n_k v_k / sum n_k, dominated by the client that declares 1000 samples
    want = (V[:4].sum(0) + 1000 * V[4]) / 1004
    torch.testing.assert_close(robust_average(V, w), want, rtol=0, atol=1e-12)
    for rule in ("median", "trimmed_mean", "krum", "multi_krum"):
        r = RobustRule(rule, trim_fraction=0.2, byzantine=1)
        torch.testing.assert_close(robust_average(V, w, r), robust_average(V, ONES, r))


# -- through the server: every method that averages with FedAvg's rule --------------------------


def fedavg_round(defense: DefenseConfig, updates: Tensor) -> tuple[Tensor, Tensor, RoundDriver]:
    """One FedAvg round over clients whose updates (reply minus the sent model) are the rows of
    ``updates`` in the first two coordinates; returns (model before, model after, driver)."""
    fm = tiny_mlp(3, 3, 2)
    n = updates.shape[0]

    def answer(c: int, msg: Payload) -> Payload:
        u = torch.zeros_like(msg["theta"])
        u[:2] = updates[c]
        return {"theta": msg["theta"] + u}

    server, driver = fedavg([c + 1 for c in range(n)], fm, answer, defense)
    before = fm.initial_params()
    driver.run_round(1)
    return before, server.theta[str(fm.num_params)], driver


@pytest.mark.parametrize(
    ("settings", "want"),
    [
        ({"aggregation": "median"}, [3.0, 1.0]),
        ({"aggregation": "trimmed_mean", "trim_fraction": 0.2}, [11 / 3, 4 / 3]),
        ({"aggregation": "krum", "byzantine": 1}, [2.0, 1.0]),
        ({"aggregation": "multi_krum", "byzantine": 1, "krum_keep": 3}, [2.0, 4 / 3]),
    ],
)
def test_fedavgs_server_takes_the_configured_rule(settings, want):
    defense = DefenseConfig(max_norm_ratio="off", **settings)
    before, after, _ = fedavg_round(defense, V)
    close((after - before)[:2], want)
    torch.testing.assert_close(after[2:], before[2:], rtol=0, atol=1e-12)  # no one moved them


def test_the_default_stays_fedavgs_weighted_mean():
    before, after, _ = fedavg_round(DefenseConfig(max_norm_ratio="off"), V)
    n = torch.arange(1, 6, dtype=torch.float64)  # client c declared c + 1 samples
    torch.testing.assert_close((after - before)[:2], (n[:, None] * V).sum(0) / n.sum())


def test_clip_to_the_rounds_median_norm():
    # norms 3, 4, 10: each update longer than the median 4 is scaled down to norm 4
    u = torch.tensor([[3.0, 0.0], [0.0, 4.0], [6.0, 8.0]], dtype=torch.float64)
    defense = DefenseConfig(max_norm_ratio="off", clip_update_norm="median")
    before, after, _ = fedavg_round(defense, u)
    clipped = torch.tensor([[3.0, 0.0], [0.0, 4.0], [2.4, 3.2]], dtype=torch.float64)
    n = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close((after - before)[:2], (n[:, None] * clipped).sum(0) / 6)


def test_the_rule_reaches_every_method_that_averages_through_the_server(caplog):
    """The config's rule is in the server context of any method (built by the Federation), and a
    method that averages through ``Server.average_reply`` (FedPer here, no edit of its aggregate)
    uses it; one that does not is warned about, once."""
    from hyperfed.runtime.simulate import Simulation

    base = ["clients.count=3", "clients.models=mlp", "rounds=1", "eval_every=1"]
    base += ["dataset.subsample=300", "local.epochs=1", "defense.aggregation=median"]
    sim = Simulation(load_config(None, [*base, "algorithm.name=fedper"]))
    assert sim.server.ctx.aggregation == RobustRule("median")
    body0 = sim.server.body.clone()
    ex = sim.driver.train_exchange(1, [0, 1, 2])
    sim.server.aggregate(1, ex.accepted)
    want = torch.stack([ex.accepted[c]["body"] for c in (0, 1, 2)]).median(dim=0).values
    torch.testing.assert_close(sim.server.body, want)
    assert not torch.equal(sim.server.body, body0)
    with caplog.at_level(logging.WARNING, logger="hyperfed"):
        Simulation(load_config(None, [*base, "algorithm.name=pfedlhn"])).run()
    assert "defense.aggregation = median: " in caplog.text
    assert "does not aggregate with FedAvg's rule" in caplog.text


def test_the_aggregation_keys_are_validated_in_one_line():
    cfg = load_config(None, ["defense.aggregation=multi_krum", "defense.krum_keep=4"])
    assert cfg.defense.rule() == RobustRule("multi_krum", 0.1, 1, 4)
    for bad, key in (
        ("defense.aggregation=mode", "defense.aggregation"),
        ("defense.trim_fraction=0.5", "defense.trim_fraction"),
        ("defense.byzantine=-1", "defense.byzantine"),
        ("defense.krum_keep=0", "defense.krum_keep"),
        ("defense.clip_update_norm=mean", "defense.clip_update_norm"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])
    assert not math.isnan(DefenseConfig().trim_fraction)
