"""Write a federation's per-client samples for other libraries (``hyperfed export``).

The federation is the one ``hyperfed run`` trains on (the command line builds it with
:func:`hyperfed.runtime.simulate.load_federation`: same seed, subsample, partition and
per-client train / val / test split); this module only writes it, in one of :data:`FORMATS`:

``pfllib``
    TsingZ0/PFLlib's layout: ``train/<id>.npz``, ``test/<id>.npz`` (and ``val/<id>.npz``,
    which PFLlib does not read), each holding ``data = {"x": ..., "y": ...}`` as PFLlib's
    ``read_data`` loads it (``np.load(f, allow_pickle=True)["data"].tolist()``), plus the
    ``config.json`` PFLlib's dataset generators write.
``flbench``
    KarhouTam/FL-bench's layout: ``data.npy`` and ``targets.npy`` (every client's samples, one
    block per client), ``partition.pkl`` (``separation`` and ``data_indices``: one
    ``{"train", "val", "test"}`` dict of row indices per client, as its ``generate_data.py``
    writes), ``args.json`` and ``all_stats.json``.
``npz``
    hyperfed's own ``dataset.name = "npz"`` reader: ``data.npz`` with the raw samples ``x``
    (uint8 images stay uint8), ``y``, a ``client`` id and a ``split`` code (0 train, 1 val,
    2 test) per sample and the normalization ``mean`` / ``std``, plus ``hyperfed.toml``: the
    config with ``dataset`` pointing at it and ``partition.name = "natural"``, which rebuilds
    exactly the same per-client tensors.

For PFLlib and FL-bench the inputs are written as the model sees them in hyperfed: float32,
``[N, C, H, W]`` images normalized with the dataset's per-channel mean / std (PFLlib's own
generators also store normalized float ``N x C x H x W`` tensors; FL-bench's ``synthetic``
slot reads ``data.npy`` as float, but divides it by 255 when its maximum is above 1: remove
that division on FL-bench's side, docs/export.md); vector
data (``synthetic``) is float32 ``[N, D]``. Labels are int64.

Nothing is written unless everything is: the files are made in a temporary folder beside the
target and moved in at the end; a non-empty target needs ``force`` (then the files and folders
the export writes replace those of the same name; anything else there is left alone).
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hyperfed.data.federated import FederatedData
from hyperfed.errors import HyperfedError

FORMATS = ("pfllib", "flbench", "npz")
SPLITS = ("train", "val", "test")  # the order of each client's block in flbench / npz rows

Progress = Callable[[int, int], None]  # (clients written, clients in all)


class ExportError(HyperfedError, ValueError):
    """A bad ``--format`` or ``--out`` (one line; raised before anything is written)."""


def check_target(out: Path, fmt: str, force: bool = False) -> None:
    """Refuse an unknown format, a file as ``out``, or a non-empty ``out`` without ``force``."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: unknown format; allowed: {', '.join(FORMATS)}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; choose a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(
            f"--out {out} is not empty; choose another folder, or --force to replace the "
            "files the export writes there"
        )


def export_federation(
    data: FederatedData,
    out: str | Path,
    fmt: str,
    *,
    config: Any = None,
    force: bool = False,
    progress: Progress | None = None,
) -> list[str]:
    """Write ``data``'s clients to ``out`` in format ``fmt``; returns the names written there.

    ``config`` (the :class:`~hyperfed.config.ExperimentConfig` that built ``data``) fills the
    metadata files (seed, partition, batch size) and, for ``npz``, ``hyperfed.toml``."""
    out = Path(out)
    check_target(out, fmt, force)
    data = data.to("cpu")
    try:
        return _write_export(data, out, fmt, config, progress)
    except OSError as e:  # an unwritable or missing place, a full disk: nothing kept of it
        why = e.strerror or str(e)
        raise ExportError(f"--out {out}: cannot write the export there ({why})") from None


def _write_export(
    data: FederatedData, out: Path, fmt: str, config: Any, progress: Progress | None
) -> list[str]:
    """Write into a temp folder beside ``out``, then move the files into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        writer = {"pfllib": _write_pfllib, "flbench": _write_flbench, "npz": _write_npz}[fmt]
        writer(data, tmp, config, progress or (lambda done, total: None))
        if fmt == "npz" and config is not None:
            path = out.absolute() / "data.npz"
            (tmp / "hyperfed.toml").write_text(reload_config(config, path, data.num_classes))
        (tmp / "README.txt").write_text(_readme(fmt, data, out))
        out.mkdir(exist_ok=True)
        names = sorted(p.name for p in tmp.iterdir())
        for name in names:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            (tmp / name).rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


# --------------------------------------------------------------------------------------------
# what every format writes: each client's samples, split by split
# --------------------------------------------------------------------------------------------


def client_indices(data: FederatedData, client: int) -> dict[str, Tensor]:
    """``{"train", "val", "test"}``: the client's indices into ``data.x`` (as the run uses)."""
    return {
        "train": data.train_idx[client],
        "val": data.val_idx[client],
        "test": data.test_idx[client],
    }


def model_inputs(data: FederatedData, idx: Tensor) -> np.ndarray:
    """float32 inputs exactly as a hyperfed model sees them (normalized images, vectors)."""
    return data.features(idx).to(torch.float32).numpy()


def _labels(data: FederatedData, idx: Tensor) -> np.ndarray:
    return data.y[idx].to(torch.int64).numpy()


def _label_counts(data: FederatedData, client: int) -> dict[int, int]:
    y = torch.cat(list(client_indices(data, client).values()))
    counts = np.bincount(_labels(data, y), minlength=data.num_classes)
    return {int(c): int(n) for c, n in enumerate(counts) if n}


def _settings(data: FederatedData, config: Any) -> dict[str, Any]:
    """What the metadata files record about how the federation was built."""
    info: dict[str, Any] = {
        "dataset": data.name,
        "num_clients": data.num_clients,
        "num_classes": data.num_classes,
        "input_shape": list(data.input_shape),
        "mean": [float(v) for v in data.mean.tolist()],
        "std": [float(v) for v in data.std.tolist()],
        "splits": {s: [int(t.numel()) for t in getattr(data, f"{s}_idx")] for s in SPLITS},
    }
    if config is not None:
        info.update(
            seed=config.seed,
            partition=config.partition.model_dump(exclude_none=True),
            subsample=config.dataset.subsample,
            batch_size=config.local.batch_size,
        )
    return info


def _save_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# PFLlib: train/<id>.npz, test/<id>.npz (+ val/<id>.npz), config.json
# --------------------------------------------------------------------------------------------


def _write_pfllib(data: FederatedData, root: Path, config: Any, progress: Progress) -> None:
    for split in SPLITS:
        (root / split).mkdir()
    for c in range(data.num_clients):
        for split, idx in client_indices(data, c).items():
            arrays = {"x": model_inputs(data, idx), "y": _labels(data, idx)}
            with open(root / split / f"{c}.npz", "wb") as f:
                np.savez_compressed(f, data=arrays)  # type: ignore[arg-type]
        progress(c + 1, data.num_clients)
    info = _settings(data, config)
    partition = info.get("partition", {}).get("name", "")
    # the keys PFLlib's generators write (its check() compares them), then ours
    _save_json(
        root / "config.json",
        {
            "num_clients": data.num_clients,
            "num_classes": data.num_classes,
            "non_iid": partition != "iid",
            "balance": False,
            "partition": partition,
            "Size of samples for labels in clients": [
                [[c, n] for c, n in _label_counts(data, i).items()] for i in range(data.num_clients)
            ],
            "alpha": info.get("partition", {}).get("alpha"),
            "batch_size": info.get("batch_size"),
            "hyperfed": info,
        },
    )


# --------------------------------------------------------------------------------------------
# FL-bench: data.npy, targets.npy, partition.pkl, args.json, all_stats.json
# --------------------------------------------------------------------------------------------


def _rows(data: FederatedData) -> tuple[Tensor, list[dict[str, np.ndarray]]]:
    """All clients' samples as one block per client (train, val, test in turn): the indices
    into ``data.x`` of every row, and each client's row ranges per split."""
    order: list[Tensor] = []
    ranges: list[dict[str, np.ndarray]] = []
    start = 0
    for c in range(data.num_clients):
        mine: dict[str, np.ndarray] = {}
        for split, idx in client_indices(data, c).items():
            mine[split] = np.arange(start, start + idx.numel(), dtype=np.int64)
            order.append(idx)
            start += idx.numel()
        ranges.append(mine)
    rows = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    return rows, ranges


def _write_flbench(data: FederatedData, root: Path, config: Any, progress: Progress) -> None:
    rows, ranges = _rows(data)
    shape = (int(rows.numel()), *data.input_shape)
    x = np.lib.format.open_memmap(root / "data.npy", mode="w+", dtype=np.float32, shape=shape)
    lo = 0
    for c, mine in enumerate(ranges):
        hi = lo + sum(r.size for r in mine.values())
        x[lo:hi] = model_inputs(data, rows[lo:hi])
        lo = hi
        progress(c + 1, data.num_clients)
    x.flush()
    del x
    np.save(root / "targets.npy", _labels(data, rows))
    clients = list(range(data.num_clients))
    partition = {
        "separation": {"train": clients, "val": clients, "test": clients, "total": len(clients)},
        "data_indices": ranges,
    }
    with open(root / "partition.pkl", "wb") as f:
        pickle.dump(partition, f)
    info = _settings(data, config)
    part = info.get("partition", {})
    _save_json(
        root / "args.json",
        {
            "client_num": data.num_clients,
            "test_ratio": part.get("test_fraction"),
            "val_ratio": part.get("val_fraction"),
            "seed": info.get("seed"),
            "split": "sample",
            "IID_ratio": 1.0 if part.get("name") == "iid" else 0.0,
            "monitor_window_name_suffix": f"hyperfed-{data.name}-{data.num_clients}clients",
            # FL-bench's "synthetic" slot reads its input size and classes from these two
            "dimension": math.prod(data.input_shape),
            "class_num": data.num_classes,
            "hyperfed": info,
        },
    )
    stats: dict[str, Any] = {
        str(c): {"x": int(sum(r.size for r in mine.values())), "y": _label_counts(data, c)}
        for c, mine in enumerate(ranges)
    }
    _save_json(root / "all_stats.json", stats)


# --------------------------------------------------------------------------------------------
# npz: data.npz for dataset.name = "npz" and the hyperfed.toml that reads it back
# --------------------------------------------------------------------------------------------


def _write_npz(data: FederatedData, root: Path, config: Any, progress: Progress) -> None:
    rows, ranges = _rows(data)
    client = np.concatenate(
        [np.full(sum(r.size for r in mine.values()), c) for c, mine in enumerate(ranges)]
        or [np.zeros(0)]
    ).astype(np.int64)
    split = np.concatenate(
        [np.full(mine[s].size, k) for mine in ranges for k, s in enumerate(SPLITS)] or [np.zeros(0)]
    ).astype(np.int8)
    arrays: dict[str, np.ndarray] = {
        "x": data.x[rows].numpy(),
        "y": _labels(data, rows),
        "client": client,
        "split": split,
    }
    if data.mean.numel():  # images: the run's normalization, not the exported subset's
        arrays["mean"] = data.mean.to(torch.float64).numpy()
        arrays["std"] = data.std.to(torch.float64).numpy()
    np.savez_compressed(root / "data.npz", **arrays)  # type: ignore[arg-type]
    progress(data.num_clients, data.num_clients)


def reload_config(config: Any, path: Path, num_classes: int | None = None) -> str:
    """``config`` as TOML with its dataset replaced by the exported ``data.npz`` at ``path``
    (natural partition: the exported clients and splits, in order)."""
    from hyperfed.config import config_from_dict, to_toml

    raw = config.model_dump(exclude_none=True)
    options: dict[str, Any] = {}
    if num_classes is not None:
        options["num_classes"] = num_classes
    raw["dataset"] = {"name": "npz", "path": str(path), **({"options": options} if options else {})}
    raw["partition"] = {**raw["partition"], "name": "natural"}
    raw["partition"].pop("flwr", None)
    return to_toml(config_from_dict(raw))


def _readme(fmt: str, data: FederatedData, out: Path) -> str:
    sizes = {s: sum(int(t.numel()) for t in getattr(data, f"{s}_idx")) for s in SPLITS}
    head = (
        f"Written by `hyperfed export --format {fmt}`: {data.name}, {data.num_clients} clients, "
        f"{data.num_classes} classes, input shape {list(data.input_shape)}; "
        f"{sizes['train']} train / {sizes['val']} val / {sizes['test']} test samples, each "
        "client's exactly as `hyperfed run` splits them with the same config.\n\n"
    )
    floats = (
        "Inputs: float32 images N x C x H x W, scaled to [0, 1] and normalized with the "
        "dataset's per-channel mean / std (recorded under 'hyperfed' in config.json / "
        "args.json); labels int64.\n"
        if data.mean.numel()
        else "Inputs: float32 vectors N x D, as the dataset holds them; labels int64.\n"
    )
    if fmt == "pfllib":
        return (
            head
            + floats
            + (
                "train/<id>.npz, test/<id>.npz: PFLlib's files (np.load(f, allow_pickle=True)"
                "['data'].tolist() -> {'x', 'y'}).\n"
                "val/<id>.npz: each client's validation split, same format; PFLlib does not read "
                "it.\nconfig.json: as PFLlib's generators write it.\n"
                f"Use: copy this folder to PFLlib/dataset/<NAME> and run from PFLlib/system: "
                f"python main.py -data <NAME> -nc {data.num_clients} -ncl {data.num_classes} ...\n"
            )
        )
    if fmt == "flbench":
        return (
            head
            + floats
            + (
                "data.npy, targets.npy: every client's samples, one block per client (train, val, "
                "test in turn).\npartition.pkl: {'separation', 'data_indices'}; data_indices[i] = "
                "{'train', 'val', 'test'}: client i's row indices into data.npy. The validation "
                "split is data_indices[i]['val'].\nargs.json: FL-bench's dataset arguments "
                "(dimension and class_num for its 'synthetic' slot).\n"
                "Use: copy these files to FL-bench/data/synthetic and run "
                "python main.py dataset.name=synthetic model.name=2nn (or a slot whose input shape "
                "matches; see docs/export.md).\nTrap: FL-bench divides data.npy by 255 when its "
                "maximum is above 1, which these normalized inputs are: remove that division in "
                "your FL-bench copy first (docs/export.md).\n"
            )
        )
    return head + (
        "data.npz: x (the raw samples: uint8 images as stored, or float32 vectors), y, client "
        "(id per sample), split (0 train, 1 val, 2 test), mean / std (the run's "
        "normalization).\nhyperfed.toml: the config reading it back (dataset.name = npz, "
        f"partition.name = natural).\nUse: hyperfed run -c {out / 'hyperfed.toml'}\n"
    )
