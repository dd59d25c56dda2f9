"""hyperfed: personalized federated learning with hypernetworks across heterogeneous clients.

The Python API (``docs/python.md``)::

    import hyperfed

    result = hyperfed.run("configs/seed000/fmnist_homo.toml", overrides={"rounds": 5})
    print(result.mean_acc, result.client_acc)

Every name below is imported on first use, so ``import hyperfed`` stays cheap (no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "run": "hyperfed.api",
    "load_config": "hyperfed.api",
    "RunResult": "hyperfed.api",
    "register_model": "hyperfed.models.zoo",
    "register_method": "hyperfed.algorithms",
    "ExperimentConfig": "hyperfed.config",
    "Simulation": "hyperfed.runtime.simulate",
    "Algorithm": "hyperfed.algorithms.base",
    "HyperfedError": "hyperfed.errors",
    "ConfigError": "hyperfed.errors",
    "ModelPartError": "hyperfed.models.adapter",
}

__all__ = [
    "Algorithm",
    "ConfigError",
    "ExperimentConfig",
    "HyperfedError",
    "ModelPartError",
    "RunResult",
    "Simulation",
    "__version__",
    "load_config",
    "register_method",
    "register_model",
    "run",
]

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports on first use
    from hyperfed.algorithms import register_method
    from hyperfed.algorithms.base import Algorithm
    from hyperfed.api import RunResult, load_config, run
    from hyperfed.config import ExperimentConfig
    from hyperfed.errors import ConfigError, HyperfedError
    from hyperfed.models.adapter import ModelPartError
    from hyperfed.models.zoo import register_model
    from hyperfed.runtime.simulate import Simulation


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperfed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
