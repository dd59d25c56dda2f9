"""Every method learns: on a small fixed digits task it ends above a floor (issue 19, item 3).

Task: scikit-learn digits, 600 samples, 6 LeNet clients, 10 rounds of 1 local epoch (batch
16), every method at its own defaults (one-off phases shortened as in ``SHORT``). Personalized
and decentralized methods run on a label-skewed split (2 classes per client, the papers'
"quantity" partition); the methods that evaluate one global model run on an IID split, where
a global model is the right tool.

Where each floor comes from: the same run was measured over seeds 0, 1 and 2 on the 2-core
CPU machine (2026-11-23; ``MEASURED`` holds min and mean over the seeds), and the floor is the
minimum minus 0.05. The test runs seed 0. On the label-skewed split FedAvg's global model
reaches 0.281 on average (0.118 / 0.506 / 0.220), so every personalized floor is above FedAvg's
mean (asserted below); chance is 0.10 for a global model. A new method without a floor fails
``test_every_method_has_a_floor``: measure it over three seeds first.
"""

from __future__ import annotations

import dataclasses

import pytest

from hyperfed.algorithms import get_algorithm, registry
from hyperfed.config import load_config
from hyperfed.runtime.simulate import Simulation

BASE = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=600",
    "clients.count=6",
    "clients.models=lenet",
    "rounds=10",
    "eval_every=10",
    "local.epochs=1",
    "local.batch_size=16",
    "seed=0",
]
LABEL_SKEW = ["partition.name=quantity", "partition.classes_per_client=2"]
IID = ["partition.name=iid"]
# shorter one-off phases (dataset distillation, one-shot training) where a method has them
SHORT = {
    "distill_iters": 20,
    "ipc": 2,
    "syn_batch": 10,
    "distill_batch_real": 32,
    "one_shot_epochs": 1,
    "extractor_epochs": 1,
    "shared_model": "lenet",  # FML / FedKD default to cnn5, which needs inputs >= 16x16
}
GLOBAL_MODEL = {
    "fedavg",
    "moon",  # scores its global model (MOON's protocol)
    "fedavg_dd",
    "feddm",
    "fedbn",
    "fedbn_dd",
}  # one global model (FedBN: on LeNet, no BatchNorm): IID
FEDAVG_MEAN_LABEL_SKEW = 0.281

# method: (min over seeds 0-2, mean over seeds 0-2) of the final mean accuracy
MEASURED = {
    "dfedalt": (0.914, 0.942),
    "dfedavg": (0.441, 0.590),
    "dfedhp": (0.838, 0.885),  # generation = literal (0.731 / 0.786 with residual)
    "ditto": (0.839, 0.864),
    "fd": (0.672, 0.685),
    "fedavg": (0.273, 0.289),  # IID
    "fedavg_dd": (0.393, 0.456),  # IID
    "fedkd": (0.598, 0.681),
    "fedper": (0.763, 0.833),
    "fedproto": (0.668, 0.676),
    "fml": (0.696, 0.726),
    "lg_fedavg": (0.529, 0.584),
    "local": (0.786, 0.884),
    "mh_pfedhn": (0.675, 0.719),
    "mh_pfedhndd": (0.770, 0.801),
    "mh_pfedhng": (0.690, 0.781),
    "mh_pfedhngd": (0.629, 0.658),
    # re-measured with the authors' 8-kernel extractor, the default since 2026-11-29: the same
    "pfedes": (0.638, 0.659),
    "pfedhn": (0.612, 0.698),
    "pfedhn_dd": (0.644, 0.714),
    # hn_init = "layer" (2026-11-27: 0.957 / 0.988 / 0.959); with "target", the default
    # before, (0.518, 0.563): barely above "always one of my two classes" (issue 21)
    "pfedkt": (0.957, 0.968),
    # issue 22-24 baselines (measured by their authors' helpers the same way, 2026-11-24)
    "dispfl": (0.448, 0.584),
    "desa": (0.658, 0.719),
    "fedbn": (0.273, 0.289),
    # IID; images clamped to the data range (they diverged without). Min and mean over seeds
    # 0-6 (2026-11-24, issue 27's per-parameter loop): in this setting FedDM's accuracy swings
    # between 0.12 and 0.75 from round to round (seed 0, rounds 1-30: the server retrains 25
    # epochs on 120 synthetic images each round), and a change of the last bits of one SGD
    # step moves round 10 by +-0.15; seeds 0-2 alone had given (0.440, 0.491)
    "feddm": (0.273, 0.371),
    "fedbn_dd": (0.393, 0.456),  # IID, as FedBN
    "fedgh_dd": (0.808, 0.892),
    "pfedlhn_dd": (0.880, 0.931),  # IID; LeNet has no BatchNorm: FedBN is FedAvg here
    "fedfomo": (0.780, 0.799),  # the own model a candidate (2026-11-26)
    "fedphp": (0.561, 0.626),
    "fedrod": (0.735, 0.779),
    "fedgh": (0.916, 0.954),  # server header 100 epochs x batch 10 (2026-11-26)
    "fedtgp": (0.753, 0.835),
    "hypcluster": (0.483, 0.524),
    "mapper": (0.753, 0.860),
    # IID at 60 rounds (ROUNDS): MOON scores its global model; mu = 1 slows the global model
    # (mu = 0: 0.32 at 10 rounds, as FedAvg; mu = 1: 0.113). Its climb from chance starts
    # between rounds 20 and 40 and where depends on the CPU: at 30 rounds seed 0 gave 0.293 on
    # 2026-11-26's machine and 0.193 on 2026-11-30's; at 60 it has levelled off (seed 0: 0.887
    # at rounds 50 and 60; seeds 0-2 re-measured 2026-11-30)
    "moon": (0.887, 0.916),
    # at 40 rounds (ROUNDS); h as deep as the authors' --hyper-nhid 3 and reading the
    # descriptor standardized as their code does (0.888 / 0.975 / 0.879, 2026-11-26; without
    # the standardization 0.751 / 0.828 / 0.801)
    "pefll": (0.879, 0.914),
    "pfedla": (0.977, 0.989),  # at 40 rounds (ROUNDS); hn_lr 5e5 (2026-11-26)
    "pfedlhn": (0.796, 0.875),
    "fedrep": (0.556, 0.566),  # the run's epochs (E - 1 head + 1 body; 2026-11-26), not 10 + 1
    "partialfed": (0.798, 0.809),
}
# Methods that start as FedAvg and personalize only once their aggregation weights (pFedLA's
# alpha) or descriptors (PeFLL's embedding network) have been learned: at 10 rounds they are at
# FedAvg's level (pFedLA 0.212, PeFLL 0.300 over seeds 0-2), so they are measured at 40.
ROUNDS = {"pfedla": 40, "pefll": 40, "moon": 60}
MARGIN = 0.05


def floor(method: str) -> float:
    return MEASURED[method][0] - MARGIN


def settings(method: str) -> list[str]:
    fields = {f.name for f in dataclasses.fields(get_algorithm(method).hparams)}
    short = [f"algorithm.{k}={v}" for k, v in SHORT.items() if k in fields]
    split = IID if method in GLOBAL_MODEL else LABEL_SKEW
    rounds = ROUNDS.get(method, 10)
    length = [f"rounds={rounds}", f"eval_every={rounds}"]
    return [*BASE, *split, f"algorithm.name={method}", *short, *length]


def test_every_method_has_a_floor() -> None:
    missing = sorted(set(registry()) - set(MEASURED))
    assert not missing, f"measure these over seeds 0-2 and add them to MEASURED: {missing}"


def test_personalized_floors_are_above_fedavgs_global_model() -> None:
    for method in set(MEASURED) - GLOBAL_MODEL:
        assert floor(method) > FEDAVG_MEAN_LABEL_SKEW, method


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(MEASURED))
def test_method_learns_above_its_floor(method: str) -> None:
    sim = Simulation(load_config(None, settings(method)))
    initial = sim.evaluate()["mean_acc"]
    final = sim.run()[-1]
    assert not final["rejected"], f"rejected updates from clients {final['rejected']}"
    assert final["mean_acc"] >= floor(method), (
        f"{method}: final mean accuracy {final['mean_acc']:.3f} below its floor "
        f"{floor(method):.3f} (from {initial:.3f} before training)"
    )
