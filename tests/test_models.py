"""Tests for the model zoo (hyperfed.models.zoo)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

from hyperfed.models import (
    MODEL_REGISTRY,
    ModelInputError,
    ZooNet,
    build_model,
    check_input,
    describe_model,
    model_names,
    param_count,
)

ALL = model_names()
TINY_OK = {
    "lenet", "mlp", "vgg8", "resnet10", "resnet12", "resnet18", "resnet18_cifar", "convnet",
    "convnet_in",
}  # fmt: skip
PFEDES = ["cnn1", "cnn2", "cnn3", "cnn4", "cnn5"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny batches: one intra-op thread is faster and immune to a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(name: str, in_shape: tuple[int, ...], num_classes: int) -> ZooNet:
    torch.manual_seed(0)
    return build_model(name, in_shape, num_classes)


def _check_forward(model: ZooNet, in_shape: tuple[int, ...], num_classes: int) -> None:
    model.eval()  # Dropout off, so both calls below see the same function
    x = torch.randn(2, *in_shape)
    logits = model(x)
    assert logits.shape == (2, num_classes)
    feats, logits2 = model(x, return_features=True)
    last_linear = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert last_linear is model.classifier
    assert feats.shape == (2, last_linear.in_features) == (2, model.feature_dim)
    torch.testing.assert_close(logits, logits2)
    torch.testing.assert_close(last_linear(feats), logits)


def test_registry_names() -> None:
    expected = {
        "lenet", "mlp", "vgg8", "resnet10", "resnet12", "resnet18", "convnet", "convnet_in",
        "resnet9",
        *PFEDES, "kt_cnn_small", "kt_cnn_large", "squeezenet1_0", "squeezenet1_1",
        "resnet18_cifar", "lenet_wide", "mlp_wide", "vgg8_wide", "mlp_lenet_size",
        "vgg8_lenet_size",
    }  # fmt: skip
    assert set(ALL) == expected == set(MODEL_REGISTRY)


@pytest.mark.parametrize("name", ALL)
def test_forward_cifar100(name: str) -> None:
    model = _build(name, (3, 32, 32), 100)
    print(f"{name} (3,32,32)/100: {param_count(model):,} params")
    _check_forward(model, (3, 32, 32), 100)


@pytest.mark.parametrize("name", ALL)
def test_forward_mnist(name: str) -> None:
    _check_forward(_build(name, (1, 28, 28), 10), (1, 28, 28), 10)


@pytest.mark.parametrize("name", ALL)
def test_digits_8x8(name: str) -> None:
    side = MODEL_REGISTRY[name].min_side
    if side <= 8:
        _check_forward(_build(name, (1, 8, 8), 10), (1, 8, 8), 10)
    else:
        with pytest.raises(ModelInputError, match=rf"^{name} .*at least {side}x{side} \(H x W\)"):
            build_model(name, (1, 8, 8), 10)
    assert {n for n in ALL if MODEL_REGISTRY[n].min_side <= 8} >= TINY_OK


@pytest.mark.parametrize("name", PFEDES)
def test_pfedes_cnns_refuse_8x8(name: str) -> None:
    with pytest.raises(ModelInputError) as info:
        check_input(name, (1, 8, 8))
    msg = str(info.value)
    assert "\n" not in msg and name in msg and "16x16" in msg


@pytest.mark.parametrize("name", [n for n in ALL if MODEL_REGISTRY[n].min_side > 1])
def test_min_side_is_tight(name: str) -> None:
    """The registry's min_side is the true limit of the architecture (checked without the guard)."""
    side = MODEL_REGISTRY[name].min_side
    builder = MODEL_REGISTRY[name].builder
    builder((1, side, side + 3), 3).eval()(torch.zeros(1, 1, side, side + 3))
    with pytest.raises(RuntimeError):
        builder((1, side + 3, side - 1), 3).eval()(torch.zeros(1, 1, side + 3, side - 1))
    with pytest.raises(ModelInputError, match=f"{side}x{side}"):
        check_input(name, (1, side + 3, side - 1))


@pytest.mark.parametrize("name", ALL)
def test_head_prefixes(name: str) -> None:
    model = _build(name, (3, 32, 32), 10)
    names = [n for n, _ in model.named_parameters()]
    assert model.head_prefixes
    for prefix in model.head_prefixes:
        assert any(n.startswith(prefix + ".") for n in names), prefix
    head = [n for n in names if n.startswith(tuple(p + "." for p in model.head_prefixes))]
    assert "classifier.weight" in head and "classifier.bias" in head
    assert len(head) < len(names)  # the body stays outside the head
    if name == "mlp":
        assert head == ["classifier.weight", "classifier.bias"]


def test_mlp_vector_input() -> None:
    model = _build("mlp", (64,), 10)
    assert model(torch.randn(5, 64)).shape == (5, 10)
    feats, _ = model(torch.randn(5, 64), return_features=True)
    assert feats.shape == (5, 64)
    assert param_count(model) == 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10


def test_lenet_param_count_by_hand() -> None:
    expected = (
        (3 * 3 * 3 * 16 + 16)  # conv1
        + (16 * 3 * 3 * 32 + 32)  # conv2
        + (2048 * 108 + 108)  # fc1
        + (108 * 64 + 64)  # fc2
        + (64 * 100 + 100)  # fc3
    )
    assert param_count(_build("lenet", (3, 32, 32), 100)) == expected == 239_856


def test_counts_match_paper_sizes() -> None:
    """Paper sizes are float32 MiB (000 Table 20, 002 Table 1) or exact counts (001, 004)."""

    def mib(name: str, num_classes: int) -> float:
        return param_count(_build(name, (3, 32, 32), num_classes)) * 4 / 2**20

    for name, size in [
        ("lenet", 0.915),
        ("vgg8", 1.048),
        ("resnet10", 1.347),
        ("resnet12", 2.018),
        ("resnet18", 2.179),
    ]:
        assert round(mib(name, 100), 3) == size, name
    for name, size in [("cnn1", 10.00), ("cnn2", 6.92), ("cnn3", 5.04)]:
        assert round(mib(name, 10), 2) == size, name
    assert param_count(_build("kt_cnn_small", (3, 32, 32), 10)) == 1_706_458
    assert param_count(_build("resnet18_cifar", (3, 32, 32), 10)) == 11_173_962


def test_unknown_name() -> None:
    with pytest.raises(KeyError) as info:
        build_model("resnet1000", (3, 32, 32), 10)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "\n" not in msg and "resnet1000" in msg and all(n in msg for n in ALL)
    with pytest.raises(ValueError):
        describe_model("nope")


def test_bad_shapes() -> None:
    for shape in [(3, 32), (64,), (3, 0, 32), (1, 3, 32, 32)]:
        with pytest.raises(ModelInputError, match="lenet .*4x4"):
            check_input("lenet", shape)
    with pytest.raises(ModelInputError):
        check_input("mlp", (0,))
    with pytest.raises(ValueError):
        build_model("lenet", (3, 32, 32), 0)


@pytest.mark.parametrize("name", ALL)
def test_describe(name: str) -> None:
    text = describe_model(name)
    assert "\n" not in text and text.startswith(name) and ("Table" in text or "section" in text)


def test_construction_is_deterministic_and_leaves_buffers() -> None:
    for name in ["vgg8", "resnet10"]:
        a, b = _build(name, (3, 32, 32), 10), _build(name, (3, 32, 32), 10)
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert ka == kb
            torch.testing.assert_close(va, vb)
    bn = _build("resnet10", (1, 8, 8), 10).features.bn
    assert int(bn.num_batches_tracked) == 0 and bool((bn.running_var == 1).all())


def test_convnet_param_counts_by_hand() -> None:
    """Seed 003's ConvNet (Table 10) on CIFAR-10 (3x32x32, 10 classes): three padded 3x3 convs
    of 128 channels, 32 -> 16 -> 8 -> 4 pixels after the three 2x2 pools, FC 128*4*4 -> 10.
    ``convnet_in`` adds an affine instance norm (gamma, beta per channel) after each conv."""
    conv1 = 3 * 128 * 3 * 3 + 128  # 3,584
    conv2 = 128 * 128 * 3 * 3 + 128  # 147,584
    conv3 = 128 * 128 * 3 * 3 + 128  # 147,584
    norms = 3 * (128 + 128)  # 768: gamma and beta of 128 channels, after each conv
    fc = 128 * 4 * 4 * 10 + 10  # 20,490
    assert param_count(_build("convnet", (3, 32, 32), 10)) == conv1 + conv2 + conv3 + fc == 319_242
    in_count = conv1 + conv2 + conv3 + norms + fc
    assert param_count(_build("convnet_in", (3, 32, 32), 10)) == in_count == 320_010


def test_convnet_in_normalizes_each_conv_per_sample_and_channel_before_the_relu() -> None:
    """Zhao et al.'s ConvNet, layer by layer, computed here with plain tensor ops: conv, then
    ``gamma * (h - mean) / sqrt(var + 1e-5) + beta`` with mean / biased var over H x W of each
    sample and channel, then ReLU, then 2x2 average pooling; FC on the flattened maps."""
    model = _build("convnet_in", (3, 8, 8), 5)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # gamma, beta away from their 1 / 0 defaults so both matter
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(convs) == len(norms) == 3
    x = torch.randn(2, 3, 8, 8, generator=g)
    h = x
    for conv, norm in zip(convs, norms, strict=True):
        h = torch.nn.functional.conv2d(h, conv.weight, conv.bias, padding=1)
        mean = h.mean(dim=(2, 3), keepdim=True)
        var = h.var(dim=(2, 3), unbiased=False, keepdim=True)
        h = (h - mean) / torch.sqrt(var + 1e-5)
        h = norm.weight[None, :, None, None] * h + norm.bias[None, :, None, None]
        h = torch.relu(h)
        h = 0.25 * (h[..., ::2, ::2] + h[..., 1::2, ::2] + h[..., ::2, 1::2] + h[..., 1::2, 1::2])
    expected = h.flatten(1) @ model.classifier.weight.T + model.classifier.bias
    for mode in (model.train, model.eval):  # per-sample statistics: the same in both modes
        mode()
        torch.testing.assert_close(model(x), expected)


def test_fedbn_keeps_the_instance_norm_of_convnet_in_local() -> None:
    """FedBN's local part on seed 003's ConvNet: the 768 affine norm parameters of
    ``convnet_in`` (3 layers x 128 channels x (gamma, beta)); none on the plain ``convnet``,
    where FedBN is FedAvg."""
    from hyperfed.models.layout import FunctionalModel
    from hyperfed.models.select import norm_mask

    fm = FunctionalModel(_build("convnet_in", (3, 32, 32), 10), "convnet_in")
    mask = norm_mask(fm)
    assert int(mask.sum()) == 3 * 2 * 128
    local = {s.name for s in fm.layout.segments if bool(mask[s.offset : s.end].all())}
    assert local == {f"features.{i}.{p}" for i in (1, 5, 9) for p in ("weight", "bias")}
    plain = FunctionalModel(_build("convnet", (3, 32, 32), 10), "convnet")
    assert int(norm_mask(plain).sum()) == 0


@pytest.mark.parametrize("name", ["lenet", "resnet10", "convnet_in"])
def test_vmap_over_clients(name: str) -> None:
    model = _build(name, (3, 32, 32), 10)
    params = {k: torch.stack([v, v + 0.01]) for k, v in model.named_parameters()}
    buffers = {k: torch.stack([v, v]) for k, v in model.named_buffers()}
    x = torch.randn(4, 3, 32, 32)

    def run(p: dict, b: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return functional_call(model, (p, b), (x,), {"return_features": True})

    model.eval()
    feats, logits = vmap(run, in_dims=(0, 0, None))(params, buffers, x)
    assert logits.shape == (2, 4, 10) and feats.shape == (2, 4, model.feature_dim)
    torch.testing.assert_close(logits[0], model(x))
    assert not torch.allclose(logits[0], logits[1])

    model.train()  # BatchNorm in train mode works when the buffers are stacked too
    _, logits = vmap(run, in_dims=(0, 0, None))(params, buffers, x)
    assert logits.shape == (2, 4, 10)
    if buffers:
        assert int(buffers["features.bn.num_batches_tracked"][0]) == 1
        assert not torch.equal(buffers["features.bn.running_mean"][0], torch.zeros(16))


def test_seed_003_wide_variants_match_tables_11_to_13():
    """Seed 003 widens FC2 to 2048: LeNet-style FC 2048x108, 108x2048, 2048x100 (Table 11),
    MLP 3072x128, 128x2048, 2048x100 (Table 12), VGG8 1024x180, 180x2048, 2048x100 (Table 13),
    on 32x32x3 inputs with 100 classes; the conv parts are the seed 000 models'."""
    from hyperfed.models.zoo import build_model

    def count(name: str) -> int:
        return sum(p.numel() for p in build_model(name, (3, 32, 32), 100).parameters())

    def fc(*dims: int) -> int:
        return sum(a * b + b for a, b in zip(dims, dims[1:]))

    lenet_convs = (3 * 16 * 9 + 16) + (16 * 32 * 9 + 32)
    assert count("lenet_wide") == lenet_convs + fc(2048, 108, 2048, 100)
    assert count("mlp_wide") == fc(3072, 128, 2048, 100)
    vgg_convs = count("vgg8") - fc(1024, 180, 64, 100)
    assert count("vgg8_wide") == vgg_convs + fc(1024, 180, 2048, 100)


@pytest.mark.parametrize("name", ["lenet", "resnet10"])
def test_functional_model_binds_flat_views_like_functional_call(name: str) -> None:
    """Outside torch.func transforms FunctionalModel puts theta's views straight into the
    modules' slots (no functional_call): same outputs and BatchNorm statistics as
    functional_call, gradients reach theta, and the module's own tensors are back after the
    call, also when the forward raises."""
    from hyperfed.models.layout import FunctionalModel

    fm = FunctionalModel(_build(name, (3, 16, 16), 10), name)
    own = {k: v.clone() for k, v in fm.module.state_dict().items()}
    theta = fm.initial_params() + 0.01 * torch.randn(fm.num_params)
    buffers = fm.initial_buffers() + 0.1
    x = torch.randn(4, 3, 16, 16)

    tensors = {**fm.layout.unflatten(theta), **fm.buffer_layout.unflatten(buffers.clone())}
    counters = {n: torch.zeros((), dtype=torch.long) for n, b in fm.module.named_buffers()}
    tensors.update({n: c for n, c in counters.items() if n not in tensors})
    fm.module.train()
    expected = functional_call(fm.module, tensors, (x,))
    leaf = theta.clone().requires_grad_(True)
    logits, new_buffers = fm.forward_train(leaf, buffers, x)
    torch.testing.assert_close(logits, expected)
    if fm.num_buffers:  # BatchNorm wrote its statistics into the returned copy only
        expected_buffers = fm.buffer_layout.flatten({k: tensors[k] for k in fm.buffer_layout.names})
        torch.testing.assert_close(new_buffers, expected_buffers)
        assert not torch.equal(new_buffers, buffers)
    (g,) = torch.autograd.grad(logits.sum(), leaf)
    assert g.abs().sum() > 0
    fm.module.eval()
    torch.testing.assert_close(
        fm.forward(theta, buffers, x),
        functional_call(
            fm.module, {**fm.layout.unflatten(theta), **fm.buffer_layout.unflatten(buffers)}, (x,)
        ),
    )
    with pytest.raises(RuntimeError):
        fm.forward(theta, buffers, torch.randn(4, 5, 16, 16))  # wrong channel count
    for k, v in fm.module.state_dict().items():
        assert torch.equal(v, own[k]), k
    assert all(isinstance(p, nn.Parameter) for p in fm.module.parameters())


def test_functional_model_binds_a_tied_weight_in_every_slot() -> None:
    from hyperfed.models.layout import FunctionalModel

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3, bias=False)
            self.b = nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    fm = FunctionalModel(Tied(), "tied")
    assert fm.num_params == 9
    theta = torch.eye(3).reshape(-1) * 2
    out = fm.forward(theta, fm.initial_buffers(), torch.ones(1, 3))
    torch.testing.assert_close(out, torch.full((1, 3), 4.0))  # (2I)(2I) x
