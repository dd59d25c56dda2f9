"""A run killed with SIGKILL and resumed ends with the metrics of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hyperfed.config import load_config
from hyperfed.runtime.rundir import RunDir
from hyperfed.runtime.simulate import Simulation

ROUNDS = 30
SETTINGS = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=400",
    "clients.count=4",
    "clients.models=lenet",
    "partition.name=quantity",
    "partition.classes_per_client=2",
    "algorithm.name=fedavg",
    f"rounds={ROUNDS}",
    "eval_every=2",
    "checkpoint_every=3",
    "local.epochs=1",
    "seed=1",
]
KILL_AFTER_ROUND = 6
# one thread per process: on a small shared CPU more threads spin and slow everything down
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _hyperfed(*args: str) -> list[str]:
    return [sys.executable, "-m", "hyperfed", *args]


def _run_args(out: Path) -> list[str]:
    args = ["run", "--out", str(out), "--quiet"]
    for s in SETTINGS:
        args += ["--set", s]
    return _hyperfed(*args)


def _records(path: Path) -> list[dict]:
    """Complete metrics records (a line cut by the kill is ignored)."""
    out = []
    p = path / "metrics.jsonl"
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def _without_time(records: list[dict]) -> list[dict]:
    """Everything but wall-clock times."""
    return [
        {k: v for k, v in r.items() if k != "seconds" and not k.endswith("_seconds")}
        for r in records
    ]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _reference_run(path: Path) -> None:
    """The same experiment, uninterrupted, in this process (one thread, as the subprocesses)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Simulation(load_config(None, SETTINGS)).run(RunDir(path))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_metrics(tmp_path):
    killed_dir, ref_dir = tmp_path / "killed", tmp_path / "reference"
    procs: list[subprocess.Popen] = []
    try:
        victim = subprocess.Popen(
            _run_args(killed_dir), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        procs.append(victim)
        deadline = time.monotonic() + 120
        while True:
            recs = _records(killed_dir)
            if recs and recs[-1]["round"] >= KILL_AFTER_ROUND:
                break
            if victim.poll() is not None:
                out = victim.stdout.read().decode() if victim.stdout else ""
                pytest.fail(
                    f"the run to be killed exited (code {victim.returncode}) before reaching "
                    f"round {KILL_AFTER_ROUND}; output:\n{out}"
                )
            assert time.monotonic() < deadline, "the run never reached the kill round"
            time.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        if victim.returncode != -signal.SIGKILL:
            pytest.fail(
                f"the run finished (code {victim.returncode}) before it could be killed; "
                f"make ROUNDS larger so that the kill lands mid-run"
            )
        killed_records = _records(killed_dir)
        assert killed_records[-1]["round"] < ROUNDS, "the run was not interrupted"
        assert (killed_dir / "checkpoint.pt").exists(), "no checkpoint before the kill"
        # as if the kill had cut a metrics line in half
        with open(killed_dir / "metrics.jsonl", "a") as f:
            f.write('{"round": 99, "mean_a')

        resumed = subprocess.Popen(
            _hyperfed("run", "--resume", str(killed_dir), "--quiet"),
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        procs.append(resumed)
        _reference_run(ref_dir)  # meanwhile, on the other core
        out, _ = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, out.decode()
    finally:
        for p in procs:
            _stop(p)

    expected = _without_time(_records(ref_dir))
    assert [r["round"] for r in expected] == list(range(2, ROUNDS + 1, 2))
    got = _without_time(_records(killed_dir))
    assert [r["round"] for r in got] == [r["round"] for r in expected]
    assert got == expected
    assert len((killed_dir / "metrics.jsonl").read_text().splitlines()) == len(expected)
    assert (killed_dir / "summary.md").exists()
    seconds = [r["seconds"] for r in _records(killed_dir)]
    assert seconds == sorted(seconds), "the clock goes on across a resume"


def test_a_new_run_does_not_inherit_an_old_checkpoint_in_its_directory(tmp_path):
    """Otherwise a second run into the same --out, killed before its first checkpoint, would
    resume the first run's state under the second run's config."""
    old = RunDir(tmp_path)
    old.create("rounds = 9\n")
    old.append_metrics({"round": 6, "mean_acc": 0.5})
    old.save_checkpoint({"round": 6})
    new = RunDir(tmp_path)
    new.create("rounds = 3\n")
    assert new.load_checkpoint() is None
    assert new.metrics() == []
    assert (tmp_path / "config.toml").read_text() == "rounds = 3\n"


def test_truncate_metrics_drops_later_records_and_a_cut_line(tmp_path):
    d = RunDir(tmp_path)
    d.create("rounds = 9\n")
    accs = ("mean_acc", "weighted_acc", "min_acc", "max_acc", "std_acc")  # what a record holds
    for rnd in (2, 4, 6):
        d.append_metrics({"round": rnd, **dict.fromkeys(accs, rnd / 10)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"round": 8, "mean')
    d.truncate_metrics(4)
    assert [(r["round"], r["mean_acc"]) for r in d.metrics()] == [(2, 0.2), (4, 0.4)]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")
