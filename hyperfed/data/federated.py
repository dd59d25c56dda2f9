"""Per-client data kept on the device, indexed instead of loaded.

All samples (train and test pooled, as the papers partition the whole dataset) live in one
tensor ``x`` -- uint8 images stay uint8 on the device and are normalized per batch -- and
each client holds index tensors into it. A batch for many clients is one gather
``x[idx]`` with ``idx`` of shape ``[clients, batch]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hyperfed.data.partition import (
    FLWR_PREFIX,
    ClientSplit,
    PartitionError,
    client_label_counts,
    flwr_partition,
    partition_labels,
    split_clients,
)
from hyperfed.data.sources import ArrayDataset


@dataclass
class FederatedData:
    x: Tensor  # [N, ...] uint8 images or float32 vectors, on the device
    y: Tensor  # [N] int64
    train_idx: list[Tensor]  # per client, indices into x
    val_idx: list[Tensor]
    test_idx: list[Tensor]
    num_classes: int
    input_shape: tuple[int, ...]
    mean: Tensor
    std: Tensor
    name: str = ""
    dtype: torch.dtype = torch.float32  # of the normalized inputs (float64 in precision tests)

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    @property
    def train_sizes(self) -> list[int]:
        return [int(t.numel()) for t in self.train_idx]

    @property
    def test_sizes(self) -> list[int]:
        return [int(t.numel()) for t in self.test_idx]

    def features(self, idx: Tensor) -> Tensor:
        """Normalized float inputs for global indices ``idx`` (any shape)."""
        x = self.x[idx]
        if x.dtype == torch.uint8:
            x = x.to(self.dtype).div_(255.0)
            if self.mean.numel():
                shape = [1] * (x.dim() - 3) + [-1, 1, 1]
                x = (x - self.mean.view(shape).to(x.dtype)) / self.std.view(shape).to(x.dtype)
        return x

    def pixels(self, x: Tensor) -> Tensor:
        """Normalized images ``[..., C, H, W]`` (from :meth:`features`) back in [0, 1]."""
        if self.mean.numel():
            shape = [1] * (x.dim() - 3) + [-1, 1, 1]
            x = x * self.std.view(shape).to(x) + self.mean.view(shape).to(x)
        return x.clamp(0, 1)

    def label_counts(self) -> np.ndarray:
        """``[clients, classes]``: how many samples of each class each client holds (its
        train, val and test splits together), as the partition dealt them."""
        parts = [
            torch.cat([t.cpu(), v.cpu(), s.cpu()]).numpy()
            for t, v, s in zip(self.train_idx, self.val_idx, self.test_idx)
        ]
        return client_label_counts(parts, self.y.cpu().numpy(), self.num_classes)

    def batch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        return self.features(idx), self.y[idx]

    def only(self, clients: list[int]) -> FederatedData:
        """The same federation holding only ``clients``' samples (a Flower node keeps its own
        client's data, not the pool): ``x``/``y`` compacted to their train/val/test samples,
        their indices remapped, every other client's index lists empty."""
        keep = sorted(set(clients))
        parts = [t for c in keep for t in (self.train_idx[c], self.val_idx[c], self.test_idx[c])]
        rows = torch.cat(parts).unique() if parts else torch.zeros(0, dtype=torch.long)
        remap = torch.full((self.x.shape[0],), -1, dtype=torch.long, device=rows.device)
        remap[rows] = torch.arange(rows.numel(), device=rows.device)
        empty = rows.new_zeros(0)

        def mine(idx: list[Tensor]) -> list[Tensor]:
            return [remap[t] if c in keep else empty for c, t in enumerate(idx)]

        return FederatedData(
            self.x[rows].clone(),
            self.y[rows].clone(),
            mine(self.train_idx),
            mine(self.val_idx),
            mine(self.test_idx),
            self.num_classes,
            self.input_shape,
            self.mean,
            self.std,
            self.name,
            self.dtype,
        )

    def to(self, device: torch.device | str) -> FederatedData:
        mv = lambda ts: [t.to(device) for t in ts]  # noqa: E731
        return FederatedData(
            self.x.to(device),
            self.y.to(device),
            mv(self.train_idx),
            mv(self.val_idx),
            mv(self.test_idx),
            self.num_classes,
            self.input_shape,
            self.mean.to(device),
            self.std.to(device),
            self.name,
            self.dtype,
        )


def fixed_splits(parts: list[np.ndarray], split: np.ndarray) -> list[ClientSplit]:
    """Each client's train / val / test as ``split`` (0 / 1 / 2 per pooled sample) gives them,
    in the order of ``parts`` (an npz written by ``hyperfed export``)."""
    out = []
    for i, part in enumerate(parts):
        s = split[part]
        cs = ClientSplit(train=part[s == 0], val=part[s == 1], test=part[s == 2])
        if not cs.train.size or not cs.test.size:
            raise PartitionError(
                f"client {i}: the dataset's split array gives it {cs.train.size} train and "
                f"{cs.test.size} test samples; every client needs >= 1 of each"
            )
        out.append(cs)
    return out


def federate(
    ds: ArrayDataset,
    num_clients: int,
    scheme: str,
    *,
    classes_per_client: int = 2,
    alpha: float = 0.5,
    flwr_args: dict[str, Any] | None = None,
    test_fraction: float = 0.25,
    val_fraction: float = 0.0,
    seed: int = 0,
    subsample: int | None = None,
    device: torch.device | str = "cpu",
) -> FederatedData:
    """Pool train+test, partition among clients, split each client's share (seed 000 §4.1).

    ``scheme`` is a :data:`~hyperfed.data.partition.PARTITIONS` name, ``"natural"`` (the
    dataset's own writers / users: the first ``num_clients`` of them, in id order) or
    ``"flwr:<Partitioner>"`` with its keyword arguments in ``flwr_args``. ``subsample`` keeps
    a uniformly drawn subset of that many pooled samples first (CPU-sized variants of the
    paper settings)."""
    x = np.concatenate([ds.x_train, ds.x_test])
    y = np.concatenate([ds.y_train, ds.y_test]).astype(np.int64)
    natural = getattr(ds, "natural_partition", None)
    writers: np.ndarray | None = None  # the writer of each pooled sample (-1: none)
    if natural is not None:
        writers = np.full(len(y), -1, dtype=np.int64)
        for w, p in enumerate(natural):
            writers[np.asarray(p, dtype=np.int64)] = w
    if subsample is not None and subsample < len(y):
        if scheme == "natural":
            raise ValueError("dataset.subsample cannot be combined with the natural partition")
        keep = np.sort(np.random.default_rng([seed, 17]).choice(len(y), subsample, replace=False))
        x, y = x[keep], y[keep]
        writers = writers[keep] if writers is not None else None
    if scheme == "natural" and natural is None:
        raise PartitionError(
            f"partition.name = natural: {ds.name} has no per-writer split (synthetic has one; "
            "so has an npz file with a client array, or hf_disk with a client column); choose "
            "quantity, dirichlet, pathological or iid"
        )
    if natural is not None and scheme == "natural":
        if len(natural) < num_clients:
            raise PartitionError(
                f"partition.name = natural: {ds.name} has {len(natural)} writers but "
                f"clients.count = {num_clients}; set clients.count <= {len(natural)}"
            )
        parts = [np.asarray(p) for p in natural][:num_clients]
    elif scheme.startswith(FLWR_PREFIX):
        parts = flwr_partition(y, num_clients, scheme, flwr_args, seed=seed, groups=writers)
    else:
        parts = partition_labels(
            y, num_clients, scheme, classes_per_client=classes_per_client, alpha=alpha, seed=seed
        )
    fixed = getattr(ds, "natural_split", None)
    if scheme == "natural" and fixed is not None:  # npz with a split array: kept as given
        splits = fixed_splits(parts, np.asarray(fixed))
    else:
        splits = split_clients(
            parts, y, test_fraction=test_fraction, val_fraction=val_fraction, seed=seed
        )
    as_t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64))  # noqa: E731
    data = FederatedData(
        x=torch.from_numpy(np.ascontiguousarray(x)),
        y=torch.from_numpy(y),
        train_idx=[as_t(s.train) for s in splits],
        val_idx=[as_t(s.val) for s in splits],
        test_idx=[as_t(s.test) for s in splits],
        num_classes=ds.num_classes,
        input_shape=tuple(ds.x_train.shape[1:]),
        mean=torch.tensor(ds.mean, dtype=torch.float32),
        std=torch.tensor(ds.std, dtype=torch.float32),
        name=ds.name,
    )
    return data.to(device)
