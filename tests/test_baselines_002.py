"""pFedES's baselines (seed 002, Tables 2-3): each runs and sends only its documented payload."""

import pytest
import torch

from hyperfed.algorithms.base import ServerContext
from hyperfed.algorithms.fd import FDParams, FDServer
from hyperfed.algorithms.fedproto import FedProtoParams, FedProtoServer
from hyperfed.config import ConfigError, load_config
from hyperfed.engine.losses import class_sums, kd_loss, pack_classes
from hyperfed.models.zoo import build_model
from hyperfed.runtime.simulate import Simulation

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    # on a shared 2-core machine two intra-op threads per process are 10-20x slower
    torch.set_num_threads(1)


def _sim(alg: str, *extra: str) -> Simulation:
    cfg = load_config(
        None,
        [
            f"algorithm.name={alg}",
            "clients.count=4",
            'clients.models=["lenet", "vgg8"]',
            "partition.classes_per_client=2",
            "rounds=2",
            "eval_every=2",
            "local.epochs=1",
            "local.vectorize=off",
            *extra,
        ],
    )
    return Simulation(cfg)


def _run(sim: Simulation) -> tuple[dict, list[dict]]:
    replies_seen: list[dict] = []
    aggregate = sim.server.aggregate

    def spy(rnd, replies):
        replies_seen.extend(replies.values())
        aggregate(rnd, replies)

    sim.server.aggregate = spy  # type: ignore[method-assign]
    return sim.run()[-1], replies_seen


def _held(sim: Simulation, cid: int) -> int:
    return int((torch.bincount(sim.data.y[sim.data.train_idx[cid]]) > 0).sum())


LENET_CLASSIFIER = 64 * 10 + 10  # lenet and vgg8 both end in Linear(64 -> 10)
MLP_PARAMS = sum(p.numel() for p in build_model("mlp", (1, 8, 8), 10).parameters())


@pytest.mark.parametrize(
    "alg,extra,keys",
    [
        ("lg_fedavg", ["algorithm.global_layers=classifier"], {"head"}),
        ("fedproto", [], {"proto_classes", "protos", "proto_counts"}),
        ("fd", [], {"logit_classes", "logits", "logit_counts"}),
        ("fml", ["algorithm.shared_model=mlp"], {"shared"}),
        ("fedkd", ["algorithm.shared_model=mlp"], {"shared"}),
    ],
)
def test_baseline_runs_two_rounds_and_sends_only_its_payload(alg, extra, keys):
    sim = _sim(alg, *extra)
    record, replies = _run(sim)
    assert len(replies) == 2 * 4 and all(set(r) == keys for r in replies)
    assert record["rejected"] == []
    up = record["bytes_up_round"]
    if alg == "lg_fedavg":
        assert up == 4 * LENET_CLASSIFIER * 4
    elif alg in ("fml", "fedkd"):
        assert up == 4 * MLP_PARAMS * 4
    else:  # S held classes: int32 id + d floats + a float count each
        d = 64 if alg == "fedproto" else 10
        held = [_held(sim, c) for c in range(4)]
        # a group pads to its largest client's class count
        groups = {0: [0, 2], 1: [1, 3]}
        expected = sum(len(g) * max(held[c] for c in g) * (d + 2) * 4 for g in groups.values())
        assert up == expected


def test_lg_fedavg_refuses_heads_that_differ_in_size():
    with pytest.raises(ConfigError, match="global_layers"):
        _sim("lg_fedavg")  # lenet's and vgg8's fc layers differ; only the classifier matches


def test_fedproto_refuses_representations_of_different_widths():
    from hyperfed.bench import synthetic_federation

    data = synthetic_federation(2, 20, (1, 28, 28), 10)
    cfg = ["device=cpu", "clients.count=2", "algorithm.name=fedproto"]
    with pytest.raises(ConfigError, match=r"one representation size .*\[64, 500\]"):
        Simulation(load_config(None, [*cfg, 'clients.models=["lenet","cnn1"]']), data=data)


def test_lg_fedavg_client_evaluates_its_body_under_the_global_head():
    sim = _sim("lg_fedavg", "algorithm.global_layers=classifier")
    _run(sim)
    name, cids = "lenet", sim.groups["lenet"]
    group = sim.group(name, cids, rnd=-1)
    msgs = sim.server.configure_eval(cids)
    theta, _ = sim.client.eval_model(
        group, {"head": torch.stack([msgs[c]["head"] for c in cids])}, sim.states(cids)
    )
    mask = sim.models[name].layout.mask(("classifier",))
    assert torch.equal(theta[0, mask], sim.server.head)
    assert torch.equal(theta[0, ~mask], sim.store[cids[0]]["theta"][~mask])


def test_packed_classes_round_trip_and_weighted_prototype_average():
    means = torch.zeros(2, 4, 3)
    counts = torch.tensor([[5.0, 0, 1, 0], [0, 0, 3, 0]])
    means[0, 0], means[0, 2], means[1, 2] = 1.0, 2.0, 6.0
    classes, values, cnt = pack_classes(means, counts)
    assert classes.tolist() == [[0, 2], [2, -1]] and cnt.tolist() == [[5, 1], [3, 0]]
    assert torch.equal(values[1, 1], torch.zeros(3))

    ctx = ServerContext(0, CPU, 4, (1, 8, 8))
    joins = {c: {"num_samples": torch.tensor(9), "feature_dim": torch.tensor(3)} for c in (0, 1)}
    server = FedProtoServer(FedProtoParams(), joins, ctx)
    keys = ("proto_classes", "protos", "proto_counts")
    replies = {i: dict(zip(keys, (classes[i], values[i], cnt[i]))) for i in (0, 1)}
    assert all(server.check_reply(i, r) is None for i, r in replies.items())
    server.aggregate(1, replies)
    assert torch.allclose(server.protos[2], torch.full((3,), (1 * 2.0 + 3 * 6.0) / 4))
    assert torch.allclose(server.protos[0], torch.ones(3))
    assert server.proto_mask.tolist() == [1.0, 0.0, 1.0, 0.0]
    bad = dict(replies[0], proto_classes=torch.tensor([0, 7], dtype=torch.int32))
    assert "outside" in (server.check_reply(0, bad) or "")


def test_fd_targets_leave_the_clients_own_logits_out():
    ctx = ServerContext(0, CPU, 3, (1, 8, 8))
    server = FDServer(FDParams(), {c: {"num_samples": torch.tensor(1)} for c in range(3)}, ctx)
    keys = ("logit_classes", "logits", "logit_counts")
    logits = torch.eye(3)

    def report(cls, vec, n):
        return dict(
            zip(keys, (torch.tensor([cls], dtype=torch.int32), vec[None], torch.tensor([n])))
        )

    server.aggregate(1, {0: report(0, logits[0], 2.0), 1: report(0, logits[1], 1.0)})
    msgs = server.configure_train(2, [0, 1, 2])
    assert torch.allclose(msgs[0]["global_logits"][0], logits[1])  # only client 1's
    assert torch.allclose(msgs[1]["global_logits"][0], logits[0])  # only client 0's
    assert torch.allclose(msgs[2]["global_logits"][0], (2 * logits[0] + logits[1]) / 3)
    assert msgs[2]["global_mask"].tolist() == [1.0, 0.0, 0.0]
    sums, n = class_sums(*(report(0, logits[0], 2.0)[k] for k in keys), 3)
    assert torch.allclose(sums[0], 2 * logits[0]) and n.tolist() == [2.0, 0.0, 0.0]


def test_kd_loss_is_zero_for_equal_logits_and_scales_with_t_squared():
    z = torch.randn(5, 4)
    assert kd_loss(z, z).abs().item() < 1e-6
    s, t = torch.randn(5, 4), torch.randn(5, 4)
    per = kd_loss(s, t, 2.0, reduction="none")
    assert per.shape == (5,) and torch.allclose(per.mean(), kd_loss(s, t, 2.0))
    # without Hinton's factor: the plain KL of the softened distributions, by hand
    p_t, p_s = torch.softmax(t / 2.0, -1), torch.softmax(s / 2.0, -1)
    plain = (p_t * (p_t.log() - p_s.log())).sum(-1).mean()
    assert torch.allclose(kd_loss(s, t, 2.0, scale_t2=False), plain, atol=1e-6)
    assert torch.allclose(kd_loss(s, t, 2.0), 4.0 * plain, atol=1e-6)
