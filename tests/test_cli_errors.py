"""Bad input gets one line, exit 2 and no traceback (issue 17: errors that printed tracebacks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_helpers import SMALL, assert_one_line_error, invoke, sets
from typer.testing import CliRunner

from hyperfed.algorithms import registry
from hyperfed.algorithms.base import hparam_fields
from hyperfed.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("algorithm.hn_lr=-1", ["algorithm.hn_lr", "> 0"]),
        ('algorithm.hn_lr="abc"', ["algorithm.hn_lr", "valid number"]),
        ("algorithm.hn_lrr=0.1", ["did you mean hn_lr"]),
        ("rouds=3", ["did you mean rounds"]),
        ("algorithm.name=mh_pfedhnn", ["unknown algorithm 'mh_pfedhnn'; did you mean mh_pfedhn"]),
    ],
)
def test_bad_settings_are_one_line_errors(setting: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.name=mh_pfedhn", setting])
    for word in words:
        assert word in str(err.value)


def test_every_method_default_passes_its_declared_types() -> None:
    for name in registry():
        load_config(None, [f"algorithm.name={name}"]).hparams()


def test_yaml_errors_name_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 3\n  local: [1,\n")
    with pytest.raises(ConfigError, match="line 2, column 8"):
        load_config(bad)


def test_list_models_with_a_bad_input_shape() -> None:
    assert_one_line_error(["list", "models", "--input-shape", "abc"], "--input-shape", "C,H,W")


def test_list_algorithms_shows_factory_defaults() -> None:
    result = invoke("list", "algorithms")
    assert result.exit_code == 0
    assert "_MISSING_TYPE" not in result.output
    for alg in registry().values():
        assert not any("MISSING" in repr(v) for v in hparam_fields(alg.hparams).values())


def test_report_target_must_be_a_fraction(tmp_path: Path) -> None:
    assert_one_line_error(["report", str(tmp_path), "--target", "80"], "--target", "0.8")


def test_report_out_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    assert_one_line_error(["report", str(tmp_path), "--out", str(f)], "is a file")
    assert f.read_text() == "x"


def test_natural_partition_needs_a_dataset_that_has_one(tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert_one_line_error(
        [
            "run",
            "--out",
            str(out),
            "--quiet",
            *sets([s for s in SMALL if "subsample" not in s] + ["partition.name=natural"]),
        ],
        "natural",
        "synthetic",
    )
    assert not out.exists()  # the folder made for the run is removed again


def test_flower_local_refuses_zero_nodes() -> None:
    pytest.importorskip("flwr")
    assert_one_line_error(["flower", "local", "--nodes", "0", *sets(SMALL)], "--nodes 0")


# -- issue 55: inputs that still printed a traceback ----------------------------------------


def _half(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("compressed", [False, True])
def test_a_truncated_npz_file(tmp_path: Path, compressed: bool) -> None:
    import numpy as np

    data = tmp_path / "data.npz"
    save = np.savez_compressed if compressed else np.savez
    save(data, x=np.zeros((40, 1, 8, 8), np.float32), y=np.arange(40) % 3)
    out = tmp_path / "r"
    npz = [*SMALL[:1], "dataset.name=npz", f"dataset.path={_half(data)}", *SMALL[3:]]
    assert_one_line_error(["run", "--out", str(out), "--quiet", *sets(npz)], "npz", "truncated")
    assert not out.exists()


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_config_file_that_is_not_utf8(tmp_path: Path, suffix: str) -> None:
    bad = tmp_path / f"latin1{suffix}"
    text = "rounds: 1\n# r\xe9sum\xe9\n" if suffix == ".yaml" else "rounds = 1\n# r\xe9sum\xe9\n"
    bad.write_bytes(text.encode("latin-1"))  # é is byte 0xe9, not UTF-8
    out = tmp_path / "r"
    args = ["run", "--config", str(bad), "--out", str(out), "--quiet"]
    assert_one_line_error(args, str(bad), "not UTF-8", "line 2", "0xe9")
    assert not out.exists()


def test_a_seed_beyond_64_bits(tmp_path: Path) -> None:
    out = tmp_path / "r"
    big = "seed=99999999999999999999999"
    assert_one_line_error(
        ["run", "--out", str(out), "--quiet", *sets([*SMALL, big])], "seed", "4294967295"
    )
    assert not out.exists()
    with pytest.raises(ConfigError, match="seed"):
        load_config(None, [f"seed={2**32}"])
    assert load_config(None, [f"seed={2**32 - 1}"]).seed == 2**32 - 1


# -- issue 58: one error boundary for every command ---------------------------------------


def _commands() -> list[tuple[list[str], Any]]:
    """(the group path, typer's CommandInfo) of every command, ``hyperfed flower``'s too."""
    from hyperfed.cli import app

    found: list[tuple[list[str], Any]] = [([], c) for c in app.registered_commands]
    for group in app.registered_groups:
        assert group.typer_instance is not None and group.name
        found += [([group.name], c) for c in group.typer_instance.registered_commands]
    return found


def _id(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(["hyperfed", *value])
    return str(value.name or value.callback.__name__)


@pytest.mark.parametrize(("group", "info"), _commands(), ids=_id)
def test_a_hyperfed_error_in_any_command_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, group: list[str], info: Any
) -> None:
    """The command's body stands in with one that raises (no option of its own left): the
    error comes out as ``error: <message>`` alone on stderr, exit code 2, nothing else."""
    from typer.main import get_command_name

    from hyperfed.cli import app
    from hyperfed.errors import HyperfedError

    name = info.name or get_command_name(info.callback.__name__)

    def body() -> None:
        raise HyperfedError("--set a.b=[red]x[/red]: not allowed here")

    body.__name__ = info.callback.__name__
    monkeypatch.setattr(info, "callback", body)
    result = CliRunner().invoke(app, [*group, name])
    assert result.exit_code == 2, result.output
    assert result.stderr == "error: --set a.b=[red]x[/red]: not allowed here\n"
    assert result.stdout == ""


def test_an_error_deep_in_a_sweep_is_one_line_after_its_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hyperfed.sweep
    from hyperfed.sweep import SweepError

    def run_sweep(out: Path, **kw: Any) -> None:
        kw["on_progress"](0, 4, "")
        raise SweepError(f"{out}: holds a sweep of another grid")

    monkeypatch.setattr(hyperfed.sweep, "run_sweep", run_sweep)
    out = tmp_path / "s"
    result = invoke("sweep", "--out", str(out))
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {out}: holds a sweep of another grid\n"
