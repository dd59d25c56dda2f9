"""The distilled set as a plug-in (seed 003 Table 5; issue 24): ``plug_in(method)`` composes a
method with MH-pFedHNDD's distillation without inheriting from it.

Defining properties: the setup phase delivers the merged S (Eq. 7) to every client; the
method's rounds are the method's own except that its cross-entropy becomes Eq. 9's, so with
S's terms weighted 0 the composed method *is* the method, and with them on it is not; the
method's own hyperparameters reach the method (composition: nothing ignored); a method that
trains with a loss of its own is refused in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyperfed.algorithms import get_algorithm
from hyperfed.algorithms.base import (
    CLIENT_GROUPS,
    INSPECTION,
    SERVER_CORE,
    Algorithm,
    Server,
    ServerContext,
)
from hyperfed.algorithms.compose import plug_in
from hyperfed.config import ConfigError, load_config
from hyperfed.runtime.simulate import Simulation

BASE = [
    "device=cpu",
    "rounds=2",
    "eval_every=2",
    "dataset.name=digits",
    "dataset.subsample=300",
    "partition.name=quantity",
    "clients.count=3",
    "clients.models=lenet",
    "local.epochs=1",
    "local.batch_size=32",
]
DD = [
    "algorithm.distill_model=lenet",
    "algorithm.distill_iters=3",
    "algorithm.distill_batch_real=16",
    "algorithm.ipc=2",
    "algorithm.syn_batch=8",
]


def _sim(name: str, *extra: str) -> Simulation:
    return Simulation(load_config(None, [*BASE, f"algorithm.name={name}", *extra]))


def test_setup_delivers_the_merged_synthetic_set_to_every_client() -> None:
    """Alg. 1: every client distills S_i (ipc images per class it holds) and receives the merge
    S = union of the S_i (Eq. 7) -- the server's S and each client's copy are the same set."""
    sim = _sim("fedgh_dd", *DD)
    sim.run_setup()
    syn_x, syn_y = sim.server.shared_synthetic()  # type: ignore[misc]
    held = sum(int(torch.unique(sim.data.y[sim.data.train_idx[c]]).numel()) for c in range(3))
    assert syn_y.numel() == 2 * held  # ipc per held class, every client's S_i merged
    for c in range(3):
        assert torch.equal(sim.store[c]["syn_x"], syn_x) and torch.equal(
            sim.store[c]["syn_y"], syn_y
        )


def _round_replies(sim: Simulation) -> dict[int, dict[str, torch.Tensor]]:
    msgs = sim.server.configure_train(1, [0, 1, 2])
    return sim.transport.fit(1, msgs).replies


@pytest.mark.parametrize("method", ["fedgh", "pfedlhn"])
def test_with_the_synthetic_terms_off_the_plug_in_is_the_method(method: str) -> None:
    """Eq. 9 with lambda_s = lambda_reg = 0 and real data on is the method's own CE: the
    composed method's round-1 replies equal the method's exactly; with lambda_s > 0 they move."""
    plain = _sim(method)
    off = _sim(f"{method}_dd", *DD, "algorithm.lambda_s=0", "algorithm.lambda_reg=0")
    on = _sim(f"{method}_dd", *DD, "algorithm.lambda_s=1", "algorithm.lambda_reg=0")
    for s in (off, on):
        s.run_setup()
    a, b, c = _round_replies(plain), _round_replies(off), _round_replies(on)
    for cid in a:
        for key in a[cid]:
            assert torch.allclose(a[cid][key], b[cid][key], atol=1e-6), (cid, key)
    moved = [not torch.allclose(a[cid][k], c[cid][k], atol=1e-4) for cid in a for k in a[cid]]
    assert any(moved)


def test_the_methods_own_hyperparameters_reach_the_method() -> None:
    sim = _sim("fedgh_dd", *DD, "algorithm.server_lr=0.5")
    assert sim.server.method.hp.server_lr == 0.5  # type: ignore[attr-defined]
    assert sim.client.method.hp.server_lr == 0.5  # type: ignore[attr-defined]
    assert sim.client.distilled.hp.ipc == 2  # type: ignore[attr-defined]


def test_a_method_with_its_own_loss_is_refused_in_one_line() -> None:
    """FedProto trains with CE + a prototype distance: Eq. 9 cannot replace it."""
    alg = plug_in(get_algorithm("fedproto"))
    cfg = load_config(None, [*BASE, "algorithm.name=fedproto"])
    hp = alg.hparams(
        **{
            **vars(cfg.hparams()),
            "distill_model": "lenet",
            "distill_iters": 2,
            "ipc": 2,
            "distill_batch_real": 8,
            "syn_batch": 4,
        }
    )
    sim = _sim("fedproto")
    sim.client = alg.client(hp, sim.client.ctx)
    sim.transport.client = sim.client
    sim.store = {
        c: {**s, "syn_x": torch.zeros(2, *sim.data.input_shape), "syn_y": torch.tensor([0, 1])}
        for c, s in sim.store.items()
    }
    msgs = {c: dict(m) for c, m in sim.server.configure_train(1, [0, 1, 2]).items()}
    with pytest.raises(ConfigError, match="fedproto trains with a loss of its own"):
        sim.transport.fit(1, msgs)


# -- the protocol: the wrappers forward the core and exactly the capabilities a method has ------


class _Groups(Server):
    """A method server with the eligibility / evaluation-group capability and nothing else."""

    def eligible_clients(self, rnd: int) -> list[int] | None:
        return [0] if rnd < 3 else [1]

    def eval_groups(self) -> dict[str, list[int]]:
        return {"first": [0]}


class _Plain(Server):
    pass


def _composed(server: type[Server], name: str) -> Algorithm:
    inner = get_algorithm("fedavg")
    return plug_in(dataclasses.replace(inner, name=name, server=server))


def test_the_wrapper_forwards_a_capability_only_when_the_method_has_it() -> None:
    """The composed server answers eligible_clients / eval_groups with the method's when the
    method has the capability, and with the protocol's "not present" default when it does not
    (nothing hand-written per hook); the core hooks are always the method's."""
    with_groups, plain = _composed(_Groups, "g").server, _composed(_Plain, "p").server
    assert CLIENT_GROUPS.held_by(with_groups) and not CLIENT_GROUPS.held_by(plain)
    assert plain.eligible_clients is Server.eligible_clients
    ctx = ServerContext(0, torch.device("cpu"), 2, (3,))
    clients = {c: {"num_params": torch.tensor(4), "num_samples": torch.tensor(1)} for c in (0, 1)}
    hp = _composed(_Groups, "g").hparams(distill_model="mlp")
    server = with_groups(hp, clients, ctx)
    assert server.eligible_clients(1) == [0] and server.eligible_clients(5) == [1]
    assert server.eval_groups() == {"first": [0]}
    # the distillation follows the method's eligibility: only clients that train get theta_d
    assert set(server.configure_setup(0, [0, 1])) == {0}
    assert plain(hp, clients, ctx).eval_groups() == {}
    for hook in SERVER_CORE[:5]:  # configure_train .. configure_eval: the method's own
        assert getattr(with_groups, hook) is not getattr(Server, hook), hook


def test_mh_pfedhndd_forwards_inspection_and_groups_from_mh_pfedhn() -> None:
    """The attack harness's inspection (model_updates) and MH-pFedHN's new-client groups reach
    the composed server; the synthetic set it inspects is the component's."""
    alg = get_algorithm("mh_pfedhndd")
    assert INSPECTION.held_by(alg.server) and CLIENT_GROUPS.held_by(alg.server)
    assert alg.server.model_updates is not Server.model_updates
    plain = get_algorithm("fedbn_dd")
    assert not CLIENT_GROUPS.held_by(plain.server)


def test_a_method_with_a_setup_stage_of_its_own_is_refused() -> None:
    with pytest.raises(ValueError, match="desa has a setup phase of its own"):
        plug_in(get_algorithm("desa"))
