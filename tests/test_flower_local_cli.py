"""``hyperfed flower local``'s run directory and throwaway keys (issue 55, deployment bugs).

A reused ``--out`` is refused as ``hyperfed run`` refuses it (``--force`` to overwrite), a
deployed run's checkpoint is the one ``--resume`` looks for, and ``--secure`` hands the
SuperLink paths it can open from its own working folder and deletes the private keys on every
way out. The deployment is a stand-in here (the real ones: test_flower.py,
test_flower_secure.py), so each test takes a second.

Skipped as a whole when Flower is not installed (``pip install 'hyperfed[flower]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'hyperfed[flower]'")

from cli_helpers import invoke, sets  # noqa: E402

from hyperfed.deploy import launch  # noqa: E402
from hyperfed.deploy.launch import DeployError, LocalDeployment, superlink_command  # noqa: E402
from hyperfed.deploy.secure import SecureMaterial, make_material  # noqa: E402
from hyperfed.runtime.rundir import CHECKPOINT, RunDir  # noqa: E402

SETTINGS = [
    "device=cpu",
    "seed=0",
    "rounds=1",
    "dataset.name=digits",
    "clients.count=2",
    "clients.models=lenet",
    "algorithm.name=fedavg",
]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A deployment that starts nothing; ``seen`` records what the command handed it, and
    ``seen["fail"]`` makes it fail: "start" (DeployError while starting), "run" (the run ends
    failed), "interrupt" (Ctrl-C while waiting)."""
    seen: dict[str, Any] = {"entered": 0}

    class Fake(LocalDeployment):
        def __enter__(self) -> Fake:
            seen["entered"] += 1
            seen["resume"] = self.resume
            seen["material"] = self.secure
            if self.secure is not None:
                seen["keys"] = [p for p in self.secure.folder.rglob("*") if p.is_file()]
                # the SuperLink's arguments, opened from its own working folder
                args = superlink_command(1, secure=self.secure)
                paths = [a for a in args if a.endswith((".crt", ".pem", ".key"))]
                seen["link_files"] = [(self.workdir / p).is_file() for p in paths]
            if seen.get("fail") == "start":
                raise DeployError("flower-superlink exited: boom")
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def submit(self) -> int:
            return 1

        def wait(self, run_id: int, timeout: float, poll: float = 2.0) -> str:
            if seen.get("fail") == "interrupt":
                raise KeyboardInterrupt
            return "finished:failed" if seen.get("fail") == "run" else "finished:completed"

        def logs(self, lines: int = 40) -> str:
            return "(logs)"

    monkeypatch.setattr(launch, "LocalDeployment", Fake)
    monkeypatch.setattr("hyperfed.deploy.cli.print_final", lambda *a: None)
    return seen


def _finished_run(out: Path) -> None:
    """What a deployed run leaves: config, metrics, checkpoint, server state."""
    run = RunDir(out)
    run.create("rounds = 1\n")
    run.append_metrics({"round": 1, "mean_acc": 0.5})
    run.save_checkpoint({"round": 1})
    (out / "server_state.pt").write_bytes(b"state")


def _one_line(result: Any, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


def test_flower_local_refuses_an_out_that_holds_a_run_as_run_does(fake, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _finished_run(out)
    before = _snapshot(out)
    flower = invoke("flower", "local", *sets(SETTINGS), "--out", str(out), "--quiet")
    message = _one_line(flower)
    assert fake["entered"] == 0 and _snapshot(out) == before  # nothing started, nothing lost
    assert f"--out {out} already holds a run" in message
    assert f"--out {out} --resume continues it, --force replaces it" in message
    run = invoke("run", *sets(SETTINGS), "--out", str(out), "--quiet")
    assert _one_line(run).replace(f"--resume {out}", f"--out {out} --resume") == message
    # --force: the deployment starts (its server writes the run anew)
    assert invoke("flower", "local", *sets(SETTINGS), "--out", str(out), "--force").exit_code == 0
    assert fake["entered"] == 1 and fake["resume"] is False


def test_run_and_flower_local_refuse_an_out_with_other_files(fake, tmp_path: Path) -> None:
    """A folder without metrics but with someone's config.toml / summary.md is not written
    over (it was, by `hyperfed run`)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.toml").write_text("# my notes, not a hyperfed config\n")
    (out / "summary.md").write_text("my summary\n")
    before = _snapshot(out)
    for command in (["run"], ["flower", "local"]):
        message = _one_line(invoke(*command, *sets(SETTINGS), "--out", str(out), "--quiet"))
        assert "is not empty (config.toml, summary.md)" in message and "--force" in message
        assert _snapshot(out) == before
    assert fake["entered"] == 0


def test_flower_local_resume_finds_the_checkpoint_the_server_writes(fake, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _finished_run(out)  # RunDir.save_checkpoint: what the ServerApp's driver writes
    assert (out / CHECKPOINT).is_file()
    result = invoke("flower", "local", *sets(SETTINGS), "--out", str(out), "--resume", "--quiet")
    assert result.exit_code == 0, result.output
    assert fake["entered"] == 1 and fake["resume"] is True
    (out / CHECKPOINT).unlink()
    result = invoke("flower", "local", *sets(SETTINGS), "--out", str(out), "--resume", "--quiet")
    assert f"holds no checkpoint ({CHECKPOINT})" in _one_line(result)


def test_secure_material_paths_are_absolute_whatever_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    material = make_material(Path("runs/r/flower/secure"), 2, days=1)
    paths = [material.folder, material.ca_cert, material.server_cert, material.server_key]
    paths += [*material.node_keys, material.public_key(0)]
    assert all(p.is_absolute() and p.exists() for p in paths)
    assert SecureMaterial.load("runs/r/flower/secure", 2) == material
    # a SuperLink started in another working folder opens the files it is given
    relative = SecureMaterial(
        Path("s"), Path("s/ca.crt"), Path("s/server.pem"), Path("s/server.key"), ()
    )
    args = superlink_command(1, secure=relative)
    for flag, name in [
        ("--ssl-ca-certfile", "ca.crt"),
        ("--ssl-certfile", "server.pem"),
        ("--ssl-keyfile", "server.key"),
    ]:
        assert Path(args[args.index(flag) + 1]) == Path.cwd() / "s" / name


@pytest.mark.parametrize("failure", [None, "start", "run", "interrupt"])
def test_secure_with_a_relative_out_works_and_deletes_the_keys_on_every_way_out(
    fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str | None
) -> None:
    monkeypatch.chdir(tmp_path)
    fake["fail"] = failure
    result = invoke("flower", "local", *sets(SETTINGS), "--out", "run", "--secure", "--quiet")
    expected = {None: 0, "start": 1, "run": 1, "interrupt": 130}[failure]  # 130: Ctrl-C
    assert result.exit_code == expected, result.output
    assert fake["link_files"] == [True, True, True]  # ca.crt, server.pem, server.key
    keys = fake["keys"]
    assert {p.name for p in keys} >= {"server.key", "node-0", "node-1"}
    assert not [p for p in keys if p.exists()], "private keys left behind"
    assert not (tmp_path / "run" / "flower" / "secure").exists()
