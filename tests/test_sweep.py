"""``hyperfed sweep`` and the grouped report (issue 26): a grid is expanded as written, a
sweep killed midway resumes (finished runs skipped, the rest run), and the report's mean and
std over seeds are the runs' own final figures."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyperfed.report import group_by_seed, run_summary, write_report
from hyperfed.runtime.rundir import read_metrics
from hyperfed.sweep import SweepError, expand, parse_axes, run_sweep, split_values

TINY = [
    "dataset.name=digits",
    "dataset.subsample=200",
    "clients.count=3",
    "clients.models=mlp",
    "rounds=2",
    "eval_every=1",
    "local.epochs=1",
    "partition.val_fraction=0.2",
    "device=cpu",
]


def test_values_split_at_top_level_commas_only() -> None:
    assert split_values('fedavg, local,["lenet","vgg8"],"a,b"') == [
        "fedavg",
        "local",
        '["lenet","vgg8"]',
        '"a,b"',
    ]


def test_grid_is_the_product_of_the_axes_times_the_seeds() -> None:
    axes = parse_axes(["algorithm.name=fedavg,local", "rounds=3", "local.lr=0.1,0.01"])
    points = expand(axes, [0, 1])
    assert len(points) == 2 * 2 * 2
    # first axis slowest, seed fastest; names show only what varies
    assert points[0].name == "algorithm.name=fedavg,local.lr=0.1,seed=0"
    assert points[1].name == "algorithm.name=fedavg,local.lr=0.1,seed=1"
    assert points[-1].sets == ("algorithm.name=local", "rounds=3", "local.lr=0.01", "seed=1")


@pytest.mark.parametrize(
    "sets, message",
    [
        (["rounds"], "expected key=value"),
        (["seed=1,2"], "give seeds with --seeds"),
        (["rounds=2", "rounds=3"], "may appear once"),
    ],
)
def test_bad_axes_are_refused_in_one_line(sets: list[str], message: str) -> None:
    with pytest.raises(SweepError, match=message):
        parse_axes(sets)


def test_a_bad_point_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="run algorithm.name=nope,seed=0: .*unknown algorithm"):
        run_sweep(tmp_path / "s", config=None, sets=["algorithm.name=fedavg,nope"], seeds=[0])
    assert not (tmp_path / "s").exists()  # nothing written


@pytest.mark.slow
def test_sweep_killed_midway_resumes_and_reports_mean_and_std(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    sets = ["algorithm.name=fedavg,local", *TINY]
    cmd = [sys.executable, "-m", "hyperfed", "sweep", "--seeds", "0,1", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    first = out / "algorithm.name=fedavg,seed=0"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # kill it once the first run has finished
        if (first / "metrics.jsonl").exists() and len(read_metrics(first)) == 2:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode != 0
    # resume: the stored grid, the finished run skipped, the others run
    result = run_sweep(out, config=None, sets=[], seeds=[])
    assert "algorithm.name=fedavg,seed=0" in result.skipped
    assert sorted(result.skipped + result.done) == sorted(
        f"algorithm.name={a},seed={s}" for a in ("fedavg", "local") for s in (0, 1)
    )
    assert not result.failed

    runs = sorted(p for p in out.iterdir() if p.is_dir())
    groups = group_by_seed([run_summary(p) for p in runs])
    assert [g["label"] for g in groups] == ["fedavg", "local"]
    report = write_report(runs, tmp_path / "report").read_text()
    for algo in ("fedavg", "local"):
        finals = [read_metrics(out / f"algorithm.name={algo},seed={s}")[-1] for s in (0, 1)]
        accs = [r["mean_acc"] for r in finals]
        mean, std = statistics.fmean(accs), statistics.pstdev(accs)
        scored = "global" if algo == "fedavg" else "personalized"
        row = rf"\| {algo} \| {scored} \| [^|]+ \| 2 \(0, 1\) \| {mean:.4f} ± {std:.4f} \|"
        assert re.search(row, report), row


def test_groups_of_one_method_are_labelled_by_the_hyperparameter_that_varies() -> None:
    def summary(generation: str, seed: int) -> dict[str, object]:
        cfg = {"seed": seed, "algorithm": {"name": "dfedhp", "generation": generation}}
        return {"config": cfg, "algorithm": "dfedhp"}

    runs = [summary(g, s) for g in ("residual", "literal") for s in (0, 1)]
    labels = [g["label"] for g in group_by_seed(runs)]  # type: ignore[arg-type]
    assert labels == ["algorithm.generation=residual", "algorithm.generation=literal"]


def test_drop_checkpoints_deletes_finished_runs_checkpoints_and_keeps_them_done(
    tmp_path: Path,
) -> None:
    """Without the option every finished run keeps its ``checkpoint.pt`` (``--resume``);
    resuming the folder with ``--drop-checkpoints`` deletes the finished run's, the metrics
    still mark it done (it does not rerun), and the run it starts leaves none behind."""
    import shutil

    from typer.testing import CliRunner

    from hyperfed.cli import app
    from hyperfed.sweep import checkpoint_bytes

    out = tmp_path / "sweep"
    first = run_sweep(out, config=None, sets=["algorithm.name=local", *TINY], seeds=[0, 1])
    assert first.done == ["seed=0", "seed=1"]
    assert len(list(out.rglob("checkpoint.pt"))) == 2 and checkpoint_bytes(out) > 0
    shutil.rmtree(out / "seed=1")  # to be run again by the resume
    args = ["sweep", "--out", str(out), "--drop-checkpoints"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "1 finished, 0 failed, 1 skipped (finished before)" in " ".join(result.output.split())
    assert checkpoint_bytes(out) == 0 and not list(out.rglob("checkpoint.pt"))
    for seed in (0, 1):
        assert len(read_metrics(out / f"seed={seed}")) == 2


def _missing_data(tmp_path: Path) -> list[str]:
    """``--set`` options of a run that fails at data load, before any training, with an error
    quoting ``tmp_path/[x]`` in brackets: ``[/tmp/.../[x], ...]`` is a closing tag to rich."""
    return ["dataset.name=fashion_mnist", f"dataset.data_dir={tmp_path / '[x]'}", "rounds=1"]


def test_a_failed_run_is_one_literal_line_with_its_name_counted_failed_and_exit_1(
    tmp_path: Path,
) -> None:
    """Issue 56: the failed run's own error, printed as written (not read as console markup,
    which crashed the sweep with a MarkupError traceback), named, counted as failed in the
    progress and summary lines, and the exit status is 1."""
    from typer.testing import CliRunner

    from hyperfed.cli import app

    out = tmp_path / "sweep"
    args = ["sweep", "--out", str(out), "--seeds", "0"]
    for s in _missing_data(tmp_path):
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.splitlines()
    failed = [line for line in lines if line.startswith("failed: seed=0: ")]
    assert len(failed) == 1, result.output
    assert f"not found in [{tmp_path / '[x]'}, " in failed[0]  # the brackets printed literally
    assert f"(full output: {out / '.seed=0.log'})" in failed[0]
    assert "sweep: 1/1 runs ended (seed=0 failed)" in lines
    assert f"sweep {out}: 0 finished, 1 failed, 0 skipped (finished before)" in lines
    assert "Traceback" not in result.output


def test_reproduce_names_each_failed_run_counts_it_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hyperfed reproduce`` without its data: the table is still written, then each failed
    run's one-line error (brackets literal) and the finished / failed / skipped counts."""
    from typer.testing import CliRunner

    from hyperfed import reproduce
    from hyperfed.cli import app

    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "tiny.toml").write_text('[clients]\ncount = 3\nmodels = "mlp"\n')
    sets = tuple(_missing_data(tmp_path))
    target = reproduce.Target("9:t", "toy", "tiny.toml", ("fedavg", "local"), ("local",), cpu=sets)
    monkeypatch.setitem(reproduce.TARGETS, target.key, target)
    args = ["reproduce", target.key, "--methods", "local", "--seeds", "0"]
    args += ["--out", str(tmp_path / "r"), "--configs", str(configs)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    failed = [line for line in lines if line.startswith("failed: algorithm.name=local,seed=0: ")]
    assert len(failed) == 1, result.output
    assert f"not found in [{tmp_path / '[x]'}, " in failed[0]
    assert "9:t runs: 0 finished, 1 failed, 0 skipped (finished before)" in lines


def test_failure_and_plain_lines_print_user_text_literally(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``[/data]`` is a closing tag to rich (a MarkupError) and ``[bold]`` a style: both print
    as written."""
    from hyperfed.terminal import print_failed, say

    print_failed("seed=0", "error: not found in [/data, /data/x]; [bold]no[/bold]")
    say("resume [/out]", err=True)
    err = capsys.readouterr().err
    assert "failed: seed=0: not found in [/data, /data/x]; [bold]no[/bold]\n" in err
    assert "resume [/out]\n" in err


def _hand_run(path: Path, seed: int, accs: list[float]) -> None:
    """A run directory written by hand: FedAvg, ``seed``, one record per round."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text(f'seed = {seed}\n[algorithm]\nname = "fedavg"\n')
    rows = [
        {
            "round": r,
            "scores": "global",
            "mean_acc": a,
            "weighted_acc": a,
            "min_acc": a,
            "max_acc": a,
            "std_acc": 0.0,
            "num_clients": 2,
        }
        for r, a in enumerate(accs, 1)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_report_prints_the_over_seeds_table_and_writes_inside_its_first_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56 item 5: the console shows mean ± std over seeds (seeds 0.6 and 0.8 at the
    last round: 0.7000 ± 0.1000, population std), not only the per-run rows; the report goes
    to ``<first input>/report/`` (not the current folder) and is replaced only with --force."""
    from hyperfed.cli import app

    sweep = tmp_path / "s"
    _hand_run(sweep / "seed=0", 0, [0.5, 0.6])
    _hand_run(sweep / "seed=1", 1, [0.7, 0.8])
    monkeypatch.chdir(tmp_path)
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["report", str(sweep)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    over = [line for line in lines if line.startswith("| fedavg | global |")]
    assert len(over) == 1 and "| 2 (0, 1) | 0.7000 ± 0.1000 | 0.7000 ± 0.1000 |" in over[0]
    assert lines.index("## Over seeds") < lines.index("## Runs")
    assert sum(line.startswith("| seed=") for line in lines) == 2  # and the per-run rows
    report = sweep / "report" / "report.md"
    assert report.exists() and not (tmp_path / "report").exists()
    assert f"wrote {report} and plots in {sweep / 'report'}/" in lines
    before = report.read_text()
    # an earlier report is not replaced without --force: one line, exit 2, the file as it was
    _hand_run(sweep / "seed=2", 2, [0.9, 0.9])
    again = CliRunner().invoke(app, ["report", str(sweep)])
    assert again.exit_code == 2, again.output
    assert " ".join(again.output.split()) == (
        f"error: {sweep / 'report'} already holds a report; --force replaces it, or choose "
        "another --out"
    )
    assert report.read_text() == before
    forced = CliRunner().invoke(app, ["report", str(sweep), "--force"], env={"COLUMNS": "250"})
    assert forced.exit_code == 0, forced.output
    assert "| 3 (0, 1, 2) |" in report.read_text()


def test_a_running_run_s_live_line_is_its_last_record_with_an_eta(tmp_path: Path) -> None:
    """Round 2 of 5 recorded at 20 s on the run's clock: 10 s a round, 3 rounds left, eta 30 s;
    a line cut by the writer is skipped; no metrics yet: starting."""
    from hyperfed.sweep import LiveRun, live_run

    run = tmp_path / "run"
    assert live_run(run, 5) == LiveRun(0, 5) and live_run(run, 5).line() == "round 0/5, starting"
    run.mkdir()
    rows = [{"round": 1, "mean_acc": 0.4, "seconds": 10.0}, {"round": 2, "mean_acc": 0.6}]
    rows[1]["seconds"] = 20.0
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"round": 3, "mean_a'
    (run / "metrics.jsonl").write_text(text)
    live = live_run(run, 5)
    assert live == LiveRun(2, 5, 0.6, 30.0)
    assert live.line() == "round 2/5, mean acc 0.6000, eta 30 s"


def test_sweep_shows_a_live_line_per_running_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56 item 4: while a run (a subprocess) goes, the sweep polls its metrics.jsonl
    and prints its round, accuracy and ETA (off a terminal: a line whenever the round moves).
    The subprocess is a stand-in writing one record per poll, the clock a counter."""
    import itertools

    from typer.testing import CliRunner

    from hyperfed import sweep as sweep_mod
    from hyperfed.cli import app

    class FakeRun:  # "hyperfed run --out DIR": one record (10 s a round) per poll, 2 rounds
        def __init__(self, cmd: list[str], **kw: object) -> None:
            self.out = Path(cmd[cmd.index("--out") + 1])
            self.out.mkdir(parents=True)
            self.polls = 0
            self.returncode: int | None = None

        def poll(self) -> int | None:
            self.polls += 1
            if self.polls > 2:
                self.returncode = 0
                return 0
            row = {"round": self.polls, "mean_acc": 0.25 * self.polls, "seconds": 10.0 * self.polls}
            with (self.out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            return None

    clock = itertools.count()
    monkeypatch.setattr(sweep_mod.subprocess, "Popen", FakeRun)
    monkeypatch.setattr(sweep_mod.time, "sleep", lambda s: None)
    monkeypatch.setattr(sweep_mod.time, "monotonic", lambda: float(next(clock)))
    out = tmp_path / "s"
    args = ["sweep", "--out", str(out), "--seeds", "0", "--set", "rounds=2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    live = [line for line in result.output.splitlines() if line.startswith("sweep: seed=0: ")]
    assert live == [
        "sweep: seed=0: round 1/2, mean acc 0.2500, eta 10 s",
        "sweep: seed=0: round 2/2, mean acc 0.5000, eta 0 s",
    ]
