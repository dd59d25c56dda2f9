"""Plugins (issue 28 item 3): another installed package's algorithms, models and datasets.

Each test installs a real, tiny plugin distribution into ``tmp_path``: a package plus a
``*.dist-info`` folder with ``METADATA`` and ``entry_points.txt``, on ``sys.path``, exactly what
``pip install`` leaves in site-packages. :func:`importlib.metadata.entry_points` finds it the
way it finds any installed package.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import invoke, sets

from hyperfed import plugins
from hyperfed.algorithms import registry
from hyperfed.data.sources import dataset_names, load_dataset
from hyperfed.models.zoo import build_model, model_names, param_count

PLUGIN_MODULES = ("hfplug_demo", "hfplug_clash")

ALGO = '''
"""FedAvg with an unweighted mean; each client also uploads its sample count."""
from dataclasses import dataclass

import torch

from hyperfed.algorithms.base import Algorithm, Client, Server


@dataclass
class Params:
    """No hyperparameters."""


class UniformServer(Server):
    def __init__(self, hp, clients, ctx):
        super().__init__(hp, clients, ctx)
        self.theta = ctx.model_with(int(next(iter(clients.values()))["num_params"]))
        self.theta = self.theta.initial_params().to(ctx.device)

    def configure_train(self, rnd, client_ids):
        return {c: {"theta": self.theta} for c in client_ids}

    configure_eval = lambda self, ids: self.configure_train(0, ids)  # noqa: E731

    def aggregate(self, rnd, replies):
        self.theta = torch.stack([r["theta"] for r in replies.values()]).mean(0)


class UniformClient(Client):
    def fit(self, group, msg, state):
        theta, buffers, loss = group.train(msg["theta"], state["buffers"])
        return {"theta": theta, "n": group.num_samples}, {"buffers": buffers}, loss

    def eval_model(self, group, msg, state):
        return msg["theta"], state["buffers"]


ALGORITHM = Algorithm(
    "fedavg_uniform", "FedAvg, unweighted mean (a plugin)", Params, UniformServer, UniformClient,
    homogeneous_only=True,
)
'''

NETS = '''
from torch import nn

from hyperfed.models.zoo import ZooNet


def build_tiny_net(in_shape, num_classes):
    """One hidden layer of 5 units."""
    body = nn.Sequential(nn.Flatten(1), nn.Linear(in_shape[0], 5), nn.ReLU())
    return ZooNet(body, in_shape, num_classes)
'''

DATA = '''
import numpy as np

from hyperfed.data.sources import ArrayDataset


def load_tiny_blobs(data_dir=None):
    """237 vectors of 7 features, 3 well separated classes."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 237)
    x = (4 * np.eye(7)[y] + rng.normal(0, 0.3, (237, 7))).astype(np.float32)
    return ArrayDataset("tiny_blobs", x[:180], y[:180], x[180:], y[180:], 3, (), ())
'''

DEMO_ENTRY_POINTS = """
[hyperfed.algorithms]
fedavg_uniform = hfplug_demo.algo

[hyperfed.models]
tiny_net = hfplug_demo.nets:build_tiny_net

[hyperfed.datasets]
tiny_blobs = hfplug_demo.data:load_tiny_blobs
"""


def install(site: Path, dist: str, entry_points: str, files: dict[str, str]) -> None:
    """What ``pip install`` leaves: the package's files and ``<dist>-0.1.dist-info``."""
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site-packages folder on sys.path; plugin caches cleared before and after."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    plugins.reset()
    yield site
    plugins.reset()
    for name in list(sys.modules):
        if name.split(".")[0] in PLUGIN_MODULES:
            del sys.modules[name]


@pytest.fixture
def demo(site):
    files = {
        "hfplug_demo/__init__.py": "",
        "hfplug_demo/algo.py": ALGO,
        "hfplug_demo/nets.py": NETS,
        "hfplug_demo/data.py": DATA,
    }
    install(site, "hfplug-demo", DEMO_ENTRY_POINTS, files)
    return site


def test_without_plugins_the_registries_are_the_built_ins(site):
    assert "fedavg_uniform" not in registry()
    assert "tiny_net" not in model_names()
    assert "tiny_blobs" not in dataset_names()


def test_plugin_entries_join_the_registries(demo):
    assert registry()["fedavg_uniform"].summary == "FedAvg, unweighted mean (a plugin)"
    assert model_names()[-1] == "tiny_net" and "lenet" in model_names()
    net = build_model("tiny_net", (7,), 3)
    assert net.arch == "tiny_net" and param_count(net) == 7 * 5 + 5 + 5 * 3 + 3
    ds = load_dataset("tiny_blobs")
    assert (ds.num_train, ds.num_test, ds.input_shape, ds.num_classes) == (180, 57, (7,), 3)


@pytest.mark.parametrize(
    "what,name,package",
    [
        ("algorithms", "fedavg_uniform", "hfplug-demo"),
        ("models", "tiny_net", "plugin: hfplug-demo"),
        ("datasets", "tiny_blobs", "plugin: hfplug-demo"),
    ],
)
def test_hyperfed_list_shows_the_plugins(demo, what, name, package):
    result = invoke("list", what, "--input-shape", "7")
    assert result.exit_code == 0, result.output
    assert re.search(rf"^\W*{name}\W", result.output, re.M), result.output
    if what != "algorithms":
        assert package in result.output


def test_hyperfed_run_runs_the_plugin_algorithm_model_and_dataset(demo, tmp_path):
    out = tmp_path / "run"
    settings = [
        "device=cpu",
        "dataset.name=tiny_blobs",
        "partition.name=iid",
        "clients.count=3",
        "clients.models=tiny_net",
        "algorithm.name=fedavg_uniform",
        "local.epochs=2",
        "local.lr=0.1",
        "local.batch_size=8",
        "rounds=2",
        "eval_every=1",
    ]
    result = invoke("run", "--quiet", "--out", str(out), *sets(settings))
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    last = records[-1]
    assert last["client_arch"] == ["tiny_net"] * 3
    # the plugin model on the plugin data (7 features, 3 classes): 58 parameters; the plugin
    # client uploads them plus its sample count (the built-in FedAvg would upload 58 values)
    assert last["bytes_up_per_client"] == 4 * (58 + 1)
    # 237 samples over 3 clients (iid), a quarter of each client's share for test: each
    # accuracy is k / 20, and the separable blobs are learnt (chance is 1/3)
    assert all(abs(a * 20 - round(a * 20)) < 1e-4 for a in last["client_acc"]), last
    assert last["mean_acc"] > 0.9, last["client_acc"]
    assert "tiny_blobs" in (out / "config.toml").read_text()


def test_a_broken_plugin_is_skipped_with_a_one_line_warning(demo, caplog):
    install(
        demo,
        "hfplug-broken",
        "[hyperfed.models]\nbroken_net = hfplug_missing.nets:build\n"
        "[hyperfed.datasets]\nnot_callable = hfplug_demo:__name__\n"
        "[hyperfed.algorithms]\ncrash = hfplug_clash.crash\n",
        {"hfplug_clash/__init__.py": "", "hfplug_clash/crash.py": "raise RuntimeError('no GPU')"},
    )
    with caplog.at_level(logging.WARNING, logger="hyperfed.plugins"):
        names = model_names()
        datasets = dataset_names()
        algorithms = registry()
    assert "tiny_net" in names and "broken_net" not in names  # the good plugin still loads
    assert "tiny_blobs" in datasets and "not_callable" not in datasets
    assert "fedavg_uniform" in algorithms and "fedavg" in algorithms
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    for m in messages:
        assert "\n" not in m and "hfplug-broken" in m
    assert any("ModuleNotFoundError" in m and "hfplug_missing" in m for m in messages)
    assert any("RuntimeError: no GPU" in m for m in messages)


def test_a_name_clash_with_a_built_in_is_a_one_line_error_naming_both(demo):
    nets = "def build(in_shape, num_classes):\n    raise AssertionError\n"
    install(
        demo,
        "hfplug-clash",
        "[hyperfed.models]\nlenet = hfplug_clash:build\n",
        {"hfplug_clash/__init__.py": nets},
    )
    result = invoke("list", "models")
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    for word in ("'lenet'", "hfplug-clash", "built-in model"):
        assert word in line, line
    result = invoke("run", *sets(["clients.models=lenet"]))
    assert result.exit_code == 2 and "hfplug-clash" in result.output


def test_an_algorithm_plugin_named_like_a_built_in_is_refused(demo):
    text = ALGO.replace('"fedavg_uniform", "FedAvg', '"fedavg", "FedAvg')
    install(
        demo,
        "hfplug-clash",
        "[hyperfed.algorithms]\nmine = hfplug_clash.algo:ALGORITHM\n",
        {"hfplug_clash/__init__.py": "", "hfplug_clash/algo.py": text},
    )
    with pytest.raises(plugins.PluginError, match="'fedavg'.*hfplug-clash.*built-in"):
        registry()


def test_a_model_builder_may_return_any_module_but_not_something_else(site):
    install(
        site,
        "hfplug-clash",
        "[hyperfed.models]\nplain = hfplug_clash:build\nnot_a_module = hfplug_clash:tensor\n",
        {
            "hfplug_clash/__init__.py": "import torch\n"
            "build = lambda s, c: torch.nn.Linear(s[0], c)\n"
            "tensor = lambda s, c: torch.zeros(c)\n"
        },
    )
    # a plain module is wrapped (issue 56): its Linear is the classifier, 3 * 2 + 2 params
    net = build_model("plain", (3,), 2)
    assert type(net).__name__ == "ModuleNet" and param_count(net) == 8
    assert net.head_prefixes == ("net.",) and net.feature_dim == 3
    with pytest.raises(plugins.PluginError, match="returned Tensor, not a torch.nn.Module"):
        build_model("not_a_module", (3,), 2)


def test_hyperfed_list_skips_a_faulty_plugin_by_name(demo, caplog):
    """A model whose builder raises and an algorithm whose hyperparameters cannot be read are
    left out of the listing with a warning naming them; the rest is listed (issue 56)."""
    nets = "def build(in_shape, num_classes):\n    raise RuntimeError('needs a GPU')\n"
    algo = ALGO.replace('"fedavg_uniform", "FedAvg', '"half_done", "FedAvg').replace(
        "Params, UniformServer", "None, UniformServer"
    )
    install(
        demo,
        "hfplug-broken",
        "[hyperfed.models]\nbroken_net = hfplug_clash:build\n"
        "[hyperfed.algorithms]\nhalf_done = hfplug_clash.algo\n",
        {"hfplug_clash/__init__.py": nets, "hfplug_clash/algo.py": algo},
    )
    for what, good, bad, why in [
        ("models", "tiny_net", "broken_net", "RuntimeError: needs a GPU"),
        ("algorithms", "fedavg_uniform", "half_done", "TypeError"),
    ]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hyperfed.plugins"):
            result = invoke("list", what, "--input-shape", "7", "--classes", "3")
        assert result.exit_code == 0, result.output
        assert re.search(rf"^\W*{good}\W", result.output, re.M), result.output
        assert re.search(r"^\W*fedavg\W|^\W*mlp\W", result.output, re.M), result.output
        assert bad not in result.output
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 1 and bad in messages[0] and why in messages[0], messages
