"""Plugins: algorithms, models and datasets that another installed package registers.

A package declares them as entry points in its ``pyproject.toml``; hyperfed finds them with
:func:`importlib.metadata.entry_points` the first time a registry is asked for its names, and
they then appear in ``hyperfed list`` and run like the built-ins::

    [project.entry-points."hyperfed.algorithms"]
    my_method = "my_pkg.my_method"            # a module with ALGORITHM (or an ALGORITHMS list)
    # or: my_method = "my_pkg.my_method:ALGORITHM"  (an Algorithm object)

    [project.entry-points."hyperfed.models"]
    my_net = "my_pkg.nets:build"              # (in_shape, num_classes) -> nn.Module, or a ModelEntry

    [project.entry-points."hyperfed.datasets"]
    my_data = "my_pkg.data:load"              # (data_dir=None, **options) -> ArrayDataset

An algorithm is registered under its ``Algorithm.name``; a model or dataset under the entry
point's name. A plugin that fails to import, or whose object is of the wrong kind, is skipped
with a one-line warning naming its package; a plugin name equal to a built-in one (or to
another package's plugin) is a :class:`PluginError` naming both.

A bottom-layer module: it imports nothing of hyperfed but the errors; each registry
(``algorithms``, ``models.zoo``, ``data.sources``) checks and converts its own plugins.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Literal, ParamSpec, TypeVar

from hyperfed.errors import HyperfedError

__all__ = ["GROUPS", "Plugin", "PluginError", "cached", "discover", "reset"]

Kind = Literal["algorithms", "models", "datasets"]
GROUPS: dict[str, str] = {
    "algorithms": "hyperfed.algorithms",
    "models": "hyperfed.models",
    "datasets": "hyperfed.datasets",
}

log = logging.getLogger("hyperfed.plugins")
P = ParamSpec("P")
T = TypeVar("T")
_RESETS: list[Callable[[], None]] = []


class PluginError(HyperfedError):
    """Two registrations of one name (a plugin and a built-in, or two plugins)."""


@dataclass(frozen=True)
class Plugin:
    """One loaded entry point: its name, the object it names, and where it comes from."""

    name: str
    value: Any
    package: str  # the distribution that declares it
    target: str  # the entry point's value, "module:attribute"


def cached(fn: Callable[P, T]) -> Callable[P, T]:
    """``functools.cache`` whose cache :func:`reset` clears (for registries built from plugins)."""
    wrapped = functools.cache(fn)
    _RESETS.append(wrapped.cache_clear)
    return wrapped  # type: ignore[return-value]


def reset() -> None:
    """Forget every loaded plugin and cached registry (e.g. after installing a package)."""
    for clear in _RESETS:
        clear()


def _warn(kind: str, package: str, target: str, why: object) -> None:
    why = " ".join(str(why).split()) or type(why).__name__
    log.warning("skipping %s plugin %s from package %s: %s", kind[:-1], target, package, why)


@cached
def _load(kind: str) -> list[Plugin]:
    found = []
    for ep in entry_points(group=GROUPS[kind]):
        package = ep.dist.name if ep.dist is not None else "(unknown package)"
        try:
            value = ep.load()
        except Exception as e:  # any error of a third-party import: skip that plugin only
            _warn(kind, package, ep.value, f"{type(e).__name__}: {e}")
            continue
        found.append(Plugin(ep.name, value, package, ep.value))
    return found


def discover(
    kind: Kind,
    builtin: Collection[str],
    convert: Callable[[Plugin], Iterable[tuple[str, T]]],
) -> dict[str, T]:
    """The ``kind`` plugins, each turned into ``(name, entry)`` pairs by ``convert``.

    ``convert`` raises ``TypeError`` / ``ValueError`` for an object of the wrong kind: that
    plugin is skipped with a warning. A name in ``builtin`` or registered twice raises
    :class:`PluginError`.
    """
    out: dict[str, T] = {}
    owner: dict[str, Plugin] = {}
    what = kind[:-1]
    for plugin in _load(kind):
        try:
            items = list(convert(plugin))
        except (TypeError, ValueError) as e:
            _warn(kind, plugin.package, plugin.target, e)
            continue
        for name, entry in items:
            if name in builtin:
                raise PluginError(
                    f"{what} {name!r} of plugin package {plugin.package} ({plugin.target}) "
                    f"clashes with hyperfed's built-in {what} {name!r}; rename it in "
                    f"{plugin.package}'s entry points"
                )
            if name in owner:
                first = owner[name]
                raise PluginError(
                    f"{what} {name!r} is registered twice: by plugin package {first.package} "
                    f"({first.target}) and by {plugin.package} ({plugin.target}); uninstall "
                    "or rename one"
                )
            out[name] = entry
            owner[name] = plugin
    return out
