"""A run is a directory (DESIGN contract 5).

``config.toml`` (resolved), ``metrics.jsonl`` (one JSON object per evaluated round),
``machine.jsonl`` (the machine each start or resume ran on), ``checkpoint.pt`` (written
atomically: temp file + rename), ``summary.md`` and plots.

A checkpoint file is a one-line JSON header (format, SHA-256 and size of the payload, SHA-256
of the ``config.toml`` it belongs to) followed by a ``torch.save`` payload that is loaded with
``weights_only=True``: a corrupt, truncated or foreign checkpoint is refused, never unpickled.
One process at a time owns a run directory (``flock`` on the folder itself; no lock file).
The round driver writes its checkpoints in the background (:meth:`RunDir.save_checkpoint_async`):
the state is copied at the checkpoint's moment and one writer thread streams the copy to disk
while the next rounds run.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import io
import json
import logging
import math
import os
import platform
import re
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hyperfed.errors import HyperfedError

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.pt"
MACHINE = "machine.jsonl"
SUMMARY = "summary.md"
CHECKPOINT_FORMAT = "hyperfed-checkpoint-1"
# a run's files hyperfed writes through a temp file (atomic_write_bytes); server_state.pt: the
# Flower server's final state (hyperfed.deploy.server.SERVER_STATE)
ATOMIC_FILES = (CHECKPOINT, CONFIG, METRICS, "server_state.pt")
# the temp file of one of them: mkstemp's ".<name>." prefix and its 8 random characters
_TEMP_NAME = re.compile(
    r"\.(" + "|".join(re.escape(name) for name in ATOMIC_FILES) + r")\.[a-z0-9_]{8}"
)


class RunDirError(HyperfedError, ValueError):
    """A run directory that cannot be used as asked (locked, nothing to resume, a bad
    checkpoint); the message says what to do instead."""


class CheckpointWriteError(RunDirError):
    """A checkpoint that could not be written (disk full, quota, I/O error); the previous
    checkpoint is left as it was."""


def is_temp_file(name: str) -> bool:
    """Whether ``name`` is the temp file of one of a run's atomically written files."""
    return _TEMP_NAME.fullmatch(name) is not None


def remove_stale_temps(path: str | Path) -> list[str]:
    """Delete the temp files a killed writer left in run directory ``path`` (only names of
    hyperfed's own temp pattern, :func:`is_temp_file`); returns their names. Call it while
    holding the directory: a live writer's temp file matches the pattern too."""
    removed: list[str] = []
    folder = Path(path)
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        if is_temp_file(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return sorted(removed)


def check_new_run(path: str | Path, force: bool, resume: str) -> None:
    """Refuse to start a new run in ``path`` when it already holds one (metrics or a
    checkpoint) or any other file, unless ``force``: a new run writes config.toml,
    metrics.jsonl and summary.md over what is there. ``resume`` is the command-line way to
    continue the run there (e.g. ``--resume DIR``). Serves ``hyperfed run`` and
    ``hyperfed flower local / sim`` alike."""
    folder = Path(path)
    if force or not folder.is_dir():
        return
    names = sorted(p.name for p in folder.iterdir() if not is_temp_file(p.name))
    if METRICS in names or CHECKPOINT in names:
        raise RunDirError(
            f"--out {folder} already holds a run; {resume} continues it, --force replaces it, "
            "or choose another --out"
        )
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise RunDirError(
            f"--out {folder} is not empty ({shown}); a run writes config.toml, metrics.jsonl "
            "and summary.md there: --force writes over them, or choose another --out"
        )


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# the checkpoint's header line, padded to this length (written after the payload it describes)
_HEADER_BYTES = 511


class _HashingWriter:
    """A write-only stream that hashes and counts what passes through to ``file``; keeps the
    OSError of a failed write (torch.save reports it as a RuntimeError)."""

    def __init__(self, hashing: bool = True) -> None:
        self.file: Any = None
        self.sha256 = hashlib.sha256()
        self.hashing = hashing
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        if self.hashing:
            self.sha256.update(data)
        self.size += len(data)
        try:
            return int(self.file.write(data))
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.file.flush()


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` (JSON has no NaN/Inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_failure(e: BaseException, stream_error: OSError | None) -> str | None:
    """Why writing a file failed, if ``e`` is a write failure (a full disk, a quota, an I/O
    error: torch.save turns the stream's OSError into a RuntimeError, "unexpected pos" or
    "file write failed"); None for anything else (a bug, to keep its traceback)."""
    error = stream_error or (e if isinstance(e, OSError) else None)
    if error is None and "write failed" not in str(e) and "unexpected pos" not in str(e):
        return None
    return (error.strerror or str(error)) if error is not None else _first_line(e)


def atomic_torch_save(path: Path, obj: Any, what: str) -> int:
    """``torch.save(obj)`` into ``path`` atomically (:func:`atomic_write_bytes`), streamed;
    returns the bytes written. A write failure (a full disk) raises a one-line
    :class:`CheckpointWriteError` naming ``what``; the previous file is left as it was."""
    stream = _HashingWriter(hashing=False)

    def write(f: Any) -> None:
        stream.file = f
        torch.save(obj, stream)  # type: ignore[arg-type]  # write() and flush() suffice

    try:
        atomic_write_bytes(path, write)
    except (OSError, RuntimeError) as e:
        why = _write_failure(e, stream.error)
        if why is None:
            raise
        kept = f"the previous {what} is kept" if path.exists() else f"no {what} written yet"
        raise CheckpointWriteError(f"cannot write the {what} {path} ({why}); {kept}") from e
    return stream.size


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Write through a temp file in the same folder, fsync, then rename over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a run directory is shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# values a checkpoint holds that nothing can change in place: a snapshot keeps them as they are
_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def snapshot_state(state: Any) -> Any:
    """A copy of checkpoint ``state`` that training cannot change (it updates parameters and
    optimizer moments in place): dicts, lists and tuples rebuilt, every tensor storage copied
    once into host memory (one copy per storage: tensors that share one, or one tensor named
    twice, still share their copy, so ``torch.save`` writes what it would have written of the
    live state). A tensor on an accelerator is copied to the CPU here, not to a second place
    on the device (``load_checkpoint`` maps everything to the CPU anyway)."""
    return _snapshot(state, {})


def _snapshot(obj: Any, memo: dict[Any, Any]) -> Any:
    if isinstance(obj, _IMMUTABLE) or type(obj) is torch.Size:
        return obj
    key = id(obj)
    if key in memo:  # the same object twice: pickle writes it once, so does the snapshot
        return memo[key][1]
    if isinstance(obj, torch.Tensor):
        out = _snapshot_tensor(obj, memo)
    elif type(obj) in (dict, OrderedDict):
        out = type(obj)((k, _snapshot(v, memo)) for k, v in obj.items())
    elif type(obj) in (list, tuple):
        out = type(obj)(_snapshot(v, memo) for v in obj)
    else:  # anything else a state may hold (a set, a namedtuple): a deep copy of its own
        out = copy.deepcopy(obj)
    memo[key] = (obj, out)  # obj kept alive: its id stays its own while the memo lives
    return out


def _snapshot_tensor(t: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
    if not plain or t.is_quantized or t.is_conj() or t.is_neg() or t.device.type == "meta":
        return copy.deepcopy(t)  # sparse, quantized, a subclass: torch's own copy
    storage = t.untyped_storage()
    key = ("storage", storage.device, storage.data_ptr(), storage.nbytes())
    if key not in memo:
        # UntypedStorage.cpu() copies only off the CPU; on it, clone()
        memo[key] = (storage, storage.clone() if storage.device.type == "cpu" else storage.cpu())
    out = torch.empty(0, dtype=t.dtype).set_(memo[key][1], t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad)


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # the background checkpoint write (save_checkpoint_async): at most one at a time
        self._writer: threading.Thread | None = None
        self._write_result: tuple[int, float, BaseException | None] = (0, 0.0, None)
        # (bytes, seconds) of the last checkpoint known written: set by save_checkpoint and,
        # for a background write, when it is waited for (so the driver reads it at one moment)
        self.last_checkpoint: tuple[int, float] | None = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[RunDir]:
        """Hold the run directory for this process (``flock`` on the folder itself, so no file
        is left behind); a second process is refused at once. A folder made here and left empty
        (the run failed before writing anything) is removed again."""
        made = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise RunDirError(
                f"cannot use {self.path} as a run directory ({e.strerror}); choose another --out"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(
                f"{self.path} is in use by another hyperfed process; wait for it to finish "
                "or choose another --out"
            ) from None
        try:
            yield self
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            if made and not any(self.path.iterdir()):
                self.path.rmdir()

    def create(self, config_toml: str) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        # a checkpoint left by an earlier run in this folder is not this run's to resume
        (self.path / CHECKPOINT).unlink(missing_ok=True)
        remove_stale_temps(self.path)  # half-written files of a killed earlier run
        atomic_write_bytes(self.path / CONFIG, lambda f: f.write(config_toml.encode()))
        (self.path / METRICS).write_text("")
        (self.path / MACHINE).write_text("")

    def note_machine(self, start_round: int, device: str | torch.device) -> None:
        """Append the machine this start (``start_round`` 0) or resume runs on to
        ``machine.jsonl``: same-seed runs on different CPUs or torch builds part by float
        rounding after a few rounds, and ``hyperfed report`` says when its rows span machines."""
        line = {"from_round": start_round, **machine_info(device)}
        try:
            with open(self.path / MACHINE, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # an annotation: a full disk here is the checkpoint's to report
            logging.getLogger("hyperfed").warning("could not write %s: %s", MACHINE, e.strerror)

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS, "a") as f:
            f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            f.flush()

    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def config_sha256(self) -> str:
        p = self.path / CONFIG
        return _sha256(p.read_bytes()) if p.exists() else ""

    def save_checkpoint(self, state: dict[str, Any]) -> int:
        """Write the checkpoint atomically, now (after a background write still in flight);
        returns its size in bytes. A write failure raises :class:`CheckpointWriteError`."""
        self.wait_checkpoint()
        self.last_checkpoint = self._timed_write(state, self.config_sha256())
        return self.last_checkpoint[0]

    def save_checkpoint_async(self, state: dict[str, Any]) -> None:
        """Write the checkpoint in the background: wait for the previous write (at most one in
        flight; its failure raises here), copy ``state`` (:func:`snapshot_state`: the caller
        may change it as soon as this returns) and hand the copy to a writer thread.
        :meth:`wait_checkpoint` waits for it and raises its failure. The write is as atomic
        as :meth:`save_checkpoint`'s: a kill at any moment leaves the previous checkpoint or
        this one. A subclass that writes its own way (overrides ``save_checkpoint``: the
        Flower server's logs a failure and goes on) is called here, in this thread."""
        if type(self).save_checkpoint is not RunDir.save_checkpoint:
            self.save_checkpoint(state)
            return
        self.wait_checkpoint()
        snapshot, config = snapshot_state(state), self.config_sha256()

        def write() -> None:
            try:
                self._write_result = (*self._timed_write(snapshot, config), None)
            except BaseException as e:  # handed to the main thread by wait_checkpoint
                self._write_result = (0, 0.0, e)

        # not a daemon: an interpreter that exits while it writes waits for it
        self._writer = threading.Thread(target=write, name="hyperfed-checkpoint")
        self._writer.start()

    def wait_checkpoint(self) -> int | None:
        """Wait for the background checkpoint write, if one is in flight, and raise its error
        (a :class:`CheckpointWriteError`, with the message :meth:`save_checkpoint` gives) in
        this thread; returns its size in bytes (None: no write was in flight)."""
        if self._writer is None:
            return None
        self._writer.join()
        self._writer = None
        (size, seconds, error), self._write_result = self._write_result, (0, 0.0, None)
        if error is not None:
            raise error
        self.last_checkpoint = (size, seconds)
        return size

    def _timed_write(self, state: dict[str, Any], config_sha256: str) -> tuple[int, float]:
        """:meth:`_write_checkpoint`, with its size in bytes and the seconds it took."""
        started = time.monotonic()
        size = self._write_checkpoint(state, config_sha256)
        return size, time.monotonic() - started

    def _write_checkpoint(self, state: dict[str, Any], config_sha256: str) -> int:
        """The write itself. torch.save streams into the file through a hash, and the header
        line (padded to a fixed length) is written over its placeholder at the end: the
        serialized state is never held in memory (a pFedKT HN(large) federation's state is
        6.6 GB, and its buffer had doubled the run's peak)."""
        header: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "config_sha256": config_sha256}
        stream = _HashingWriter()

        def write(f: Any) -> None:
            f.write(b" " * _HEADER_BYTES + b"\n")  # the header's place
            stream.file = f
            torch.save(state, stream)  # type: ignore[arg-type]  # write() and flush() suffice
            header.update(sha256=stream.sha256.hexdigest(), size=stream.size)
            head = json.dumps(header).encode()
            assert len(head) <= _HEADER_BYTES, "checkpoint header longer than its place"
            f.seek(0)
            f.write(head.ljust(_HEADER_BYTES) + b"\n")
            f.seek(0, os.SEEK_END)

        try:
            atomic_write_bytes(self.path / CHECKPOINT, write)
        except (OSError, RuntimeError) as e:
            # a full disk: torch.save turns the stream's OSError into a RuntimeError
            # ("unexpected pos", "file write failed"); the temp file is gone, the old
            # checkpoint untouched
            why = _write_failure(e, stream.error)
            if why is None:
                raise  # not a write failure: a bug, with its traceback
            kept = (
                "the previous checkpoint is kept"
                if (self.path / CHECKPOINT).exists()
                else "no checkpoint written yet"
            )
            raise CheckpointWriteError(
                f"cannot write the checkpoint in {self.path} ({why}); {kept}"
            ) from e
        return _HEADER_BYTES + 1 + stream.size

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The last checkpoint (None if there is none), verified before it is read."""
        p = self.path / CHECKPOINT
        remove_stale_temps(self.path)  # a killed writer's half-written files: never read
        if not p.exists():
            return None
        bad = f"checkpoint {p} is unusable"
        restart = f"start the run anew with --out {self.path} --force"
        with p.open("rb") as f:
            line = f.readline(_HEADER_BYTES + 1)
            try:
                header = json.loads(line) if line.endswith(b"\n") else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                header = None
            if not isinstance(header, dict) or header.get("format") != CHECKPOINT_FORMAT:
                raise RunDirError(f"{bad}: not a hyperfed checkpoint (empty or foreign); {restart}")
            payload = f.read()  # the one copy of the state in memory while it is checked
        if len(payload) != header.get("size") or _sha256(payload) != header.get("sha256"):
            raise RunDirError(f"{bad}: truncated or corrupt (checksum mismatch); {restart}")
        if header.get("config_sha256") != self.config_sha256():
            raise RunDirError(
                f"{bad}: config.toml changed since it was written; restore the config or {restart}"
            )
        try:
            return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as e:  # the unpickler refuses anything but tensors and containers
            raise RunDirError(f"{bad}: it holds more than tensors ({e}); {restart}") from None

    def rebind_config(self, config_toml: str) -> None:
        """Write ``config_toml`` as the run's config and point the checkpoint (verified before)
        at it: ``hyperfed run --resume DIR --set rounds=N`` extending a run. Only the header's
        config hash changes, patched in place (a hash for a hash: the same length), so the
        state is neither read nor copied again."""
        path = self.path / CHECKPOINT
        with path.open("rb") as f:
            line = f.readline(_HEADER_BYTES + 1)
        old = json.loads(line)["config_sha256"]
        atomic_write_bytes(self.path / CONFIG, lambda f: f.write(config_toml.encode()))
        key = b'"config_sha256": '
        patched = line.replace(
            key + json.dumps(old).encode(), key + json.dumps(self.config_sha256()).encode(), 1
        )
        assert len(patched) == len(line) and patched != line or old == self.config_sha256()
        with path.open("r+b") as out:
            out.write(patched)
            out.flush()
            os.fsync(out.fileno())

    def truncate_metrics(self, last_round: int) -> None:
        """Keep complete records up to ``last_round`` (a killed run may leave more, or half a line)."""
        keep = [r for r in self.metrics() if r["round"] <= last_round]
        text = "".join(json.dumps(r) + "\n" for r in keep)
        atomic_write_bytes(self.path / METRICS, lambda f: f.write(text.encode()))


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0].strip() if lines else type(e).__name__


def _cpu_model() -> str:
    """The CPU's name with its family / model / stepping (a virtual machine's generic name,
    "Intel(R) Xeon(R) Processor", covers several generations)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Hardware", "cpu family", "model", "stepping"):
                    fields.setdefault(key, value.strip())
                elif not key and fields:
                    break  # the first processor's block is enough
    except OSError:
        pass
    name = fields.get("model name") or fields.get("Hardware")
    if not name:
        return platform.processor() or platform.machine() or "unknown"
    ids = [
        f"{k.split()[-1]} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields
    ]
    return f"{name} ({' '.join(ids)})" if ids else name


def _vector_isa() -> str:
    """The widest vector instruction set torch's CPU kernels may use here (its own probe)."""
    with contextlib.suppress(Exception):
        return str(torch.backends.cpu.get_cpu_capability())
    return "unknown"


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What decides a run's float rounding: CPU model and vector ISA, core count, accelerator,
    torch and Python versions (no host name)."""
    dev = torch.device(device)
    accelerator = ""
    if dev.type == "cuda" and torch.cuda.is_available():
        accelerator = torch.cuda.get_device_name(dev)
    return {
        "cpu": _cpu_model(),
        "isa": _vector_isa(),
        "cores": os.cpu_count(),
        "device": dev.type,
        "accelerator": accelerator,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def machine_label(line: dict[str, Any]) -> str:
    """What makes two machine.jsonl lines "the same machine" for float rounding: CPU, vector
    ISA, accelerator (or a device other than the CPU), torch build."""
    device = line.get("accelerator") or ("" if line.get("device") == "cpu" else line.get("device"))
    parts = (line.get("cpu"), line.get("isa"), device, line.get("torch"))
    return ", ".join(str(p) for p in parts if p)


def read_machines(path: str | Path) -> list[dict[str, Any]]:
    """``machine.jsonl``'s lines (runs recorded before it existed: none). A line that is not
    a JSON object is skipped: the file only annotates a run, it decides nothing."""
    p = Path(path) / MACHINE
    if not p.is_file():
        return []
    return [item for item in _json_lines(p) if isinstance(item, dict)]


def _json_lines(p: Path) -> Iterator[Any]:
    """Each line of a JSON-lines file parsed, or ``None`` for a line that does not parse
    (JSONDecodeError, UnicodeDecodeError: binary garbage); nothing for a missing file."""
    if not p.exists():
        return
    for line in p.read_bytes().splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            yield None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for record in _json_lines(Path(path) / METRICS):
        # None: a line cut by a kill, everything after it untrusted; not a record: edited by
        # hand, or garbage that parses
        if record is None or not is_record(record):
            break
        out.append(record)
    return out


# what every metrics record holds, and report / resume read: the round, the accuracies
_RECORD_NUMBERS = ("mean_acc", "weighted_acc", "min_acc", "max_acc", "std_acc")


def is_record(record: Any) -> bool:
    """Whether ``record`` (one parsed line of metrics.jsonl) has the shape hyperfed writes: a
    whole-number ``round`` and the accuracies as numbers (None: a NaN, JSON has none)."""
    if not isinstance(record, dict):
        return False
    rnd = record.get("round")
    if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
        return False
    return all(
        k in record and (record[k] is None or type(record[k]) in (int, float))
        for k in _RECORD_NUMBERS
    )
