"""DESA (Huang et al., ICML 2024): decentralized FL with synthetic anchors, heterogeneous models.

Reference: the paper and the authors' code (``ubc-tea/DESA``: ``iterative_desa.py`` for the
pipeline and the KD term, ``loss_fn.py`` for SupCon, ``condensation.py`` for DM); where the
paper gives no constant, the defaults and the loss reductions are the code's.

The paper's pipeline (§3):

1. **local data synthesis** (§3.2): each client distills ``ipc`` synthetic images per class
   from noise by distribution matching (DM, Zhao & Bilen: per class
   ``||mean psi(x_c) - mean psi(s_c)||^2``, summed over classes, psi a *freshly initialized*
   ConvNet every iteration), independent of its own model;
2. **global anchor aggregation** (§3.2): the clients' synthetic sets are mixed into one set of
   global anchors D^Syn, class by class: anchor ``j`` of class ``c`` is the mean of the
   clients' ``j``-th class-``c`` images;
3. **training** (§3.3-3.4), round after round, each client's own model theta_i with
   ``L = CE(D_i u D^Syn) + lambda_REG L_REG + lambda_KD L_KD``:
   ``L_REG`` a supervised contrastive loss (SupCon, temperature ``tau_reg``) between the
   features of the client's real batch and of an anchor batch (anchor features detached: the
   anchors pull the client's embedding), averaged over *all* the batch's samples with a sample
   that has no positive counting 0 (``loss_fn.SupConLoss``); ``L_KD`` on the anchors towards
   the mean of the *other* clients' logits on them (temperature ``kd_temperature``), which the
   clients share after each round, term for term the code's ``calculate_kd_loss``:
   ``(1 - kd_alpha) CE(z_A, y_A) + kd_alpha T^2 KL(softmax(teacher/T) || softmax(z_A/T))`` with
   ``kd_alpha = 0.9`` and the KL of ``nn.KLDivLoss()``, whose default reduction ``'mean'``
   averages over batch *and classes* (``kd_reduction="mean"``); ``kd_reduction="batchmean"``
   is the textbook KL (summed over classes, averaged over the batch: K times stronger).

**Runtime: a centralized relay.** DESA is decentralized (neighbours exchange anchors once and
logits each round); seed 003 compares it in its centralized table (Table 1-2, lower part).
Its official code averages over *every* participating client (a complete graph), which a
relay reproduces exactly: the server forwards, and never trains anything. Setup stage 0 (one
shot) collects the clients' synthetic sets, the server mixes them into D^Syn (step 2), stage
1 sends D^Syn to everyone, stage 2 collects each client's logits on D^Syn from its initial
model (the official code's logits before its first iteration). In round t the server sends
client i the mean of the latest logits of the other clients (``teacher``), the client trains
and replies with its logits on D^Syn after training (the logits the others learn from next
round). A non-sampled client's logits stay as it last sent them (the official code then
averages only over this round's participants). The relay holds D^Syn as ``syn_x``/``syn_y``
(what ``hyperfed attack`` scores).

Shared mechanics: stage 0 and 1 are MH-pFedHNDD's distillation phase, a component the relay
and the client hold (:class:`~hyperfed.distill.component.DistilledSetServer` with
:func:`mix_anchors` as its merge, :class:`~hyperfed.distill.component.DistilledSetClient`, with
:func:`~hyperfed.distill.synthesis.distill_synthetic` set to DM: noise
initialization, a fresh network every iteration, no contrastive term); ``L_REG`` is
:func:`~hyperfed.distill.losses.supcon_loss` (rescaled to the code's mean over
all samples); ``L_KD``'s KL is :func:`~hyperfed.engine.losses.kd_loss`.

Differences from the official code: **no DiffAugment in the synthesis** (the code's DM
augments each class's real and synthetic batch with the same differentiable augmentation,
DSA's ``color_crop_cutout_flip_scale_rotate``; ``distill_synthetic`` has no augmentation, so
the anchors here are plain DM's); ``distill_batch_real`` 64 real images per class and
iteration (the code draws 256); the anchors of a class average the clients *that hold it*
(the code assumes every client holds every class); ``CE(D_i u D^Syn)`` is the cross-entropy
over one local batch joined with one anchor batch per step, in one forward pass (one set of
BatchNorm batch statistics), and that anchor batch also serves ``L_REG`` and ``L_KD`` (the code
draws its CE batch from the concatenated dataset ``D_i u D^Syn`` and two further anchor
batches, each its own forward pass); ``L_KD``'s CE part therefore counts the anchor batch a
second time, as the code's does; the local batch is the run's ``local.batch_size`` (the code:
32, and ``anchor_batch`` 32).

The KD reduction: the official ``mean`` with ``kd_alpha=0.9`` and the KL-only ``batchmean``
(``kd_alpha=1``) score alike on a validation split, at T = 20 the term is small either way
(docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal, get_args

import torch
import torch.nn.functional as F
from annotated_types import Ge, Lt
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    ClientGroup,
    Payload,
    PersonalModelClient,
    Server,
    ServerContext,
    chosen,
    nonfinite_tensor,
)
from hyperfed.distill.component import (
    DistilledSetClient,
    DistilledSetServer,
    seeded_distill_theta,
)
from hyperfed.distill.losses import group_batches, supcon_loss
from hyperfed.distill.synthesis import DistillConfig
from hyperfed.engine.losses import kd_loss
from hyperfed.engine.metering import FlopMeter
from hyperfed.errors import ConfigError
from hyperfed.hparams import Count, NonNeg, NonNegInt, Positive, Unit
from hyperfed.models.layout import FunctionalModel
from hyperfed.progress import PhaseCost

ANCHOR_SALT = 53  # seeds of the anchor batches in local training
# "mean": the KL averaged over batch x classes (the official code's nn.KLDivLoss() default);
# "batchmean": summed over classes, averaged over the batch (the KL's definition)
KDReduction = Literal["mean", "batchmean"]
KD_REDUCTIONS = get_args(KDReduction)


@dataclass
class DESAParams:
    ipc: Count = chosen(50, "seed 003 §4 runs DESA with IPC 50 (the official code's default)")
    distill_iters: NonNegInt = chosen(1000, "seed 003 §4; the official code's inv_iters")
    distill_lr: Positive = chosen(1.0, "official code: SGD on the images, lr 1, momentum 0.5")
    distill_momentum: Annotated[float, Ge(0), Lt(1)] = chosen(0.5, "official code")
    distill_batch_real: Count = chosen(64, "MH-pFedHNDD's; the official code draws 256 per class")
    distill_model: str = chosen("convnet", "official code: a random ConvNet per iteration")
    lambda_reg: NonNeg = chosen(1.0, "official code's default lambda_reg")
    lambda_kd: NonNeg = chosen(1.0, "official code's default lambda_kd")
    tau_reg: Positive = chosen(0.07, "official code's SupCon temperature")
    kd_temperature: Positive = chosen(20.0, "official code's KD temperature")
    kd_alpha: Unit = chosen(
        0.9, "official code's calculate_kd_loss: distil_weight 0.9 on T^2 KL, 0.1 on CE"
    )
    kd_reduction: KDReduction = chosen(
        "mean", "official code: nn.KLDivLoss()'s default 'mean', over batch x classes"
    )
    anchor_batch: Count = chosen(32, "official code: anchor batch = local batch 32")

    def distill_config(self) -> DistillConfig:
        """Step 1: DM from noise with a fresh random network every iteration."""
        return DistillConfig(
            ipc=self.ipc,
            iters=self.distill_iters,
            lr=self.distill_lr,
            momentum=self.distill_momentum,
            batch_real=self.distill_batch_real,
            lambda_cc=0.0,
            init="noise",
            resample=True,
        )


def mix_anchors(
    xs: list[Tensor], ys: list[Tensor], ipc: int, num_classes: int
) -> tuple[Tensor, Tensor]:
    """Step 2: global anchors, class by class the mean over the clients holding class ``c`` of
    their ``j``-th image of class ``c`` (``j < ipc``). Ordered by class."""
    out_x, out_y = [], []
    for c in range(num_classes):
        own = [x[y == c] for x, y in zip(xs, ys) if bool((y == c).any())]
        if not own:
            continue
        out_x.append(torch.stack([o[:ipc] for o in own]).mean(0))
        out_y.append(torch.full((ipc,), c, dtype=torch.long, device=xs[0].device))
    return torch.cat(out_x), torch.cat(out_y)


def desa_kd_loss(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    *,
    temperature: float,
    alpha: float,
    reduction: str,
) -> Tensor:
    """L_KD (§3.4), the official code's ``calculate_kd_loss`` term for term:
    ``(1 - alpha) CE(student, labels) + alpha T^2 KL(softmax(teacher/T) || softmax(student/T))``,
    the KL averaged over batch x classes (``reduction="mean"``, ``nn.KLDivLoss()``'s default)
    or over the batch only (``"batchmean"``)."""
    kl = kd_loss(student, teacher, temperature)  # T^2 * KL summed over classes, batch mean
    if reduction == "mean":
        kl = kl / student.shape[-1]
    return (1.0 - alpha) * F.cross_entropy(student, labels) + alpha * kl


def supcon_all_samples(features: Tensor, labels: Tensor, *, temperature: float) -> Tensor:
    """L_REG (§3.3): SupCon averaged over *all* samples, one without a positive counting 0
    (the official ``SupConLoss``; :func:`supcon_loss` averages over those with a positive)."""
    same = labels.unsqueeze(-1) == labels.unsqueeze(-2)
    has_pos = (same.sum(-1) > 1).to(features.dtype)  # a positive besides itself
    return supcon_loss(features, labels, temperature=temperature) * has_pos.mean(-1)


def desa_objective(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    *,
    lambda_reg: float,
    lambda_kd: float,
    tau_reg: float,
    kd_temperature: float,
    kd_alpha: float,
    kd_reduction: str,
) -> tuple[Tensor, Tensor]:
    """``CE(B_D u B_A) + lambda_REG SupCon(f(B_D), f(B_A).detach()) + lambda_KD L_KD(z(B_A),
    teacher, y_A)`` for one client (:func:`supcon_all_samples`, :func:`desa_kd_loss`);
    ``ctx``: anchors ``syn_x``, ``syn_y``, this step's anchor
    indices ``anc_idx``, the teacher logits ``teacher [M, K]`` and ``teacher_weight`` (0 when
    no other client's logits exist)."""
    idx = ctx["anc_idx"]
    xa, ya = ctx["syn_x"][idx], ctx["syn_y"][idx]
    b = x.shape[0]
    (feats, logits), new_buffers = fm.forward_train(
        theta, buffers, torch.cat([x, xa]), return_features=True
    )
    loss = F.cross_entropy(logits, torch.cat([y, ya]))  # CE over D_i u D^Syn
    if lambda_reg > 0:  # L_REG (§3.3): anchors' features detached
        f = torch.cat([feats[:b], feats[b:].detach()])
        loss = loss + lambda_reg * supcon_all_samples(f, torch.cat([y, ya]), temperature=tau_reg)
    if lambda_kd > 0:  # L_KD (§3.4): towards the other clients' mean logits on the anchors
        kd = desa_kd_loss(
            logits[b:],
            ctx["teacher"][idx],
            ya,
            temperature=kd_temperature,
            alpha=kd_alpha,
            reduction=kd_reduction,
        )
        loss = loss + lambda_kd * ctx["teacher_weight"] * kd
    return loss, new_buffers


class DESAServer(Server):
    """The relay: mixes the anchors (setup), forwards the other clients' mean logits."""

    def __init__(self, hp: DESAParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        # stages 0-1: theta_d is stage 0's first network (then a fresh one every iteration,
        # step 1), seeded; the sets are mixed into anchors (step 2)
        theta_d = partial(
            seeded_distill_theta,
            hp.distill_model,
            ctx.input_shape,
            ctx.num_classes,
            ctx.seed,
            ctx.device,
        )
        mix = partial(mix_anchors, ipc=hp.ipc, num_classes=ctx.num_classes)
        self.anchors = DistilledSetServer(
            ctx.input_shape, ctx.num_classes, ctx.device, distill_theta=theta_d, merge=mix
        )
        n, k = len(clients), ctx.num_classes
        self.logits = torch.zeros(n, 0, k, device=ctx.device)  # latest logits on D^Syn
        self.has_logits = torch.zeros(n, dtype=torch.bool, device=ctx.device)

    def shared_synthetic(self) -> tuple[Tensor, Tensor] | None:
        return self.anchors.shared_synthetic()

    def configure_setup(self, stage: int, client_ids: list[int]) -> dict[int, Payload]:
        if stage == 2:  # the clients' logits on D^Syn from their initial models
            return {c: {} for c in client_ids}
        return self.anchors.configure_setup(stage, client_ids)

    def check_setup_reply(self, stage: int, client_id: int, reply: Payload) -> str | None:
        if stage != 2:
            return self.anchors.check_setup_reply(stage, client_id, reply)
        return self.check_reply(client_id, reply)

    def aggregate_setup(self, stage: int, replies: dict[int, Payload]) -> None:
        if stage == 0 and replies:  # step 2: mix the clients' sets into the global anchors
            self.anchors.aggregate_setup(stage, replies)
            n, m = len(self.clients), int(self.anchors.syn_y.numel())
            self.logits = torch.zeros(n, m, self.ctx.num_classes, device=self.ctx.device)
        elif stage == 2:
            self.aggregate(0, replies)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "anchors": self.anchors.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.anchors.load_state_dict(state.pop("anchors"))
        super().load_state_dict(state)

    def teacher(self, client_id: int) -> tuple[Tensor, Tensor]:
        """The mean of the other clients' latest logits on D^Syn, and 1 (0 if there are none)."""
        others = self.has_logits.clone()
        others[client_id] = False
        if not bool(others.any()):
            return torch.zeros_like(self.logits[0]), torch.zeros((), device=self.ctx.device)
        return self.logits[others].mean(0), torch.ones((), device=self.ctx.device)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        out = {}
        for c in client_ids:
            teacher, weight = self.teacher(c)
            out[c] = {"teacher": teacher, "teacher_weight": weight}
        return out

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"logits": tuple(self.logits.shape[1:])}

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        declared = self.reply_shapes(client_id)
        if set(reply) != set(declared):
            return f"expected tensors {sorted(declared)}, got {sorted(reply)}"
        if tuple(reply["logits"].shape) != declared["logits"]:
            return f"logits has shape {tuple(reply['logits'].shape)}, expected {declared['logits']}"
        return nonfinite_tensor(reply)

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        for c, reply in replies.items():
            self.logits[c] = reply["logits"].to(self.logits)
            self.has_logits[c] = True


class DESAClient(PersonalModelClient):
    """Each client keeps its own model (any architecture) and D^Syn (``syn_x``, ``syn_y``)."""

    def __init__(self, hp: Any, ctx: Any) -> None:
        super().__init__(hp, ctx)
        self.anchors = DistilledSetClient(hp, ctx.input_shape, ctx.num_classes, ctx.device)

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        return {**super().init_state(fm, num_clients), **self.anchors.init_state(num_clients)}

    def heavy_phases(self, group: ClientGroup) -> list[PhaseCost]:
        """The setup's distillation (step 1), timed before the run."""
        return self.anchors.heavy_phases(group)

    def anchor_logits(self, group: ClientGroup, theta: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Each client's logits on D^Syn (its model in inference mode): what it shares."""
        x = state["syn_x"][0]
        outs = [
            group.fm.forward(theta[c], state["buffers"][c], x)  # type: ignore[misc]
            for c in range(group.size)
        ]
        return torch.stack(outs).detach()  # type: ignore[arg-type]

    def setup(
        self, stage: int, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[list[Payload], dict[str, Tensor], dict[str, Tensor]]:
        if stage < 2:
            return self.anchors.setup(stage, group, msg, state)
        with torch.no_grad():
            z = self.anchor_logits(group, state["theta"], state)
        return [{"logits": z[c]} for c in range(group.size)], state, {}

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        hp: DESAParams = self.hp
        m = int(state["syn_y"].shape[1])
        if m == 0:
            raise ConfigError("desa: no anchors; the setup phase must run before round 1")
        anc_idx = group_batches(group, m, hp.anchor_batch, ANCHOR_SALT)
        loss_fn = partial(
            desa_objective,
            lambda_reg=hp.lambda_reg,
            lambda_kd=hp.lambda_kd,
            tau_reg=hp.tau_reg,
            kd_temperature=hp.kd_temperature,
            kd_alpha=hp.kd_alpha,
            kd_reduction=hp.kd_reduction,
        )
        ctx = {
            "syn_x": state["syn_x"],
            "syn_y": state["syn_y"],
            "teacher": msg["teacher"],
            "teacher_weight": msg["teacher_weight"],
        }
        theta, buffers, loss = group.train(
            state["theta"],
            state["buffers"],
            loss_fn=loss_fn,
            ctx=ctx,
            step_ctx={"anc_idx": anc_idx.to(state["syn_y"].device)},
        )
        new_state = {**state, "theta": theta, "buffers": buffers}
        with torch.no_grad(), FlopMeter.counting():  # the round's upload: the client's work
            z = self.anchor_logits(group, theta, new_state)
        return {"logits": z}, new_state, loss


ALGORITHM = Algorithm(
    name="desa",
    summary="DESA: synthetic anchors shared once, anchor SupCon + KD on others' logits (relay)"
    "; cost: the setup's distillation, distill_iters x clients x classes x (ipc + "
    "distill_batch_real) images through distill_model",
    hparams=DESAParams,
    server=DESAServer,
    client=DESAClient,
    local_defaults={"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0, "epochs": 1},
    reference="paper + authors' code (ubc-tea/DESA): its KD term, SupCon and DM constants",
)
