"""A run is a directory (DESIGN contract 5).

``config.toml`` (resolved), ``metrics.jsonl`` (one JSON object per evaluated round),
``checkpoint.pt`` (written atomically: temp file + rename), ``summary.md`` and plots.

A checkpoint file is a one-line JSON header (format, SHA-256 and size of the payload, SHA-256
of the ``config.toml`` it belongs to) followed by a ``torch.save`` payload that is loaded with
``weights_only=True``: a corrupt, truncated or foreign checkpoint is refused, never unpickled.
One process at a time owns a run directory (``flock`` on the folder itself; no lock file).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hyperfed.errors import HyperfedError

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.pt"
SUMMARY = "summary.md"
CHECKPOINT_FORMAT = "hyperfed-checkpoint-1"


class RunDirError(HyperfedError, ValueError):
    """A run directory that cannot be used as asked (locked, nothing to resume, a bad
    checkpoint); the message says what to do instead."""


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# the checkpoint's header line, padded to this length (written after the payload it describes)
_HEADER_BYTES = 511


class _HashingWriter:
    """A write-only stream that hashes and counts what passes through to ``file``."""

    def __init__(self) -> None:
        self.file: Any = None
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return int(self.file.write(data))

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


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

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
        atomic_write_bytes(self.path / CONFIG, lambda f: f.write(config_toml.encode()))
        (self.path / METRICS).write_text("")

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
        """Write the checkpoint atomically; returns its size in bytes. torch.save streams into
        the file through a hash, and the header line (padded to a fixed length) is written over
        its placeholder at the end: the serialized state is never held in memory (a pFedKT
        HN(large) federation's state is 6.6 GB, and its buffer had doubled the run's peak)."""
        header: dict[str, Any] = {
            "format": CHECKPOINT_FORMAT,
            "config_sha256": self.config_sha256(),
        }
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

        atomic_write_bytes(self.path / CHECKPOINT, write)
        return _HEADER_BYTES + 1 + stream.size

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The last checkpoint (None if there is none), verified before it is read."""
        p = self.path / CHECKPOINT
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

    def truncate_metrics(self, last_round: int) -> None:
        """Keep complete records up to ``last_round`` (a killed run may leave more, or half a line)."""
        keep = [r for r in self.metrics() if r["round"] <= last_round]
        text = "".join(json.dumps(r) + "\n" for r in keep)
        atomic_write_bytes(self.path / METRICS, lambda f: f.write(text.encode()))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path) / METRICS
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a kill: everything after it is untrusted
    return out
