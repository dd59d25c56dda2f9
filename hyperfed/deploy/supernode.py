"""``python -m hyperfed.deploy.supernode [--poll-interval S] <flower-supernode arguments>``:
Flower's SuperNode with its waits shortened, and the waits every deployed process shares.

Flower 1.42 waits in three places that a loopback round of milliseconds' training notices:

- the SuperNode sleeps 3 s whenever a pull finds no message for it, and 0.5 s at a time while
  it waits for its ClientApp's reply;
- whoever pulls a message's objects (SuperNode, ClientApp, ServerApp) waits 1 s, then 2, 4,
  ... up to 10 s, when an object has not arrived yet -- and the sender pushes a message
  before its objects, so the first try usually misses by a few milliseconds;
- the ServerApp's ``Grid.send_and_receive`` sleeps 3 s between pulls
  (:func:`hyperfed.deploy.server.send_and_receive` replaces it).

FedPer, 10 digits clients, one node each: 13.9 s a round deployed with Flower's waits against
0.37 s on the Simulation Engine. This module runs the same SuperNode
(``flwr.supernode.cli.flower_supernode``) with its idle wait on a :class:`PollSchedule` --
:data:`FIRST_POLL` seconds after a message, growing by half each empty pull up to
``--poll-interval`` (default :data:`POLL_INTERVAL`), so a node asks often while a round is
under way and seldom when it is idle -- its wait for the reply (a look at its own memory, no
request) capped at :data:`FIRST_POLL`, and the object pulls retrying after
:data:`FIRST_OBJECT_RETRY` seconds (:func:`shorten_object_pulls`; the ClientApp and
ServerApp processes call it too). ``hyperfed flower local`` starts its nodes this way; a real
deployment can too (``flower app`` prints the plain ``flower-supernode`` command, Flower's
default).

It patches ``flwr.supernode.start_client_internal`` (its ``time`` module and its pull
function) and the keyword defaults of Flower's object-pull functions: internal modules of
flwr 1.42, like :mod:`hyperfed.deploy.clientapp`; with another flwr it runs the SuperNode
unchanged and says so.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

POLL_INTERVAL = 0.25  # seconds: the longest idle wait between pulls (Flower's: 3 s)
FIRST_POLL = 0.01  # seconds: the first wait after a message, and a wait for a reply (Flower: 0.5)
FIRST_OBJECT_RETRY = 0.01  # seconds: an object pull's first retry, doubling (Flower's: 1 s)

log = logging.getLogger("hyperfed")


class PollSchedule:
    """Waits between pulls that find nothing: ``first`` seconds after :meth:`reset` (a
    message came), then ``growth`` times the last, never more than ``cap``."""

    def __init__(self, first: float, cap: float, growth: float = 1.5) -> None:
        self.first, self.cap, self.growth = min(first, cap), cap, growth
        self._next = self.first

    def reset(self) -> None:
        self._next = self.first

    def next(self) -> float:
        wait = self._next
        self._next = min(wait * self.growth, self.cap)
        return wait


class NodeClock:
    """The ``time`` module as Flower's SuperNode loop sees it: its idle wait (3 s; it asks for
    ``sleep(>= 1)``) follows ``schedule``, any shorter wait (for the ClientApp's reply, in the
    node's own memory) lasts at most ``schedule.first``; everything else is ``clock``'s."""

    def __init__(self, schedule: PollSchedule, clock: ModuleType = time) -> None:
        self.schedule = schedule
        self._clock = clock

    def sleep(self, seconds: float) -> None:
        if seconds >= 1.0:
            self._clock.sleep(self.schedule.next())
        else:
            self._clock.sleep(min(seconds, self.schedule.first))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)


def _resetting(
    pull: Callable[..., int | None], schedule: PollSchedule
) -> Callable[..., int | None]:
    """Flower's pull-and-store step, restarting ``schedule`` when it brought a message."""

    def pull_and_store(*args: Any, **kwargs: Any) -> int | None:
        run_id = pull(*args, **kwargs)
        if run_id is not None:
            schedule.reset()
        return run_id

    pull_and_store.wrapped = pull  # type: ignore[attr-defined]
    return pull_and_store


def shorten_supernode_waits(cap: float, first: float = FIRST_POLL) -> bool:
    """Put Flower's SuperNode loop on a :class:`PollSchedule` (``first`` .. ``cap`` seconds);
    False (nothing changed) when this flwr has no such module."""
    try:
        from flwr.supernode import start_client_internal as loop
    except ImportError:
        return False
    pull = getattr(loop, "_pull_and_store_message", None)
    if not isinstance(getattr(loop, "time", None), (ModuleType, NodeClock)) or pull is None:
        return False
    schedule = PollSchedule(first, cap)
    loop.time = NodeClock(schedule)  # type: ignore[assignment]
    loop._pull_and_store_message = _resetting(getattr(pull, "wrapped", pull), schedule)
    return True


def shorten_object_pulls(first_retry: float = FIRST_OBJECT_RETRY) -> bool:
    """Flower's object pulls retry a missing object after ``first_retry`` seconds (doubling up
    to Flower's cap, with Flower's limits on tries and time) instead of 1 s; False when this
    flwr has no such functions."""
    try:
        from flwr.supercore.inflatable import inflatable_utils as objects
    except ImportError:
        return False
    functions = (objects.pull_objects, objects.pull_and_inflate_object_from_tree)
    defaults = [getattr(f, "__kwdefaults__", None) or {} for f in functions]
    if not all("initial_backoff" in d for d in defaults):
        return False
    for d in defaults:
        d["initial_backoff"] = first_retry
    return True


def split_poll_interval(argv: Sequence[str]) -> tuple[float, list[str]]:
    """``--poll-interval S`` (or ``--poll-interval=S``) taken out of ``argv``; the rest is
    Flower's. A missing or non-positive value is a one-line error."""
    rest: list[str] = []
    poll = POLL_INTERVAL
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--poll-interval" or arg.startswith("--poll-interval="):
            value = arg.split("=", 1)[1] if "=" in arg else (args.pop(0) if args else "")
            try:
                poll = float(value)
            except ValueError:
                poll = -1.0
            if not poll > 0:
                raise SystemExit(f"--poll-interval {value!r}: give seconds > 0, e.g. 0.1")
        else:
            rest.append(arg)
    return poll, rest


def main(argv: Sequence[str] | None = None) -> int:
    poll, rest = split_poll_interval(sys.argv[1:] if argv is None else argv)
    if not (shorten_supernode_waits(poll) and shorten_object_pulls()):
        print(
            "hyperfed.deploy.supernode: this flwr's SuperNode waits are not the ones of "
            "flwr 1.42; running Flower's SuperNode with its own waits",
            file=sys.stderr,
        )
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
