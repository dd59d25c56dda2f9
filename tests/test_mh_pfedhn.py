"""MH-pFedHN / G / GD and pFedHN: hypernetwork shape rules, update direction, payloads."""

import math

import pytest
import torch

from hyperfed.algorithms.base import ServerContext
from hyperfed.algorithms.mh_pfedhn import (
    MHPFedHNGDParams,
    MHPFedHNParams,
    MHPFedHNServer,
    decode_update,
    encode_update,
)
from hyperfed.config import load_config
from hyperfed.engine.simulate import Simulation
from hyperfed.hypernet.multihead import MultiHeadHypernet, num_chunks


def _server(sizes, **hp):
    clients = {
        c: {"num_params": torch.tensor(k), "num_samples": torch.tensor(10)}
        for c, k in sizes.items()
    }
    ctx = ServerContext(0, torch.device("cpu"), 10, (1, 8, 8))
    return MHPFedHNServer(MHPFedHNParams(**hp), clients, ctx)


def test_tau_and_head_sharing():
    sizes = {0: 1000, 1: 1000, 2: 2500, 3: 3000, 4: 3001, 5: 1}
    hn = MultiHeadHypernet(sizes, out_dim=1000, hidden=8, embed_dim=4)
    assert [hn.tau[c] for c in range(6)] == [1, 1, 3, 3, 4, 1]
    assert hn.tau[2] == num_chunks(2500, 1000) == math.ceil(2500 / 1000)
    # clients with the same tau share a head; different tau, different head
    assert hn.key[0] == hn.key[1] == hn.key[5]
    assert hn.key[2] == hn.key[3] != hn.key[4]
    assert len(hn.heads) == 3
    assert hn.heads[hn.key[2]].weight.shape == (3, 8, 1000)  # tau channels x hidden x N
    assert {n: p.shape for n, p in hn.embeddings.items()}["4"] == (4, 4)


def test_theta_length_and_chunk_order():
    sizes = {0: 2500, 1: 2200}
    hn = MultiHeadHypernet(sizes, out_dim=1000, hidden=8, embed_dim=4)
    thetas = hn.generate([0, 1])
    assert thetas[0].shape == (2500,) and thetas[1].shape == (2200,)
    head = hn.heads[hn.key[0]]
    for c in (0, 1):
        codes = hn.extractor(hn.embeddings[str(c)])  # [tau, hidden]
        manual = [codes[j] @ head.weight[j] + head.bias[j] for j in range(3)]  # chunk j = channel j
        expected = torch.cat(manual)[: sizes[c]]
        assert torch.allclose(thetas[c], expected, atol=1e-6)


def test_head_ablations_of_table_3():
    sizes = {0: 2500, 1: 900, 2: 2500}
    own = MultiHeadHypernet(sizes, out_dim=1000, heads="per_client", hidden=8, embed_dim=4)
    assert len(own.heads) == 3 and own.heads[own.key[0]].weight.shape[0] == 3
    none = MultiHeadHypernet(sizes, out_dim=1000, heads="none", hidden=8, embed_dim=4)
    assert len(none.heads) == 1 and none.heads["shared"].weight.shape[0] == 1
    thetas = none.generate([0, 1])
    assert thetas[0].shape == (2500,) and thetas[1].shape == (900,)


@pytest.mark.parametrize("heads", ["per_size", "per_client", "none"])
def test_backward_equals_autograd_through_generated_thetas(heads):
    """hnet.backward(g) == grad of sum_c <theta_c, g_c> through generate(); clients of one
    head with different K (2500 / 2200), a client alone, and ``inputs`` restricting it."""
    sizes = {0: 2500, 1: 2200, 2: 700, 3: 2500}
    hn = MultiHeadHypernet(sizes, out_dim=1000, hidden=8, embed_dim=4, heads=heads)
    torch.manual_seed(3)
    g = {c: torch.randn(sizes[c]) for c in (0, 1, 2)}  # client 3 takes no part
    thetas = hn.generate(list(g))
    params = list(hn.parameters())
    expected = torch.autograd.grad(
        sum((thetas[c] * g[c]).sum() for c in g), params, allow_unused=True
    )
    hn.backward(g)
    for p, e in zip(params, expected):
        assert (p.grad is None) == (e is None)
        if e is not None:
            assert torch.allclose(p.grad, e, atol=1e-6)
    assert hn.embeddings["3"].grad is None
    hn.zero_grad(set_to_none=True)
    only = [hn.embeddings["1"], hn.embeddings["3"]]
    hn.backward(g, inputs=only)
    index = next(i for i, p in enumerate(params) if p is only[0])
    assert torch.allclose(only[0].grad, expected[index], atol=1e-6)
    assert all(p.grad is None for p in params if p is not only[0])


@pytest.mark.parametrize("mode", ["sequential", "mean"])
def test_server_update_moves_theta_toward_trained(mode):
    server = _server({0: 2500, 1: 700}, out_dim=1000, hidden=16, embed_dim=8, hn_update=mode)
    msgs = server.configure_train(1, [0, 1])
    torch.manual_seed(1)
    trained = {c: m["theta"] + 0.05 * torch.randn_like(m["theta"]) for c, m in msgs.items()}
    replies = {c: {"delta": trained[c] - msgs[c]["theta"]} for c in msgs}
    server.aggregate(1, replies)
    after = server.configure_train(2, [0, 1])
    for c in (0, 1):
        change = after[c]["theta"] - msgs[c]["theta"]
        assert torch.dot(change, replies[c]["delta"]) > 0
        before_dist = (trained[c] - msgs[c]["theta"]).norm()
        assert (trained[c] - after[c]["theta"]).norm() < before_dist


def test_bad_update_is_rejected_and_state_unchanged():
    server = _server({0: 500}, out_dim=100, hidden=8, embed_dim=4)
    state = {k: v.clone() for k, v in server.hnet.state_dict().items()}
    assert "expected (500,)" in server.check_reply(0, {"delta": torch.zeros(499)})
    assert "NaN" in server.check_reply(0, {"delta": torch.full((500,), float("nan"))})
    assert server.check_reply(0, {}) == "missing delta"
    assert server.check_reply(0, {"delta": torch.zeros(500)}) is None
    for k, v in server.hnet.state_dict().items():
        assert torch.equal(v, state[k])


def test_top_k_pruned_upload_round_trip():
    delta = torch.tensor([0.1, -3.0, 0.2, 2.0, 0.0, -0.5, 1.0, 0.05, 0.3, -0.01])
    sent = encode_update(delta, 0.3, "delta")
    assert set(sent) == {"delta_idx", "delta_val"} and sent["delta_val"].numel() == 3
    dense = decode_update(sent, "delta", 10)
    assert torch.equal(dense.nonzero().flatten().sort().values, torch.tensor([1, 3, 6]))
    assert torch.equal(dense[[1, 3, 6]], delta[[1, 3, 6]])


def _sim(algorithm, models, **extra):
    sets = [
        f"algorithm.name={algorithm}",
        "rounds=2",
        "eval_every=1",
        "clients.count=4",
        f"clients.models={models}",
        "local.epochs=1",
        "algorithm.out_dim=512",
        "algorithm.hidden=16",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return Simulation(load_config(None, sets))


def test_server_learns_only_param_counts_and_updates():
    sim = _sim("mh_pfedhn", '["lenet","mlp"]')
    for cid, info in sim.joins.items():
        assert set(info) == {"num_params", "num_samples"}
        assert int(info["num_params"]) == sim.models[sim.arch_of[cid]].num_params
    seen = {}
    original = sim.server.aggregate
    sim.server.aggregate = lambda rnd, replies: (seen.update(replies), original(rnd, replies))
    sim.run_round(1)
    for cid, reply in seen.items():
        assert set(reply) == {"delta"}
        assert reply["delta"].shape == (sim.models[sim.arch_of[cid]].num_params,)


def test_gd_sends_global_model_and_its_update():
    sim = _sim("mh_pfedhngd", '"lenet"')
    assert isinstance(sim.server.hp, MHPFedHNGDParams)
    msgs = sim.server.configure_train(1, [0, 1])
    assert set(msgs[0]) == {"theta", "global"}
    assert torch.equal(msgs[0]["global"], msgs[1]["global"])
    seen = {}
    original = sim.server.aggregate
    sim.server.aggregate = lambda rnd, replies: (seen.update(replies), original(rnd, replies))
    before = sim.server.configure_train(1, [0])[0]["global"].clone()
    sim.run_round(1)
    assert all(set(r) == {"delta", "global_delta"} for r in seen.values())
    assert not torch.equal(before, sim.server.configure_train(2, [0])[0]["global"])


@pytest.mark.parametrize("algorithm", ["mh_pfedhn", "mh_pfedhng", "mh_pfedhngd", "pfedhn"])
def test_methods_learn_on_digits(algorithm):
    sim = _sim(algorithm, '["lenet","vgg8"]')
    before = sim.evaluate()["mean_acc"]
    records = sim.run()
    assert records[-1]["mean_acc"] > before
    assert 0.0 <= records[-1]["mean_acc"] <= 1.0


def test_generalization_phase_freezes_the_hypernetwork():
    sim = _sim(
        "mh_pfedhn",
        '["lenet","mlp"]',
        **{"algorithm.new_clients": 0.5, "algorithm.adapt_rounds": 1, "clients.count": 4},
    )
    server = sim.server
    assert server.old_ids == [0, 1] and server.new_ids == [2, 3]
    assert server.eligible_clients(1) == [0, 1] and server.eligible_clients(2) == [2, 3]
    sim.run_round(1)  # training phase: new clients' embeddings untouched
    frozen = {n: p.detach().clone() for n, p in server.hnet.named_parameters()}
    assert all(torch.equal(frozen[f"embeddings.{c}"], server.hnet.embeddings[str(c)]) for c in "23")
    result = sim.run_round(2)  # adaptation: only new clients, only their embeddings move
    assert result.clients == [2, 3]
    for name, p in server.hnet.named_parameters():
        moved = not torch.equal(frozen[name], p)
        assert moved == (name in ("embeddings.2", "embeddings.3")), name
    metrics = sim.evaluate()
    assert {"mean_acc_old", "mean_acc_new"} <= set(metrics)


def test_personal_and_frozen_layers():
    sim = _sim(
        "mh_pfedhn",
        '"lenet"',
        **{
            "algorithm.personal_layers": '["classifier", ""]',
            "algorithm.frozen_layers": '["", "fc"]',
        },
    )
    fm = sim.models["lenet"]
    head = fm.layout.mask(["classifier"])
    fc = fm.layout.mask(["fc"])
    seen = {}
    original = sim.server.aggregate
    sim.server.aggregate = lambda rnd, replies: (seen.update(replies), original(rnd, replies))
    sent = sim.server.configure_train(1, [0, 1, 2, 3])
    sim.run_round(1)
    assert torch.all(seen[0]["delta"][head] == 0) and seen[0]["delta"][~head].abs().sum() > 0
    assert torch.all(seen[1]["delta"][fc] == 0) and seen[1]["delta"][~fc].abs().sum() > 0
    personal = sim.store[0]["personal"]
    assert not torch.equal(personal[head], sent[0]["theta"][head])  # trained locally
    group = sim.group("lenet", [0], 1)
    theta, _ = sim.client.eval_model(group, {"theta": sent[0]["theta"][None]}, sim._gather([0]))
    assert torch.equal(theta[0][head], personal[head])
