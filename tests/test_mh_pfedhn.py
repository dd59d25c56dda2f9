"""MH-pFedHN / G / GD and pFedHN: hypernetwork shape rules, update direction, payloads."""

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.mh_pfedhn import (
    GLOBAL,
    MHPFedHNClient,
    MHPFedHNGDParams,
    MHPFedHNGParams,
    MHPFedHNParams,
    MHPFedHNServer,
    distillation_loss,
)
from hyperfed.config import load_config, validate_hparams
from hyperfed.data.federated import FederatedData
from hyperfed.engine.codec import decode_update, encode_update
from hyperfed.engine.local import SGDConfig
from hyperfed.engine.robust import RobustRule
from hyperfed.hparams import hparam_sources
from hyperfed.hypernet.multihead import Head, MultiHeadHypernet, num_chunks
from hyperfed.models.layout import FunctionalModel
from hyperfed.runtime.simulate import Simulation


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
    # the heads' gradients by hand: a second backward adds to .grad; after
    # zero_grad(set_to_none=True) the kept buffer starts over from the new gradient
    hn.zero_grad(set_to_none=True)
    hn.backward(g)
    hn.backward(g)
    for p, e in zip(params, expected):
        if e is not None:
            assert torch.allclose(p.grad, 2 * e, atol=1e-6)
    hn.zero_grad(set_to_none=True)
    hn.backward({c: -v for c, v in g.items()})
    for p, e in zip(params, expected):
        if e is not None:
            assert torch.allclose(p.grad, -e, atol=1e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_head_gradient_by_hand_equals_autograd_with_fewer_channels_than_the_head(shared):
    """Head.backward_from = autograd through Head.forward, also for codes of tau = 2 on a
    head of 3 channels (the third channel's weight and bias get zero gradient)."""
    torch.manual_seed(0)
    head = Head(channels=3, hidden=5, out_dim=7, shared=shared)
    codes = torch.randn(4, 2, 5, requires_grad=True)
    g = torch.randn(4, 2, 7)
    expected = torch.autograd.grad((head(codes) * g).sum(), [codes, head.weight, head.bias])
    got_codes = head.backward_from(codes.detach(), g)
    for got, e in zip([got_codes, head.weight.grad, head.bias.grad], expected):
        assert torch.allclose(got, e, atol=1e-6)
    if not shared:
        assert head.weight.grad[2].abs().sum() == 0 and head.bias.grad[2].abs().sum() == 0


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
    # the VGG8 clients once sent NaN every round while the others' mean still rose
    assert all(not r["rejected"] and not r["nonfinite_loss"] for r in records)


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


def test_new_clients_adapt_with_their_own_adam_at_adapt_lr():
    # §4.4 / authors' run_test.py: a fresh Adam on the new clients' embeddings. Adam's first
    # step is lr * g / (|g| + eps) per entry (bias-corrected m = g, v = g^2), so every entry of
    # a new embedding with a gradient moves by adapt_lr, whatever the hypernetwork's hn_lr
    lr = 0.05
    sim = _sim(
        "mh_pfedhn",
        '["lenet","lenet","mlp","mlp"]',  # new clients 2, 3 run an architecture of their own
        **{
            "algorithm.new_clients": 0.5,
            "algorithm.adapt_rounds": 1,
            "algorithm.adapt_lr": lr,
            "algorithm.heads": "per_architecture",
        },
    )
    server = sim.server
    new_head = server.hnet.key[2]
    assert server.hnet.key[3] == new_head != server.hnet.key[0]
    sim.run_round(1)
    before = {n: p.detach().clone() for n, p in server.hnet.named_parameters()}
    hn_state = {k: v["step"].clone() for k, v in server.opt.state.items()}
    sim.run_round(2)
    for name, p in server.hnet.named_parameters():
        moved = (p.detach() - before[name]).abs()
        if name in ("embeddings.2", "embeddings.3") or name.startswith(f"heads.{new_head}."):
            # entries whose |g| is near Adam's eps (or zero) move less, none more
            assert float(moved.max()) <= lr * (1 + 1e-3), name
            at_lr = ((moved - lr).abs() <= 1e-2 * lr).float().mean()
            assert float(at_lr) > 0.9, name
        else:  # the hypernetwork and the old clients' embeddings are frozen
            assert torch.equal(moved, torch.zeros_like(moved)), name
    # the hypernetwork's own Adam took no step in the adaptation round
    assert {k: v["step"] for k, v in server.opt.state.items()} == hn_state


def test_adapt_lr_larger_than_the_embedding_scale_is_refused():
    # Adam's first step moves every entry by adapt_lr (test above): at the authors' embed_std
    # 0.002 the default 5e-2 would be 25 initial standard deviations in one round
    held_out = {"new_clients": 0.2, "adapt_rounds": 10}
    with pytest.raises(ValueError, match="adapt_lr 0.05 exceeds embed_std 0.002"):
        MHPFedHNParams(**held_out, embed_std=0.002)
    MHPFedHNParams(**held_out, embed_std=0.002, adapt_lr=2e-4)  # the authors' pair
    MHPFedHNParams(embed_std=0.002)  # no held-out clients: adapt_lr is never used


@pytest.mark.parametrize("hn_update", ["alg1", "sequential"])
def test_alg1_generates_each_client_after_the_previous_clients_step(hn_update):
    # Alg. 1 / authors' MH-pFedHN.py: for each client, theta_i = h(v_i; phi) from the current
    # phi, train, step. "sequential" generates every theta_i at the round's start instead
    sim = _sim("mh_pfedhn", '"lenet"', **{"algorithm.hn_update": hn_update})
    server = sim.server
    sent, steps_before = [], []
    configure = server.configure_train

    def spy(rnd, ids):
        steps_before.append(
            sum(int(st["step"]) for st in server.opt.state.values()) if server.opt.state else 0
        )
        msgs = configure(rnd, ids)
        sent.extend((c, m["theta"].clone()) for c, m in msgs.items())
        return msgs

    server.configure_train = spy
    start = {c: t.detach().clone() for c, t in server.hnet.generate([0, 1, 2, 3]).items()}
    result = sim.run_round(1)
    assert result.clients == [0, 1, 2, 3] and not result.rejected
    assert [c for c, _ in sent] == [0, 1, 2, 3]
    as_at_start = [torch.allclose(theta, start[c], rtol=0, atol=1e-6) for c, theta in sent]
    if hn_update == "alg1":  # one exchange per client; clients 1-3 see the moved hypernetwork
        assert len(steps_before) == 4 and steps_before == sorted(set(steps_before))
        assert as_at_start == [True, False, False, False]
    else:
        assert len(steps_before) == 1 and as_at_start == [True] * 4


def test_hn_grad_clip_bounds_the_hypernetwork_gradient():
    # authors' code: clip_grad_norm_(hnet.parameters(), 50) before each Adam step; with a tiny
    # clip the step's gradient has exactly that norm (Adam's first step hides the scale, so
    # the clipped gradient is read where the optimizer sees it)
    server = _server({0: 300, 1: 300}, out_dim=128, hidden=8, hn_grad_clip=1e-3)
    norms = []
    original = server.opt.step
    server.opt.step = lambda *a, **k: (  # type: ignore[method-assign]
        norms.append(
            torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in server.hnet.parameters() if p.grad is not None])
            )
        ),
        original(*a, **k),
    )
    server.aggregate(1, {c: {"delta": torch.ones(300)} for c in (0, 1)})
    torch.testing.assert_close(norms[0], torch.tensor(1e-3))


def test_authors_hypernetwork_init_and_output_relu():
    hnet = MultiHeadHypernet({0: 300}, out_dim=128, hidden=8, embed_std=0.002, relu_out=True)
    v = hnet.embeddings["0"]
    assert 0.001 < float(v.std()) < 0.004  # N(0, 0.002^2), as norm_var in HyperNetworks.py
    assert isinstance(hnet.extractor[-1], torch.nn.ReLU)
    plain = MultiHeadHypernet({0: 300}, out_dim=128, hidden=8)
    assert isinstance(plain.extractor[-1], torch.nn.Linear)


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
    theta, _ = sim.client.eval_model(group, {"theta": sent[0]["theta"][None]}, sim.states([0]))
    assert torch.equal(theta[0][head], personal[head])


# == Defining properties on hand-sized examples (issue 19) ===================================
# A tiny hypernetwork (embedding 3, hidden 4, two extractor layers, N = 5) in float64, its
# optimizer swapped for plain SGD where a test checks an exact step, and a linear client model
# (2 inputs, 3 classes, K = 9) trained for one full-batch SGD step on four hand-written samples.
# Every expected value is computed here from the paper's equations: Eq. 3 written out by hand,
# its vector-Jacobian products by autograd through that hand-written forward, and the gradients
# of CE and KL of a linear model in closed form.

TINY = {"embed_dim": 3, "hidden": 4, "n_layers": 2, "out_dim": 5}
X = torch.tensor([[1.0, -0.5], [0.3, 0.8], [-1.2, 0.4], [0.6, 1.5]], dtype=torch.float64)
Y = torch.tensor([0, 2, 1, 2])


def _tiny_server(
    sizes: dict[int, int],
    hp: MHPFedHNParams,
    samples: dict[int, int] | None = None,
    global_size: int | None = None,
    sgd_lr: float | None = None,
) -> MHPFedHNServer:
    """A float64 server; ``sgd_lr`` replaces its Adam by plain SGD (exact, linear steps)."""
    clients: dict[int, dict[str, torch.Tensor]] = {}
    for c, k in sizes.items():
        clients[c] = {
            "num_params": torch.tensor(k),
            "num_samples": torch.tensor((samples or {}).get(c, 10)),
        }
        if global_size is not None:
            clients[c]["num_global_params"] = torch.tensor(global_size)
    server = MHPFedHNServer(hp, clients, ServerContext(0, torch.device("cpu"), 3, (2,)))
    server.hnet.double()
    if sgd_lr is not None:
        server.opt = torch.optim.SGD(server.hnet.parameters(), lr=sgd_lr)
    return server


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def hand_theta(
    p: dict[str, torch.Tensor], name: str, head: str, size: int, chunk: int, n_layers: int = 2
) -> torch.Tensor:
    """Eq. 3 written out: theta = concat_j (f(v^j) W_j + b_j)[:K], tau = ceil(K / N) chunks,
    f the extractor MLP (Linear, ReLU, Linear, ...), (W_j, b_j) channel j of the head."""
    h = p[f"embeddings.{name}"]
    for layer in range(n_layers):
        if layer:
            h = torch.relu(h)
        h = h @ p[f"extractor.{2 * layer}.weight"].T + p[f"extractor.{2 * layer}.bias"]
    w, b = p[f"heads.{head}.weight"], p[f"heads.{head}.bias"]
    tau = math.ceil(size / chunk)
    chunks = [h[j] @ w[j if len(w) > 1 else 0] + b[j if len(b) > 1 else 0] for j in range(tau)]
    return torch.cat(chunks)[:size]


def sgd_expected(
    p: dict[str, torch.Tensor],
    outputs: Callable[[dict[str, torch.Tensor]], list[torch.Tensor]],
    grad_outputs: list[torch.Tensor],
    lr: float,
) -> dict[str, torch.Tensor]:
    """phi - lr * (d outputs / d phi)^T grad_outputs: one plain SGD step of the hypernetwork."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in p.items()}
    grads = torch.autograd.grad(
        outputs(leaves), list(leaves.values()), grad_outputs=grad_outputs, allow_unused=True
    )
    return {
        n: (t - lr * g if g is not None else t).detach() for (n, t), g in zip(leaves.items(), grads)
    }


def _assert_params(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for n, p in module.named_parameters():
        assert torch.allclose(p.detach(), expected[n], rtol=0, atol=1e-12), n


def _theta_fn(server: MHPFedHNServer, c: int) -> Callable[[dict], torch.Tensor]:
    hn = server.hnet
    name = "global" if c < 0 else str(c)
    return lambda p: hand_theta(p, name, hn.key[c], hn.sizes[c], hn.chunk[c], server.hp.n_layers)


@pytest.mark.parametrize("aggregation", ["median", "krum"])
def test_robust_aggregation_combines_each_clients_own_hypernetwork_gradient(aggregation):
    """defense.aggregation on MH-pFedHN (hn_update "mean"): the shared parameters (extractor,
    head) step on the rule's combination of each client's own gradient, taken alone (autograd
    by hand): per coordinate the median (the mean of the two middle values of four), or Krum's
    pick (f = 1: the row nearest its 4 - 1 - 2 = 1 nearest neighbour); each embedding steps on
    its own client's gradient / n, as under "mean". A 1e6-scaled reply cannot drag phi."""
    lr, n = 0.1, 4
    server = _tiny_server({c: 12 for c in range(n)}, MHPFedHNParams(**TINY), sgd_lr=lr)
    server.ctx.aggregation = RobustRule(aggregation, byzantine=1)
    p0 = _params(server.hnet)
    msgs = server.configure_train(1, list(range(n)))
    g = torch.Generator().manual_seed(0)
    deltas = {c: 0.3 * torch.randn(12, generator=g, dtype=torch.float64) for c in msgs}
    deltas[3] = deltas[3] * 1e6  # the hostile client
    server.aggregate(1, {c: {"delta": d} for c, d in deltas.items()})

    def own_grads(c: int) -> dict[str, torch.Tensor]:
        leaves = {k: t.clone().requires_grad_(True) for k, t in p0.items()}
        grads = torch.autograd.grad(
            [_theta_fn(server, c)(leaves)], list(leaves.values()),
            grad_outputs=[-deltas[c]], allow_unused=True,
        )  # fmt: skip
        return {k: torch.zeros_like(p0[k]) if t is None else t for k, t in zip(leaves, grads)}

    grads = [own_grads(c) for c in range(n)]
    shared = [k for k in p0 if not k.startswith("embeddings.")]
    rows = torch.stack([torch.cat([gr[k].reshape(-1) for k in shared]) for gr in grads])
    if aggregation == "median":
        combined = torch.quantile(rows, 0.5, dim=0)  # linear interpolation: two middle values
    else:
        dist = torch.cdist(rows, rows) ** 2 + torch.diag(torch.full((n,), math.inf))
        combined = rows[dist.min(dim=1).values.argmin()]
        assert dist.min(dim=1).values.argmin() != 3
    expected = dict(p0)
    for k, piece in zip(shared, combined.split([p0[k].numel() for k in shared])):
        expected[k] = p0[k] - lr * piece.view_as(p0[k])
    for c in range(n):
        expected[f"embeddings.{c}"] = p0[f"embeddings.{c}"] - lr * grads[c][f"embeddings.{c}"] / n
    _assert_params(server.hnet, expected)
    honest = rows[:3].abs().max(dim=0).values  # per coordinate, inside the honest clients' range
    assert (combined.abs() <= honest + 1e-12).all() and rows[3].norm() > 1e4 * honest.norm()


def test_tau_is_ceil_and_clients_of_similar_size_share_a_head():
    """§3.2: tau_i = ceil(K_i / N); models whose tau agrees share one head of tau channels."""
    sizes = {0: 11, 1: 15, 2: 16, 3: 5, 4: 1}  # N = 5: ceil -> 3, 3, 4, 1, 1 (floor: 2, 3, 3, ..)
    hn = MultiHeadHypernet(sizes, **TINY)
    assert [hn.tau[c] for c in range(5)] == [3, 3, 4, 1, 1]
    assert hn.heads[hn.key[0]] is hn.heads[hn.key[1]]  # 11 and 15 parameters: one head
    assert hn.heads[hn.key[3]] is hn.heads[hn.key[4]]
    assert len({hn.key[0], hn.key[2], hn.key[3]}) == 3 and len(hn.heads) == 3
    assert hn.heads[hn.key[2]].weight.shape == (4, 4, 5)  # tau channels x hidden x N
    p = _params(hn)
    thetas = hn.generate(list(sizes))
    for c, k in sizes.items():  # Eq. 3 by hand, each client through its head
        assert torch.allclose(thetas[c], hand_theta(p, str(c), hn.key[c], k, 5), atol=1e-6)


def test_customized_embeddings_are_per_client():
    """§3.2: client i owns v_i = [v_i^1 .. v_i^tau_i]; two clients of the same size share the
    head but not the embeddings, so they get different models."""
    hn = MultiHeadHypernet({0: 15, 1: 15, 2: 4}, **TINY)
    e = dict(hn.embeddings.items())
    assert e["0"].shape == (3, 3) and e["1"].shape == (3, 3) and e["2"].shape == (1, 3)
    assert e["0"] is not e["1"] and not torch.equal(e["0"], e["1"])
    thetas = hn.generate([0, 1])
    assert hn.key[0] == hn.key[1] and not torch.allclose(thetas[0], thetas[1])
    hn.backward({0: torch.ones(15)})  # client 0's update reaches v_0, never v_1
    assert e["0"].grad is not None and e["0"].grad.abs().sum() > 0 and e["1"].grad is None


@pytest.mark.parametrize("mode", ["mean", "sequential"])
def test_hypernetwork_update_is_vjp_with_init_minus_trained(mode):
    """Alg. 1 server step, pFedHN's sign: phi <- phi - lr * (d theta_i / d phi)^T (theta_i -
    theta~_i), and the same for v_i. ``mean``: one step on the average over the round's
    clients; ``sequential``: one step per client as Alg. 1 is printed. Client 2 sits out."""
    lr = 0.05
    hp = MHPFedHNParams(**TINY, hn_update=mode)
    server = _tiny_server({0: 12, 1: 14, 2: 4}, hp, sgd_lr=lr)
    p0 = _params(server.hnet)
    msgs = server.configure_train(1, [0, 1])
    for c in (0, 1):  # Eq. 3: the server sends h(v_i; phi)[:K_i]
        assert torch.allclose(msgs[c]["theta"], _theta_fn(server, c)(p0), atol=1e-12)
    g = torch.Generator().manual_seed(0)
    trained = {
        c: m["theta"] + 0.3 * torch.randn(m["theta"].shape, generator=g, dtype=torch.float64)
        for c, m in msgs.items()
    }
    server.aggregate(1, {c: {"delta": trained[c] - msgs[c]["theta"]} for c in msgs})
    init_minus_trained = {c: msgs[c]["theta"] - trained[c] for c in msgs}
    if mode == "mean":
        expected = sgd_expected(
            p0,
            lambda p: [_theta_fn(server, 0)(p), _theta_fn(server, 1)(p)],
            [init_minus_trained[0] / 2, init_minus_trained[1] / 2],
            lr,
        )
    else:
        expected = p0
        for c in (0, 1):
            expected = sgd_expected(
                expected, lambda p, c=c: [_theta_fn(server, c)(p)], [init_minus_trained[c]], lr
            )
    _assert_params(server.hnet, expected)
    assert torch.equal(server.hnet.embeddings["2"], p0["embeddings.2"])
    after = server.configure_train(2, [0, 1])
    for c in (0, 1):  # and so the generated model moved toward the trained one
        assert (after[c]["theta"] - trained[c]).norm() < (msgs[c]["theta"] - trained[c]).norm()


def test_hypernetwork_optimizer_is_adam_at_hn_lr():
    """§4.1: Adam, lr 2e-4. Adam's first step is -lr * g / (|g| + eps) with g the VJP of
    theta - theta~ (so every entry with a gradient moves by ~lr, against g's sign)."""
    hp = MHPFedHNParams(**TINY)
    assert hp.hn_lr == 2e-4
    server = _tiny_server({0: 12}, hp)
    assert isinstance(server.opt, torch.optim.Adam)
    p0 = _params(server.hnet)
    theta = server.configure_train(1, [0])[0]["theta"]
    trained = theta + torch.linspace(-0.2, 0.3, 12, dtype=torch.float64)
    server.aggregate(1, {0: {"delta": trained - theta}})
    vjp = sgd_expected(p0, lambda p: [_theta_fn(server, 0)(p)], [theta - trained], -1.0)
    for n, p in server.hnet.named_parameters():
        g = vjp[n] - p0[n]  # sgd_expected with lr = -1 adds the VJP
        step = 2e-4 * g / (g.abs() + 1e-8)
        assert torch.allclose(p.detach(), p0[n] - step, rtol=0, atol=1e-10), n


def test_global_model_shares_the_smallest_clients_head_with_own_embeddings():
    """§3.3, Eq. 5: K_g = min K_i, so w_g comes from the smallest client's head, through the
    global embeddings v_g (tau_g = ceil(K_g / N) of them)."""
    server = _tiny_server({0: 12, 1: 4}, MHPFedHNGParams(**TINY), global_size=4)
    hn = server.hnet
    assert hn.key[GLOBAL] == hn.key[1] != hn.key[0]
    assert hn.embeddings["global"].shape == (1, 3)
    msgs = server.configure_train(1, [0, 1])
    w_g = _theta_fn(server, GLOBAL)(_params(hn))
    assert torch.allclose(msgs[0]["global"], w_g, atol=1e-12)
    assert torch.equal(msgs[0]["global"], msgs[1]["global"])  # every client gets the same w_g


def test_global_update_alone_is_sample_weighted_vjp():
    """Alg. 2 / Eq. 6-7: phi <- phi - lr * sum_i m_i/M (d w_g / d phi)^T (-Delta w_g,i), i.e.
    w_g moves toward the sample-weighted average of the clients' trained global models. Zero
    personalized updates isolate this step (plain SGD: a zero gradient moves nothing)."""
    lr = 0.1
    hp = MHPFedHNGParams(**TINY)
    server = _tiny_server({0: 12, 1: 4}, hp, samples={0: 30, 1: 10}, global_size=4, sgd_lr=lr)
    p0 = _params(server.hnet)
    w_g = server.configure_train(1, [0, 1])[0]["global"]
    dw = {0: torch.tensor([0.2, -0.1, 0.4, 0.0]), 1: torch.tensor([-0.6, 0.3, 0.1, 0.5])}
    dw = {c: v.double() for c, v in dw.items()}
    replies = {
        c: {"delta": torch.zeros(k, dtype=torch.float64), "global_delta": dw[c]}
        for c, k in ((0, 12), (1, 4))
    }
    server.aggregate(1, replies)
    weighted = 0.75 * dw[0] + 0.25 * dw[1]  # m = 30, 10 -> m_i / M = 3/4, 1/4
    expected = sgd_expected(p0, lambda p: [_theta_fn(server, GLOBAL)(p)], [-weighted], lr)
    _assert_params(server.hnet, expected)
    moved = server.configure_train(2, [0])[0]["global"] - w_g
    assert torch.dot(moved, weighted) > 0  # toward the clients' trained global models


def test_global_step_comes_before_the_personalized_steps():
    """Alg. 2: first the global step (Eq. 6-7) at phi, then the clients' steps at the updated
    phi (mean mode: one step on the average). Both orders are computed by hand; the server
    must match the printed one."""
    lr = 0.2
    hp = MHPFedHNGParams(**TINY)
    server = _tiny_server({0: 12, 1: 4}, hp, samples={0: 30, 1: 10}, global_size=4, sgd_lr=lr)
    p0 = _params(server.hnet)
    msgs = server.configure_train(1, [0, 1])
    g = torch.Generator().manual_seed(1)
    rnd = lambda k: torch.randn(k, generator=g, dtype=torch.float64)  # noqa: E731
    replies = {
        0: {"delta": rnd(12), "global_delta": rnd(4)},
        1: {"delta": rnd(4), "global_delta": rnd(4)},
    }
    server.aggregate(1, replies)
    weighted = 0.75 * replies[0]["global_delta"] + 0.25 * replies[1]["global_delta"]

    def global_step(p: dict) -> dict:
        return sgd_expected(p, lambda q: [_theta_fn(server, GLOBAL)(q)], [-weighted], lr)

    def client_step(p: dict) -> dict:
        outs = lambda q: [_theta_fn(server, 0)(q), _theta_fn(server, 1)(q)]  # noqa: E731
        return sgd_expected(p, outs, [-replies[0]["delta"] / 2, -replies[1]["delta"] / 2], lr)

    expected, reversed_order = client_step(global_step(p0)), global_step(client_step(p0))
    _assert_params(server.hnet, expected)
    assert any(not torch.allclose(expected[n], reversed_order[n], atol=1e-9) for n in p0)
    assert torch.equal(msgs[0]["global"], msgs[1]["global"])


@pytest.mark.parametrize("hn_update", ["alg1", "mean"])
def test_alg2_exchanges_w_g_first_then_the_personal_models_from_the_moved_hypernetwork(hn_update):
    """global_exchange = "alg2" (Alg. 2 as printed; the authors' MH-pFedHNGD.py): a round is
    first an exchange of w_g alone with every client and one step on sum_i m_i/M Delta w_g,i
    (Eq. 6-7), then the personal exchange(s): theta_i generated from the hypernetwork that
    step moved, each client distilling from the round-start w_g. Under "alg1" one step per
    client at full weight, each theta_i generated after the previous step; under "mean" one
    step on the average. Every step is computed by hand (plain SGD)."""
    lr = 0.2
    hp = MHPFedHNGDParams(**TINY, global_exchange="alg2", hn_update=hn_update)
    server = _tiny_server({0: 12, 1: 4}, hp, samples={0: 30, 1: 10}, global_size=4, sgd_lr=lr)
    p0 = _params(server.hnet)
    exchanges = server.round_exchanges(1, [0, 1])
    assert exchanges == ([[0, 1], [0], [1]] if hn_update == "alg1" else [[0, 1], [0, 1]])
    g = torch.Generator().manual_seed(2)
    rnd = lambda k: torch.randn(k, generator=g, dtype=torch.float64)  # noqa: E731
    first = server.configure_train(1, exchanges[0])
    assert all(set(m) == {"global"} for m in first.values())
    w_g = first[0]["global"].clone()
    assert torch.allclose(w_g, _theta_fn(server, GLOBAL)(p0), rtol=0, atol=1e-12)
    assert server.reply_shapes(0) == {"global_delta": (4,)}
    dw = {0: rnd(4), 1: rnd(4)}
    server.aggregate(1, {c: {"global_delta": dw[c]} for c in (0, 1)})
    weighted = 0.75 * dw[0] + 0.25 * dw[1]  # m = 30, 10
    expected = sgd_expected(p0, lambda q: [_theta_fn(server, GLOBAL)(q)], [-weighted], lr)
    _assert_params(server.hnet, expected)
    deltas = {0: rnd(12), 1: rnd(4)}
    for batch in exchanges[1:]:
        msgs = server.configure_train(1, batch)
        assert server.reply_shapes(batch[0]) == {"delta": (server.hnet.sizes[batch[0]],)}
        for c, m in msgs.items():
            assert set(m) == {"theta", "teacher"}
            assert torch.equal(m["teacher"], w_g)  # the round-start w_g, not the moved one
            assert torch.allclose(m["theta"], _theta_fn(server, c)(expected), rtol=0, atol=1e-12)
        server.aggregate(1, {c: {"delta": deltas[c]} for c in batch})
        share = 1 / len(batch)
        outs = lambda q, b=batch: [_theta_fn(server, c)(q) for c in b]  # noqa: E731
        expected = sgd_expected(expected, outs, [-deltas[c] * share for c in batch], lr)
        _assert_params(server.hnet, expected)


def test_alg2_round_through_the_driver_steps_w_g_once_and_sends_no_w_g_with_theta():
    sim = _sim(
        "mh_pfedhngd",
        '"lenet"',
        **{"algorithm.global_exchange": "alg2", "algorithm.hn_update": "alg1"},
    )
    server = sim.server
    sent: list[tuple[list[int], set[str]]] = []
    configure = server.configure_train

    def spy(rnd, ids):
        msgs = configure(rnd, ids)
        sent.append((list(ids), {k for m in msgs.values() for k in m}))
        return msgs

    server.configure_train = spy
    result = sim.run_round(1)
    assert not result.rejected and result.replied == [0, 1, 2, 3]
    assert sent == [([0, 1, 2, 3], {"global"})] + [([c], {"theta", "teacher"}) for c in range(4)]
    steps = {id(p): int(st["step"]) for p, st in server.opt.state.items()}
    # Eq. 6-7: one Adam step a round on v_g; one per client on each v_i; phi: 1 + 4
    assert steps[id(server.hnet.embeddings["global"])] == 1
    assert [steps[id(server.hnet.embeddings[str(c)])] for c in range(4)] == [1, 1, 1, 1]
    assert steps[id(next(server.hnet.extractor.parameters()))] == 5


def test_random_client_order_is_a_fresh_permutation_every_round_and_by_id_is_sorted():
    """client_order = "random" (the authors' random.sample(train_list, n) every round): each
    round's per-client exchanges are a permutation of the sampled clients, drawn anew each
    round and reproducible from (seed, round); "by_id" keeps the ids' order."""
    ids = [3, 5, 8, 9, 11]
    by_id = _server({c: 300 for c in ids}, out_dim=128, hidden=8, hn_update="alg1")
    assert by_id.round_exchanges(4, ids) == [[c] for c in ids]
    server = _server(
        {c: 300 for c in ids}, out_dim=128, hidden=8, hn_update="alg1", client_order="random"
    )
    again = _server(
        {c: 300 for c in ids}, out_dim=128, hidden=8, hn_update="alg1", client_order="random"
    )
    orders = [tuple(b[0] for b in server.round_exchanges(r, ids)) for r in range(1, 31)]
    assert all(sorted(o) == ids for o in orders)
    assert len(set(orders)) >= 20  # 30 draws from 120 orders: repeats are rare
    assert {o[0] for o in orders} == set(ids)  # every client goes first in some round
    assert orders == [tuple(b[0] for b in again.round_exchanges(r, ids)) for r in range(1, 31)]


def test_alg2_is_refused_with_partial_deployment():
    with pytest.raises(ValueError, match="global_model_fraction"):
        MHPFedHNGDParams(global_exchange="alg2", global_model_fraction=0.5)


# -- the client side: one full-batch SGD step of a linear model, gradients in closed form ----
def _linear_fm(seed: int) -> FunctionalModel:
    torch.manual_seed(seed)
    return FunctionalModel(torch.nn.Linear(2, 3).double(), "linear")


def _hand_group(fm: FunctionalModel, lr: float) -> ClientGroup:
    """Client 0 holds the four samples; batch 4, one epoch: exactly one SGD step."""
    data = FederatedData(
        x=X,
        y=Y,
        train_idx=[torch.arange(4)],
        val_idx=[torch.arange(0)],
        test_idx=[torch.arange(4)],
        num_classes=3,
        input_shape=(2,),
        mean=torch.zeros(0),
        std=torch.zeros(0),
        dtype=torch.float64,
    )
    sgd = SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    return ClientGroup(fm, [0], data, rnd=1, seed=0, sgd=sgd, vectorize=False)


def _client(hp: MHPFedHNParams, teacher: FunctionalModel | None) -> MHPFedHNClient:
    """The client role with ``teacher`` as its global model's architecture."""
    client = MHPFedHNClient(MHPFedHNParams(), ClientContext(0, torch.device("cpu"), 3, (2,)))
    client.hp = hp
    client.global_fm = teacher
    return client


def _logits(theta: torch.Tensor) -> torch.Tensor:
    return X @ theta[:6].view(3, 2).T + theta[6:]  # nn.Linear(2, 3): weight, then bias


def hand_grad(
    theta: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    ce_w: float = 1.0,
    kl_w: float = 0.0,
    T: float = 1.0,
    t2: bool = False,
) -> torch.Tensor:
    """d/d theta of ce_w * CE + kl_w * KL(softmax(t/T) || softmax(s/T)) (x T^2 if t2), batch
    means, for s = x W^T + b: dCE/ds = (softmax(s) - onehot(y)) / n and
    dKL/ds = (softmax(s/T) - softmax(t/T)) / (T n); d/dW = G^T x, d/db = sum_rows G."""
    s, n = _logits(theta), len(Y)
    grad = ce_w * (torch.softmax(s, 1) - F.one_hot(Y, 3)) / n
    if kl_w:
        scale = kl_w * (T * T if t2 else 1.0) / (T * n)
        grad = grad + scale * (torch.softmax(s / T, 1) - torch.softmax(teacher_logits / T, 1))
    return torch.cat([(grad.T @ X).flatten(), grad.sum(0)])


def hand_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float) -> torch.Tensor:
    pt = torch.softmax(teacher_logits / T, 1)
    return (pt * (pt.log() - torch.log_softmax(student_logits / T, 1))).sum(1).mean()


def _fit(hp: MHPFedHNParams, lr: float = 0.5, with_teacher: bool = True) -> tuple:
    student, teacher = _linear_fm(1), _linear_fm(2)
    theta, w_g = student.initial_params(), teacher.initial_params()
    client = _client(hp, teacher if with_teacher else None)
    msg = {"theta": theta[None]}
    if with_teacher:
        msg["global"] = w_g[None]
    state = client.init_state(student, 1)
    reply, _, _ = client.fit(_hand_group(student, lr), msg, state)
    return reply, theta, w_g


def test_client_update_returns_trained_minus_received():
    """Alg. 1 ClientUpdate: theta~ = theta - eta * grad CE (one step here), and the reply is
    Delta theta = theta~ - theta, nothing else."""
    reply, theta, _ = _fit(MHPFedHNParams(**TINY), lr=0.5, with_teacher=False)
    assert set(reply) == {"delta"}
    assert torch.allclose(reply["delta"][0], -0.5 * hand_grad(theta), rtol=0, atol=1e-12)


def test_g_client_trains_received_global_model_and_plain_ce_personal_model():
    """Alg. 2 ClientUpdate1: Delta w_g,i = w_g,i - w_g after CE steps from the received w_g.
    MH-pFedHNG has no distillation: the personalized step is plain CE."""
    reply, theta, w_g = _fit(MHPFedHNGParams(**TINY, global_model="linear"))
    assert torch.allclose(reply["global_delta"][0], -0.5 * hand_grad(w_g), rtol=0, atol=1e-12)
    assert torch.allclose(reply["delta"][0], -0.5 * hand_grad(theta), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("weighting", "t2", "ce_w", "kl_w", "scale"),
    [
        ("eq8", False, 0.2, 0.8, 1.0),
        ("kl_weight", False, 0.8, 0.2, 1.0),
        ("eq8", True, 0.2, 0.8, 4.0),
    ],
)
def test_gd_client_step_is_eq8_with_received_global_as_teacher(weighting, t2, ce_w, kl_w, scale):
    """Eq. 8 / Alg. 2 ClientUpdate2 with lambda = 0.2, T = 2: the personalized step descends
    lambda * CE + (1 - lambda) * KL(softmax(w_g(x)/T) || softmax(theta(x)/T)), the teacher
    being the w_g the client *received* (not its trained w_g,i). ``kl_weight`` swaps the
    weights (the other reading); ``kd_t2`` multiplies the KL by T^2 = 4."""
    hp = MHPFedHNGDParams(
        **TINY,
        global_model="linear",
        kd_lambda=0.2,
        temperature=2.0,
        kd_weighting=weighting,
        kd_t2=t2,
    )
    assert hp.kd_weights() == pytest.approx((ce_w, kl_w))
    reply, theta, w_g = _fit(hp)
    t_logits = _logits(w_g)
    expected = -0.5 * hand_grad(theta, t_logits, ce_w, kl_w, T=2.0, t2=t2)
    assert torch.allclose(reply["delta"][0], expected, rtol=0, atol=1e-12)
    assert torch.allclose(reply["global_delta"][0], -0.5 * hand_grad(w_g), rtol=0, atol=1e-12)
    # the loss value itself, from hand logits
    student = _linear_fm(1)
    loss, _ = distillation_loss(
        student,
        theta,
        torch.zeros(0),
        X,
        Y,
        {"teacher": w_g, "teacher_buffers": torch.zeros(0)},
        teacher=_linear_fm(2),
        ce_weight=ce_w,
        kl_weight=kl_w,
        temperature=2.0,
        kd_t2=t2,
    )
    by_hand = ce_w * F.cross_entropy(_logits(theta), Y) + kl_w * scale * hand_kl(
        _logits(theta), t_logits, 2.0
    )
    assert torch.allclose(loss, by_hand, rtol=0, atol=1e-12)


def test_alg2_client_trains_w_g_alone_then_distils_theta_from_the_teacher_it_is_sent():
    """global_exchange = "alg2": the first exchange carries w_g alone (ClientUpdate1: the reply
    is Delta w_g,i only); the personal exchange carries theta_i and the round-start w_g as
    ``teacher`` (ClientUpdate2: Eq. 8 against that teacher, no second w_g training)."""
    hp = MHPFedHNGDParams(
        **TINY, global_model="linear", global_exchange="alg2", kd_lambda=0.3, temperature=2.0
    )
    student, teacher_fm = _linear_fm(1), _linear_fm(2)
    theta, w_g = student.initial_params(), teacher_fm.initial_params()
    client = _client(hp, teacher_fm)
    state = client.init_state(student, 1)
    reply, state, _ = client.fit(_hand_group(student, 0.5), {"global": w_g[None]}, state)
    assert set(reply) == {"global_delta"}
    assert torch.allclose(reply["global_delta"][0], -0.5 * hand_grad(w_g), rtol=0, atol=1e-12)
    teacher = w_g + 0.3  # any teacher: the one sent is the one distilled from
    msg = {"theta": theta[None], "teacher": teacher[None]}
    reply, _, _ = client.fit(_hand_group(student, 0.5), msg, state)
    assert set(reply) == {"delta"}
    ce_w, kl_w = hp.kd_weights()  # kl_weight reading: 0.7 CE + 0.3 KL
    expected = -0.5 * hand_grad(theta, _logits(teacher), ce_w, kl_w, T=2.0)
    assert torch.allclose(reply["delta"][0], expected, rtol=0, atol=1e-12)


def test_distillation_moves_the_student_toward_the_teacher_by_eta_grad_squared():
    """Eq. 8 as printed with lambda = 0: the step is pure distillation, Delta theta =
    -eta * grad KL, so KL(teacher || student) falls by eta * |grad KL|^2 to first order
    (eta = 1e-3 here)."""
    eta, T = 1e-3, 3.0
    hp = MHPFedHNGDParams(
        **TINY, global_model="linear", kd_lambda=0.0, temperature=T, kd_weighting="eq8"
    )
    reply, theta, w_g = _fit(hp, lr=eta)
    t_logits = _logits(w_g)
    g = hand_grad(theta, t_logits, 0.0, 1.0, T=T)
    assert torch.allclose(reply["delta"][0], -eta * g, rtol=0, atol=1e-15)
    drop = hand_kl(_logits(theta), t_logits, T) - hand_kl(
        _logits(theta + reply["delta"][0]), t_logits, T
    )
    assert drop > 0
    assert float(drop) == pytest.approx(float(eta * g.dot(g)), rel=0.01)


def test_gd_default_weighs_the_kl_by_lambda_and_configs_use_papers_lambda():
    """lambda = 0.1 (§4.1) weighs the KL, 1 - lambda the CE: the reading chosen on validation
    (session 18; Eq. 8 as printed, lambda on the CE, is ``kd_weighting="eq8"``); the seed-000
    configs set §4.1's (T, lambda) per dataset: CIFAR-100 (15, 0.01), Tiny-ImageNet (24, 0.2),
    EMNIST (10, 0.1)."""
    hp = MHPFedHNGDParams()
    assert (hp.kd_weighting, hp.kd_lambda, hp.kd_weights()) == ("kl_weight", 0.1, (0.9, 0.1))
    assert MHPFedHNGDParams(kd_weighting="eq8").kd_weights() == (0.1, 0.9)
    assert hparam_sources(MHPFedHNGDParams)["kd_weighting"].startswith("chosen here: val acc")
    with pytest.raises(ValueError, match="kd_weighting: allowed: one of eq8, kl_weight"):
        validate_hparams(MHPFedHNGDParams, {"kd_weighting": "hinton"})
    paper = {"cifar100": (15.0, 0.01), "tiny_imagenet": (24.0, 0.2), "emnist": (10.0, 0.1)}
    seen = set()
    for path in sorted(Path(__file__).parents[1].glob("configs/seed000/*.toml")):
        cfg = load_config(path, ["algorithm.name=mh_pfedhngd"])
        if cfg.dataset.name in paper and "kd_lambda" in cfg.algorithm.params:
            got = cfg.hparams()
            assert (got.temperature, got.kd_lambda, got.kd_weighting) == (
                *paper[cfg.dataset.name],
                "kl_weight",
            ), path.name
            seen.add(cfg.dataset.name)
    assert seen == set(paper)


def test_client_is_evaluated_with_the_generated_personalized_model():
    """pFedHN / MH-pFedHN evaluate theta_i = h(v_i; phi)[:K_i] of the current hypernetwork (no
    local fine-tuning), and GD's client its personalized model, never the global teacher."""
    lr = 0.05
    server = _tiny_server({0: 9, 1: 4}, MHPFedHNGDParams(**TINY), global_size=9, sgd_lr=lr)
    msgs = server.configure_train(1, [0, 1])
    replies = {
        c: {
            "delta": 0.1 * torch.ones_like(m["theta"]),
            "global_delta": 0.1 * torch.ones(9, dtype=torch.float64),
        }
        for c, m in msgs.items()
    }
    server.aggregate(1, replies)
    p1 = _params(server.hnet)
    evals = server.configure_eval([0, 1])
    for c in (0, 1):  # the updated hypernetwork's output, not last round's theta
        assert torch.allclose(evals[c]["theta"], _theta_fn(server, c)(p1), rtol=0, atol=1e-12)
        assert not torch.allclose(evals[c]["theta"], msgs[c]["theta"])
    student = _linear_fm(1)
    client = _client(MHPFedHNGDParams(**TINY, global_model="linear"), _linear_fm(2))
    msg = {"theta": evals[0]["theta"][None], "global": evals[0]["global"][None]}
    theta, _ = client.eval_model(_hand_group(student, 0.1), msg, client.init_state(student, 1))
    assert torch.equal(theta[0], evals[0]["theta"])
