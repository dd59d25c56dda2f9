"""Seed 003's configs: each method gets the paper's schedule (rounds x local epochs, §4
Training Strategies) and local lr (§B.2) through ``[per_method.<name>]`` tables, the CPU
config scales every schedule by one factor, IPC follows §4 per dataset, and the ConvNet is
the normalized one (``convnet_in``).

The expected values below are typed from the seed text (shared/seeds/003_*.txt, §4 and
§B.2), not read from the configs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hyperfed.config import ConfigError, config_from_dict, load_config, to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SEED003 = Path(__file__).resolve().parents[1] / "configs" / "seed003"
PAPER = sorted(SEED003.glob("table[12]_*.toml"))
CPU = SEED003 / "cpu_fmnist.toml"

# §4 Training Strategies: (rounds, local epochs); §B.2: local lr. The hypernetwork methods'
# lr is 1e-3 ("all of these methods use a local client learning rate of 1e-3").
HN = (500, 1, 1e-3)
SCHEDULE = {
    "fedavg": (200, 10, 0.01),
    "fedbn": (200, 10, 0.01),
    "fedgh": (200, 10, 5e-3),
    "fedtgp": (200, 10, 0.01),
    "desa": (100, 1, 0.01),  # "100 local training epochs" (official code: 100 x 1)
    "pfedhn": HN,
    "pfedlhn": HN,
    "mh_pfedhn": HN,
    "mh_pfedhngd": HN,
    "mh_pfedhndd": HN,
    # Table 5's plug-ins: their base method's schedule
    "fedavg_dd": (200, 10, 0.01),
    "fedbn_dd": (200, 10, 0.01),
    "fedgh_dd": (200, 10, 5e-3),
    "pfedhn_dd": HN,
    "pfedlhn_dd": HN,
}
DD = ("mh_pfedhndd", "fedavg_dd", "fedbn_dd", "fedgh_dd", "pfedhn_dd", "pfedlhn_dd")


def _load(path: Path, method: str, *sets: str):  # type: ignore[no-untyped-def]
    return load_config(path, [f"algorithm.name={method}", *sets])


@pytest.mark.parametrize(
    "path",
    [SEED003 / "table1_cifar10_dir0.1_homo.toml", SEED003 / "table1_cifar100_dir0.02_hetero.toml"],
    ids=lambda p: p.stem,
)
def test_each_method_gets_the_seeds_schedule(path: Path) -> None:
    got = {}
    for method in SCHEDULE:
        cfg = _load(path, method)
        assert cfg.local.lr is not None
        got[method] = (cfg.rounds, cfg.local.epochs, cfg.local.lr)
    assert got == SCHEDULE
    feddm = _load(path, "feddm")
    assert feddm.rounds == 20  # §4: 20 rounds, 500 global (server) epochs in all
    assert feddm.rounds * feddm.hparams().server_epochs == 500


def test_every_paper_config_has_the_same_schedules() -> None:
    """The 16 Table 1 / Table 2 files differ in data and models only, not in schedules."""
    assert len(PAPER) == 16
    tables = {p.name: tomllib.loads(p.read_text())["per_method"] for p in PAPER}
    first = next(iter(tables.values()))
    assert all(t == first for t in tables.values())
    raw = tomllib.loads(PAPER[0].read_text())
    assert (raw["rounds"], raw["local"]["epochs"], raw["local"]["lr"]) == HN


def test_cpu_config_scales_every_schedule_by_one_factor() -> None:
    """cpu_fmnist.toml: rounds = paper rounds / 10 for every method (FedDM's 20 -> 2 with the
    same 25 server epochs a round), the local epochs per round unchanged."""
    paper = SEED003 / "table1_cifar10_dir0.1_homo.toml"
    for method in [*SCHEDULE, "feddm"]:
        big, small = _load(paper, method), _load(CPU, method)
        assert small.rounds * 10 == big.rounds, method
        assert small.local.epochs == big.local.epochs, method
    assert _load(CPU, "feddm").hparams().server_epochs == 25


def test_ipc_follows_section_4_per_dataset() -> None:
    """MH-pFedHNDD and the plug-ins that reuse its distillation: IPC 50 on CIFAR-10, 10 on
    CIFAR-100; FedDM and DESA: IPC 50 and 1000 iterations everywhere."""
    for path in PAPER[:1] + PAPER[-1:]:  # one of each dataset, through the config loader
        ipc = 50 if "_cifar10_" in path.name else 10
        for method in DD:
            hp = _load(path, method).hparams()
            assert (hp.ipc, hp.distill_iters) == (ipc, 3000), (path.name, method)
        for method in ("feddm", "desa"):
            hp = _load(path, method).hparams()
            assert (hp.ipc, hp.distill_iters) == (50, 1000), (path.name, method)
    for path in PAPER:  # and every file's tables
        ipc = 50 if "_cifar10_" in path.name else 10
        algorithm = tomllib.loads(path.read_text())["algorithm"]
        assert {m: algorithm[m]["ipc"] for m in DD} == dict.fromkeys(DD, ipc), path.name
        assert algorithm["feddm"]["ipc"] == algorithm["desa"]["ipc"] == 50, path.name


def test_paper_configs_use_the_normalized_convnet() -> None:
    for path in PAPER:
        cfg = _load(path, "mh_pfedhngd")
        models = [cfg.clients.models] if isinstance(cfg.clients.models, str) else cfg.clients.models
        assert "convnet_in" in models and "convnet" not in models, path.name
        assert cfg.hparams().global_model == "convnet_in"


def test_an_explicit_set_wins_and_the_saved_config_is_resolved(tmp_path: Path) -> None:
    path = SEED003 / "table1_cifar10_dir0.1_homo.toml"
    cfg = _load(path, "fedavg", "rounds=7", "local.lr=0.5")
    assert (cfg.rounds, cfg.local.epochs, cfg.local.lr) == (7, 10, 0.5)
    cfg = _load(path, "fedavg", "per_method.fedavg.rounds=3")
    assert cfg.rounds == 3
    # the run directory's config.toml holds the resolved values (resume reads it back)
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(_load(path, "fedavg", "rounds=7")))
    again = load_config(saved)
    assert (again.rounds, again.local.epochs, again.local.lr) == (7, 10, 0.01)
    assert "per_method" not in saved.read_text()


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        ({"fedavgg": {"rounds": 3}}, r"^per_method\.fedavgg: not an algorithm name"),
        ({"fedavg": {"round": 3}}, r"^per_method\.fedavg\.round: unknown key; allowed: rounds"),
        ({"fedavg": {"rounds": 0}}, r"^per_method\.fedavg\.rounds: .*from 1 to 1000000 \(got 0\)"),
        ({"pfedhn": {"local": {"epocs": 2}}}, r"^per_method\.pfedhn\.local\.epocs: unknown key"),
        ({"fedavg": 3}, r"^per_method\.fedavg: expected a table"),
    ],
)
def test_bad_per_method_tables_are_one_line_errors(tables: dict, message: str) -> None:
    """Every table is checked, also those of methods that do not run."""
    with pytest.raises(ConfigError, match=message) as info:
        config_from_dict({"algorithm": {"name": "mh_pfedhn"}, "per_method": tables})
    assert "\n" not in str(info.value)
