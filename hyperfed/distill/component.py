"""The distilled set as a component a server and a client *hold* (seed 003, Alg. 1).

MH-pFedHNDD, its Table 5 plug-ins and DESA add the same one-off distillation phase to a
method; each holds these two pieces instead of inheriting them:

* :class:`DistilledSetServer` -- setup stage 0 sends the distillation model ``theta_d`` to the
  clients that train, receives their S_i (``syn_x``, ``syn_y``: the only keys of a reply) and
  merges them (Eq. 7, :func:`~hyperfed.distill.synthesis.merge_synthetic`, or the method's own
  merge, DESA's anchors); stage 1 sends S to every client. Where ``theta_d`` comes from is the
  holder's: MH-pFedHNDD's hypernetwork generates it, the others send a seeded initialization of
  ``distill_model`` (:func:`seeded_distill_theta`).
* :class:`DistilledSetClient` -- the client side of both stages (distill S_i with
  :func:`~hyperfed.distill.synthesis.distill_synthetic`, keep S in the client state) and the
  synthetic terms of Eq. 9 for local training (:meth:`DistilledSetClient.synthetic_kwargs`).

:class:`DDParams` holds the hyperparameters of the phase and of Eq. 9.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from hyperfed.distill.losses import BatchGroup, group_batches, synthetic_objective
from hyperfed.distill.synthesis import (
    DistillConfig,
    clients_text,
    distill_cost,
    distill_synthetic,
    merge_synthetic,
)
from hyperfed.engine.codec import Payload, nonfinite_tensor
from hyperfed.engine.local import client_seed
from hyperfed.hparams import chosen, paper
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model
from hyperfed.progress import PhaseCost

DISTILL_SALT = 31  # seeds of the distillation phase
SYNTHETIC_SALT = 37  # seeds of the synthetic batches in local training
SYNTHETIC_KEYS = ("syn_x", "syn_y")  # S in the client state and on the wire


@dataclass
class DDParams:
    """The data-distillation part of MH-pFedHNDD, shared with its plug-ins (Table 5).

    Defaults: seed 003 §4 (lambda = 0.7, lambda_CC = 5e-4, lambda_S = lambda_Reg = 0.1, T = 3000
    distillation iterations), Appendix D.1 (synthetic batch 50 next to the local batch 64).
    IPC: the paper uses 50 / 10 / 10 for CIFAR-10 / CIFAR-100 / Tiny-ImageNet; default 10.
    Not in the paper (DM's and FedDM's values): image learning rate 1.0, momentum 0.5, 64 real
    samples per class per iteration; tau_temp 0.1 (UniCon's default).
    """

    # distillation phase (Eq. 4-7)
    distill_model: str = chosen("convnet", "seed 003 names none; Table 10's ConvNet, as in DM")
    ipc: int = paper(10, "seed 003 §4 (CIFAR-100, Tiny-ImageNet)")
    # T
    distill_iters: int = paper(3000, "seed 003 §4")
    distill_lr: float = chosen(1.0, "seed 003 gives none; DM's / FedDM's (App. B.2)")
    distill_momentum: float = chosen(0.5, "seed 003 gives none; DM's")
    # real samples per class per iteration
    distill_batch_real: int = chosen(64, "seed 003 gives none; DM's / FedDM's")
    # Eq. 6; 0 = Table 3's "w/o L_CC"
    lambda_cc: float = paper(5e-4, "seed 003 §4, App. D.3 (Fig. 4c)")
    # Eq. 5 sums L_CC over the anchors ("sum"); "mean" averages (lambda_cc then weighs it
    # 1/N as strongly). Chosen on a validation split (configs/mh_pfedhndd_fmnist.toml with
    # partition.val_fraction = 0.1, seeds 0-2, final round): mean 0.944, sum 0.942 (mean ahead
    # in each seed)
    cc_reduction: str = chosen("mean", "validation split: 0.944 vs Eq. 5's sum 0.942, seeds 0-2")
    # temperature of Eq. 5 and Eq. 8
    tau_temp: float = chosen(0.1, "seed 003 gives none; UniCon's default")
    # "real" / "noise"; auto = real, noise under DP
    distill_init: str = paper("auto", "seed 003 Alg. 1 (S_i from a subset of D_i)")
    # True: DM's fresh random network every iteration
    distill_resample: bool = paper(False, "seed 003 Alg. 1 (theta_d fixed)")
    # training phase (Eq. 8-9)
    lambda_s: float = paper(0.1, "seed 003 §4, App. D.3 (Fig. 4d)")
    lambda_reg: float = paper(0.1, "seed 003 §4, App. D.3 (Fig. 4e)")
    # lambda of the universum u_j = lambda x_j + (1 - lambda) x_k
    mixup: float = paper(0.7, "seed 003 §4 (lambda = 0.7)")
    # False = Table 3's "w/o UniNeg"
    universum: bool = paper(True, "seed 003 Eq. 8")
    syn_batch: int = paper(50, "seed 003 App. D.1 (Fig. 4a)")
    # "synthetic" = Table 9's "only S"
    train_on: str = paper("both", "seed 003 Eq. 9")
    # differential privacy of the distillation phase (Table 6). Table 6 gives no sigma, epsilon,
    # clipping norm or delta: a config's ``dp_noise = 1.0`` is ours, not a paper value
    # noise multiplier sigma; 0 and dp_epsilon 0: no DP
    dp_noise: float = paper(0.0, "seed 003 §4 (no DP outside Table 6)")
    # > 0: choose sigma per client to reach this epsilon
    dp_epsilon: float = paper(0.0, "seed 003 §4 (no DP outside Table 6)")
    # "dp_sgd": per-sample clipped image gradients + noise; "features": clipped per-class
    # feature sums + noise (cheaper, less noise for the same epsilon; not the paper's)
    dp_mechanism: str = paper(
        "dp_sgd",
        "seed 003 §4.6: DP 'when generating synthetic data', citing Abadi et al. 2016 (DP-SGD)",
    )
    dp_clip: float = chosen(1.0, "Table 6 gives no DP settings; unit clipping norm")
    dp_delta: float = chosen(1e-5, "Table 6 gives no DP settings; the usual 1e-5")

    def check_dd(self) -> None:
        if self.distill_init not in ("auto", "real", "noise"):
            raise ValueError(
                f"distill_init must be auto, real or noise (got {self.distill_init!r})"
            )
        if self.cc_reduction not in ("mean", "sum"):
            raise ValueError(f"cc_reduction must be mean or sum (got {self.cc_reduction!r})")
        if self.dp_mechanism not in ("dp_sgd", "features"):
            raise ValueError(f"dp_mechanism must be dp_sgd or features (got {self.dp_mechanism!r})")
        if self.train_on not in ("both", "synthetic"):
            raise ValueError(f"train_on must be both or synthetic (got {self.train_on!r})")
        if self.ipc < 1 or self.syn_batch < 1 or self.distill_batch_real < 1:
            raise ValueError("ipc, syn_batch and distill_batch_real must be >= 1")
        if self.distill_iters < 0:
            raise ValueError(f"distill_iters must be >= 0 (got {self.distill_iters})")
        if not 0 <= self.mixup <= 1:
            raise ValueError(f"mixup must be in [0, 1] (got {self.mixup})")
        if min(self.lambda_cc, self.lambda_s, self.lambda_reg, self.dp_noise) < 0:
            raise ValueError("lambda_cc, lambda_s, lambda_reg and dp_noise must be >= 0")
        if self.tau_temp <= 0 or self.dp_clip <= 0 or not 0 < self.dp_delta < 1:
            raise ValueError("tau_temp and dp_clip must be > 0, dp_delta in (0, 1)")
        private = self.dp_noise > 0 or self.dp_epsilon > 0
        if private and self.distill_init == "real":
            raise ValueError("DP needs distill_init = noise (real-sample init publishes images)")
        if private:
            from hyperfed.privacy.accounting import require_opacus

            require_opacus()  # a clear error now, before any work

    def distill_config(self) -> DistillConfig:
        private = self.dp_noise > 0 or self.dp_epsilon > 0
        init = self.distill_init if self.distill_init != "auto" else "real"
        return DistillConfig(
            ipc=self.ipc,
            iters=self.distill_iters,
            lr=self.distill_lr,
            momentum=self.distill_momentum,
            batch_real=self.distill_batch_real,
            lambda_cc=self.lambda_cc,
            cc_reduction=self.cc_reduction,
            temperature=self.tau_temp,
            init="noise" if private else init,
            resample=self.distill_resample,
            dp_noise=self.dp_noise,
            dp_epsilon=self.dp_epsilon,
            dp_mechanism=self.dp_mechanism,
            dp_clip=self.dp_clip,
            dp_delta=self.dp_delta,
        )


def distill_model_size(name: str, input_shape: tuple[int, ...], num_classes: int) -> int:
    """K_d, the parameter count of ``distill_model`` (built without touching the global RNG)."""
    with torch.random.fork_rng(devices=[]):
        module = build_model(name, input_shape, num_classes)
    return sum(p.numel() for p in module.parameters())


def seeded_distill_theta(
    name: str, input_shape: tuple[int, ...], num_classes: int, seed: int, device: torch.device
) -> Tensor:
    """theta_d for a server without a hypernetwork: ``distill_model`` initialized from the run's
    seed (+ :data:`DISTILL_SALT`), the global RNG left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + DISTILL_SALT)
        module = build_model(name, input_shape, num_classes)
    return FunctionalModel(module).initial_params().to(device)


Merge = Callable[[list[Tensor], list[Tensor]], tuple[Tensor, Tensor]]


class DistilledSetServer:
    """The server side of the distillation phase: stage 0 sends theta_d (``distill_theta()``)
    to the clients that train (``training_clients()``: None for all; held-out new clients
    join later, so their images must not be in the S the others use) and receives the S_i;
    ``merge`` (default: Eq. 7) makes S of them; stage 1 sends S to every client."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        device: torch.device,
        distill_theta: Callable[[], Tensor],
        training_clients: Callable[[], list[int] | None] = lambda: None,
        merge: Merge = merge_synthetic,
    ) -> None:
        self.input_shape, self.num_classes, self.device = input_shape, num_classes, device
        self.distill_theta = distill_theta
        self.training_clients = training_clients
        self.merge = merge
        self.syn_x = torch.zeros(0, *input_shape, device=device)
        self.syn_y = torch.zeros(0, dtype=torch.long, device=device)

    def shared_synthetic(self) -> tuple[Tensor, Tensor] | None:
        return (self.syn_x, self.syn_y) if self.syn_y.numel() else None

    def configure_setup(self, stage: int, client_ids: list[int]) -> dict[int, Payload]:
        if stage == 0:
            training = self.training_clients()
            ids = client_ids if training is None else [c for c in client_ids if c in training]
            theta_d = self.distill_theta()
            return {c: {"theta_d": theta_d} for c in ids}
        if stage == 1:
            return {c: {"syn_x": self.syn_x, "syn_y": self.syn_y} for c in client_ids}
        return {}

    def check_setup_reply(self, stage: int, client_id: int, reply: Payload) -> str | None:
        if stage != 0:
            return None if not reply else f"unexpected keys {sorted(reply)}"
        if set(reply) != set(SYNTHETIC_KEYS):
            return f"expected keys syn_x, syn_y (got {sorted(reply)})"
        x, y = reply["syn_x"], reply["syn_y"]
        shape = tuple(self.input_shape)
        if x.dim() != 1 + len(shape) or tuple(x.shape[1:]) != shape or not x.is_floating_point():
            return f"syn_x has shape {tuple(x.shape)}, expected (M, {', '.join(map(str, shape))})"
        if y.shape != (x.shape[0],) or y.is_floating_point():
            return f"syn_y has shape {tuple(y.shape)}, expected integer ({x.shape[0]},)"
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            return f"syn_y holds a class outside [0, {self.num_classes})"
        return nonfinite_tensor(reply)

    def aggregate_setup(self, stage: int, replies: dict[int, Payload]) -> None:
        if stage != 0 or not replies:
            return
        ids = sorted(replies)
        x, y = self.merge([replies[c]["syn_x"] for c in ids], [replies[c]["syn_y"] for c in ids])
        self.syn_x, self.syn_y = x.to(self.device), y.long().to(self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"syn_x": self.syn_x, "syn_y": self.syn_y}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.syn_x, self.syn_y = state["syn_x"].to(self.device), state["syn_y"].to(self.device)


class DistilledSetClient:
    """The client side of the distillation phase and the synthetic terms of Eq. 9; S lives in
    the client state (``syn_x``, ``syn_y``; one shared storage for the clients of a group).
    ``hp`` gives ``distill_model`` and ``distill_config()`` (and, for Eq. 9, DDParams')."""

    def __init__(
        self,
        hp: Any,
        input_shape: tuple[int, ...],
        num_classes: int,
        device: torch.device,
    ) -> None:
        self.hp = hp
        self.input_shape, self.device = input_shape, device
        module = build_model(hp.distill_model, input_shape, num_classes)
        self.distill_fm = FunctionalModel(module.to(device), hp.distill_model)

    def init_state(self, num_clients: int) -> dict[str, Tensor]:
        """An empty S for each client, until stage 1 delivers it."""
        return {
            "syn_x": torch.zeros(num_clients, 0, *self.input_shape, device=self.device),
            "syn_y": torch.zeros(num_clients, 0, dtype=torch.long, device=self.device),
        }

    def setup(
        self, stage: int, group: BatchGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[list[Payload], dict[str, Tensor], dict[str, Tensor]]:
        n = len(group.client_ids)
        if stage == 0:  # Alg. 1, ClientDatasetDistillation(theta_d)
            seeds = [client_seed(group.seed, 0, c, DISTILL_SALT) for c in group.client_ids]
            xs, ys, stats = distill_synthetic(
                self.distill_fm,
                msg["theta_d"][0],
                group.data,
                group.client_ids,
                self.hp.distill_config(),
                seeds,
                net_seed=group.seed,
                label=f"distilling synthetic sets ({self.hp.distill_model})",
            )
            return [{"syn_x": x, "syn_y": y} for x, y in zip(xs, ys)], state, stats
        # stage 1: keep S (the same for every client: one storage, expanded)
        x, y = msg["syn_x"][:1].clone(), msg["syn_y"][:1].clone()
        new_state = {
            **state,
            "syn_x": x.expand(n, *x.shape[1:]),
            "syn_y": y.expand(n, *y.shape[1:]),
        }
        return [{} for _ in range(n)], new_state, {}

    def heavy_phases(self, group: BatchGroup) -> list[PhaseCost]:
        """The setup's distillation of ``group``'s clients, timed by a short probe (``hyperfed
        run`` prints it before the run). Its cost grows with ``distill_iters`` x the clients x
        (``ipc`` + ``distill_batch_real``) x the classes a client holds, per ``distill_model``
        forward and backward pass."""
        hp = self.hp
        cfg = hp.distill_config()
        seeds = [client_seed(group.seed, 0, c, DISTILL_SALT) for c in group.client_ids]
        seconds = distill_cost(self.distill_fm, group.data, group.client_ids, cfg, seeds)
        what = (
            f"setup distillation: {clients_text(group.client_ids, group.data.num_clients)} x "
            f"{cfg.iters} iterations of {hp.distill_model} (ipc {cfg.ipc}, "
            f"{cfg.batch_real} real per class)"
        )
        return [PhaseCost(what, seconds)]

    def synthetic_kwargs(
        self, group: BatchGroup, state: dict[str, Tensor], steps: int | None = None
    ) -> dict[str, Any]:
        """``loss_fn``, ``ctx`` and ``step_ctx`` for local training (Eq. 9) over ``steps``
        local steps (default: the group's own plan); empty (plain CE) before the distillation
        phase has delivered S."""
        hp = self.hp
        m = int(state["syn_y"].shape[1])
        if m == 0:
            return {}
        syn_idx = group_batches(group, m, hp.syn_batch, SYNTHETIC_SALT, steps)
        loss_fn = partial(
            synthetic_objective,
            lambda_s=hp.lambda_s,
            lambda_reg=hp.lambda_reg,
            mixup=hp.mixup,
            use_universum=hp.universum,
            temperature=hp.tau_temp,
            use_real=hp.train_on == "both",
        )
        return {
            "loss_fn": loss_fn,
            "ctx": {"syn_x": state["syn_x"], "syn_y": state["syn_y"]},
            "step_ctx": {"syn_idx": syn_idx.to(state["syn_y"].device)},
        }
