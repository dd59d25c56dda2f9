"""The dataset table and :func:`load_dataset`: a name in, an :class:`ArrayDataset` out.

:data:`DATASETS` lists the built-in datasets (:mod:`hyperfed.data.builtin`: files already on disk,
never downloaded, or generated in memory) followed by your own data (:mod:`hyperfed.data.own`:
``folder``, ``npz``, ``hf_disk``, read from ``dataset.path``); installed plugins add theirs
(entry-point group ``hyperfed.datasets``). What a loader returns and raises is in
:mod:`hyperfed.data.datasets`; every name users import from here (``ArrayDataset``,
``DataError``, ``DatasetEntry``, ...) still is.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from hyperfed import plugins
from hyperfed.data.builtin import BUILTIN_DATASETS
from hyperfed.data.datasets import ArrayDataset, DataError, DatasetEntry
from hyperfed.data.own import MAX_CLASSES, MAX_IMAGE_SIDE, OWN_DATA, OWN_DATASETS
from hyperfed.registry import Registry

__all__ = [
    "DATASETS",
    "MAX_CLASSES",
    "MAX_IMAGE_SIDE",
    "OWN_DATA",
    "ArrayDataset",
    "DataError",
    "DatasetEntry",
    "dataset_entries",
    "dataset_names",
    "load_dataset",
]

DATASETS: dict[str, DatasetEntry] = {**BUILTIN_DATASETS, **OWN_DATASETS}


def _plugin_dataset(plugin: plugins.Plugin) -> list[tuple[str, DatasetEntry]]:
    """A ``hyperfed.datasets`` entry point: a :class:`DatasetEntry`, or a loader
    ``(data_dir=None, **options) -> ArrayDataset``."""
    value = plugin.value
    if isinstance(value, DatasetEntry):
        return [(plugin.name, value)]
    if not callable(value):
        raise TypeError(f"expected a loader (data_dir=None, **opts) -> ArrayDataset; got {value!r}")
    doc = (getattr(value, "__doc__", None) or "").strip().splitlines()
    what = f"{doc[0] if doc else plugin.target} (plugin: {plugin.package})"
    return [(plugin.name, DatasetEntry(value, what, f"plugin package {plugin.package}"))]


DATASET_REGISTRY: Registry[DatasetEntry] = Registry("datasets", _plugin_dataset, DATASETS)


def dataset_entries() -> dict[str, DatasetEntry]:
    """:data:`DATASETS`, then the datasets of installed plugins (group ``hyperfed.datasets``)."""
    return DATASET_REGISTRY.entries()


def dataset_names() -> list[str]:
    """Names accepted by :func:`load_dataset`, in registry order (plugins last)."""
    return list(dataset_entries())


def _canonical(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    return {"fmnist": "fashion_mnist", "cifar_10": "cifar10", "cifar_100": "cifar100"}.get(key, key)


def load_dataset(name: str, data_dir: str | Path | None = None, **options: Any) -> ArrayDataset:
    """Load dataset ``name`` (see :func:`dataset_names`) from disk / memory.

    ``options`` are passed to the loader (e.g. ``alpha``, ``beta``, ``num_users``, ``seed`` for
    ``synthetic``; ``split`` for ``emnist``; ``cache_dir`` for ``tiny_imagenet``).
    """
    entries = dataset_entries()
    key = name if name in entries else _canonical(name)
    if key not in entries:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(dataset_names())}")
    loader = entries[key].loader
    try:
        inspect.signature(loader).bind(data_dir, **options)
    except TypeError as exc:
        params = [
            p.name
            for p in inspect.signature(loader).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        raise DataError(
            f"{key}: bad options {sorted(options)} ({exc}); accepted: {params or 'none'}"
        ) from exc
    ds = loader(data_dir, **options)
    if not isinstance(ds, ArrayDataset):  # a plugin's loader
        raise DataError(f"{key}: the loader returned {type(ds).__name__}, not an ArrayDataset")
    return ds
