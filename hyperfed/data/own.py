"""Your own data, read from ``dataset.path`` (passed as the loader option ``path``).

``npz`` (arrays ``x``, ``y``, optional ``x_test``, ``y_test``, ``client``, ``split``, ``mean``,
``std``), ``folder`` (one sub-folder of images per class) and ``hf_disk`` (a Hugging Face dataset
written by ``save_to_disk``; needs the optional ``datasets`` package). A ``client`` id per sample
becomes ``natural_partition``; an npz ``split`` per sample (``train`` / ``val`` / ``test``,
or 0 / 1 / 2) becomes ``natural_split``, which fixes each client's split under
``partition.name = natural`` (what ``hyperfed export --format npz`` writes).
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hyperfed.data.datasets import ArrayDataset, DataError, DatasetEntry, image_dataset

__all__ = ["IMAGE_SUFFIXES", "MAX_CLASSES", "MAX_IMAGE_SIDE", "OWN_DATA", "OWN_DATASETS"]

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
        ds = image_dataset(what, x_train, y_train, x_test, y_test, num_classes)
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
# the table (hyperfed.data.sources.DATASETS ends with these, in this order)
# --------------------------------------------------------------------------------------------

OWN_DATASETS: dict[str, DatasetEntry] = {
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
