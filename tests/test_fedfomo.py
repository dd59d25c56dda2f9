"""FedFomo (Zhang et al., ICLR 2021) against its federated update and model selection.

Eq. 4: ``w_n = (L_i(theta_i^{t-1}) - L_i(theta_n)) / ||theta_n - theta_i^{t-1}||`` on client
i's validation split; Eq. 5-6: ``theta_i^t = theta_i^{t-1} + sum_n w+_n (theta_n -
theta_i^{t-1})`` with ``w+ = max(w, 0) / sum max(w, 0)`` (no positive weight: theta_i^{t-1});
then local SGD on the train split. As in the authors' code (NVlabs/FedFomo) and PFLlib,
theta_i^{t-1} is where the client's last local training began and its own current (trained)
model is one candidate next to the M downloads (``include_own=False``: the current model is
the reference point, only downloads are candidates). §3.3: the server sends the M models of
highest affinity P_in (epsilon-greedy) and adds the raw w_n to P_in.

Model: z = x W^T + b, ``theta = [W (C x D), b]``; losses and gradients by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.fedfomo import (
    FedFomoClient,
    FedFomoParams,
    FedFomoServer,
    with_validation,
)
from hyperfed.config import validate_hparams
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ZooNet

CPU = torch.device("cpu")
D, C = 3, 3


def _linear() -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(ZooNet(nn.Identity(), (D,), C).double(), "lin")


def _data() -> FederatedData:
    """Two clients, each 4 train and 3 validation samples; train and val labels disagree, so
    a weight computed on the train split would differ."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(14, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 2, 2, 1, 1, 0, 2, 0, 1, 1, 0])
    train = [torch.arange(0, 4), torch.arange(7, 11)]
    val = [torch.arange(4, 7), torch.arange(11, 14)]
    none = torch.zeros(0)
    return FederatedData(x, y, train, val, train, C, (D,), none, none, dtype=torch.float64)


def _group(fm: FunctionalModel, data: FederatedData, lr: float) -> ClientGroup:
    sgd = SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    return ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=sgd, vectorize=False)


def _ce(theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
    w, b = theta[: C * D].view(C, D), theta[C * D :]
    return F.cross_entropy(x @ w.T + b, y)


def _ce_grad(theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
    w, b = theta[: C * D].view(C, D), theta[C * D :]
    g = (torch.softmax(x @ w.T + b, -1) - F.one_hot(y, C).to(x.dtype)) / len(y)
    return torch.cat([(g.T @ x).reshape(-1), g.sum(0)])


def _split(data: FederatedData, c: int, split: str) -> tuple[Tensor, Tensor]:
    idx = (data.val_idx if split == "val" else data.train_idx)[c]
    return data.x[idx], data.y[idx]


def _candidates(fm: FunctionalModel, data: FederatedData) -> tuple[Tensor, Tensor, Tensor]:
    """Per client: its own model, the model its last training started from (``anchor``: a step
    up its val gradient, so its own training lowered the val loss) and 3 downloads -- two that
    lower its validation loss (steps of different lengths down its val gradient plus noise)
    and one that raises it."""
    g = torch.Generator().manual_seed(5)
    own = fm.initial_params() + 0.3 * torch.randn(2, fm.num_params, generator=g).double()
    models, anchors = [], []
    for c in range(2):
        gv = _ce_grad(own[c], *_split(data, c, "val"))
        noise = 0.05 * torch.randn(4, fm.num_params, generator=g).double()
        steps = torch.stack([-2.0 * gv, -5.0 * gv, 4.0 * gv])
        models.append(own[c] + steps + noise[:3])
        anchors.append(own[c] + 1.5 * gv + noise[3])
    return own, torch.stack(anchors), torch.stack(models)


def _client(**hp: object) -> FedFomoClient:
    return FedFomoClient(FedFomoParams(**hp), ClientContext(0, CPU, C, (D,)))  # type: ignore[arg-type]


def _expected_update(base: Tensor, cands: Tensor, x: Tensor, y: Tensor, mask: Tensor) -> tuple:
    """Eq. 4-6 by hand for one client: (raw weights, updated theta) from reference ``base``."""
    w = torch.zeros(cands.shape[0], dtype=torch.float64)
    for n in range(cands.shape[0]):
        if mask[n] > 0:
            gain = _ce(base, x, y) - _ce(cands[n], x, y)
            w[n] = gain / torch.sqrt(((cands[n] - base) ** 2).sum())
    pos = w.clamp(min=0)
    theta = base.clone()
    if pos.sum() > 0:
        for n in range(cands.shape[0]):
            theta = theta + pos[n] / pos.sum() * (cands[n] - base)
    return w, theta


def _state(client: FedFomoClient, fm: FunctionalModel, own: Tensor, anchor: Tensor) -> dict:
    state = client.init_state(fm, 2)
    state["theta"], state["anchor"] = own.clone(), anchor.clone()
    return state


def test_own_model_is_a_weighted_candidate_measured_from_where_training_began() -> None:
    """Default (authors' code): reference theta_i^{t-1} = the anchor, candidates = own model
    + 3 downloads; lr = 0 (no local training) so the kept model is the update itself; the
    raw weights of the 3 downloads go back, the update is the next anchor."""
    fm, data = _linear(), _data()
    own, anchor, models = _candidates(fm, data)
    client = _client()
    state = _state(client, fm, own, anchor)
    mask = torch.ones(2, 3)
    reply, new_state, _ = client.fit(_group(fm, data, 0.0), {"models": models, "mask": mask}, state)
    for c in range(2):
        x, y = _split(data, c, "val")
        cands = torch.cat([own[c][None], models[c]])
        w, theta = _expected_update(anchor[c], cands, x, y, torch.ones(4))
        assert (w[:3] > 0).all() and w[3] < 0  # own and two downloads help, one harms
        assert torch.allclose(reply["weights"][c], w[1:], atol=1e-10)
        assert torch.allclose(new_state["theta"][c], theta, atol=1e-10)
        assert torch.allclose(new_state["anchor"][c], theta, atol=1e-10)
        assert torch.allclose(reply["theta"][c], theta, atol=1e-10)


def test_exclude_own_weights_the_downloads_against_the_current_model() -> None:
    """include_own=False: reference = the current theta_i, candidates = the downloads only;
    the harmful download gets a negative raw weight and no share."""
    fm, data = _linear(), _data()
    own, anchor, models = _candidates(fm, data)
    client = _client(include_own=False)
    state = _state(client, fm, own, anchor)
    mask = torch.ones(2, 3)
    reply, new_state, _ = client.fit(_group(fm, data, 0.0), {"models": models, "mask": mask}, state)
    for c in range(2):
        x, y = _split(data, c, "val")
        w, theta = _expected_update(own[c], models[c], x, y, mask[c])
        assert (w[:2] > 0).all() and w[2] < 0  # the construction gives both signs
        assert torch.allclose(reply["weights"][c], w, atol=1e-10)
        assert torch.allclose(new_state["theta"][c], theta, atol=1e-10)


def test_exclude_own_without_a_helpful_download_leaves_the_model_unchanged() -> None:
    """include_own=False, all w_n <= 0: theta_i^t = theta_i (the harmful model is not mixed
    in)."""
    fm, data = _linear(), _data()
    own, anchor, models = _candidates(fm, data)
    client = _client(include_own=False)
    state = _state(client, fm, own, anchor)
    mask = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])  # only the harmful download
    reply, new_state, _ = client.fit(_group(fm, data, 0.0), {"models": models, "mask": mask}, state)
    assert torch.allclose(new_state["theta"], own, atol=1e-12)
    assert (reply["weights"][:, :2] == 0).all() and (reply["weights"][:, 2] < 0).all()


@pytest.mark.parametrize("fallback", [None, "start"])  # None: the default, "own"
def test_no_candidate_better_than_where_training_began(fallback: str | None) -> None:
    """Own model and the only download both raise the loss over the anchor: all w_n <= 0;
    fallback="own" (PFLlib, default) keeps the current model, "start" (authors' code) returns
    to theta_i^{t-1}, the anchor."""
    fm, data = _linear(), _data()
    own, _, models = _candidates(fm, data)
    client = _client(**({} if fallback is None else {"fallback": fallback}))
    state = _state(client, fm, models[:, 2], own)  # own model: the harmful one; anchor: own
    mask = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    bad = models.clone()
    bad[:, 2] = 2 * models[:, 2] - own  # further up the val gradient than the own model
    reply, new_state, _ = client.fit(_group(fm, data, 0.0), {"models": bad, "mask": mask}, state)
    kept = own if fallback == "start" else models[:, 2]
    assert torch.allclose(new_state["theta"], kept, atol=1e-12)
    assert torch.allclose(new_state["anchor"], kept, atol=1e-12)
    assert (reply["weights"][:, :2] == 0).all() and (reply["weights"][:, 2] < 0).all()


def test_local_training_is_sgd_on_the_train_split_from_the_updated_model() -> None:
    """After the federated update, one full-batch SGD step on the *train* split; the update
    (not the trained model) is kept as the next round's reference point."""
    fm, data = _linear(), _data()
    own, anchor, models = _candidates(fm, data)
    client = _client()
    state = _state(client, fm, own, anchor)
    mask = torch.ones(2, 3)
    lr = 0.3
    reply, new_state, _ = client.fit(_group(fm, data, lr), {"models": models, "mask": mask}, state)
    for c in range(2):
        cands = torch.cat([own[c][None], models[c]])
        _, theta = _expected_update(anchor[c], cands, *_split(data, c, "val"), torch.ones(4))
        expected = theta - lr * _ce_grad(theta, *_split(data, c, "train"))
        assert torch.allclose(reply["theta"][c], expected, atol=1e-10)
        assert torch.allclose(new_state["theta"][c], expected, atol=1e-10)
        assert torch.allclose(new_state["anchor"][c], theta, atol=1e-10)


# Hand example: one class-0 validation sample at x = 0, so the loss of theta = [W (2 x 1), b]
# is softplus(b1 - b0) -- set by b alone -- while W moves the distance.
ANCHOR = [0.0, 0.0, 0.0, 0.0]  # L = log 2
OWN = [0.0, 0.0, 1.0, 0.0]  # L = softplus(-1) = 0.3133, distance 1
BARELY = [0.3, 0.0, 1.1, 0.0]  # L = softplus(-1.1) = 0.2873: barely better than OWN
HARMFUL = [0.0, 0.4, -1.0, 0.0]  # L = softplus(1) = 1.3133


def _hand_fit(include_own: bool) -> Tensor:
    torch.manual_seed(0)
    fm = FunctionalModel(ZooNet(nn.Identity(), (1,), 2).double(), "lin1")
    x = torch.zeros(2, 1, dtype=torch.float64)
    y = torch.tensor([0, 1])
    train, val = [torch.tensor([1])], [torch.tensor([0])]
    none = torch.zeros(0)
    data = FederatedData(x, y, train, val, train, 2, (1,), none, none, dtype=torch.float64)
    sgd = SGDConfig(lr=0.0, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    group = ClientGroup(fm, [0], data, rnd=1, seed=0, sgd=sgd, vectorize=False)
    client = FedFomoClient(FedFomoParams(include_own=include_own), ClientContext(0, CPU, 2, (1,)))
    state = client.init_state(fm, 1)
    state["theta"] = torch.tensor([OWN], dtype=torch.float64)
    state["anchor"] = torch.tensor([ANCHOR], dtype=torch.float64)
    msg = {"models": torch.tensor([[BARELY, HARMFUL]], dtype=torch.float64),
           "mask": torch.ones(1, 2)}  # fmt: skip
    _, new_state, _ = client.fit(group, msg, state)
    return new_state["theta"][0]


def _loss(theta: list[float]) -> float:
    return math.log1p(math.exp(theta[3] - theta[2]))


def test_hand_example_own_and_two_downloads_weights_and_update() -> None:
    """Python floats: w_n = (L(anchor) - L(theta_n)) / ||theta_n - anchor||, negative ones
    dropped, normalized; theta = anchor + sum_n w_n (theta_n - anchor)."""
    assert abs(_loss(ANCHOR) - math.log(2)) < 1e-15
    raw = [(_loss(ANCHOR) - _loss(m)) / math.dist(m, ANCHOR) for m in (OWN, BARELY, HARMFUL)]
    assert abs(raw[0] - 0.379885) < 1e-6 and abs(raw[1] - 0.355921) < 1e-6 and raw[2] < 0
    share = [max(r, 0.0) / (max(raw[0], 0.0) + max(raw[1], 0.0)) for r in raw]
    expected = [
        a + sum(s * (m[k] - a) for s, m in zip(share, (OWN, BARELY, HARMFUL), strict=True))
        for k, a in enumerate(ANCHOR)
    ]
    got = _hand_fit(include_own=True)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12)


def test_a_download_barely_better_on_validation_no_longer_replaces_the_model() -> None:
    """BARELY beats the own model by 0.026 in validation loss. Excluding the own model, it
    gets weight 1 and replaces it; with the own model a candidate (default), the own model
    keeps about half the share (0.516 by hand), so the result is far from BARELY."""
    assert _loss(BARELY) < _loss(OWN) < _loss(ANCHOR) and _loss(OWN) - _loss(BARELY) < 0.03
    replaced = _hand_fit(include_own=False)
    assert torch.allclose(replaced, torch.tensor(BARELY, dtype=torch.float64), atol=1e-12)
    mixed = _hand_fit(include_own=True)
    gap = math.dist(OWN, BARELY)
    assert float((mixed - torch.tensor(BARELY, dtype=torch.float64)).norm()) > 0.4 * gap
    assert float((mixed - torch.tensor(OWN, dtype=torch.float64)).norm()) > 0.4 * gap


def test_without_a_val_split_a_fixed_share_of_train_is_held_out() -> None:
    """No partition.val_fraction: validation = a fixed 20% of train, disjoint from what is
    trained on, the same every round; a client with a val split keeps it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (30,), generator=g)
    train = [torch.arange(0, 20), torch.arange(20, 27)]
    val = [torch.zeros(0, dtype=torch.long), torch.arange(27, 30)]
    none = torch.zeros(0)
    data = FederatedData(x, y, train, val, train, C, (D,), none, none, dtype=torch.float64)
    out = with_validation(data, [0, 1], 0.2, seed=4)
    assert out.val_idx[0].numel() == 4 and out.train_idx[0].numel() == 16
    both = torch.cat([out.val_idx[0], out.train_idx[0]]).sort().values
    assert torch.equal(both, train[0])
    assert torch.equal(out.train_idx[1], train[1]) and torch.equal(out.val_idx[1], val[1])
    again = with_validation(data, [0], 0.2, seed=4)
    assert torch.equal(again.val_idx[0], out.val_idx[0])


def test_bad_include_own_or_fallback_is_rejected() -> None:
    with pytest.raises(ValueError, match="include_own: Input should be a valid boolean"):
        validate_hparams(FedFomoParams, {"include_own": "yes"})
    with pytest.raises(ValueError, match="fallback: allowed: one of own, start"):
        validate_hparams(FedFomoParams, {"fallback": "anchor"})


def _server(n: int, **hp: float) -> FedFomoServer:
    fm = _linear()
    joins = {c: {"num_params": torch.tensor(fm.num_params), "num_samples": torch.tensor(4)}
             for c in range(n)}  # fmt: skip
    return FedFomoServer(FedFomoParams(**hp), joins, ServerContext(0, CPU, C, (D,), {"lin": fm}))  # type: ignore[arg-type]


def test_greedy_selection_takes_the_m_highest_affinities_of_uploaded_others() -> None:
    """epsilon = 0: the M clients of highest P_in, never i itself nor a client that has not
    uploaded yet; the payload carries exactly their stored models."""
    server = _server(6, num_models=2, epsilon=0.0)
    K = server.size
    server.models = torch.arange(6, dtype=torch.float32)[:, None].expand(6, K).clone()
    server.uploaded[:] = torch.tensor([True, True, True, True, False, True])
    server.affinity[0] = torch.tensor([9.0, 1.0, 3.0, -2.0, 8.0, 2.0])  # 0: self, 4: not ready
    msg = server.configure_train(1, [0])[0]
    assert torch.equal(msg["mask"], torch.ones(2))
    assert torch.equal(msg["models"][:, 0], torch.tensor([2.0, 5.0]))  # P = 3, then P = 2


def test_exploration_decays_by_epsilon_decay_per_round() -> None:
    """eps_t = max(0, eps - (t-1) decay): eps = 1 at round 1 explores (random picks among
    the ready ones), the same server at round 2 (eps 0) is greedy."""
    server = _server(8, num_models=3, epsilon=1.0, epsilon_decay=1.0)
    server.uploaded[:] = True
    server.affinity[0] = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7])
    greedy = [7, 6, 5]
    explored = []
    for seed in range(5):  # round 1 under different run seeds
        server.ctx.seed = seed
        explored.append(server.select(1, 0))
    assert any(sorted(p) != sorted(greedy) for p in explored)
    assert all(0 not in p and len(set(p)) == 3 for p in explored)
    assert server.select(2, 0) == greedy


def test_server_stores_uploads_and_adds_raw_weights_to_affinity() -> None:
    """aggregate: models[i] <- theta_i; P_in += w_n for the n that were sent to i."""
    server = _server(4, num_models=2, epsilon=0.0)
    K = server.size
    server.uploaded[:] = torch.tensor([False, True, True, True])
    server.affinity[0] = torch.tensor([0.0, 5.0, 4.0, 1.0])
    server.configure_train(1, [0])  # sends clients 1 and 2
    theta = torch.full((K,), 0.5)
    server.aggregate(1, {0: {"theta": theta, "weights": torch.tensor([0.25, -1.0])}})
    assert torch.equal(server.models[0], theta) and bool(server.uploaded[0])
    assert torch.allclose(server.affinity[0], torch.tensor([0.0, 5.25, 3.0, 1.0]))


def test_clients_are_evaluated_with_their_own_updated_model() -> None:
    """The personalized model is theta_i (kept by the client), not any downloaded model."""
    fm, data = _linear(), _data()
    own, anchor, models = _candidates(fm, data)
    client = _client()
    state = _state(client, fm, own, anchor)
    reply, state, _ = client.fit(
        _group(fm, data, 0.1), {"models": models, "mask": torch.ones(2, 3)}, state
    )
    theta, _ = client.eval_model(_group(fm, data, 0.1), {}, state)
    assert torch.equal(theta, reply["theta"])


def test_without_a_val_split_local_training_skips_the_held_out_samples() -> None:
    """The held-out validation samples are not trained on: one full-batch step on the other
    4 of the client's 5 training samples."""
    fm = _linear()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(10, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 0, 2, 2, 1, 0, 0])
    train = [torch.arange(0, 5), torch.arange(5, 10)]
    empty = [torch.zeros(0, dtype=torch.long)] * 2
    none = torch.zeros(0)
    data = FederatedData(x, y, train, empty, train, C, (D,), none, none, dtype=torch.float64)
    client = _client(val_holdout=0.2)
    state = client.init_state(fm, 2)
    lr = 0.5
    group = _group(fm, data, lr)
    reply, _, _ = client.fit(group, {"models": torch.zeros(2, 0, fm.num_params),
                                     "mask": torch.zeros(2, 0)}, state)  # fmt: skip
    kept = with_validation(data, [0, 1], 0.2, seed=group.seed).train_idx
    for c in range(2):
        assert kept[c].numel() == 4
        theta0 = fm.initial_params()
        expected = theta0 - lr * _ce_grad(theta0, x[kept[c]], y[kept[c]])
        assert torch.allclose(reply["theta"][c], expected, atol=1e-10)
