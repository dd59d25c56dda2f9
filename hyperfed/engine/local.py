"""Local training of many clients at once (DESIGN contract 3).

Clients of one architecture are trained as one tensor ``theta[C, K]``: each step gathers a
batch per client, computes per-client gradients with ``vmap(grad(loss))`` and applies an
update rule with per-client state (:mod:`hyperfed.engine.optim`): by default SGD with
momentum and weight decay exactly as ``torch.optim.SGD`` does (``d = g + wd*p;
buf = m*buf + d; p -= lr*buf``); Adam is another rule. Every method's local loop is this
one: a method that needs another optimizer passes a rule, and a method that trains a
hypernetwork through the model it generates passes that loss with the hypernetwork's
parameters as ``theta`` (pFedKT's end-to-end mode).

Batch schedule (shared by every execution path, so they agree to float tolerance): client
``c`` with ``n_c`` training samples sees a stream of independent shuffles of its data, cut
into consecutive batches of exactly ``B`` samples; it does ``ceil(E * n_c / B)`` steps, i.e.
E epochs with the last batch completed from the next shuffle rather than left short (so
BatchNorm always sees full batches). Clients that finished their steps are masked: their
parameters, momentum and BatchNorm statistics stay as they are while the others go on.
The shuffles come from a generator seeded per (run seed, round, client), so a client's
batches do not depend on which other clients share its group, nor on the execution path.
Dropout masks in the client loop and the reference loop come from the same per-client seed
(:func:`client_rng`), so a model with dropout trains alike in one process, in worker
processes (``local.workers``) and after a resume; under ``vmap`` every client draws its own
masks from the process's stream (``randomness="different"``).

Execution paths: the vmapped step (GPU default), the same step client after client with
plain autograd (CPU default; with channels-last activations inside
:func:`hyperfed.models.layout.channels_last`; a loss marked :func:`per_parameter` there
trains each parameter as its own leaf with torch's fused SGD kernel, other losses one flat
leaf), each
vmapped step replayed as a CUDA graph (``cuda_graphs``), and :func:`train_reference`.
:class:`~hyperfed.engine.metering.FlopMeter` measures what any of them trains.

A frozen part (``trainable``) is outside the backward pass where it can be: when the mask
freezes whole parameters and the loss reads ``theta`` only through the model
(:func:`per_parameter`), the frozen parameters enter the loss as constants, so autograd
computes no gradient for them and stops at the first trainable layer (FedRep's head epochs:
no backward through the body; :func:`frozen_parameters`). Otherwise (a mask that splits a
parameter, a loss that reads the flat vector) the whole gradient is computed and the frozen
entries' update is masked after it. Both give the same update.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from hyperfed.data.federated import FederatedData
from hyperfed.engine.metering import FlopMeter, count_flops
from hyperfed.engine.optim import SGD, State, UpdateRule
from hyperfed.models.layout import FunctionalModel, Params

log = logging.getLogger("hyperfed")
T = TypeVar("T")

# loss_fn(fm, theta, buffers, x, y, ctx) -> (loss, new_buffers); ctx holds per-client extras
LossFn = Callable[[FunctionalModel, Tensor, Tensor, Tensor, Tensor, dict[str, Tensor]], tuple]


@dataclass(frozen=True)
class SGDConfig:
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 1e-4
    epochs: float = 2  # a phase may take part of an epoch (FedRep at E = 1)
    batch_size: int = 64
    cuda_graphs: str = "off"  # on / auto (groups <= GRAPH_AUTO_MAX_CLIENTS) / off; GPU only

    def rule(self) -> SGD:
        """The update rule these settings give (:func:`train_clients`' default)."""
        return SGD(self.lr, self.momentum, self.weight_decay)


@dataclass
class BatchPlan:
    idx: Tensor  # [S, C, B] global sample indices
    active: Tensor  # [S, C] bool: client c takes a step at s
    counts: tuple[int, ...]  # steps per client, on the host (no device sync to read them)
    seeds: tuple[int, ...] = ()  # per client (run, round, client): dropout in client_rng

    @property
    def steps(self) -> int:
        return int(self.idx.shape[0])


def client_seed(seed: int, rnd: int, client_id: int, salt: int = 0) -> int:
    """A deterministic, well-mixed seed per (run, round, client)."""
    return (seed * 1_000_003 + rnd * 10_007 + client_id * 101 + salt) % (2**63 - 1)


def local_steps(n: int, epochs: float, batch_size: int) -> int:
    """Local steps of a client with ``n`` training samples: ``ceil(epochs * n / batch)``."""
    return max(1, math.ceil(epochs * n / batch_size))


def plan_batches(
    train_idx: list[Tensor], epochs: float, batch_size: int, seeds: list[int]
) -> BatchPlan:
    """The batch schedule described in the module docstring, for a group of clients."""
    per_client, counts = [], []
    for idx, seed in zip(train_idx, seeds):
        n = int(idx.numel())
        steps = local_steps(n, epochs, batch_size)
        need = steps * batch_size
        g = torch.Generator().manual_seed(seed)
        perms = [torch.randperm(n, generator=g) for _ in range(math.ceil(need / n))]
        order = torch.cat(perms)[:need].to(idx.device)
        per_client.append(idx[order].view(steps, batch_size))
        counts.append(steps)
    S = max(counts)
    device = train_idx[0].device
    idx = torch.zeros(S, len(train_idx), batch_size, dtype=torch.long, device=device)
    active = torch.zeros(S, len(train_idx), dtype=torch.bool, device=device)
    for c, (b, s) in enumerate(zip(per_client, counts)):
        idx[:s, c] = b
        idx[s:, c] = b[-1]  # padding steps are masked out; any valid index will do
        active[:s, c] = True
    return BatchPlan(idx, active, tuple(counts), tuple(seeds))


def client_plan(plan: BatchPlan, c: int) -> BatchPlan:
    """Client ``c``'s part of a group's plan: its own steps on a client axis of length 1."""
    s = plan.counts[c]
    seeds = plan.seeds[c : c + 1]
    return BatchPlan(plan.idx[:s, c : c + 1], plan.active[:s, c : c + 1], (s,), seeds)


@contextmanager
def client_rng(fm: FunctionalModel, plan: BatchPlan) -> Iterator[None]:
    """The global random stream of a one-client ``plan``, seeded by its (run, round, client)
    seed while the client trains, for a model that draws from it (dropout); restored after.
    Models without dropout, and plans without seeds, leave the stream alone."""
    if not fm.stochastic or not plan.seeds:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(plan.seeds[0] ^ _DROPOUT_SALT)
        yield


_DROPOUT_SALT = 0x5EED_D80F  # the masks' stream differs from the batch shuffles' stream


L = TypeVar("L", bound=Callable)


def per_parameter(loss: L) -> L:
    """Mark a loss that reads ``theta`` only through ``fm.forward`` / ``fm.forward_train``:
    the client loop may then hand it per-parameter leaves instead of one flat vector
    (:func:`_leaf_sgd_loop`). A loss that slices, adds or compares ``theta`` itself (a
    proximal term, two models in one vector) must stay unmarked."""
    loss.per_parameter = True  # type: ignore[attr-defined]
    return loss


def takes_per_parameter(loss_fn: Callable) -> bool:
    """Whether ``loss_fn`` (or the function a ``functools.partial`` wraps) is marked."""
    return bool(getattr(getattr(loss_fn, "func", loss_fn), "per_parameter", False))


@per_parameter
def cross_entropy_loss(
    fm: FunctionalModel, theta: Params, buffers: Tensor, x: Tensor, y: Tensor, ctx: dict
) -> tuple[Tensor, Tensor]:
    """The supervised loss every method starts from (``theta`` flat or per parameter)."""
    logits, new_buffers = fm.forward_train(theta, buffers, x)
    return F.cross_entropy(logits, y), new_buffers


def frozen_parameters(fm: FunctionalModel, trainable: Tensor) -> list[tuple[bool, ...] | None]:
    """Per client (a row of ``trainable``, ``[K]`` or ``[C, K]``): which of ``fm``'s parameters
    the mask freezes whole, in layout order; None where it splits a parameter, freezes none or
    freezes all (such a client's update is masked after a full backward). One host copy of the
    mask per call, none per step."""
    rows = trainable.detach().to("cpu", torch.bool)
    if rows.shape[-1] != fm.num_params:  # not fm's parameter vector (e.g. two models in one)
        return [None] * (rows.shape[0] if rows.dim() == 2 else 1)
    rows = rows.reshape(-1, fm.num_params)
    on = F.pad(rows.to(torch.int64).cumsum(1), (1, 0))  # [C, K + 1]
    starts = torch.tensor([s.offset for s in fm.layout.segments], dtype=torch.long)
    ends = torch.tensor([s.end for s in fm.layout.segments], dtype=torch.long)
    count = on[:, ends] - on[:, starts]  # trainable entries per (client, parameter)
    whole = (count == 0) | (count == ends - starts)
    out: list[tuple[bool, ...] | None] = []
    for ok, n in zip(whole.all(1).tolist(), (count == 0).tolist()):
        useful = ok and any(n) and not all(n)
        out.append(tuple(bool(v) for v in n) if useful else None)
    return out


def _with_constants(
    fm: FunctionalModel, flat: Tensor, frozen: tuple[bool, ...]
) -> tuple[Tensor, ...]:
    """``flat``'s parameters as views: the frozen ones constants to autograd, the others
    leaves that require grad."""
    views = fm.layout.unflatten(flat).values()
    return tuple(v.detach() if f else v.detach().requires_grad_() for v, f in zip(views, frozen))


def stopped_step(
    step_loss: Callable, fm: FunctionalModel, frozen: tuple[bool, ...], device: torch.device
) -> Callable:
    """The vmapped step of a loss marked :func:`per_parameter` with the ``frozen`` parameters
    outside the backward pass: the gradient is taken w.r.t. the trainable entries only
    (gathered), the frozen parameters are read from the undifferentiated ``theta``; the
    returned gradient is ``[C, K]`` with zeros on the frozen entries."""
    segs = fm.layout.segments
    sizes = [s.numel for s in segs]
    idx = torch.cat([torch.arange(s.offset, s.end) for s, f in zip(segs, frozen) if not f])
    idx = idx.to(device)
    train_sizes = [s.numel for s, f in zip(segs, frozen) if not f]

    def loss_of(th_train: Tensor, th: Tensor, bu: Tensor, x: Tensor, y: Tensor, cx: dict) -> tuple:
        trained = iter(th_train.split(train_sizes))
        params = tuple(
            (p if f else next(trained)).reshape(s.shape)
            for s, f, p in zip(segs, frozen, th.split(sizes))
        )
        return step_loss(params, bu, x, y, cx)

    inner = vmap(grad_and_value(loss_of, has_aux=True), randomness="different")

    def step(th: Tensor, bu: Tensor, x: Tensor, y: Tensor, cx: dict) -> tuple:
        g, aux = inner(th[:, idx], th, bu, x, y, cx)
        return th.new_zeros(th.shape).index_copy_(1, idx, g), aux

    return step


def train_clients(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    data: FederatedData,
    plan: BatchPlan,
    sgd: SGDConfig,
    *,
    loss_fn: LossFn = cross_entropy_loss,
    ctx: dict[str, Tensor] | None = None,
    trainable: Tensor | None = None,
    vectorize: bool = True,
    step_ctx: dict[str, Tensor] | None = None,
    rule: UpdateRule | None = None,
    rule_state: State | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run a group's local training; returns ``(theta, buffers, mean_loss)`` with a client axis.

    ``rule`` turns each step's gradients into the new ``theta`` (:mod:`hyperfed.engine.optim`;
    default ``sgd.rule()``, SGD with ``sgd``'s lr, momentum and weight decay; ``sgd`` also
    gives the execution options). ``theta`` is whatever ``loss_fn`` differentiates: a model's
    parameters, or a hypernetwork's that the loss generates them from (pFedKT). ``rule_state``:
    the rule's per-client state carried in (``rule.init_state``'s keys, a client axis each);
    its entries are replaced by the state after training (the dict is updated, the tensors in
    it are not written to), so a method keeps it from round to round. None: a fresh state,
    dropped after (SGD's momentum starts at zero every call, as a ``torch.optim.SGD`` built
    per round does).
    ``step_ctx`` holds per-step extras, each ``[S, C, ...]`` with ``S >= plan.steps``: at step
    ``s`` the loss sees ``v[s]`` in its ``ctx`` (e.g. MH-pFedHNDD's synthetic-batch indices).
    ``trainable`` (``[K]`` or ``[C, K]`` bool) freezes the other entries (resource-constrained
    clients, personal/shared splits); whole frozen parameters of a :func:`per_parameter` loss
    stay outside the backward pass (the module docstring; under ``vmap`` when every client
    freezes the same ones). ``vectorize=False`` runs the same step client after client --
    faster on a small CPU, identical results.
    """
    ctx = ctx or {}
    step_ctx = step_ctx or {}
    rule = sgd.rule() if rule is None else rule

    def step_loss(th: Tensor, bu: Tensor, x: Tensor, y: Tensor, cx: dict) -> tuple:
        loss, new_bu = loss_fn(fm, th, bu, x, y, cx)
        return loss, (loss.detach(), new_bu)

    mask = None if trainable is None else trainable.to(device=theta.device, dtype=theta.dtype)
    # per client: the parameters kept outside the backward pass (None: none, or masked after)
    per_param = takes_per_parameter(loss_fn)
    frozen: list[tuple[bool, ...] | None] = [None] * theta.shape[0]
    if trainable is not None and per_param:
        frozen = frozen_parameters(fm, trainable)
        frozen = frozen * theta.shape[0] if len(frozen) == 1 else frozen
    if vectorize:
        one_set = frozen[0] is not None and all(f == frozen[0] for f in frozen)
        frozen = frozen if one_set else [None] * theta.shape[0]
        if FlopMeter.active:
            count_flops(loss_fn, fm, theta, buffers, data, plan, ctx, step_ctx, frozen)
        if frozen[0] is not None:
            step = stopped_step(step_loss, fm, frozen[0], theta.device)
        else:
            step = vmap(grad_and_value(step_loss, has_aux=True), randomness="different")
        out = _local_loop(
            step, theta, buffers, data, plan, sgd, rule, rule_state, ctx, mask, step_ctx
        )
        return _handed_back(out, rule_state)
    # a loss marked per_parameter trains on per-parameter leaves (one fused SGD kernel a
    # step, no flat gradient to gather; frozen parameters are constants there); other losses
    # may read theta itself
    leaf_rule = isinstance(rule, SGD) and per_param and not step_ctx
    leaves = [leaf_rule and (mask is None or f is not None) for f in frozen]
    frozen = [f if leaf else None for f, leaf in zip(frozen, leaves)]
    if FlopMeter.active:
        count_flops(loss_fn, fm, theta, buffers, data, plan, ctx, step_ctx, frozen)
    outs = []
    for c in range(theta.shape[0]):
        sub = client_plan(plan, c)
        m = mask if mask is None or mask.dim() == 1 else mask[c : c + 1]
        cx = {k: v[c : c + 1] for k, v in ctx.items()}
        sx = {k: v[: sub.steps, c : c + 1] for k, v in step_ctx.items()}
        st = None if rule_state is None else {k: v[c : c + 1] for k, v in rule_state.items()}
        with client_rng(fm, sub):
            if leaves[c]:
                assert isinstance(rule, SGD)
                one = {k: v[0] for k, v in cx.items()}
                args = (fm, theta[c], buffers[c], data, sub, rule, loss_fn, one, frozen[c], st)
                outs.append(_leaf_sgd_loop(*args))
                continue
            outs.append(
                _local_loop(
                    one_client_step(step_loss),
                    theta[c : c + 1],
                    buffers[c : c + 1],
                    data,
                    sub,
                    sgd,
                    rule,
                    st,
                    cx,
                    m,
                    sx,
                )
            )
    thetas, bufs, losses, states = zip(*outs)
    state = {k: torch.cat([s[k] for s in states]) for k in states[0]}
    out = (torch.cat(thetas), torch.cat(bufs), torch.cat(losses), state)
    return _handed_back(out, rule_state)


def _handed_back(
    out: tuple[Tensor, Tensor, Tensor, State], rule_state: State | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(theta, buffers, loss)``, the state after training written into ``rule_state``."""
    if rule_state is not None:
        rule_state.update(out[3])
    return out[0], out[1], out[2]


def one_client_step(step_loss: Callable) -> Callable:
    """One client's step on a client axis of length 1, with plain autograd: no vmap and no
    ``torch.func`` transform, whose per-op dispatch overhead dominates small CPU steps."""

    def run(th: Tensor, bu: Tensor, x: Tensor, y: Tensor, cx: dict) -> tuple:
        leaf = th[0].detach().requires_grad_(True)
        with torch.enable_grad():
            loss, (loss_d, nb) = step_loss(
                leaf, bu[0], x[0], y[0], {k: v[0] for k, v in cx.items()}
            )
            (g,) = torch.autograd.grad(loss, leaf)
        return g[None], (loss_d[None], (loss_d[None], nb.detach()[None]))

    return run


def _leaf_sgd_loop(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    data: FederatedData,
    plan: BatchPlan,
    rule: SGD,
    loss_fn: Callable[..., tuple],  # given a tuple of leaves as theta
    ctx: dict[str, Tensor],
    frozen: tuple[bool, ...] | None = None,
    state: State | None = None,
) -> tuple[Tensor, Tensor, Tensor, State]:
    """One client's local SGD (a one-client ``plan``, its ``ctx`` without a client axis) on
    a loss marked :func:`per_parameter`, each parameter its own autograd leaf: a view into a
    copy of the client's flat vector, updated in place by torch's fused SGD kernel
    (``torch.optim.SGD(fused=True)``'s: the same step as :meth:`SGD.step_`, in one pass).
    ``frozen`` parameters are constants: no gradient, no update, no backward pass through
    them. ``state``: the rule's (``m[1, K]``), None for a fresh one."""
    # A step body of its own, not _train_step's: per-parameter leaves never gather the flat
    # gradient, measured faster per CPU step (docs/performance.md, "Per-parameter leaves").
    flat = theta.detach().clone()
    views = list(fm.layout.unflatten(flat).values())  # updated in place: flat is the result
    frozen = frozen or (False,) * len(views)
    params = _with_constants(fm, flat, frozen)  # the leaves share flat's memory
    train = [i for i, f in enumerate(frozen) if not f]
    leaves = [params[i] for i in train]
    # torch.optim.SGD's first step from a zero buffer: buf = d = 0 * m + d
    momentum = flat.new_zeros(flat.shape) if state is None else state["m"][0].clone()
    bufs = list(fm.layout.unflatten(momentum).values()) if rule.momentum else []
    bufs = [bufs[i] for i in train] if bufs else []
    views = [views[i] for i in train]
    losses = []
    with torch.enable_grad():
        for idx in plan.idx[:, 0].unbind(0):
            x, y = data.batch(idx)
            loss, new_buffers = loss_fn(fm, params, buffers, x, y, ctx)
            grads = torch.autograd.grad(loss, leaves)
            torch._fused_sgd_(  # on the views (no autograd); it walks raw memory, so a
                views,  # channels-last weight gradient is made contiguous like its parameter
                [g if g.dim() < 4 else g.contiguous() for g in grads],
                bufs,
                weight_decay=rule.weight_decay,
                momentum=rule.momentum,
                lr=rule.lr,
                dampening=0.0,
                nesterov=False,
                maximize=False,
                is_first_step=False,
            )
            buffers = new_buffers.detach()
            losses.append(loss.detach())
    loss_sum = torch.stack(losses).sum()
    return flat[None], buffers[None], (loss_sum / plan.steps)[None], {"m": momentum[None]}


def _keep(active: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """``new`` for the clients still training (``active[C]``), ``old`` for the others."""
    return torch.where(active.view(-1, *[1] * (old.dim() - 1)), new, old)


def _local_loop(
    step: Callable,
    theta: Tensor,
    buffers: Tensor,
    data: FederatedData,
    plan: BatchPlan,
    sgd: SGDConfig,
    rule: UpdateRule,
    state: State | None,
    ctx: dict[str, Tensor],
    mask: Tensor | None,
    step_ctx: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, State]:
    """The steps of ``plan``, each one :func:`_train_step`; ``state`` None: a fresh one. A
    client past its last step keeps its theta, state and BatchNorm statistics (a group whose
    clients all take every step is updated in place). Returns ``(theta, buffers, mean loss,
    state)``."""
    graphs = sgd.cuda_graphs == "on" or (
        sgd.cuda_graphs == "auto" and theta.shape[0] <= GRAPH_AUTO_MAX_CLIENTS
    )
    if graphs and theta.is_cuda and plan.steps > GRAPH_WARMUP_STEPS:
        args = (step, theta, buffers, data, plan, rule, state, ctx, mask, step_ctx or {})
        return _graphed_loop(*args)
    loss_sum = torch.zeros(theta.shape[0], device=theta.device)
    all_active = min(plan.counts) == plan.steps
    if state is None:
        state = rule.init_state(theta)
    elif all_active:
        state = {k: v.clone() for k, v in state.items()}  # updated in place from here on
    if all_active:
        theta = theta.clone()  # updated in place from here on
    for s in range(plan.steps):
        x, y = data.batch(plan.idx[s])
        cx = {**ctx, **{k: v[s] for k, v in step_ctx.items()}} if step_ctx else ctx
        active = None if all_active else plan.active[s]
        theta, buffers, state, loss = _train_step(
            step, rule, mask, theta, buffers, state, x, y, cx, active
        )
        loss_sum = loss_sum + loss
    steps = plan.active.sum(0).clamp(min=1)
    return theta.detach(), buffers.detach(), loss_sum / steps, state


def _train_step(
    step: Callable,
    rule: UpdateRule,
    mask: Tensor | None,
    theta: Tensor,
    buffers: Tensor,
    state: State,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    active: Tensor | None,
) -> tuple[Tensor, Tensor, State, Tensor]:
    """One local step of a group, the one step body of the eager loop and the CUDA graph:
    ``step`` gives each client's gradient, ``rule`` updates ``theta`` and ``state``. With
    ``active`` (``[C]`` bool) a client outside it keeps its theta, state and BatchNorm
    statistics; without, every client steps and ``theta`` and ``state`` are updated in place.
    Returns ``(theta, buffers, state, loss)``, the loss zero for the clients that kept theirs."""
    grads, (_, (loss, new_buffers)) = step(theta, buffers, x, y, ctx)
    if active is None:
        rule.step_(theta, grads, state, mask)
        return theta, new_buffers, state, loss
    new_theta, new_state = rule.step(theta, grads, state, mask)
    theta = _keep(active, new_theta, theta)
    state = {k: _keep(active, new_state[k], v) for k, v in state.items()}
    if buffers.shape[1]:
        buffers = _keep(active, new_buffers, buffers)
    return theta, buffers, state, loss * active


GRAPH_AUTO_MAX_CLIENTS = 32  # "auto": larger groups are GPU-bound (see config.py)
GRAPH_WARMUP_STEPS = 2  # eager steps on a side stream before capture (lazy cuDNN/autograd init)
GRAPH_STATS = {"captured": 0, "failed": 0}  # read by `hyperfed bench`


def _graphed_loop(
    step: Callable,
    theta: Tensor,
    buffers: Tensor,
    data: FederatedData,
    plan: BatchPlan,
    rule: UpdateRule,
    state: State | None,
    ctx: dict[str, Tensor],
    mask: Tensor | None,
    step_ctx: dict[str, Tensor],
) -> tuple[Tensor, Tensor, Tensor, State]:
    """The same steps, each :func:`_train_step` (masked) replayed as one captured CUDA graph.

    A vmapped step launches hundreds of small kernels; on a GPU their launch cost (~4 ms per
    step for LeNet, `benchmarks/gpu_variants.py`) exceeds the arithmetic. The step is written
    once against static tensors (state updated in place, batch indices copied in before each
    replay), run eagerly for the warm-up steps, captured, and replayed for the rest. A loss
    that cannot be captured (a host sync inside it) falls back to eager steps, with a warning.
    """
    th, bu = theta.clone(), buffers.clone()
    st = rule.init_state(theta) if state is None else {k: v.clone() for k, v in state.items()}
    loss_sum = torch.zeros(theta.shape[0], device=theta.device)
    idx, active = plan.idx[0].clone(), plan.active[0].clone()
    sctx = {k: v[0].clone() for k, v in step_ctx.items()}

    def body() -> None:  # _train_step, its results written into the static tensors
        x, y = data.batch(idx)
        args = (step, rule, mask, th, bu, st, x, y, {**ctx, **sctx}, active)
        new_theta, new_buffers, new_state, loss = _train_step(*args)
        th.copy_(new_theta)
        for k, v in st.items():
            v.copy_(new_state[k])
        if bu.shape[1]:
            bu.copy_(new_buffers)
        loss_sum.add_(loss.detach())

    def load(s: int) -> None:
        idx.copy_(plan.idx[s])
        active.copy_(plan.active[s])
        for k, v in sctx.items():
            v.copy_(step_ctx[k][s])

    side = torch.cuda.Stream(theta.device)
    side.wait_stream(torch.cuda.current_stream(theta.device))
    with torch.cuda.stream(side):
        for s in range(GRAPH_WARMUP_STEPS):
            load(s)
            body()
    torch.cuda.current_stream(theta.device).wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    graph: torch.cuda.CUDAGraph | None = captured
    try:
        with torch.cuda.graph(captured):
            body()
    except RuntimeError as e:  # capture records only: the state is as the warm-up left it
        graph = None
        if not GRAPH_STATS["failed"]:
            log.warning("CUDA graph capture failed (%s); running these steps eagerly", e)
        GRAPH_STATS["failed"] += 1
    else:
        GRAPH_STATS["captured"] += 1
    for s in range(GRAPH_WARMUP_STEPS, plan.steps):
        load(s)
        if graph is not None:
            graph.replay()
        else:
            body()
    steps = plan.active.sum(0).clamp(min=1)
    return th.detach(), bu.detach(), loss_sum / steps, st


def train_reference(
    module: nn.Module,
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    data: FederatedData,
    plan: BatchPlan,
    sgd: SGDConfig,
) -> tuple[Tensor, Tensor]:
    """The papers' way: client after client, a real ``nn.Module`` and ``torch.optim.SGD``.

    Kept as the ground truth for tests and the baseline for benchmarks: a deliberately
    separate, plain implementation (no :func:`_train_step`), so a bug in the engine's step
    cannot hide in both sides of a comparison.
    """
    if FlopMeter.active:
        count_flops(cross_entropy_loss, fm, theta, buffers, data, plan, {}, {})
    out_theta, out_buf = [], []
    for c in range(theta.shape[0]):
        fm.load_into(module, theta[c], buffers[c])
        module.train()
        opt = torch.optim.SGD(
            module.parameters(), lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay
        )
        with client_rng(fm, client_plan(plan, c)):
            for s in range(plan.counts[c]):
                x, y = data.batch(plan.idx[s, c])
                opt.zero_grad()
                F.cross_entropy(module(x), y).backward()
                opt.step()
        t, b = fm.read_from(module)
        out_theta.append(t.clone())
        out_buf.append(b.clone())
    return torch.stack(out_theta), torch.stack(out_buf)
