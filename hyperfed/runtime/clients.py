"""Running a client role over client ids, written once for every transport.

A :class:`ClientHost` takes the messages of some clients, groups the clients by architecture
(the simulator's order: groups, then client id), stacks each group's messages and states,
calls the client role (``Client.fit`` / ``setup`` / ``mix`` / ``eval_model``), unstacks what
comes back and writes the new states to a :class:`StateStore`. The in-memory simulator, the
worker processes of ``local.workers`` (one group chunk at a time: :meth:`ClientHost.fit_group`,
:meth:`ClientHost.evaluate_group`) and a Flower node all run this code; they differ only in
where the states live (a dict in memory; a node's ``context.state`` and its disk files) and
in how the results travel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from hyperfed.algorithms.base import (
    Client,
    ClientGroup,
    Payload,
    StackedOnRead,
    stack_payloads,
    unstack_payload,
)
from hyperfed.data.federated import FederatedData
from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.metering import FlopMeter
from hyperfed.models.layout import FunctionalModel, channels_last

State = dict[str, Tensor]  # one client's persistent state
MakeGroup = Callable[[str, list[int], int], ClientGroup]  # (architecture, client ids, round)
# (correct, total, loss sum) of each client of a group, on one split
GroupCounts = tuple[Tensor, Tensor, Tensor]


class StateStore(Protocol):
    """Where the clients' persistent states live, by client id."""

    def get(self, cids: list[int]) -> dict[int, State]:
        """The states of ``cids`` (one each, no client axis)."""
        ...

    def put(self, states: dict[int, State]) -> None:
        """Replace the states of the clients in ``states``."""
        ...


class MemoryStore:
    """The simulator's store: a dict by client id, read and written in place."""

    def __init__(self, states: dict[int, State]) -> None:
        self.states = states

    def get(self, cids: list[int]) -> dict[int, State]:
        return {c: self.states[c] for c in cids}

    def put(self, states: dict[int, State]) -> None:
        self.states.update(states)


@dataclass
class Fitted:
    """What local training gave back: replies by client id, each architecture group's clients
    with their losses (in group order), and the FLOPs measured."""

    replies: dict[int, Payload] = field(default_factory=dict)
    losses: list[tuple[list[int], Tensor]] = field(default_factory=list)
    flops: int = 0


@dataclass
class SetUp:
    """What a setup stage gave back: replies by client id and, per architecture group, its
    clients with their statistics (a value per client)."""

    replies: dict[int, Payload] = field(default_factory=dict)
    stats: list[tuple[list[int], dict[str, Tensor]]] = field(default_factory=list)


class ClientHost:
    """A client role run over client ids: ``groups`` (architecture -> its client ids, in the
    simulator's order) decide how clients group, ``make_group`` builds a group's
    :class:`ClientGroup`, ``models`` and ``data`` are what evaluation scores with. ``nhwc``:
    every call runs with channels-last on or off (None: as the caller has set it)."""

    def __init__(
        self,
        client: Client,
        groups: Mapping[str, list[int]],
        make_group: MakeGroup,
        models: Mapping[str, FunctionalModel],
        data: FederatedData,
        nhwc: bool | None = None,
    ) -> None:
        self.client = client
        self.groups = groups
        self.make_group = make_group
        self.models = models
        self.data = data
        self.nhwc = nhwc

    def parts(self, cids: Iterable[int]) -> list[tuple[str, list[int]]]:
        """``cids`` by architecture group, in the simulator's order (groups, then client id)."""
        wanted = set(cids)
        out = [(name, [c for c in members if c in wanted]) for name, members in self.groups.items()]
        return [(name, part) for name, part in out if part]

    @contextlib.contextmanager
    def _format(self) -> Iterator[None]:
        if self.nhwc is None:
            yield
        else:
            with channels_last(self.nhwc):
                yield

    # -- one group (what a worker process runs on a chunk) ---------------------------------
    def fit_group(
        self, name: str, cids: list[int], rnd: int, msgs: list[Payload], states: Payload
    ) -> tuple[Payload, Payload, Tensor, int]:
        """``Client.fit`` on clients ``cids`` of architecture ``name`` (``states`` stacked):
        the stacked reply and new state, the losses and the FLOPs measured."""
        with self._format(), FlopMeter() as meter:
            reply, state, loss = self.client.fit(
                self.make_group(name, cids, rnd), stack_payloads(msgs), states
            )
        return reply, state, loss, meter.total

    def evaluate_group(
        self, name: str, cids: list[int], msgs: list[Payload], states: list[State], split: str
    ) -> GroupCounts:
        """(correct, total, loss sum) of clients ``cids`` (architecture ``name``) on
        ``split``: their ``Client.eval_model`` scored on their own samples."""
        with self._format():
            theta, buffers = self.client.eval_model(
                self.make_group(name, cids, -1),
                stack_payloads(msgs),
                StackedOnRead(states),  # only what it reads
            )
            net = self.client.eval_network(self.models[name])
            return evaluate_clients(net, theta, buffers, self.data, cids, split)

    # -- any clients ------------------------------------------------------------------------
    def fit(self, rnd: int, msgs: dict[int, Payload], store: StateStore) -> Fitted:
        """Local training of the clients of ``msgs``, one ``Client.fit`` per architecture
        group; their new states are written to ``store``."""
        states = store.get(list(msgs))
        out = Fitted()
        new: dict[int, State] = {}
        for name, part in self.parts(msgs):
            reply, state, loss, flops = self.fit_group(
                name, part, rnd, [msgs[c] for c in part], stack_payloads([states[c] for c in part])
            )
            new.update(zip(part, unstack_payload(state, len(part))))
            out.replies.update(zip(part, unstack_payload(reply, len(part))))
            out.losses.append((part, loss))
            out.flops += flops
        store.put(new)
        return out

    def setup(
        self,
        stage: int,
        msgs: dict[int, Payload],
        store: StateStore,
        done: Callable[[int], None] | None = None,
    ) -> SetUp:
        """``Client.setup`` stage ``stage`` per architecture group; ``done(n)`` after each
        group of ``n`` clients (progress)."""
        states = store.get(list(msgs))
        out = SetUp()
        new: dict[int, State] = {}
        with self._format():
            for name, part in self.parts(msgs):
                replies, state, stats = self.client.setup(
                    stage,
                    self.make_group(name, part, 0),
                    stack_payloads([msgs[c] for c in part]),
                    stack_payloads([states[c] for c in part]),
                )
                new.update(zip(part, unstack_payload(state, len(part))))
                out.replies.update(zip(part, replies))
                out.stats.append((part, stats))
                if done is not None:
                    done(len(part))
        store.put(new)
        return out

    def mix(self, rnd: int, mixed: dict[int, Payload], store: StateStore) -> None:
        """Decentralized: ``Client.mix`` of each client's mixed payload (``sum_j W_ij
        payload_j``, one client axis-free payload each) into its state."""
        states = store.get(list(mixed))
        new: dict[int, State] = {}
        with self._format():
            for name, part in self.parts(mixed):
                state = self.client.mix(
                    self.make_group(name, part, rnd),
                    stack_payloads([mixed[c] for c in part]),
                    stack_payloads([states[c] for c in part]),
                )
                new.update(zip(part, unstack_payload(state, len(part))))
        store.put(new)

    def evaluate(
        self, msgs: dict[int, Payload], split: str, store: StateStore
    ) -> list[tuple[list[int], GroupCounts]]:
        """Each architecture group's clients with their (correct, total, loss sum) on
        ``split``."""
        states = store.get(list(msgs))
        return [
            (
                part,
                self.evaluate_group(
                    name, part, [msgs[c] for c in part], [states[c] for c in part], split
                ),
            )
            for name, part in self.parts(msgs)
        ]
