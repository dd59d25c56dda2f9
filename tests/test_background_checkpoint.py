"""Checkpoints off the round's critical path (issue 57, item 2): the round driver copies the
state at the checkpoint's moment and one writer thread writes the copy while the next rounds
run (``RunDir.save_checkpoint_async``).

- the round after a checkpoint runs while the checkpoint is still being written;
- a write that fails in the background raises ``CheckpointWriteError`` in the main thread, at
  the next checkpoint or at the end of the run, with the message a synchronous write gives;
- an error or Ctrl-C in a round waits for the write in flight (a failed write is then logged);
- what is written is the state at the checkpoint's moment, whatever training does to the live
  tensors after it; tensors that share memory still share it in the file;
- a run killed (SIGKILL) while a checkpoint is written in the background resumes from the
  previous checkpoint to the records of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from toy import Scripted, fedavg, tiny_mlp

from hyperfed.algorithms.base import Payload
from hyperfed.runtime.driver import EvalCounts
from hyperfed.runtime.rundir import CHECKPOINT, CheckpointWriteError, RunDir

BLOCK_S = 60  # a blocked writer gives up after this long (a hung test, not a timing check)


def _driver() -> Any:
    """A FedAvg round driver over three scripted clients (each adds 0.1 to the model)."""
    fm = tiny_mlp(3, 3, 2)
    counts = EvalCounts(torch.ones(3), torch.full((3,), 2.0), torch.ones(3))

    def answer(c: int, msg: Payload) -> Payload:
        return {"theta": msg["theta"] + 0.1}

    server, driver = fedavg([1, 2, 3], fm, answer)
    driver.transport = Scripted(answer, counts)
    return driver


def _run_dir(path: Path) -> RunDir:
    run = RunDir(path)
    run.create("rounds = 3\n")
    return run


def test_the_next_round_runs_while_the_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 1's write blocks until round 2's state has been taken: the driver ran round 2
    during the write. Written in the main thread (synchronously), round 1's write would end
    before round 2 began."""
    real = RunDir._write_checkpoint
    events: list[str] = []
    release = threading.Event()

    def write(self: RunDir, state: dict[str, Any], config: str) -> int:
        rnd = state["round"]
        events.append(f"write {rnd} starts")
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(BLOCK_S), "round 2 never came"
        size = real(self, state, config)
        events.append(f"write {rnd} ends")
        return size

    def checkpoint(rnd: int) -> dict[str, Any]:
        events.append(f"round {rnd} state")
        if rnd == 2:
            release.set()
        return {"round": rnd}

    monkeypatch.setattr(RunDir, "_write_checkpoint", write)
    run = _run_dir(tmp_path)
    _driver().run(3, 3, run_dir=run, checkpoint_every=1, checkpoint=checkpoint)
    assert events[:4] == ["round 1 state", "write 1 starts", "round 2 state", "write 1 ends"]
    # at most one write in flight: each starts after the one before it ended
    assert events.index("write 2 starts") > events.index("write 1 ends")
    assert events.index("write 3 starts") > events.index("write 2 ends")
    assert len(events) == 9
    # the last checkpoint is on disk when run returns
    state = run.load_checkpoint()
    assert state is not None and state["round"] == 3


def _failing_save(monkeypatch: pytest.MonkeyPatch, fail_round: int) -> list[str]:
    """torch.save fails writing the checkpoint of ``fail_round`` as on a full disk (torch turns
    the stream's error into this RuntimeError); returns the threads that wrote checkpoints."""
    real = torch.save
    threads: list[str] = []

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if type(f).__name__ == "_HashingWriter":  # the run directory's checkpoint stream
            threads.append(threading.current_thread().name)
            if obj["round"] == fail_round:
                f.write(b"x" * 100)
                raise RuntimeError(
                    "PytorchStreamWriter failed writing file data/0: file write failed"
                )
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return threads


def test_a_background_write_error_is_raised_at_the_next_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 2's checkpoint fails in the writer thread; round 3's checkpoint raises it, with
    the one line a synchronous write gives (round 1's checkpoint kept), and the run stops."""
    threads = _failing_save(monkeypatch, fail_round=2)
    run = _run_dir(tmp_path)
    rounds_done: list[int] = []
    with pytest.raises(CheckpointWriteError) as caught:
        _driver().run(
            5,
            5,
            run_dir=run,
            checkpoint_every=1,
            checkpoint=lambda rnd: {"round": rnd},
            on_round=lambda rnd, result, record: rounds_done.append(rnd),
        )
    assert str(caught.value) == (
        f"cannot write the checkpoint in {tmp_path} (PytorchStreamWriter failed writing file "
        "data/0: file write failed); the previous checkpoint is kept"
    )
    assert threads == ["hyperfed-checkpoint"] * 2  # written in the background
    assert rounds_done == [1, 2]  # round 3 ran, its checkpoint raised, on_round(3) never came
    state = run.load_checkpoint()
    assert state is not None and state["round"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        CHECKPOINT,
        "config.toml",
        "machine.jsonl",
        "metrics.jsonl",
    ]


def test_a_failed_last_checkpoint_is_raised_when_the_run_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last round's checkpoint fails in the background: run() raises it instead of
    returning (no checkpoint was written before: the message says so)."""
    _failing_save(monkeypatch, fail_round=2)
    run = _run_dir(tmp_path)
    with pytest.raises(
        CheckpointWriteError, match=r"file write failed\); no checkpoint written yet"
    ):
        _driver().run(2, 2, run_dir=run, checkpoint_every=2, checkpoint=lambda rnd: {"round": rnd})
    assert run.load_checkpoint() is None


def test_ctrl_c_waits_for_the_checkpoint_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in round 2 while round 1's checkpoint is being written: run() finishes the write
    before the KeyboardInterrupt leaves it (round 1's checkpoint on disk). Round 1's write is
    held until someone waits for it, so without that wait it would still be unfinished."""
    real_write, real_wait = RunDir._write_checkpoint, RunDir.wait_checkpoint
    release = threading.Event()
    ended: list[int] = []

    def write(self: RunDir, state: dict[str, Any], config: str) -> int:
        assert release.wait(BLOCK_S), "nobody waited for the write"
        size = real_write(self, state, config)
        ended.append(state["round"])
        return size

    def wait(self: RunDir) -> int | None:
        if self._writer is not None:  # a wait for a write in flight (not the one before it)
            release.set()
        return real_wait(self)

    def ctrl_c(rnd: int) -> dict[str, Any]:
        if rnd == 2:
            raise KeyboardInterrupt
        return {"round": rnd}

    monkeypatch.setattr(RunDir, "_write_checkpoint", write)
    monkeypatch.setattr(RunDir, "wait_checkpoint", wait)
    run = _run_dir(tmp_path)
    try:
        with pytest.raises(KeyboardInterrupt):
            _driver().run(3, 3, run_dir=run, checkpoint_every=1, checkpoint=ctrl_c)
        assert ended == [1]
    finally:
        release.set()  # a writer left blocked by a broken driver ends
    monkeypatch.undo()
    state = run.load_checkpoint()
    assert state is not None and state["round"] == 1


def test_a_failed_write_under_an_error_is_logged_and_the_error_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Round 1's background write fails and round 2 raises its own error: that error leaves
    run(), the write's one line is logged (not lost)."""
    _failing_save(monkeypatch, fail_round=1)

    def boom(rnd: int) -> dict[str, Any]:
        if rnd == 2:
            raise ValueError("round 2 went wrong")
        return {"round": rnd}

    run = _run_dir(tmp_path)
    with (
        caplog.at_level("ERROR", logger="hyperfed"),
        pytest.raises(ValueError, match="round 2 went wrong"),
    ):
        _driver().run(3, 3, run_dir=run, checkpoint_every=1, checkpoint=boom)
    assert f"cannot write the checkpoint in {tmp_path} (" in caplog.text
    assert "file write failed); no checkpoint written yet" in caplog.text


@pytest.mark.parametrize(
    ("rounds", "eval_every", "checkpoint_every", "warning"),
    [
        # checkpoints after rounds 1-5; write 1 is known at round 2's, with 3 writes to come
        (5, 1, None, "rewritten every 1 round(s) (checkpoint_every defaults to eval_every): 3"),
        # after rounds 2, 4 and 5 (the last); write 2 is known at round 4's: 1 write to come
        (5, 2, None, "rewritten every 2 round(s) (checkpoint_every defaults to eval_every): 1"),
        (5, 1, 1, None),  # checkpoint_every chosen by the user: no advice
        (2, 1, None, None),  # write 1 is known at the last checkpoint: nothing left to save
    ],
)
def test_a_large_checkpoint_at_the_default_interval_is_warned_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    rounds: int,
    eval_every: int,
    checkpoint_every: int | None,
    warning: str | None,
) -> None:
    """Every checkpoint counts as large here; the warning names the writes still to come."""
    from hyperfed.runtime import driver as driver_module

    monkeypatch.setattr(driver_module, "LARGE_CHECKPOINT_BYTES", 1)
    run = _run_dir(tmp_path)
    with caplog.at_level("WARNING", logger="hyperfed"):
        _driver().run(
            rounds,
            eval_every,
            run_dir=run,
            checkpoint_every=checkpoint_every,
            checkpoint=lambda rnd: {"round": rnd},
        )
    told = [r.getMessage() for r in caplog.records if "each checkpoint is" in r.getMessage()]
    if warning is None:
        assert told == []
    else:
        assert len(told) == 1 and warning + " more write(s)" in told[0], told
        assert (
            run.last_checkpoint is not None
            and run.last_checkpoint[0] == (tmp_path / CHECKPOINT).stat().st_size
        )


def test_a_small_checkpoint_is_not_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="hyperfed"):
        _driver().run(4, 1, run_dir=_run_dir(tmp_path), checkpoint=lambda rnd: {"round": rnd})
    assert not [r for r in caplog.records if "each checkpoint is" in r.getMessage()]


def test_what_is_written_is_the_state_at_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live tensors (and lists, dicts) change in place after save_checkpoint_async returns,
    while the write is held back: the file holds the values they had when it was called. A
    tensor named twice and a view of it share one storage in the file, as torch.save of the
    live state writes them (the same size)."""
    real = RunDir._write_checkpoint
    release = threading.Event()

    def write(self: RunDir, state: dict[str, Any], config: str) -> int:
        assert release.wait(BLOCK_S), "never released"
        return real(self, state, config)

    w = torch.arange(6, dtype=torch.float32)
    moments = {"exp_avg": torch.zeros(2, 3), "step": torch.tensor(4.0)}
    state: dict[str, Any] = {
        "round": 4,
        "w": w,
        "w_again": w,
        "w_tail": w[3:],
        "opt": {"state": {0: moments}, "lrs": [0.1, 0.2]},
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    sync_dir = _run_dir(tmp_path / "sync")
    sync_size = sync_dir.save_checkpoint(state)

    monkeypatch.setattr(RunDir, "_write_checkpoint", write)
    run = _run_dir(tmp_path / "async")
    run.save_checkpoint_async(state)
    # training goes on: in-place updates, containers changed
    with torch.no_grad():
        w.mul_(10)
        moments["exp_avg"].add_(1)
        moments["step"] += 1
        state["param"].sub_(5)
    state["opt"]["lrs"].append(0.3)
    state["opt"]["state"][1] = {"step": torch.tensor(1.0)}
    state["round"] = 5
    release.set()
    size = run.wait_checkpoint()
    monkeypatch.undo()

    back = run.load_checkpoint()
    assert back is not None and back["round"] == 4
    assert back["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert back["w_tail"].tolist() == [3.0, 4.0, 5.0]
    assert back["opt"]["lrs"] == [0.1, 0.2] and list(back["opt"]["state"]) == [0]
    assert back["opt"]["state"][0]["exp_avg"].tolist() == [[0.0] * 3] * 2
    assert back["opt"]["state"][0]["step"].item() == 4.0
    assert back["param"].tolist() == [1.0, 1.0]
    # one storage for w, w_again and w_tail, as in the live state
    assert back["w_again"] is back["w"]
    assert back["w_tail"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()
    assert size == sync_size == (tmp_path / "async" / CHECKPOINT).stat().st_size


# -- a kill while the background write is in flight -------------------------------------------

ROUNDS = 6
SETTINGS = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=200",
    "clients.count=3",
    "clients.models=mlp",
    "partition.name=quantity",
    "partition.classes_per_client=2",
    "algorithm.name=fedavg",
    f"rounds={ROUNDS}",
    "eval_every=2",
    "checkpoint_every=2",
    "local.epochs=1",
    "local.workers=1",
    "seed=1",
]
HELD_ROUND = 4  # its checkpoint's write starts, writes part of the file, and never ends
# the victim: a run whose round-4 checkpoint write hangs half-way while the rounds go on
# (round 6's checkpoint then waits for it: rounds 1-6 are those of an uninterrupted run)
VICTIM = """
import sys, threading, torch
from hyperfed.config import load_config
from hyperfed.runtime.rundir import RunDir
from hyperfed.runtime.simulate import Simulation
real = torch.save
def save(obj, f, *args, **kwargs):
    if type(f).__name__ == "_HashingWriter" and obj["round"] == int(sys.argv[2]):
        f.write(b"x" * 1000)
        f.flush()
        open(sys.argv[1] + ".held", "w").close()  # tell the test
        threading.Event().wait()  # the kill lands here
    real(obj, f, *args, **kwargs)
torch.save = save
run = RunDir(sys.argv[1])
with run.locked():
    Simulation(load_config(None, sys.argv[3:])).run(run)
"""


def _temp_files(path: Path) -> list[str]:
    """Checkpoint temp files (mkstemp's ``.checkpoint.pt.XXXXXXXX``): a write in flight."""
    names = [p.name for p in path.iterdir()] if path.is_dir() else []
    return [n for n in names if n.startswith(f".{CHECKPOINT}.")]


def _records(path: Path) -> list[dict[str, Any]]:
    p = path / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _without_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in r.items() if k != "seconds" and not k.endswith("_seconds")}
        for r in records
    ]


@pytest.mark.slow
def test_a_kill_during_a_background_checkpoint_resumes_to_the_same_records(tmp_path: Path) -> None:
    """Killed after round 4's metrics line while round 4's checkpoint is being written (the
    run went on to round 6): the file on disk is round 2's, the resume drops the records of
    rounds 4 and 6, runs rounds 3-6 again and records what the killed run had recorded (its
    rounds 1-6 ran uninterrupted: the write in flight changes no computation); the
    half-written temp file is removed."""
    from hyperfed.runtime.simulate import resume

    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, str(killed), str(HELD_ROUND), *SETTINGS],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        held = tmp_path / "killed.held"
        # round 4's write has begun (and hangs), round 6 is recorded
        while not (held.exists() and len(_records(killed)) == ROUNDS // 2):
            if victim.poll() is not None:
                out = victim.stdout.read().decode() if victim.stdout else ""
                pytest.fail(f"the run exited (code {victim.returncode}) early:\n{out}")
            assert time.monotonic() < deadline, "the run never reached round 6"
            time.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    uninterrupted = _without_time(_records(killed))
    assert [r["round"] for r in uninterrupted] == [2, 4, 6]
    assert _temp_files(killed), "the kill landed after the write"

    sim, run_dir, start = resume(killed)
    assert start == 2  # round 4's checkpoint never finished: round 2's is on disk
    assert [r["round"] for r in _records(killed)] == [2]
    with run_dir.locked():
        sim.run(run_dir, start_round=start)
    assert _without_time(_records(killed)) == uninterrupted
    assert not _temp_files(killed)
    state = run_dir.load_checkpoint()
    assert state is not None and state["round"] == ROUNDS
