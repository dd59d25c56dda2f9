"""The built-in datasets: files already on disk (never downloaded) or generated in memory.

``digits`` (bundled with scikit-learn), ``mnist`` / ``fashion_mnist`` / ``emnist`` (IDX files),
``cifar10`` / ``cifar100`` (python pickles, extracted or as the archive), ``tiny_imagenet``
(the extracted folder) and ``synthetic`` (LEAF-style Synthetic(alpha, beta)). Each loader looks
for its files in a fixed search order and raises a one-line :class:`DataError` naming the
folders it searched and how to obtain the data when they are missing, truncated or of the wrong
format.

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
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from hyperfed.data.datasets import ArrayDataset, DataError, DatasetEntry, image_dataset

__all__ = ["BUILTIN_DATASETS", "EMNIST_SPLITS", "ENV_VAR", "FASHION_MNIST_SYSTEM_DIR"]

ENV_VAR = "HYPERFED_DATA"
_HOW_TO_PASS = f"pass --set dataset.data_dir=DIR or set {ENV_VAR} to a folder holding"


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


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
    return image_dataset("digits", x_tr, y_tr, x_te, y_te, 10)


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
    return image_dataset(
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
    return image_dataset(
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
    return image_dataset(
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
    return image_dataset(name, *_cifar_concat(name, parts), num_classes)


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
    return image_dataset(name, *_cifar_concat(name, parts), num_classes)


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
            return image_dataset("tiny_imagenet", x_tr, y_tr, x_te, y_te, num_classes)
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
    return image_dataset("tiny_imagenet", x_tr, y_tr, x_te, y_te, len(wnids))


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
# the table (hyperfed.data.sources.DATASETS starts with these, in this order)
# --------------------------------------------------------------------------------------------

BUILTIN_DATASETS: dict[str, DatasetEntry] = {
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
}
