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
images (zero DM loss); ``hyperfed attack`` measures it (docs/privacy.md). DP starts from noise.

**DP (Table 6).** §4.6 runs "differential privacy (Abadi et al., 2016) ... when generating
synthetic data" and gives no sigma, epsilon, clipping norm or delta (so ``dp_noise = 1.0`` in
our configs and docs/results.md is our choice, not the paper's). Two mechanisms, ``dp_mechanism``:

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

**Composition.** All three are :func:`~hyperfed.algorithms.compose.plug_in` of a method (the
distilled set is a component the composed roles hold, :mod:`hyperfed.distill.component`):
MH-pFedHN whose hypernetwork has a slot for theta_d (:class:`MHPFedHNDistillServer`, the
``distill_theta`` capability), pFedHN the same with one chunk per client, and FedAvg with the
one-shot option (:class:`OneShotFedAvgServer`, the ``receive_synthetic`` capability).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    ClientGroup,
    Payload,
    ServerContext,
    chosen,
    paper,
)
from hyperfed.algorithms.compose import plug_in
from hyperfed.algorithms.fedavg import FedAvgClient, FedAvgParams, FedAvgServer
from hyperfed.algorithms.mh_pfedhn import (
    GLOBAL,
    MHPFedHNClient,
    MHPFedHNParams,
    MHPFedHNServer,
)
from hyperfed.data.federated import FederatedData
from hyperfed.distill.component import distill_model_size
from hyperfed.engine.local import SGDConfig, plan_batches, train_clients
from hyperfed.hparams import Count, NonNegInt, Positive
from hyperfed.models.layout import FunctionalModel
from hyperfed.progress import phase

DISTILL = GLOBAL  # theta_d's hypernetwork slot (MH-pFedHNDD has no global model)


# -- MH-pFedHN with a slot for theta_d --------------------------------------------------------
@dataclass
class MHPFedHNDistillParams(MHPFedHNParams):
    """MH-pFedHN's hypernetwork settings (hn_lr 2e-4, as §B.2 gives for MH-pFedHNDD)."""

    def __post_init__(self) -> None:
        MHPFedHNParams.__post_init__(self)
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
class PFedHNDistillParams(MHPFedHNDistillParams):
    """Table 5: pFedHN (one chunk of K_i per client)."""

    out_dim: Count | None = paper(None, "seed 003 Table 5 (pFedHN: one chunk per client)")


class MHPFedHNDistillServer(MHPFedHNServer):
    """MH-pFedHN's server; its hypernetwork also generates theta_d from v_d (slot DISTILL)."""

    def extra_models(self, clients: dict[int, Payload]) -> dict[int, int]:
        hp, ctx = self.hp, self.ctx
        return {DISTILL: distill_model_size(hp.distill_model, ctx.input_shape, ctx.num_classes)}

    @torch.no_grad()
    def distill_theta(self) -> Tensor:
        return self.hnet.generate([DISTILL])[DISTILL]


# -- FedAvg with Table 9's one-shot mode ------------------------------------------------------
@dataclass
class OneShotFedAvgParams(FedAvgParams):
    """FedAvg; ``one_shot``: Table 9's one-shot row (the server trains one model on S for
    ``one_shot_epochs`` of SGD, batch 64, momentum 0.9)."""

    one_shot: bool = paper(False, "seed 003 Table 5 (FedAvg + DD trains every round)")
    one_shot_epochs: NonNegInt = chosen(50, "Table 9 gives no one-shot schedule")
    one_shot_lr: Positive = chosen(0.01, "App. B.2's FedAvg lr; one-shot's not given")


class OneShotFedAvgServer(FedAvgServer):
    """FedAvg's server (one global model per architecture). One-shot: each global model is
    trained on the merged S once, when the setup delivers it (``receive_synthetic``)."""

    def __init__(self, hp: Any, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.buffers = {
            key: ctx.model_with(int(key)).initial_buffers().to(ctx.device) for key in self.theta
        }

    def receive_synthetic(self, syn_x: Tensor, syn_y: Tensor) -> None:
        if not (self.hp.one_shot and syn_y.numel()):
            return
        label = f"server: one-shot training on S, {self.hp.one_shot_epochs} epochs per model"
        with phase(label, len(self.theta)) as tick:
            for key in self.theta:
                fm = self.ctx.model_with(int(key))
                self.theta[key], self.buffers[key] = self._train_on_synthetic(
                    fm, self.theta[key], self.buffers[key], syn_x, syn_y
                )
                tick.advance()

    def _train_on_synthetic(
        self, fm: FunctionalModel, theta: Tensor, buffers: Tensor, syn_x: Tensor, syn_y: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One-shot: the server trains a model on S (a client axis of 1)."""
        m = syn_y.numel()
        data = FederatedData(
            x=syn_x,
            y=syn_y,
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


class OneShotFedAvgClient(FedAvgClient):
    """FedAvg's client; one-shot: no local training, evaluated with the server's model."""

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        if self.hp.one_shot:
            zeros = torch.zeros(group.size, device=state["buffers"].device)
            return {}, state, zeros
        return super().fit(group, msg, state)

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        if self.hp.one_shot:
            return msg["theta"], msg.get("buffers", state["buffers"])
        return super().eval_model(group, msg, state)


_LOCAL = {"lr": 1e-3, "momentum": 0.9, "weight_decay": 1e-4, "epochs": 1}  # §4, §B.2


def _method(
    name: str, hparams: type, server: type, client: type, scores: str = "personalized"
) -> Algorithm:
    """The method a plug-in composes (not registered itself); ``scores``: the model its
    evaluation scores (algorithms.base.SCORED_MODELS)."""
    return Algorithm(
        name=name, summary=name, hparams=hparams, server=server, client=client, scores=scores
    )


ALGORITHMS = [
    plug_in(
        _method("mh_pfedhn", MHPFedHNDistillParams, MHPFedHNDistillServer, MHPFedHNClient),
        name="mh_pfedhndd",
        summary="MH-pFedHNDD: MH-pFedHN + distilled synthetic set and UniCon loss (seed 003)",
        hparams_name="MHPFedHNDDParams",
        local_defaults=_LOCAL,
    ),
    plug_in(
        _method("pfedhn", PFedHNDistillParams, MHPFedHNDistillServer, MHPFedHNClient),
        name="pfedhn_dd",
        summary="pFedHN + MH-pFedHNDD's distilled set (seed 003, Table 5)",
        hparams_name="PFedHNDDParams",
        local_defaults=_LOCAL,
    ),
    plug_in(
        # FedAvg's global model is what every client is evaluated with (one-shot too)
        _method("fedavg", OneShotFedAvgParams, OneShotFedAvgServer, OneShotFedAvgClient, "global"),
        name="fedavg_dd",
        summary="FedAvg + MH-pFedHNDD's distilled set; one_shot: Table 9 (seed 003)",
        hparams_name="FedAvgDDParams",
        local_defaults={"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-4, "epochs": 1},
    ),
]
# the composed roles and hyperparameters, by the names the tests and docs use
MHPFedHNDDParams, PFedHNDDParams, FedAvgDDParams = (a.hparams for a in ALGORITHMS)
MHPFedHNDDServer, MHPFedHNDDClient = ALGORITHMS[0].server, ALGORITHMS[0].client
FedAvgDDServer, FedAvgDDClient = ALGORITHMS[2].server, ALGORITHMS[2].client
