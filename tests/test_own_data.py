"""Your own data (issue 28): folder / npz / hf_disk loaders, flwr-datasets partitioners, the
natural (per-writer) partition of an npz file, and the label-distribution plot of a run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke, sets

from hyperfed.config import ConfigError, load_config
from hyperfed.data.federated import federate
from hyperfed.data.partition import PartitionError, client_label_counts, flwr_partition
from hyperfed.data.sources import DataError, load_dataset
from hyperfed.report import LABEL_PLOT, plot_label_distribution

# ------------------------------------------------------------------------------------ npz


def test_npz_images_channels_last_and_string_labels(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(12, 6, 5, 3), dtype=np.uint8)  # [N, H, W, C]
    y = np.array(["dog", "cat", "emu"] * 4)
    x_test = rng.integers(0, 256, size=(3, 6, 5, 3), dtype=np.uint8)
    y_test = np.array(["emu", "cat", "cat"])
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=x_test, y_test=y_test)
    ds = load_dataset("npz", path=tmp_path / "d.npz")
    assert ds.x_train.shape == (12, 3, 6, 5) and ds.x_train.dtype == np.uint8
    np.testing.assert_array_equal(ds.x_train, x.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(ds.x_test, x_test.transpose(0, 3, 1, 2))
    # classes are the sorted distinct values: cat=0, dog=1, emu=2
    np.testing.assert_array_equal(ds.y_train, [1, 0, 2] * 4)
    np.testing.assert_array_equal(ds.y_test, [2, 0, 0])
    assert ds.num_classes == 3
    np.testing.assert_allclose(ds.mean, (x / 255.0).mean(axis=(0, 1, 2)), rtol=1e-6)
    assert ds.natural_partition is None


def test_npy_folder_float_images_and_vectors(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    grey = rng.random((10, 4, 4))  # floats in [0, 1], [N, H, W]
    np.save(tmp_path / "x.npy", grey)
    np.save(tmp_path / "y.npy", np.arange(10) % 4)
    ds = load_dataset("npz", path=tmp_path)
    assert ds.x_train.shape == (10, 1, 4, 4)
    np.testing.assert_array_equal(ds.x_train[:, 0], np.rint(grey * 255).astype(np.uint8))
    assert ds.num_classes == 4 and ds.num_test == 0

    vec = tmp_path / "vec.npz"
    np.savez(vec, x=rng.normal(size=(8, 5)), y=np.arange(8) % 2)
    ds = load_dataset("npz", path=vec)
    assert ds.x_train.dtype == np.float32 and ds.input_shape == (5,) and ds.mean == ()


@pytest.mark.parametrize(
    ("arrays", "words"),
    [
        ({"x": np.zeros((4, 3, 3), np.uint8)}, ["lacks y", "np.savez"]),
        ({"x": np.zeros((4, 3, 3), np.uint8), "y": np.zeros(5)}, ["4 samples", "5"]),
        ({"x": np.full((4, 3, 3), 2.0), "y": np.zeros(4)}, ["float pixels", "[0, 1]"]),
        (
            {"x": np.zeros((4, 3, 3), np.uint8), "y": np.zeros(4), "x_test": np.zeros((1, 3, 3))},
            ["y_test"],
        ),
        (
            {"x": np.zeros((4, 3, 3), np.uint8), "y": np.zeros(4), "client": np.zeros(3)},
            ["client ids cover 3"],
        ),
    ],
)
def test_npz_bad_files_are_one_line_errors(tmp_path: Path, arrays: dict, words: list[str]) -> None:
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError) as err:
        load_dataset("npz", path=tmp_path / "bad.npz")
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_missing_or_wrong_path_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no data given; pass --set dataset.path=FILE.npz"):
        load_dataset("npz")
    with pytest.raises(DataError, match=r"does not exist; pass --set dataset.path="):
        load_dataset("npz", path=tmp_path / "nope.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(DataError, match="holds one array"):
        load_dataset("npz", path=tmp_path / "one.npy")
    with pytest.raises(DataError, match="not a folder"):
        load_dataset("folder", path=tmp_path / "one.npy")
    # through the config: the path is absolute in the run's config.toml, options reach the loader
    cfg = load_config(None, ["dataset.name=npz", f"dataset.path={tmp_path / 'nope.npz'}"])
    assert Path(cfg.dataset.path or "").is_absolute()
    with pytest.raises(DataError, match="does not exist"):
        cfg.dataset.load()
    cfg = load_config(None, ["dataset.name=npz", "dataset.options={colour=1}"])
    with pytest.raises(
        DataError, match=r"bad options \['colour'\].*accepted: \['path', 'num_classes'\]"
    ):
        cfg.dataset.load()


# --------------------------------------------------------------------------------- folder


def _png(path: Path, array: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def test_folder_layout_classes_sorted_and_train_test(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    pix = {}
    for split, n in (("train", 3), ("test", 1)):
        for cls in ("zebra", "ant"):  # written out of order: labels follow the sorted names
            for i in range(n):
                a = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
                pix[(split, cls, i)] = a
                _png(tmp_path / split / cls / f"{i}.png", a)
    (tmp_path / "train" / "ant" / "notes.txt").write_text("not an image")
    ds = load_dataset("folder", path=tmp_path)
    assert ds.num_classes == 2 and ds.x_train.shape == (6, 3, 5, 7)
    np.testing.assert_array_equal(ds.y_train, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(ds.y_test, [0, 1])
    np.testing.assert_array_equal(ds.x_train[3], pix[("train", "zebra", 0)].transpose(2, 0, 1))
    np.testing.assert_array_equal(ds.x_test[0], pix[("test", "ant", 0)].transpose(2, 0, 1))


def test_folder_grey_sizes_and_resize(tmp_path: Path) -> None:
    _png(tmp_path / "a" / "0.png", np.full((4, 4), 10, np.uint8))
    _png(tmp_path / "b" / "0.png", np.full((6, 6), 200, np.uint8))
    with pytest.raises(DataError, match=r"differ in size.*dataset.options.image_size"):
        load_dataset("folder", path=tmp_path)
    ds = load_dataset("folder", path=tmp_path, image_size=[3, 5])
    assert ds.x_train.shape == (2, 1, 3, 5)  # grey stays one channel
    np.testing.assert_array_equal(ds.x_train[:, 0, 0, 0], [10, 200])
    assert ds.num_test == 0
    empty = tmp_path / "empty"
    (empty / "cls").mkdir(parents=True)
    with pytest.raises(DataError, match="no images"):
        load_dataset("folder", path=empty)


# -------------------------------------------------------------------------------- hf_disk


def test_hf_disk_dataset_dict_with_auto_and_named_columns(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rng = np.random.default_rng(3)
    pics = [rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8) for _ in range(8)]
    feats = datasets.Features(
        {"img": datasets.Image(), "kind": datasets.ClassLabel(names=["a", "b", "c", "d"])}
    )
    rows = {"img": [Image.fromarray(p) for p in pics], "kind": [0, 1, 2, 1, 0, 1, 2, 1]}
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({k: v[:6] for k, v in rows.items()}, feats),
            "test": datasets.Dataset.from_dict({k: v[6:] for k, v in rows.items()}, feats),
        }
    )
    dd.save_to_disk(str(tmp_path / "hf"))
    ds = load_dataset("hf_disk", path=tmp_path / "hf")  # columns found by their feature types
    assert ds.num_classes == 4  # from the ClassLabel, not from the labels seen
    np.testing.assert_array_equal(ds.y_train, [0, 1, 2, 1, 0, 1])
    np.testing.assert_array_equal(ds.x_test[1], pics[7].transpose(2, 0, 1))

    plain = datasets.Dataset.from_dict(
        {
            "pix": [p.tolist() for p in pics],
            "tag": [5, 6, 5, 6, 5, 6, 5, 6],
            "who": [0] * 4 + [1] * 4,
        }
    )
    plain.save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(DataError, match=r"which column holds the images.*image_column"):
        load_dataset("hf_disk", path=tmp_path / "plain", label_column="tag")
    ds = load_dataset(
        "hf_disk",
        path=tmp_path / "plain",
        image_column="pix",
        label_column="tag",
        client_column="who",
    )
    np.testing.assert_array_equal(ds.x_train[2], pics[2].transpose(2, 0, 1))
    assert ds.num_classes == 7  # integer labels are kept: classes 0..6
    assert [p.tolist() for p in ds.natural_partition or []] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_hf_disk_without_the_package_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match=r"pip install hyperfed\[hf\]"):
        load_dataset("hf_disk", path=tmp_path)


# ------------------------------------------------------------------- natural (npz writers)


def _writers_npz(path: Path, writers: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(4)
    y = rng.integers(0, 3, size=writers.size)
    np.savez(
        path,
        x=rng.integers(0, 256, size=(writers.size, 1, 4, 4), dtype=np.uint8),
        y=y,
        client=writers,
    )
    return y


def test_natural_partition_follows_the_npz_client_array(tmp_path: Path) -> None:
    writers = np.array(["w7", "w2", "w2", "w9"] * 6)  # 3 writers, ids in no order
    _writers_npz(tmp_path / "w.npz", writers)
    ds = load_dataset("npz", path=tmp_path / "w.npz")
    data = federate(ds, 3, "natural", seed=0)
    for cid, writer in enumerate(["w2", "w7", "w9"]):  # clients follow the sorted ids
        held = np.sort(
            np.concatenate([t.numpy() for t in (data.train_idx[cid], data.test_idx[cid])])
        )
        np.testing.assert_array_equal(held, np.flatnonzero(writers == writer))
    # fewer clients than writers: the first ones; more: a one-line error naming the count
    assert federate(ds, 2, "natural", seed=0).num_clients == 2
    with pytest.raises(PartitionError, match=r"3 writers but clients.count = 4"):
        federate(ds, 4, "natural", seed=0)


def test_natural_needs_client_test_beside_x_test(tmp_path: Path) -> None:
    z = np.zeros((4, 1, 3, 3), np.uint8)
    np.savez(
        tmp_path / "a.npz", x=z, y=np.zeros(4), x_test=z, y_test=np.zeros(4), client=np.zeros(4)
    )
    with pytest.raises(DataError, match="no client_test"):
        load_dataset("npz", path=tmp_path / "a.npz")
    np.savez(
        tmp_path / "b.npz",
        x=z,
        y=np.zeros(4),
        x_test=z,
        y_test=np.zeros(4),
        client=np.arange(4),
        client_test=np.arange(4),
    )
    ds = load_dataset("npz", path=tmp_path / "b.npz")  # writer k: train sample k and test sample k
    assert [p.tolist() for p in ds.natural_partition or []] == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ----------------------------------------------------------------- flwr-datasets partitioners


def _labels(n: int = 600, classes: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, size=n)


def test_flwr_dirichlet_seeded_disjoint_and_sized_to_the_clients() -> None:
    pytest.importorskip("flwr_datasets")
    y = _labels()
    args = {"alpha": 0.3, "min_partition_size": 5}
    a = flwr_partition(y, 7, "flwr:DirichletPartitioner", args, seed=1)
    b = flwr_partition(y, 7, "flwr:DirichletPartitioner", args, seed=1)
    c = flwr_partition(y, 7, "flwr:DirichletPartitioner", args, seed=2)
    assert len(a) == 7
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))
    used = np.concatenate(a)
    assert np.unique(used).size == used.size  # each sample in at most one client
    assert used.min() >= 0 and used.max() < y.size
    assert min(p.size for p in a) >= 5
    counts = client_label_counts(a, y)
    assert (counts == 0).any()  # alpha = 0.3 skews the labels: some client lacks some class


def test_flwr_partitioner_through_the_config_and_federate(tmp_path: Path) -> None:
    pytest.importorskip("flwr_datasets")
    cfg = load_config(
        None,
        [
            "partition.name=flwr:PathologicalPartitioner",
            "partition.flwr={num_classes_per_partition=2}",
            "clients.count=5",
            "seed=3",
        ],
    )
    ds = load_dataset("digits")
    p = cfg.partition
    data = federate(ds, 5, p.name, flwr_args=p.flwr, seed=cfg.seed)
    counts = data.label_counts()
    assert counts.shape == (5, 10)
    assert ((counts > 0).sum(axis=1) <= 2).all()  # the partitioner's argument took effect
    again = federate(ds, 5, p.name, flwr_args=p.flwr, seed=cfg.seed)
    np.testing.assert_array_equal(again.label_counts(), counts)


def test_flwr_natural_id_partitioner_sees_the_writers(tmp_path: Path) -> None:
    pytest.importorskip("flwr_datasets")
    writers = np.repeat([3, 1, 2], 8)
    _writers_npz(tmp_path / "w.npz", writers)
    ds = load_dataset("npz", path=tmp_path / "w.npz")
    flwr = federate(ds, 3, "flwr:NaturalIdPartitioner", flwr_args={"partition_by": "client"})
    natural = federate(ds, 3, "natural")
    held = lambda d: {  # noqa: E731
        tuple(np.sort(np.concatenate([d.train_idx[i].numpy(), d.test_idx[i].numpy()])))
        for i in range(d.num_clients)
    }
    assert held(flwr) == held(natural)


@pytest.mark.parametrize(
    ("name", "args", "words"),
    [
        (
            "flwr:DirichletPartition",
            {},
            ["unknown flwr-datasets partitioner", "flwr:DirichletPartitioner"],
        ),
        ("flwr:DirichletPartitioner", {}, ["alpha", "accepted: partition_by, alpha"]),
        ("flwr:DirichletPartitioner", {"alpha": 0.5, "beta": 1}, ["beta", "accepted"]),
        ("flwr:DirichletPartitioner", {"alpha": 0.5, "num_partitions": 4}, ["clients.count"]),
        ("flwr:DirichletPartitioner", {"alpha": 0.5, "partition_by": "writer"}, ["no writers"]),
        (
            "flwr:SizePartitioner",
            {"partition_sizes": [10, 10]},
            ["made 2 partitions", "clients.count = 3"],
        ),
    ],
)
def test_flwr_bad_requests_are_one_line_errors(name: str, args: dict, words: list[str]) -> None:
    pytest.importorskip("flwr_datasets")
    with pytest.raises(PartitionError) as err:
        flwr_partition(_labels(), 3, name, args)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_partition_names_in_the_config() -> None:
    with pytest.raises(ConfigError, match=r"partition.name: allowed: .*flwr:<Partitioner>"):
        load_config(None, ["partition.name=fancy"])
    with pytest.raises(ConfigError, match=r"partition.flwr holds .* partition.name = dirichlet"):
        load_config(None, ["partition.name=dirichlet", "partition.flwr={alpha=1}"])


# ------------------------------------------------------------ label distribution of a run


def test_run_writes_the_label_distribution_plot(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, size=(160, 1, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 5, size=160)
    np.savez(tmp_path / "mydata.npz", x=x, y=y)
    settings = [
        "dataset.name=npz",
        f"dataset.path={tmp_path / 'mydata.npz'}",
        "device=cpu",
        "clients.count=4",
        "clients.models=lenet",
        "algorithm.name=fedavg",
        "partition.classes_per_client=2",
        "rounds=1",
        "local.epochs=1",
    ]
    out = tmp_path / "run"
    result = invoke("run", "--out", str(out), "--quiet", *sets(settings))
    assert result.exit_code == 0, result.output
    assert (out / LABEL_PLOT).stat().st_size > 0
    assert LABEL_PLOT in (out / "summary.md").read_text()

    # the matrix plotted is the partition's: recount it from the run's own federation
    import torch

    from hyperfed.runtime.simulate import load_federation

    data = load_federation(load_config(out / "config.toml"), torch.device("cpu"))
    expected = np.zeros((4, 5), dtype=np.int64)
    yy = data.y.numpy()
    for i in range(4):
        for split in (data.train_idx, data.val_idx, data.test_idx):
            np.add.at(expected[i], yy[split[i].numpy()], 1)
    drawn = plot_label_distribution(data.label_counts(), tmp_path / "again.png")
    np.testing.assert_array_equal(drawn, expected)
    assert ((drawn > 0).sum(axis=1) == 2).all()  # quantity with 2 classes per client
    assert drawn.sum() == 160
