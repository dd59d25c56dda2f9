"""How often a deployment asks for messages (issue 39 item 3): the server and the nodes pull on
a schedule -- ``FIRST_POLL`` seconds after a message, half as long again after each empty
pull, at most ``POLL_INTERVAL`` -- instead of Flower's 3 s; a node's wait for its ClientApp's
reply lasts ``FIRST_POLL`` (Flower: 0.5 s); an object pull retries after
``FIRST_OBJECT_RETRY`` (Flower: 1 s). Hand-sized fakes, no processes.

Skipped as a whole when Flower is not installed (``pip install 'hyperfed[flower]'``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'hyperfed[flower]'")

from hyperfed.deploy import server as server_side  # noqa: E402
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


def _schedule(n: int, first: float, cap: float) -> list[float]:
    """The waits the module docstring describes: first, then x1.5 each, never above cap."""
    out = [first]
    while len(out) < n:
        out.append(min(out[-1] * 1.5, cap))
    return out


def test_the_server_pulls_on_the_schedule_until_every_message_is_answered(monkeypatch):
    """Replies ready at pulls 1, 3 and 4: four pulls; a reply restarts the schedule (Flower's
    loop waits 3 s each time), and every reply is returned once."""
    waits: list[float] = []
    monkeypatch.setattr(server_side.time, "sleep", waits.append)
    grid = _Grid([3, 1, 4])
    replies = server_side.send_and_receive(grid, ["a", "b", "c"], timeout=60.0, poll=0.1)  # type: ignore[arg-type]
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    first = supernode.FIRST_POLL
    assert grid.pulls == 4 and waits == pytest.approx([first, first * 1.5, first])
    assert first <= 0.01 and supernode.POLL_INTERVAL <= 0.25


def test_the_server_stops_pulling_at_the_timeout(monkeypatch):
    """A node that never answers: the waits grow to ``poll`` and the exchange ends when the
    round timeout has passed, with the replies that came (the deployment then reports the
    missing client)."""
    now = [0.0]
    waits: list[float] = []

    def sleep(s: float) -> None:
        waits.append(s)
        now[0] += s

    monkeypatch.setattr(server_side.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(server_side.time, "sleep", sleep)
    grid = _Grid([1, 0])  # message 1 is never answered
    replies = server_side.send_and_receive(grid, ["a", "b"], timeout=1.0, poll=0.25)  # type: ignore[arg-type]
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert waits == pytest.approx(_schedule(len(waits), supernode.FIRST_POLL, 0.25))
    assert waits[-1] == 0.25 and sum(waits[:-1]) < 1.0 <= sum(waits)
    assert grid.pulls == len(waits) + 1


def test_the_node_waits_on_the_schedule_and_briefly_for_its_reply():
    slept: list[float] = []
    clock = SimpleNamespace(sleep=slept.append, monotonic=lambda: 7.0)
    node = supernode.NodeClock(supernode.PollSchedule(0.01, 0.1), clock)  # type: ignore[arg-type]
    for _ in range(7):
        node.sleep(3)  # Flower's idle poll
    assert slept == pytest.approx(_schedule(7, 0.01, 0.1))
    slept.clear()
    node.sleep(0.5)  # Flower's wait for the ClientApp's reply: a look at the node's memory
    node.sleep(0.005)
    assert slept == [0.01, 0.005]
    node.schedule.reset()  # a message came
    node.sleep(3)
    assert slept[-1] == 0.01
    assert node.monotonic() == 7.0  # everything else is the clock's


def test_the_node_loop_of_this_flower_is_the_one_shortened(monkeypatch):
    """The module whose ``time.sleep(3)`` idles the SuperNode gets the node clock, and its
    pull step restarts the schedule when it brought a message."""
    from flwr.supernode import start_client_internal as loop

    monkeypatch.setattr(loop, "time", loop.time)  # restored after the test
    monkeypatch.setattr(loop, "_pull_and_store_message", lambda **kw: kw["answer"])
    assert supernode.shorten_supernode_waits(0.2)
    assert isinstance(loop.time, supernode.NodeClock) and loop.time.schedule.cap == 0.2
    schedule = loop.time.schedule
    schedule.next(), schedule.next()
    loop._pull_and_store_message(answer=None)  # nothing for this node
    assert schedule.next() > schedule.first
    loop._pull_and_store_message(answer=42)  # a message of run 42
    assert schedule.next() == schedule.first
    assert supernode.shorten_supernode_waits(0.3)  # twice: the pull is wrapped once
    assert loop._pull_and_store_message.wrapped(answer=7) == 7  # type: ignore[attr-defined]


def test_an_object_pull_retries_after_the_first_retry_not_a_second(monkeypatch):
    """Flower pulls a message's objects right after the message, often before the sender has
    pushed them; its first retry waits 1 s. Shortened: FIRST_OBJECT_RETRY, then doubling."""
    from flwr.supercore.inflatable import inflatable_utils as objects

    for f in (objects.pull_objects, objects.pull_and_inflate_object_from_tree):
        monkeypatch.setitem(
            f.__kwdefaults__, "initial_backoff", f.__kwdefaults__["initial_backoff"]
        )
    waits: list[float] = []

    class Event(objects.threading.Event):  # type: ignore[name-defined,misc]
        def wait(self, timeout=None):  # type: ignore[no-untyped-def]
            if timeout is None:  # the thread pool's own waits
                return super().wait()
            waits.append(timeout)  # the retry's backoff
            return False

    monkeypatch.setattr(objects.threading, "Event", Event)
    monkeypatch.setattr(objects.random, "uniform", lambda a, b: 0.0)  # no jitter
    tries = {"a": 0}

    def pull(object_id: str) -> bytes:
        tries[object_id] += 1
        if tries[object_id] < 3:
            raise objects.ObjectUnavailableError(object_id)
        return b"x"

    assert objects.pull_objects(["a"], pull) == {"a": b"x"}
    assert waits == [1.0, 2.0]  # Flower's
    waits.clear()
    tries["a"] = 0
    assert supernode.shorten_object_pulls()
    assert objects.pull_objects(["a"], pull) == {"a": b"x"}
    first = supernode.FIRST_OBJECT_RETRY
    assert waits == pytest.approx([first, 2 * first]) and first <= 0.01


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


def test_the_run_status_is_asked_in_process_and_the_cli_only_when_that_fails(tmp_path):
    """``flwr list`` is a Python start and ~1 s of CPU; polled every 2 s it took a core's
    share from the nodes. The status comes over the Control API connection; the CLI answers
    only when that fails (e.g. another flwr)."""
    from hyperfed.config import load_config
    from hyperfed.deploy.launch import LocalDeployment

    cfg = load_config(None, ["dataset.name=digits", "clients.count=2"])
    d = LocalDeployment(cfg, tmp_path / "flower", tmp_path / "run", nodes=2, num_partitions=2)
    cli_calls: list[tuple[str, ...]] = []

    def cli(*args: str, timeout: float = 120.0):  # type: ignore[no-untyped-def]
        cli_calls.append(args)
        out = '{"success": true, "runs": [{"run-id": 7, "status": "finished:completed"}]}'
        return SimpleNamespace(stdout=out, returncode=0)

    d.flwr = cli  # type: ignore[method-assign]
    d._control_status = lambda run_id: "running"  # type: ignore[method-assign]
    assert d.status(7) == "running" and cli_calls == []

    def broken(run_id: int) -> str:
        raise RuntimeError("no Control API here")

    d._control_status = broken  # type: ignore[method-assign]
    assert d.status(7) == "finished:completed"
    assert cli_calls == [("list", "--run-id", "7", "--format", "json")]
