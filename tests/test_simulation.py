"""The simulator against hand computations: FedAvg, Local, accounting, evaluation, rejection."""

from __future__ import annotations

import copy

import pytest
import torch

from hyperfed.config import load_config
from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.local import train_reference
from hyperfed.runtime.simulate import Simulation

BASE = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=300",
    "partition.name=iid",
    "clients.models=lenet",
    "local.epochs=1",
    "local.batch_size=32",
    "local.lr=0.02",
    "eval_every=1",
    "seed=3",
]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a small shared CPU, two threads spin against other processes
    and make these tiny models many times slower (results do not depend on it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _sim(*overrides: str) -> Simulation:
    return Simulation(load_config(None, [*BASE, *overrides]))


def _global(sim: Simulation) -> torch.Tensor:
    """FedAvg's global model (one per architecture; these tests use one architecture)."""
    theta = sim.server.theta
    if isinstance(theta, dict):
        (theta,) = theta.values()
    return theta


def _reference_rounds(sim: Simulation, theta: torch.Tensor, cid: int, rounds: int):
    """``train_reference`` of client ``cid`` alone, round after round, on the engine's plans."""
    fm = sim.models["lenet"]
    module = copy.deepcopy(fm.module)
    theta = theta[None].clone()
    buffers = fm.initial_buffers()[None].clone()
    for rnd in range(1, rounds + 1):
        plan = sim.group("lenet", [cid], rnd).plan()
        theta, buffers = train_reference(module, fm, theta, buffers, sim.data, plan, sim.sgd)
    return theta[0]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == b.shape
    err = float((a - b).abs().max())
    assert err <= tol, f"max abs difference {err:.3g} > {tol}"


def test_fedavg_with_one_client_is_plain_sgd():
    sim = _sim("clients.count=1", "algorithm.name=fedavg", "rounds=2")
    theta0 = _global(sim).clone()
    records = sim.run()
    assert [r["round"] for r in records] == [1, 2]
    expected = _reference_rounds(sim, theta0, 0, rounds=2)
    assert not torch.allclose(expected, theta0), "training must move the parameters"
    _close(_global(sim), expected)


def test_local_is_independent_training():
    sim = _sim("clients.count=3", "algorithm.name=local", "rounds=2")
    fm = sim.models["lenet"]
    theta0 = fm.initial_params().clone()
    sim.run()
    thetas = [sim.store[c]["theta"] for c in range(3)]
    for c in range(3):
        _close(thetas[c], _reference_rounds(sim, theta0, c, rounds=2))
    assert not torch.allclose(thetas[0], thetas[1]), "clients must train on their own data"


@pytest.mark.parametrize("participation,participants", [(1.0, 4), (0.5, 2)])
def test_fedavg_bytes_match_the_hand_count(participation, participants):
    sim = _sim(
        "clients.count=4", "algorithm.name=fedavg", "rounds=2", f"participation={participation}"
    )
    K = sim.models["lenet"].num_params
    records = sim.run()
    join = 4 * 2 * 8  # before round 1 every client sends num_params and num_samples (int64)
    for r in records:
        assert r["participants"] == participants
        assert r["bytes_down_per_client"] == K * 4
        assert r["bytes_up_per_client"] == K * 4
        assert r["bytes_down_round"] == participants * K * 4
        assert r["bytes_up_round"] == participants * K * 4
        rnd = r["round"]
        assert r["bytes_down_total"] == rnd * participants * K * 4
        assert r["bytes_up_total"] == join + rnd * participants * K * 4
    # so a participating client moves 2*K*4 bytes per round in all
    r = records[-1]
    assert r["bytes_up_per_client"] + r["bytes_down_per_client"] == 2 * K * 4


def test_local_sends_nothing():
    sim = _sim("clients.count=2", "algorithm.name=local", "rounds=1")
    (r,) = sim.run()
    assert r["bytes_up_round"] == r["bytes_down_round"] == 0
    assert r["bytes_up_total"] == r["bytes_down_total"] == 0


def test_evaluation_covers_every_client_and_its_summaries_agree():
    sim = _sim(
        "clients.count=4",
        "algorithm.name=fedavg",
        "rounds=2",
        "participation=0.5",
        "partition.name=dirichlet",
        "partition.alpha=1.0",
    )
    (*_, r) = sim.run()
    n = sim.cfg.clients.count
    acc = torch.tensor(r["client_acc"], dtype=torch.float64)
    assert len(r["client_acc"]) == n and r["num_clients"] == n and r["participants"] == 2
    assert r["client_arch"] == ["lenet"] * n
    # every client's personalized model (here: the global one) on its own test split,
    # participants of the last round or not
    fm = sim.models["lenet"]
    buffers = torch.stack([sim.store[c]["buffers"] for c in range(n)])
    ok, tot, _ = evaluate_clients(fm, _global(sim).expand(n, -1), buffers, sim.data, list(range(n)))
    assert tot.tolist() == [float(s) for s in sim.data.test_sizes]
    assert len(set(sim.data.test_sizes)) > 1, "weighted and plain means must differ to be tested"
    _close(acc, (ok / tot).double(), 1e-5)
    sizes = torch.tensor(sim.data.test_sizes, dtype=torch.float64)
    assert r["mean_acc"] == pytest.approx(float(acc.mean()), abs=1e-5)
    assert r["weighted_acc"] == pytest.approx(float((acc * sizes).sum() / sizes.sum()), abs=1e-5)
    assert r["min_acc"] == pytest.approx(float(acc.min()), abs=1e-5)
    assert r["max_acc"] == pytest.approx(float(acc.max()), abs=1e-5)
    assert r["std_acc"] == pytest.approx(float(acc.std(unbiased=False)), abs=1e-5)
    assert r["min_acc"] <= r["mean_acc"] <= r["max_acc"]


def test_same_config_and_seed_give_identical_metrics():
    def once():
        recs = _sim("clients.count=3", "algorithm.name=fedavg", "rounds=2").run()
        return [{k: v for k, v in r.items() if k != "seconds"} for r in recs]

    a, b = once(), once()
    assert a == b
    assert len(a) == 2


def test_check_reply_refuses_non_finite_and_misshapen_updates():
    sim = _sim("clients.count=2", "algorithm.name=fedavg", "rounds=1")
    K = sim.models["lenet"].num_params
    good = torch.zeros(K)
    assert sim.server.check_reply(0, {"theta": good}) is None
    for bad in (float("nan"), float("inf")):
        t = good.clone()
        t[5] = bad
        assert "theta" in sim.server.check_reply(0, {"theta": t})
    assert sim.server.check_reply(0, {"theta": torch.zeros(K + 1)}) is not None
    assert sim.server.check_reply(0, {}) is not None


def _poison(monkeypatch, sim: Simulation, bad: set[int], seen: dict[int, torch.Tensor]) -> None:
    """Make the clients in ``bad`` reply NaN; record what every client really computed."""
    original = sim.client.fit

    def fit(group, msg, state):
        reply, new_state, loss = original(group, msg, state)
        theta = reply["theta"].clone()
        for i, c in enumerate(group.client_ids):
            seen[c] = theta[i].clone()
            if c in bad:
                theta[i, :7] = float("nan")
        return {"theta": theta}, new_state, loss

    monkeypatch.setattr(sim.client, "fit", fit)


def test_a_nan_reply_is_rejected_and_the_others_are_averaged(monkeypatch):
    sim = _sim(
        "clients.count=3",
        "algorithm.name=fedavg",
        "rounds=1",
        "partition.name=dirichlet",
        "partition.alpha=1.0",
    )
    seen: dict[int, torch.Tensor] = {}
    _poison(monkeypatch, sim, {1}, seen)
    (r,) = sim.run()
    assert r["rejected"] == [1]
    # a rejected update was still uploaded: it counts in the bytes
    assert r["bytes_up_round"] == 3 * sim.models["lenet"].num_params * 4
    n = torch.tensor([float(sim.data.train_sizes[c]) for c in (0, 2)])
    expected = (n[0] * seen[0] + n[1] * seen[2]) / n.sum()
    assert torch.isfinite(_global(sim)).all()
    _close(_global(sim), expected, 1e-6)


def test_when_every_reply_is_rejected_the_server_state_is_unchanged(monkeypatch):
    sim = _sim("clients.count=2", "algorithm.name=fedavg", "rounds=1")
    before = _global(sim).clone()
    _poison(monkeypatch, sim, {0, 1}, {})
    result = sim.run_round(1)
    assert result.rejected == [0, 1]
    assert result.bytes_up == 2 * sim.models["lenet"].num_params * 4  # uploaded, then rejected
    assert torch.equal(_global(sim), before)


def test_round_flops_are_steps_times_batch_times_one_sample_forward_backward():
    """Local trains one model with plain CE: the measured FLOPs must equal the hand count."""
    import math

    from hyperfed.runtime.simulate import train_flops_per_sample

    for path in ("off", "reference"):
        sim = _sim("algorithm.name=local", "clients.count=3", f"local.vectorize={path}")
        result = sim.run_round(1)
        steps = sum(math.ceil(n / 32) for n in sim.data.train_sizes)  # E = 1, batch 32
        fm = sim.models["lenet"]
        per_sample = train_flops_per_sample(fm, sim.data.input_shape, sim.device)
        assert result.flops == steps * 32 * per_sample > 0, path


def test_a_second_trained_model_shows_in_the_flops():
    """FML trains the shared model beside the private one: more FLOPs than Local alone."""
    local = _sim("algorithm.name=local", "clients.count=2").run_round(1).flops
    fml = _sim('algorithm={name="fml", shared_model="lenet"}', "clients.count=2").run_round(1).flops
    assert fml > local > 0


def test_server_flops_are_the_hypernetworks_and_kept_apart_from_the_clients():
    """MH-pFedHN's server generates and updates with a hypernetwork: counted as server FLOPs,
    not in the clients' figure. FedAvg's weighted average is one [1, C] x [C, K] product
    (2 C K FLOPs); Local has no server work."""
    mh = _sim("algorithm.name=mh_pfedhn", "clients.count=3", "rounds=1")
    local = _sim("algorithm.name=local", "clients.count=3", "rounds=1")
    fedavg = _sim("algorithm.name=fedavg", "clients.count=3", "rounds=1")
    results = {n: s.run_round(1) for n, s in [("mh", mh), ("local", local), ("fedavg", fedavg)]}
    assert results["mh"].flops == results["local"].flops > 0  # same local training
    assert results["mh"].server_flops > 0
    assert results["local"].server_flops == 0
    assert results["fedavg"].server_flops == 2 * 3 * fedavg.models["lenet"].num_params
    record = mh.run()[-1]
    assert record["flops_server_total"] == mh.totals["flops_server"] > results["mh"].server_flops


def test_model_assignment_round_robin_explicit_random_and_new_architectures() -> None:
    """clients.models spread round robin (a list of ``count`` names is explicit), a seeded
    random draw (pFedES assigns models at random), and held-out clients with architectures no
    other client has (seed 000 Fig. 5)."""

    def arch(*sets: str, seed: int = 0) -> list[str]:
        return load_config(None, list(sets)).clients.assignment(seed)

    mix = 'clients.models=["lenet","vgg8","mlp"]'
    assert arch("clients.count=4", mix) == ["lenet", "vgg8", "mlp", "lenet"]
    explicit = 'clients.models=["mlp","lenet","lenet"]'
    assert arch("clients.count=3", explicit) == ["mlp", "lenet", "lenet"]
    drawn = [arch("clients.count=30", mix, "clients.assign=random", seed=s) for s in (0, 0, 1)]
    assert drawn[0] == drawn[1] != drawn[2]  # seeded
    assert set(drawn[0]) == {"lenet", "vgg8", "mlp"} and drawn[0] != arch("clients.count=30", mix)
    held = arch("clients.count=5", mix, 'clients.new_models=["resnet10"]', "clients.new_count=2")
    assert held == ["lenet", "vgg8", "mlp", "resnet10", "resnet10"]


def test_held_out_clients_with_new_architectures_join_after_training() -> None:
    """Fig. 5 on a tiny scale: the last client runs an architecture no training client has; it
    is never sampled before the adaptation rounds and is reported in mean_acc_new."""

    cfg = load_config(
        None,
        [
            "device=cpu",
            "dataset.name=digits",
            "dataset.subsample=300",
            "clients.count=4",
            "clients.models=lenet",
            'clients.new_models=["mlp"]',
            "clients.new_count=1",
            "algorithm.name=mh_pfedhn",
            "algorithm.new_clients=0.25",
            "algorithm.adapt_rounds=1",
            "rounds=3",
            "eval_every=3",
            "local.epochs=1",
        ],
    )
    sim = Simulation(cfg)
    assert sim.arch_of == ["lenet", "lenet", "lenet", "mlp"]
    sampled = [sim.run_round(r).clients for r in (1, 2, 3)]
    assert all(3 not in c for c in sampled[:2]) and sampled[2] == [3]
    assert "mean_acc_new" in sim.evaluate()


def test_evaluation_stacks_only_the_state_the_scored_model_needs(monkeypatch):
    """pFedKT scores ``theta_prev``; its clients also keep a local hypernetwork and Adam's two
    moments of it (for HN(large), ~220 MB a client). Evaluating must not stack those: what
    ``torch.stack`` copies during ``evaluate`` is the scored models and buffers only."""
    cfg = load_config(
        None,
        [*BASE, "clients.count=3", "clients.models=mlp", "algorithm.name=pfedkt", "rounds=1"],
    )
    sim = Simulation(cfg)
    sim.run_round(1)
    store = sim.transport.store
    assert {"hn", "hn_m", "hn_v"} <= set(store[0])  # what a full stack would copy
    copied: list[int] = []
    stack = torch.stack

    def spy(tensors, *args, **kwargs):
        out = stack(tensors, *args, **kwargs)
        copied.append(out.numel())
        return out

    monkeypatch.setattr(torch, "stack", spy)
    sim.evaluate("test")
    monkeypatch.setattr(torch, "stack", stack)
    scored = sum(store[c][k].numel() for c in store for k in ("theta_prev", "buffers"))
    hypernet = sum(store[c][k].numel() for c in store for k in ("hn", "hn_m", "hn_v"))
    assert hypernet > scored  # so the sum below tells the two apart
    assert sum(copied) < scored + hypernet / 2
