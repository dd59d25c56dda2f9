"""Robust aggregation: the rules a server may combine client models with instead of FedAvg's mean.

``defense.aggregation`` picks one for every method that averages with FedAvg's rule
(:meth:`hyperfed.algorithms.base.Server.average_reply` calls :func:`robust_average`):

* ``mean`` -- ``sum_k n_k v_k / sum_k n_k`` (FedAvg; the default, unchanged);
* ``median`` -- the coordinate-wise median (Yin et al. 2018, "Byzantine-robust distributed
  learning", Def. 1): per coordinate the middle value, the mean of the two middle ones for an
  even count;
* ``trimmed_mean`` -- the coordinate-wise beta-trimmed mean (Yin et al. 2018, Def. 2): per
  coordinate drop the ``floor(beta * n)`` largest and smallest values and average the rest;
* ``krum`` / ``multi_krum`` -- Blanchard et al. 2017 ("Machine learning with adversaries"):
  ``score_i = sum of ||v_i - v_j||^2 over the n - f - 2 vectors v_j nearest v_i``; Krum keeps
  the vector of lowest score, Multi-Krum averages the ``m`` of lowest scores.

The robust rules weight every client alike: they do not trust the sample count a client declares
at join (a lied count moves ``mean`` only). With fewer replies than a rule's definition needs
(Krum: ``n > 2f + 2``; trimming: ``2 floor(beta n) < n``) the rule still answers -- Krum's
neighbour count is clamped to ``[1, n - 1]``, the trim to ``(n - 1) // 2`` -- so a small round
never stops a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hyperfed.engine.losses import weighted_average

AGGREGATIONS = ("mean", "median", "trimmed_mean", "krum", "multi_krum")


@dataclass(frozen=True)
class RobustRule:
    """How a server combines client vectors (``defense.aggregation`` and its settings)."""

    aggregation: str = "mean"
    trim_fraction: float = 0.1  # beta of the trimmed mean
    byzantine: int = 1  # f of Krum / Multi-Krum
    krum_keep: int | None = None  # m of Multi-Krum; None: n - f

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation={self.aggregation!r}; allowed: {', '.join(AGGREGATIONS)}"
            )


def coordinate_median(values: Tensor) -> Tensor:
    """The median of ``values [n, ...]`` along the first axis, coordinate by coordinate (the
    mean of the two middle values when ``n`` is even)."""
    n = values.shape[0]
    ordered = values.sort(dim=0).values
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trim_count(n: int, beta: float) -> int:
    """How many values a beta-trimmed mean of ``n`` drops at each end (``floor(beta n)``, at
    most ``(n - 1) // 2`` so that one is left)."""
    return min(int(beta * n), (n - 1) // 2)


def trimmed_mean(values: Tensor, beta: float) -> Tensor:
    """Coordinate-wise beta-trimmed mean of ``values [n, ...]``."""
    n = values.shape[0]
    k = trim_count(n, beta)
    return values.sort(dim=0).values[k : n - k].mean(dim=0)


def krum_scores(values: Tensor, byzantine: int) -> Tensor:
    """Krum's score of each row of ``values [n, d]`` (float64): the sum of its squared distances
    to its ``n - f - 2`` nearest other rows (clamped to ``[1, n - 1]``)."""
    n = values.shape[0]
    if n == 1:
        return torch.zeros(1, dtype=torch.float64)
    v = values.reshape(n, -1).double()
    dist = torch.cdist(v, v) ** 2
    dist.fill_diagonal_(float("inf"))
    k = min(max(n - byzantine - 2, 1), n - 1)
    return dist.sort(dim=1).values[:, :k].sum(dim=1)


def krum_select(values: Tensor, byzantine: int, keep: int) -> list[int]:
    """The rows of the ``keep`` lowest Krum scores, lowest first (ties: the lower index)."""
    scores = krum_scores(values, byzantine)
    order = torch.argsort(scores, stable=True)
    return [int(i) for i in order[: max(1, min(keep, values.shape[0]))]]


def robust_average(values: Tensor, weights: Tensor, rule: RobustRule | None = None) -> Tensor:
    """``values [n, ...]`` (one row per client) combined by ``rule`` (default: the weighted
    mean, with ``weights [n]`` the clients' sample counts; the robust rules ignore them)."""
    rule = rule or RobustRule()
    if rule.aggregation == "mean":
        return weighted_average(values, weights)  # FedAvg's rule
    if rule.aggregation == "median":
        return coordinate_median(values)
    if rule.aggregation == "trimmed_mean":
        return trimmed_mean(values, rule.trim_fraction)
    n = values.shape[0]
    keep = 1 if rule.aggregation == "krum" else (rule.krum_keep or n - rule.byzantine)
    chosen = krum_select(values, rule.byzantine, keep)
    return values[chosen].mean(dim=0)
