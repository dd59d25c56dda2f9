"""One file per method: every module here with an ``ALGORITHM`` entry (or an ``ALGORITHMS``
list, for a paper's variants) is imported by name at the end of this file and registered
(:class:`hyperfed.registry.Registry`), and so is every algorithm another installed package
declares under the ``hyperfed.algorithms`` entry point group (:mod:`hyperfed.plugins`).
A new method file is added to that import list (``tests/test_federation.py`` checks that
every method module is listed)."""

from __future__ import annotations

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
from hyperfed.errors import did_you_mean
from hyperfed.registry import Registry


def _in_module(module: types.ModuleType) -> list[Algorithm]:
    entries = [getattr(module, "ALGORITHM", None), *getattr(module, "ALGORITHMS", [])]
    return [alg for alg in entries if isinstance(alg, Algorithm)]


def _algorithms_of(value: object) -> list[Algorithm]:
    """An ``Algorithm``, or a module holding ``ALGORITHM`` / ``ALGORITHMS``: the algorithms in it
    (a TypeError naming what was given otherwise)."""
    if isinstance(value, types.ModuleType) and _in_module(value):
        return _in_module(value)
    if isinstance(value, Algorithm):
        return [value]
    raise TypeError(
        "expected an Algorithm or a module with ALGORITHM = Algorithm(...); got "
        f"{type(value).__name__}"
    )


def _plugin_algorithms(plugin: plugins.Plugin) -> Iterator[tuple[str, Algorithm]]:
    """A plugin's value: an ``Algorithm``, or a module holding ``ALGORITHM`` / ``ALGORITHMS``."""
    for alg in _algorithms_of(plugin.value):
        yield alg.name, alg


ALGORITHMS: Registry[Algorithm] = Registry("algorithms", _plugin_algorithms)


def registry() -> dict[str, Algorithm]:
    """Every algorithm by name: the method modules of this package, then the installed plugins."""
    return dict(sorted(ALGORITHMS.entries().items()))


def register_method(algorithm: Algorithm | types.ModuleType) -> str:
    """Add a method to this process's registry (``hyperfed.register_method``): an
    :class:`~hyperfed.algorithms.base.Algorithm`, or a module holding ``ALGORITHM`` (or an
    ``ALGORITHMS`` list, whose first entry's name is returned). ``algorithm.name = <its name>``
    then runs it. Registering a name again replaces this process's earlier registration; a
    built-in or plugin method's name is refused. Worker processes (``local.workers`` > 1) do
    not see it. Returns the (first) registered name."""
    try:
        found = _algorithms_of(algorithm)
    except TypeError as e:
        raise TypeError(f"register_method: {e}") from None
    for alg in found:
        ALGORITHMS.add(alg.name, alg)
    return found[0].name


def get_algorithm(name: str) -> Algorithm:
    algos = registry()
    if name not in algos:
        raise KeyError(
            f"unknown algorithm {name!r}; {did_you_mean(name, algos)}choose one of: "
            f"{', '.join(sorted(algos))}"
        )
    return algos[name]


__all__ = [
    "Algorithm",
    "Client",
    "ClientContext",
    "ClientGroup",
    "Payload",
    "Server",
    "ServerContext",
    "ALGORITHMS",
    "METHOD_MODULES",
    "get_algorithm",
    "register_method",
    "registry",
]


# every method module, by name (imported last: a method module may import this package)
from hyperfed.algorithms import (  # noqa: E402, F401 (read back below, through globals())
    desa,
    dfedalt,
    dfedavg,
    dfedhp,
    dispfl,
    distilled_set,
    ditto,
    fd,
    fedavg,
    fedbn,
    feddm,
    fedfomo,
    fedgh,
    fedkd,
    fedper,
    fedphp,
    fedproto,
    fedrep,
    fedrod,
    fedtgp,
    fml,
    hypcluster,
    lg_fedavg,
    local,
    mapper,
    mh_pfedhn,
    mh_pfedhndd,
    moon,
    partialfed,
    pefll,
    pfedes,
    pfedhn,
    pfedkt,
    pfedla,
    pfedlhn,
)

# the modules of the import list above, in its order (one list to edit when adding a method)
METHOD_MODULES: tuple[types.ModuleType, ...] = tuple(
    m
    for m in dict(globals()).values()
    if isinstance(m, types.ModuleType)
    and m.__name__.startswith(__name__ + ".")
    and m.__name__.count(".") == 2
    and _in_module(m)
)
for _module in METHOD_MODULES:
    for _alg in _in_module(_module):
        ALGORITHMS.register(_alg.name, _alg)
