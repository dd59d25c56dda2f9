"""FedGH (Yi et al., ACM MM 2023; arXiv 2303.13137), defining properties on hand-sized inputs.

The round (the paper's Figure 1): (1) the client replaces its local header by the global one,
(2) trains extractor + header with CE, (3) uploads per-class local averaged representations
(LARs) of its trained extractor, (4) the server trains the global header with CE on the
(LAR, class) pairs, ``server_epochs`` shuffled passes in batches of ``server_batch_size``
(epochs x ceil(pairs / batch) SGD steps), and the client is evaluated with its own extractor and
the global header (``eval_header="global"``) or its locally trained one (``"local"``).

Expected values are computed here with plain torch from a hand-written forward pass of a tiny
``Linear(3, 4) - ReLU - Linear(4, 3)`` model in float64 (its header is the last Linear, flat
entries 16..30: weight row-major, then bias), never read back from the method.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms import fedgh
from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.fedgh import FedGHClient, FedGHParams, FedGHServer
from hyperfed.config import validate_hparams
from hyperfed.data.federated import FederatedData
from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.local import SGDConfig
from hyperfed.errors import ConfigError

CPU = torch.device("cpu")
F64 = torch.float64
D_IN, HIDDEN, CLASSES = 3, 4, 3
HEAD = slice(D_IN * HIDDEN + HIDDEN, None)  # the header's flat entries (16..30)
Y = (torch.tensor([0, 0, 1, 1]), torch.tensor([1, 2, 2, 2]))


def forward(theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """(representation, logits) of the tiny MLP from its flat vector, by hand."""
    w1 = theta[:12].view(HIDDEN, D_IN)
    b1 = theta[12:16]
    w2 = theta[16:28].view(CLASSES, HIDDEN)
    b2 = theta[28:31]
    feats = (x @ w1.T + b1).relu()
    return feats, feats @ w2.T + b2


def make_data() -> FederatedData:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, D_IN, generator=g, dtype=F64) * 1.5
    return toy_federation(x, torch.cat(Y), [torch.arange(0, 4), torch.arange(4, 8)], CLASSES)


def joins(dims: tuple[int, ...] = (HIDDEN, HIDDEN)) -> dict:
    return {
        c: {"num_samples": torch.tensor(4), "feature_dim": torch.tensor(d)}
        for c, d in enumerate(dims)
    }


def make_server(**hp: Any) -> FedGHServer:
    return FedGHServer(FedGHParams(**hp), joins(), ServerContext(3, CPU, CLASSES, (D_IN,)))


def global_header(server: FedGHServer) -> Tensor:
    """The server's header as the tiny model's flat header entries, read off nn.Linear."""
    w, b = server.header.weight.detach(), server.header.bias.detach()
    return torch.cat([w.reshape(-1), b]).to(F64)


def fit(lr: float = 0.5, vectorize: bool = False):
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES)
    sgd = SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    group = ClientGroup(fm, [0, 1], make_data(), rnd=1, seed=0, sgd=sgd, vectorize=vectorize)
    client = FedGHClient(FedGHParams(), ClientContext(0, CPU, CLASSES, (D_IN,)))
    server = make_server()
    msg = {k: v.expand(2, -1) for k, v in server.configure_train(1, [0])[0].items()}
    state = client.init_state(fm, 2)
    reply, new_state, _ = client.fit(group, msg, state)
    return group, client, server, msg, state, reply, new_state


@pytest.mark.parametrize("vectorize", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_local_training_starts_from_the_global_header_and_trains_all_with_ce(
    vectorize: bool,
) -> None:
    """Steps 1-2: the global header replaces the client's own, then one full-batch CE step on
    the whole model (extractor and header) = theta_h - lr * grad CE(F(x), y)."""
    lr = 0.5
    group, _, server, _, state, _, new_state = fit(lr, vectorize)
    data = group.data
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        start = state["theta"][c].clone()
        start[HEAD] = global_header(server)
        leaf = start.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(forward(leaf, x)[1], y), leaf)
        expected = start - lr * g
        own = state["theta"][c]  # the step from the client's own header lands elsewhere
        leaf = own.clone().requires_grad_(True)
        (g_own,) = torch.autograd.grad(F.cross_entropy(forward(leaf, x)[1], y), leaf)
        assert (expected - (own - lr * g_own)).abs().max() > 1e-2
        assert g[HEAD].abs().max() > 1e-3  # the header is trained too
        torch.testing.assert_close(new_state["theta"][c], expected, rtol=0, atol=1e-6)


def test_upload_is_the_class_mean_representation_of_the_trained_extractor() -> None:
    """Step 3: one LAR per held class, the mean of f_k(x) over the class's samples computed with
    the *trained* extractor; classes and LARs only (no sample counts cross)."""
    group, _, _, _, state, reply, new_state = fit()
    assert set(reply) == {"proto_classes", "protos"}
    data = group.data
    held = {0: [0, 1], 1: [1, 2]}
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        feats, _ = forward(new_state["theta"][c], x)
        stale, _ = forward(state["theta"][c], x)
        assert reply["proto_classes"][c].tolist() == held[c]
        for s, j in enumerate(held[c]):
            mean = feats[y == j].mean(0)
            torch.testing.assert_close(reply["protos"][c, s].to(F64), mean, rtol=0, atol=1e-6)
            assert (stale[y == j].mean(0) - mean).abs().max() > 1e-4


def _reply(classes: list[int], reps: list[list[float]]) -> dict[str, Tensor]:
    return {
        "proto_classes": torch.tensor(classes, dtype=torch.int32),
        "protos": torch.tensor(reps, dtype=torch.float32),
    }


REPLIES = {
    0: _reply([0, 2], [[1.0, 0.0, 2.0, 0.5], [0.0, 3.0, 0.0, 1.0]]),
    1: _reply([1, -1], [[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),  # a padded slot
}
PAIRS = [(torch.tensor([1.0, 0.0, 2.0, 0.5]), 0), (torch.tensor([0.0, 3.0, 0.0, 1.0]), 2)]
PAIRS.append((torch.tensor([2.0, 1.0, 0.0, 0.0]), 1))


def sgd_on_pairs(w: Tensor, b: Tensor, batches: list[list[int]], lr: float) -> Tensor:
    """theta <- theta - lr * grad mean_{pairs in batch} CE(W R + b, s), batch after batch (the
    gradient by autograd through ``F.cross_entropy``, the server writes it out by hand)."""
    w, b = w.to(F64).clone(), b.to(F64).clone()
    for batch in batches:
        reps = torch.stack([PAIRS[i][0] for i in batch]).to(F64)
        labels = torch.tensor([PAIRS[i][1] for i in batch])
        lw, lb = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        gw, gb = torch.autograd.grad(F.cross_entropy(reps @ lw.T + lb, labels), (lw, lb))
        w, b = w - lr * gw, b - lr * gb
    return torch.cat([w.reshape(-1), b])


def test_server_trains_the_header_with_ce_on_the_uploaded_lars() -> None:
    """Step 4, all pairs in one batch: one SGD step theta - eta * grad mean CE(h(R_k^s), s) over
    the three real pairs (the padded slot is no sample); a wrong sign, label or loss differs."""
    server = make_server(server_lr=0.3, server_epochs=1, server_batch_size=8)
    w0, b0 = server.header.weight.detach().clone(), server.header.bias.detach().clone()
    assert all(server.check_reply(c, r) is None for c, r in REPLIES.items())
    server.aggregate(1, REPLIES)
    expected = sgd_on_pairs(w0, b0, [[0, 1, 2]], 0.3)
    assert (expected - sgd_on_pairs(w0, b0, [], 0.3)).abs().max() > 1e-2
    torch.testing.assert_close(global_header(server), expected, rtol=0, atol=1e-6)
    sent = server.configure_train(2, [0])[0]["header"]
    torch.testing.assert_close(sent.to(F64), expected, rtol=0, atol=1e-6)


def test_one_lar_per_step_is_sequential_sgd_over_the_pairs() -> None:
    """Step 4 with one pair per step (LipingYi/FedGH's schedule): the header equals three
    sequential SGD steps in some order of the pairs, not the single full-batch step."""
    server = make_server(server_lr=0.5, server_epochs=1, server_batch_size=1)
    w0, b0 = server.header.weight.detach().clone(), server.header.bias.detach().clone()
    server.aggregate(1, REPLIES)
    got = global_header(server)
    orders = [sgd_on_pairs(w0, b0, [[i] for i in p], 0.5) for p in itertools.permutations(range(3))]
    assert min(float((got - o).abs().max()) for o in orders) < 1e-6
    assert (got - sgd_on_pairs(w0, b0, [[0, 1, 2]], 0.5)).abs().max() > 1e-3


def _count_server_steps(server: FedGHServer, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Run ``aggregate(1, REPLIES)`` recording the pairs (indices into PAIRS) of every SGD step
    the server takes (by wrapping its step function)."""
    batches: list[list[int]] = []
    rows = {tuple(r.tolist()): i for i, (r, _) in enumerate(PAIRS)}
    step = fedgh.header_step

    def counted(
        header: torch.nn.Linear, reps: Tensor, onehot: Tensor, lr: float, clip: float
    ) -> None:
        batches.append([rows[tuple(r.tolist())] for r in reps.float()])
        labels = [PAIRS[i][1] for i in batches[-1]]
        assert onehot.argmax(1).tolist() == labels  # each LAR keeps its class
        step(header, reps, onehot, lr, clip)

    monkeypatch.setattr(fedgh, "header_step", counted)
    server.aggregate(1, REPLIES)
    return batches


@pytest.mark.parametrize(
    "schedule",
    [
        {"server_epochs": 1, "server_batch_size": 1},
        {"server_epochs": 3, "server_batch_size": 2},
        {"server_epochs": 2, "server_batch_size": 10},
        {},
    ],
)
def test_server_takes_epochs_times_ceil_pairs_over_batch_steps(
    schedule: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 4's schedule: ``server_epochs`` passes, each over every uploaded pair exactly once
    in batches of ``server_batch_size`` (the last one short), so epochs * ceil(M / B) SGD steps
    for the M = 3 real pairs of REPLIES (the padded slot is no pair); ``{}`` is the default
    schedule."""
    hp = FedGHParams(**schedule)
    server = make_server(**schedule)
    batches = _count_server_steps(server, monkeypatch)
    m, b = len(PAIRS), hp.server_batch_size
    per_pass = -(-m // b)  # ceil(M / B), written without math.ceil
    assert len(batches) == hp.server_epochs * per_pass
    for e in range(hp.server_epochs):
        passed = batches[e * per_pass : (e + 1) * per_pass]
        assert sorted(i for batch_rows in passed for i in batch_rows) == list(range(m))
        assert [len(x) for x in passed] == [b] * (m // b) + ([m % b] if m % b else [])


def _evaluated(eval_header: str) -> tuple[ClientGroup, Tensor, Tensor, dict, Tensor, Tensor]:
    """Train both clients one round, let the server train a header the clients have never
    seen, and return what each client is evaluated with (and its accuracy counts)."""
    group, _, server, _, _, _, new_state = fit()
    server.aggregate(1, REPLIES)
    hp = FedGHParams(eval_header=eval_header)
    client = FedGHClient(hp, ClientContext(0, CPU, CLASSES, (D_IN,)))
    server.hp = hp
    payload = server.configure_eval([0])[0]
    msg = {k: v.expand(2, -1) for k, v in payload.items()}
    theta, buffers = client.eval_model(group, msg, new_state)
    ok, _, _ = evaluate_clients(group.fm, theta, buffers, group.data, [0, 1])
    return group, theta, ok, payload, new_state["theta"], global_header(server)


def test_client_is_evaluated_with_its_extractor_and_the_global_header() -> None:
    """Step 4 on the client (``eval_header="global"``, the default): its score is argmax of
    h(f_k(x); theta_global); the locally trained header is discarded."""
    assert FedGHParams().eval_header == "global"
    group, theta, ok, payload, trained, header = _evaluated("global")
    assert set(payload) == {"header"}
    data = group.data
    for c in range(2):
        x, y = data.batch(data.test_idx[c])
        mixed = trained[c].clone()
        mixed[HEAD] = header
        assert (mixed - trained[c]).abs().max() > 1e-2  # the two headers differ
        torch.testing.assert_close(theta[c], mixed, rtol=0, atol=1e-7)
        _, logits = forward(mixed, x)
        assert int(ok[c]) == int((logits.argmax(1) == y).sum())


def test_local_eval_header_scores_the_locally_trained_header() -> None:
    """``eval_header="local"`` (LipingYi/FedGH's test_acc after local training): the client's
    extractor with the header of its own latest local training; nothing crosses for it."""
    group, theta, ok, payload, trained, header = _evaluated("local")
    assert payload == {}
    data = group.data
    for c in range(2):
        x, y = data.batch(data.test_idx[c])
        assert (trained[c][HEAD] - header).abs().max() > 1e-2  # the two headers differ
        torch.testing.assert_close(theta[c], trained[c], rtol=0, atol=1e-7)
        _, logits = forward(trained[c], x)
        assert int(ok[c]) == int((logits.argmax(1) == y).sum())


def test_the_records_say_which_header_was_scored() -> None:
    from hyperfed.algorithms.fedgh import ALGORITHM

    assert ALGORITHM.scored_model(FedGHParams()) == "personalized"
    assert ALGORITHM.scored_model(FedGHParams(eval_header="local")) == "local"
    assert "HtFLlib" in ALGORITHM.reference


def test_clients_must_share_one_representation_width() -> None:
    """The header is one Linear(d, classes): different widths are a ConfigError at join."""
    with pytest.raises(ConfigError, match="one representation size"):
        FedGHServer(FedGHParams(), joins((4, 5)), ServerContext(0, CPU, CLASSES, (D_IN,)))


@pytest.mark.parametrize(
    "bad",
    [{"eval_header": "server"}, {"server_epochs": 0}, {"server_batch_size": 0}, {"server_lr": 0}],
)
def test_bad_hyperparameters_are_a_value_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(bad))}: allowed: "):
        validate_hparams(FedGHParams, bad)


def test_malformed_lar_replies_are_rejected() -> None:
    """Contract 6: counts are not part of FedGH's upload; class ids must exist; finite values."""
    server = make_server()
    good = REPLIES[0]
    assert server.check_reply(0, {**good, "proto_counts": torch.ones(2)}) is not None
    bad_class = {**good, "proto_classes": torch.tensor([0, 3], dtype=torch.int32)}
    assert server.check_reply(0, bad_class) is not None
    nan = {**good, "protos": good["protos"].clone().fill_(float("nan"))}
    assert server.check_reply(0, nan) is not None


def test_the_header_step_clips_its_gradient_norm_as_the_authors_code():
    """One LAR of norm 1e10 (a client whose local training exploded, 000:table2 seed 2): from
    a zero header the gradient is (softmax(0) - e_s) R, norm ~0.95e10 -- unclipped, one step at
    lr 0.01 moves the header by ~1e8; clipped at 50 (LipingYi/FedGH's clip_grad_norm_) by
    exactly lr * 50. A gradient below the clip is the plain SGD step."""
    rep = torch.zeros(1, 4)
    rep[0, 0] = 1e10
    onehot = torch.tensor([[1.0, 0.0, 0.0]])
    err = torch.tensor([[1 / 3 - 1, 1 / 3, 1 / 3]])  # softmax(0) - e_s, n = 1
    full = torch.sqrt((err.T @ rep).square().sum() + err.square().sum())

    def moved(clip: float) -> float:
        header = torch.nn.Linear(4, 3)
        torch.nn.init.zeros_(header.weight)
        torch.nn.init.zeros_(header.bias)
        with torch.no_grad():  # as in the server's aggregate
            fedgh.header_step(header, rep, onehot, 0.01, clip)
        return float(torch.sqrt(header.weight.square().sum() + header.bias.square().sum()))

    assert moved(math.inf) == pytest.approx(0.01 * float(full), rel=1e-4)
    assert moved(50.0) == pytest.approx(0.01 * 50.0, rel=1e-4)
    assert FedGHParams().server_clip == 50.0
    small = torch.tensor([[0.5, -0.2, 0.1, 0.3]])  # gradient norm < 1: the clip does nothing
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        fedgh.header_step(a, small, onehot, 0.01, 50.0)
        fedgh.header_step(b, small, onehot, 0.01, math.inf)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    with pytest.raises(ValueError, match="server_clip: allowed: a number > 0"):
        validate_hparams(FedGHParams, {"server_clip": 0.0})
