"""Stopping and killing a deployment's processes takes along the children they detached
(Flower's SuperLink starts its SuperExec with ``start_new_session``; the ServerApp runs in
that session), so a stopped or crashed SuperLink leaves no ServerApp behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperfed.deploy.launch import Process

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="the detached-child lookup reads /proc"
)

# a "SuperLink": starts a detached "SuperExec", which starts a "ServerApp" in its own group,
# then all three sleep; the two descendants' pids go to argv[1]
LINK = """
import subprocess, sys, time
code = '''
import subprocess, sys, time
app = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(f"{__import__('os').getpid()} {app.pid}")
time.sleep(600)
'''
subprocess.Popen([sys.executable, "-c", code, sys.argv[1]], start_new_session=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Pids a test started: killed at the end whatever the test found (a broken stop must
    not leave sleepers behind)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def start_link(tmp_path: Path, started: list[int]) -> tuple[Process, list[int]]:
    pids_file = tmp_path / "pids"
    popen = subprocess.Popen([sys.executable, "-c", LINK, str(pids_file)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pids_file.exists() or len(pids_file.read_text().split()) < 2:
        assert time.monotonic() < deadline, "the process tree did not start"
        time.sleep(0.05)
    descendants = [int(v) for v in pids_file.read_text().split()]
    started.extend([popen.pid, *descendants])
    assert all(running(p) for p in descendants)
    return Process("superlink", popen, tmp_path / "log"), descendants


def wait_gone(pids: list[int], seconds: float = 10) -> list[int]:
    deadline = time.monotonic() + seconds
    while [p for p in pids if running(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def test_kill_takes_the_detached_superexec_and_its_serverapp(
    tmp_path: Path, started: list[int]
) -> None:
    link, descendants = start_link(tmp_path, started)
    link.kill()  # a crashed machine: nothing of the server may keep running
    assert not running(link.pid)
    assert wait_gone(descendants) == []


def test_stop_takes_the_detached_superexec_and_its_serverapp(
    tmp_path: Path, started: list[int]
) -> None:
    link, descendants = start_link(tmp_path, started)
    link.stop(grace=1.0)
    assert not running(link.pid)
    assert wait_gone(descendants) == []
