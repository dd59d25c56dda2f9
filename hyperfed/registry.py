"""One registry style for methods, models and datasets (issue 38, item 4).

A :class:`Registry` maps names to entries: the built-ins, given by the module that defines them
(the zoo's table in ``models/zoo.py``, the dataset table in ``data/sources.py``, each method
module's ``ALGORITHM`` through the static import list in ``algorithms/__init__.py``), then the
entries installed packages declare as plugins (:mod:`hyperfed.plugins`). Every built-in is
reached by a plain import, so static tools (and ``tests/test_layers.py``) see every edge.

A bottom-layer module: it imports nothing of hyperfed but the plugin loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from hyperfed import plugins

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> entries of one ``kind`` ("algorithms", "models", "datasets"): the built-ins in
    the order they were registered, then the plugins (``convert`` turns a loaded entry point
    into ``(name, entry)`` pairs, raising TypeError / ValueError for the wrong kind of object)."""

    def __init__(
        self,
        kind: plugins.Kind,
        convert: Callable[[plugins.Plugin], Iterable[tuple[str, T]]],
        builtin: dict[str, T] | None = None,
    ) -> None:
        self.kind = kind
        self.convert = convert
        self.builtin: dict[str, T] = {} if builtin is None else builtin  # kept, not copied
        self.added: set[str] = set()  # names added at run time (add), among the built-ins
        self._with_plugins = plugins.cached(self._discover)

    def register(self, name: str, entry: T) -> T:
        """Add a built-in ``entry`` under ``name`` (a second one of the same name is an error)."""
        if name in self.builtin:
            raise ValueError(f"{self.kind[:-1]} {name!r} is registered twice")
        self.builtin[name] = entry
        self._with_plugins.cache_clear()  # type: ignore[attr-defined]  # read before: stale
        return entry

    def add(self, name: str, entry: T) -> T:
        """Add ``entry`` at run time (``hyperfed.register_model`` / ``register_method``): a
        name added this way before is replaced; a built-in's or a plugin's name is a
        :class:`~hyperfed.plugins.PluginError`."""
        what = self.kind[:-1]
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise plugins.PluginError(f"a {what} name must be a non-empty word; got {name!r}")
        if name not in self.added and name in self.entries():
            owner = "a built-in" if name in self.builtin else "an installed plugin's"
            raise plugins.PluginError(
                f"{what} {name!r} is {owner} {what}; register yours under another name"
            )
        self.builtin[name] = entry
        self.added.add(name)
        self._with_plugins.cache_clear()  # type: ignore[attr-defined]
        return entry

    def remove(self, name: str) -> None:
        """Forget an entry added at run time (:meth:`add`); other names are kept."""
        if name in self.added:
            self.added.discard(name)
            del self.builtin[name]
            self._with_plugins.cache_clear()  # type: ignore[attr-defined]

    def _discover(self) -> dict[str, T]:
        return {**self.builtin, **plugins.discover(self.kind, self.builtin, self.convert)}

    def entries(self) -> dict[str, T]:
        """Every entry by name: the built-ins, then the installed plugins (loaded once)."""
        return self._with_plugins()

    def names(self) -> list[str]:
        return list(self.entries())
