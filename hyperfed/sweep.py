"""``hyperfed sweep``: a grid of runs (config keys x seeds), K at a time, resumable.

A sweep is a folder. ``sweep.json`` holds the grid (config file, ``--set`` axes, seeds); each
point of the grid is one ordinary run directory below it, named after the values that vary
(``algorithm.name=fedavg,seed=1``). Runs are separate ``hyperfed run`` processes, ``parallel``
at a time, each with ``cores // parallel`` torch threads so they share the machine instead of
fighting over it. Calling the same sweep again resumes it: finished runs (a metrics record
at the last round) are skipped, interrupted ones continue from their checkpoint, the others
start. ``hyperfed report SWEEP`` then groups the runs that differ only by seed.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyperfed.errors import HyperfedError
from hyperfed.runtime.cores import CORES_ENV
from hyperfed.runtime.rundir import CHECKPOINT, read_metrics

MANIFEST = "sweep.json"
# live_run reads this much of a running run's metrics.jsonl, from its end (the last record)
TAIL_BYTES = 1 << 18


class SweepError(HyperfedError, ValueError):
    """A sweep that cannot run as asked (one line, for the CLI)."""


def split_values(text: str) -> list[str]:
    """``a,b,[c,d],"e,f"`` -> ``["a", "b", "[c,d]", '"e,f"']``: commas inside brackets or
    quotes do not separate values."""
    values, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(cur.strip())
            cur = ""
            continue
        cur += ch
    values.append(cur.strip())
    return [v for v in values if v]


def parse_axes(sets: list[str]) -> list[tuple[str, list[str]]]:
    """``--set key=v1,v2`` options -> ``[(key, [v1, v2]), ...]`` (a single value is fixed)."""
    axes = []
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SweepError(f"--set {item!r}: expected key=value or key=v1,v2,... ")
        values = split_values(value)
        if not values:
            raise SweepError(f"--set {item!r}: no value after '='")
        axes.append((key.strip(), values))
    keys = [k for k, _ in axes]
    if len(set(keys)) != len(keys) or "seed" in keys:
        raise SweepError("each --set key may appear once; give seeds with --seeds, not --set seed")
    return axes


@dataclass(frozen=True)
class SweepPoint:
    """One run of the grid: its overrides (seed last) and its folder name."""

    sets: tuple[str, ...]
    name: str
    seed: int


def expand(axes: list[tuple[str, list[str]]], seeds: list[int]) -> list[SweepPoint]:
    """The grid's runs in order (first axis slowest, seed fastest); the name shows only the
    keys with more than one value, and the seed."""
    varying = [k for k, vs in axes if len(vs) > 1]
    points = []
    for combo in itertools.product(*[vs for _, vs in axes]):
        chosen = dict(zip([k for k, _ in axes], combo))
        for seed in seeds:
            label = [f"{k}={_safe(chosen[k])}" for k in varying] + [f"seed={seed}"]
            sets = tuple(f"{k}={v}" for k, v in chosen.items()) + (f"seed={seed}",)
            points.append(SweepPoint(sets, ",".join(label), seed))
    return points


def _safe(value: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in value).strip("_") or "_"


def run_state(path: Path, rounds: int | None) -> str:
    """``done`` (a record at the last round), ``partial`` (a checkpoint to resume) or ``new``."""
    if (path / "metrics.jsonl").exists() and rounds is not None:
        records = read_metrics(path)
        if records and int(records[-1]["round"]) >= rounds:
            return "done"
    if (path / CHECKPOINT).exists():
        return "partial"
    return "new"


def _planned_rounds(config: Path | None, point: SweepPoint) -> int:
    from hyperfed.config import load_config

    return load_config(config, list(point.sets)).rounds


def load_manifest(out: Path) -> dict[str, Any] | None:
    path = out / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class SweepResult:
    done: list[str]  # ran to the end in this call
    skipped: list[str]  # finished by an earlier call
    failed: list[tuple[str, str]]  # name, last line of its error output


def run_sweep(
    out: Path,
    *,
    config: Path | None,
    sets: list[str],
    seeds: list[int],
    parallel: int = 1,
    threads: int | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    only: Callable[[SweepPoint], bool] | None = None,
    drop_checkpoints: bool = False,
    on_running: Callable[[dict[str, LiveRun]], None] | None = None,
) -> SweepResult:
    """Run (or resume) the sweep in ``out``. A second call with another grid is refused
    (a sweep folder holds one grid); with no ``sets``/``config`` it resumes the stored one.
    ``only`` runs just the grid's points it accepts (the folder still holds the whole grid,
    so a later call can run the rest). ``drop_checkpoints`` deletes each finished run's
    ``checkpoint.pt`` (only ``--resume`` reads it; the metrics say a run is done), also of
    runs an earlier call finished: a grid of hundreds of runs otherwise keeps a model state per
    run and client on disk. ``on_progress(ended, total, line)`` is called once before the
    first run (``line`` empty) and after each run ends, ``line`` saying which and how:
    ``<name> finished`` or ``<name> failed`` (its error is in the result's ``failed``).
    ``on_running({name: LiveRun})`` gets every running run's last record (round, accuracy,
    ETA: :func:`live_run`, read from its ``metrics.jsonl``) about once a second."""
    if parallel < 1:
        raise SweepError(f"--parallel {parallel}: run at least 1 at a time")
    stored = load_manifest(out)
    if stored is not None and not sets and config is None and not seeds:
        config = Path(stored["config"]) if stored["config"] else None
        sets, seeds = list(stored["sets"]), list(stored["seeds"])
    if not seeds:
        seeds = [0]
    manifest = {"config": str(config) if config else None, "sets": sets, "seeds": seeds}
    if stored is not None and stored != manifest:
        raise SweepError(
            f"{out} holds another sweep ({stored}); resume it with `hyperfed sweep --out {out}` "
            "alone, or choose another --out"
        )
    if config is not None and not config.exists():
        raise SweepError(f"--config {config}: no such file")
    points = [p for p in expand(parse_axes(sets), seeds) if only is None or only(p)]
    # validate every point before starting anything (a typo fails now, not after an hour)
    rounds = {}
    for p in points:
        try:
            rounds[p.name] = _planned_rounds(config, p)
        except HyperfedError as e:
            raise SweepError(f"run {p.name}: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    threads = threads or max(1, (os.cpu_count() or 1) // parallel)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env[CORES_ENV] = str(min(threads, int(env.get(CORES_ENV, "").strip() or threads)))
    result = SweepResult([], [], [])
    todo = []
    for p in points:
        state = run_state(out / p.name, rounds[p.name])
        if state == "done":
            result.skipped.append(p.name)
            if drop_checkpoints:
                (out / p.name / CHECKPOINT).unlink(missing_ok=True)
        else:
            todo.append((p, state))
    total, finished = len(points), len(result.skipped)
    if on_progress:
        on_progress(finished, total, "")
    running: list[tuple[SweepPoint, subprocess.Popen[bytes], Path]] = []
    queue = list(todo)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM: stop the runs too, so a resume finds them whole

    previous = signal.signal(signal.SIGTERM, stop)
    polled = 0.0
    try:
        while queue or running:
            while queue and len(running) < parallel:
                p, state = queue.pop(0)
                run_dir = out / p.name
                cmd = [sys.executable, "-m", "hyperfed", "run", "--quiet"]
                if state == "partial":
                    cmd += ["--resume", str(run_dir)]
                else:
                    cmd += ["--out", str(run_dir), "--force"]
                    cmd += ["--config", str(config)] if config else []
                    for s in p.sets:
                        cmd += ["--set", s]
                log = run_dir.parent / f".{p.name}.log"
                with open(log, "wb") as f:
                    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
                running.append((p, proc, log))
            time.sleep(0.2)
            if on_running is not None and time.monotonic() - polled >= 1.0:
                polled = time.monotonic()
                on_running({p.name: live_run(out / p.name, rounds[p.name]) for p, _, _ in running})
            for item in list(running):
                p, proc, log = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                polled = 0.0  # the live lines drop it at the next poll
                finished += 1
                if proc.returncode == 0:
                    result.done.append(p.name)
                    log.unlink(missing_ok=True)
                    if drop_checkpoints:
                        (out / p.name / CHECKPOINT).unlink(missing_ok=True)
                else:
                    lines = log.read_text(errors="replace").strip().splitlines() or ["?"]
                    result.failed.append((p.name, f"{lines[-1]} (full output: {log})"))
                if on_progress:
                    outcome = "finished" if proc.returncode == 0 else "failed"
                    on_progress(finished, total, f"{p.name} {outcome}")
        if on_running is not None:
            on_running({})  # no run left
    except KeyboardInterrupt:
        for _, proc, _ in running:
            proc.terminate()
        for _, proc, _ in running:
            proc.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return result


@dataclass(frozen=True)
class LiveRun:
    """A running run's progress, from its last metrics record: the round (0 before the
    first record), of ``rounds``, its mean accuracy and the ETA from its own clock."""

    round: int
    rounds: int
    mean_acc: float | None = None
    eta_s: float | None = None

    def line(self) -> str:
        """``round 12/60, mean acc 0.8123, eta 2 min 10 s`` (``starting`` before a record)."""
        from hyperfed.progress import duration

        if not self.round:
            return f"round 0/{self.rounds}, starting"
        acc = "n/a" if self.mean_acc is None else f"{self.mean_acc:.4f}"
        eta = "" if self.eta_s is None else f", eta {duration(self.eta_s)}"
        return f"round {self.round}/{self.rounds}, mean acc {acc}{eta}"


def live_run(run_dir: Path, rounds: int) -> LiveRun:
    """The progress of the run writing ``run_dir`` (a subprocess of the sweep): its last
    complete metrics record, read from the file's tail. The ETA is the run's seconds per round
    so far (its ``seconds``, which go on across a resume) times the rounds left."""
    path = run_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return LiveRun(0, rounds)
    for line in reversed(tail):
        try:
            record = json.loads(line)
            rnd = int(record["round"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the writer, or by the tail's start
        seconds = record.get("seconds")
        eta = seconds / rnd * max(rounds - rnd, 0) if seconds and rnd else None
        return LiveRun(rnd, rounds, record.get("mean_acc"), eta)
    return LiveRun(0, rounds)


def checkpoint_bytes(out: Path) -> int:
    """Bytes of the run checkpoints below ``out`` (what ``drop_checkpoints`` frees)."""
    return sum(p.stat().st_size for p in out.rglob(CHECKPOINT))


def sweep_runs(paths: list[Path]) -> list[Path]:
    """Run directories named by ``paths``: a run directory itself, or every run directory
    below a folder (a sweep's, or ``reproduce``'s with its ``tuned/<method>/`` sweeps)."""
    runs = []
    for path in paths:
        if (path / "metrics.jsonl").exists():
            runs.append(path)
        elif path.is_dir():
            runs += sorted(p.parent for p in path.rglob("metrics.jsonl"))
    return runs
