"""MH-pFedHNDD (seed 003, Algorithm 1): MH-pFedHN with a one-off dataset-distillation phase.

**Distillation phase** (§3.4; the setup exchanges of ``base.py``, run once before round 1):

* setup stage 0 -- the server generates the distillation model theta_d = h(v_d; phi)[:K_d]
  from its own embeddings v_d with the same multi-head hypernetwork (v_d takes the extra-model
  slot that MH-pFedHNG's global model uses; ``distill_model`` is ConvNet, Table 10, by
  default) and sends it to every client. Each client synthesizes ``ipc`` images for every
  class it holds, starting from its real samples, and optimizes them for ``distill_iters``
  iterations with L_DM + lambda_CC L_CC (Eq. 4-6, :func:`distill_synthetic`); it uploads
  S_i (``syn_x``, ``syn_y``: the only keys of its reply).
* the server merges the S_i by label into S (Eq. 7, :func:`merge_synthetic`);
* setup stage 1 -- the server sends S to every client, which keeps it in its state.

**Training phase** (§3.5): MH-pFedHN rounds (server side unchanged) whose local loss is Eq. 9,
CE(B_D) + lambda_S CE(B_S) + lambda_Reg L_Reg with L_Reg the UniCon loss of Eq. 8 (Mixup
universum negatives, lambda = ``mixup``); a synthetic batch of ``syn_batch`` samples is drawn
from S at every local step (per-step indices through ``step_ctx``, so the step stays vmapped).

The distillation model theta_d is the one the server sends, kept fixed through the T
iterations as Alg. 1 reads; ``distill_resample = true`` instead re-initializes a random
network every iteration after the first, as DM (Zhao & Bilen) does.

Privacy: started from real samples (``distill_init = "auto"`` without DP), S_i stays close to
the client's images and, for a class the client holds at most ``ipc`` samples of, *is* those
images (zero DM loss); ``hyperfed attack`` measures it (README "Privacy"). DP starts from noise.

**DP (Table 6).** §4.6 runs "differential privacy (Abadi et al., 2016) ... when generating
synthetic data" and gives no sigma, epsilon, clipping norm or delta (so ``dp_noise = 1.0`` in
our configs and README is our choice, not the paper's). Two mechanisms, ``dp_mechanism``:

* ``"dp_sgd"`` (default, the paper's citation): DP-SGD on the synthetic images. At every one of
  the T iterations each real sample's gradient (its term of L_DM + lambda_CC L_CC w.r.t. S_i,
  from ``torch.func`` per-sample gradients) is clipped to ``dp_clip``, the sum gets
  ``N(0, (sigma dp_clip)^2)`` noise on every pixel of S_i and is divided by the lot size.
  L_CC's real anchors contrast with S_i only (one real sample per term). Costs a backward pass
  through theta_d per real sample and iteration.
* ``"features"``: each real feature (input of theta_d's last layer) is clipped to ``dp_clip``
  and the per-class feature sums get the noise; L_DM and L_CC use the noisy class means. One
  backward per iteration as without DP, and the noise is d-dimensional per class instead of
  S_i-dimensional, so the images move more per unit of privacy; it is not what Abadi et al.
  describe.

Both are the subsampled Gaussian mechanism with sensitivity ``dp_clip`` per iteration, so for
the same sigma, sampling rate ``q = max_c batch_real / n_c`` and steps they have the same
epsilon (Opacus' RDP accountant, ``hyperfed.privacy.accounting``); ``dp_epsilon`` calibrates
sigma to a target, ``dp_noise`` gives sigma and the setup statistics report ``dp_epsilon``.
Steps = T: a client distills once (Alg. 1), never again in later rounds. The guarantee covers
the uploaded S_i only, not the training-phase model updates (neither does the paper's).

**Ablations** (config keys under ``[algorithm]``): ``lambda_cc = 0`` (Table 3, w/o L_CC),
``universum = false`` (Table 3, w/o UniNeg: L_Reg is SupCon over B_D u B_S), ``ipc`` (Table 4),
``train_on = "synthetic"`` (Table 9, only S), DP (Table 6: ``dp_noise`` or ``dp_epsilon``,
``dp_mechanism``, ``dp_clip``, ``dp_delta``; needs ``pip install hyperfed[privacy]``), participation (Table 8,
the top-level ``participation`` key). Plug-ins (Table 5): ``pfedhn_dd`` (pFedHN's hypernetwork,
one chunk per client) and ``fedavg_dd`` (FedAvg; the server sends a randomly initialized
theta_d); ``fedavg_dd`` with ``one_shot = true`` is Table 9's one-shot row (the server trains
one model on S; clients only evaluate it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    ClientGroup,
    Payload,
    Server,
    ServerContext,
    chosen,
    nonfinite_tensor,
    paper,
)
from hyperfed.algorithms.dataset_distillation import (
    DistillConfig,
    clients_text,
    distill_cost,
    distill_synthetic,
    group_batches,
    merge_synthetic,
    synthetic_objective,
)
from hyperfed.algorithms.fedavg import FedAvgClient, FedAvgServer
from hyperfed.algorithms.mh_pfedhn import (
    GLOBAL,
    MHPFedHNClient,
    MHPFedHNParams,
    MHPFedHNServer,
    encode_update,
)
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig, client_seed, plan_batches, train_clients
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model
from hyperfed.progress import PhaseCost, phase

DISTILL = GLOBAL  # theta_d's hypernetwork slot (MH-pFedHNDD has no global model)
DISTILL_SALT = 31  # seeds of the distillation phase
SYNTHETIC_SALT = 37  # seeds of the synthetic batches in local training


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


@dataclass
class MHPFedHNDDParams(MHPFedHNParams, DDParams):
    """MH-pFedHN's hypernetwork settings (hn_lr 2e-4, as §B.2 gives for MH-pFedHNDD) + DD."""

    def __post_init__(self) -> None:
        MHPFedHNParams.__post_init__(self)
        self.check_dd()
        if self.global_model:
            raise ValueError("mh_pfedhndd takes no global_model (theta_d uses that slot)")
        # inherited from MH-pFedHN but not served by this client (it trains every layer)
        for name in ("personal_layers", "frozen_layers"):
            if getattr(self, name):
                raise ValueError(
                    f"{name}: the MH-pFedHNDD client trains every generated layer (seed 000's "
                    f"Tables 13-15 ablations are MH-pFedHN's); remove {name}"
                )


@dataclass
class PFedHNDDParams(MHPFedHNDDParams):
    """Table 5: pFedHN (one chunk of K_i per client) + the distilled set."""

    out_dim: int | None = paper(None, "seed 003 Table 5 (pFedHN: one chunk per client)")


@dataclass
class FedAvgDDParams(DDParams):
    """Table 5: FedAvg + the distilled set; ``one_shot``: Table 9's one-shot row (the server
    trains one model on S for ``one_shot_epochs`` of SGD, batch 64, momentum 0.9)."""

    one_shot: bool = paper(False, "seed 003 Table 5 (FedAvg + DD trains every round)")
    one_shot_epochs: int = chosen(50, "Table 9 gives no one-shot schedule")
    one_shot_lr: float = chosen(0.01, "App. B.2's FedAvg lr; one-shot's not given")

    def __post_init__(self) -> None:
        self.check_dd()


# -- server -----------------------------------------------------------------------------------
class SyntheticSetupServer(Server):
    """The server side of the distillation phase: stage 0 sends theta_d and receives the S_i,
    stage 1 sends the merged S (Eq. 7) to every client."""

    def __init__(self, hp: Any, clients: dict[int, Payload], ctx: ServerContext) -> None:
        # K_d first: MH-pFedHNDD's hypernetwork (built in super().__init__) has a slot for it
        module = build_model(hp.distill_model, ctx.input_shape, ctx.num_classes)
        self.distill_size = sum(p.numel() for p in module.parameters())
        super().__init__(hp, clients, ctx)
        self.syn_x = torch.zeros(0, *ctx.input_shape, device=ctx.device)
        self.syn_y = torch.zeros(0, dtype=torch.long, device=ctx.device)

    def distill_theta(self) -> Tensor:
        raise NotImplementedError

    def shared_synthetic(self) -> tuple[Tensor, Tensor] | None:
        return (self.syn_x, self.syn_y) if self.syn_y.numel() else None

    def configure_setup(self, stage: int, client_ids: list[int]) -> dict[int, Payload]:
        if stage == 0:
            # only clients that train distill: held-out clients (new_clients, Fig. 3) join
            # later, so their images must not be in the S the training clients use
            training = self.eligible_clients(1)
            ids = client_ids if training is None else [c for c in client_ids if c in training]
            theta_d = self.distill_theta()
            return {c: {"theta_d": theta_d} for c in ids}
        if stage == 1:
            return {c: {"syn_x": self.syn_x, "syn_y": self.syn_y} for c in client_ids}
        return {}

    def check_setup_reply(self, stage: int, client_id: int, reply: Payload) -> str | None:
        if stage != 0:
            return None if not reply else f"unexpected keys {sorted(reply)}"
        if set(reply) != {"syn_x", "syn_y"}:
            return f"expected keys syn_x, syn_y (got {sorted(reply)})"
        x, y = reply["syn_x"], reply["syn_y"]
        shape = tuple(self.ctx.input_shape)
        if x.dim() != 1 + len(shape) or tuple(x.shape[1:]) != shape or not x.is_floating_point():
            return f"syn_x has shape {tuple(x.shape)}, expected (M, {', '.join(map(str, shape))})"
        if y.shape != (x.shape[0],) or y.is_floating_point():
            return f"syn_y has shape {tuple(y.shape)}, expected integer ({x.shape[0]},)"
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.ctx.num_classes):
            return f"syn_y holds a class outside [0, {self.ctx.num_classes})"
        return nonfinite_tensor(reply)

    def aggregate_setup(self, stage: int, replies: dict[int, Payload]) -> None:
        if stage != 0 or not replies:
            return
        ids = sorted(replies)
        x, y = merge_synthetic(
            [replies[c]["syn_x"] for c in ids], [replies[c]["syn_y"] for c in ids]
        )
        self.syn_x, self.syn_y = x.to(self.ctx.device), y.long().to(self.ctx.device)


class MHPFedHNDDServer(SyntheticSetupServer, MHPFedHNServer):
    """MH-pFedHN's server; its hypernetwork also generates theta_d from v_d."""

    def extra_models(self, clients: dict[int, Payload]) -> dict[int, int]:
        return {DISTILL: self.distill_size}

    @torch.no_grad()
    def distill_theta(self) -> Tensor:
        return self.hnet.generate([DISTILL])[DISTILL]


class FedAvgDDServer(SyntheticSetupServer, FedAvgServer):
    """FedAvg's server (one global model per architecture); theta_d is a seeded random
    initialization of ``distill_model``. One-shot: each global model is trained on S once."""

    def __init__(self, hp: FedAvgDDParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.buffers = {
            key: ctx.model_with(int(key)).initial_buffers().to(ctx.device) for key in self.theta
        }

    def distill_theta(self) -> Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.ctx.seed + DISTILL_SALT)
            module = build_model(self.hp.distill_model, self.ctx.input_shape, self.ctx.num_classes)
        return FunctionalModel(module).initial_params().to(self.ctx.device)

    def aggregate_setup(self, stage: int, replies: dict[int, Payload]) -> None:
        super().aggregate_setup(stage, replies)
        if stage == 0 and self.hp.one_shot and self.syn_y.numel():
            label = f"server: one-shot training on S, {self.hp.one_shot_epochs} epochs per model"
            with phase(label, len(self.theta)) as tick:
                for key in self.theta:
                    fm = self.ctx.model_with(int(key))
                    self.theta[key], self.buffers[key] = self._train_on_synthetic(
                        fm, self.theta[key], self.buffers[key]
                    )
                    tick.advance()

    def _train_on_synthetic(
        self, fm: FunctionalModel, theta: Tensor, buffers: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One-shot: the server trains a model on S (a client axis of 1)."""
        m = self.syn_y.numel()
        data = FederatedData(
            x=self.syn_x,
            y=self.syn_y,
            train_idx=[torch.arange(m, device=self.ctx.device)],
            val_idx=[],
            test_idx=[],
            num_classes=self.ctx.num_classes,
            input_shape=self.ctx.input_shape,
            mean=torch.zeros(0),
            std=torch.zeros(0),
        )
        sgd = SGDConfig(
            lr=self.hp.one_shot_lr,
            momentum=0.9,
            weight_decay=1e-4,
            epochs=self.hp.one_shot_epochs,
            batch_size=64,
        )
        plan = plan_batches(data.train_idx, sgd.epochs, sgd.batch_size, [self.ctx.seed])
        out, new_buffers, _ = train_clients(
            fm, theta[None], buffers[None], data, plan, sgd, vectorize=False
        )
        return out[0], new_buffers[0]

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        if self.hp.one_shot:  # nothing to train: the models were fit on S during setup
            return {c: {} for c in client_ids}
        return super().configure_train(rnd, client_ids)

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        if not self.hp.one_shot:
            return super().configure_eval(client_ids)
        keys = {c: str(self.size[c]) for c in client_ids}
        return {c: {"theta": self.theta[k], "buffers": self.buffers[k]} for c, k in keys.items()}

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        if self.hp.one_shot:
            return None if not reply else f"unexpected keys {sorted(reply)}"
        return super().check_reply(client_id, reply)

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if not self.hp.one_shot:
            super().aggregate(rnd, replies)


# -- client -----------------------------------------------------------------------------------
class SyntheticClient(Client):
    """The client side of the distillation phase and the synthetic terms of Eq. 9; S lives in
    the client state (``syn_x``, ``syn_y``; one shared storage for the clients of a group)."""

    def __init__(self, hp: Any, ctx: ClientContext) -> None:
        super().__init__(hp, ctx)
        module = build_model(hp.distill_model, ctx.input_shape, ctx.num_classes)
        self.distill_fm = FunctionalModel(module.to(ctx.device), hp.distill_model)

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        state["syn_x"] = torch.zeros(num_clients, 0, *self.ctx.input_shape, device=self.ctx.device)
        state["syn_y"] = torch.zeros(num_clients, 0, dtype=torch.long, device=self.ctx.device)
        return state

    def setup(
        self, stage: int, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[list[Payload], dict[str, Tensor], dict[str, Tensor]]:
        n = group.size
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

    def heavy_phases(self, group: ClientGroup) -> list[PhaseCost]:
        """The setup's distillation of ``group``'s clients, timed by a short probe (``hyperfed
        run`` prints it before the run). Its cost grows with ``distill_iters`` x the clients x
        (``ipc`` + ``distill_batch_real``) x the classes a client holds, per ``distill_model``
        forward and backward pass."""
        hp = self.hp
        cfg = hp.distill_config()
        seeds = [client_seed(group.seed, 0, c, DISTILL_SALT) for c in group.client_ids]
        fm = self.distill_fm
        seconds = distill_cost(fm, group.data, group.client_ids, cfg, seeds)
        what = (
            f"setup distillation: {clients_text(group.client_ids, group.data.num_clients)} x "
            f"{cfg.iters} iterations of {hp.distill_model} (ipc {cfg.ipc}, "
            f"{cfg.batch_real} real per class)"
        )
        return [PhaseCost(what, seconds)]

    def synthetic_kwargs(
        self, group: ClientGroup, state: dict[str, Tensor], steps: int | None = None
    ) -> dict[str, Any]:
        """``loss_fn``, ``ctx`` and ``step_ctx`` for ``group.train`` (Eq. 9) over ``steps`` local
        steps (default: the group's own plan); empty (plain CE) before the distillation phase
        has delivered S."""
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


class MHPFedHNDDClient(SyntheticClient, MHPFedHNClient):
    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        kwargs = self.synthetic_kwargs(group, state)
        theta, buffers, loss = group.train(msg["theta"], state["buffers"], **kwargs)
        reply = encode_update(theta - msg["theta"], self.hp.upload_fraction, "delta")
        return reply, {**state, "buffers": buffers}, loss


class FedAvgDDClient(SyntheticClient, FedAvgClient):
    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        if self.hp.one_shot:
            zeros = torch.zeros(group.size, device=state["buffers"].device)
            return {}, state, zeros
        kwargs = self.synthetic_kwargs(group, state)
        theta, buffers, loss = group.train(msg["theta"], state["buffers"], **kwargs)
        return {"theta": theta}, {**state, "buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return msg["theta"], msg.get("buffers", state["buffers"])


# what `hyperfed list algorithms` says drives the cost (configs/distill_cpu.toml: a CPU preset)
DD_COST = (
    "; cost: the setup's distillation, distill_iters x clients x classes x (ipc + "
    "distill_batch_real) images through distill_model"
)

_LOCAL = {"lr": 1e-3, "momentum": 0.9, "weight_decay": 1e-4, "epochs": 1}  # §4, §B.2

ALGORITHMS = [
    Algorithm(
        name="mh_pfedhndd",
        summary="MH-pFedHNDD: MH-pFedHN + distilled synthetic set and UniCon loss (seed 003)"
        f"{DD_COST}",
        hparams=MHPFedHNDDParams,
        server=MHPFedHNDDServer,
        client=MHPFedHNDDClient,
        local_defaults=_LOCAL,
    ),
    Algorithm(
        name="pfedhn_dd",
        summary=f"pFedHN + MH-pFedHNDD's distilled set (seed 003, Table 5){DD_COST}",
        hparams=PFedHNDDParams,
        server=MHPFedHNDDServer,
        client=MHPFedHNDDClient,
        local_defaults=_LOCAL,
    ),
    Algorithm(
        name="fedavg_dd",
        summary=f"FedAvg + MH-pFedHNDD's distilled set; one_shot: Table 9 (seed 003){DD_COST}",
        hparams=FedAvgDDParams,
        server=FedAvgDDServer,
        client=FedAvgDDClient,
        local_defaults={"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-4, "epochs": 1},
    ),
]
