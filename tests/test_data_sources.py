"""Dataset loaders, tested on small files written here in the real on-disk formats."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from hyperfed.data.sources import (
    DATASETS,
    ArrayDataset,
    DataError,
    dataset_names,
    load_dataset,
)

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
MNIST_NAMES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYPERFED_DATA", raising=False)


# ---------------------------------------------------------------------------- writers


def idx_bytes(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.tobytes()


def write(path: Path, data: bytes, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def make_idx_set(
    folder: Path,
    *,
    gz: bool,
    prefix: str = "",
    names: dict[str, str] | None = None,
    n_train: int = 7,
    n_test: int = 3,
    num_classes: int = 10,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, num_classes, n_train).astype(np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, num_classes, n_test).astype(np.uint8),
    }
    names = names or MNIST_NAMES
    for key, arr in arrays.items():
        write(folder / f"{prefix}{names[key]}", idx_bytes(arr), gz)
    return arrays


def check_image_ds(ds: ArrayDataset, shape: tuple[int, ...], num_classes: int) -> None:
    assert ds.input_shape == shape
    assert ds.num_classes == num_classes
    assert ds.x_train.dtype == np.uint8 and ds.x_test.dtype == np.uint8
    assert ds.y_train.dtype == np.int64 and ds.y_test.dtype == np.int64
    assert ds.x_train.shape[0] == ds.y_train.shape[0]
    assert ds.x_test.shape[0] == ds.y_test.shape[0]
    assert len(ds.mean) == shape[0] == len(ds.std)
    assert all(0.0 <= m <= 1.0 for m in ds.mean) and all(s > 0 for s in ds.std)
    x = ds.x_train.astype(np.float64) / 255.0
    np.testing.assert_allclose(ds.mean, x.mean(axis=(0, 2, 3)), atol=1e-9)


# ---------------------------------------------------------------------------- registry / digits


def test_registry_names() -> None:
    expected = {
        "digits",
        "mnist",
        "fashion_mnist",
        "emnist",
        "cifar10",
        "cifar100",
        "tiny_imagenet",
        "synthetic",
        "folder",  # your own data (tests/test_own_data.py)
        "npz",
        "hf_disk",
    }
    assert set(dataset_names()) == expected == set(DATASETS)
    for entry in DATASETS.values():
        assert entry.description and entry.source and "\n" not in entry.description


def test_unknown_dataset_and_bad_option() -> None:
    with pytest.raises(DataError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet")
    with pytest.raises(DataError, match="bad options"):
        load_dataset("digits", colour=True)


def test_digits() -> None:
    ds = load_dataset("digits")
    check_image_ds(ds, (1, 8, 8), 10)
    assert ds.num_train + ds.num_test == 1797
    assert ds.x_train.max() == 255 and ds.x_train.min() == 0
    assert set(np.unique(ds.y_train)) == set(range(10)) == set(np.unique(ds.y_test))
    again = load_dataset("digits")
    np.testing.assert_array_equal(ds.x_train, again.x_train)
    np.testing.assert_array_equal(ds.y_test, again.y_test)


# ---------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_idx(tmp_path: Path, gz: bool) -> None:
    arrays = make_idx_set(tmp_path, gz=gz)
    ds = load_dataset("fashion_mnist", tmp_path)
    check_image_ds(ds, (1, 28, 28), 10)
    np.testing.assert_array_equal(ds.x_train[:, 0], arrays["train_images"])
    np.testing.assert_array_equal(ds.y_train, arrays["train_labels"])
    np.testing.assert_array_equal(ds.x_test[:, 0], arrays["test_images"])
    np.testing.assert_array_equal(ds.y_test, arrays["test_labels"])


def test_mnist_subfolder_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = make_idx_set(tmp_path / "mnist", gz=True, seed=3)
    ds = load_dataset("mnist", tmp_path)  # data_dir/<name>
    np.testing.assert_array_equal(ds.y_train, arrays["train_labels"])
    monkeypatch.setenv("HYPERFED_DATA", str(tmp_path))
    ds = load_dataset("mnist")  # $HYPERFED_DATA/<name>
    np.testing.assert_array_equal(ds.x_test[:, 0], arrays["test_images"])


def test_mnist_dotted_names(tmp_path: Path) -> None:
    dotted = {k: v.replace("-idx", ".idx") for k, v in MNIST_NAMES.items()}
    arrays = make_idx_set(tmp_path, gz=False, names=dotted)
    ds = load_dataset("mnist", tmp_path)
    np.testing.assert_array_equal(ds.y_test, arrays["test_labels"])


def test_mnist_missing_names_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = tmp_path / "env"
    monkeypatch.setenv("HYPERFED_DATA", str(env))
    with pytest.raises(DataError) as err:
        load_dataset("mnist", tmp_path / "nowhere")
    msg = str(err.value)
    assert "\n" not in msg
    assert "train-images-idx3-ubyte" in msg
    assert str(tmp_path / "nowhere") in msg
    # a data_dir that does not exist is never replaced by another copy (issue 17 item 7)
    assert str(env / "mnist") not in msg


def test_fashion_mnist_partial_folder(tmp_path: Path) -> None:
    make_idx_set(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as err:
        load_dataset("fashion_mnist", tmp_path)
    msg = str(err.value)
    assert "t10k-labels-idx1-ubyte" in msg and str(tmp_path) in msg
    assert "dataset-fashion-mnist" in msg


def test_fashion_mnist_missing_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hyperfed.data.builtin as builtin

    system = tmp_path / "usr-share-datasets-fashion-mnist"
    monkeypatch.setattr(builtin, "FASHION_MNIST_SYSTEM_DIR", str(system))
    with pytest.raises(DataError) as err:
        load_dataset("fashion_mnist", tmp_path / "data")
    msg = str(err.value)
    assert msg.startswith("fashion_mnist: train-images-idx3-ubyte(.gz) not found in [")
    assert str(tmp_path / "data") in msg and str(system) in msg
    assert "dataset-fashion-mnist" in msg and "HYPERFED_DATA" in msg and "\n" not in msg


@pytest.mark.parametrize("gz", [True, False])
def test_idx_bad_magic(tmp_path: Path, gz: bool) -> None:
    make_idx_set(tmp_path, gz=gz)
    bad = bytes([0, 0, 0x08, 1]) + struct.pack(">I", 5) + bytes(5)  # a labels file
    path = write(tmp_path / "train-images-idx3-ubyte", bad, gz)
    with pytest.raises(DataError, match="magic") as err:
        load_dataset("mnist", tmp_path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_truncated(tmp_path: Path, gz: bool) -> None:
    arrays = make_idx_set(tmp_path, gz=gz)
    data = idx_bytes(arrays["test_images"])[:-100]
    path = write(tmp_path / "t10k-images-idx3-ubyte", data, gz)
    with pytest.raises(DataError, match="truncated") as err:
        load_dataset("mnist", tmp_path)
    assert str(path) in str(err.value)


def test_idx_truncated_gzip_stream(tmp_path: Path) -> None:
    make_idx_set(tmp_path, gz=True)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DataError) as err:
        load_dataset("mnist", tmp_path)
    assert str(path) in str(err.value)


def test_idx_count_and_label_checks(tmp_path: Path) -> None:
    make_idx_set(tmp_path, gz=False)
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.zeros(4, np.uint8)), False)
    with pytest.raises(DataError, match="7 images but"):
        load_dataset("mnist", tmp_path)
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.full(7, 12, np.uint8)), False)
    with pytest.raises(DataError, match="labels outside"):
        load_dataset("mnist", tmp_path)


def test_emnist_transposed(tmp_path: Path) -> None:
    names = {
        "train_images": "train-images-idx3-ubyte",
        "train_labels": "train-labels-idx1-ubyte",
        "test_images": "test-images-idx3-ubyte",
        "test_labels": "test-labels-idx1-ubyte",
    }
    arrays = make_idx_set(
        tmp_path / "emnist" / "gzip", gz=True, prefix="emnist-byclass-", names=names, num_classes=62
    )
    ds = load_dataset("emnist", tmp_path)
    check_image_ds(ds, (1, 28, 28), 62)
    assert ds.name == "emnist"
    np.testing.assert_array_equal(ds.x_train[:, 0], arrays["train_images"].transpose(0, 2, 1))
    np.testing.assert_array_equal(ds.y_test, arrays["test_labels"])
    with pytest.raises(DataError, match="emnist-byclass-train-images-idx3-ubyte"):
        load_dataset("emnist", tmp_path / "empty")


def test_fashion_mnist_real() -> None:
    if not (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"{FASHION_DIR} not installed (apt-get install dataset-fashion-mnist)")
    ds = load_dataset("fashion_mnist")
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    assert np.bincount(ds.y_train).tolist() == [6000] * 10
    assert np.bincount(ds.y_test).tolist() == [1000] * 10
    assert abs(ds.mean[0] - 0.286) < 0.01 and abs(ds.std[0] - 0.353) < 0.01


# ---------------------------------------------------------------------------- CIFAR


def cifar_batches(name: str, n: int = 4) -> dict[str, dict[bytes, object]]:
    rng = np.random.default_rng(1)
    if name == "cifar10":
        members = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        return {
            m: {
                b"batch_label": m.encode(),
                b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                b"labels": rng.integers(0, 10, n).tolist(),
                b"filenames": [b"x.png"] * n,
            }
            for m in members
        }
    return {
        m: {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"fine_labels": rng.integers(0, 100, n).tolist(),
            b"coarse_labels": rng.integers(0, 20, n).tolist(),
        }
        for m in ("train", "test")
    }


CIFAR_LAYOUT = {
    "cifar10": ("cifar-10-python.tar.gz", "cifar-10-batches-py", "labels", 10),
    "cifar100": ("cifar-100-python.tar.gz", "cifar-100-python", "fine_labels", 100),
}


def write_cifar_archive(path: Path, name: str, batches: dict[str, dict[bytes, object]]) -> None:
    _, folder, _, _ = CIFAR_LAYOUT[name]
    with tarfile.open(path, "w:gz") as tar:
        for member, obj in batches.items():
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"{folder}/{member}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def expected_cifar(name: str, batches: dict[str, dict[bytes, object]]) -> tuple[np.ndarray, ...]:
    key = CIFAR_LAYOUT[name][2].encode()
    test = "test_batch" if name == "cifar10" else "test"
    train = [m for m in batches if m != test]
    x_tr = np.concatenate([np.asarray(batches[m][b"data"]) for m in train]).reshape(-1, 3, 32, 32)
    y_tr = np.concatenate([np.asarray(batches[m][key]) for m in train])
    x_te = np.asarray(batches[test][b"data"]).reshape(-1, 3, 32, 32)
    y_te = np.asarray(batches[test][key])
    return x_tr, y_tr, x_te, y_te


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("layout", ["archive", "archive_path", "folder"])
def test_cifar(tmp_path: Path, name: str, layout: str) -> None:
    archive, folder, _, num_classes = CIFAR_LAYOUT[name]
    batches = cifar_batches(name)
    if layout == "folder":
        (tmp_path / folder).mkdir()
        for member, obj in batches.items():
            (tmp_path / folder / member).write_bytes(pickle.dumps(obj))
        ds = load_dataset(name, tmp_path)
    else:
        write_cifar_archive(tmp_path / archive, name, batches)
        ds = load_dataset(name, tmp_path if layout == "archive" else tmp_path / archive)
    check_image_ds(ds, (3, 32, 32), num_classes)
    x_tr, y_tr, x_te, y_te = expected_cifar(name, batches)
    np.testing.assert_array_equal(ds.x_train, x_tr)
    np.testing.assert_array_equal(ds.y_train, y_tr)
    np.testing.assert_array_equal(ds.x_test, x_te)
    np.testing.assert_array_equal(ds.y_test, y_te)


def py2_pickle(data: np.ndarray, labels: list[int], label_key: bytes) -> bytes:
    """A batch pickled the way Python 2 / numpy 1 wrote the official CIFAR files."""

    def s(b: bytes) -> bytes:  # SHORT_BINSTRING (a Python 2 str)
        return b"U" + bytes([len(b)]) + b

    def k(v: int) -> bytes:  # BININT1
        return b"K" + bytes([v])

    rows, cols = data.shape
    out = b"\x80\x02}(" + s(b"data")
    out += b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + k(0) + b"\x85"
    out += s(b"b") + b"\x87R("
    out += k(1) + b"J" + struct.pack("<i", rows) + b"J" + struct.pack("<i", cols) + b"\x86"
    out += b"cnumpy\ndtype\n" + s(b"u1") + k(0) + k(1) + b"\x87R"
    minus_one = b"J" + struct.pack("<i", -1)
    out += b"(" + k(3) + s(b"|") + b"NNN" + minus_one + minus_one + k(0) + b"tb"
    raw = data.tobytes()
    out += b"\x89T" + struct.pack("<I", len(raw)) + raw + b"tb"  # BINSTRING
    out += s(label_key) + b"](" + b"".join(k(v) for v in labels) + b"eu."
    return out


def test_cifar100_python2_pickles(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    folder = tmp_path / "cifar100" / "cifar-100-python"
    folder.mkdir(parents=True)
    expected = {}
    for member, n in (("train", 5), ("test", 2)):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 100, n).tolist()
        (folder / member).write_bytes(py2_pickle(data, labels, b"fine_labels"))
        expected[member] = (data.reshape(-1, 3, 32, 32), labels)
    ds = load_dataset("cifar100", tmp_path)
    np.testing.assert_array_equal(ds.x_train, expected["train"][0])
    assert ds.y_train.tolist() == expected["train"][1]
    np.testing.assert_array_equal(ds.x_test, expected["test"][0])


def test_cifar_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        load_dataset("cifar100", tmp_path)
    msg = str(err.value)
    assert "cifar-100-python.tar.gz" in msg and str(tmp_path) in msg and "\n" not in msg


def test_cifar_truncated_archive(tmp_path: Path) -> None:
    path = tmp_path / "cifar-10-python.tar.gz"
    write_cifar_archive(path, "cifar10", cifar_batches("cifar10"))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", tmp_path)
    assert str(path) in str(err.value)


def test_cifar_archive_missing_member(tmp_path: Path) -> None:
    batches = cifar_batches("cifar10")
    del batches["data_batch_3"]
    write_cifar_archive(tmp_path / "cifar-10-python.tar.gz", "cifar10", batches)
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", tmp_path)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (os.getcwd, ())


def test_cifar_refuses_foreign_pickles(tmp_path: Path) -> None:
    batches = cifar_batches("cifar10")
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for member, obj in batches.items():
        (folder / member).write_bytes(pickle.dumps(obj))
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": _Evil(), b"labels": []}))
    with pytest.raises(DataError, match="not allowed") as err:
        load_dataset("cifar10", tmp_path)
    assert str(folder / "test_batch") in str(err.value)
    (folder / "test_batch").write_bytes(b"garbage")
    with pytest.raises(DataError, match="test_batch"):
        load_dataset("cifar10", tmp_path)


# ---------------------------------------------------------------------------- Tiny-ImageNet


def make_tiny_imagenet(root: Path) -> None:
    from PIL import Image

    wnids = ["n001", "n002"]
    colors = {"n001": (200, 30, 30), "n002": (30, 30, 200)}
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    lines = []
    for w in wnids:
        img_dir = root / "train" / w / "images"
        img_dir.mkdir(parents=True)
        for j in range(2):
            Image.new("RGB", (64, 64), colors[w]).save(img_dir / f"{w}_{j}.JPEG", quality=95)
        (root / "train" / w / f"{w}_boxes.txt").write_text("")
        val_name = f"val_{w}.JPEG"
        Image.new("RGB", (64, 64), colors[w]).save(root / "val" / "images" / val_name)
        lines.append(f"{val_name}\t{w}\t0\t0\t63\t63")
    # a grayscale image must come back as 3 channels
    Image.new("L", (64, 64), 128).save(root / "train" / "n002" / "images" / "n002_gray.JPEG")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")


def test_tiny_imagenet(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    make_tiny_imagenet(tmp_path / "tiny-imagenet-200")
    ds = load_dataset("tiny_imagenet", tmp_path)
    check_image_ds(ds, (3, 64, 64), 2)
    assert ds.x_train.shape == (5, 3, 64, 64) and ds.x_test.shape == (2, 3, 64, 64)
    assert ds.y_train.tolist() == [0, 0, 1, 1, 1]
    assert ds.y_test.tolist() == [0, 1]
    red = ds.x_train[0].reshape(3, -1).mean(axis=1)
    assert red[0] > 180 and red[2] < 50
    cache = tmp_path / "cache"
    first = load_dataset("tiny_imagenet", tmp_path, cache_dir=cache)
    assert (cache / "tiny_imagenet_uint8.npz").is_file()
    second = load_dataset("tiny_imagenet", tmp_path / "gone", cache_dir=cache)
    np.testing.assert_array_equal(first.x_train, second.x_train)


def test_tiny_imagenet_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("PIL")
    with pytest.raises(DataError, match="wnids.txt not found") as err:
        load_dataset("tiny_imagenet", tmp_path)
    assert str(tmp_path) in str(err.value)
    root = tmp_path / "tiny-imagenet-200"
    make_tiny_imagenet(root)
    (root / "val" / "images" / "val_n002.JPEG").unlink()
    with pytest.raises(DataError, match="val_n002.JPEG"):
        load_dataset("tiny_imagenet", tmp_path)
    (root / "val" / "images" / "val_n002.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match="cannot decode"):
        load_dataset("tiny_imagenet", tmp_path)


def test_tiny_imagenet_without_pillow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(DataError, match="pip install pillow"):
        load_dataset("tiny_imagenet", tmp_path)


# ---------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic() -> None:
    a = load_dataset("synthetic", seed=3, num_users=8)
    b = load_dataset("synthetic", seed=3, num_users=8)
    c = load_dataset("synthetic", seed=4, num_users=8)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert a.x_train.shape != c.x_train.shape or not np.array_equal(a.x_train, c.x_train)
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int64
    assert a.input_shape == (60,) and a.num_classes == 10 and a.mean == () and a.std == ()
    assert a.natural_partition is not None and len(a.natural_partition) == 8
    pooled = np.sort(np.concatenate(a.natural_partition))
    np.testing.assert_array_equal(pooled, np.arange(a.num_train + a.num_test))
    for part in a.natural_partition:
        assert len(part) >= 50
        assert (part < a.num_train).any() and (part >= a.num_train).any()
    x, y = a.pooled()
    assert x.shape[0] == y.shape[0] == a.num_train + a.num_test
    assert y.max() < 10


def test_synthetic_options() -> None:
    ds = load_dataset("synthetic", num_users=4, dim=12, num_classes=5, max_samples_per_user=80)
    assert ds.input_shape == (12,) and ds.num_classes == 5
    assert all(50 <= len(p) <= 80 for p in ds.natural_partition or [])
    with pytest.raises(DataError):
        load_dataset("synthetic", test_fraction=1.5)
