"""The Python API (issue 56, items 2 and 3): ``hyperfed.run`` / ``load_config`` /
``register_model`` / ``register_method``, and any ``nn.Module`` as a client model.

Every expectation is derived by hand: parameter counts from the layer sizes, upload sizes
(4 bytes a float32) from what each method sends, personal parameter names from the rule the
adapter states (the head is the last ``nn.Linear`` the forward calls).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import hyperfed
from hyperfed import api
from hyperfed.algorithms import ALGORITHMS, get_algorithm
from hyperfed.engine.representations import header_index, representation_join
from hyperfed.errors import ConfigError, HyperfedError
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.split import body_head
from hyperfed.models.zoo import MODELS, build_model, model_names
from hyperfed.plugins import PluginError
from hyperfed.runtime.rundir import json_safe, read_metrics

DIGITS = (1, 8, 8)  # scikit-learn digits: 8x8 grey images, 10 classes
SMALL = {
    "device": "cpu",
    "rounds": 2,
    "eval_every": 1,
    "clients.count": 3,
    "dataset.subsample": 300,
    "local.epochs": 1,
    "local.workers": 1,
    "clients.models": "mlp",
    "algorithm.name": "fedavg",
}


class TwoLayer(nn.Module):
    """Flatten, Linear 64 -> 16, ReLU, Linear 16 -> classes; ``fc`` is registered *before*
    ``body`` but called after it: the head is found by call order, not by attribute order."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(16, num_classes)
        self.body = nn.Sequential(nn.Flatten(1), nn.Linear(math.prod(in_shape), 16), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


class DeepHead(nn.Module):
    """A body Linear 64 -> 16, then ``head`` = Linear 16 -> 8, ReLU, Linear 8 -> classes."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(1), nn.Linear(math.prod(in_shape), 16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def conv_only(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """3x3 conv to one map per class, global average pooling: no Linear at all."""
    return nn.Sequential(
        nn.Conv2d(in_shape[0], num_classes, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(1)
    )


TWO_LAYER_PARAMS = 64 * 16 + 16 + 16 * 10 + 10  # 1210
TWO_LAYER_HEAD = 16 * 10 + 10  # fc: 170


@pytest.fixture(autouse=True)
def _forget_registrations():
    """Models and methods registered by a test are removed after it."""
    yield
    for registry in (MODELS, ALGORITHMS):
        for name in list(registry.added):
            registry.remove(name)


def _head_names(name: str) -> list[str]:
    fm = FunctionalModel(build_model(name, DIGITS, 10), name)
    mask = body_head(fm).head_mask()
    return [s.name for s in fm.layout.segments if bool(mask[s.offset])]


# -- hyperfed.run -----------------------------------------------------------------------------


def test_run_returns_the_metrics_its_run_directory_holds(tmp_path, monkeypatch, capsys):
    result = hyperfed.run(overrides=SMALL, out=tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2]
    assert [json.loads(json.dumps(json_safe(r))) for r in result.records] == rows
    last = rows[-1]
    assert list(result.client_acc) == last["client_acc"] and len(result.client_acc) == 3
    assert (result.mean_acc, result.weighted_acc) == (last["mean_acc"], last["weighted_acc"])
    assert result.client_arch == ("mlp",) * 3 and result.final is result.records[-1]
    assert abs(result.mean_acc - sum(result.client_acc) / 3) < 1e-5  # the mean over clients
    assert result.run_dir == tmp_path / "run" and (result.run_dir / "summary.md").is_file()
    assert (result.config.rounds, result.config.algorithm.name) == (2, "fedavg")
    printed = capsys.readouterr().out
    assert "round 1/2: mean acc" in printed and "round 2/2: mean acc" in printed
    # without out: nothing written anywhere, the same numbers (same config and seed)
    monkeypatch.chdir(tmp_path / "run")
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    again = hyperfed.run(overrides=SMALL, progress=False)
    assert again.run_dir is None and again.client_acc == result.client_acc
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
    assert capsys.readouterr().out == ""


def test_run_refuses_an_out_that_holds_a_run_before_any_work(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(HyperfedError, match="already holds a run"):
        hyperfed.run(overrides=SMALL, out=tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_load_config_takes_a_path_a_dict_a_config_or_none(tmp_path):
    default = hyperfed.load_config()
    assert default.algorithm.name == "mh_pfedhn" and default.rounds == 30  # default.toml
    as_dict = hyperfed.load_config({"rounds": 4, "algorithm": {"name": "fedavg"}})
    assert (as_dict.rounds, as_dict.algorithm.name, as_dict.clients.count) == (4, "fedavg", 10)
    path = tmp_path / "c.toml"
    path.write_text('rounds = 6\n[algorithm]\nname = "local"\n')
    assert hyperfed.load_config(str(path)).rounds == 6
    # overrides as --set strings or as a dict (dotted or nested keys) agree
    a = hyperfed.load_config(path, ["local.lr=0.5", "clients.models=mlp"])
    b = hyperfed.load_config(path, {"local": {"lr": 0.5}, "clients.models": "mlp"})
    assert a == b and (a.local.lr, a.clients.models, a.rounds) == (0.5, "mlp", 6)
    assert hyperfed.load_config(a) is a
    assert hyperfed.load_config(a, {"rounds": 9}).rounds == 9
    # as on the command line, an override wins over the method's per_method table
    table = {"algorithm": {"name": "fedavg"}, "per_method": {"fedavg": {"rounds": 7}}}
    assert hyperfed.load_config(table).rounds == 7
    assert hyperfed.load_config(table, {"rounds": 2}).rounds == 2
    with pytest.raises(ConfigError, match=r"local\.lrr: unknown key; did you mean lr"):
        hyperfed.load_config(None, {"local.lrr": 0.1})


def test_import_hyperfed_loads_no_torch():
    """The API's names load on first use: ``import hyperfed`` itself stays cheap."""
    code = "import sys, hyperfed; print(sorted(m for m in ('torch', 'hyperfed.api') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_package_exports_the_api_lazily():
    names = set(hyperfed.__all__)
    assert {"run", "load_config", "RunResult", "register_model", "register_method"} <= names
    assert {"ExperimentConfig", "Simulation", "ModelPartError"} <= names
    assert names == {"__version__", *hyperfed._EXPORTS}
    for name in hyperfed.__all__:
        assert getattr(hyperfed, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hyperfed.nope  # noqa: B018


# -- any nn.Module as a client model ----------------------------------------------------------


def test_a_plain_module_trains_under_fedavg_fedper_fedrep_with_its_last_linear_personal():
    hyperfed.register_model("two_layer", TwoLayer)
    assert _head_names("two_layer") == ["net.fc.weight", "net.fc.bias"]
    runs = {}
    for method in ("fedavg", "fedper", "fedrep"):
        settings = {**SMALL, "rounds": 1, "algorithm.name": method, "clients.models": "two_layer"}
        runs[method] = hyperfed.run(overrides=settings, progress=False)
    # FedAvg uploads the whole model; FedPer the body only (the personal head stays home)
    assert runs["fedavg"].final["bytes_up_per_client"] == 4 * TWO_LAYER_PARAMS
    assert runs["fedper"].final["bytes_up_per_client"] == 4 * (TWO_LAYER_PARAMS - TWO_LAYER_HEAD)
    # FedRep's head_layers = "classifier" is the module's last Linear, whatever its name
    assert runs["fedrep"].final["bytes_up_per_client"] == 4 * (TWO_LAYER_PARAMS - TWO_LAYER_HEAD)
    assert runs["fedper"].client_arch == ("two_layer",) * 3


def test_the_classifier_is_the_header_that_fedgh_fedtgp_and_fedrod_share():
    """The wrapper keeps the module's parameter order (``fc`` was registered first): the
    header, weight row-major then bias, is the first 16 * 10 + 10 entries of theta."""
    hyperfed.register_model("two_layer", TwoLayer)
    fm = FunctionalModel(build_model("two_layer", DIGITS, 10), "two_layer")
    assert fm.layout.names == [
        "net.fc.weight",
        "net.fc.bias",
        "net.body.1.weight",
        "net.body.1.bias",
    ]
    assert torch.equal(header_index(fm), torch.arange(TWO_LAYER_HEAD))
    assert int(representation_join(fm, 5, "fedgh")["feature_dim"]) == 16


def test_run_takes_a_model_factory_directly():
    result = hyperfed.run(overrides={**SMALL, "rounds": 1}, model=TwoLayer, progress=False)
    assert result.client_arch == ("TwoLayer",) * 3
    assert result.final["bytes_up_per_client"] == 4 * TWO_LAYER_PARAMS
    assert "TwoLayer" in model_names()
    with pytest.raises(ConfigError, match="factory"):
        hyperfed.run(overrides=SMALL, model=TwoLayer(DIGITS, 10), progress=False)


def test_the_head_is_the_last_linear_or_the_named_submodule():
    hyperfed.register_model("deep", DeepHead)
    hyperfed.register_model("deep_named", DeepHead, head="head")
    assert _head_names("deep") == ["net.head.2.weight", "net.head.2.bias"]
    assert _head_names("deep_named") == [
        "net.head.0.weight",
        "net.head.0.bias",
        "net.head.2.weight",
        "net.head.2.bias",
    ]
    # features: the input of the last Linear (8 wide), whichever head is personal
    net = build_model("deep_named", DIGITS, 10)
    assert net.feature_dim == 8 and net.head_prefixes == ("net.head.",)
    x = torch.randn(5, *DIGITS)
    feats, logits = net(x, return_features=True)
    inner = net.net
    want = torch.relu(inner.head[0](inner.body(x)))
    assert torch.equal(feats, want) and torch.equal(logits, inner.head[2](want))
    assert torch.equal(net(x), logits)
    hyperfed.register_model("bad_head", DeepHead, head="tail")
    with pytest.raises(hyperfed.ModelPartError, match="head='tail' names no submodule.*body.1"):
        build_model("bad_head", DIGITS, 10)


def test_a_module_without_a_linear_head_trains_where_no_split_is_needed(tmp_path):
    hyperfed.register_model("conv_only", conv_only)
    net = build_model("conv_only", DIGITS, 10)
    assert net.head_prefixes == () and net.feature_dim is None
    one = {**SMALL, "rounds": 1, "clients.models": "conv_only"}
    result = hyperfed.run(overrides=one, progress=False)
    assert result.final["bytes_up_per_client"] == 4 * (1 * 10 * 9 + 10)  # the conv's 100
    # a method that keeps a head personal: one line naming the method, the model, the fix
    for method in ("fedper", "lg_fedavg"):
        with pytest.raises(hyperfed.ModelPartError) as info:
            hyperfed.run(overrides={**one, "algorithm.name": method}, progress=False)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{method}: model 'conv_only'")
        assert "head='<submodule>'" in message
    with pytest.raises(ConfigError, match="fedproto needs a model whose forward ends in an nn"):
        hyperfed.run(overrides={**one, "algorithm.name": "fedproto"}, progress=False)
    with pytest.raises(hyperfed.ModelPartError, match="needs the features"):
        net(torch.zeros(2, *DIGITS), return_features=True)


def test_a_factory_whose_output_is_not_the_logits_is_refused_in_one_line():
    hyperfed.register_model("wide", lambda s, c: nn.Sequential(nn.Flatten(1), nn.Linear(64, 7)))
    with pytest.raises(hyperfed.ModelPartError, match=r"logits of shape \[batch, 10\].*\(2, 7\)"):
        build_model("wide", DIGITS, 10)
    hyperfed.register_model("crash", lambda s, c: nn.Linear(3, c))  # expects 3 features
    with pytest.raises(hyperfed.ModelPartError, match="fails on a zero batch.*RuntimeError"):
        build_model("crash", DIGITS, 10)


# -- registering in-process ----------------------------------------------------------------


def test_register_model_and_method_join_the_registries_and_replace_their_own():
    hyperfed.register_model("mine", TwoLayer)
    hyperfed.register_model("mine", DeepHead)  # a notebook cell run again: replaced
    assert _head_names("mine") == ["net.head.2.weight", "net.head.2.bias"]
    with pytest.raises(PluginError, match="'lenet' is a built-in model"):
        hyperfed.register_model("lenet", TwoLayer)
    mine = dataclasses.replace(get_algorithm("fedavg"), name="my_fedavg")
    assert hyperfed.register_method(mine) == "my_fedavg"
    cfg = hyperfed.load_config(None, {"algorithm.name": "my_fedavg"})
    assert cfg.hparams() == get_algorithm("fedavg").hparams()
    with pytest.raises(PluginError, match="'fedper' is a built-in algorithm"):
        hyperfed.register_method(dataclasses.replace(mine, name="fedper"))
    with pytest.raises(TypeError, match="expected an Algorithm"):
        hyperfed.register_method("fedavg")  # type: ignore[arg-type]


def test_a_model_registered_in_python_is_refused_with_worker_processes(monkeypatch):
    hyperfed.register_model("two_layer", TwoLayer)
    settings = {**SMALL, "clients.models": "two_layer", "local.workers": 2}
    with pytest.raises(ConfigError, match="local.workers: 'two_layer' was registered"):
        hyperfed.run(overrides=settings, progress=False)
    # auto, with cores for two workers: the run stays in this process, where the model is
    monkeypatch.setenv("HYPERFED_CORES", "2")
    sim = api.build_simulation(api.load_config(overrides={**settings, "local.workers": "auto"}))
    assert sim.workers == 1 and sim.transport.parallel is None
