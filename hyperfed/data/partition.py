"""Label-based federated partitions of a pooled dataset, and per-client train/val/test splits.

Schemes (:data:`PARTITIONS`):

``quantity``
    Quantity-based label imbalance (MH-pFedHN / MH-pFedHNDD, after Shamsian et al.): every
    client holds exactly ``classes_per_client`` distinct classes.  Classes are dealt out
    "least used first" with random tie-breaking, so class usage counts differ by at most one and
    every class is used as soon as ``num_clients * classes_per_client >= num_classes``.  For each
    (client i, class c) pair a share ``a_ic ~ U(0.4, 0.6)`` is drawn and client i receives
    ``a_ic / sum_j a_jc`` of class c's samples (largest-remainder rounding; every holder gets at
    least one sample of each of its classes).
``dirichlet``
    Distribution-based label imbalance: for every class, proportions ``p ~ Dir(alpha * 1_K)``
    over the K clients.  Works for very small ``alpha`` (0.01): a degenerate draw (NaN / all zero)
    is replaced by a one-hot vector on a random client.
``pathological``
    ``classes_per_client`` classes per client (dealt as for ``quantity``); each class's samples
    are cut into equal shards (sizes within one) among the clients holding it.
``iid``
    A uniform random permutation cut into ``num_clients`` pieces whose sizes differ by at most 1.
``flwr:<Partitioner>`` (:func:`flwr_partition`)
    Any label-based partitioner of flwr-datasets (``flwr:DirichletPartitioner``,
    ``flwr:PathologicalPartitioner``, ``flwr:ShardPartitioner``, ...) with its own keyword
    arguments; the rules below are flwr-datasets' own, not hyperfed's.

Rules shared by all schemes:

* Every used sample goes to exactly one client; the union of the parts is ``range(N)``
  restricted to the used classes.  With ``quantity`` / ``pathological`` and
  ``num_clients * classes_per_client < num_classes`` some classes are held by nobody; their
  samples are **dropped** (they appear in no part).  Classes with no samples are ignored.
* Minimum size: every client ends with at least ``min_samples`` samples.

  - ``dirichlet``: up to :data:`DIRICHLET_MAX_TRIES` independent draws are made and the first one
    that satisfies the minimum is kept; otherwise the draw with the largest smallest client is
    kept and samples are moved, one block at a time, from the currently largest client (from its
    most frequent class) to each client below the minimum.  This always succeeds once
    ``num_samples >= num_clients * min_samples``.
  - ``quantity`` / ``pathological``: a client below the minimum receives samples of *its own*
    classes from other holders of those classes that stay at or above the minimum and keep at
    least one sample of the class (so the "exactly k classes" property survives).  If that is
    impossible a :class:`PartitionError` is raised.
  - ``iid``: sizes are balanced, so only the global check applies.

* Impossible requests raise :class:`PartitionError` with a one-line message: more
  ``num_clients * min_samples`` than samples, ``classes_per_client`` larger than the number of
  classes present, a class with fewer samples than clients holding it, etc.
* Results are deterministic given ``seed`` (``numpy.random.default_rng``); each part is a sorted
  ``int64`` array of indices into ``labels``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperfed.errors import HyperfedError

__all__ = [
    "DIRICHLET_MAX_TRIES",
    "PARTITIONS",
    "ClientSplit",
    "PartitionError",
    "client_label_counts",
    "flwr_partition",
    "partition_labels",
    "split_clients",
]

PARTITIONS = ("quantity", "dirichlet", "pathological", "iid")
DIRICHLET_MAX_TRIES = 100
QUANTITY_SHARE_RANGE = (0.4, 0.6)


class PartitionError(HyperfedError, ValueError):
    """A partition or split request that cannot be satisfied (always a one-line message)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _as_labels(labels: np.ndarray) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer) and not np.all(np.mod(y, 1) == 0):
        raise PartitionError(f"labels must be integers, got dtype {y.dtype}")
    y = y.astype(np.int64, copy=False)
    if y.size and int(y.min()) < 0:
        raise PartitionError(f"labels must be non-negative, found {int(y.min())}")
    return y


def _apportion(n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Row-wise largest-remainder rounding: integer counts ``[R, K]`` with rows summing to ``n``."""
    p = p / p.sum(axis=1, keepdims=True)
    exact = p * n[:, None]
    base = np.floor(exact).astype(np.int64)
    rest = n - base.sum(axis=1)
    frac = exact - base
    order = np.argsort(-frac, axis=1, kind="stable")
    ranks = np.empty_like(order)
    rows = np.arange(order.shape[0])[:, None]
    ranks[rows, order] = np.arange(order.shape[1])[None, :]
    return base + (ranks < rest[:, None]).astype(np.int64)


def _deal_classes(
    num_clients: int, classes: np.ndarray, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Give each client k distinct classes, least-used first with random tie-breaking."""
    usage = np.zeros(len(classes), dtype=np.int64)
    out: list[np.ndarray] = []
    for _ in range(num_clients):
        perm = rng.permutation(len(classes))
        pick = perm[np.argsort(usage[perm], kind="stable")[:k]]
        usage[pick] += 1
        out.append(np.sort(classes[pick]))
    return out


def _fill_from_holders(
    counts: np.ndarray,
    held: list[np.ndarray],
    classes: np.ndarray,
    min_samples: int,
    scheme: str,
) -> None:
    """Raise clients below ``min_samples`` using other holders of their own classes (in place)."""
    totals = counts.sum(axis=1)
    for i in np.flatnonzero(totals < min_samples):
        need = int(min_samples - totals[i])
        while need > 0:
            best = (0, -1, -1)  # (amount, donor, class)
            for c in held[i]:
                spare = np.minimum(counts[:, c] - 1, totals - min_samples)
                spare[i] = 0
                j = int(np.argmax(spare))
                if spare[j] > best[0]:
                    best = (int(spare[j]), j, int(c))
            amount, j, c = best
            if amount <= 0:
                raise PartitionError(
                    f"{scheme}: cannot give client {i} min_samples={min_samples} samples from "
                    f"its classes {classes[held[i]].tolist()} (it has {int(totals[i])}); use fewer "
                    "clients (clients.count) or more partition.classes_per_client"
                )
            amount = min(amount, need)
            counts[j, c] -= amount
            counts[i, c] += amount
            totals[j] -= amount
            totals[i] += amount
            need -= amount


def _fill_from_largest(counts: np.ndarray, min_samples: int) -> None:
    """Raise clients below ``min_samples`` with samples of the largest client (in place)."""
    totals = counts.sum(axis=1)
    for i in np.flatnonzero(totals < min_samples):
        need = int(min_samples - totals[i])
        while need > 0:
            masked = totals.copy()
            masked[i] = -1
            j = int(np.argmax(masked))
            c = int(np.argmax(counts[j]))
            amount = min(need, int(totals[j] - min_samples), int(counts[j, c]))
            if amount <= 0:  # unreachable after the global size check
                raise PartitionError(
                    f"dirichlet: cannot give client {i} min_samples={min_samples} samples"
                )
            counts[j, c] -= amount
            counts[i, c] += amount
            totals[j] -= amount
            totals[i] += amount
            need -= amount


def _materialise(
    labels: np.ndarray, counts: np.ndarray, classes: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Turn a ``[K, len(classes)]`` count matrix into index arrays (random samples per class)."""
    num_clients = counts.shape[0]
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for col, c in enumerate(classes):
        col_counts = counts[:, col]
        if not col_counts.any():
            continue  # class held by nobody: its samples are dropped
        idx = rng.permutation(np.flatnonzero(labels == c))
        if int(col_counts.sum()) != idx.size:  # internal invariant
            raise AssertionError(f"class {c}: counts {int(col_counts.sum())} != {idx.size}")
        bounds = np.cumsum(col_counts)[:-1]
        for i, chunk in enumerate(np.split(idx, bounds)):
            if chunk.size:
                pieces[i].append(chunk)
    return [
        np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, dtype=np.int64)
        for p in pieces
    ]


def _check_total(scheme: str, used: int, num_clients: int, min_samples: int, note: str) -> None:
    if used < num_clients * min_samples:
        raise PartitionError(
            f"{scheme}: {num_clients} clients x min_samples={min_samples} needs "
            f"{num_clients * min_samples} samples but only {used} are available{note}; "
            "use fewer clients or a smaller min_samples"
        )


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def partition_labels(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    *,
    classes_per_client: int = 2,
    alpha: float = 0.5,
    seed: int = 0,
    min_samples: int = 4,
) -> list[np.ndarray]:
    """Split sample indices ``0..len(labels)-1`` among ``num_clients`` clients.

    Returns one sorted ``int64`` index array per client (see the module docstring for the exact
    rules, the class-dropping rule and the minimum-size rule).
    """
    if scheme not in PARTITIONS:
        raise PartitionError(f"unknown partition scheme {scheme!r}; choose one of {PARTITIONS}")
    y = _as_labels(labels)
    if int(num_clients) != num_clients or num_clients < 1:
        raise PartitionError(f"{scheme}: num_clients must be a positive integer, got {num_clients}")
    if int(min_samples) != min_samples or min_samples < 1:
        raise PartitionError(f"{scheme}: min_samples must be a positive integer, got {min_samples}")
    num_clients, min_samples = int(num_clients), int(min_samples)
    rng = np.random.default_rng(seed)
    n = int(y.size)

    if scheme == "iid":
        _check_total(scheme, n, num_clients, min_samples, "")
        perm = rng.permutation(n)
        return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]

    classes, class_sizes = np.unique(y, return_counts=True)
    class_sizes = class_sizes.astype(np.int64)

    if scheme == "dirichlet":
        if not np.isfinite(alpha) or alpha <= 0:
            raise PartitionError(f"dirichlet: alpha must be > 0, got {alpha}")
        _check_total(scheme, n, num_clients, min_samples, "")
        best: np.ndarray | None = None
        best_min = -1
        for _ in range(DIRICHLET_MAX_TRIES):
            props = rng.dirichlet(np.full(num_clients, float(alpha)), size=len(classes))
            bad = ~np.isfinite(props).all(axis=1) | ~(props.sum(axis=1) > 0)
            if bad.any():
                props[bad] = 0.0
                props[bad, rng.integers(num_clients, size=int(bad.sum()))] = 1.0
            counts = _apportion(class_sizes, props).T  # [K, C]
            smallest = int(counts.sum(axis=1).min())
            if smallest > best_min:
                best, best_min = counts, smallest
            if smallest >= min_samples:
                break
        assert best is not None
        counts = np.ascontiguousarray(best)
        _fill_from_largest(counts, min_samples)
        return _materialise(y, counts, classes, rng)

    # quantity / pathological
    k = classes_per_client
    if int(k) != k or k < 1:
        raise PartitionError(f"{scheme}: classes_per_client must be a positive integer, got {k}")
    k = int(k)
    if k > len(classes):
        raise PartitionError(
            f"{scheme}: classes_per_client={k} exceeds the {len(classes)} classes present"
        )
    held_cols = _deal_classes(num_clients, np.arange(len(classes)), k, rng)
    holders: list[list[int]] = [[] for _ in classes]
    for i, cols in enumerate(held_cols):
        for col in cols:
            holders[int(col)].append(i)
    used = int(sum(class_sizes[c] for c, h in enumerate(holders) if h))
    dropped = sum(1 for h in holders if not h)
    note = f" ({dropped} unheld classes dropped)" if dropped else ""
    _check_total(scheme, used, num_clients, min_samples, note)

    counts = np.zeros((num_clients, len(classes)), dtype=np.int64)
    for col, h in enumerate(holders):
        if not h:
            continue  # class held by nobody: dropped
        size = int(class_sizes[col])
        if size < len(h):
            raise PartitionError(
                f"{scheme}: class {int(classes[col])} has {size} samples but {len(h)} clients "
                "hold it; use fewer clients or a smaller classes_per_client"
            )
        if scheme == "quantity":
            share = rng.uniform(*QUANTITY_SHARE_RANGE, size=len(h))
            alloc = _apportion(np.array([size]), share[None, :])[0]
            # every holder keeps at least one sample: take from the biggest allocation
            for z in np.flatnonzero(alloc == 0):
                alloc[int(np.argmax(alloc))] -= 1
                alloc[z] += 1
        else:
            alloc = np.full(len(h), size // len(h), dtype=np.int64)
            alloc[rng.permutation(len(h))[: size % len(h)]] += 1
        counts[h, col] = alloc
    _fill_from_holders(counts, held_cols, classes, min_samples, scheme)
    return _materialise(y, counts, classes, rng)


FLWR_PREFIX = "flwr:"
# filled in by hyperfed, never taken from partition.flwr
_FLWR_OWN = {"num_partitions": "clients.count", "seed": "the run's seed (seed = ...)"}


def flwr_partition(
    labels: np.ndarray,
    num_clients: int,
    name: str,
    args: Mapping[str, Any] | None = None,
    *,
    seed: int = 0,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Split sample indices with the flwr-datasets partitioner ``flwr:<Name>`` (or ``<Name>``).

    ``args`` are its keyword arguments; ``num_partitions`` is ``num_clients``, ``seed`` is
    ``seed`` and ``partition_by`` defaults to ``"label"``. The partitioner sees a
    ``datasets.Dataset`` with a ``label`` column (and a ``client`` column holding ``groups``,
    a writer id per sample, when given: ``NaturalIdPartitioner(partition_by="client")``);
    each of its partitions is mapped back to a sorted ``int64`` index array. It must make
    exactly ``num_clients`` partitions, disjoint (a sample may be in none).
    """
    cls_name = name.removeprefix(FLWR_PREFIX)
    try:
        import datasets
        from flwr_datasets import partitioner as flwr_partitioner
    except ImportError as exc:
        raise PartitionError(
            f"partition.name = {name} needs flwr-datasets, which is not installed; "
            "pip install hyperfed[flwr-datasets]"
        ) from exc
    known = sorted(
        n
        for n in getattr(flwr_partitioner, "__all__", [])
        if n != "Partitioner" and not n.startswith("Vertical")  # those split columns, not rows
    )
    if cls_name not in known:
        raise PartitionError(
            f"unknown flwr-datasets partitioner {cls_name!r}; choose one of "
            f"{', '.join(FLWR_PREFIX + n for n in known)}"
        )
    cls = getattr(flwr_partitioner, cls_name)
    y = _as_labels(labels)
    params = inspect.signature(cls).parameters
    given = dict(args or {})
    for key, where in _FLWR_OWN.items():
        if key in given:
            raise PartitionError(f"partition.flwr.{key}: hyperfed sets it from {where}; drop it")
    kwargs = dict(given)
    if "num_partitions" in params:
        kwargs["num_partitions"] = int(num_clients)
    if "seed" in params:
        kwargs["seed"] = int(seed)
    if "partition_by" in params:
        kwargs.setdefault("partition_by", "label")
    columns: dict[str, Any] = {"label": y, "_index": np.arange(y.size, dtype=np.int64)}
    if groups is not None:
        columns["client"] = np.asarray(groups).reshape(-1)
    accepted = [p for p in params if p not in _FLWR_OWN]
    by = kwargs.get("partition_by")
    if by is not None and by not in columns:
        have = "label or client" if groups is not None else "label (this dataset has no writers)"
        raise PartitionError(f"partition.flwr.partition_by = {by!r}: the columns are {have}")
    try:
        part = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PartitionError(
            f"{FLWR_PREFIX}{cls_name}: bad partition.flwr {given} ({exc}); accepted: "
            f"{', '.join(accepted)}"
        ) from exc
    part.dataset = datasets.Dataset.from_dict(columns)
    try:
        made = int(part.num_partitions)
        parts = [
            # numpy format: np.asarray(partition["_index"]) would convert element by element
            np.sort(np.asarray(part.load_partition(i).with_format("numpy")[:]["_index"])).astype(
                np.int64
            )
            for i in range(min(made, num_clients))
        ]
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise PartitionError(f"{FLWR_PREFIX}{cls_name} with {given}: {exc}") from exc
    if made != num_clients:
        raise PartitionError(
            f"{FLWR_PREFIX}{cls_name} made {made} partitions but clients.count = "
            f"{num_clients}; make them agree"
        )
    if parts:
        used = np.bincount(np.concatenate(parts), minlength=y.size)
        if used.size and int(used.max()) > 1:
            raise PartitionError(
                f"{FLWR_PREFIX}{cls_name} put {int((used > 1).sum())} samples in more than one "
                "partition; hyperfed needs disjoint clients"
            )
    return parts


@dataclass
class ClientSplit:
    """One client's sample indices (into the pooled dataset) for training, validation, test."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def __len__(self) -> int:
        return int(self.train.size + self.val.size + self.test.size)


def _round(x: float) -> int:
    return int(np.floor(x + 0.5))


def split_clients(
    parts: Sequence[np.ndarray],
    labels: np.ndarray,
    *,
    test_fraction: float = 0.25,
    val_fraction: float = 0.0,
    seed: int = 0,
) -> list[ClientSplit]:
    """Split each client's samples into train / val / test, stratified by label.

    Sizes for a client with ``n`` samples: ``n_test = round(n * test_fraction)`` clamped to
    ``[1, n - 1]``; ``n_val = round(n * val_fraction)``, at least 1 when ``val_fraction > 0``
    and ``n >= 3``, and never so large that train would be empty; ``n_train`` is the rest
    (always >= 1).  So every client has >= 1 train and >= 1 test sample; a client with fewer than
    2 samples is a :class:`PartitionError`.  Defaults give the 75/25 split of MH-pFedHN;
    ``test_fraction=0.1, val_fraction=0.1`` gives 8:1:1.

    Stratification: within a client the samples of each class are shuffled and laid out at evenly
    spaced positions (random phase per class); test takes the first ``n_test`` of that order, val
    the next ``n_val``, train the rest — each class is spread across the splits in proportion
    (up to rounding).  Client ``i`` uses ``default_rng([seed, i])``, so results are deterministic
    and do not depend on the other clients.
    """
    y = _as_labels(labels)
    if not 0.0 < test_fraction < 1.0:
        raise PartitionError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if not 0.0 <= val_fraction < 1.0 or test_fraction + val_fraction >= 1.0:
        raise PartitionError(
            f"val_fraction must be in [0, 1) with test_fraction + val_fraction < 1, "
            f"got {val_fraction} + {test_fraction}"
        )
    out: list[ClientSplit] = []
    for i, part in enumerate(parts):
        idx = np.asarray(part, dtype=np.int64).reshape(-1)
        n = int(idx.size)
        if n < 2:
            raise PartitionError(
                f"client {i} has {n} sample(s); it needs >= 2 for non-empty train and test splits"
            )
        if int(idx.min()) < 0 or int(idx.max()) >= y.size:
            raise PartitionError(f"client {i} has indices outside 0..{y.size - 1}")
        n_test = min(max(_round(n * test_fraction), 1), n - 1)
        n_val = _round(n * val_fraction)
        if val_fraction > 0 and n >= 3:
            n_val = max(n_val, 1)
        n_val = min(n_val, n - n_test - 1)

        rng = np.random.default_rng([int(seed), i])
        yi = y[idx]
        key = np.empty(n, dtype=np.float64)
        for c in np.unique(yi):
            members = np.flatnonzero(yi == c)
            members = members[rng.permutation(members.size)]
            key[members] = (np.arange(members.size) + rng.random()) / members.size
        order = np.lexsort((rng.random(n), key))
        test = np.sort(idx[order[:n_test]])
        val = np.sort(idx[order[n_test : n_test + n_val]])
        train = np.sort(idx[order[n_test + n_val :]])
        out.append(ClientSplit(train=train, val=val, test=test))
    return out


def client_label_counts(
    parts: Sequence[np.ndarray], labels: np.ndarray, num_classes: int | None = None
) -> np.ndarray:
    """``[num_clients, num_classes]`` matrix of how many samples of each class each client has."""
    y = _as_labels(labels)
    c = int(num_classes) if num_classes is not None else (int(y.max()) + 1 if y.size else 0)
    out = np.zeros((len(parts), c), dtype=np.int64)
    for i, part in enumerate(parts):
        if len(part):
            out[i] = np.bincount(y[np.asarray(part, dtype=np.int64)], minlength=c)[:c]
    return out
