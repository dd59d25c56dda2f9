"""Ecosystem conventions (issue 28 item 5): shell completion, the config's JSON schema, the
resolved config written by a maintained TOML writer (tomli-w)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib
from cli_helpers import invoke

from hyperfed.config import ExperimentConfig, load_config, to_toml


def test_shell_completion_is_on():
    exe = Path(sys.executable).with_name("hyperfed")
    # the shell named, not detected from the process tree (CI runs under sh, which typer
    # cannot complete); typer reads this switch when the app is built, so a fresh process
    no_detection = {**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    script = subprocess.run(
        [exe, "--show-completion", "bash"], env=no_detection, capture_output=True, text=True
    )
    assert script.returncode == 0, script.stderr
    assert "complete -o default -F _hyperfed_completion hyperfed" in script.stdout
    assert "_HYPERFED_COMPLETE=complete_bash" in script.stdout
    assert "--install-completion" in invoke("--help").output
    # what that script asks the installed command when <TAB> is pressed after "hyperfed list "
    env = {**os.environ, "_HYPERFED_COMPLETE": "complete_bash", "COMP_CWORD": "2"}
    env["COMP_WORDS"] = "hyperfed list "
    proc = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["algorithms", "models", "datasets", "partitions"], proc


def test_schema_is_the_configs_json_schema():
    result = invoke("schema")
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    props = schema["properties"]
    assert {"rounds", "dataset", "clients", "algorithm", "local"} <= set(props)
    assert props["rounds"]["minimum"] == 1 and props["rounds"]["default"] == 20
    dataset = schema["$defs"]["DatasetConfig"]
    assert "name" in dataset["properties"] and dataset["additionalProperties"] is False
    assert schema == {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **ExperimentConfig.model_json_schema(),
    }


def test_the_resolved_config_round_trips_through_toml(tmp_path):
    sets = [
        'dataset.data_dir="C:\\\\data \\"x\\" é"',  # a backslash, quotes and non-ASCII
        'clients.models=["lenet", "lenet"]',
        "clients.count=5",
        'clients.new_models=["mlp"]',
        "clients.new_count=1",
        "algorithm.name=dfedavg",
        'algorithm.topology="networkx:watts_strogatz_graph"',
        "algorithm.dfedavg.graph_args={k = 4, p = 0.1}",  # a table in a per-method table
        "algorithm.p=0.25",
        "local.lr=1e-4",
        "rounds=3",
    ]
    cfg = load_config(None, sets)
    text = to_toml(cfg)
    data = tomllib.loads(text)
    assert data["algorithm"]["dfedavg"]["graph_args"] == {"k": 4, "p": 0.1}
    assert data["clients"]["models"] == ["lenet", "lenet"]
    path = tmp_path / "config.toml"
    path.write_text(text)
    again = load_config(path)
    assert again.model_dump() == cfg.model_dump()
    assert again.hparams() == cfg.hparams()
    assert again.dataset.data_dir == 'C:\\data "x" é'
    assert to_toml(again) == text  # a fixed point: resume compares the file's hash
