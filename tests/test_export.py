"""``hyperfed export`` (issue 35): a config's federation written for PFLlib, FL-bench and the npz
reader holds exactly each client's train / val / test samples of the federation `run` builds."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import SMALL, assert_one_line_error, invoke, sets

from hyperfed.config import load_config
from hyperfed.data.federated import FederatedData
from hyperfed.data.partition import PartitionError
from hyperfed.data.sources import DataError, load_dataset
from hyperfed.export import export_federation
from hyperfed.runtime.simulate import load_federation

SPLITS = ("train", "val", "test")
SETTINGS = [*SMALL, "partition.val_fraction=0.2", "seed=3"]


@pytest.fixture(scope="module")
def built() -> tuple[object, FederatedData]:
    cfg = load_config(None, SETTINGS)
    return cfg, load_federation(cfg, torch.device("cpu"))


def _idx(data: FederatedData, split: str, c: int) -> torch.Tensor:
    return getattr(data, f"{split}_idx")[c]


def _expected_inputs(data: FederatedData, idx: torch.Tensor) -> np.ndarray:
    """The model's inputs computed here from the raw uint8 pixels: (x / 255 - mean) / std."""
    x = data.x[idx].numpy().astype(np.float64) / 255.0
    mean = data.mean.numpy().astype(np.float64)[None, :, None, None]
    std = data.std.numpy().astype(np.float64)[None, :, None, None]
    return (x - mean) / std


def test_npz_round_trip_gives_the_same_client_tensors(tmp_path: Path, built) -> None:
    cfg, data = built
    export_federation(data, tmp_path / "e", "npz", config=cfg)
    back = load_federation(load_config(tmp_path / "e" / "hyperfed.toml"), torch.device("cpu"))
    assert back.num_clients == data.num_clients == 3
    assert back.num_classes == data.num_classes and back.input_shape == data.input_shape
    for c in range(data.num_clients):
        assert _idx(data, "val", c).numel() > 0  # the val split travels too
        for split in SPLITS:
            a, b = _idx(data, split, c), _idx(back, split, c)
            assert torch.equal(back.x[b], data.x[a]), (c, split)
            assert back.x.dtype == torch.uint8
            assert torch.equal(back.y[b], data.y[a]), (c, split)
            # same normalization as the run (not the statistics of the exported subset)
            assert torch.equal(back.features(b), data.features(a)), (c, split)


def test_pfllib_files_hold_each_clients_samples(tmp_path: Path, built) -> None:
    cfg, data = built
    export_federation(data, tmp_path, "pfllib", config=cfg)
    for c in range(data.num_clients):
        for split in SPLITS:
            with open(tmp_path / split / f"{c}.npz", "rb") as f:  # as PFLlib's read_data does
                got = np.load(f, allow_pickle=True)["data"].tolist()
            idx = _idx(data, split, c)
            assert got["x"].dtype == np.float32 and got["x"].shape == (idx.numel(), 1, 8, 8)
            np.testing.assert_allclose(got["x"], _expected_inputs(data, idx), atol=1e-5)
            np.testing.assert_array_equal(got["y"], data.y[idx].numpy())
            assert got["y"].dtype == np.int64
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["0.npz", "1.npz", "2.npz"]
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["num_clients"] == 3 and conf["num_classes"] == 10
    counts = data.label_counts()
    for c, pairs in enumerate(conf["Size of samples for labels in clients"]):
        assert {k: n for k, n in pairs} == {k: int(n) for k, n in enumerate(counts[c]) if n}
    assert "val/<id>.npz" in (tmp_path / "README.txt").read_text()


def test_flbench_files_hold_each_clients_samples(tmp_path: Path, built) -> None:
    cfg, data = built
    export_federation(data, tmp_path, "flbench", config=cfg)
    x = np.load(tmp_path / "data.npy")
    y = np.load(tmp_path / "targets.npy")
    with open(tmp_path / "partition.pkl", "rb") as f:
        part = pickle.load(f)
    assert part["separation"] == {"train": [0, 1, 2], "val": [0, 1, 2], "test": [0, 1, 2]} | {
        "total": 3
    }
    assert x.dtype == np.float32 and x.shape[1:] == (1, 8, 8) and len(part["data_indices"]) == 3
    rows = []
    for c, mine in enumerate(part["data_indices"]):
        assert set(mine) == set(SPLITS)
        for split in SPLITS:
            idx = _idx(data, split, c)
            np.testing.assert_allclose(x[mine[split]], _expected_inputs(data, idx), atol=1e-5)
            np.testing.assert_array_equal(y[mine[split]], data.y[idx].numpy())
            rows.append(mine[split])
    # every row belongs to exactly one client's split
    np.testing.assert_array_equal(np.sort(np.concatenate(rows)), np.arange(len(y)))
    args = json.loads((tmp_path / "args.json").read_text())
    assert (args["client_num"], args["dimension"], args["class_num"]) == (3, 64, 10)


def test_cli_export_and_its_bad_input(tmp_path: Path) -> None:
    out = tmp_path / "pf"
    result = invoke("export", "--format", "pfllib", "--out", str(out), *sets(SETTINGS))
    assert result.exit_code == 0, result.output
    assert (out / "train" / "2.npz").is_file() and (out / "config.json").is_file()
    # unknown format: one line, nothing written
    assert_one_line_error(
        ["export", "--format", "leaf", "--out", str(tmp_path / "x")], "leaf", "pfllib"
    )
    assert not (tmp_path / "x").exists()
    # a non-empty folder without --force: refused, left as it was
    keep = tmp_path / "busy"
    keep.mkdir()
    (keep / "mine.txt").write_text("keep me")
    args = ["export", "--format", "npz", "--out", str(keep), *sets(SETTINGS)]
    assert_one_line_error(args, "not empty", "--force")
    assert [p.name for p in keep.iterdir()] == ["mine.txt"]
    # a config error: nothing written either
    assert_one_line_error([*args[:4], str(tmp_path / "y"), "--set", "clients.count=0"], "count")
    assert not (tmp_path / "y").exists()
    # --force writes the export's files beside the others
    assert invoke(*args, "--force").exit_code == 0
    assert sorted(p.name for p in keep.iterdir()) == [
        "README.txt",
        "data.npz",
        "hyperfed.toml",
        "mine.txt",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_npz_split_array_is_checked_and_kept(tmp_path: Path) -> None:
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    y = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    client = np.array([1, 1, 1, 1, 0, 0, 0, 0])
    split = np.array(["test", "train", "val", "train", "train", "test", "train", "train"])
    np.savez(tmp_path / "d.npz", x=x, y=y, client=client, split=split)
    cfg = load_config(
        None,
        ["dataset.name=npz", f"dataset.path={tmp_path / 'd.npz'}", "partition.name=natural"]
        + ["clients.count=2", "clients.models=mlp", "device=cpu"],
    )
    data = load_federation(cfg, torch.device("cpu"))
    # client 0 = id 0 (samples 4..7), client 1 = id 1 (samples 0..3); splits as given
    assert [t.tolist() for t in data.train_idx] == [[4, 6, 7], [1, 3]]
    assert [t.tolist() for t in data.val_idx] == [[], [2]]
    assert [t.tolist() for t in data.test_idx] == [[5], [0]]
    np.savez(tmp_path / "d.npz", x=x, y=y, client=client, split=np.where(split == "test", 1, 0))
    with pytest.raises(PartitionError, match="0 test"):
        load_federation(cfg, torch.device("cpu"))
    np.savez(tmp_path / "n.npz", x=x, y=y, split=np.zeros(8))
    with pytest.raises(DataError, match="no client"):
        load_dataset("npz", path=tmp_path / "n.npz")
    np.savez(tmp_path / "b.npz", x=x, y=y, client=client, split=np.array(["tr"] * 8))
    with pytest.raises(DataError, match="'tr'"):
        load_dataset("npz", path=tmp_path / "b.npz")
