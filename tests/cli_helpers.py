"""Calling the ``hyperfed`` command in-process (shared by the CLI tests)."""

from __future__ import annotations

from typer.testing import CliRunner

from hyperfed.cli import app

# a wide console, so that rich tables never wrap a name
ENV = {"COLUMNS": "250", "HYPERFED_DATA": None}
SMALL = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=300",
    "clients.count=3",
    "clients.models=lenet",
    "algorithm.name=fedavg",
    "local.epochs=1",
    "eval_every=1",
]


def invoke(*args: str):
    from hyperfed.terminal import console

    # rich reads COLUMNS once, when the console is made (at import): set the width itself
    before = console.width
    console.width = int(ENV["COLUMNS"] or 250)
    try:
        return CliRunner().invoke(app, list(args), env=ENV)
    finally:
        console.width = before


def sets(settings: list[str]) -> list[str]:
    """``--set k=v`` for each setting."""
    return [a for s in settings for a in ("--set", s)]


def assert_one_line_error(args: list[str], *words: str) -> None:
    """The command exits 2 without a traceback, its message naming each of ``words``."""
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = " ".join(result.output.split())
    for word in words:
        assert word in message, message
