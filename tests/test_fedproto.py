"""FedProto (Tan et al., AAAI 2022; arXiv 2105.00243), defining properties on hand-sized inputs.

Equation numbers follow the arXiv text: Eq. (3) the local prototype ``C_i^(j)`` = mean of the
representations ``f_i(x)`` of class j; Eq. (4) nearest-prototype inference; Eq. (6) the global
prototype, the per-class count-weighted average ``sum_i |D_ij| C_i^(j) / N_j`` of the clients
that hold class j (the written formula carries an extra ``1/|N_j|``, read as normalization);
Eq. (7)-(8) the local loss ``L_S(F_i(x), y) + lam * d(f_i(x), C_bar^y)`` with d the squared L2
distance averaged over feature entries (the official code's ``nn.MSELoss``).

Expected values are computed here with plain torch from a hand-written forward pass of a tiny
``Linear(3, 4) - ReLU - Linear(4, 3)`` model in float64, never read back from the method.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.fedproto import (
    FedProtoClient,
    FedProtoParams,
    FedProtoServer,
    proto_loss,
)
from hyperfed.config import load_config
from hyperfed.data.federated import FederatedData
from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.local import SGDConfig
from hyperfed.engine.metering import FlopMeter
from hyperfed.models.layout import FunctionalModel
from hyperfed.runtime.simulate import Simulation

CPU = torch.device("cpu")
F64 = torch.float64
D_IN, HIDDEN, CLASSES = 3, 4, 3
SIZES = (D_IN, HIDDEN, CLASSES)
# client 0 holds classes 0 and 1 (2 + 2 samples), client 1 classes 1 and 2 (1 + 3 samples)
Y = (torch.tensor([0, 0, 1, 1]), torch.tensor([1, 2, 2, 2]))
# the vmapped path and the per-client loop; the first vmap in a process costs ~6 s (warm-up)
VECTORIZE = [pytest.param(True, marks=pytest.mark.slow), False]


def tiny_fm(seed: int = 0) -> FunctionalModel:
    return tiny_mlp(D_IN, HIDDEN, CLASSES, seed)


def mlp_forward(theta: Tensor, x: Tensor, sizes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Plain-torch forward of Linear-ReLU-...-Linear from its flat (weight, bias)* vector:
    (representation = input of the last Linear, logits)."""
    h, off, feats = x, 0, x
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = theta[off : off + a * b].view(b, a)
        bias = theta[off + a * b : off + a * b + b]
        off += a * b + b
        feats = h
        h = h @ w.T + bias
        if i < len(sizes) - 2:
            h = h.relu()
    assert off == theta.numel()
    return feats, h


def make_data() -> FederatedData:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, D_IN, generator=g, dtype=F64) * 1.5
    y = torch.cat(Y)
    idx = [torch.arange(0, 4), torch.arange(4, 8)]
    return toy_federation(x, y, idx, CLASSES)


def make_group(fm: FunctionalModel, lr: float, epochs: int = 1, vectorize: bool = True):
    sgd = SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=epochs, batch_size=4)
    return ClientGroup(fm, [0, 1], make_data(), rnd=1, seed=0, sgd=sgd, vectorize=vectorize)


def make_client(lam: float) -> FedProtoClient:
    return FedProtoClient(FedProtoParams(lam=lam), ClientContext(0, CPU, CLASSES, (D_IN,)))


def global_protos() -> tuple[Tensor, Tensor]:
    """C_bar for classes 0 and 2; class 1 has no global prototype yet."""
    g = torch.Generator().manual_seed(2)
    protos = torch.rand(CLASSES, HIDDEN, generator=g, dtype=F64) * 2.0
    protos[1] = 0.0
    return protos, torch.tensor([1.0, 0.0, 1.0], dtype=F64)


def eq7_loss(theta: Tensor, x: Tensor, y: Tensor, protos: Tensor, mask: Tensor, lam: float):
    """Eq. 7: CE(F(x), y) + lam * mean over samples whose class has C_bar of
    mean_entries (f(x) - C_bar^y)^2."""
    feats, logits = mlp_forward(theta, x, SIZES)
    have = mask[y]
    dist = ((feats - protos[y]) ** 2).mean(1)
    return F.cross_entropy(logits, y) + lam * (dist * have).sum() / have.sum().clamp(min=1)


def sgd_step(theta: Tensor, x: Tensor, y: Tensor, lam: float, lr: float) -> Tensor:
    protos, mask = global_protos()
    leaf = theta.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(eq7_loss(leaf, x, y, protos, mask, lam), leaf)
    return theta - lr * g


def fit(lam: float, lr: float, epochs: int = 1, vectorize: bool = True):
    fm = tiny_fm()
    group = make_group(fm, lr, epochs, vectorize)
    client = make_client(lam)
    state = client.init_state(fm, 2)
    protos, mask = global_protos()
    msg = {"protos": protos.expand(2, -1, -1), "proto_mask": mask.expand(2, -1)}
    reply, new_state, _ = client.fit(group, msg, state)
    return group, client, state, msg, reply, new_state


@pytest.mark.parametrize("vectorize", VECTORIZE)
def test_one_local_step_descends_ce_plus_lambda_times_prototype_distance(vectorize: bool) -> None:
    """Eq. 7: one full-batch SGD step equals theta - lr * grad(CE + lam * d(f(x), C_bar^y));
    lam = 0.7 pins the weight, the + sign pins the direction, class 1 (no C_bar) gets CE only."""
    lam, lr = 0.7, 0.5
    group, _, state, _, _, new_state = fit(lam, lr, vectorize=vectorize)
    data = group.data
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        theta0 = state["theta"][c]
        expected = sgd_step(theta0, x, y, lam, lr)
        # the example can fail: the prototype term moves the step, in a sign-dependent way
        assert (expected - sgd_step(theta0, x, y, 0.0, lr)).abs().max() > 1e-3
        assert (expected - sgd_step(theta0, x, y, 1.0, lr)).abs().max() > 1e-4
        torch.testing.assert_close(new_state["theta"][c], expected, rtol=0, atol=1e-10)


def test_proto_loss_value_is_ce_plus_lambda_times_mean_squared_distance() -> None:
    """Eq. 7 on hand numbers: the loss value itself, samples without a C_bar^y excluded."""
    fm = tiny_fm()
    theta = fm.initial_params()
    x, y = make_data().batch(torch.arange(4))
    protos, mask = global_protos()
    ctx = {"protos": protos, "proto_mask": mask}
    loss, _ = proto_loss(fm, theta, torch.zeros(0), x, y, ctx, lam=0.3)
    torch.testing.assert_close(loss, eq7_loss(theta, x, y, protos, mask, 0.3), rtol=0, atol=1e-12)
    ce, _ = proto_loss(fm, theta, torch.zeros(0), x, y, ctx, lam=0.0)
    assert float(loss - ce) > 1e-3  # the regularizer adds a positive distance


def test_regularizer_pulls_representations_toward_the_global_prototypes() -> None:
    """Eq. 7's + lam * d term: training with lam > 0 ends with representations closer to the
    global prototypes of their classes than training on CE alone (a flipped sign pushes away)."""
    protos, mask = global_protos()

    def distance(lam: float) -> float:
        group, _, _, _, _, new_state = fit(lam, lr=0.05, epochs=20)
        data, total = group.data, 0.0
        for c in range(2):
            x, y = data.batch(data.train_idx[c])
            feats, _ = mlp_forward(new_state["theta"][c], x, SIZES)
            total += float((((feats - protos[y]) ** 2).mean(1) * mask[y]).sum())
        return total

    with_reg, ce_only = distance(5.0), distance(0.0)
    assert with_reg < 0.75 * ce_only, (with_reg, ce_only)


@pytest.mark.parametrize("vectorize", VECTORIZE)
def test_uploaded_prototypes_are_class_means_of_the_trained_representation(
    vectorize: bool,
) -> None:
    """Eq. 3 and Algorithm 1 order: after local training, C_i^(j) = mean of f_i(x) over the
    client's samples of class j, with the *trained* model; uploaded with |D_ij| per class."""
    group, _, state, _, reply, new_state = fit(0.7, 0.5, vectorize=vectorize)
    assert set(reply) == {"proto_classes", "protos", "proto_counts"}
    data = group.data
    held = {0: ([0, 1], [2.0, 2.0]), 1: ([1, 2], [1.0, 3.0])}
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        feats, _ = mlp_forward(new_state["theta"][c], x, SIZES)
        stale, _ = mlp_forward(state["theta"][c], x, SIZES)
        classes, counts = held[c]
        assert reply["proto_classes"][c].tolist() == classes
        assert reply["proto_counts"][c].tolist() == counts
        for s, j in enumerate(classes):
            mean = feats[y == j].mean(0)
            torch.testing.assert_close(reply["protos"][c, s].to(F64), mean, rtol=0, atol=1e-6)
            # prototypes of the model before training would be another vector
            assert (stale[y == j].mean(0) - mean).abs().max() > 1e-4


@pytest.mark.parametrize("epochs", [1, 2])
def test_client_flops_include_the_prototype_pass(epochs: int) -> None:
    """The round's client FLOPs are local training plus the prototype pass (Eq. 3, one forward
    of the trained model over each training sample, once a round whatever E), counted by hand
    from the layer sizes of Linear(3, 4) - ReLU - Linear(4, 3), 2 FLOPs a multiply-add:
    forward 2 * (3*4 + 4*3) = 48 a sample; backward 72 (dL/dW2, dL/dh and dL/dW1, 24 each; none
    for the input). Training a sample for one epoch: 48 + 72 = 120. Each client holds 4 samples
    (one batch of 4): E = 1 gives 2 * 4 * (120 + 48) = 1344 (1.4x the training alone: the pass
    left outside the meter counted 960); E = 2 gives 2 * 4 * (2 * 120 + 48) = 2304."""
    with FlopMeter() as meter:
        fit(0.7, 0.5, epochs=epochs, vectorize=False)
    assert meter.total == 2 * 4 * (epochs * 120 + 48)


def _reply(classes: list[int], protos: Tensor, counts: list[float]) -> dict[str, Tensor]:
    return {
        "proto_classes": torch.tensor(classes, dtype=torch.int32),
        "protos": protos,
        "proto_counts": torch.tensor(counts),
    }


def test_server_prototype_is_the_count_weighted_average_per_class() -> None:
    """Eq. 6: C_bar^(j) = sum_i |D_ij| C_i^(j) / sum_i |D_ij| over this round's holders of j
    (an unweighted mean would differ); a class nobody reports keeps its previous prototype."""
    d = 2
    ctx = ServerContext(0, CPU, 4, (D_IN,))
    joins = {c: {"num_samples": torch.tensor(8), "feature_dim": torch.tensor(d)} for c in range(3)}
    server = FedProtoServer(FedProtoParams(), joins, ctx)
    p2 = torch.tensor([5.0, -1.0])
    old0 = torch.tensor([9.0, 9.0])
    server.aggregate(1, {0: _reply([0, 2], torch.stack([old0, p2]), [4.0, 5.0])})
    a0, b0, c1 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0]), torch.tensor([0.5, 0.25])
    replies = {
        0: _reply([0], a0[None], [1.0]),
        1: _reply([0, -1], torch.stack([b0, torch.zeros(d)]), [3.0, 0.0]),  # padded slot
        2: _reply([1], c1[None], [2.0]),
    }
    assert all(server.check_reply(c, r) is None for c, r in replies.items())
    server.aggregate(2, replies)
    torch.testing.assert_close(server.protos[0], (1 * a0 + 3 * b0) / 4)  # not (a0 + b0) / 2
    torch.testing.assert_close(server.protos[1], c1)
    torch.testing.assert_close(server.protos[2], p2)  # not reported in round 2: kept
    torch.testing.assert_close(server.protos[3], torch.zeros(d))
    assert server.proto_mask.tolist() == [1.0, 1.0, 1.0, 0.0]
    msgs = server.configure_train(3, [0, 1])
    assert set(msgs[0]) == {"protos", "proto_mask"}
    torch.testing.assert_close(msgs[1]["protos"], server.protos)


def test_a_client_round_trip_feeds_the_server_average() -> None:
    """Eq. 3 -> Eq. 6: the server's prototype of class 1 (held by both clients: 2 and 1
    samples) is the count-weighted average of the two clients' trained class means."""
    group, _, _, _, reply, new_state = fit(0.7, 0.5)
    ctx = ServerContext(0, CPU, CLASSES, (D_IN,))
    joins = {
        c: {"num_samples": torch.tensor(4), "feature_dim": torch.tensor(HIDDEN)} for c in (0, 1)
    }
    server = FedProtoServer(FedProtoParams(), joins, ctx)
    server.aggregate(1, {c: {k: v[c] for k, v in reply.items()} for c in (0, 1)})
    data, means = group.data, []
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        feats, _ = mlp_forward(new_state["theta"][c], x, SIZES)
        means.append(feats[y == 1].mean(0))
    expected = (2 * means[0] + 1 * means[1]) / 3
    torch.testing.assert_close(server.protos[1].to(F64), expected, rtol=0, atol=1e-6)


def test_client_is_evaluated_with_its_own_trained_model_and_classifier() -> None:
    """What the code claims (module docstring): the score is argmax of the client's own
    trained classifier, not Eq. 4's nearest global prototype; the eval message carries nothing
    that changes the model."""
    group, client, _, _, _, new_state = fit(0.7, 0.5)
    server = FedProtoServer(
        FedProtoParams(),
        {c: {"num_samples": torch.tensor(4), "feature_dim": torch.tensor(HIDDEN)} for c in (0, 1)},
        ServerContext(0, CPU, CLASSES, (D_IN,)),
    )
    assert server.configure_eval([0, 1]) == {0: {}, 1: {}}
    theta, buffers = client.eval_model(group, {}, new_state)
    assert torch.equal(theta, new_state["theta"])
    ok, total, _ = evaluate_clients(group.fm, theta, buffers, group.data, [0, 1])
    data = group.data
    for c in range(2):
        x, y = data.batch(data.test_idx[c])
        _, logits = mlp_forward(new_state["theta"][c], x, SIZES)
        assert int(ok[c]) == int((logits.argmax(1) == y).sum())


def test_bytes_down_are_the_whole_prototype_table_and_up_the_held_classes() -> None:
    """Both directions of the wire, counted by the round driver. Digits (10 classes), the zoo's
    MLP 64 -> 128 -> 64 -> 10 (its representation, the input of the last Linear, is d = 64
    wide), 2 classes a client:
    down, every class's prototype and the mask, float32: (10 * 64 + 10) * 4 = 2600 bytes a
    client; up, the 2 held classes as (int32 id, float32 [64] prototype, float32 count):
    2 * (64 + 2) * 4 = 528 bytes (down is ~5x up). Before round 1 each client sent n_k and d
    (int64): 2 * 8 bytes."""
    cfg = load_config(
        None,
        [
            "device=cpu",
            "dataset.name=digits",
            "dataset.subsample=200",
            "partition.name=quantity",
            "partition.classes_per_client=2",
            "clients.models=mlp",
            "clients.count=2",
            "algorithm.name=fedproto",
            "local.vectorize=off",
            "rounds=1",
            "eval_every=1",
        ],
    )
    (r,) = Simulation(cfg).run()
    assert r["bytes_down_per_client"] == (10 * 64 + 10) * 4
    assert r["bytes_up_per_client"] == 2 * (64 + 2) * 4
    assert r["bytes_down_round"] == r["bytes_down_total"] == 2 * 2600
    assert r["bytes_up_round"] == 2 * 528
    assert r["bytes_up_total"] == 2 * 528 + 2 * 2 * 8
