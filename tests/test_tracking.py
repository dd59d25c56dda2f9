"""[tracking]: MLflow (a local file store, read back with MLflow's own client) and Weights &
Biases (offline, read back from its ``.wandb`` file with W&B's own record schema), a resumed
run continuing the same tracked run, and the one-line error when a package is missing.
Nothing here reaches the network."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import SMALL as CLI_SMALL
from cli_helpers import invoke, sets

from hyperfed.api import build_simulation, load_config, run
from hyperfed.config import ConfigError
from hyperfed.runtime.rundir import RunDir, read_metrics
from hyperfed.runtime.simulate import resume
from hyperfed.runtime.tracking import TRACKING_FILE

SMALL = {
    "device": "cpu",
    "dataset.name": "digits",
    "rounds": 1,
    "eval_every": 1,
    "clients.count": 2,
    "dataset.subsample": 200,
    "local.epochs": 1,
    "local.workers": 1,
    "clients.models": "mlp",
    "algorithm.name": "fedavg",
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_CODE": "true",
        # W&B's own settings, for speed: no pip-package list, no system-metrics sampler
        "WANDB_X_SAVE_REQUIREMENTS": "false",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_MACHINE_INFO": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }.items():
        monkeypatch.setenv(key, value)


def _run_then_extend(out: Path, settings: dict[str, Any], api: bool) -> list[dict[str, Any]]:
    """Round 1 as a run, then ``--resume --set rounds=2``: its metrics.jsonl rows. ``api``:
    round 1 through ``hyperfed.run`` (summary.md and plots too); else, as the resume,
    through ``Simulation.run`` alone (no plots: cheaper)."""
    if api:
        run(overrides={**SMALL, **settings}, out=out, progress=False)
    else:
        build_simulation(load_config(None, {**SMALL, **settings})).run(RunDir(out))
    sim, run_dir, start = resume(out, ["rounds=2"])
    assert start == 1
    sim.run(run_dir, start_round=start)
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2]
    return rows


def test_mlflow_file_store_read_back_and_resumed(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    out = tmp_path / "run"
    rows = _run_then_extend(out, {"tracking.mlflow": True, "tracking.mlflow_uri": uri}, api=True)
    ids = json.loads((out / TRACKING_FILE).read_text())["mlflow"]
    assert ids["tracking_uri"] == uri
    client = MlflowClient(uri)
    # the resume continued the same MLflow run: one run in the experiment, both rounds in it
    exp = client.get_experiment_by_name("hyperfed")
    assert exp is not None
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [ids["run_id"]]
    for key in ("mean_acc", "weighted_acc", "test_loss", "bytes_up_total", "flops_total"):
        history = client.get_metric_history(ids["run_id"], key)
        got = [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
        assert got == [(r["round"], pytest.approx(r[key])) for r in rows], key
    got_run = client.get_run(ids["run_id"])
    assert got_run.info.status == "FINISHED"
    params = got_run.data.params
    assert params["algorithm.name"] == "fedavg"
    assert params["local.lr"] == str(load_config(None, SMALL).local.lr)
    assert params["rounds"] == "1"  # MLflow params are fixed: the extension is a tag
    assert got_run.data.tags["resumed.rounds"] == "2"
    assert got_run.data.tags["hyperfed.run_dir"] == str(out.resolve())
    artifacts = {a.path for a in client.list_artifacts(ids["run_id"])}
    assert {"summary.md", "accuracy_vs_round.png"} <= artifacts


def _wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file, parsed with W&B's own protobuf schema: a 7-byte
    header (":W&B", magic, version), then LevelDB-log blocks of 32 KiB whose chunks carry a
    7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if size == 0 and kind == 0:
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def test_wandb_offline_files_hold_the_metrics_and_resume_keeps_the_id(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    assert load_config(None).tracking.wandb_mode == "offline"  # the default
    out = tmp_path / "run"
    rows = _run_then_extend(out, {"tracking.wandb": True, "tracking.experiment": "proj"}, api=False)
    ids = json.loads((out / TRACKING_FILE).read_text())["wandb"]
    assert ids["project"] == "proj"
    # one offline folder per segment (the run and its resume), both under the same run id
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{ids['id']}.wandb"] * 2
    history: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    for f in files:
        for record in _wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == ids["id"]
                assert record.run.project == "proj"
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                items = {
                    i.nested_key[0] or i.key: json.loads(i.value_json) for i in record.history.item
                }
                history[int(items["_step"])] = items
    assert config["algorithm.name"] == "fedavg"
    assert sorted(history) == [1, 2]
    for row in rows:
        got = history[row["round"]]
        for key in ("mean_acc", "weighted_acc", "bytes_up_total", "flops_total"):
            assert math.isclose(got[key], row[key], rel_tol=1e-6), key


@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_missing_package_is_one_line_naming_the_extra(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    cfg = load_config(None, {**SMALL, f"tracking.{name}": True})
    with pytest.raises(ConfigError) as e:
        build_simulation(cfg)
    assert str(e.value) == (
        f"tracking.{name}: the {name} package is missing; pip install 'hyperfed[tracking]'"
    )
    out = tmp_path / "run"
    result = invoke("run", "--out", str(out), *sets([*CLI_SMALL, f"tracking.{name}=true"]))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "pip install 'hyperfed[tracking]'" in " ".join(result.output.split())
    assert not out.exists() or not any(out.iterdir())  # before any work: nothing written
