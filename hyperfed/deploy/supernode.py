"""``python -m hyperfed.deploy.supernode [--poll-interval S] <flower-supernode arguments>``:
Flower's SuperNode with its waits shortened.

Flower 1.42's SuperNode sleeps 3 s whenever a pull finds no message for it and 0.5 s while it
waits for its ClientApp's reply, so on a loopback deployment every message exchange waited
seconds for a training step of milliseconds (FedPer, 10 digits clients: 13.9 s a round
deployed against 0.37 s on the Simulation Engine). This module runs the same SuperNode
(``flwr.supernode.cli.flower_supernode``) with each of those sleeps capped at
``--poll-interval`` seconds (default :data:`POLL_INTERVAL`): the node asks the SuperLink for
work that much more often, one small request each time. ``hyperfed flower local`` starts its
nodes this way; a real deployment can too (``flower app`` prints the plain ``flower-supernode``
command, Flower's default).

It patches the ``time`` module seen by ``flwr.supernode.start_client_internal`` (an internal
module of flwr 1.42, like :mod:`hyperfed.deploy.clientapp`); with another flwr it runs the
SuperNode unchanged and says so.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

POLL_INTERVAL = 0.1  # seconds; Flower's own waits are 3 s (no message) and 0.5 s (no reply)

log = logging.getLogger("hyperfed")


class CappedSleep:
    """The ``time`` module, except that ``sleep`` waits at most ``cap`` seconds."""

    def __init__(self, cap: float, clock: ModuleType = time) -> None:
        self.cap = cap
        self._clock = clock

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(min(seconds, self.cap))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)


def cap_supernode_waits(cap: float) -> bool:
    """Cap the sleeps of Flower's SuperNode loop at ``cap`` seconds; False (nothing changed)
    when this flwr has no such module."""
    try:
        from flwr.supernode import start_client_internal as loop
    except ImportError:
        return False
    if not isinstance(getattr(loop, "time", None), (ModuleType, CappedSleep)):
        return False
    loop.time = CappedSleep(cap)  # type: ignore[assignment]
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
    if not cap_supernode_waits(poll):
        print(
            "hyperfed.deploy.supernode: this flwr has no supernode loop to shorten; "
            "running Flower's SuperNode with its own waits",
            file=sys.stderr,
        )
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
