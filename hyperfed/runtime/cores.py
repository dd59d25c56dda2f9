"""How many CPU cores a hyperfed process may use (``local.workers = auto``).

Light on purpose (no torch import): ``sweep`` and ``tune`` read it to share the machine among
the runs they start in parallel, through ``HYPERFED_CORES``.
"""

from __future__ import annotations

import os

from hyperfed.errors import ConfigError

__all__ = ["CORES_ENV", "available_cores", "physical_cores"]


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads not counted)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        allowed = os.cpu_count() or 1
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo") as f:
            phys = ""
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    phys = value.strip()
                elif key.strip() == "core id":
                    cores.add((phys, value.strip()))
    except OSError:
        pass
    return max(1, min(allowed, len(cores) or allowed))


# caps the cores one hyperfed process uses: set by `sweep --parallel` / `tune --parallel` for
# their runs (the machine's cores shared among them), or by a user on a shared machine
CORES_ENV = "HYPERFED_CORES"


def available_cores() -> int:
    """The cores this process may use: its physical cores, capped by ``HYPERFED_CORES``."""
    cores = physical_cores()
    cap = os.environ.get(CORES_ENV, "").strip()
    if not cap:
        return cores
    if not cap.isdigit() or int(cap) < 1:
        raise ConfigError(f"{CORES_ENV}={cap!r}: expected a whole number >= 1")
    return min(cores, int(cap))
