"""Dataset loaders: turn files already on disk into in-memory :class:`ArrayDataset` objects.

Nothing is ever downloaded.  Each loader looks for its files in a fixed search order and raises a
one-line :class:`DataError` naming the folders it searched and how to obtain the data when they
are missing, truncated or of the wrong format.

Search order for the file-based datasets (first folder that holds the files wins):

1. ``data_dir`` and ``data_dir/<alias>`` for each folder alias of the dataset
   (e.g. ``fashion_mnist``, ``fashion-mnist``, ``FashionMNIST/raw``),
2. ``$HYPERFED_DATA`` and ``$HYPERFED_DATA/<alias>``,
3. system locations (only ``/usr/share/datasets/fashion-mnist`` for Fashion-MNIST, where Debian's
   ``dataset-fashion-mnist`` package installs the four gzipped IDX files).

A folder that holds only part of a dataset's files stops the search with a :class:`DataError`
naming the missing files (no silent fallback to another copy further down the list).  IDX files
may be gzipped or not (detected from the content), and are checked for magic number, dimensions
and exact size.  CIFAR pickles are read with an unpickler that only rebuilds numpy arrays.

Your own data (:data:`OWN_DATA`) is read from ``dataset.path`` (passed as the loader option
``path``): ``npz`` (arrays ``x``, ``y``, optional ``x_test``, ``y_test``, ``client``,
``split``, ``mean``, ``std``),
``folder`` (one sub-folder of images per class) and ``hf_disk`` (a Hugging Face dataset written
by ``save_to_disk``; needs the optional ``datasets`` package). A ``client`` id per sample
becomes ``natural_partition``; an npz ``split`` per sample (``train`` / ``val`` / ``test``,
or 0 / 1 / 2) becomes ``natural_split``, which fixes each client's split under
``partition.name = natural`` (what ``hyperfed export --format npz`` writes).

Images are returned as ``uint8`` arrays of shape ``[N, C, H, W]`` (values 0..255); ``mean`` and
``std`` are the per-channel statistics of ``x_train / 255`` and are meant for normalisation.
Vector data (``synthetic``) is ``float32 [N, D]`` with empty ``mean``/``std``.
"""

from __future__ import annotations

import gzip
import inspect
import io
import os
import pickle
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from hyperfed import plugins
from hyperfed.errors import HyperfedError
from hyperfed.registry import Registry

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "DataError",
    "DatasetEntry",
    "dataset_entries",
    "dataset_names",
    "load_dataset",
]

ENV_VAR = "HYPERFED_DATA"
_HOW_TO_PASS = f"pass --set dataset.data_dir=DIR or set {ENV_VAR} to a folder holding"


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


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


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


def _image_dataset(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
) -> ArrayDataset:
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


def _search_dirs(
    data_dir: str | Path | None, aliases: Sequence[str], system: Sequence[str] = ()
) -> list[Path]:
    """Candidate folders in search order, without duplicates (existing or not)."""
    roots: list[Path] = []
    if data_dir is not None:
        roots.append(Path(data_dir).expanduser())
        if not roots[0].exists():
            # never fall back to another copy while config.toml records a path that is not
            # there: the loader's "not found in [...]" error names this path alone
            return [roots[0], *(roots[0] / alias for alias in aliases)]
    env = os.environ.get(ENV_VAR)
    if env:
        roots.append(Path(env).expanduser())
    out: list[Path] = []
    for root in roots:
        out.append(root)
        out.extend(root / alias for alias in aliases)
    out.extend(Path(p) for p in system)
    seen: set[str] = set()
    unique: list[Path] = []
    for p in out:
        key = str(p)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def _fmt_dirs(dirs: Sequence[Path]) -> str:
    if not dirs:
        return f"[] (no dataset.data_dir given and {ENV_VAR} unset)"
    return "[" + ", ".join(str(d) for d in dirs) + "]"


def _find_file(folder: Path, names: Sequence[str]) -> Path | None:
    """First of ``name`` / ``name.gz`` (for each name) that exists in ``folder``."""
    for name in names:
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _read_bytes(path: Path, what: str) -> bytes:
    """Whole file, transparently gunzipped (by magic bytes, not by suffix)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
            fh.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=fh) as gz:
                    return gz.read()
            return fh.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{what}: cannot read {path}: {exc} (truncated or corrupt gzip?)") from exc


_IDX_DTYPES = {0x08: np.dtype(np.uint8)}


def _parse_idx(path: Path, what: str, ndim: int) -> np.ndarray:
    """Parse an IDX file (``ubyte`` only), validating the magic number, dims and size."""
    raw = _read_bytes(path, what)
    if len(raw) < 4:
        raise DataError(f"{what}: {path} is too short to be an IDX file ({len(raw)} bytes)")
    zero, type_code, got_ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or type_code not in _IDX_DTYPES or got_ndim != ndim:
        raise DataError(
            f"{what}: {path} has bad IDX magic number 0x{raw[:4].hex()} "
            f"(expected 0x0000080{ndim}: unsigned bytes, {ndim} dims)"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{what}: {path} is truncated inside the IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(dims, dtype=np.int64))
    payload = len(raw) - header
    if payload != expected:
        state = "truncated" if payload < expected else "has trailing bytes"
        raise DataError(
            f"{what}: {path} {state}: header says dims {tuple(dims)} = {expected} bytes, "
            f"file holds {payload}"
        )
    arr = np.frombuffer(raw, dtype=_IDX_DTYPES[type_code], offset=header)
    return arr.reshape(dims)


# --------------------------------------------------------------------------------------------
# digits (scikit-learn, bundled)
# --------------------------------------------------------------------------------------------


def _load_digits(
    data_dir: str | Path | None = None, *, test_fraction: float = 0.2, seed: int = 0
) -> ArrayDataset:
    """scikit-learn's 8x8 digits, scaled 0..16 -> 0..255, fixed stratified train/test split."""
    del data_dir  # bundled with scikit-learn
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float64)
    x = np.rint(images * 255.0 / 16.0).clip(0, 255).astype(np.uint8)[:, None, :, :]
    y = np.asarray(bunch.target, dtype=np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return _image_dataset("digits", x_tr, y_tr, x_te, y_te, 10)


# --------------------------------------------------------------------------------------------
# IDX datasets: mnist, fashion_mnist, emnist
# --------------------------------------------------------------------------------------------


def _load_idx_set(
    name: str,
    dirs: list[Path],
    files: dict[str, Sequence[str]],
    how_to: str,
    image_hw: tuple[int, int] = (28, 28),
) -> dict[str, np.ndarray]:
    """Find the folder holding all four IDX files, parse and cross-check them."""
    primary = {key: names[0] for key, names in files.items()}
    chosen: dict[str, Path] | None = None
    for folder in dirs:
        if not folder.is_dir():
            continue
        found = {key: _find_file(folder, names) for key, names in files.items()}
        if all(p is not None for p in found.values()):
            chosen = {key: p for key, p in found.items() if p is not None}
            break
        if any(p is not None for p in found.values()):
            # an incomplete set earlier in the search order is a mistake, not a reason to fall
            # back silently to another copy further down the list
            missing = [primary[k] + "(.gz)" for k, p in found.items() if p is None]
            raise DataError(
                f"{name}: {', '.join(missing)} missing in {folder} (the other IDX files are "
                f"there); {how_to}"
            )
    if chosen is None:
        raise DataError(
            f"{name}: {primary['train_images']}(.gz) not found in {_fmt_dirs(dirs)}; {how_to}"
        )
    arrays: dict[str, np.ndarray] = {}
    for key, path in chosen.items():
        arrays[key] = _parse_idx(path, name, 3 if key.endswith("images") else 1)
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if tuple(images.shape[1:]) != image_hw:
            raise DataError(
                f"{name}: {chosen[f'{split}_images']} holds {images.shape[1]}x{images.shape[2]} "
                f"images, expected {image_hw[0]}x{image_hw[1]}"
            )
        if images.shape[0] != labels.shape[0]:
            raise DataError(
                f"{name}: {chosen[f'{split}_images']} has {images.shape[0]} images but "
                f"{chosen[f'{split}_labels']} has {labels.shape[0]} labels"
            )
    return arrays


_MNIST_FILES: dict[str, Sequence[str]] = {
    "train_images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}

FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


def _load_fashion_mnist(data_dir: str | Path | None = None) -> ArrayDataset:
    dirs = _search_dirs(
        data_dir,
        ("fashion_mnist", "fashion-mnist", "FashionMNIST/raw", "FashionMNIST"),
        (FASHION_MNIST_SYSTEM_DIR,),
    )
    how_to = (
        "install Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist, "
        f"files land in {FASHION_MNIST_SYSTEM_DIR}) or {_HOW_TO_PASS} the four Fashion-MNIST "
        "IDX files (github.com/zalandoresearch/fashion-mnist)"
    )
    a = _load_idx_set("fashion_mnist", dirs, _MNIST_FILES, how_to)
    return _image_dataset(
        "fashion_mnist",
        a["train_images"][:, None],
        a["train_labels"],
        a["test_images"][:, None],
        a["test_labels"],
        10,
    )


def _load_mnist(data_dir: str | Path | None = None) -> ArrayDataset:
    dirs = _search_dirs(data_dir, ("mnist", "MNIST/raw", "MNIST"))
    how_to = (
        f"{_HOW_TO_PASS} the four MNIST IDX files train-images-idx3-ubyte.gz, "
        "train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz "
        "(e.g. from a torchvision MNIST/raw folder)"
    )
    a = _load_idx_set("mnist", dirs, _MNIST_FILES, how_to)
    return _image_dataset(
        "mnist",
        a["train_images"][:, None],
        a["train_labels"],
        a["test_images"][:, None],
        a["test_labels"],
        10,
    )


# split -> (number of classes, label offset subtracted from the stored labels)
EMNIST_SPLITS: dict[str, tuple[int, int]] = {
    "byclass": (62, 0),
    "bymerge": (47, 0),
    "balanced": (47, 0),
    "digits": (10, 0),
    "mnist": (10, 0),
    "letters": (26, 1),  # stored labels are 1..26
}


def _load_emnist(data_dir: str | Path | None = None, *, split: str = "byclass") -> ArrayDataset:
    """EMNIST (default ``byclass``: 62 classes). Images are stored transposed; we flip them."""
    if split not in EMNIST_SPLITS:
        raise DataError(f"emnist: unknown split {split!r}; choose one of {sorted(EMNIST_SPLITS)}")
    num_classes, offset = EMNIST_SPLITS[split]
    p = f"emnist-{split}-"
    files: dict[str, Sequence[str]] = {
        "train_images": (f"{p}train-images-idx3-ubyte",),
        "train_labels": (f"{p}train-labels-idx1-ubyte",),
        "test_images": (f"{p}test-images-idx3-ubyte",),
        "test_labels": (f"{p}test-labels-idx1-ubyte",),
    }
    dirs = _search_dirs(data_dir, ("emnist", "emnist/gzip", "gzip", "EMNIST/raw"))
    how_to = (
        f"{_HOW_TO_PASS} the EMNIST IDX files {p}*-idx?-ubyte(.gz) (the 'gzip' folder of NIST's "
        "EMNIST release, www.nist.gov/itl/products-and-services/emnist-dataset)"
    )
    a = _load_idx_set("emnist", dirs, files, how_to)
    name = "emnist" if split == "byclass" else f"emnist_{split}"
    return _image_dataset(
        name,
        a["train_images"].transpose(0, 2, 1)[:, None],
        a["train_labels"].astype(np.int64) - offset,
        a["test_images"].transpose(0, 2, 1)[:, None],
        a["test_labels"].astype(np.int64) - offset,
        num_classes,
    )


# --------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python pickle version)
# --------------------------------------------------------------------------------------------


def _numpy_pickle_globals() -> dict[tuple[str, str], Any]:
    try:
        from numpy._core import multiarray as ma
        from numpy._core import numeric as nu
    except ImportError:  # numpy < 2
        from numpy.core import multiarray as ma  # type: ignore[no-redef]
        from numpy.core import numeric as nu  # type: ignore[no-redef]
    import _codecs

    allowed: dict[tuple[str, str], Any] = {
        ("_codecs", "encode"): _codecs.encode,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = ma._reconstruct
        allowed[(module, "scalar")] = ma.scalar
    if hasattr(nu, "_frombuffer"):
        for module in ("numpy.core.numeric", "numpy._core.numeric"):
            allowed[(module, "_frombuffer")] = nu._frombuffer
    return allowed


class _SafeUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays, lists, dicts and strings (no code execution)."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _SafeUnpickler._allowed is None:
            _SafeUnpickler._allowed = _numpy_pickle_globals()
        try:
            return _SafeUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed") from None


def _load_batch(fh: IO[bytes], where: str, what: str, label_key: str) -> tuple[np.ndarray, Any]:
    try:
        obj = _SafeUnpickler(fh, encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means a corrupt / foreign file
        raise DataError(f"{what}: {where} is not a readable CIFAR pickle batch ({exc})") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{what}: {where} does not hold a dict (not a CIFAR batch)")
    batch = {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}
    if "data" not in batch or label_key not in batch:
        raise DataError(f"{what}: {where} lacks the 'data' / '{label_key}' entries")
    data = np.asarray(batch["data"])
    labels = np.asarray(batch[label_key], dtype=np.int64).reshape(-1)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(
            f"{what}: {where} 'data' is {data.dtype} {data.shape}, expected uint8 [N, 3072]"
        )
    if data.shape[0] != labels.shape[0]:
        raise DataError(f"{what}: {where} has {data.shape[0]} images but {labels.shape[0]} labels")
    return data.reshape(-1, 3, 32, 32), labels


_CIFAR = {
    # name: (archive, folder inside it, train members, test members, label key, classes)
    "cifar10": (
        "cifar-10-python.tar.gz",
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        "labels",
        10,
    ),
    "cifar100": (
        "cifar-100-python.tar.gz",
        "cifar-100-python",
        ("train",),
        ("test",),
        "fine_labels",
        100,
    ),
}


def _load_cifar(name: str, data_dir: str | Path | None) -> ArrayDataset:
    archive, folder, train_members, test_members, label_key, num_classes = _CIFAR[name]
    how_to = (
        f"{_HOW_TO_PASS} {archive} or its extracted {folder}/ folder "
        "(www.cs.toronto.edu/~kriz/cifar.html, python version)"
    )
    members = train_members + test_members
    # data_dir may also be the archive itself
    if data_dir is not None and Path(data_dir).is_file():
        return _cifar_from_archive(name, Path(data_dir), how_to)
    dirs = _search_dirs(data_dir, (name, name.replace("cifar", "cifar-")))
    for d in dirs:
        for sub in (d / folder, d):
            if (sub / members[0]).is_file():
                return _cifar_from_folder(name, sub, how_to)
        if (d / archive).is_file():
            return _cifar_from_archive(name, d / archive, how_to)
    raise DataError(
        f"{name}: neither {archive} nor {folder}/{members[0]} found in {_fmt_dirs(dirs)}; {how_to}"
    )


def _cifar_concat(
    name: str, parts: dict[str, tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    _, _, train_members, test_members, _, _ = _CIFAR[name]
    x_tr = np.concatenate([parts[m][0] for m in train_members])
    y_tr = np.concatenate([parts[m][1] for m in train_members])
    x_te = np.concatenate([parts[m][0] for m in test_members])
    y_te = np.concatenate([parts[m][1] for m in test_members])
    return x_tr, y_tr, x_te, y_te


def _cifar_from_folder(name: str, folder: Path, how_to: str) -> ArrayDataset:
    _, _, train_members, test_members, label_key, num_classes = _CIFAR[name]
    parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for member in train_members + test_members:
        path = folder / member
        if not path.is_file():
            raise DataError(f"{name}: {path} missing (the folder is incomplete); {how_to}")
        with open(path, "rb") as fh:
            parts[member] = _load_batch(fh, str(path), name, label_key)
    return _image_dataset(name, *_cifar_concat(name, parts), num_classes)


def _cifar_from_archive(name: str, path: Path, how_to: str) -> ArrayDataset:
    _, folder, train_members, test_members, label_key, num_classes = _CIFAR[name]
    parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    wanted = set(train_members + test_members)
    try:
        with tarfile.open(path, "r:*") as tar:
            for info in tar:
                base = info.name.rstrip("/").rsplit("/", 1)[-1]
                if not info.isfile() or base not in wanted or base in parts:
                    continue
                fh = tar.extractfile(info)
                if fh is None:
                    continue
                with fh:
                    data = fh.read()
                parts[base] = _load_batch(io.BytesIO(data), f"{path}:{info.name}", name, label_key)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"{name}: cannot read archive {path}: {exc} (truncated or corrupt?)"
        ) from exc
    missing = sorted(wanted - set(parts))
    if missing:
        raise DataError(
            f"{name}: archive {path} lacks {', '.join(folder + '/' + m for m in missing)}; {how_to}"
        )
    return _image_dataset(name, *_cifar_concat(name, parts), num_classes)


def _load_cifar10(data_dir: str | Path | None = None) -> ArrayDataset:
    return _load_cifar("cifar10", data_dir)


def _load_cifar100(data_dir: str | Path | None = None) -> ArrayDataset:
    return _load_cifar("cifar100", data_dir)


# --------------------------------------------------------------------------------------------
# Tiny-ImageNet
# --------------------------------------------------------------------------------------------

_TINY_FOLDER = "tiny-imagenet-200"
_TINY_HOW_TO = (
    f"{_HOW_TO_PASS} the extracted {_TINY_FOLDER}/ folder (wnids.txt, train/, val/; "
    "from cs231n.stanford.edu/tiny-imagenet-200.zip)"
)


def _read_image(path: Path, size: int) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
            if rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
            arr = np.asarray(rgb, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise DataError(f"tiny_imagenet: cannot decode image {path}: {exc}") from exc
    return arr.transpose(2, 0, 1)


def _load_tiny_imagenet(
    data_dir: str | Path | None = None, *, cache_dir: str | Path | None = None
) -> ArrayDataset:
    """Tiny-ImageNet-200: train/<wnid>/images/*.JPEG for training, val/ as the test set.

    Decoding 110k JPEGs takes a while; with ``cache_dir`` the uint8 arrays are stored there as
    ``tiny_imagenet_uint8.npz`` on the first load and read back afterwards.
    """
    try:
        import PIL.Image  # noqa: F401
    except ImportError as exc:
        raise DataError(
            "tiny_imagenet: reading the JPEGs needs Pillow, which is not installed; "
            "pip install pillow"
        ) from exc
    cache = Path(cache_dir) / "tiny_imagenet_uint8.npz" if cache_dir is not None else None
    if cache is not None and cache.is_file():
        try:
            with np.load(cache) as z:
                x_tr, y_tr, x_te, y_te = (z[k] for k in ("x_train", "y_train", "x_test", "y_test"))
                num_classes = int(z["num_classes"])
            return _image_dataset("tiny_imagenet", x_tr, y_tr, x_te, y_te, num_classes)
        except (OSError, KeyError, ValueError, zlib.error) as exc:
            raise DataError(
                f"tiny_imagenet: cache {cache} is corrupt ({exc}); delete it to rebuild"
            ) from exc

    dirs = _search_dirs(data_dir, (_TINY_FOLDER, f"tiny_imagenet/{_TINY_FOLDER}", "tiny_imagenet"))
    root: Path | None = None
    for d in dirs:
        for sub in (d / _TINY_FOLDER, d):
            if (sub / "wnids.txt").is_file():
                root = sub
                break
        if root is not None:
            break
    if root is None:
        raise DataError(
            f"tiny_imagenet: {_TINY_FOLDER}/wnids.txt not found in {_fmt_dirs(dirs)}; "
            f"{_TINY_HOW_TO}"
        )
    wnids = [w.strip() for w in (root / "wnids.txt").read_text().splitlines() if w.strip()]
    if not wnids or len(set(wnids)) != len(wnids):
        raise DataError(f"tiny_imagenet: {root / 'wnids.txt'} is empty or has duplicate ids")
    index = {w: i for i, w in enumerate(wnids)}
    size = 64

    train_files: list[tuple[Path, int]] = []
    for wnid in wnids:
        folder = root / "train" / wnid / "images"
        if not folder.is_dir():
            raise DataError(f"tiny_imagenet: {folder} missing; {_TINY_HOW_TO}")
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpeg", ".jpg"))
        if not files:
            raise DataError(f"tiny_imagenet: no JPEG files in {folder}; {_TINY_HOW_TO}")
        train_files.extend((p, index[wnid]) for p in files)

    ann = root / "val" / "val_annotations.txt"
    if not ann.is_file():
        raise DataError(f"tiny_imagenet: {ann} missing; {_TINY_HOW_TO}")
    test_files: list[tuple[Path, int]] = []
    for lineno, line in enumerate(ann.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise DataError(f"tiny_imagenet: {ann} line {lineno} is malformed: {line[:60]!r}")
        img = root / "val" / "images" / fields[0]
        if not img.is_file():
            raise DataError(f"tiny_imagenet: {img} (listed in {ann}) missing; {_TINY_HOW_TO}")
        test_files.append((img, index[fields[1]]))

    def read_all(items: list[tuple[Path, int]]) -> tuple[np.ndarray, np.ndarray]:
        x = np.empty((len(items), 3, size, size), dtype=np.uint8)
        for i, (path, _) in enumerate(items):
            x[i] = _read_image(path, size)
        return x, np.array([label for _, label in items], dtype=np.int64)

    x_tr, y_tr = read_all(train_files)
    x_te, y_te = read_all(test_files)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te, num_classes=len(wnids))
        os.replace(tmp, cache)
    return _image_dataset("tiny_imagenet", x_tr, y_tr, x_te, y_te, len(wnids))


# --------------------------------------------------------------------------------------------
# Synthetic(alpha, beta)
# --------------------------------------------------------------------------------------------


def _load_synthetic(
    data_dir: str | Path | None = None,
    *,
    alpha: float = 0.5,
    beta: float = 0.5,
    num_users: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    test_fraction: float = 0.25,
    min_samples_per_user: int = 50,
    max_samples_per_user: int | None = None,
) -> ArrayDataset:
    """LEAF-style Synthetic(alpha, beta) (Li et al., FedProx; used by pFedHN).

    For user k: ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)`` (second argument = standard
    deviation, as in the reference generator); ``W_k [C, D]`` and ``b_k [C]`` have entries
    ``~ N(u_k, 1)``; ``v_k [D]`` has entries ``~ N(B_k, 1)``; ``x ~ N(v_k, Sigma)`` with diagonal
    ``Sigma_jj = j^-1.2``; ``y = argmax(W_k x + b_k)``.  User sizes follow a power law:
    ``int(lognormal(4, 2)) + min_samples_per_user`` (optionally capped).  Each user's samples are
    split ``1 - test_fraction`` / ``test_fraction`` into train / test;
    ``natural_partition[k]`` indexes user k's samples in ``concatenate([x_train, x_test])``.
    """
    del data_dir  # generated
    if num_users < 1 or dim < 1 or num_classes < 2:
        raise DataError("synthetic: need num_users >= 1, dim >= 1 and num_classes >= 2")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"synthetic: test_fraction must be in (0, 1), got {test_fraction}")
    if min_samples_per_user < 2:
        raise DataError("synthetic: min_samples_per_user must be >= 2 (train and test per user)")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4.0, 2.0, size=num_users).astype(np.int64) + min_samples_per_user
    if max_samples_per_user is not None:
        sizes = np.minimum(sizes, max(int(max_samples_per_user), min_samples_per_user))
    cov_diag = np.arange(1, dim + 1, dtype=np.float64) ** -1.2
    x_tr_parts, y_tr_parts, x_te_parts, y_te_parts = [], [], [], []
    for k in range(num_users):
        u_k = rng.normal(0.0, alpha)
        b_k_mean = rng.normal(0.0, beta)
        w = rng.normal(u_k, 1.0, size=(num_classes, dim))
        b = rng.normal(u_k, 1.0, size=num_classes)
        v = rng.normal(b_k_mean, 1.0, size=dim)
        n = int(sizes[k])
        x = v + rng.standard_normal((n, dim)) * np.sqrt(cov_diag)
        y = np.argmax(x @ w.T + b, axis=1).astype(np.int64)
        n_test = min(n - 1, max(1, int(np.floor(n * test_fraction + 0.5))))
        perm = rng.permutation(n)
        test_idx, train_idx = perm[:n_test], perm[n_test:]
        x_tr_parts.append(x[train_idx])
        y_tr_parts.append(y[train_idx])
        x_te_parts.append(x[test_idx])
        y_te_parts.append(y[test_idx])
    n_train = int(sum(len(p) for p in y_tr_parts))
    natural: list[np.ndarray] = []
    tr_off, te_off = 0, n_train
    for tr, te in zip(y_tr_parts, y_te_parts, strict=True):
        natural.append(
            np.concatenate(
                [np.arange(tr_off, tr_off + len(tr)), np.arange(te_off, te_off + len(te))]
            ).astype(np.int64)
        )
        tr_off += len(tr)
        te_off += len(te)
    return ArrayDataset(
        name="synthetic",
        x_train=np.concatenate(x_tr_parts).astype(np.float32),
        y_train=np.concatenate(y_tr_parts),
        x_test=np.concatenate(x_te_parts).astype(np.float32),
        y_test=np.concatenate(y_te_parts),
        num_classes=num_classes,
        mean=(),
        std=(),
        natural_partition=natural,
    )


# --------------------------------------------------------------------------------------------
# your own data: folder (ImageFolder layout), npz / npy arrays, hf_disk (datasets.save_to_disk)
# --------------------------------------------------------------------------------------------

OWN_DATA = ("folder", "npz", "hf_disk")
# your own data: at most this many classes (integer labels are class ids 0..max) and this
# image side (dataset.options.image_size); far above any real dataset, far below what
# exhausts memory (a label of 10^12 asked for 10^12 classes)
MAX_CLASSES = 1_000_000
MAX_IMAGE_SIDE = 8192
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
# columns looked for when hf_disk's image_column / label_column / client_column are not given
_HF_IMAGE_COLUMNS = ("image", "img", "pixel_values", "pixels", "x")
_HF_LABEL_COLUMNS = ("label", "labels", "fine_label", "target", "y")
_HF_CLIENT_COLUMNS = ("client", "client_id", "writer", "writer_id", "user", "user_id")


def _own_path(what: str, path: str | Path | None, data_dir: str | Path | None, hint: str) -> Path:
    """The file or folder ``dataset.path`` names (``data_dir`` as a fallback), which must exist."""
    given = path if path is not None else data_dir
    if given is None:
        raise DataError(f"{what}: no data given; pass --set dataset.path={hint}")
    p = Path(given).expanduser()
    if not p.exists():
        raise DataError(
            f"{what}: dataset.path={given} does not exist; pass --set dataset.path={hint}"
        )
    return p


def _image_size(what: str, image_size: int | Sequence[int] | None) -> tuple[int, int] | None:
    if image_size is None:
        return None
    if isinstance(image_size, int | np.integer):
        hw = (int(image_size), int(image_size))
    else:
        hw_list = [int(v) for v in image_size]
        if len(hw_list) != 2:
            raise DataError(
                f"{what}: image_size must be one int or [height, width], got {image_size}"
            )
        hw = (hw_list[0], hw_list[1])
    if min(hw) < 1 or max(hw) > MAX_IMAGE_SIDE:
        raise DataError(
            f"{what}: image_size must be between 1 and {MAX_IMAGE_SIDE} pixels, got {image_size}"
        )
    return hw


def _pil_to_chw(img: Any, where: str, what: str, size: tuple[int, int] | None) -> np.ndarray:
    """A PIL image as uint8 ``[C, H, W]``: grey stays one channel, anything else becomes RGB."""
    from PIL import Image

    try:
        grey = img.mode in ("1", "L", "LA", "I", "I;16", "F")
        conv = img.convert("L" if grey else "RGB")
        if size is not None and conv.size != (size[1], size[0]):
            conv = conv.resize((size[1], size[0]), Image.Resampling.BILINEAR)
        arr = np.asarray(conv, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise DataError(f"{what}: cannot decode image {where}: {exc}") from exc
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _stack_images(what: str, images: list[np.ndarray], names: list[str]) -> np.ndarray:
    """Stack ``[C, H, W]`` images (grey ones repeated to RGB when the set mixes both)."""
    if not images:
        return np.zeros((0, 1, 1, 1), dtype=np.uint8)
    channels = max(im.shape[0] for im in images)
    images = [np.repeat(im, channels, axis=0) if im.shape[0] != channels else im for im in images]
    sizes = {im.shape[1:] for im in images}
    if len(sizes) > 1:
        first: dict[tuple[int, ...], str] = {}
        for im, name in zip(images, names):
            first.setdefault(im.shape[1:], name)
        (a, sa), (b, sb) = list(first.items())[:2]
        raise DataError(
            f"{what}: images differ in size ({sa} is {a[0]}x{a[1]}, {sb} is {b[0]}x{b[1]}); "
            "pass --set dataset.options.image_size=SIDE (or [H, W]) to resize them all"
        )
    return np.stack(images)


def _as_samples(what: str, key: str, x: np.ndarray) -> np.ndarray:
    """Images as uint8 ``[N, C, H, W]`` (from ``[N, H, W]``, ``[N, H, W, C]`` with C in 1/3/4,
    or ``[N, C, H, W]`` with C = 1 or 3 -- which one a 4-D array is: channels last when its
    last axis is 1, 3 or 4 and its second is not 1 or 3; integers 0..255 or floats in [0, 1]);
    vectors ``[N, D]`` as float32."""
    x = np.asarray(x)
    real = np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)
    if x.dtype == object or not (real or x.dtype == np.bool_):
        raise DataError(f"{what}: {key} has dtype {x.dtype}; expected real numbers")
    if x.ndim == 2:
        if x.size and not bool(np.all(np.isfinite(x))):
            raise DataError(f"{what}: {key} holds NaN or Inf values; expected finite numbers")
        return np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4:
        if x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3):
            x = x.transpose(0, 3, 1, 2)  # NHWC -> NCHW (1 or 3 channels first stays NCHW)
    else:
        raise DataError(
            f"{what}: {key} has shape {x.shape}; expected [N, D] vectors or [N, H, W], "
            "[N, H, W, C], [N, C, H, W] images"
        )
    if x.dtype == np.uint8 or x.size == 0:
        return np.ascontiguousarray(x, dtype=np.uint8)
    lo, hi = float(x.min()), float(x.max())
    if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
        if lo < 0 or hi > 255:
            raise DataError(f"{what}: {key} holds integer pixels {lo:g}..{hi:g}; expected 0..255")
        return np.ascontiguousarray(x, dtype=np.uint8)
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo < 0.0 or hi > 1.0:
        raise DataError(
            f"{what}: {key} holds float pixels {lo:g}..{hi:g}; store uint8 0..255 or floats "
            "in [0, 1] (or flatten to [N, D] vectors, used as they are)"
        )
    return np.rint(x * 255.0).astype(np.uint8)


def _encode_labels(
    what: str, y_train: np.ndarray, y_test: np.ndarray, num_classes: int | None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Integer labels >= 0 stay as they are (classes ``0..max``); any other labels (strings,
    negative numbers) become the index of their value in the sorted list of distinct values."""
    both = np.concatenate([np.asarray(y_train).reshape(-1), np.asarray(y_test).reshape(-1)])
    if both.size == 0:
        raise DataError(f"{what}: no samples")
    if both.dtype.kind == "c" or both.dtype == object:
        raise DataError(f"{what}: labels have dtype {both.dtype}; expected integers or strings")
    if both.dtype.kind == "f" and not bool(np.all(np.isfinite(both))):
        raise DataError(f"{what}: labels hold NaN or Inf; give every sample a label")
    integral = np.issubdtype(both.dtype, np.integer) or (
        np.issubdtype(both.dtype, np.floating) and bool(np.all(np.mod(both, 1) == 0))
    )
    if integral and float(both.min()) >= 0:
        codes = both.astype(np.int64)
        found = int(codes.max()) + 1
    else:
        values, codes = np.unique(both, return_inverse=True)
        found = len(values)
        codes = codes.astype(np.int64).reshape(-1)
    if found > MAX_CLASSES or (num_classes is not None and num_classes > MAX_CLASSES):
        raise DataError(
            f"{what}: the labels ask for {max(found, num_classes or 0)} classes (integer labels "
            f"are class ids 0..max); at most {MAX_CLASSES}: number the classes 0..K-1"
        )
    if num_classes is None:
        num_classes = found
    elif num_classes < found:
        raise DataError(f"{what}: num_classes={num_classes} but the labels need {found}")
    n = int(np.asarray(y_train).size)
    return codes[:n], codes[n:], int(num_classes)


def _as_labels(what: str, key: str, y: np.ndarray) -> np.ndarray:
    """One label per sample: ``[N]`` (or ``[N, 1]``), not one-hot rows."""
    y = np.asarray(y)
    if y.ndim > 2 or (y.ndim == 2 and y.shape[1] != 1):
        raise DataError(
            f"{what}: {key} has shape {y.shape}; expected one label per sample, shape [N] "
            "(one-hot rows: y.argmax(1))"
        )
    return y.reshape(-1)


def _own_dataset(
    what: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray | None = None,
    y_test: np.ndarray | None = None,
    *,
    clients: np.ndarray | None = None,
    num_classes: int | None = None,
    encode: bool = True,
) -> ArrayDataset:
    """Check and convert user arrays; ``clients`` (one id per pooled sample, train then test)
    becomes ``natural_partition`` (one part per distinct id, in sorted id order)."""
    x_train = _as_samples(what, "x", x_train)
    y_train = _as_labels(what, "y", y_train)
    if x_train.shape[0] != y_train.shape[0]:
        raise DataError(f"{what}: x has {x_train.shape[0]} samples but y has {y_train.shape[0]}")
    if x_test is None:  # hyperfed pools train and test before partitioning: none is needed
        x_test, y_test = x_train[:0], y_train[:0]
    else:
        x_test = _as_samples(what, "x_test", x_test)
        y_test = _as_labels(what, "y_test", np.asarray(y_test))
        if x_test.shape[0] != y_test.shape[0]:
            raise DataError(
                f"{what}: x_test has {x_test.shape[0]} samples but y_test has {y_test.shape[0]}"
            )
        if x_test.shape[1:] != x_train.shape[1:]:
            raise DataError(
                f"{what}: x_test samples are {x_test.shape[1:]}, x samples {x_train.shape[1:]}"
            )
    assert y_test is not None
    if encode:
        y_train, y_test, num_classes = _encode_labels(what, y_train, y_test, num_classes)
    assert num_classes is not None
    if x_train.dtype == np.uint8:
        ds = _image_dataset(what, x_train, y_train, x_test, y_test, num_classes)
    else:
        ds = ArrayDataset(
            what,
            x_train,
            y_train.astype(np.int64),
            x_test.astype(np.float32),
            y_test.astype(np.int64),
            num_classes,
            (),
            (),
        )
    if clients is not None:
        ids = np.asarray(clients).reshape(-1)
        if ids.shape[0] != ds.num_train + ds.num_test:
            raise DataError(
                f"{what}: the client ids cover {ids.shape[0]} samples, the data has "
                f"{ds.num_train + ds.num_test} (train then test); give one id per sample"
            )
        _, inverse = np.unique(ids, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.flatnonzero(np.diff(inverse[order])) + 1
        ds.natural_partition = [p.astype(np.int64) for p in np.split(order, bounds)]
    return ds


def _load_npz(
    data_dir: str | Path | None = None,
    *,
    path: str | Path | None = None,
    num_classes: int | None = None,
) -> ArrayDataset:
    """Arrays ``x``, ``y`` (optional ``x_test``, ``y_test``; optional ``client`` and
    ``client_test``: a writer / user id per sample for ``partition.name = natural``) from one
    ``.npz`` file, or from a folder of ``.npy`` files of those names.

    Optional, with ``client``: ``split`` (and ``split_test``), each sample's split -- ``train``
    / ``val`` / ``test`` or 0 / 1 / 2 -- used instead of ``partition.test_fraction`` /
    ``val_fraction``. Optional ``mean`` and ``std`` (one float per image channel) replace the
    statistics computed from ``x``. ``hyperfed export --format npz`` writes all of these."""
    hint = "FILE.npz (arrays x, y; optional x_test, y_test, client, split, mean, std)"
    p = _own_path("npz", path, data_dir, hint)
    keys: tuple[str, ...] = ("x", "y", "x_test", "y_test", "client", "client_test")
    keys += ("split", "split_test", "mean", "std")
    arrays: dict[str, np.ndarray] = {}
    found_keys: list[str] = []  # what the file holds, to say when x or y is missing
    try:
        if p.is_dir():
            for key in keys:
                if (p / f"{key}.npy").is_file():
                    arrays[key] = np.load(p / f"{key}.npy", allow_pickle=False)
            where = f"{p}/"
            found_keys = sorted(f.stem for f in p.glob("*.npy"))
        else:
            z = np.load(p, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise DataError(
                    f"npz: {p} holds one array; save x and y together with np.savez(FILE, x=, y=) "
                    "or pass a folder holding x.npy and y.npy"
                )
            with z:
                arrays = {key: z[key] for key in keys if key in z.files}
                found_keys = list(z.files)
            where = str(p)
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zlib.error, zipfile.BadZipFile) as exc:
        # BadZipFile: a truncated or damaged .npz (not an OSError)
        raise DataError(
            f"npz: cannot read {p}: {exc} (not an .npz / .npy file, or truncated?)"
        ) from exc
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        found = ", ".join(found_keys) or "nothing"
        raise DataError(
            f"npz: {where} lacks {' and '.join(missing)} (found {found}); save it with "
            "np.savez(FILE, x=images_or_vectors, y=labels)"
        )
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"npz: {where} has only one of x_test / y_test; give both or neither")
    clients = arrays.get("client")
    if clients is not None and "x_test" in arrays:
        if "client_test" not in arrays:
            raise DataError(f"npz: {where} has client and x_test but no client_test; add it")
        clients = np.concatenate([clients.reshape(-1), arrays["client_test"].reshape(-1)])
    ds = _own_dataset(
        "npz",
        arrays["x"],
        arrays["y"],
        arrays.get("x_test"),
        arrays.get("y_test"),
        clients=clients,
        num_classes=num_classes,
    )
    if "split" in arrays:
        ds.natural_split = _npz_split(where, arrays, clients)
    for key in ("mean", "std"):
        if key in arrays:
            stats = np.asarray(arrays[key], dtype=np.float64).reshape(-1)
            channels = ds.x_train.shape[1] if ds.x_train.dtype == np.uint8 else 0
            if stats.size != channels or (key == "std" and not bool(np.all(stats > 0))):
                raise DataError(
                    f"npz: {where} {key} holds {stats.size} value(s); expected one per image "
                    f"channel ({channels}){', all > 0' if key == 'std' else ''}"
                )
            setattr(ds, key, tuple(float(v) for v in stats))
    return ds


_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


def _npz_split(where: str, arrays: dict[str, np.ndarray], clients: np.ndarray | None) -> np.ndarray:
    """The npz ``split`` (+ ``split_test``) array as codes 0 train / 1 val / 2 test per pooled
    sample."""
    if clients is None:
        raise DataError(
            f"npz: {where} has split but no client; the split is per client, add client ids"
        )
    parts = [arrays["split"].reshape(-1)]
    if "x_test" in arrays:
        if "split_test" not in arrays:
            raise DataError(f"npz: {where} has split and x_test but no split_test; add it")
        parts.append(arrays["split_test"].reshape(-1))
    raw = np.concatenate(parts)
    if raw.dtype.kind in "US":
        names = raw.astype(str)
        codes = np.array([_SPLIT_CODES.get(v, -1) for v in names], dtype=np.int64)
    else:
        codes = raw.astype(np.int64) if raw.dtype.kind in "iub" else np.full(raw.size, -1)
    if codes.size != clients.size:
        raise DataError(
            f"npz: {where} split covers {codes.size} samples, the data has {clients.size}; "
            "give one split per sample (train then test)"
        )
    bad = np.flatnonzero((codes < 0) | (codes > 2))
    if bad.size:
        raise DataError(
            f"npz: {where} split holds {raw[bad[0]]!r} (sample {bad[0]}); allowed: train, val, "
            "test or 0, 1, 2"
        )
    return codes


def _read_class_folders(
    root: Path, classes: list[str], size: tuple[int, int] | None
) -> tuple[list[np.ndarray], list[str], list[int]]:
    from PIL import Image

    images: list[np.ndarray] = []
    names: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        folder = root / cls
        if not folder.is_dir():
            continue
        for f in sorted(folder.rglob("*")):
            if f.suffix.lower() not in IMAGE_SUFFIXES or not f.is_file():
                continue
            try:
                with Image.open(f) as img:
                    images.append(_pil_to_chw(img, str(f), "folder", size))
            except (OSError, ValueError) as exc:
                raise DataError(f"folder: cannot decode image {f}: {exc}") from exc
            names.append(str(f))
            labels.append(label)
    return images, names, labels


def _load_folder(
    data_dir: str | Path | None = None,
    *,
    path: str | Path | None = None,
    image_size: int | Sequence[int] | None = None,
) -> ArrayDataset:
    """ImageFolder layout: ``root/<class>/<images>`` or ``root/train/<class>/...`` with an
    optional ``root/test/<class>/...``. Classes are the sub-folder names, sorted; grey images
    stay one channel; ``image_size`` (an int or [H, W]) resizes every image."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError as exc:
        raise DataError("folder: reading images needs Pillow; pip install pillow") from exc
    hint = "DIR holding one sub-folder of images per class"
    root = _own_path("folder", path, data_dir, hint)
    if not root.is_dir():
        raise DataError(
            f"folder: dataset.path={root} is not a folder; pass --set dataset.path={hint}"
        )
    size = _image_size("folder", image_size)
    train_root = root / "train" if (root / "train").is_dir() else root
    test_root = root / "test" if train_root != root and (root / "test").is_dir() else None
    classes = sorted(
        d.name for d in train_root.iterdir() if d.is_dir() and not d.name.startswith(".")
    )
    if not classes:
        raise DataError(f"folder: {train_root} has no class sub-folders; expected {hint}")
    x_tr, n_tr, y_tr = _read_class_folders(train_root, classes, size)
    if not x_tr:
        raise DataError(
            f"folder: no images ({', '.join(IMAGE_SUFFIXES)}) in the class folders of {train_root}"
        )
    x_te: list[np.ndarray] = []
    n_te: list[str] = []
    y_te: list[int] = []
    if test_root is not None:
        extra = sorted(
            d.name for d in test_root.iterdir() if d.is_dir() and d.name not in set(classes)
        )
        if extra:
            raise DataError(f"folder: {test_root} has classes {extra} that train/ lacks")
        x_te, n_te, y_te = _read_class_folders(test_root, classes, size)
    x_all = _stack_images("folder", x_tr + x_te, n_tr + n_te)
    n = len(x_tr)
    return _own_dataset(
        "folder",
        x_all[:n],
        np.asarray(y_tr, dtype=np.int64),
        x_all[n:] if test_root is not None else None,
        np.asarray(y_te, dtype=np.int64) if test_root is not None else None,
        num_classes=len(classes),
        encode=False,
    )


def _hf_column(
    what: str, columns: Sequence[str], given: str | None, auto: Sequence[str]
) -> str | None:
    if given is not None:
        if given not in columns:
            raise DataError(f"{what}: no column {given!r} (columns: {', '.join(columns)})")
        return given
    return next((c for c in auto if c in columns), None)


def _hf_images(what: str, split: Any, column: str, size: tuple[int, int] | None) -> np.ndarray:
    import datasets

    feature = split.features[column]
    if isinstance(feature, datasets.Image):
        images, names = [], []
        for i, img in enumerate(split[column]):
            images.append(_pil_to_chw(img, f"row {i}", what, size))
            names.append(f"row {i}")
        return _stack_images(what, images, names)
    try:
        return np.asarray(split.with_format("numpy")[column])
    except (ValueError, TypeError) as exc:
        raise DataError(
            f"{what}: column {column!r} is not an Image column nor equal-sized arrays ({exc})"
        ) from exc


def _load_hf_disk(
    data_dir: str | Path | None = None,
    *,
    path: str | Path | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    client_column: str | None = None,
    image_size: int | Sequence[int] | None = None,
) -> ArrayDataset:
    """A Hugging Face ``datasets`` Dataset or DatasetDict written by ``save_to_disk`` (read
    with ``load_from_disk``: never downloads). A DatasetDict needs a ``train`` split; ``test``
    is used when present. Columns are found by name (``image``/``img``/..., ``label``/...) or
    a ``ClassLabel`` / ``Image`` feature, unless given; a ``client_column`` (auto: ``client``,
    ``writer_id``, ...) gives ``partition.name = natural`` its writers."""
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            "hf_disk: reading a saved Hugging Face dataset needs the datasets package; "
            "pip install hyperfed[hf]"
        ) from exc
    hint = "DIR written by datasets' save_to_disk"
    root = _own_path("hf_disk", path, data_dir, hint)
    try:
        loaded = datasets.load_from_disk(str(root))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(
            f"hf_disk: {root} is not a dataset saved with save_to_disk ({exc})"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"hf_disk: {root} has splits {list(loaded)} but no 'train' split")
        train, test = loaded["train"], loaded.get("test")
    else:
        train, test = loaded, None
    cols = list(train.column_names)
    feats = train.features
    by_type = [c for c in cols if isinstance(feats[c], datasets.ClassLabel)]
    label = _hf_column("hf_disk", cols, label_column, [*by_type, *_HF_LABEL_COLUMNS])
    by_type = [c for c in cols if isinstance(feats[c], datasets.Image)]
    image = _hf_column("hf_disk", cols, image_column, [*by_type, *_HF_IMAGE_COLUMNS])
    if label is None or image is None:
        role = "label" if label is None else "image"
        raise DataError(
            f"hf_disk: cannot tell which column holds the {role}s (columns: {', '.join(cols)}); "
            f"pass --set dataset.options.{role}_column=NAME"
        )
    client = _hf_column("hf_disk", cols, client_column, _HF_CLIENT_COLUMNS)
    if test is not None:
        missing = [
            c for c in (image, label, client) if c is not None and c not in test.column_names
        ]
        if missing:
            raise DataError(f"hf_disk: the test split lacks column(s) {missing}")
    size = _image_size("hf_disk", image_size)
    num_classes = (
        feats[label].num_classes if isinstance(feats[label], datasets.ClassLabel) else None
    )
    clients = None
    if client is not None:
        parts = [np.asarray(train[client])] + (
            [np.asarray(test[client])] if test is not None else []
        )
        clients = np.concatenate(parts)
    return _own_dataset(
        "hf_disk",
        _hf_images("hf_disk", train, image, size),
        np.asarray(train[label]),
        _hf_images("hf_disk", test, image, size) if test is not None else None,
        np.asarray(test[label]) if test is not None else None,
        clients=clients,
        num_classes=num_classes,
    )


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------

DATASETS: dict[str, DatasetEntry] = {
    "digits": DatasetEntry(
        _load_digits,
        "scikit-learn 8x8 handwritten digits (1797 images, 1x8x8, 10 classes)",
        "bundled with scikit-learn (sklearn.datasets.load_digits); nothing to fetch",
    ),
    "mnist": DatasetEntry(
        _load_mnist,
        "MNIST handwritten digits (70000 images, 1x28x28, 10 classes)",
        "the four MNIST IDX files (gzipped or not) in dataset.data_dir, $HYPERFED_DATA or <dir>/mnist",
    ),
    "fashion_mnist": DatasetEntry(
        _load_fashion_mnist,
        "Fashion-MNIST Zalando articles (70000 images, 1x28x28, 10 classes)",
        f"Debian package dataset-fashion-mnist ({FASHION_MNIST_SYSTEM_DIR}) or the four IDX "
        "files in dataset.data_dir / $HYPERFED_DATA",
    ),
    "emnist": DatasetEntry(
        _load_emnist,
        "EMNIST byclass handwritten characters (814255 images, 1x28x28, 62 classes)",
        "emnist-byclass-*-idx?-ubyte(.gz) from NIST's EMNIST 'gzip' release in dataset.data_dir / "
        "$HYPERFED_DATA",
    ),
    "cifar10": DatasetEntry(
        _load_cifar10,
        "CIFAR-10 natural images (60000 images, 3x32x32, 10 classes)",
        "cifar-10-python.tar.gz or cifar-10-batches-py/ in dataset.data_dir / $HYPERFED_DATA",
    ),
    "cifar100": DatasetEntry(
        _load_cifar100,
        "CIFAR-100 natural images, fine labels (60000 images, 3x32x32, 100 classes)",
        "cifar-100-python.tar.gz or cifar-100-python/ in dataset.data_dir / $HYPERFED_DATA",
    ),
    "tiny_imagenet": DatasetEntry(
        _load_tiny_imagenet,
        "Tiny-ImageNet-200 (100000 train + 10000 val-as-test images, 3x64x64, 200 classes)",
        "extracted tiny-imagenet-200/ folder in dataset.data_dir / $HYPERFED_DATA (needs Pillow)",
    ),
    "synthetic": DatasetEntry(
        _load_synthetic,
        "LEAF Synthetic(alpha, beta) vectors, naturally partitioned per user (float32 [N, dim])",
        "generated in memory from a seed; nothing to fetch",
    ),
    "folder": DatasetEntry(
        _load_folder,
        "your images, one sub-folder per class (ImageFolder layout; optional train/ and test/)",
        "dataset.path = the folder (needs Pillow); dataset.options.image_size resizes",
    ),
    "npz": DatasetEntry(
        _load_npz,
        "your arrays: x (images or vectors), y (labels); optional x_test, y_test, client",
        "dataset.path = an .npz file (np.savez) or a folder of x.npy, y.npy",
    ),
    "hf_disk": DatasetEntry(
        _load_hf_disk,
        "a Hugging Face datasets dataset saved with save_to_disk (image + label columns)",
        "dataset.path = the folder save_to_disk wrote; needs pip install hyperfed[hf]",
    ),
}


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
