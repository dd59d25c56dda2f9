"""Seed 000's remaining table settings (issue 20 item 3): Table 10's head sharing among
equal-size models, Tables 13-14's heterogeneous layer modes, Table 15's share of clients that
deploy the global model, and the configs of every new table setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mh_pfedhn import (
    TINY,
    X,
    Y,
    _assert_params,
    _client,
    _linear_fm,
    _logits,
    _params,
    _sim,
    _theta_fn,
    _tiny_server,
    hand_grad,
    hand_theta,
    sgd_expected,
)
from torch import nn

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.mh_pfedhn import (
    GLOBAL,
    MHPFedHNClient,
    MHPFedHNGDParams,
    MHPFedHNGParams,
    MHPFedHNParams,
    MHPFedHNServer,
    deploying_clients,
)
from hyperfed.config import load_config
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig
from hyperfed.errors import ConfigError
from hyperfed.hypernet.multihead import MultiHeadHypernet
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.select import select_names
from hyperfed.models.zoo import build_model, param_count
from hyperfed.runtime.simulate import Simulation

CONFIGS = Path(__file__).parents[1] / "configs" / "seed000"
NEW = sorted(CONFIGS.glob("table1[0345]_*.toml"))
SHAPES = {"cifar100": ((3, 32, 32), 100), "fashion_mnist": ((1, 28, 28), 10)}


# == Table 10: heads shared among equal-size models ==========================================
@pytest.mark.parametrize(("shape", "classes"), list(SHAPES.values()))
def test_lenet_size_variants_have_lenets_count_but_other_layers(shape, classes):
    """App. C.5: VGGNet and MLP 'adjusted to match the number of parameters in the LeNet model'
    -- within a parameter here (two integer widths cannot always hit it), so that at the
    paper's N = 3072 all three get the same tau = ceil(K / N) and so one head; the layers
    (names and shapes) stay those of VGG8 / the MLP."""
    lenet = build_model("lenet", shape, classes)
    target = param_count(lenet)
    for name, base in (("vgg8_lenet_size", "vgg8"), ("mlp_lenet_size", "mlp")):
        model = build_model(name, shape, classes)
        assert abs(param_count(model) - target) <= 1, name
        assert -(-param_count(model) // 3072) == -(-target // 3072)
        layers = [n for n, _ in model.named_parameters()]
        assert layers == [n for n, _ in build_model(base, shape, classes).named_parameters()]
        assert layers != [n for n, _ in lenet.named_parameters()] or name == "vgg8_lenet_size"
        convs = [p.shape for n, p in model.named_parameters() if p.dim() == 4]
        base_convs = [p.shape for n, p in build_model(base, shape, classes).named_parameters()]
        assert convs == [s for s in base_convs if len(s) == 4]  # the convs are VGG8's own


def test_heads_per_size_share_one_head_per_architecture_separates_equal_sizes():
    """Table 10: three clients of equal size K = 15 (tau = 3 at N = 5), clients 0 and 2 of one
    architecture, client 1 of another. Green (per_size): one head; its gradient is the sum of
    both architectures' contributions. Red (per_architecture): clients 0 and 2 share a head,
    client 1 has its own, each theta from its head (Eq. 3 by hand)."""
    sizes = {0: 15, 1: 15, 2: 15}
    arch = {0: "A", 1: "B", 2: "A"}
    g = {c: torch.linspace(-1, 1, 15, dtype=torch.float64) * (c + 1) for c in sizes}
    shared = MultiHeadHypernet(sizes, **TINY).double()
    assert len(shared.heads) == 1 and len({shared.key[c] for c in sizes}) == 1
    key = shared.key[0]

    def head_grad(hn: MultiHeadHypernet, clients: list[int], key: str) -> torch.Tensor:
        leaves = {n: t.clone().requires_grad_(True) for n, t in _params(hn).items()}
        out = sum((hand_theta(leaves, str(c), hn.key[c], 15, 5) * g[c]).sum() for c in clients)
        return torch.autograd.grad(out, leaves[f"heads.{key}.weight"])[0]

    shared.backward({0: g[0], 1: g[1]})  # one client of each architecture
    both = head_grad(shared, [0, 1], key)
    only_a = head_grad(shared, [0], key)
    assert torch.allclose(shared.heads[key].weight.grad, both, atol=1e-12)
    assert not torch.allclose(both, only_a)  # client 1's gradient reaches the shared head too

    torch.manual_seed(0)
    separate = MultiHeadHypernet(sizes, **TINY, heads="per_architecture", arch=arch).double()
    ka, kb = separate.key[0], separate.key[1]
    assert separate.key[2] == ka != kb and len(separate.heads) == 2
    q = _params(separate)
    thetas = separate.generate([0, 1, 2])
    for c in sizes:  # Eq. 3 by hand through the client's own architecture's head
        assert torch.allclose(thetas[c], hand_theta(q, str(c), separate.key[c], 15, 5))
    separate.backward({0: g[0], 1: g[1], 2: g[2]})
    assert torch.allclose(separate.heads[ka].weight.grad, head_grad(separate, [0, 2], ka))
    assert torch.allclose(separate.heads[kb].weight.grad, head_grad(separate, [1], kb))


def _joins(models: list[str], hp: MHPFedHNParams, shape=(1, 28, 28), classes=10):
    client = MHPFedHNClient(hp, _ctx(shape, classes))
    joins = {}
    for c, name in enumerate(models):
        fm = FunctionalModel(build_model(name, shape, classes), name)
        joins[c] = client.join(fm, 10)
    return joins


def _ctx(shape, classes):
    return ClientContext(0, torch.device("cpu"), classes, shape)


@pytest.mark.parametrize("algorithm", ["mh_pfedhn", "mh_pfedhngd"])
def test_table10_server_heads_from_joins(algorithm):
    """What the server learns and builds for Table 10's federation on Fashion-MNIST-shaped
    inputs: per_size -> every client (and GD's LeNet-style global model) on one head;
    per_architecture -> the clients report an opaque architecture id (equal for equal
    architectures, no name), one head per architecture, the global model on the LeNet head."""
    models = ["lenet", "vgg8_lenet_size", "mlp_lenet_size", "lenet"]
    cls = MHPFedHNGDParams if algorithm == "mh_pfedhngd" else MHPFedHNParams
    small = {"hidden": 4, "embed_dim": 3}
    ctx = ServerContext(0, torch.device("cpu"), 10, (1, 28, 28))
    green = MHPFedHNServer(cls(**small), _joins(models, cls(**small)), ctx)
    assert len(green.hnet.heads) == 1
    hp = cls(**small, heads="per_architecture")
    joins = _joins(models, hp)
    tags = [int(j["arch_id"]) for j in joins.values()]
    assert tags[0] == tags[3] and len(set(tags)) == 3
    assert all(t.dtype == torch.int64 and t.dim() == 0 for j in joins.values() for t in j.values())
    red = MHPFedHNServer(hp, joins, ctx)
    key = red.hnet.key
    assert key[0] == key[3] and len({key[0], key[1], key[2]}) == 3
    if algorithm == "mh_pfedhngd":
        assert key[GLOBAL] == key[0] and len(red.hnet.heads) == 3
    with pytest.raises(ConfigError, match="arch_id"):
        MHPFedHNServer(hp, _joins(models, cls(**small)), ctx)  # joins without the tag


# == Tables 13 / 14: layer modes per architecture ============================================
def test_mode_globs_and_prefixes_name_the_layers_the_paper_means():
    """App. C.9: a ResNet client keeping 'the batch normalization layers and classification
    layers locally' -> ``*.bn*,classifier`` names exactly the BatchNorm modules' parameters
    (found here through the module types) and the classifier; a prefix names a layer; an
    entry naming nothing is a one-line ConfigError, never a silent no-op."""
    module = build_model("resnet10", (3, 32, 32), 100)
    fm = FunctionalModel(module, "resnet10")
    bn = {
        f"{m_name}.{p_name}"
        for m_name, m in module.named_modules()
        if isinstance(m, nn.BatchNorm2d)
        for p_name, _ in m.named_parameters(recurse=False)
    }
    got = select_names(fm, "*.bn*,classifier", 3)
    assert set(got) == bn | {"classifier.weight", "classifier.bias"}
    assert len(bn) == 2 * (1 + 2 * 10)  # stem BN + two per residual block, weight and bias
    lenet = FunctionalModel(build_model("lenet", (3, 32, 32), 100), "lenet")
    assert select_names(lenet, "fc.2, classifier", 0) == [
        "fc.2.weight",
        "fc.2.bias",
        "classifier.weight",
        "classifier.bias",
    ]
    assert select_names(lenet, "", 0) == []
    with pytest.raises(ConfigError, match=r"'fc.9' names no parameter of its model lenet") as e:
        select_names(lenet, "fc.9,classifier", 4)
    assert "\n" not in str(e.value)


def _resnet_blocks(name: str) -> list[str]:
    module = build_model(name, (3, 32, 32), 100)
    blocks = [n for n, m in module.named_modules() if type(m).__name__ == "BasicBlock"]
    return blocks


@pytest.mark.parametrize(
    "path", [p for p in NEW if p.name.startswith(("table13", "table14")) and "hetero" in p.name]
)
def test_heterogeneous_mode_configs(path):
    """Tables 13 / 14 (heterogeneous): client i runs clients.models[i % n] with mode i % n.
    For every client of the config, its mode names parameters of its own model, and the modes
    are the paper's: LeNet-style / VGG8 (Table 13: classifier / input + classifier / input /
    none local; Table 14: FC2 + classifier / classifier / none frozen), ResNets (Table 13: BN
    + classifier local, or none; Table 14: the last 20% of the residual blocks + classifier
    frozen, or none)."""
    cfg = load_config(path)
    shape, classes = SHAPES[cfg.dataset.name]
    hp = cfg.hparams()
    key = "personal_layers" if "table13" in path.name else "frozen_layers"
    modes = getattr(hp, key)
    arch = cfg.clients.assignment(cfg.seed)
    assert isinstance(cfg.clients.models, list) and len(cfg.clients.models) == len(modes)
    fms = {a: FunctionalModel(build_model(a, shape, classes), a) for a in set(arch)}
    seen: dict[str, set[frozenset[str]]] = {}
    for c, a in enumerate(arch):
        names = frozenset(select_names(fms[a], modes[c % len(modes)], c))
        seen.setdefault(a, set()).add(names)
    for a, got in seen.items():
        names = fms[a].layout.names
        fc2, head = {"fc.2.weight", "fc.2.bias"}, {"classifier.weight", "classifier.bias"}
        first = {n for n in names if n.startswith("features.0.")}
        if a.startswith("resnet"):
            if key == "personal_layers":
                local = {n for n in names if ".bn" in n} | head
            else:
                blocks = _resnet_blocks(a)
                last = blocks[len(blocks) - round(0.2 * len(blocks)) :]
                local = {n for n in names if n.startswith(tuple(b + "." for b in last))} | head
                assert len(last) == {"resnet10": 2, "resnet12": 2, "resnet18": 4}[a]
            expected = {frozenset(local), frozenset()}
        elif a == "mlp":
            first = {n for n in names if n.startswith("features.1.")}
            expected = {frozenset(s) for s in (head, first | head, first, set())}
        elif key == "personal_layers":
            expected = {frozenset(s) for s in (head, first | head, first, set())}
        else:
            expected = {frozenset(s) for s in (fc2 | head, head, set())}
        assert got == expected, (path.name, a)


# == Table 15: C% of the clients deploy the global model =====================================
def test_exactly_that_fraction_is_served_the_global_model():
    """App. C.10 / Table 15: round(C n) clients (a seeded draw, fixed over rounds) get w_g
    with use_global = 1; the others get their generated theta_i, zeros where w_g would be and
    use_global = 0. C = 1 is Alg. 2 unchanged (no flag)."""
    sizes = dict.fromkeys(range(10), 9)
    hp = MHPFedHNGDParams(**TINY, global_model="linear", global_model_fraction=0.4)
    server = _tiny_server(sizes, hp, global_size=9)
    assert server.global_users == deploying_clients(list(range(10)), 0.4, 0)
    assert len(server.global_users) == 4
    w_g = _theta_fn(server, GLOBAL)(_params(server.hnet))
    for rnd in (1, 2):
        msgs = server.configure_train(rnd, list(range(10)))
        on = [c for c, m in msgs.items() if float(m["use_global"]) == 1.0]
        assert on == server.global_users
        for c, m in msgs.items():
            assert torch.allclose(m["theta"], _theta_fn(server, c)(_params(server.hnet)))
            if c in on:
                assert torch.allclose(m["global"], w_g, atol=1e-12)
            else:
                assert float(m["use_global"]) == 0.0 and not m["global"].any()
    assert deploying_clients(list(range(50)), 0.2, 0) != deploying_clients(list(range(50)), 0.2, 1)
    assert [len(deploying_clients(list(range(50)), f, 3)) for f in (0, 0.2, 0.6, 1)] == [
        0,
        10,
        30,
        50,
    ]
    full = _tiny_server(sizes, MHPFedHNGDParams(**TINY, global_model="linear"), global_size=9)
    assert all(set(m) == {"theta", "global"} for m in full.configure_train(1, [0, 1]).values())
    with pytest.raises(ValueError, match="needs a global_model"):
        MHPFedHNParams(global_model_fraction=0.5)


def test_global_step_averages_only_the_deploying_clients():
    """Eq. 6-7 over the deploying clients: phi <- phi - lr * (d w_g / d phi)^T (-sum_{i in D}
    m_i / M_D Delta w_g,i); a non-deploying client's global_delta (here deliberately
    nonzero) is ignored, and a round without deploying clients has no global step."""
    lr = 0.1
    hp = MHPFedHNGParams(**TINY, global_model_fraction=0.5)
    samples = {0: 30, 1: 10, 2: 20, 3: 40}
    server = _tiny_server(dict.fromkeys(range(4), 4), hp, samples, global_size=4, sgd_lr=lr)
    users = server.global_users
    assert len(users) == 2
    p0 = _params(server.hnet)
    g = torch.Generator().manual_seed(2)
    dw = {c: torch.randn(4, generator=g, dtype=torch.float64) for c in range(4)}
    zero = torch.zeros(4, dtype=torch.float64)
    server.aggregate(1, {c: {"delta": zero, "global_delta": dw[c]} for c in range(4)})
    total = sum(samples[c] for c in users)
    weighted = sum(samples[c] / total * dw[c] for c in users)
    expected = sgd_expected(p0, lambda p: [_theta_fn(server, GLOBAL)(p)], [-weighted], lr)
    _assert_params(server.hnet, expected)
    others = [c for c in range(4) if c not in users]
    p1 = _params(server.hnet)
    server.aggregate(2, {c: {"delta": zero, "global_delta": dw[c]} for c in others})
    _assert_params(server.hnet, p1)


def _two_client_group(fm: FunctionalModel, lr: float, vectorize: bool) -> ClientGroup:
    data = FederatedData(
        x=X,
        y=Y,
        train_idx=[torch.arange(4), torch.arange(4)],
        val_idx=[torch.arange(0), torch.arange(0)],
        test_idx=[torch.arange(4), torch.arange(4)],
        num_classes=3,
        input_shape=(2,),
        mean=torch.zeros(0),
        std=torch.zeros(0),
        dtype=torch.float64,
    )
    sgd = SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    return ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=sgd, vectorize=vectorize)


@pytest.mark.parametrize("vectorize", [True, False])
def test_deploying_client_distils_the_other_trains_plain_ce(vectorize):
    """One group, client 0 deploys w_g, client 1 does not (same data, same theta): client 0's
    step is Eq. 8 (lambda = 0.2 on the KL, T = 2) with the received w_g as teacher and it returns
    Delta w_g; client 1's is Alg. 1's plain CE step and its global_delta is zero, its global
    BatchNorm state untouched."""
    lr = 0.5
    hp = MHPFedHNGDParams(
        **TINY, global_model="linear", kd_lambda=0.2, temperature=2.0, global_model_fraction=0.5
    )  # the default kd_weighting: lambda weighs the KL (0.8 CE + 0.2 KL)
    student, teacher = _linear_fm(1), _linear_fm(2)
    theta, w_g = student.initial_params(), teacher.initial_params()
    client = _client(hp, teacher)
    msg = {
        "theta": torch.stack([theta, theta]),
        "global": torch.stack([w_g, torch.zeros_like(w_g)]),
        "use_global": torch.tensor([1.0, 0.0]),
    }
    state = client.init_state(student, 2)
    reply, new_state, loss = client.fit(_two_client_group(student, lr, vectorize), msg, state)
    kd = -lr * hand_grad(theta, _logits(w_g), 0.8, 0.2, T=2.0)
    ce = -lr * hand_grad(theta)
    assert torch.allclose(reply["delta"][0], kd, rtol=0, atol=1e-12)
    assert torch.allclose(reply["delta"][1], ce, rtol=0, atol=1e-12)
    assert torch.allclose(reply["global_delta"][0], -lr * hand_grad(w_g), rtol=0, atol=1e-12)
    assert not reply["global_delta"][1].any()
    assert torch.equal(new_state["global_buffers"][1], state["global_buffers"][1])
    assert loss.shape == (2,) and bool(torch.isfinite(loss).all())


def test_simulated_round_with_a_fraction_of_global_users():
    """End to end through the transport (mixed groups): the deploying clients upload a
    nonzero Delta w_g, the others zeros; every client still uploads Delta theta_i."""
    sim = _sim("mh_pfedhngd", '["lenet","mlp"]', **{"algorithm.global_model_fraction": 0.5})
    users = set(sim.server.global_users)
    assert len(users) == 2
    seen: dict = {}
    original = sim.server.aggregate
    sim.server.aggregate = lambda rnd, replies: (seen.update(replies), original(rnd, replies))
    sim.run_round(1)
    assert set(seen) == {0, 1, 2, 3}
    for c, reply in seen.items():
        assert reply["delta"].abs().sum() > 0
        assert bool(reply["global_delta"].any()) == (c in users), c


# == every new table config loads, and its CPU variant runs ==================================
def test_every_table_setting_has_a_config_and_a_fashion_mnist_variant():
    names = {p.stem for p in NEW}
    full = {n for n in names if not n.endswith("_fmnist")}
    assert {
        "table10_heads_shared",
        "table10_heads_per_architecture",
        "table13_extreme_personalization_hetero",
        "table14_resource_constraints_hetero",
        "table15_global_model_fraction",
        "table15_global_model_fraction_hetero",
    } <= full
    for n in full:
        assert f"{n}_fmnist" in names, n
        cfg, small = load_config(CONFIGS / f"{n}.toml"), load_config(CONFIGS / f"{n}_fmnist.toml")
        assert cfg.dataset.name == "cifar100" and small.dataset.name == "fashion_mnist"
        assert cfg.algorithm.name == small.algorithm.name
        # the table's own setting is the same in both
        for key in ("heads", "global_model_fraction"):
            assert getattr(cfg.hparams(), key) == getattr(small.hparams(), key), (n, key)
    assert load_config(CONFIGS / "table14_resource_constraints.toml").algorithm.name == (
        "mh_pfedhn"
    )  # Table 14 is MH-pFedHN's


RUN = [
    "table10_heads_per_architecture_fmnist",
    "table13_extreme_personalization_hetero_fmnist",
    "table14_resource_constraints_hetero_fmnist",
    "table15_global_model_fraction_hetero_fmnist",
]


@pytest.mark.parametrize("name", RUN)
def test_fashion_mnist_variants_run_a_round(name):
    """The CPU variants with a new mechanism each run (one round, shrunk to one client per
    (model, mode) pair and 12 images per client; their own models, modes, heads and
    fraction) with every reply accepted. The homogeneous variants differ only in their
    models; every full file: ``hyperfed run --config FILE --set rounds=2`` (see the report)."""
    path = CONFIGS / f"{name}.toml"
    models = load_config(path).clients.models
    n = max(len(models) if isinstance(models, list) else 1, 4)
    sets = ["rounds=1", "eval_every=1", "local.epochs=1", "device=cpu", f"clients.count={n}"]
    sim = Simulation(load_config(path, [*sets, f"dataset.subsample={12 * n}"]))
    result = sim.run_round(1)
    assert result.clients == list(range(n)) and not result.rejected
