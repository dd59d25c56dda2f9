"""What every dataset loader returns and the pieces they share.

:class:`ArrayDataset` holds a whole dataset in memory; :class:`DataError` is the one-line error
every loader raises; :class:`DatasetEntry` is a row of the dataset table
(:data:`hyperfed.data.sources.DATASETS`). The loaders themselves live in
:mod:`hyperfed.data.builtin` (the built-in datasets) and :mod:`hyperfed.data.own` (your own
data); :func:`hyperfed.data.sources.load_dataset` picks one by name.

Images are ``uint8`` arrays of shape ``[N, C, H, W]`` (values 0..255); ``mean`` and ``std`` are
the per-channel statistics of ``x_train / 255`` and are meant for normalisation. Vector data
(``synthetic``) is ``float32 [N, D]`` with empty ``mean``/``std``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hyperfed.errors import HyperfedError

__all__ = ["ArrayDataset", "DataError", "DatasetEntry", "Loader", "image_dataset"]


class DataError(HyperfedError, RuntimeError):
    """A dataset file or folder is missing or corrupt.

    The message is always a single line: what is wrong, where it was looked for, and how to get
    the data.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


@dataclass
class ArrayDataset:
    """A whole dataset held in memory as numpy arrays.

    ``natural_partition`` is only set for datasets that come already split by user
    (``synthetic``; ``npz`` / ``hf_disk`` with client ids): entry ``i`` holds the indices of user ``i``'s samples in the *pooled*
    arrays ``concatenate([x_train, x_test])`` / ``concatenate([y_train, y_test])`` (see
    :meth:`pooled`), i.e. test indices are offset by ``len(y_train)``.
    ``natural_split`` (npz with a ``split`` array) gives each pooled sample its split, 0 train,
    1 val, 2 test: with the natural partition it replaces the drawn per-client split.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    natural_partition: list[np.ndarray] | None = None
    natural_split: np.ndarray | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """``(C, H, W)`` for images, ``(D,)`` for vector data."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.y_test.shape[0])

    def pooled(self) -> tuple[np.ndarray, np.ndarray]:
        """Train followed by test, as the federated partitioner uses them (new arrays)."""
        return (
            np.concatenate([self.x_train, self.x_test], axis=0),
            np.concatenate([self.y_train, self.y_test], axis=0),
        )


Loader = Callable[..., ArrayDataset]


@dataclass(frozen=True)
class DatasetEntry:
    """Registry entry: the loader, a one-line description and where the files come from."""

    loader: Loader
    description: str
    source: str


def _channel_stats(x: np.ndarray, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean / std of ``x / 255`` for a uint8 ``[N, C, H, W]`` array (chunked)."""
    n, c = x.shape[0], x.shape[1]
    if n == 0:
        return tuple(0.0 for _ in range(c)), tuple(1.0 for _ in range(c))
    total = np.zeros(c, dtype=np.float64)
    total_sq = np.zeros(c, dtype=np.float64)
    for start in range(0, n, chunk):
        block = x[start : start + chunk].astype(np.float64) / 255.0
        total += block.sum(axis=(0, 2, 3))
        total_sq += np.square(block).sum(axis=(0, 2, 3))
    count = float(n * x.shape[2] * x.shape[3])
    mean = total / count
    var = np.maximum(total_sq / count - np.square(mean), 0.0)
    std = np.sqrt(var)
    std = np.where(std > 0, std, 1.0)
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def image_dataset(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
) -> ArrayDataset:
    """Check the labels and wrap uint8 ``[N, C, H, W]`` images with their channel statistics."""
    x_train = np.ascontiguousarray(x_train, dtype=np.uint8)
    x_test = np.ascontiguousarray(x_test, dtype=np.uint8)
    y_train = np.asarray(y_train, dtype=np.int64)
    y_test = np.asarray(y_test, dtype=np.int64)
    for split, y in (("train", y_train), ("test", y_test)):
        if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise DataError(
                f"{name}: {split} labels outside 0..{num_classes - 1} "
                f"(found {int(y.min())}..{int(y.max())}); the files are not {name} files"
            )
    mean, std = _channel_stats(x_train)
    return ArrayDataset(name, x_train, y_train, x_test, y_test, num_classes, mean, std)
