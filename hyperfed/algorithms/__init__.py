"""One file per method: every module here with an ``ALGORITHM`` entry (or an ``ALGORITHMS``
list, for a paper's variants) is registered, and so is every algorithm another installed package
declares under the ``hyperfed.algorithms`` entry point group (:mod:`hyperfed.plugins`)."""

from __future__ import annotations

import importlib
import pkgutil
import types
from collections.abc import Iterator

from hyperfed import plugins
from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    ClientGroup,
    Payload,
    Server,
    ServerContext,
)


def _in_module(module: types.ModuleType) -> list[Algorithm]:
    entries = [getattr(module, "ALGORITHM", None), *getattr(module, "ALGORITHMS", [])]
    return [alg for alg in entries if isinstance(alg, Algorithm)]


def _plugin_algorithms(plugin: plugins.Plugin) -> Iterator[tuple[str, Algorithm]]:
    """A plugin's value: an ``Algorithm``, or a module holding ``ALGORITHM`` / ``ALGORITHMS``."""
    value = plugin.value
    found = _in_module(value) if isinstance(value, types.ModuleType) else [value]
    if not found or not all(isinstance(alg, Algorithm) for alg in found):
        raise TypeError(
            "expected an Algorithm or a module with ALGORITHM = Algorithm(...); got "
            f"{type(value).__name__}"
        )
    for alg in found:
        yield alg.name, alg


@plugins.cached
def registry() -> dict[str, Algorithm]:
    """Every algorithm by name: the modules of this package, then the installed plugins."""
    algos = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for alg in _in_module(module):
            algos[alg.name] = alg
    algos.update(plugins.discover("algorithms", algos, _plugin_algorithms))
    return dict(sorted(algos.items()))


def get_algorithm(name: str) -> Algorithm:
    algos = registry()
    if name not in algos:
        raise KeyError(f"unknown algorithm {name!r}; choose one of: {', '.join(sorted(algos))}")
    return algos[name]


__all__ = [
    "Algorithm",
    "Client",
    "ClientContext",
    "ClientGroup",
    "Payload",
    "Server",
    "ServerContext",
    "get_algorithm",
    "registry",
]
