"""Every input path probed as a hostile or new user would (issue 55): bad content is one line,
exit 2, no traceback, and the output folder is left as it was. In-process and tiny: nothing
here trains beyond one round of digits."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import SMALL, assert_one_line_error, sets

from hyperfed.config import (
    MAX_CLIENTS,
    MAX_EPOCHS,
    MAX_ROUNDS,
    ConfigError,
    load_config,
    to_toml,
)
from hyperfed.runtime.rundir import CHECKPOINT, METRICS, RunDir, read_metrics


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _refused(args: list[str], out: Path, *words: str) -> None:
    """One line naming ``words``, exit 2, and ``out`` as it was (absent stays absent)."""
    before = _snapshot(out) if out.is_dir() else None
    assert_one_line_error(args, *words)
    assert (_snapshot(out) if out.is_dir() else None) == before


# data that cannot load: a setting wrongly accepted fails the test at once, never trains
_NO_DATA = ["algorithm.name=pfedhn", "dataset.name=npz", "dataset.path=/nonexistent/x.npz"]


# -- config files -------------------------------------------------------------------------
CONFIG_FILES = {
    "binary": (os.urandom(64) + b"\xff", ["not UTF-8"]),
    "toml syntax": (b"rounds = = 3\n", ["line 1"]),
    "wrong type": (b"rounds = 'three'\n", ["rounds", "valid integer"]),
    "wrong section type": (b"local = 3\n", ["local", "dictionary"]),
    "unknown key": (b"roundz = 3\n", ["roundz", "did you mean rounds"]),
    "huge number": (b"rounds = 100000000000000000000000\n", ["rounds", "1 to 1000000"]),
    "negative number": (b"[clients]\ncount = -4\n", ["clients.count", "1 to 1000000"]),
    "nan float": (b"[local]\nlr = nan\n", ["local.lr", "finite"]),
    "inf float": (b"[local]\nlr = inf\n", ["local.lr", "finite"]),
}


@pytest.mark.parametrize("name", list(CONFIG_FILES))
def test_a_bad_config_file(tmp_path: Path, name: str) -> None:
    text, words = CONFIG_FILES[name]
    path = tmp_path / "bad.toml"
    path.write_bytes(text)
    out = tmp_path / "r"
    args = ["run", "--config", str(path), "--out", str(out), "--quiet", *sets(_NO_DATA[1:])]
    _refused(args, out, *words)
    assert not out.exists()


def test_a_config_that_is_a_directory_says_so(tmp_path: Path) -> None:
    out = tmp_path / "r"
    args = ["run", "--config", str(tmp_path), "--out", str(out), "--quiet"]
    _refused(args, out, "is a directory", "TOML or YAML file")
    assert not out.exists()


# -- --set --------------------------------------------------------------------------------
SETTINGS = {
    "=3": ["expected key=value"],
    "a..b=1": ["expected key=value"],
    "nope=1": ["nope", "unknown key;"],
    "local.lr=abc": ["local.lr", "valid number"],
    "local.lr.x=1": ["lr is not a section"],
    "rounds=1e23": ["rounds", f"1 to {MAX_ROUNDS}"],
    "rounds=1e15": ["rounds", f"1 to {MAX_ROUNDS}"],
    "eval_every=0": ["eval_every", f"1 to {MAX_ROUNDS}"],
    "clients.count=10000000": ["clients.count", f"1 to {MAX_CLIENTS}"],
    "local.epochs=1e9": ["local.epochs", f"1 to {MAX_EPOCHS}"],
    "local.batch_size=0": ["local.batch_size"],
    "local.workers=5000": ["local.workers", "1 to 1024"],
    "participation=inf": ["participation", "finite"],
    "local.momentum=nan": ["local.momentum", "finite"],
    "algorithm.hn_lr=nan": ["algorithm.hn_lr", "finite"],
    "algorithm.embed_dim=-5": ["algorithm.embed_dim", "1 to 1000000000"],
    "algorithm.embed_dim=1e30": ["algorithm.embed_dim", "too large"],
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_bad_set(tmp_path: Path, setting: str) -> None:
    out = tmp_path / "r"
    args = ["run", "--out", str(out), "--quiet", *sets(_NO_DATA)]
    _refused([*args, "--set", setting], out, *SETTINGS[setting])
    assert not out.exists()


def test_the_bounds_are_inclusive() -> None:
    cfg = load_config(None, [f"rounds={MAX_ROUNDS}", f"local.epochs={MAX_EPOCHS}"])
    assert (cfg.rounds, cfg.local.epochs) == (MAX_ROUNDS, MAX_EPOCHS)
    with pytest.raises(ConfigError, match="rounds"):
        load_config(None, [f"rounds={MAX_ROUNDS + 1}"])


# -- [attack] is simulation-only ----------------------------------------------------------
@pytest.mark.parametrize("command", ["local", "sim", "app"])
def test_flower_refuses_the_poisoning_harness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    pytest.importorskip("flwr")
    from hyperfed.deploy import cli as deploy_cli

    def started(*args: object, **kwargs: object) -> None:  # a refusal never gets here
        pytest.fail("the deployment started")

    monkeypatch.setattr(deploy_cli, "_launch", started)
    out = tmp_path / "r"
    args = ["flower", command, "--out", str(out), *sets([*SMALL, "attack.kind=scale"])]
    _refused(args, out, "attack.kind = scale", "simulation-only")
    assert not out.exists()


def test_a_flower_run_config_with_an_attack_is_refused() -> None:
    """``flwr run --run-config "attack.kind='sign_flip'"`` reaches the ServerApp and nodes."""
    pytest.importorskip("flwr")
    from hyperfed.deploy.appconfig import config_from_run_config, experiment_run_config

    run_config = experiment_run_config(load_config(None, SMALL))
    assert config_from_run_config(run_config).attack.kind == "none"
    with pytest.raises(ConfigError, match="simulation-only"):
        config_from_run_config({**run_config, "attack.kind": "sign_flip"})


# -- your own data ------------------------------------------------------------------------
def _own(name: str, path: Path, *extra: str) -> list[str]:
    data = [s for s in SMALL if not s.startswith("dataset.")]
    return [*data, "rounds=1", f"dataset.name={name}", f"dataset.path={path}", *extra]


_X = np.random.default_rng(0).random((40, 1, 8, 8)).astype(np.float32)
_Y = np.arange(40) % 3
NPZ = {
    "wrong keys": (dict(images=_X, labels=_Y), ["lacks x and y", "found images, labels"]),
    "string pixels": (dict(x=np.array(["a"] * 40), y=_Y), ["dtype <U1", "real numbers"]),
    "complex pixels": (dict(x=_X.astype(np.complex64), y=_Y), ["complex64", "real numbers"]),
    "mismatched lengths": (dict(x=_X, y=_Y[:30]), ["40 samples", "y has 30"]),
    "nan pixels": (dict(x=np.where(_X > 0.5, np.nan, _X), y=_Y), ["float pixels nan"]),
    "inf vectors": (dict(x=np.full((40, 5), np.inf, np.float32), y=_Y), ["NaN or Inf"]),
    "nan labels": (dict(x=_X, y=np.where(_Y > 1, np.nan, _Y)), ["labels hold NaN"]),
    "one-hot labels": (dict(x=_X, y=np.eye(3)[_Y]), ["shape (40, 3)", "one label per sample"]),
    "labels out of range": (dict(x=_X, y=np.where(_Y > 1, 10**12, _Y)), ["at most 1000000"]),
}


@pytest.mark.parametrize("name", list(NPZ))
def test_a_bad_npz_file(tmp_path: Path, name: str) -> None:
    arrays, words = NPZ[name]
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    out = tmp_path / "r"
    _refused(["run", "--out", str(out), "--quiet", *sets(_own("npz", path))], out, *words)
    assert not out.exists()


def _folder(root: Path, kind: str) -> Path:
    from PIL import Image

    for c in "ab":
        (root / c).mkdir(parents=True)
        if kind == "non-image file":
            (root / c / "notes.txt").write_text("hello")
        elif kind == "undecodable image":
            (root / c / "x.png").write_bytes(b"not a png")
        elif kind == "huge image_size":
            Image.new("L", (8, 8)).save(root / c / "x.png")
    if kind == "empty folder":
        for c in "ab":
            (root / c).rmdir()
    return root


FOLDERS = {
    "empty folder": ["no class sub-folders"],
    "non-image file": ["no images"],
    "undecodable image": ["cannot decode image", "x.png"],
    "huge image_size": ["image_size", "between 1 and 8192"],
}


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_a_bad_image_folder(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("PIL")
    root = _folder(tmp_path / "images", kind)
    extra = ["dataset.options={image_size = 100000000}"] if kind == "huge image_size" else []
    out = tmp_path / "r"
    args = ["run", "--out", str(out), "--quiet", *sets(_own("folder", root, *extra))]
    _refused(args, out, *FOLDERS[kind])
    assert not out.exists()


@pytest.mark.parametrize("what", ["an npz file", "an image folder"])
def test_hf_disk_on_a_path_in_another_format(tmp_path: Path, what: str) -> None:
    pytest.importorskip("datasets")
    if what == "an npz file":
        path = tmp_path / "data.npz"
        np.savez(path, x=_X, y=_Y)
    else:
        path = tmp_path / "images"
        (path / "a").mkdir(parents=True)
    out = tmp_path / "r"
    args = ["run", "--out", str(out), "--quiet", *sets(_own("hf_disk", path))]
    _refused(args, out, "not a dataset saved with save_to_disk")
    assert not out.exists()


# -- checkpoints for --resume -------------------------------------------------------------
def _run_dir(path: Path, state: object, config: list[str] | None = None) -> Path:
    """A run directory holding ``state`` as its checkpoint (a valid checksum), written
    against ``config`` (default: the run's own config)."""
    path.mkdir()
    own = to_toml(load_config(None, [*SMALL, "rounds=2", "checkpoint_every=1"]))
    (path / "config.toml").write_text(to_toml(load_config(None, config)) if config else own)
    (path / METRICS).write_text("")
    RunDir(path).save_checkpoint(state)  # type: ignore[arg-type]
    (path / "config.toml").write_text(own)
    return path


def _tamper_checksum(path: Path) -> None:
    head, payload = (path / CHECKPOINT).read_bytes().split(b"\n", 1)
    header = json.loads(head)
    header["sha256"] = "0" * 64
    (path / CHECKPOINT).write_bytes(json.dumps(header).encode().ljust(511) + b"\n" + payload)


CHECKPOINTS = {
    "random bytes": ["not a hyperfed checkpoint"],
    "tampered checksum": ["checksum mismatch"],
    "another method's checkpoint": ["config.toml changed"],
    "no round number": ["does not fit this run", "no round number"],
    "another state layout": ["does not fit this run", "KeyError"],
}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_a_bad_checkpoint_for_resume(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "r"
    state: object = {"round": 1, "server": {}, "totals": {}}
    if kind == "no round number":
        state = {"weights": torch.ones(3)}
    _run_dir(run, state, [*SMALL, "algorithm.name=fedper"] if "method" in kind else None)
    if kind == "random bytes":
        (run / CHECKPOINT).write_bytes(os.urandom(3000))
    elif kind == "tampered checksum":
        _tamper_checksum(run)
    _refused(["run", "--resume", str(run), "--quiet"], run, *CHECKPOINTS[kind])


# -- hyperfed report on a corrupt metrics.jsonl -------------------------------------------
def _record(rnd: int) -> dict[str, object]:
    acc = {k: 0.5 for k in ("mean_acc", "weighted_acc", "min_acc", "max_acc", "std_acc")}
    return {"round": rnd, **acc}


CORRUPT = {
    "binary": os.urandom(200),
    "not json": b"{not json\n",
    "a json list": b"[1, 2]\n",
    "missing accuracies": b'{"round": 1}\n',
    "mistyped fields": b'{"round": "x", "mean_acc": "y"}\n',
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_report_on_a_corrupt_first_metrics_line(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS).write_bytes(CORRUPT[kind] + json.dumps(_record(1)).encode() + b"\n")
    out = tmp_path / "report"
    _refused(["report", str(run), "--out", str(out)], run, "metrics.jsonl", "line 1")
    assert not out.exists()


def test_a_corrupt_line_ends_the_records_it_follows(tmp_path: Path) -> None:
    """A kill cuts the last line: the records before it are read, nothing after it."""
    good = b"".join(json.dumps(_record(r)).encode() + b"\n" for r in (1, 2))
    for bad in CORRUPT.values():
        (tmp_path / METRICS).write_bytes(good + bad + json.dumps(_record(3)).encode() + b"\n")
        assert [r["round"] for r in read_metrics(tmp_path)] == [1, 2]


def test_report_on_an_unreadable_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS).write_text(json.dumps(_record(1)) + "\n")
    (run / "config.toml").write_text("rounds = = 1\n")
    _refused(["report", str(run), "--out", str(tmp_path / "rep")], run, "config.toml")


# -- output paths that cannot be written --------------------------------------------------
def test_outputs_under_a_file_are_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    where = blocker / "sub"  # cannot be made: its parent is a file
    assert_one_line_error(
        ["export", "--format", "npz", "--out", str(where), *sets(SMALL)], "cannot write"
    )
    for args in (["export", "--format", "npz"], ["flower", "app"], ["attack"]):
        if args[0] == "flower":
            pytest.importorskip("flwr")
        assert_one_line_error([*args, "--out", str(blocker), *sets(SMALL)], "is a file")
    assert blocker.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# -- the Flower server's state on a full disk ---------------------------------------------
def _disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save's write fails as on a full disk (it reports the OSError as RuntimeError)."""
    real = torch.save

    def save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if type(f).__name__ == "_HashingWriter":  # the run directory's streamed writes
            f.write(b"x" * 100)
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_the_flower_server_state_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("flwr")
    from hyperfed.deploy import server as server_side

    path = tmp_path / server_side.SERVER_STATE
    assert server_side.save_server_state(path, {"round": 1, "w": torch.ones(3)})
    before = path.read_bytes()
    _disk_full(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="hyperfed.flower"):
        assert not server_side.save_server_state(path, {"round": 2, "w": torch.ones(3)})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "file write failed" in lines[0] and "previous server state is kept" in lines[0]
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_flower_checkpoint_on_a_full_disk_keeps_the_last_one_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("flwr")
    from hyperfed.deploy import server as server_side

    failed: list[int] = []
    run = server_side.ServerRunDir(tmp_path, lambda: failed.append(1))
    (tmp_path / "config.toml").write_text("rounds = 2\n")
    run.save_checkpoint({"round": 1, "w": torch.ones(3)})
    _disk_full(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="hyperfed.flower"):
        assert run.save_checkpoint({"round": 2, "w": torch.ones(3)}) == 0
    monkeypatch.undo()
    assert failed == [1] and len(caplog.records) == 1
    assert "previous checkpoint is kept" in caplog.records[0].getMessage()
    state = RunDir(tmp_path).load_checkpoint()
    assert state is not None and state["round"] == 1


def test_the_config_page_states_the_bounds() -> None:
    from hyperfed import config
    from hyperfed.data import sources

    text = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    for bound in (config.MAX_ROUNDS, config.MAX_EPOCHS, config.MAX_BATCH, sources.MAX_CLASSES):
        assert f"1 to {bound:,}" in text or f"{bound:,}" in text, bound
    assert f"1 to {config.MAX_WORKERS}" in text and f"{sources.MAX_IMAGE_SIDE} pixels" in text
    assert config.MAX_SAMPLES == 10**12 and config.MAX_HPARAM_INT == 10**9
    assert "10^12" in text and "0 to 10^9" in text
