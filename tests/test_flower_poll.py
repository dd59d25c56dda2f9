"""How often a deployment asks for messages (issue 39 item 3): the server pulls replies every
``POLL_INTERVAL`` seconds instead of Flower's 3, and ``hyperfed flower local`` runs its
SuperNodes through ``hyperfed.deploy.supernode``, which caps the node loop's 3 s / 0.5 s
waits. Hand-sized fakes, no processes.

Skipped as a whole when Flower is not installed (``pip install 'hyperfed[flower]'``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'hyperfed[flower]'")

import hyperfed.deploy.flower as fl  # noqa: E402
from hyperfed.deploy import supernode  # noqa: E402
from hyperfed.deploy.launch import supernode_command  # noqa: E402


class _Grid:
    """Replies to message i become available at pull number ``ready[i]`` (1-based)."""

    def __init__(self, ready: list[int]) -> None:
        self.ready = ready
        self.pulls = 0

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):  # type: ignore[no-untyped-def]
        self.pulls += 1
        return [
            SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=f"m{i}"))
            for i, at in enumerate(self.ready)
            if at == self.pulls and f"m{i}" in ids
        ]

    def send_and_receive(self, *a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("Flower's send_and_receive pulls every 3 s")


def test_the_server_pulls_every_poll_interval_until_every_message_is_answered(monkeypatch):
    """Replies ready at pulls 1, 3 and 4: four pulls, three waits of ``poll`` seconds each
    between them (Flower's loop waits 3 s), and every reply returned once."""
    waits: list[float] = []
    monkeypatch.setattr(fl.time, "sleep", waits.append)
    grid = _Grid([3, 1, 4])
    replies = fl.send_and_receive(grid, ["a", "b", "c"], timeout=60.0, poll=0.1)  # type: ignore[arg-type]
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert grid.pulls == 4 and waits == [0.1, 0.1, 0.1]
    assert fl.POLL_INTERVAL <= 0.1


def test_the_server_stops_pulling_at_the_timeout(monkeypatch):
    """A node that never answers: the exchange ends when the round timeout has passed, with
    the replies that came (the deployment then reports the missing client)."""
    now = [0.0]
    monkeypatch.setattr(fl.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(fl.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    grid = _Grid([1, 0])  # message 1 is never answered
    replies = fl.send_and_receive(grid, ["a", "b"], timeout=1.0, poll=0.25)  # type: ignore[arg-type]
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert grid.pulls == 5  # at t = 0, 0.25, 0.5, 0.75, 1.0


def test_capped_sleep_waits_at_most_the_cap():
    slept: list[float] = []
    clock = SimpleNamespace(sleep=slept.append, monotonic=lambda: 7.0)
    capped = supernode.CappedSleep(0.1, clock)  # type: ignore[arg-type]
    capped.sleep(3)  # Flower's idle poll
    capped.sleep(0.5)  # Flower's wait for the ClientApp's reply
    capped.sleep(0.02)
    assert slept == [0.1, 0.1, 0.02]
    assert capped.monotonic() == 7.0  # everything else is the clock's


def test_the_node_loop_of_this_flower_is_the_one_capped(monkeypatch):
    """The module whose ``time.sleep(3)`` idles the SuperNode gets the capped clock."""
    from flwr.supernode import start_client_internal as loop

    monkeypatch.setattr(loop, "time", loop.time)  # restored after the test
    assert supernode.cap_supernode_waits(0.2)
    assert isinstance(loop.time, supernode.CappedSleep) and loop.time.cap == 0.2


def test_poll_interval_is_taken_out_of_flowers_arguments():
    args = ["--insecure", "--poll-interval", "0.2", "--superlink", "127.0.0.1:1"]
    assert supernode.split_poll_interval(args) == (
        0.2,
        ["--insecure", "--superlink", "127.0.0.1:1"],
    )
    assert supernode.split_poll_interval(["--poll-interval=0.5"]) == (0.5, [])
    assert supernode.split_poll_interval([]) == (supernode.POLL_INTERVAL, [])
    for bad in (["--poll-interval", "0"], ["--poll-interval", "soon"], ["--poll-interval"]):
        with pytest.raises(SystemExit, match="--poll-interval .*: give seconds > 0"):
            supernode.split_poll_interval(bad)


def test_local_supernodes_run_through_the_capped_wrapper():
    cmd = supernode_command("127.0.0.1:1", 0, 3, 9000, poll_interval=0.3)
    assert cmd[:3] == [sys.executable, "-m", "hyperfed.deploy.supernode"]
    assert cmd[cmd.index("--poll-interval") + 1] == "0.3"
    assert cmd[cmd.index("--superlink") + 1] == "127.0.0.1:1"
