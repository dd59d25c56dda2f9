"""A run directory never loses or mixes results (issue 17, items 3-8): a resume that cannot
resume, a second run on the same directory, a corrupt or foreign checkpoint, a missing
data_dir and a diverged run are each refused or reported, and nothing is changed."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
from cli_helpers import SMALL, assert_one_line_error, invoke, sets

from hyperfed.runtime.rundir import CHECKPOINT, RunDir, RunDirError

TWO_ROUNDS = [*SMALL, "rounds=2", "checkpoint_every=1"]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "r"
    result = invoke("run", "--out", str(out), "--quiet", *sets(TWO_ROUNDS))
    assert result.exit_code == 0, result.output
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name, data in _snapshot(src).items():
        (dst / name).write_bytes(data)
    return dst


def _refused(args: list[str], out: Path, *words: str) -> None:
    """The command exits 2 with a one-line error naming ``words`` and leaves ``out`` as it was."""
    before = _snapshot(out)
    assert_one_line_error(args, *words)
    assert _snapshot(out) == before


def test_resume_without_a_checkpoint_refuses_and_keeps_the_metrics(
    finished_run: Path, tmp_path: Path
) -> None:
    run = _copy_run(finished_run, tmp_path / "r")
    (run / CHECKPOINT).unlink()
    assert (run / "metrics.jsonl").stat().st_size > 0
    _refused(["run", "--resume", str(run), "--quiet"], run, "no checkpoint", "--force")


def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "busy"
    with RunDir(out).locked():
        (out / "metrics.jsonl").write_text('{"round": 1}\n')
        _refused(["run", "--out", str(out), "--force", "--quiet", *sets(TWO_ROUNDS)], out, "in use")
        with pytest.raises(RunDirError, match="in use"), RunDir(out).locked():
            pass
    with RunDir(out).locked():  # released when the holder is done
        pass


@pytest.mark.parametrize("damage", ["flip_bytes", "truncate", "empty", "config_edited"])
def test_a_damaged_checkpoint_is_refused(finished_run: Path, tmp_path: Path, damage: str) -> None:
    run = _copy_run(finished_run, tmp_path / "r")
    ckpt = run / CHECKPOINT
    data = bytearray(ckpt.read_bytes())
    if damage == "flip_bytes":  # 4 KiB overwritten inside the payload
        start = len(data) // 2
        data[start : start + 4096] = bytes(4096)
        ckpt.write_bytes(bytes(data))
        words = ["corrupt"]
    elif damage == "truncate":
        ckpt.write_bytes(bytes(data[: len(data) - 100]))
        words = ["truncated"]
    elif damage == "empty":
        ckpt.write_bytes(b"")
        words = ["not a hyperfed checkpoint"]
    else:
        cfg = run / "config.toml"
        cfg.write_text(cfg.read_text().replace("rounds = 2", "rounds = 3"))
        words = ["config.toml changed"]
    _refused(["run", "--resume", str(run), "--quiet"], run, *words)


class _Exploit:
    """Unpickling this would run code (here: create a file)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.target,))


def test_a_pickle_that_runs_code_is_refused_even_with_a_valid_checksum(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    (tmp_path / "config.toml").write_text("rounds = 1\n")
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"round": 1, "x": _Exploit(marker)}, buf)
    payload = buf.getvalue()
    import hashlib

    header = {
        "format": "hyperfed-checkpoint-1",
        "sha256": hashlib.sha256(payload).hexdigest(),
        "size": len(payload),
        "config_sha256": run.config_sha256(),
    }
    (tmp_path / CHECKPOINT).write_bytes((json.dumps(header) + "\n").encode() + payload)
    with pytest.raises(RunDirError, match="more than tensors"):
        run.load_checkpoint()
    assert not marker.exists()


def test_a_checkpoint_round_trips(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    (tmp_path / "config.toml").write_text("rounds = 1\n")
    state = {"round": 3, "w": torch.arange(4.0), "store": {0: {"theta": torch.ones(2)}}}
    run.save_checkpoint(state)
    back = run.load_checkpoint()
    assert back is not None and back["round"] == 3
    assert torch.equal(back["w"], state["w"])
    assert torch.equal(back["store"][0]["theta"], torch.ones(2))


def test_a_missing_data_dir_is_refused_not_replaced_by_the_system_copy(tmp_path: Path) -> None:
    out = tmp_path / "r"
    out.mkdir()
    bad = tmp_path / "no-such-folder"
    settings = [*TWO_ROUNDS, "dataset.name=fashion_mnist", f"dataset.data_dir={bad}"]
    _refused(["run", "--out", str(out), "--quiet", *sets(settings)], out, "not found in", str(bad))
    result = invoke("run", "--out", str(out), "--quiet", *sets(settings))
    searched = " ".join(result.output.split()).split("not found in [")[1].split("]")[0]
    assert "/usr/share" not in searched  # the system copy is not even searched


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "a-file"
    out.write_text("keep me")
    result = invoke("run", "--out", str(out), "--quiet", *sets(TWO_ROUNDS))
    assert result.exit_code == 2 and "is a file" in result.output
    assert out.read_text() == "keep me"


def test_a_diverged_run_says_so_in_metrics_summary_and_console(tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = invoke("run", "--out", str(out), *sets([*TWO_ROUNDS, "local.lr=1e6"]))
    assert result.exit_code == 0, result.output
    assert "training loss was NaN or Inf" in " ".join(result.output.split())
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # valid JSON: no bare NaN
    assert "NaN" not in (out / "metrics.jsonl").read_text()
    assert all(r["nonfinite_loss"] for r in records)
    assert "run diverged" in (out / "summary.md").read_text()


def test_a_healthy_run_reports_no_divergence(finished_run: Path) -> None:
    records = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert records and not any(r["nonfinite_loss"] for r in records)
    assert "diverged" not in (finished_run / "summary.md").read_text()


def test_files_written_atomically_are_readable_by_others(finished_run: Path) -> None:
    """mkstemp makes 0600 files; a run directory people share must follow the umask."""
    mask = os.umask(0)
    os.umask(mask)
    for name in ("config.toml", CHECKPOINT):
        assert (finished_run / name).stat().st_mode & 0o777 == 0o666 & ~mask


def test_progress_lines_when_stdout_is_not_a_terminal(tmp_path: Path) -> None:
    result = invoke("run", "--out", str(tmp_path / "r"), *sets(TWO_ROUNDS))
    assert result.exit_code == 0, result.output
    assert "round 1/2: mean acc" in result.output and "round 2/2: mean acc" in result.output
    assert "Checkpoint for `--resume`" in (tmp_path / "r" / "summary.md").read_text()


def test_report_legends_tell_runs_with_the_same_folder_name_apart() -> None:
    from hyperfed.report import _x_value, run_labels

    runs = [
        {"run": "run", "path": "a/run", "algorithm": "fedavg"},
        {"run": "run", "path": "b/run", "algorithm": "local"},
        {"run": "other", "path": "c/other", "algorithm": "ditto"},
    ]
    assert run_labels(runs) == ["a/run (fedavg)", "b/run (local)", "other (ditto)"]
    # the FLOPs axis counts the server's work too
    assert _x_value({"flops_total": 5, "flops_server_total": 7}, "flops") == 12.0


def test_disk_full_says_where_the_run_is_and_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from hyperfed.runtime.simulate import Simulation

    def full(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Simulation, "run", full)
    out = tmp_path / "r"
    result = invoke("run", "--out", str(out), "--quiet", *sets(TWO_ROUNDS))
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert "no space left on device" in message and f"--resume {out}" in message


def test_sigterm_stops_flower_local_as_ctrl_c_does() -> None:
    import signal

    from hyperfed.deploy.cli import _interrupt

    with pytest.raises(KeyboardInterrupt):
        _interrupt(signal.SIGTERM, None)


def test_saving_a_checkpoint_streams_the_state_to_the_file(tmp_path: Path) -> None:
    """A large state (a pFedKT HN(large) federation is 6.6 GB) must not be copied while it is
    written: Python-side peak memory of ``save_checkpoint`` is a small fraction of the
    checkpoint (it was ~3x, then 1.13x with torch.save's buffer), and the file round-trips."""
    import tracemalloc

    run = RunDir(tmp_path)
    (tmp_path / "config.toml").write_text("rounds = 1\n")
    state = {"round": 2, "w": torch.arange(2_000_000, dtype=torch.float32)}  # 8 MB
    tracemalloc.start()
    try:
        size = run.save_checkpoint(state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == (tmp_path / CHECKPOINT).stat().st_size > 8_000_000
    assert peak < 0.1 * size, f"peak {peak / size:.2f}x the checkpoint"
    back = run.load_checkpoint()
    assert back is not None and torch.equal(back["w"], state["w"])


def test_a_checkpoint_with_the_earlier_unpadded_header_still_loads(tmp_path: Path) -> None:
    """Runs checkpointed before the header was padded resume: the header is one JSON line
    either way."""
    import hashlib

    from hyperfed.runtime.rundir import CHECKPOINT_FORMAT

    run = RunDir(tmp_path)
    (tmp_path / "config.toml").write_text("rounds = 1\n")
    buf = io.BytesIO()
    torch.save({"round": 3, "w": torch.ones(5)}, buf)
    payload = buf.getvalue()
    header = {
        "format": CHECKPOINT_FORMAT,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "size": len(payload),
        "config_sha256": run.config_sha256(),
    }
    (tmp_path / CHECKPOINT).write_bytes(json.dumps(header).encode() + b"\n" + payload)
    back = run.load_checkpoint()
    assert back is not None and back["round"] == 3 and torch.equal(back["w"], torch.ones(5))
    (tmp_path / CHECKPOINT).write_bytes(json.dumps(header).encode() + b"\n" + payload[:-1])
    with pytest.raises(RunDirError, match="truncated or corrupt"):
        run.load_checkpoint()


# -- issue 55: a full disk while checkpointing, stale temp files -----------------------------


def test_a_checkpoint_torch_save_cannot_write_is_one_line_and_keeps_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save reports a failed write as a RuntimeError (not the OSError the disk-full
    handler caught): one line, non-zero exit, round 1's checkpoint intact, no temp file."""
    real = torch.save
    calls: list[int] = []

    def save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if type(f).__name__ == "_HashingWriter":  # the run directory's checkpoint stream
            calls.append(1)
            if len(calls) == 2:  # round 2's checkpoint: half written, then the disk is full
                f.write(b"x" * 100)
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed "
                    "writing file data/0: file write failed"
                )
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "r"
    result = invoke("run", "--out", str(out), "--quiet", *sets(TWO_ROUNDS))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(calls) == 2
    message = " ".join(result.output.split())
    assert "cannot write the checkpoint" in message and "file write failed" in message
    assert "previous checkpoint is kept" in message and f"--resume {out}" in message
    state = RunDir(out).load_checkpoint()
    assert state is not None and state["round"] == 1
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_a_full_disk_under_torch_save_names_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real path: the file's write raises ENOSPC inside torch.save, which re-raises it as
    a RuntimeError; the error names the OSError's reason, the old checkpoint stays."""
    import errno

    from hyperfed.runtime import rundir

    run = RunDir(tmp_path)
    (tmp_path / "config.toml").write_text("rounds = 1\n")
    run.save_checkpoint({"round": 1, "w": torch.ones(3)})
    before = (tmp_path / CHECKPOINT).read_bytes()
    real = os.fdopen

    class Full:
        def __init__(self, f) -> None:  # type: ignore[no-untyped-def]
            self.f, self.written = f, 0

        def write(self, data: bytes) -> int:
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return int(self.f.write(data))

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self.f, name)

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    monkeypatch.setattr(rundir.os, "fdopen", lambda fd, mode: Full(real(fd, mode)))
    with pytest.raises(rundir.CheckpointWriteError, match="No space left on device"):
        run.save_checkpoint({"round": 2, "w": torch.ones(100_000)})
    monkeypatch.undo()
    assert (tmp_path / CHECKPOINT).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT, "config.toml"]


def test_a_resume_and_a_new_run_remove_stale_temp_checkpoints(
    finished_run: Path, tmp_path: Path
) -> None:
    """A kill during an atomic write leaves mkstemp's .checkpoint.pt.XXXXXXXX behind; a
    resume (and a run started anew) deletes those, and only those."""
    run = _copy_run(finished_run, tmp_path / "r")
    stale = [".checkpoint.pt.k3_9xq2a", ".metrics.jsonl.0abcdefg", ".config.toml.zz__zz__"]
    kept = [".checkpoint.pt.notes", "checkpoint.pt.abcdefgh", ".other.pt.abcdefgh", "notes.txt"]
    for name in stale + kept:
        (run / name).write_bytes(b"partial")
    result = invoke("run", "--resume", str(run), "--quiet")
    assert result.exit_code == 0, result.output
    names = {p.name for p in run.iterdir()}
    assert not names & set(stale) and set(kept) <= names
    for name in stale:
        (run / name).write_bytes(b"partial")
    result = invoke("run", "--out", str(run), "--force", "--quiet", *sets(TWO_ROUNDS))
    assert result.exit_code == 0, result.output
    names = {p.name for p in run.iterdir()}
    assert not names & set(stale) and set(kept) <= names


def test_run_refuses_an_out_holding_other_files_unless_forced(tmp_path: Path) -> None:
    """Without metrics, `run --out` wrote over a folder's config.toml and summary.md."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.toml").write_text("# my own notes\n")
    (out / "summary.md").write_text("my summary\n")
    _refused(
        ["run", "--out", str(out), "--quiet", *sets(TWO_ROUNDS)],
        out,
        "is not empty (config.toml, summary.md)",
        "--force",
    )
    result = invoke("run", "--out", str(out), "--force", "--quiet", *sets(TWO_ROUNDS))
    assert result.exit_code == 0, result.output
    assert "rounds = 2" in (out / "config.toml").read_text()


def test_a_finished_run_extends_with_resume_and_more_rounds(
    finished_run: Path, tmp_path: Path
) -> None:
    """Issue 56 item 6: ``--resume DIR --set rounds=3`` continues a finished 2-round run from
    its last checkpoint: its metrics keep rounds 1-2 byte for byte and go on with round 3, and
    config.toml says 3 rounds. Any other --set, or fewer rounds than were run, is refused in
    one line with the directory as it was."""
    from hyperfed.runtime.rundir import read_metrics

    run = _copy_run(finished_run, tmp_path / "r")
    before = (run / "metrics.jsonl").read_text().splitlines()
    _refused(["run", "--resume", str(run), "--set", "local.lr=0.5"], run, "only rounds", "local.lr")
    _refused(["run", "--resume", str(run), "--set", "rounds=1"], run, "run 2 rounds", "grow")
    result = invoke("run", "--resume", str(run), "--set", "rounds=3", "--quiet")
    assert result.exit_code == 0, result.output
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3]
    assert after[:2] == before  # the finished rounds' rows, unchanged
    assert "rounds = 3" in (run / "config.toml").read_text().splitlines()


def test_an_extension_killed_before_its_first_new_checkpoint_still_resumes(
    finished_run: Path, tmp_path: Path
) -> None:
    """The extension rewrites config.toml and re-points the kept checkpoint at it before any
    round runs, so a kill right then leaves a run that resumes (not "config.toml changed")."""
    from hyperfed.runtime.simulate import resume

    run = _copy_run(finished_run, tmp_path / "r")
    state = RunDir(run).load_checkpoint()
    sim, _, start = resume(run, ["rounds=5"])  # rebuilt, nothing run: as if killed now
    sim.close()
    assert start == 2 and "rounds = 5" in (run / "config.toml").read_text().splitlines()
    again = RunDir(run).load_checkpoint()  # verified against the new config: no error
    assert again is not None and state is not None and again["round"] == state["round"] == 2


@pytest.mark.parametrize("stop_at", [1, 2])
def test_ctrl_c_says_how_to_resume_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: int
) -> None:
    """Ctrl-C in round 2 (round 1 checkpointed): one line naming ``--resume DIR``; in round 1,
    before any checkpoint: how to start again. Exit status 130 either way."""
    from hyperfed.runtime.driver import RoundDriver

    run_round = RoundDriver.run_round

    def interrupted(self, rnd, **kw):  # type: ignore[no-untyped-def]
        if rnd == stop_at:
            raise KeyboardInterrupt
        return run_round(self, rnd, **kw)

    monkeypatch.setattr(RoundDriver, "run_round", interrupted)
    out = tmp_path / "r"
    result = invoke("run", "--out", str(out), "--quiet", *sets(TWO_ROUNDS))
    assert result.exit_code == 130, result.output
    said = " ".join(result.output.split())
    if stop_at == 2:
        assert said == f"interrupted; resume with: hyperfed run --resume {out}"
    else:
        assert said == (
            f"interrupted before the first checkpoint; start it again with --out {out} --force"
        )


def test_the_final_table_names_the_scored_model_and_where_the_best_round_was_picked(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FedAvg scores its global model: the title must not say "each client's own model"; with
    no validation split the best round is labelled as picked on test. A run whose records say
    ``personalized`` and carry a validation accuracy reads the other way."""
    from hyperfed.terminal import console, print_final

    width = console.width
    console.width = 200
    try:
        print_final(finished_run, 1.0)
        fedavg = capsys.readouterr().out
        run = _copy_run(finished_run, tmp_path / "r")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for row, val in zip(rows, (0.5, 0.4)):  # round 1 is the best on validation
            row.update(scores="personalized", val_mean_acc=val)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print_final(run, 1.0)
        personal = capsys.readouterr().out
    finally:
        console.width = width
    assert "Test accuracy at round 2 (the global model, one per architecture)" in fedavg
    assert "own model" not in fedavg
    assert "picked on test" in fedavg and "no validation split" in fedavg
    assert "Test accuracy at round 2 (each client's own model)" in personal
    assert "best mean (round 1, picked on val)" in personal and "picked on test" not in personal


def test_machine_jsonl_names_the_machine_of_each_start_and_resume(
    finished_run: Path, tmp_path: Path
) -> None:
    """Same-seed runs on different CPUs part by float rounding: each start and each resume
    appends the machine it ran on, and a resume keeps the lines before it."""
    from hyperfed.runtime.rundir import machine_info, read_machines

    run = _copy_run(finished_run, tmp_path / "r")
    here = machine_info("cpu")
    (first,) = read_machines(run)
    assert first["from_round"] == 0
    assert {k: first[k] for k in ("cpu", "isa", "torch")} == {
        "cpu": here["cpu"],
        "isa": here["isa"],
        "torch": torch.__version__,
    }
    result = invoke("run", "--resume", str(run), "--set", "rounds=3", "--quiet")
    assert result.exit_code == 0, result.output
    assert [m["from_round"] for m in read_machines(run)] == [0, 2]
    # a new run in the same folder (--force) starts the file again
    result = invoke("run", "--out", str(run), "--force", "--quiet", *sets(TWO_ROUNDS))
    assert result.exit_code == 0, result.output
    assert [m["from_round"] for m in read_machines(run)] == [0]


def _fake_run(path: Path, machines: list[dict[str, object]] | None, garbage: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.toml").write_text('[algorithm]\nname = "a"\n')
    rec = {"round": 1, "mean_acc": 0.5, "weighted_acc": 0.5, "min_acc": 0.0, "max_acc": 1.0}
    (path / "metrics.jsonl").write_text(json.dumps({**rec, "std_acc": 0.1}) + "\n")
    if machines is not None:
        lines = [json.dumps(m) for m in machines] + (["{not json", "[1, 2]"] if garbage else [])
        (path / "machine.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_report_names_the_machines_when_its_runs_span_more_than_one(tmp_path: Path) -> None:
    from hyperfed.report import report_text, run_summary

    a = {"from_round": 0, "cpu": "Xeon (model 207)", "isa": "AVX512", "torch": "2.13.0+cpu"}
    b = {**a, "cpu": "EPYC (model 17)", "isa": "AVX2"}
    same = [_fake_run(tmp_path / n, [a], garbage=True) for n in ("s0", "s1")]
    assert "Machines" not in report_text([run_summary(p) for p in same])
    other = _fake_run(tmp_path / "s2", [b])
    text = report_text([run_summary(p) for p in [*same, other]])
    assert "2 different machines" in text
    assert "- Xeon (model 207), AVX512, 2.13.0+cpu: s0, s1\n" in text
    assert "- EPYC (model 17), AVX2, 2.13.0+cpu: s2\n" in text
    # a run resumed on another machine is listed under both
    moved = _fake_run(tmp_path / "s3", [a, {**b, "from_round": 40}])
    assert "- EPYC (model 17), AVX2, 2.13.0+cpu: s3\n" in report_text([run_summary(moved)])
    # runs from before machine.jsonl: no note among themselves, "not recorded" beside others
    old = [_fake_run(tmp_path / n, None) for n in ("o0", "o1")]
    assert "Machines" not in report_text([run_summary(p) for p in old])
    assert "- not recorded: o0\n" in report_text([run_summary(old[0]), run_summary(same[0])])


def test_a_machine_jsonl_that_cannot_be_written_is_one_warning_not_a_failed_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "machine.jsonl").mkdir()  # opening it to append raises IsADirectoryError
    with caplog.at_level("WARNING", logger="hyperfed"):
        RunDir(tmp_path).note_machine(3, "cpu")
    assert "could not write machine.jsonl" in caplog.text
