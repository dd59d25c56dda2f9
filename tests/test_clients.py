"""The client host (runtime/clients.py) on a hand-sized federation: four clients in two
architecture groups, ``a = [0, 2]`` and ``b = [1, 3]``; a client role whose every result is a
formula of its inputs, so each client's reply, new state, loss and FLOPs are known by hand, and
the host's grouping, stacking and unstacking are checked against them client by client."""

from __future__ import annotations

import torch
from torch import Tensor
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, Payload, PersonalModelClient
from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.local import SGDConfig
from hyperfed.engine.metering import FlopMeter
from hyperfed.runtime.clients import ClientHost, MemoryStore

GROUPS = {"a": [0, 2], "b": [1, 3]}
CPU = torch.device("cpu")


class Formula(PersonalModelClient):
    """fit: reply ``x + s``, new state ``s + x``, loss ``sum(s)``, the FLOPs of one
    ``[n, 3] @ [3, 4]`` product reported to the active meters (``2 * n * 3 * 4``); setup: reply ``s * stage``, statistic ``s[0]``;
    every call noted as (what, client ids, round)."""

    def __init__(self) -> None:
        super().__init__(None, ClientContext(0, CPU, 2, (2,)))
        self.calls: list[tuple[str, list[int], int]] = []

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        self.calls.append(("fit", group.client_ids, group.rnd))
        for meter in FlopMeter.active:  # as the engine reports a step's FLOPs
            meter.total += 2 * group.size * 3 * 4
        new = {**state, "s": state["s"] + msg["x"]}
        return {"x": msg["x"] + state["s"]}, new, state["s"].sum(-1)

    def setup(
        self, stage: int, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[list[Payload], dict[str, Tensor], dict[str, Tensor]]:
        self.calls.append(("setup", group.client_ids, group.rnd))
        replies = [{"y": s * stage} for s in state["s"]]
        return replies, {**state, "s": state["s"] * 2}, {"first": state["s"][:, 0]}

    def mix(
        self, group: ClientGroup, mixed: Payload, state: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        self.calls.append(("mix", group.client_ids, group.rnd))
        return super().mix(group, mixed, state)


def _federation() -> tuple[ClientHost, dict[int, dict[str, Tensor]]]:
    """The host over the four clients (``a``: a tiny MLP, ``b``: another), each client's
    state ``s = [c, 10 c]`` and its own model ``theta``."""
    x = torch.randn(16, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.arange(16) % 2
    data = toy_federation(x, y, [torch.arange(4 * c, 4 * c + 4) for c in range(4)], 2)
    models = {"a": tiny_mlp(2, 3, 2, seed=1), "b": tiny_mlp(2, 2, 2, seed=2)}
    arch = {c: name for name, cids in GROUPS.items() for c in cids}
    g = torch.Generator().manual_seed(1)
    states = {
        c: {
            "s": torch.tensor([c, 10.0 * c]),
            "theta": torch.randn(models[arch[c]].num_params, generator=g, dtype=torch.float64),
            "buffers": models[arch[c]].initial_buffers(),
        }
        for c in range(4)
    }
    sgd = SGDConfig(lr=0.1, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)

    def make_group(name: str, cids: list[int], rnd: int) -> ClientGroup:
        return ClientGroup(models[name], cids, data, rnd=rnd, seed=0, sgd=sgd)

    return ClientHost(Formula(), GROUPS, make_group, models, data), states


def test_fit_groups_by_architecture_and_gives_each_client_its_own_results() -> None:
    host, states = _federation()
    before = {c: dict(s) for c, s in states.items()}
    msgs = {3: {"x": torch.tensor([1.0, 2.0])}, 0: {"x": torch.tensor([3.0, 4.0])}}
    msgs[1] = {"x": torch.tensor([5.0, 6.0])}
    got = host.fit(7, msgs, MemoryStore(states))
    # the groups in their order, then client id; round 7 for each
    assert host.client.calls == [("fit", [0], 7), ("fit", [1, 3], 7)]  # type: ignore[attr-defined]
    for c, m in msgs.items():
        s = before[c]["s"]
        assert torch.equal(got.replies[c]["x"], m["x"] + s)
        assert torch.equal(states[c]["s"], s + m["x"])
        assert torch.equal(states[c]["theta"], before[c]["theta"])
    assert set(got.replies) == {0, 1, 3}
    assert states[2] == before[2]  # not trained: untouched
    # per group: its clients and their losses sum(s) = 11 c
    assert [(cids, loss.tolist()) for cids, loss in got.losses] == [
        ([0], [0.0]),
        ([1, 3], [11.0, 33.0]),
    ]
    assert got.flops == 2 * 3 * 3 * 4  # three clients, one [1, 3] @ [3, 4] product each


def test_setup_and_mix_write_each_clients_state() -> None:
    host, states = _federation()
    done: list[int] = []
    got = host.setup(2, {c: {} for c in (2, 1, 0)}, MemoryStore(states), done.append)
    assert host.client.calls == [("setup", [0, 2], 0), ("setup", [1], 0)]  # type: ignore[attr-defined]
    assert done == [2, 1]
    for c in (0, 1, 2):
        assert torch.equal(got.replies[c]["y"], torch.tensor([2.0 * c, 20.0 * c]))
        assert torch.equal(states[c]["s"], torch.tensor([2.0 * c, 20.0 * c]))
    assert torch.equal(states[3]["s"], torch.tensor([3.0, 30.0]))
    assert [(cids, st["first"].tolist()) for cids, st in got.stats] == [
        ([0, 2], [0.0, 2.0]),
        ([1], [1.0]),
    ]
    mixed = {c: {"s": torch.tensor([-1.0 * c, 0.5])} for c in (3, 2)}
    host.mix(4, mixed, MemoryStore(states))
    assert host.client.calls[2:] == [("mix", [2], 4), ("mix", [3], 4)]  # type: ignore[attr-defined]
    for c in (2, 3):
        assert torch.equal(states[c]["s"], mixed[c]["s"])
    assert torch.equal(states[1]["s"], torch.tensor([2.0, 20.0]))


def test_evaluation_scores_each_client_with_its_own_model() -> None:
    """Each client's counts are those of its own model evaluated alone."""
    host, states = _federation()
    got = host.evaluate({c: {} for c in (3, 1, 2)}, "test", MemoryStore(states))
    assert [cids for cids, _ in got] == [[2], [1, 3]]
    for cids, counts in got:
        for i, c in enumerate(cids):
            fm = host.models["a" if c in GROUPS["a"] else "b"]
            s = states[c]
            alone = evaluate_clients(
                fm, s["theta"][None], s["buffers"][None], host.data, [c], "test"
            )
            for field, one in zip(counts, alone, strict=True):
                assert torch.equal(field[i], one[0])
    assert sum(counts[1].sum().item() for _, counts in got) == 12  # three clients x 4 samples
