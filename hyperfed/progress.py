"""Progress of long phases (distillation, server training, ...) without UI imports.

Code that runs a phase a user may wait through opens it with :func:`phase` and advances it::

    with phase("distilling synthetic set: clients 0-3", total=iters) as p:
        for t in range(iters):
            ...
            p.advance()

Nothing is shown unless the application installed a :class:`Reporter` with :func:`reporting`
(``hyperfed run`` does: nested bars under the round bar on a terminal, a
:class:`LineReporter` off one). Without a reporter a phase costs a function call, so the
algorithms, Flower clients and sweep workers run as before. This module imports nothing from
hyperfed: every layer may use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol


class Phase(Protocol):
    """One open phase: ``advance`` by finished units of ``total``; ``close`` when done."""

    def advance(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class Reporter(Protocol):
    """Shows phases: ``open`` one (``total`` None: no known length) nested ``depth`` deep."""

    def open(self, label: str, total: int | None, depth: int) -> Phase: ...


@dataclass(frozen=True)
class PhaseCost:
    """What a heavy phase will cost, estimated before the run (a client role's
    ``heavy_phases(group)``): ``what`` it does, ``seconds`` on this machine, and whether it
    runs once (the setup) or ``per_round``."""

    what: str
    seconds: float
    per_round: bool = False


class _Silent:
    def advance(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


_SILENT = _Silent()
# a phase shorter than this prints no line off a terminal (LineReporter's default quiet_s)
QUIET_S = 2.0
_reporter: Reporter | None = None
_depth = 0


@contextmanager
def reporting(reporter: Reporter | None) -> Iterator[None]:
    """Phases opened inside go to ``reporter`` (None: to nothing)."""
    global _reporter
    before = _reporter
    _reporter = reporter
    try:
        yield
    finally:
        _reporter = before


def active() -> bool:
    """Whether a reporter is installed (a caller may skip work done only for progress)."""
    return _reporter is not None


@contextmanager
def phase(label: str, total: int | None = None) -> Iterator[Phase]:
    """A phase of ``total`` units (None: unknown), reported while the block runs."""
    global _depth
    if _reporter is None:
        yield _SILENT
        return
    handle = _reporter.open(label, total, _depth)
    _depth += 1
    try:
        yield handle
    finally:
        _depth -= 1
        handle.close()


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class LineReporter:
    """Plain lines for logs (off a terminal): a phase that has run ``quiet_s`` prints a line
    at every ``step`` (10%) of its total, and at least every ``every_s`` seconds (a thread
    prints "still running" for a phase without ticks), with the elapsed time and an ETA from
    the rate so far; a phase that printed, or ran ``quiet_s``, ends with a "done" line."""

    def __init__(
        self,
        write: Callable[[str], None],
        *,
        step: float = 0.1,
        every_s: float = 30.0,
        quiet_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.write = write
        self.step = step
        self.every_s = every_s
        self.quiet_s = QUIET_S if quiet_s is None else quiet_s
        self.clock = clock
        self.lock = threading.Lock()
        self.open_phases: list[_LinePhase] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, label: str, total: int | None, depth: int) -> _LinePhase:
        p = _LinePhase(self, label, total)
        with self.lock:
            self.open_phases.append(p)
            if self._thread is None and self.every_s > 0:
                self._thread = threading.Thread(target=self._heartbeat, daemon=True)
                self._thread.start()
        return p

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s)):
            with self.lock:
                phases = list(self.open_phases)
            for p in phases:
                p.maybe_print(heartbeat=True)

    def close(self) -> None:
        """Stop the heartbeat thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def __enter__(self) -> LineReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LinePhase:
    def __init__(self, owner: LineReporter, label: str, total: int | None) -> None:
        self.owner = owner
        self.label = label
        self.total = total
        self.done = 0
        self.t0 = self.last = owner.clock()
        self.mark = 0  # the last step printed (in units of owner.step)
        self.printed = 0

    def status(self, now: float) -> str:
        elapsed = now - self.t0
        if not self.total:
            return f"{self.label}: running, {duration(elapsed)}"
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        rest = f", eta {duration(eta)}" if eta is not None else ""
        return (
            f"{self.label}: {self.done}/{self.total} ({100 * self.done // self.total}%), "
            f"{duration(elapsed)}{rest}"
        )

    def maybe_print(self, heartbeat: bool = False) -> None:
        now = self.owner.clock()
        with self.owner.lock:
            due = now - self.last >= self.owner.every_s
            mark = self.mark
            if self.total and not heartbeat:
                mark = int(self.done / self.total / self.owner.step + 1e-9)
                if now - self.t0 < self.owner.quiet_s:
                    self.mark = mark  # steps passed while quiet are not printed late
                due = due or mark > self.mark
            if not due or self not in self.owner.open_phases:
                return
            self.mark, self.last = mark, now
            self.printed += 1
        self.owner.write(self.status(now))

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.maybe_print()

    def close(self) -> None:
        now = self.owner.clock()
        with self.owner.lock:
            if self in self.owner.open_phases:
                self.owner.open_phases.remove(self)
        if self.printed or now - self.t0 >= self.owner.quiet_s:
            self.owner.write(f"{self.label}: done in {duration(now - self.t0)}")
