"""The vectorized engine, the client-by-client path and the reference loop agree."""

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.local import (
    SGDConfig,
    client_seed,
    plan_batches,
    train_clients,
    train_reference,
)
from hyperfed.models.layout import FunctionalModel, channels_last
from hyperfed.models.zoo import build_model

# HYPERFED_TEST_DEVICE=cuda runs the equality tests on a GPU (TF32 off: exact fp32 there too).
DEVICE = torch.device(os.environ.get("HYPERFED_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def _setup(name, data, clients, dtype=torch.float32):
    torch.manual_seed(0)
    module = build_model(name, data.input_shape, data.num_classes).to(dtype=dtype, device=DEVICE)
    fm = FunctionalModel(module)
    theta = fm.initial_params().expand(len(clients), -1).clone()
    theta = theta + 0.01 * torch.randn_like(theta)  # clients start from different points
    buffers = fm.initial_buffers().expand(len(clients), -1).clone()
    seeds = [client_seed(0, 1, c) for c in clients]
    sgd = SGDConfig(lr=0.01, momentum=0.9, weight_decay=1e-3, epochs=1, batch_size=32)
    plan = plan_batches([data.train_idx[c] for c in clients], sgd.epochs, sgd.batch_size, seeds)
    return fm, theta, buffers, plan, sgd


def _fewer_samples(data, first: int = 24):
    """Client i's first ``first (i + 1)`` training samples: at batch 32, 1 / 2 / 3 / 3 steps
    (still different step counts, a few steps each: resnet10 in float64 is slow on a CPU)."""
    idx = [t[: first * (i + 1)] for i, t in enumerate(data.train_idx)]
    return dataclasses.replace(data, train_idx=idx)


# float64 for BatchNorm: on digits some channels are near-constant, and BatchNorm divides
# float32 rounding differences between conv kernels by sqrt(eps), which grows over steps.
@pytest.mark.parametrize(
    "name,dtype,tol",
    [
        ("lenet", torch.float32, 2e-5),
        ("lenet", torch.float64, 1e-10),
        ("resnet10", torch.float64, 1e-10),
    ],
)
def test_vectorized_equals_reference(name, dtype, tol, digits_data):
    clients = [0, 1, 2, 3]
    digits_data = dataclasses.replace(digits_data.to(DEVICE), dtype=dtype)
    if name == "resnet10":
        digits_data = _fewer_samples(digits_data)
    fm, theta, buffers, plan, sgd = _setup(name, digits_data, clients, dtype)
    sizes = [digits_data.train_sizes[c] for c in clients]
    assert len(set(sizes)) > 1, "the test needs clients with different numbers of steps"
    ref_t, ref_b = train_reference(
        copy.deepcopy(fm.module), fm, theta, buffers, digits_data, plan, sgd
    )
    # (vectorize, sgd, channels-last activations): vmap ignores the channels-last switch
    paths = [(True, sgd, False), (False, sgd, False), (False, sgd, True), (True, sgd, True)]
    if DEVICE.type == "cuda":  # the same steps replayed as CUDA graphs
        paths.append((True, dataclasses.replace(sgd, cuda_graphs="on"), False))
    for vectorize, path_sgd, nhwc in paths:
        with channels_last(nhwc):
            t, b, loss = train_clients(
                fm, theta, buffers, digits_data, plan, path_sgd, vectorize=vectorize
            )
        err = (t - ref_t).abs().max()
        assert torch.allclose(t, ref_t, atol=tol, rtol=1e-4), (vectorize, nhwc, err)
        if fm.num_buffers:
            assert torch.allclose(b, ref_b, atol=tol, rtol=1e-4), (b - ref_b).abs().max()
        assert torch.isfinite(loss).all() and loss.shape == (4,)
    assert not torch.allclose(ref_t, theta), "training must change the parameters"


def test_plan_gives_each_client_its_own_number_of_steps(digits_data):
    clients = [0, 1, 2, 3]
    seeds = [client_seed(0, 1, c) for c in clients]
    plan = plan_batches([digits_data.train_idx[c] for c in clients], 2, 16, seeds)
    for j, c in enumerate(clients):
        n = digits_data.train_sizes[c]
        steps = int(plan.active[:, j].sum())
        assert steps == -(-2 * n // 16) == plan.counts[j]  # the host copy agrees
        used = plan.idx[:steps, j].flatten()
        assert set(used.tolist()) <= set(digits_data.train_idx[c].tolist())
        # E epochs: every sample is seen at least E times except for the completed last batch
        counts = torch.bincount(used, minlength=int(digits_data.x.shape[0]))[
            digits_data.train_idx[c]
        ]
        assert counts.min() >= 2 and counts.max() <= 3


def test_plan_depends_only_on_the_client_seed(digits_data):
    a = plan_batches([digits_data.train_idx[1]], 1, 8, [client_seed(0, 3, 1)])
    b = plan_batches(
        [digits_data.train_idx[0], digits_data.train_idx[1]],
        1,
        8,
        [client_seed(0, 3, 0), client_seed(0, 3, 1)],
    )
    s = int(a.active.sum())
    assert torch.equal(a.idx[:s, 0], b.idx[:s, 1])


def test_frozen_entries_do_not_move(digits_data):
    clients = [0, 1]
    digits_data = digits_data.to(DEVICE)
    fm, theta, buffers, plan, sgd = _setup("lenet", digits_data, clients)
    mask = ~fm.layout.mask(fm.module.head_prefixes).to(DEVICE)
    before = theta.clone()
    for vectorize in (True, False):  # the step runs in place on a copy; the input stays
        t, _, _ = train_clients(
            fm, theta, buffers, digits_data, plan, sgd, trainable=mask, vectorize=vectorize
        )
        assert torch.equal(theta, before)
        assert torch.equal(t[:, ~mask], theta[:, ~mask])
        assert not torch.equal(t[:, mask], theta[:, mask])


def test_channels_last_with_one_input_channel():
    """A 1-channel input is "contiguous" in both layouts; the engine still hands oneDNN truly
    channels-last input (channel stride 1), so what follows stays channels-last, and routes
    Flatten's gradient back channels-last; gradients equal the NCHW ones (float64)."""
    torch.manual_seed(0)
    fm = FunctionalModel(build_model("lenet", (1, 12, 12), 4).double())
    theta, buffers = fm.initial_params(), fm.initial_buffers()
    x, y = torch.randn(5, 1, 12, 12, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0])
    conv_in: list[torch.Tensor] = []
    pooled_grads: list[torch.Tensor] = []
    conv = next(m for m in fm.module.modules() if isinstance(m, torch.nn.Conv2d))
    flatten = next(m for m in fm.module.modules() if isinstance(m, torch.nn.Flatten))

    def grad() -> torch.Tensor:
        leaf = theta.clone().requires_grad_(True)
        out, _ = fm.forward_train(leaf, buffers, x)
        return torch.autograd.grad(torch.nn.functional.cross_entropy(out, y), leaf)[0]

    plain = grad()

    def watch_grad(mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        inputs[0].register_hook(pooled_grads.append)

    h1 = conv.register_forward_pre_hook(lambda m, i: conv_in.append(i[0]))
    h2 = flatten.register_forward_pre_hook(watch_grad)
    with channels_last():
        nhwc = grad()
    h1.remove()
    h2.remove()
    assert torch.allclose(plain, nhwc, atol=1e-12)
    assert conv_in[0].stride(1) == 1  # channel-innermost, not NCHW strides
    assert pooled_grads[0].stride(1) == 1


def test_channels_last_is_the_same_function_and_is_scoped():
    torch.manual_seed(0)
    fm = FunctionalModel(build_model("resnet10", (3, 16, 16), 5).double())
    theta, buffers = fm.initial_params(), fm.initial_buffers()
    x, y = torch.randn(6, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4, 0])

    def grads_and_stats():
        leaf = theta.clone().requires_grad_(True)
        out, new_buffers = fm.forward_train(leaf, buffers, x)
        (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(out, y), leaf)
        return g, new_buffers, fm.forward(theta, buffers, x)

    plain = grads_and_stats()
    with channels_last():
        seen = []
        hook = fm.module.register_forward_hook(lambda m, i, o: seen.append(i[0]))
        nhwc = grads_and_stats()
        hook.remove()
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(plain, nhwc):
        assert torch.allclose(a, b, atol=1e-12), (a - b).abs().max()
    seen.clear()
    hook = fm.module.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    fm.forward(theta, buffers, x)  # outside the block: the caller's layout again
    assert seen[0].is_contiguous() and not seen[0].is_contiguous(memory_format=torch.channels_last)


def test_training_inside_measured_flops_is_counted_once() -> None:
    """Training the server runs itself (FedDM, FedTGP, one-shot FedAvg) sits inside the
    server's exact op counter; the per-step estimate must not add the same steps again."""
    from torch.utils.flop_counter import FlopCounterMode
    from toy import tiny_mlp, toy_federation

    from hyperfed.engine.local import SGDConfig, plan_batches, train_clients
    from hyperfed.engine.metering import measured_flops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1] * 4)
    data = toy_federation(x, y, [torch.arange(8)], 2)
    fm = tiny_mlp(3, 4, 2)
    sgd = SGDConfig(lr=0.1, momentum=0.0, weight_decay=0.0, epochs=2, batch_size=4)

    def train() -> None:
        plan = plan_batches(data.train_idx, sgd.epochs, sgd.batch_size, [0])
        theta = fm.initial_params()[None]
        train_clients(fm, theta, fm.initial_buffers()[None], data, plan, sgd, vectorize=False)

    with FlopCounterMode(display=False) as direct:
        train()
    _, measured = measured_flops(train)
    assert measured == direct.get_total_flops() > 0


@pytest.mark.parametrize("model", ["lenet", "resnet10"])
def test_flop_sum_counts_what_torchs_flop_counter_counts(model) -> None:
    """FlopSum (every FLOP count of hyperfed) = torch's FlopCounterMode, on a training step
    (convolutions, BatchNorm, linear layers, their backward) and on MH-pFedHN's hypernetwork
    (einsum -> bmm, its hand-written head gradient, Adam's fused step)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hyperfed.engine.metering import FlopSum
    from hyperfed.hypernet.multihead import MultiHeadHypernet

    torch.manual_seed(0)
    module = build_model(model, (3, 32, 32), 10)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    hn = MultiHeadHypernet({0: 2500, 1: 2200, 2: 700}, out_dim=1000, hidden=8, embed_dim=4)
    opt = torch.optim.Adam(hn.parameters(), lr=1e-3, fused=True)

    def work() -> None:
        torch.nn.functional.cross_entropy(module(x), y).backward()
        thetas = hn.generate([0, 1, 2])
        hn.backward({c: torch.ones_like(t) for c, t in thetas.items()})
        opt.step()

    with FlopCounterMode(display=False) as reference:
        work()
    with FlopSum() as mine:
        work()
    assert mine.get_total_flops() == reference.get_total_flops() > 0


# -- local.compile: removed (the compiled step measured slower), recorded configs still load --


def test_removed_compile_key_loads_as_eager_and_refuses_on():
    """A recorded run's ``local.compile = "auto"`` (the old default) or ``"off"`` meant the
    eager step: such a config loads as if the key were absent, so old run directories resume;
    ``"on"`` asked for the removed path and gets one line naming the key."""
    from hyperfed.config import ConfigError, load_config

    plain = load_config(None)
    for value in ('"auto"', '"off"'):
        assert load_config(None, [f"local.compile={value}"]) == plain
    with pytest.raises(ConfigError, match=r"^local: compile was removed") as err:
        load_config(None, ['local.compile="on"'])
    assert "\n" not in str(err.value)


# -- evaluation of all clients, batched -------------------------------------------------------


@pytest.mark.parametrize("vectorize", [False, True])
def test_batched_evaluation_equals_per_client_evaluation(vectorize, digits_data):
    data = digits_data.to(DEVICE)
    fm, theta, buffers, _, _ = _setup("lenet", data, [0, 1, 2, 3])
    # clients 0 and 2 hold one model (as under FedAvg), 1 and 3 their own
    theta[2], buffers[2] = theta[0], buffers[0]
    ids = [3, 1, 0, 2]  # positions in theta are not client ids
    ok, tot, ls = evaluate_clients(fm, theta, buffers, data, ids, chunk=16, vectorize=vectorize)
    for r, cid in enumerate(ids):
        x, y = data.batch(data.test_idx[cid])
        with torch.no_grad():
            logits = fm.forward(theta[r], buffers[r], x)
        assert tot[r] == len(y) > 16, "each client's samples span several chunks"
        assert ok[r] == (logits.argmax(1) == y).sum()
        want = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        assert torch.allclose(ls[r], want, rtol=1e-5), (ls[r], want)
    assert 0 < ok.sum() < tot.sum()


def test_same_models_groups_equal_rows_only():
    from hyperfed.engine.evaluation import _same_models

    theta = torch.tensor([[1.0, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 4]])
    buffers = torch.tensor([[0.0], [5], [0], [0]])  # row 1: same weights, other statistics
    assert _same_models(theta, buffers) == [[0, 2], [1], [3]]


class _DropNet(torch.nn.Module):
    """A digits MLP with Dropout(0.5): its training forward draws masks."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(1),
            torch.nn.Linear(64, 32),
            torch.nn.ReLU(),
            torch.nn.Dropout(p),
            torch.nn.Linear(32, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _dropout_setup(digits_data, clients, p=0.5):
    torch.manual_seed(0)
    fm = FunctionalModel(_DropNet(p), "dropnet")
    theta = fm.initial_params().expand(len(clients), -1).clone()
    buffers = fm.initial_buffers().expand(len(clients), -1).clone()
    sgd = SGDConfig(lr=0.1, momentum=0.9, weight_decay=0.0, epochs=1, batch_size=16)
    seeds = [client_seed(3, 2, c) for c in clients]
    plan = plan_batches([digits_data.train_idx[c] for c in clients], 1, 16, seeds)
    return fm, theta, buffers, plan, sgd


def test_dropout_masks_depend_only_on_the_client_and_match_the_reference(digits_data):
    """A client's dropout masks come from its (run, round, client) seed: the client trained
    alone equals its row in a group, the papers' nn.Module loop draws the same masks, and the
    caller's random stream is left where it was."""
    fm, theta, buffers, plan, sgd = _dropout_setup(digits_data, [0, 1, 2])
    torch.manual_seed(123)
    before = torch.get_rng_state()
    group, _, _ = train_clients(fm, theta, buffers, digits_data, plan, sgd, vectorize=False)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(999)  # another global state: must not matter
    _, alone_theta, alone_buffers, alone_plan, _ = _dropout_setup(digits_data, [2])
    alone, _, _ = train_clients(
        fm, alone_theta, alone_buffers, digits_data, alone_plan, sgd, vectorize=False
    )
    assert torch.equal(alone[0], group[2])
    ref, _ = train_reference(copy.deepcopy(fm.module), fm, theta, buffers, digits_data, plan, sgd)
    torch.testing.assert_close(group, ref, atol=2e-5, rtol=1e-4)
    # the masks are really drawn (p = 0 trains differently)
    fm0, *_ = _dropout_setup(digits_data, [0, 1, 2], p=0.0)
    no_dropout, _, _ = train_clients(fm0, theta, buffers, digits_data, plan, sgd, vectorize=False)
    assert not torch.allclose(no_dropout, group)


def test_vmapped_dropout_draws_each_clients_own_masks(digits_data):
    # two clients with the same start and the same batches differ only by their masks
    fm, theta, buffers, plan, sgd = _dropout_setup(digits_data, [0, 0])
    t, _, loss = train_clients(fm, theta, buffers, digits_data, plan, sgd, vectorize=True)
    assert torch.isfinite(t).all() and torch.isfinite(loss).all()
    assert not torch.allclose(t[0], t[1])


@pytest.mark.parametrize(
    "name,momentum,weight_decay",
    # the three update rules on lenet; resnet10 (BatchNorm buffers) once, with every term on
    [("lenet", 0.9, 1e-3), ("lenet", 0.0, 1e-3), ("lenet", 0.9, 0.0), ("resnet10", 0.9, 1e-3)],
)
def test_per_parameter_loop_equals_the_flat_vector_loop(name, momentum, weight_decay, digits_data):
    """The plain loss trains on per-parameter leaves with torch's fused SGD kernel; any other
    loss on one flat leaf with the three-op update. Same steps, float64: equal to 1e-10."""
    from hyperfed.engine.local import cross_entropy_loss

    data = dataclasses.replace(digits_data.to(DEVICE), dtype=torch.float64)
    if name == "resnet10":
        data = _fewer_samples(data)
    fm, theta, buffers, plan, sgd = _setup(name, data, [0, 1], torch.float64)
    sgd = dataclasses.replace(sgd, momentum=momentum, weight_decay=weight_decay)

    def same_loss(*args):  # not the plain loss object: takes the flat-vector loop
        return cross_entropy_loss(*args)

    for nhwc in (False, True):
        with channels_last(nhwc):
            leaves = train_clients(fm, theta, buffers, data, plan, sgd, vectorize=False)
            flat = train_clients(
                fm, theta, buffers, data, plan, sgd, vectorize=False, loss_fn=same_loss
            )
        for a, b in zip(leaves, flat):
            assert torch.allclose(a, b, atol=1e-10, rtol=1e-9), (nhwc, (a - b).abs().max())
    assert not torch.allclose(leaves[0], theta)


@pytest.mark.parametrize("which", ["distillation", "prototypes", "logits"])
def test_marked_losses_train_per_parameter_like_the_flat_vector_loop(
    which, digits_data, monkeypatch
):
    """Losses marked per_parameter with per-client extras (MH-pFedHNGD's teacher, FedProto's
    prototypes, FD's global logits) take the per-parameter loop and agree with the flat loop to 1e-10 (float64);
    the same loss unmarked takes the flat loop."""
    from functools import partial

    from hyperfed.algorithms.fd import fd_loss
    from hyperfed.algorithms.fedproto import proto_loss
    from hyperfed.algorithms.mh_pfedhn import distillation_loss
    from hyperfed.engine import local

    data = dataclasses.replace(digits_data.to(DEVICE), dtype=torch.float64)
    fm, theta, buffers, plan, sgd = _setup("lenet", data, [0, 1], torch.float64)
    torch.manual_seed(1)
    if which == "distillation":
        teacher = FunctionalModel(build_model("lenet", data.input_shape, 10).double())
        loss = partial(
            distillation_loss, teacher=teacher, ce_weight=0.3, kl_weight=0.7, temperature=2.0
        )
        t0 = teacher.initial_params()
        ctx = {"teacher": torch.stack([t0, t0.flip(0)]), "teacher_buffers": torch.zeros(2, 0)}
    elif which == "logits":
        loss = partial(fd_loss, kd_weight=0.5, temperature=2.0)
        ctx = {
            "global_logits": torch.randn(2, 10, 10, dtype=torch.float64),
            "global_mask": (torch.arange(10) % 3 > 0).double().expand(2, 10).clone(),
        }
    else:
        loss = partial(proto_loss, lam=0.5)
        x0 = data.batch(plan.idx[0, 0])[0]
        dim = fm.forward(theta[0], buffers[0], x0, return_features=True)[0].shape[-1]
        ctx = {
            "protos": torch.randn(2, 10, dim, dtype=torch.float64),
            "proto_mask": (torch.arange(10) % 2).double().expand(2, 10).clone(),
        }
    used = []
    leaf_loop = local._leaf_sgd_loop
    monkeypatch.setattr(local, "_leaf_sgd_loop", lambda *a: used.append(1) or leaf_loop(*a))

    def unmarked(*args, **kwargs):
        return loss(*args, **kwargs)

    with channels_last(True):
        leaves = train_clients(
            fm, theta, buffers, data, plan, sgd, loss_fn=loss, ctx=ctx, vectorize=False
        )
        assert len(used) == 2, "one per-parameter loop per client"
        flat = train_clients(
            fm, theta, buffers, data, plan, sgd, loss_fn=unmarked, ctx=ctx, vectorize=False
        )
        assert len(used) == 2, "an unmarked loss takes the flat-vector loop"
    for a, b in zip(leaves, flat):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-9), (a - b).abs().max()
    assert not torch.allclose(leaves[0], theta)


# -- a frozen part is outside the backward pass (issue 35) ------------------------------------


class _Spy(torch.autograd.Function):
    """Identity whose backward counts its calls: autograd runs it only if the backward pass
    goes through the layer it follows."""

    generate_vmap_rule = True
    backward_calls = 0

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        _Spy.backward_calls += 1
        return g


class _SpyLayer(torch.nn.Module):
    def forward(self, x):
        return _Spy.apply(x)


def _two_layer():
    """z = (x W1^T + b1) W2^T + b2 in float64: the body ``features.0`` (followed by the spy),
    the head ``classifier``; two clients of 4 samples, a batch of 4 (one step an epoch)."""
    from toy import toy_federation

    from hyperfed.models.zoo import ZooNet

    d, h, c = 3, 2, 3
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(d, h), _SpyLayer())
    fm = FunctionalModel(ZooNet(body, (d,), c).double(), "two")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, d, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1, 2, 0, 0, 1])
    data = toy_federation(x, y, [torch.arange(0, 4), torch.arange(4, 8)], c)
    theta = torch.randn(2, fm.num_params, generator=g, dtype=torch.float64)
    return fm, data, theta, (d, h, c)


def _two_layer_plan(data, epochs):
    return plan_batches(data.train_idx, epochs, 4, [client_seed(0, 1, k) for k in (0, 1)])


def _unmarked(*args):  # the same loss, not marked per_parameter: the masked-after path
    from hyperfed.engine.local import cross_entropy_loss

    return cross_entropy_loss(*args)


def test_frozen_parameters_are_outside_the_backward_pass():
    """Head-only steps (body frozen) never run the backward of the body's layer, on both
    execution paths; with a loss that reads the flat vector the whole gradient is computed
    and masked after (the spy runs once per step)."""
    fm, data, theta, _ = _two_layer()
    head = fm.layout.mask(["classifier"])
    sgd = SGDConfig(lr=0.5, momentum=0.9, weight_decay=0.1, epochs=3, batch_size=4)
    plan = _two_layer_plan(data, sgd.epochs)
    b = torch.zeros(2, 0, dtype=torch.float64)
    for vectorize in (True, False):
        _Spy.backward_calls = 0
        train_clients(fm, theta, b, data, plan, sgd, trainable=head, vectorize=vectorize)
        assert _Spy.backward_calls == 0, vectorize
        train_clients(
            fm, theta, b, data, plan, sgd, trainable=head, vectorize=vectorize, loss_fn=_unmarked
        )
        assert _Spy.backward_calls == (3 if vectorize else 6), vectorize  # steps (x clients)
        _Spy.backward_calls = 0  # the body's own phase goes through the body
        train_clients(fm, theta, b, data, plan, sgd, trainable=~head, vectorize=vectorize)
        assert _Spy.backward_calls == (3 if vectorize else 6), vectorize


def test_stopped_backward_gives_the_masked_update():
    """Head-only epochs with momentum and weight decay: the body stays bit-identical, and the
    head equals both the masked-after update and torch.optim.SGD's rule computed here
    (d = g + wd h; buf = m buf + d; h -= lr buf; full batch), on both paths."""
    import torch.nn.functional as F

    fm, data, theta, (d, h, c) = _two_layer()
    nb = h * d + h
    head = fm.layout.mask(["classifier"])
    sgd = SGDConfig(lr=0.5, momentum=0.9, weight_decay=0.1, epochs=3, batch_size=4)
    plan = _two_layer_plan(data, sgd.epochs)
    b = torch.zeros(2, 0, dtype=torch.float64)
    expected = []
    for k in range(2):
        x, y = data.x[data.train_idx[k]], data.y[data.train_idx[k]]
        w1, b1 = theta[k, : h * d].view(h, d), theta[k, h * d : nb]
        hk, buf = theta[k, nb:].clone(), torch.zeros(c * h + c, dtype=torch.float64)
        for s in range(3):
            leaf = hk.clone().requires_grad_(True)
            z = (x @ w1.T + b1) @ leaf[: c * h].view(c, h).T + leaf[c * h :]
            (g,) = torch.autograd.grad(F.cross_entropy(z, y), leaf)
            step = g + 0.1 * hk
            buf = step if s == 0 else 0.9 * buf + step
            hk = hk - 0.5 * buf
        expected.append(hk)
    for vectorize in (True, False):
        stopped, _, _ = train_clients(
            fm, theta, b, data, plan, sgd, trainable=head, vectorize=vectorize
        )
        masked, _, _ = train_clients(
            fm, theta, b, data, plan, sgd, trainable=head, vectorize=vectorize, loss_fn=_unmarked
        )
        assert torch.equal(stopped[:, :nb], theta[:, :nb])
        assert torch.allclose(stopped[:, nb:], masked[:, nb:], atol=1e-12)
        assert torch.allclose(stopped[:, nb:], torch.stack(expected), atol=1e-12)
        assert not torch.allclose(stopped[:, nb:], theta[:, nb:])


def test_frozen_flops_count_only_the_trainable_backward():
    """FLOPs of a head-only step of z = (x W1^T + b1) W2^T + b2 on a batch B: forward
    2BDH + 2BHC, backward only dL/dW2 (2BHC); a full backward adds dL/dr (2BHC) and dL/dW1
    (2BDH). Counted for the steps taken (2 clients x 3)."""
    from hyperfed.engine.metering import FlopMeter

    fm, data, theta, (d, h, c) = _two_layer()
    head = fm.layout.mask(["classifier"])
    sgd = SGDConfig(lr=0.5, momentum=0.0, weight_decay=0.0, epochs=3, batch_size=4)
    plan = _two_layer_plan(data, sgd.epochs)
    b = torch.zeros(2, 0, dtype=torch.float64)
    bsz = 4
    for vectorize in (True, False):
        with FlopMeter() as stopped:
            train_clients(fm, theta, b, data, plan, sgd, trainable=head, vectorize=vectorize)
        with FlopMeter() as full:
            train_clients(
                fm, theta, b, data, plan, sgd, trainable=head, vectorize=vectorize,
                loss_fn=_unmarked,
            )  # fmt: skip
        assert stopped.total == 6 * (2 * bsz * d * h + 4 * bsz * h * c)
        assert full.total == 6 * (4 * bsz * d * h + 6 * bsz * h * c)


def _forwards(k):
    """A loss that sums the cross-entropy of k forward passes (k bound in a closure)."""
    from hyperfed.engine.local import cross_entropy_loss

    def loss(*args):
        parts = [cross_entropy_loss(*args) for _ in range(k)]
        return sum(p[0] for p in parts), parts[0][1]

    return loss


def test_flops_of_losses_that_differ_only_in_a_bound_setting_are_measured_apart():
    """One loss function, two bound settings (1 and 2 forward passes), one process: a full
    step of z = (x W1^T + b1) W2^T + b2 costs 4BDH + 6BHC per forward (forward 2BDH + 2BHC,
    backward dW1 2BDH, dr and dW2 2BHC each), so 2 forwards cost twice 1 -- the FLOP cache
    must not hand the second loss the first one's count."""
    from hyperfed.engine.metering import FlopMeter

    fm, data, theta, (d, h, c) = _two_layer()
    sgd = SGDConfig(lr=0.5, momentum=0.0, weight_decay=0.0, epochs=3, batch_size=4)
    plan = _two_layer_plan(data, sgd.epochs)
    b = torch.zeros(2, 0, dtype=torch.float64)
    counts = []
    for k in (1, 2):
        with FlopMeter() as meter:
            train_clients(fm, theta, b, data, plan, sgd, loss_fn=_forwards(k), vectorize=False)
        counts.append(meter.total)
    assert counts == [6 * (4 * 4 * d * h + 6 * 4 * h * c), 12 * (4 * 4 * d * h + 6 * 4 * h * c)]


def test_frozen_parameters_per_client_and_split_parameters():
    """Whole parameters only: a mask that splits a parameter (DisPFL's sparse masks), freezes
    nothing or everything is masked after a full backward (None); rows are per client."""
    from hyperfed.engine.local import frozen_parameters

    fm, _, _, (d, h, c) = _two_layer()
    head = fm.layout.mask(["classifier"])
    assert frozen_parameters(fm, head) == [(True, True, False, False)]
    split = head.clone()
    split[0] = True  # one entry of features.0.weight
    rows = torch.stack([~head, split, torch.ones_like(head), torch.zeros_like(head)])
    assert frozen_parameters(fm, rows) == [(False, False, True, True), None, None, None]


def test_flop_metering_does_not_import_torch_dynamo():
    """FlopSum opts out of torch's dynamo.disable wrap (``_should_skip_dynamo``): counting a
    step's FLOPs must not import torch._dynamo, ~2 s of CPU in every worker process."""
    code = (
        "import sys, torch\n"
        "from hyperfed.engine.metering import FlopSum\n"
        "x = torch.ones(3, 3, requires_grad=True)\n"
        "with FlopSum() as c:\n"
        "    (x @ x).sum().backward()\n"
        # a 3x3 @ 3x3 product is 2 * 27 FLOPs; its backward two more products (x is both sides)
        "assert c.get_total_flops() == 3 * 2 * 27, c.get_total_flops()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
