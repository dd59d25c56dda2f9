"""PeFLL (Scott et al., ICLR 2024): defining properties on hand-sized float64 examples.

The client's descriptor is ``v_i = mean_b phi(x_b, y_b)`` over a batch of its data; the server
generates ``theta_i = h(v_i)``; the client returns ``Delta theta_i``; the server
back-propagates ``-Delta theta_i`` through h (mean over the round's clients) and sends the
descriptor gradient ``g_i = (d theta_i / d v_i)^T (-Delta theta_i)`` back; the client returns
``(d v_i / d phi)^T g_i`` and the server steps h and phi together. One exchange per round here:
theta_i comes from the descriptor of the client's previous participation, g_i travels with the
next message (module docstring). Embedding network here: phi = Linear(4, 2) on [x | onehot(y)].
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import (
    EVAL_REQUEST,
    ClientContext,
    ClientGroup,
    ServerContext,
    stack_payloads,
)
from hyperfed.algorithms.pefll import PeFLLClient, PeFLLParams, PeFLLServer, embedding_net
from hyperfed.engine.local import SGDConfig
from hyperfed.errors import ConfigError
from hyperfed.models.layout import FunctionalModel

CPU = torch.device("cpu")
D = 2  # descriptor size
HP = PeFLLParams(hn_lr=0.05, embed_dim=D, hidden=3, n_hidden=1, embed_model="mlp", embed_batch=3)
X = torch.tensor(
    [[1.0, -1.0], [0.5, 2.0], [-1.5, 0.3], [0.2, 0.1], [2.0, 1.0], [-0.3, -0.8]],
    dtype=torch.float64,
)
Y = torch.tensor([0, 1, 1, 0, 1, 0])
IDX = [torch.arange(0, 3), torch.arange(3, 6)]


def _phi_fm() -> FunctionalModel:
    torch.manual_seed(11)
    return FunctionalModel(nn.Linear(4, D).double(), "lin")


def _server(n: int = 2, hp: PeFLLParams = HP, rounds: int = 5) -> PeFLLServer:
    fm = tiny_mlp(2, 2, 2)
    joins = {c: {"num_params": torch.tensor(12), "num_samples": torch.tensor(3)} for c in range(n)}
    server = PeFLLServer(hp, joins, ServerContext(0, CPU, 2, (2,), {"tiny": fm}, rounds))
    server.hnet.double()
    server.phi = _phi_fm().initial_params().clone().requires_grad_(True)  # tiny phi
    hn = [*server.hnet.extractor.parameters(), *server.hnet.heads.parameters()]
    server.opt = torch.optim.SGD([*hn, server.phi], lr=hp.hn_lr)  # exact, linear steps
    g = torch.Generator().manual_seed(2)
    server.descriptors = torch.randn(n, D, generator=g, dtype=torch.float64)
    server.pending = torch.zeros(n, D, dtype=torch.float64)
    return server


def _client(hp: PeFLLParams = HP) -> PeFLLClient:
    client = PeFLLClient(hp, ClientContext(0, CPU, 2, (2,)))
    client._embed = {4 * D + D: _phi_fm()}
    return client


def _group(ids: list[int], rnd: int = 1) -> ClientGroup:
    data = toy_federation(X, Y, IDX, 2)
    sgd = SGDConfig(lr=0.3, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=3)
    return ClientGroup(tiny_mlp(2, 2, 2), ids, data, rnd=rnd, seed=0, sgd=sgd, vectorize=False)


def hand_descriptor(phi: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """v = 1/|B| sum_b W [x_b | onehot(y_b)] + b."""
    w, b = phi[: 4 * D].view(D, 4), phi[4 * D :]
    inp = torch.cat([X[idx], F.one_hot(Y[idx], 2).double()], 1)
    return (inp @ w.T + b).mean(0)


def _params(server: PeFLLServer) -> dict[str, torch.Tensor]:
    p = {n: t.detach().clone() for n, t in server.hnet.named_parameters() if "embeddings" not in n}
    return {**p, "phi": server.phi.detach().clone()}


def hand_h(p: dict[str, torch.Tensor], v: torch.Tensor) -> torch.Tensor:
    """theta = W_out relu(W2 relu... (W1 v + b1)) + b_out (h's MLP and output layer of K)."""
    h = torch.relu(v @ p["extractor.0.weight"].T + p["extractor.0.bias"])
    h = h @ p["extractor.2.weight"].T + p["extractor.2.bias"]
    key = next(k for k in p if k.startswith("heads.") and k.endswith(".weight"))
    return h @ p[key][0] + p[key.replace("weight", "bias")][0]


def test_descriptor_is_mean_of_embedding_over_a_batch_of_labelled_samples():
    client, group = _client(), _group([0, 1])
    phi = _phi_fm().initial_params()
    idx = client.descriptor_batch(group, salt=7)
    assert sorted(idx[0].tolist()) == [0, 1, 2] and sorted(idx[1].tolist()) == [3, 4, 5]
    v = client.descriptors(group, torch.stack([phi, phi]), idx)
    for c in (0, 1):
        assert torch.allclose(v[c], hand_descriptor(phi, idx[c]), rtol=0, atol=1e-12)
    assert not torch.allclose(v[0], v[1])  # the label channels set clients apart


def test_model_is_hypernetwork_of_the_descriptor():
    """theta_i = h(v_i); with eval_descriptor="last_sent" (the old reading, an option) the
    evaluated model is h of the descriptor the client sent last, and no request is made."""
    server = _server(hp=PeFLLParams(**{**HP.__dict__, "eval_descriptor": "last_sent"}))
    p = _params(server)
    msgs = server.configure_train(1, [0, 1])
    assert server.configure_eval_request([0, 1]) == {}
    for c in (0, 1):
        expected = hand_h(p, server.descriptors[c])
        assert torch.allclose(msgs[c]["theta"], expected, rtol=0, atol=1e-12)
        assert torch.equal(msgs[c]["phi"], server.phi.detach())
        assert torch.equal(server.configure_eval([c])[c]["theta"], msgs[c]["theta"])
    assert set(msgs[0]) == {"theta", "phi", "gv", "train"}


def authors_h(p: dict[str, torch.Tensor], v: torch.Tensor, n_hidden: int) -> torch.Tensor:
    """The authors' CNNHyper (models.py): mlp = Linear(d, hid), then n_hidden x (ReLU,
    Linear(hid, hid)); each output tensor a Linear(hid, size) of the mlp's features (here all
    of them as one Linear of K). Module i of the mlp is ``extractor.<2 i>``."""
    h = v @ p["extractor.0.weight"].T + p["extractor.0.bias"]
    for i in range(1, n_hidden + 1):
        h = torch.relu(h) @ p[f"extractor.{2 * i}.weight"].T + p[f"extractor.{2 * i}.bias"]
    key = next(k for k in p if k.startswith("heads.") and k.endswith(".weight"))
    return h @ p[key][0] + p[key.replace("weight", "bias")][0]


@pytest.mark.parametrize("n_hidden", [0, 1, 3])
def test_hypernetwork_depth_is_the_authors_hyper_nhid(n_hidden):
    """--hyper-nhid n builds 1 + n Linear layers before the output layer: Linear(d, hidden)
    and n x Linear(hidden, hidden), with a ReLU before each hidden one (none after the last);
    the default is the authors' n = 3, i.e. 4 Linear layers (the earlier n_layers=3 gave 3)."""
    assert PeFLLParams().n_hidden == 3
    hidden = 4
    hp = PeFLLParams(**{**HP.__dict__, "hidden": hidden, "n_hidden": n_hidden})
    server = _server(hp=hp)
    linears = [m for m in server.hnet.extractor if isinstance(m, nn.Linear)]
    shapes = [tuple(m.weight.shape) for m in linears]
    assert shapes == [(hidden, D)] + [(hidden, hidden)] * n_hidden
    assert [type(m) for m in server.hnet.extractor] == [nn.Linear] + [nn.ReLU, nn.Linear] * n_hidden
    (head,) = server.hnet.heads.values()
    assert tuple(head.weight.shape) == (1, hidden, 12)  # output: hidden -> K
    p = _params(server)
    v = torch.tensor([[0.3, -1.2], [2.0, 0.5]], dtype=torch.float64)
    expected = torch.stack([authors_h(p, v[i], n_hidden) for i in range(2)])
    assert torch.allclose(server.generate(v), expected, rtol=0, atol=1e-12)


def _eval_exchange(
    server: PeFLLServer, client: PeFLLClient, state: dict[str, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """What the round driver does before scoring: request -> Client.setup at EVAL_REQUEST ->
    aggregate_setup -> configure_eval. Returns each client's evaluated theta."""
    ids = [0, 1]
    req = server.configure_eval_request(ids)
    assert set(req) == set(ids) and all(set(m) == {"phi"} for m in req.values())
    replies, new_state, _ = client.setup(
        EVAL_REQUEST, _group(ids, rnd=-1), stack_payloads([req[c] for c in ids]), state
    )
    assert new_state is state  # evaluation leaves the client's state as it was
    assert all(server.check_setup_reply(EVAL_REQUEST, c, r) is None for c, r in zip(ids, replies))
    server.aggregate_setup(EVAL_REQUEST, dict(zip(ids, replies)))
    msgs = server.configure_eval(ids)
    return {c: msgs[c]["theta"] for c in ids}


def test_evaluation_descriptor_is_current_phi_over_the_whole_train_split():
    """The authors' evaluate(): v_i = mean over client i's train split of phi(x, y) with the
    CURRENT phi, theta_i = h(v_i). Phi changed after the clients' last participation changes
    the evaluated model accordingly; the training state (the descriptors and g_i the next
    rounds use, the clients' state) is left as it was."""
    hp = PeFLLParams(**{**HP.__dict__, "embed_batch": 2})  # a training batch < the split (3)
    server, client = _server(hp=hp), _client(hp)
    state = client.init_state(tiny_mlp(2, 2, 2), 2)
    stale, pending = server.descriptors.clone(), server.pending.clone()
    p = _params(server)
    thetas = _eval_exchange(server, client, state)
    for c in (0, 1):
        v = hand_descriptor(p["phi"], IDX[c])  # all 3 train samples of client c
        assert torch.allclose(thetas[c], hand_h(p, v), rtol=0, atol=1e-12)
        assert not torch.allclose(thetas[c], hand_h(p, stale[c]))
        # not a one-batch descriptor either: no 2 of the 3 samples give this model
        for pair in ([0, 1], [0, 2], [1, 2]):
            one_batch = hand_descriptor(p["phi"], IDX[c][pair])
            assert not torch.allclose(thetas[c], hand_h(p, one_batch))
    # phi moves (a round the clients did not take part in): the evaluated model follows it
    with torch.no_grad():
        server.phi.add_(torch.linspace(-0.4, 0.5, server.phi.numel(), dtype=torch.float64))
    p2 = _params(server)
    moved = _eval_exchange(server, client, state)
    for c in (0, 1):
        v = hand_descriptor(p2["phi"], IDX[c])
        assert torch.allclose(moved[c], hand_h(p2, v), rtol=0, atol=1e-12)
        assert not torch.allclose(moved[c], thetas[c])
    assert torch.equal(server.descriptors, stale) and torch.equal(server.pending, pending)
    assert server.fresh == {}  # used once: the next evaluation asks again


def test_a_client_that_misses_the_evaluation_request_is_not_evaluated():
    server = _server()
    server.configure_eval_request([0, 1])
    server.aggregate_setup(EVAL_REQUEST, {1: {"v": torch.ones(D, dtype=torch.float64)}})
    msgs = server.configure_eval([0, 1])
    assert set(msgs) == {1}  # client 0: eval_missing, not scored with a stale descriptor
    assert torch.allclose(msgs[1]["theta"], hand_h(_params(server), torch.ones(D).double()))


def test_round_driver_evaluates_with_descriptors_from_the_current_phi(small_sim):
    """Through the simulator's round driver: after training (participation 0.5), phi is
    changed; every client is then scored with h(mean over its train split of phi(x, y)), the
    embedding network run here as a plain module with phi loaded into it."""
    sim = small_sim("pefll", "mlp", "rounds=1", "participation=0.5")
    sim.run()
    server = sim.server
    with torch.no_grad():
        server.phi.mul_(1.5)
    seen: dict[int, torch.Tensor] = {}
    configure = server.configure_eval

    def spy(ids: list[int]) -> dict:
        msgs = configure(ids)
        seen.update({c: m["theta"] for c, m in msgs.items()})
        return msgs

    server.configure_eval = spy  # type: ignore[method-assign]
    sim.evaluate()
    data = sim.data
    module = embedding_net("lenet", data.input_shape, data.num_classes, server.dim).double()
    torch.nn.utils.vector_to_parameters(server.phi.detach().double(), module.parameters())
    assert sorted(seen) == list(range(4))
    for c in range(4):
        x, y = data.batch(data.train_idx[c])
        onehot = F.one_hot(y, data.num_classes).double()
        if x.dim() == 4:
            onehot = onehot[:, :, None, None].expand(-1, -1, *x.shape[2:])
        v = module(torch.cat([x.double(), onehot], 1)).mean(0)
        expected = server.generate(v[None].to(server.descriptors.dtype))[0]
        assert torch.allclose(seen[c], expected, rtol=1e-4, atol=1e-5), c


def test_server_step_is_joint_on_h_and_phi_and_keeps_descriptor_gradients():
    """h <- h - lr * mean_i (d theta_i/d h)^T (-Delta theta_i); phi <- phi - lr * mean_i of the
    clients' phi gradients; g_i = (d theta_i / d v_i)^T (-Delta theta_i) is kept for client i's
    next message; the new descriptors replace the old."""
    server = _server()
    p0, v0 = _params(server), server.descriptors.clone()
    g = torch.Generator().manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    replies = {c: {"delta": 0.2 * rnd(12), "v": rnd(D), "phi_grad": rnd(4 * D + D)} for c in (0, 1)}
    server.aggregate(1, replies)
    leaves = {n: t.clone().requires_grad_(True) for n, t in p0.items() if n != "phi"}
    vs = v0.clone().requires_grad_(True)
    surrogate = sum((hand_h(leaves, vs[c]) * -replies[c]["delta"]).sum() for c in (0, 1))
    grads = torch.autograd.grad(surrogate, [*leaves.values(), vs])
    after = _params(server)
    for (name, before), gr in zip(leaves.items(), grads[:-1]):
        assert torch.allclose(after[name], before - HP.hn_lr * gr / 2, rtol=0, atol=1e-12), name
    phi_grad = (replies[0]["phi_grad"] + replies[1]["phi_grad"]) / 2
    assert torch.allclose(after["phi"], p0["phi"] - HP.hn_lr * phi_grad, rtol=0, atol=1e-12)
    assert torch.allclose(server.pending, grads[-1], rtol=0, atol=1e-12)
    assert torch.equal(server.descriptors, torch.stack([replies[0]["v"], replies[1]["v"]]))
    nxt = server.configure_train(2, [1])[1]
    assert torch.equal(nxt["gv"], server.pending[1])


def test_client_backpropagates_descriptor_gradient_through_phi_of_that_descriptor():
    """phi_grad = (d v / d phi)^T g at the phi and batch that produced the descriptor the
    server used (kept from two participations: used / sent); the reply's new descriptor uses
    the phi just received; the update is theta~ - theta."""
    client, group = _client(), _group([0])
    phi_old = _phi_fm().initial_params()
    phi_mid = phi_old + 0.1
    phi_new = phi_old - 0.2
    state = client.init_state(tiny_mlp(2, 2, 2), 1)
    used, sent = torch.tensor([[2, 0, 1]]), torch.tensor([[1, 1, 0]])
    state.update(phi_used=phi_old[None], idx_used=used, phi_sent=phi_mid[None], idx_sent=sent)
    theta = torch.randn(1, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gv = torch.tensor([[0.7, -1.3]], dtype=torch.float64)
    msg = {"theta": theta, "phi": phi_new[None], "gv": gv, "train": torch.ones(1)}
    reply, new_state, _ = client.fit(group, msg, state)
    inp = torch.cat([X[used[0]], F.one_hot(Y[used[0]], 2).double()], 1).mean(0)
    expected = torch.cat([torch.outer(gv[0], inp).reshape(-1), gv[0]])  # d(W m + b)/d(W, b)
    assert torch.allclose(reply["phi_grad"][0], expected, rtol=0, atol=1e-12)
    idx = new_state["idx_sent"][0]
    assert torch.allclose(reply["v"][0], hand_descriptor(phi_new, idx), rtol=0, atol=1e-12)
    assert torch.equal(new_state["phi_used"], phi_mid[None]) and torch.equal(
        new_state["idx_used"], sent
    )
    assert torch.equal(new_state["phi_sent"], phi_new[None])
    assert not torch.allclose(reply["delta"], torch.zeros_like(reply["delta"]))  # trained


def test_new_clients_get_a_model_from_their_descriptor_without_any_learning():
    """new_clients: held out of training; in the adaptation rounds only they take part, h and
    phi do not move, they do no local training, and their model is h(their new descriptor)."""
    hp = PeFLLParams(**{**HP.__dict__, "new_clients": 0.5, "adapt_rounds": 1})
    server = _server(n=2, hp=hp, rounds=3)
    assert server.eligible_clients(2) == [0] and server.eligible_clients(3) == [1]
    assert server.eval_groups() == {"old": [0], "new": [1]}
    p0 = _params(server)
    msg = server.configure_train(3, [1])[1]
    assert float(msg["train"]) == 0.0
    client, group = _client(), _group([1], rnd=3)
    state = client.init_state(tiny_mlp(2, 2, 2), 1)
    state.update(phi_used=torch.zeros(1, 10, dtype=torch.float64), phi_sent=msg["phi"][None])
    stacked = {k: v[None] for k, v in msg.items()}
    reply, _, _ = client.fit(group, stacked, state)
    assert torch.equal(reply["delta"], torch.zeros_like(reply["delta"]))
    # even a non-zero update would not move h or phi in an adaptation round
    sent = {k: v[0] for k, v in reply.items()}
    sent.update(
        delta=torch.ones(12, dtype=torch.float64), phi_grad=torch.ones(10, dtype=torch.float64)
    )
    server.pending[1] = 0.0
    server.aggregate(3, {1: sent})
    assert torch.equal(server.pending[1], torch.zeros(D, dtype=torch.float64))
    after = _params(server)
    assert all(torch.equal(after[n], p0[n]) for n in p0)
    server.hp = PeFLLParams(**{**hp.__dict__, "eval_descriptor": "last_sent"})
    theta = server.configure_eval([1])[1]["theta"]
    assert torch.allclose(theta, hand_h(p0, reply["v"][0]), rtol=0, atol=1e-12)


def test_heterogeneous_clients_are_refused(small_sim):
    with pytest.raises(ConfigError, match="pefll needs one architecture"):
        small_sim("pefll", ["lenet", "mlp"])


@pytest.mark.parametrize("standardize", [True, False])
def test_h_reads_the_descriptor_standardized_by_the_first_ones_mean_and_std(standardize):
    """Authors' code: h(( v - m) / s), m and s the mean and (unbiased) std of the entries of the
    first descriptor received, fixed for the run; ``standardize=False``: h(v)."""
    hp = PeFLLParams(**{**HP.__dict__, "eval_descriptor": "last_sent", "standardize": standardize})
    server = _server(hp=hp)
    v0 = torch.tensor([0.5, 2.0], dtype=torch.float64)
    v1 = torch.tensor([-1.0, 0.25], dtype=torch.float64)
    server.aggregate_setup(0, {1: {"v": v1}, 0: {"v": v0}})  # client 0's is the first (lowest id)
    server.aggregate_setup(0, {0: {"v": v1 * 3}, 1: {"v": v1}})  # later: m, s stay
    m = (0.5 + 2.0) / 2
    s = (((0.5 - m) ** 2 + (2.0 - m) ** 2) / (2 - 1)) ** 0.5  # unbiased, two entries
    p = _params(server)
    msgs = server.configure_train(1, [0, 1])
    for c, v in ((0, v1 * 3), (1, v1)):
        read = (v - m) / s if standardize else v
        assert torch.allclose(msgs[c]["theta"], hand_h(p, read), rtol=0, atol=1e-12)
