"""The ``hyperfed`` command: help, list, one-line config errors, run directories, reports."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from cli_helpers import SMALL, invoke
from cli_helpers import sets as _sets

from hyperfed.algorithms import registry
from hyperfed.config import load_config
from hyperfed.data.partition import PARTITIONS
from hyperfed.data.sources import dataset_names
from hyperfed.models.zoo import model_names


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a small shared CPU, two threads spin against other processes
    and make these tiny models many times slower (results do not depend on it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- help and list -----------------------------------------------------------------------------


def test_python_m_hyperfed_help():
    proc = subprocess.run(
        [sys.executable, "-m", "hyperfed", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("run", "list", "report"):
        assert command in proc.stdout


@pytest.mark.parametrize(
    "args,expected",
    [
        ([], ["run", "list", "report", "bench", "attack", "flower"]),
        (["run"], ["--config", "--set", "--out", "--resume", "--quiet", "--force"]),
        (["list"], ["algorithms", "models", "datasets", "partitions"]),
        (["report"], ["--out", "--target"]),
        (["attack"], ["--client", "--images", "--round", "--distance", "--iters", "--out"]),
    ],
)
def test_help(args, expected):
    result = invoke(*args, "--help")
    assert result.exit_code == 0, result.output
    for word in expected:
        assert word in result.output


def test_list_models_gives_every_zoo_model_with_a_parameter_count():
    result = invoke("list", "models")
    assert result.exit_code == 0, result.output
    rows = dict(re.findall(r"^\W*(\w+)\s*[│|]\s*([\d,]+)\s*[│|]", result.output, re.M))
    assert set(rows) == set(model_names()), result.output
    for name, count in rows.items():
        assert int(count.replace(",", "")) > 0, name


@pytest.mark.parametrize(
    "what,names",
    [
        ("algorithms", lambda: list(registry())),
        ("datasets", dataset_names),
        ("partitions", lambda: list(PARTITIONS)),
    ],
)
def test_list(what, names):
    result = invoke("list", what)
    assert result.exit_code == 0, result.output
    expected = names()
    assert expected
    for name in expected:
        assert re.search(rf"^\W*{re.escape(name)}\W", result.output, re.M), (name, result.output)


def test_list_unknown_thing_is_a_usage_error():
    assert invoke("list", "nothing").exit_code == 2


# -- configuration errors ------------------------------------------------------------------------


def _assert_one_line_error(result, *words: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    "override,words",
    [
        ("rounds=0", ["rounds"]),
        ("participation=1.5", ["participation"]),
        ("partition.name=foo", ["partition.name", "foo"]),
        ("algorithm.name=nope", ["algorithm.name", "nope"]),
        ("algorithm.bogus=1", ["algorithm.bogus"]),
        ("clients.models=nomodel", ["clients.models", "nomodel"]),
        ('clients.models=["lenet", "nomodel"]', ["clients.models", "nomodel"]),
        ("nonsense.key=1", ["nonsense"]),
        ("local.bogus=1", ["local.bogus"]),
        ("foo", ["--set", "foo"]),
        ("dataset.name=nope", ["dataset.name", "nope"]),
        ("clients.models=cnn1", ["clients.models", "cnn1", "16x16"]),
        ("local.vectorize=maybe", ["local.vectorize"]),
        ("seed=-1", ["seed"]),
        ("dataset.subsample=100 --set partition.name=natural", ["dataset.subsample", "natural"]),
    ],
)
def test_bad_setting_is_one_line_exit_2_and_writes_nothing(tmp_path, override, words):
    out = tmp_path / "run"
    settings = ["device=cpu", *override.split(" --set ")]
    result = invoke("run", *_sets(settings), "--out", str(out), "--quiet")
    _assert_one_line_error(result, *words)
    assert not out.exists()


def test_missing_data_file_names_the_path(tmp_path):
    empty = tmp_path / "no data here"
    empty.mkdir()
    out = tmp_path / "run"
    result = invoke(
        "run",
        *_sets(["device=cpu", "dataset.name=mnist", f"dataset.data_dir={empty}"]),
        "--out",
        str(out),
        "--quiet",
    )
    _assert_one_line_error(result, str(empty))
    assert not out.exists()


def test_missing_or_broken_config_file(tmp_path):
    out = tmp_path / "run"
    missing = tmp_path / "missing.toml"
    _assert_one_line_error(invoke("run", "--config", str(missing), "--out", str(out)), str(missing))
    broken = tmp_path / "broken.toml"
    broken.write_text("rounds = = 3\n")
    _assert_one_line_error(invoke("run", "--config", str(broken), "--out", str(out)), str(broken))
    assert not out.exists()


def test_resume_needs_a_run_directory_and_no_overrides_but_rounds(tmp_path):
    _assert_one_line_error(invoke("run", "--resume", str(tmp_path)), "config.toml")
    (tmp_path / "config.toml").write_text("rounds = 3\n")
    _assert_one_line_error(
        invoke("run", "--resume", str(tmp_path), "--set", "local.lr=0.5"), "--set", "local.lr"
    )
    _assert_one_line_error(
        invoke("run", "--resume", str(tmp_path), "--config", str(tmp_path / "config.toml")),
        "--config",
    )


# -- runs and reports ------------------------------------------------------------------------------

TOML = """
rounds = 2
seed = 5

[clients]
count = 3
models = "lenet"

[algorithm]
name = "fedavg"
"""

YAML = """
rounds: 2
seed: 5
clients:
  count: 3
  models: lenet
algorithm:
  name: fedavg
"""


def test_toml_and_yaml_config_files_load_the_same(tmp_path):
    (tmp_path / "exp.toml").write_text(TOML)
    (tmp_path / "exp.yaml").write_text(YAML)
    a = load_config(tmp_path / "exp.toml")
    b = load_config(tmp_path / "exp.yaml")
    assert a == b
    assert (a.rounds, a.seed, a.clients.count) == (2, 5, 3)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """One FedAvg run from a TOML file and one Local run from a YAML file, through the CLI."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the per-test _one_thread
    root = tmp_path_factory.mktemp("runs")
    (root / "exp.toml").write_text(TOML)
    (root / "exp.yaml").write_text(YAML)
    runs = []
    for name, cfg, extra in [
        ("fedavg_run", "exp.toml", []),
        ("local_run", "exp.yaml", ["algorithm.name=local"]),
    ]:
        out = root / name
        result = invoke(
            "run", "--config", str(root / cfg), *_sets(SMALL + extra), "--out", str(out), "--quiet"
        )
        assert result.exit_code == 0, (result.output, result.exception)
        runs.append(out)
    torch.set_num_threads(previous)
    return runs


def test_run_writes_a_complete_run_directory(two_runs):
    for run, algorithm in zip(two_runs, ["fedavg", "local"]):
        for f in ("config.toml", "metrics.jsonl", "checkpoint.pt", "summary.md"):
            assert (run / f).is_file(), f
        assert (run / "accuracy_vs_round.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        cfg = load_config(run / "config.toml")  # the resolved config loads back
        assert cfg.algorithm.name == algorithm
        assert (cfg.rounds, cfg.seed, cfg.clients.count) == (2, 5, 3)  # from the file
        assert cfg.dataset.subsample == 300  # from --set
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["round"] for r in records] == [1, 2]
        for r in records:
            assert 0.0 <= r["mean_acc"] <= 1.0
            assert len(r["client_acc"]) == 3
        assert "| client | model | accuracy |" in (run / "summary.md").read_text()


def test_run_prints_the_final_table_when_not_quiet(tmp_path):
    out = tmp_path / "run"
    result = invoke("run", *_sets([*SMALL, "rounds=1", "clients.count=2"]), "--out", str(out))
    assert result.exit_code == 0, (result.output, result.exception)
    assert "mean" in result.stdout and "weighted" in result.stdout
    assert str(out.name) in result.stdout
    # where it computes, once (the suite caps auto at one core: tests/conftest.py)
    assert result.stdout.count("CPU, 1 process x 1 thread (1 core available)") == 1


def test_report_compares_runs(two_runs, tmp_path):
    out = tmp_path / "report"
    result = invoke("report", *map(str, two_runs), "--out", str(out), "--target", "0.1")
    assert result.exit_code == 0, (result.output, result.exception)
    text = (out / "report.md").read_text()
    for run, algorithm in zip(two_runs, ["fedavg", "local"]):
        rows = [line for line in text.splitlines() if line.startswith(f"| {run.name} |")]
        assert len(rows) == 1, text
        assert f"| {algorithm} |" in rows[0]
        header = next(line for line in text.splitlines() if line.startswith("| run |"))
        assert rows[0].count("|") == header.count("|")
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        reached = next(r for r in records if r["mean_acc"] >= 0.1)
        cells = [c.strip() for c in rows[0].split("|")[1:-1]]
        both_ways = reached["bytes_up_total"] + reached["bytes_down_total"]
        assert reached["bytes_down_total"] > 0 or algorithm == "local"
        assert cells[-5:-1] == [  # the last cell, the server's TFLOPs: test_reproduce
            str(reached["round"]),
            f"{reached['bytes_up_total'] / 1e6:.2f}",
            f"{both_ways / 1e6:.2f}",
            f"{reached['flops_total'] / 1e12:.3f}",
        ]
    for png in ("accuracy_vs_round.png", "accuracy_vs_upload.png", "accuracy_vs_flops.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
        assert f"({png})" in text


def test_report_on_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "not_a_run").mkdir()
    out = tmp_path / "report"
    _assert_one_line_error(
        invoke("report", str(tmp_path / "not_a_run"), "--out", str(out)), "not_a_run"
    )
    assert not out.exists()


def test_run_into_a_folder_that_holds_a_run_needs_force(tmp_path):
    out = tmp_path / "run"
    args = [*_sets([*SMALL, "rounds=1", "clients.count=2"]), "--out", str(out), "--quiet"]
    assert invoke("run", *args).exit_code == 0
    before = (out / "metrics.jsonl").read_text()
    _assert_one_line_error(invoke("run", *args), "--force")
    assert (out / "metrics.jsonl").read_text() == before  # nothing changed
    result = invoke("run", *args, "--force")
    assert result.exit_code == 0, (result.output, result.exception)


# -- bench -------------------------------------------------------------------------------------


def test_bench_times_every_path_and_prints_the_ratio_table():
    small = ["--clients", "2", "--samples", "40", "--shape", "1,8,8", "--classes", "3"]
    paths = "reference,loop,loop-nchw"
    result = invoke(
        "bench", *small, "--device", "cpu", "--rounds", "1", "--epochs", "1", "--modes", paths
    )
    assert result.exit_code == 0, result.output
    assert "channels-last activations in the engine's loop and evaluation: on" in result.output
    rows = [line for line in result.output.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["path", *paths.split(",")]
    assert rows[1].split("|")[3].strip() == "1.00x"  # the reference against itself


def test_bench_repeat_pairs_each_repetition_with_its_own_reference(monkeypatch):
    """--repeat N: each path's s/round is the median over repetitions, its ratio the median of
    the per-repetition ratios against that repetition's reference, with their range."""
    import hyperfed.bench as bench_module

    times = {"reference": iter([2.0, 4.0, 3.0]), "loop": iter([1.0, 1.0, 3.0])}

    def fake_bench_mode(mode, *args, **kwargs):
        t = next(times[mode])
        return bench_module.BenchResult(mode, t, t, 0.0, 1.0)

    monkeypatch.setattr(bench_module, "bench_mode", fake_bench_mode)
    small = ["--clients", "2", "--samples", "40", "--shape", "1,8,8", "--classes", "3"]
    result = invoke(
        "bench", *small, "--device", "cpu", "--modes", "reference,loop", "--repeat", "3"
    )
    assert result.exit_code == 0, result.output
    assert "repetition 3 of 3" in result.output
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
        for line in result.output.splitlines()
        if line.startswith("| ") and not line.startswith("| path")
    }
    # ratios per repetition: 2/1, 4/1, 3/3 -> median 2, range 1-4 (not median 3 / median 1)
    assert rows["loop"] == ["1.000", "2.00x (1.00-4.00x)"]
    assert rows["reference"] == ["3.000", "1.00x (1.00-1.00x)"]


def test_bench_repeat_below_one_is_a_one_line_error():
    result = invoke("bench", "--repeat", "0", "--device", "cpu")
    _assert_one_line_error(result, "--repeat", "at least 1")


def test_bench_unknown_path_is_a_one_line_error():
    result = invoke("bench", "--modes", "reference,warp", "--device", "cpu")
    _assert_one_line_error(result, "warp", "loop-nchw")
