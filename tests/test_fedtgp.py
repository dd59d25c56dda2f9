"""FedTGP (Zhang et al., AAAI 2024; arXiv 2401.03230), defining properties on hand-sized inputs.

The round: clients train on ``CE + lam * mean_j (f(x)_j - P_hat^y_j)^2`` toward the global
prototypes and upload per-class mean representations; the server computes the adaptive margin
``delta = min(max_c min_{c' != c} ||Q^c - Q^{c'}||, tau)`` from the client prototype clusters
``Q^c`` and trains ``P_hat^c = W(e^c)`` (embedding -> Linear -> ReLU -> Linear) on the ACL loss
``CE(-(||P_k^c - P_hat^j|| + delta [j == c]), c)``; clients are scored by the nearest global
prototype.

Expected values are computed here with plain torch (a hand-written forward of a tiny
``Linear(3, 4) - ReLU - Linear(4, 3)`` model, hand-written prototype clusters and distances),
never read back from the method.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.fedtgp import (
    FedTGPClient,
    FedTGPParams,
    FedTGPServer,
    acl_loss,
    adaptive_margin,
)
from hyperfed.config import validate_hparams
from hyperfed.data.federated import FederatedData
from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.local import SGDConfig

CPU = torch.device("cpu")
F64 = torch.float64
D_IN, HIDDEN, CLASSES = 3, 4, 3
Y = (torch.tensor([0, 0, 1, 1]), torch.tensor([1, 2, 2, 2]))


def forward(theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """(representation, logits) of the tiny MLP from its flat vector, by hand."""
    w1, b1 = theta[:12].view(HIDDEN, D_IN), theta[12:16]
    w2, b2 = theta[16:28].view(CLASSES, HIDDEN), theta[28:31]
    feats = (x @ w1.T + b1).relu()
    return feats, feats @ w2.T + b2


def make_data() -> FederatedData:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, D_IN, generator=g, dtype=F64) * 1.5
    return toy_federation(x, torch.cat(Y), [torch.arange(0, 4), torch.arange(4, 8)], CLASSES)


def protos_msg(ready: bool = True) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(2)
    protos = torch.rand(CLASSES, HIDDEN, generator=g, dtype=F64) * 2.0
    mask = torch.ones(CLASSES, dtype=F64) if ready else torch.zeros(CLASSES, dtype=F64)
    return {"protos": protos.expand(2, -1, -1), "proto_mask": mask.expand(2, -1)}


def fit(lam: float, lr: float = 0.5, ready: bool = True, **hp: Any):
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES)
    sgd = SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    group = ClientGroup(fm, [0, 1], make_data(), rnd=1, seed=0, sgd=sgd, vectorize=False)
    client = FedTGPClient(FedTGPParams(lam=lam, **hp), ClientContext(0, CPU, CLASSES, (D_IN,)))
    state = client.init_state(fm, 2)
    msg = protos_msg(ready)
    reply, new_state, _ = client.fit(group, msg, state)
    return group, client, msg, state, reply, new_state


def local_step(theta: Tensor, x: Tensor, y: Tensor, protos: Tensor, lam: float, lr: float):
    leaf = theta.clone().requires_grad_(True)
    feats, logits = forward(leaf, x)
    loss = F.cross_entropy(logits, y) + lam * ((feats - protos[y]) ** 2).mean(1).mean()
    (g,) = torch.autograd.grad(loss, leaf)
    return theta - lr * g


def test_local_step_descends_ce_plus_lambda_times_distance_to_the_global_prototype() -> None:
    """Client loss: one full-batch step = theta - lr * grad(CE + lam * mean sq. distance of
    f(x) to P_hat^y); before any P_hat exists (round 1) the step is CE alone."""
    lam, lr = 0.7, 0.5
    group, _, msg, state, _, new_state = fit(lam, lr)
    _, _, _, _, _, first_round = fit(lam, lr, ready=False)
    data, protos = group.data, msg["protos"][0]
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        theta0 = state["theta"][c]
        expected = local_step(theta0, x, y, protos, lam, lr)
        assert (expected - local_step(theta0, x, y, protos, 0.0, lr)).abs().max() > 1e-3
        assert (expected - local_step(theta0, x, y, protos, -lam, lr)).abs().max() > 1e-3
        torch.testing.assert_close(new_state["theta"][c], expected, rtol=0, atol=1e-10)
        ce_only = local_step(theta0, x, y, protos, 0.0, lr)
        torch.testing.assert_close(first_round["theta"][c], ce_only, rtol=0, atol=1e-10)


def test_upload_is_the_class_mean_representation_without_counts() -> None:
    """Client prototype P_k^c = mean of f_k(x) over its class-c samples with the trained model;
    only (class, prototype) pairs cross."""
    group, _, _, state, reply, new_state = fit(0.7)
    assert set(reply) == {"proto_classes", "protos"}
    data = group.data
    held = {0: [0, 1], 1: [1, 2]}
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        feats, _ = forward(new_state["theta"][c], x)
        assert reply["proto_classes"][c].tolist() == held[c]
        for s, j in enumerate(held[c]):
            mean = feats[y == j].mean(0)
            torch.testing.assert_close(reply["protos"][c, s].to(F64), mean, rtol=0, atol=1e-6)
            stale = forward(state["theta"][c], x)[0][y == j].mean(0)
            assert (stale - mean).abs().max() > 1e-4


# client prototypes in 2-D: class 0 from two clients, classes 1 and 2 from one each
PROTOS = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 3.0], [7.0, 0.0]], dtype=F64)
LABELS = torch.tensor([0, 0, 1, 2])
# clusters Q0 = (1, 0), Q1 = (1, 3), Q2 = (7, 0): |Q0Q1| = 3, |Q0Q2| = 6, |Q1Q2| = sqrt(45)
# nearest-other distances: class 0 -> 3, class 1 -> 3, class 2 -> 6; their max is 6


def test_adaptive_margin_is_the_largest_nearest_cluster_gap_capped_at_tau() -> None:
    """delta = min(max_c min_{c' != c} ||Q^c - Q^{c'}||, tau) with Q^c the mean of the class's
    client prototypes (max of max would be sqrt(45), min of min 3)."""
    assert float(adaptive_margin(PROTOS, LABELS, 4, tau=100.0)) == pytest.approx(6.0)
    assert float(adaptive_margin(PROTOS, LABELS, 4, tau=2.5)) == pytest.approx(2.5)
    # a single uploaded class has no gap: the cap
    assert float(adaptive_margin(PROTOS[:2], LABELS[:2], 4, tau=7.0)) == pytest.approx(7.0)


def test_acl_loss_handicaps_the_true_class_by_the_margin() -> None:
    """ACL on hand numbers: -log(e^-(d_y + delta) / (e^-(d_y + delta) + sum_j!=y e^-d_j)),
    d the Euclidean distance to each generated prototype, mean over the uploaded pairs."""
    generated = torch.tensor([[0.0, 1.0], [1.0, 1.0], [4.0, 0.0]], dtype=F64)
    delta = torch.tensor(0.8, dtype=F64)
    total = 0.0
    for p, y in zip(PROTOS, LABELS.tolist()):
        d = [math.dist(p.tolist(), g.tolist()) for g in generated]
        num = math.exp(-(d[y] + 0.8))
        total += -math.log(num / (num + sum(math.exp(-d[j]) for j in range(3) if j != y)))
    got = acl_loss(PROTOS, LABELS, generated, delta)
    assert float(got) == pytest.approx(total / 4, rel=1e-12)
    assert float(acl_loss(PROTOS, LABELS, generated, delta * 0)) < float(got)  # margin adds


def hand_tgp(params: dict[str, Tensor]) -> Tensor:
    """P_hat = W2 relu(W1 e + b1) + b2 for every class embedding e, by hand."""
    h = (params["embeddings.weight"] @ params["hidden.weight"].T + params["hidden.bias"]).relu()
    return h @ params["out.weight"].T + params["out.bias"]


def server_for(**hp: Any) -> FedTGPServer:
    joins = {c: {"num_samples": torch.tensor(4), "feature_dim": torch.tensor(2)} for c in (0, 1)}
    return FedTGPServer(FedTGPParams(**hp), joins, ServerContext(5, CPU, 4, (D_IN,)))


def test_server_step_is_sgd_on_acl_with_the_adaptive_margin_and_sends_all_classes() -> None:
    """Server: one full-batch SGD step of (e, W) on ACL with delta = 6 (the margin computed
    above), then P_hat of all 4 classes is sent, class 3 included (nobody uploaded it)."""
    server = server_for(server_epochs=1, server_batch_size=16, server_lr=0.2)
    params = {k: v.detach().to(F64).clone() for k, v in server.tgp.named_parameters()}
    up = PROTOS.float()
    replies = {
        0: {"proto_classes": torch.tensor([0, 1], dtype=torch.int32), "protos": up[[0, 2]]},
        1: {"proto_classes": torch.tensor([0, 2], dtype=torch.int32), "protos": up[[1, 3]]},
    }
    assert all(server.check_reply(c, r) is None for c, r in replies.items())
    server.aggregate(1, replies)
    assert float(server.margin) == pytest.approx(6.0)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    gen = hand_tgp(leaves)
    protos, labels = PROTOS[[0, 2, 1, 3]], torch.tensor([0, 1, 0, 2])
    dist = torch.cdist(protos, gen) + 6.0 * F.one_hot(labels, 4)
    grads = torch.autograd.grad(F.cross_entropy(-dist, labels), list(leaves.values()))
    stepped = {k: v - 0.2 * g for (k, v), g in zip(params.items(), grads)}
    expected = hand_tgp(stepped)
    assert (expected - hand_tgp(params)).abs().max() > 1e-3
    torch.testing.assert_close(server.protos.to(F64), expected, rtol=0, atol=1e-5)
    msg = server.configure_train(2, [0])[0]
    assert msg["proto_mask"].tolist() == [1.0] * 4
    torch.testing.assert_close(msg["protos"], server.protos)


def test_clients_are_scored_by_the_nearest_global_prototype() -> None:
    """Inference: a sample's class is argmin_c ||f(x) - P_hat^c|| and the reported loss is the
    CE of -||f(x) - P_hat^c||^2; before any P_hat, and with inference="classifier", the
    client's own classifier."""
    group, client, msg, _, _, new_state = fit(0.7)
    theta, buffers = client.eval_model(group, msg, new_state)
    ok, _, loss = evaluate_clients(group.fm, theta, buffers, group.data, [0, 1])
    data = group.data
    protos = msg["protos"][0]
    for c in range(2):
        x, y = data.batch(data.test_idx[c])
        feats, _ = forward(new_state["theta"][c], x)
        sq = torch.cdist(feats, protos) ** 2
        assert int(ok[c]) == int((sq.argmin(1) == y).sum())
        expected = F.cross_entropy(-sq, y, reduction="sum")
        torch.testing.assert_close(loss[c], expected, rtol=1e-9, atol=1e-9)
    not_ready = {"protos": msg["protos"] * 0, "proto_mask": msg["proto_mask"] * 0}
    own, _ = client.eval_model(group, not_ready, new_state)
    assert torch.equal(own, new_state["theta"])
    _, clf_client, _, _, _, clf_state = fit(0.7, inference="classifier")
    assert torch.equal(clf_client.eval_model(group, msg, clf_state)[0], clf_state["theta"])


def test_server_trains_at_the_clients_lr_and_batch_unless_set() -> None:
    """The authors' servertgp.py: the generator's SGD uses args.local_learning_rate and
    args.batch_size, the clients' own. Left at None, server_lr / server_batch_size take the
    [local] values the federation hands the server; the step is then the hand-checked one
    above (lr 0.2, one batch of 16), and a server set explicitly elsewhere steps differently."""
    joins = {c: {"num_samples": torch.tensor(4), "feature_dim": torch.tensor(2)} for c in (0, 1)}
    up = PROTOS.float()
    replies = {
        0: {"proto_classes": torch.tensor([0, 1], dtype=torch.int32), "protos": up[[0, 2]]},
        1: {"proto_classes": torch.tensor([0, 2], dtype=torch.int32), "protos": up[[1, 3]]},
    }
    local = SGDConfig(lr=0.2, batch_size=16)

    def with_local(**hp: Any) -> FedTGPServer:
        ctx = ServerContext(5, CPU, 4, (D_IN,), local=local)
        return FedTGPServer(FedTGPParams(server_epochs=1, **hp), joins, ctx)

    inherited, explicit = (
        with_local(),
        server_for(server_epochs=1, server_batch_size=16, server_lr=0.2),
    )
    own_lr, own_batch = with_local(server_lr=0.05), with_local(server_batch_size=1)
    assert (inherited.server_lr, inherited.server_batch_size) == (0.2, 16)
    assert (own_lr.server_lr, own_batch.server_batch_size) == (0.05, 1)
    for server in (inherited, explicit, own_lr, own_batch):
        server.aggregate(1, replies)
    assert torch.equal(inherited.protos, explicit.protos)
    assert not torch.allclose(inherited.protos, own_lr.protos)
    assert not torch.allclose(inherited.protos, own_batch.protos)
    with pytest.raises(ValueError, match="no \\[local\\] settings"):
        server_for(server_epochs=1)  # no federation: nothing to inherit
    with pytest.raises(ValueError, match="server_batch_size: allowed: a whole number from 1"):
        validate_hparams(FedTGPParams, {"server_batch_size": 0})  # 0 is a bad batch, not "unset"


def test_the_federation_hands_its_local_settings_to_the_fedtgp_server() -> None:
    from hyperfed.config import load_config
    from hyperfed.runtime.simulate import Simulation

    sets = [
        "device=cpu",
        "rounds=1",
        "dataset.name=digits",
        "dataset.subsample=120",
        "clients.count=2",
        "clients.models=lenet",
        "algorithm.name=fedtgp",
        "local.lr=0.03",
        "local.batch_size=24",
    ]
    server = Simulation(load_config(None, sets)).server
    assert (server.server_lr, server.server_batch_size) == (0.03, 24)  # type: ignore[attr-defined]
