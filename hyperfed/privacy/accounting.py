"""Differential-privacy accounting for the subsampled Gaussian mechanism, from Opacus.

hyperfed does not derive privacy guarantees itself: (epsilon, delta) come from Opacus' RDP
accountant (Mironov 2017; Mironov, Talwar & Zhang 2019), the accountant Abadi et al. (2016)
style DP-SGD implementations use. Opacus is an optional extra: ``pip install hyperfed[privacy]``.
"""

from __future__ import annotations

from hyperfed.errors import HyperfedError


class PrivacyUnavailableError(HyperfedError, ImportError, ValueError):
    """Opacus is not installed (a ValueError too, so a config naming DP fails cleanly)."""


def require_opacus():  # type: ignore[no-untyped-def]
    """Opacus' RDP accountant class and noise search, or a clear error."""
    try:
        from opacus.accountants import RDPAccountant
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:  # pragma: no cover - depends on the environment
        raise PrivacyUnavailableError(
            "differential privacy needs Opacus' accountant: pip install 'hyperfed[privacy]'"
        ) from None
    return RDPAccountant, get_noise_multiplier


def composed_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """epsilon at ``delta`` of the composition of ``(noise_multiplier, sample_rate, steps)``
    phases of the subsampled Gaussian mechanism (a client that distills several times lists
    each phase); inf if any phase has no noise, 0 for no steps at all."""
    phases = [(float(s), float(min(1.0, q)), int(n)) for s, q, n in history if int(n) > 0]
    if not phases:
        return 0.0
    if any(s <= 0 for s, _, _ in phases):
        return float("inf")
    rdp_accountant, _ = require_opacus()
    acc = rdp_accountant()
    acc.history = phases
    return float(acc.get_epsilon(delta=delta))


def gaussian_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float
) -> float:
    """epsilon after ``steps`` releases of the Gaussian mechanism with noise std
    ``noise_multiplier * clip`` on a Poisson subsample of rate ``sample_rate``: DP-SGD's
    accounting (Abadi et al. 2016) with the RDP accountant; ``steps`` = the iterations taken."""
    if noise_multiplier <= 0 and steps > 0:
        return float("inf")
    return composed_epsilon([(noise_multiplier, sample_rate, steps)], delta)


def noise_for_epsilon(epsilon: float, sample_rate: float, steps: int, delta: float) -> float:
    """The noise multiplier that reaches ``epsilon`` after ``steps`` releases (Opacus' search)."""
    _, get_noise_multiplier = require_opacus()
    return float(
        get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=float(min(1.0, sample_rate)),
            steps=int(steps),
            accountant="rdp",
        )
    )
