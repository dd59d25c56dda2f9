"""Conformance of every registered algorithm (issue 19, items 1 and 4).

Parametrized over ``hyperfed.algorithms.registry()``, so a method is tested the day it is
registered. Each method runs a short default digits federation (default.toml and the method's
own defaults; only sizes shrunk, see ``SmallSim`` in conftest.py), once with one architecture
and, unless it is ``homogeneous_only``, once with the default mix of LeNet, VGG8 and MLP.
On that run:

* every reply passes the server's validation (no rejection, in the rounds or in a setup
  phase): a rejected update in a default config is a failure, not a warning;
* every number in every metrics record, every client's state and the server's state is finite;
* each client's replies keep one set of keys, shapes and dtypes, and the server's validation
  refuses a reply that does not match it (a NaN, a wrong length, a missing or an extra tensor:
  DESIGN contracts 1 and 6);
* the state after round 1, serialized as a checkpoint and loaded into a simulation rebuilt
  from the resolved config, runs round 2 to identical metrics;
* the vmapped client step, and the reference nn.Module loop for methods that train with
  plain cross-entropy, give the default per-client loop's replies, states and metrics.

Item 4: the MH family's VGG8 clients sent NaN at the hypernetwork width of its tests (the
last two tests). Known gaps are strict xfails (they start failing once fixed, so the entry
gets removed).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from hyperfed.algorithms import registry
from hyperfed.config import ConfigError, load_config, to_toml
from hyperfed.runtime.simulate import Simulation

ALGORITHMS = registry()
MIXES: dict[str, str | list[str]] = {
    "homogeneous": "lenet",
    "heterogeneous": ["lenet", "vgg8", "mlp"],  # default.toml's mix (clients.models)
}
# The mix costs as much as all the single-architecture runs. No BatchNorm model here: the
# smallest one for 8x8 inputs (ResNet-10) costs twice the rest together, and on digits its float32
# gradients are ill-conditioned (near-constant channels): vmap and loop then differ by up to
# 2% of a step's update while in float64 they agree to 1e-14 (tests/test_engine_local.py
# checks BatchNorm in float64); its default runs were clean and resumed exactly.
SLOW_MIXES = {"heterogeneous"}

# Defaults that 8x8 one-channel digits, or a mix of architectures, refuses with a clear
# ConfigError (contract 6 holds); the suite then applies the setting the error points to.
# (algorithm, mix or None for both) -> (override, what the error says)
ADJUST: dict[tuple[str, str | None], tuple[str, str]] = {
    ("fedkd", None): ("algorithm.shared_model=lenet", "cnn5 accepts (C, H, W) inputs of at least"),
    ("fml", None): ("algorithm.shared_model=lenet", "cnn5 accepts (C, H, W) inputs of at least"),
    ("lg_fedavg", "heterogeneous"): (
        "algorithm.global_layers=classifier",
        "global layers differ in size ([650, 21558, 23934]); share only layers that match, "
        'e.g. global_layers = "classifier"',
    ),
}

# Malformed replies the server's validation lets through. The decentralized methods run with
# the base Server, whose check_reply only looks for NaN/Inf: a neighbour's payload of the wrong
# length or with a missing key is gossiped and crashes the round in torch.stack instead of
# being rejected. Most methods accept extra tensors nobody asked for (contract 1: nothing but
# the declared payload crosses).
KNOWN_GAPS: dict[str, set[str]] = {}  # method -> malformed-reply kinds it still accepts
GAP_REASON = {
    "extra": "check_reply ignores tensors outside the method's payload (declare it with "
    "Server.reply_shapes, as the gossip methods do)",
}


def _cases() -> list[Any]:
    cases = []
    for name, alg in ALGORITHMS.items():
        for mix in MIXES:
            if mix == "heterogeneous" and alg.homogeneous_only:
                continue
            marks = [pytest.mark.slow] if mix in SLOW_MIXES else []
            cases.append(pytest.param((name, mix), id=f"{name}-{mix}", marks=marks))
    return cases


def _adjustments(name: str, mix: str) -> list[str]:
    return [fix for (alg, m), (fix, _) in ADJUST.items() if alg == name and m in (None, mix)]


@dataclass
class Run:
    """One default run of a method, with what the checks read."""

    name: str
    mix: str
    sets: list[str]
    sim: Simulation
    records: list[dict[str, Any]]
    replies: dict[int, dict[int, dict[str, Tensor]]]  # round -> client -> reply
    verdicts: list[tuple[str, int, str]] = field(default_factory=list)  # rejections seen
    state1: bytes = b""  # checkpoint payload after round 1
    store1: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # client states then
    server1: dict[str, Any] = field(default_factory=dict)  # the server's state then
    config_toml: str = ""


def _clone(reply: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in reply.items()}


def _record_replies(
    sim: Simulation,
    into: list[tuple[int, dict[str, Tensor]]],
    verdicts: list[tuple[str, int, str]],
) -> None:
    """Wrap the server's validation: keep every reply and every rejection it hands out."""
    check, check_setup = sim.server.check_reply, sim.server.check_setup_reply

    def check_reply(cid: int, reply: dict[str, Tensor]) -> str | None:
        problem = check(cid, reply)
        into.append((cid, _clone(reply)))
        if problem:
            verdicts.append(("round", cid, problem))
        return problem

    def check_setup_reply(stage: int, cid: int, reply: dict[str, Tensor]) -> str | None:
        problem = check_setup(stage, cid, reply)
        if problem:
            verdicts.append((f"setup {stage}", cid, problem))
        return problem

    sim.server.check_reply = check_reply  # type: ignore[method-assign]
    sim.server.check_setup_reply = check_setup_reply  # type: ignore[method-assign]


def _serialize(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _deserialize(data: bytes) -> dict[str, Any]:
    # as RunDir.load_checkpoint: tensors and containers only
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


@pytest.fixture(scope="module", params=_cases())
def run(request: pytest.FixtureRequest, small_sim: Any) -> Run:
    """The default run of one (algorithm, mix); module-scoped, so pytest runs every check
    of one case before it builds the next (one case's state in memory at a time)."""
    name, mix = request.param
    sets = small_sim.sets(name, MIXES[mix], *_adjustments(name, mix))
    torch.set_num_threads(1)
    sim = Simulation(load_config(None, sets))
    assert not sim.vectorize and not sim.reference, "the default CPU path is the client loop"
    seen: list[tuple[int, dict[str, Tensor]]] = []
    verdicts: list[tuple[str, int, str]] = []
    _record_replies(sim, seen, verdicts)
    out = Run(name, mix, sets, sim, [], {}, verdicts, config_toml=to_toml(sim.cfg))

    def on_round(rnd: int, result: Any, record: Any) -> None:
        out.replies[rnd] = dict(seen)
        seen.clear()
        if rnd == 1:
            out.state1 = _serialize(sim.state_dict(rnd))
            out.store1 = {c: _clone(s) for c, s in sim.store.items()}
            out.server1 = _deserialize(out.state1)["server"]

    out.records = sim.run(on_round=on_round)
    return out


# -- a default run is clean --------------------------------------------------------------------
def test_every_reply_is_accepted(run: Run) -> None:
    """No reply of a default run is rejected, in a round or in a setup exchange; every
    participant replied."""
    assert run.verdicts == [], f"{run.name} ({run.mix}) rejected replies: {run.verdicts[:4]}"
    for record in run.records:
        assert record["rejected"] == [], record["round"]
        assert record.get("setup", {}).get("rejected", []) == []
        assert len(run.replies[record["round"]]) == record["participants"]


def test_client_work_is_metered(run: Run) -> None:
    """Every method trains on its clients, so every evaluated round meters client FLOPs (the
    kept FedDM runs of before the meter fix recorded 0: its client work was all outside)."""
    unmetered = [r["round"] for r in run.records if not r["flops_round"] > 0]
    assert unmetered == [], f"{run.name} ({run.mix}): no client FLOPs in rounds {unmetered}"


def _nonfinite(value: Any, path: str = "") -> list[str]:
    if isinstance(value, float):
        return [] if math.isfinite(value) else [path]
    if isinstance(value, Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return [path]
        return []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nonfinite(v, f"{path}.{k}")]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in _nonfinite(v, f"{path}[{i}]")]
    return []


def test_every_number_is_finite(run: Run) -> None:
    """Losses, accuracies, byte/FLOP counts and extras of every record; every client's state
    and the server's state at the end."""
    for record in run.records:
        assert _nonfinite(record) == [], f"round {record['round']}"
    assert _nonfinite(run.sim.store, "store") == []
    assert _nonfinite(run.sim.server.state_dict(), "server") == []


# -- replies match one payload, and validation enforces it -------------------------------------
def _signature(reply: dict[str, Tensor]) -> dict[str, tuple]:
    return {k: (tuple(v.shape), v.dtype) for k, v in reply.items()}


def test_each_client_sends_one_payload_shape(run: Run) -> None:
    """A client's replies keep their keys, shapes and dtypes from round to round, and all
    clients send the same keys."""
    keys = {frozenset(r) for replies in run.replies.values() for r in replies.values()}
    assert len(keys) == 1, f"clients send different tensors: {sorted(map(sorted, keys))}"
    first = run.replies[1]
    for rnd, replies in run.replies.items():
        for cid, reply in replies.items():
            assert _signature(reply) == _signature(first[cid]), (rnd, cid)


def _malformed(reply: dict[str, Tensor], mutation: str) -> list[tuple[str, dict[str, Tensor]]]:
    """Copies of ``reply`` with one defect each (one per key where the defect is per key)."""
    out = []
    if mutation == "extra":
        return [("junk", {**reply, "junk": torch.zeros(3)})]
    for key, value in reply.items():
        if mutation == "nan" and value.is_floating_point():
            bad = value.clone().reshape(-1)
            bad[bad.numel() // 2] = float("nan")
            out.append((key, {**reply, key: bad.view(value.shape)}))
        elif mutation == "short" and value.numel():
            out.append((key, {**reply, key: value.reshape(-1)[:-1]}))
        elif mutation == "missing":
            out.append((key, {k: v for k, v in reply.items() if k != key}))
    return out


@pytest.mark.parametrize("mutation", ["nan", "short", "missing", "extra"])
def test_malformed_reply_is_rejected(
    run: Run, mutation: str, request: pytest.FixtureRequest
) -> None:
    """Contract 6: an update with NaN/Inf or the wrong length is rejected (a missing tensor
    is the extreme of a wrong length); contract 1: nothing but the payload crosses, so an
    extra tensor is refused too. Checked against the server of the finished run."""
    if mutation in KNOWN_GAPS.get(run.name, set()):
        request.applymarker(pytest.mark.xfail(strict=True, reason=GAP_REASON[mutation]))
    last = run.replies[max(run.replies)]
    cid, reply = next(iter(last.items()))
    cases = _malformed(reply, mutation)
    if not cases:
        pytest.skip(f"{run.name} sends no tensor this defect applies to")
    slipped = [key for key, bad in cases if run.sim.server.check_reply(cid, bad) is None]
    assert slipped == [], f"{mutation} {slipped} accepted by {run.name}"
    assert run.sim.server.check_reply(cid, reply) is None  # the untouched reply still passes


# -- checkpoint / resume -----------------------------------------------------------------------
def _without_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in r.items() if k != "seconds" and not k.endswith("_seconds")}
        for r in records
    ]


def test_resume_after_round_1_gives_identical_metrics(run: Run, tmp_path: Path) -> None:
    """Round 1's checkpoint (serialized as RunDir stores it) loaded into a simulation built
    from the resolved config.toml runs round 2 to the uninterrupted run's exact record."""
    (tmp_path / "config.toml").write_text(run.config_toml)
    sim = Simulation(load_config(tmp_path / "config.toml"))
    start = sim.load_state_dict(_deserialize(run.state1))
    assert start == 1
    resumed = _without_time(sim.run(start_round=start))
    expected = _without_time(run.records[1:])
    assert [r["round"] for r in resumed] == [r["round"] for r in expected]
    for got, want in zip(resumed, expected):
        differ = sorted(k for k in want.keys() | got.keys() if got.get(k) != want.get(k))
        assert differ == [], {k: (want.get(k), got.get(k)) for k in differ[:4]}


# -- vectorized == loop ------------------------------------------------------------------------
def _close(a: Any, b: Any, where: str, rtol: float = 1e-4, atol: float = 1e-5) -> list[str]:
    """Paths where the nested tensors ``a`` and ``b`` differ beyond tolerance."""
    if isinstance(a, Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"]
        if not a.is_floating_point():
            return [] if torch.equal(a, b) else [where]
        return [] if torch.allclose(a, b, rtol=rtol, atol=atol) else [where]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(a)} vs {sorted(b)}"]
        return [p for k in a for p in _close(a[k], b[k], f"{where}.{k}", rtol, atol)]
    if isinstance(a, list | tuple):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _close(x, y, f"{where}[{i}]")]
    return []


def _round1_diffs(
    sim: Any, replies: dict, replies1: dict, store1: dict, server1: dict[str, Any]
) -> list[str]:
    """Where ``sim`` after round 1 differs from a client-loop run's replies, client states and
    server state (float tolerance)."""
    diffs = _close(replies, replies1, "reply")
    diffs += _close(sim.store, store1, "store")
    # An Adam step turns float noise in a near-zero gradient into a step of up to +-lr (seen
    # once, with a zero-initialized hypernetwork head). So the server's parameters may differ
    # by a few Adam steps (1e-3), while the Adam moments, linear and quadratic in the
    # gradients, must agree to the usual tolerance.
    server = sim.server.state_dict()
    optimizers = {k for k, v in server.items() if isinstance(v, dict) and "state" in v}
    diffs += _close({k: server[k] for k in optimizers}, {k: server1[k] for k in optimizers}, "opt")
    rest = set(server) - optimizers
    diffs += _close(
        {k: server[k] for k in rest}, {k: server1[k] for k in rest}, "server", atol=1e-3
    )
    return diffs


@pytest.mark.parametrize("path", ["on", "reference"])
def test_other_execution_paths_equal_the_client_loop(run: Run, path: str, small_sim: Any) -> None:
    """``local.vectorize=on`` (one vmapped step per architecture group) and, for methods that
    train with plain cross-entropy only, ``reference`` (nn.Module + torch.optim.SGD per
    client) against the default CPU loop, over the setup phase and round 1: the same replies,
    client states, server state and metrics (float tolerance; measured differences are below
    2e-8, this tolerance is 1e-5)."""
    adjust = _adjustments(run.name, run.mix)
    sim = small_sim(run.name, MIXES[run.mix], *adjust, f"local.vectorize={path}")
    assert sim.vectorize == (path == "on") and sim.reference == (path == "reference")
    seen: list[tuple[int, dict[str, Tensor]]] = []
    verdicts: list[tuple[str, int, str]] = []
    _record_replies(sim, seen, verdicts)
    sim.run_setup()
    try:
        result = sim.run_round(1)
    except ValueError as e:
        if path == "reference" and "reference loop runs plain cross-entropy" in str(e):
            pytest.skip(f"{run.name} trains with more than plain cross-entropy")
        raise
    metrics = sim.evaluate()
    assert verdicts == []
    diffs = _round1_diffs(sim, dict(seen), run.replies[1], run.store1, run.server1)
    nchw = nchw_round = None
    if diffs and run.mix == "heterogeneous":
        # oneDNN's channels-last convolution kernels sum in another order than its NCHW ones;
        # on AVX-512 CPUs, on this mix's ill-conditioned VGG8 (8x8 digits, pFedLHN's generated
        # weights), a full 64-sample step's gradient then differs by ~1e-5 and round 1's by
        # ~5e-4, in every path alike. The claim is path equality in one memory format: compare
        # with the client loop run in the NCHW format the other paths compute in.
        nchw = small_sim(run.name, MIXES[run.mix], *adjust, "local.channels_last=off")
        assert not nchw.vectorize and not nchw.reference and not nchw.nhwc
        nchw_seen: list[tuple[int, dict[str, Tensor]]] = []
        _record_replies(nchw, nchw_seen, [])
        nchw.run_setup()
        nchw_round = nchw.run_round(1)
        diffs = _round1_diffs(
            sim, dict(seen), dict(nchw_seen), nchw.store, nchw.server.state_dict()
        )
    assert diffs == [], diffs[:5]
    expected = dict(run.records[0])
    if nchw is not None:  # the NCHW loop's round 1, as above
        expected |= nchw.evaluate() | {"train_loss": nchw_round.train_loss}
    assert metrics["client_acc"] == expected["client_acc"]
    assert metrics["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-4)
    assert result.bytes_up == expected["bytes_up_round"]
    if path == "on":  # the reference loop reports no training loss (NaN)
        assert result.train_loss == pytest.approx(expected["train_loss"], rel=1e-4)


# -- defaults that digits refuses ----------------------------------------------------------------
@pytest.mark.parametrize(
    "algorithm,mix", [(a, m or "homogeneous") for (a, m) in ADJUST], ids=lambda v: str(v)
)
def test_refused_defaults_fail_early_and_name_the_fix(
    algorithm: str, mix: str, small_sim: Any
) -> None:
    """The defaults ADJUST replaces are still refused, with a one-line ConfigError before any
    work (contract 6); drop the ADJUST entry when a default starts to work on digits."""
    (fix, message) = ADJUST.get((algorithm, None)) or ADJUST[(algorithm, mix)]
    with pytest.raises(ConfigError) as err:
        small_sim(algorithm, MIXES[mix])
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    small_sim.config(algorithm, MIXES[mix], fix)  # the named setting is a valid one


# -- issue 19 item 4: the generated VGG8 at a narrow hypernetwork -------------------------------
# At hidden=16 the VGG8 clients of mh_pfedhn, mh_pfedhng, pfedhn and the DD variants sent NaN
# every round: nn.Linear's head bias U(+-1/sqrt(hidden)) put a random offset of std 0.14 on
# every generated parameter. The bias bound is now at most the paper's width's (0.1, hidden=100;
# default runs unchanged). Zero-initializing it instead also fixed this but cost MH-pFedHN 0.14
# of mean accuracy on tests/test_learning.py's task (generated models start near zero).
HYPERNET_WIDTH = sorted(
    name
    for name, alg in ALGORITHMS.items()
    if {"hidden", "out_dim"} <= set(alg.hparams.__dataclass_fields__)
)


@pytest.mark.parametrize("algorithm", HYPERNET_WIDTH)
def test_generated_vgg8_trains_at_a_narrow_hypernetwork(
    algorithm: str, small_sim: Any, request: pytest.FixtureRequest
) -> None:
    """test_mh_pfedhn's width (hidden=16), default.toml's lr 0.05, LeNet + VGG8: no client's
    update is NaN (the issue's example: the VGG8 clients were rejected every round while the
    mean accuracy of the others still rose)."""
    sim = small_sim(
        algorithm, ["lenet", "vgg8"], "algorithm.hidden=16", "local.epochs=4", "rounds=1"
    )
    sim.run_setup()
    result = sim.run_round(1)
    assert result.rejected == []
    assert math.isfinite(result.train_loss)


@pytest.mark.parametrize("out_dim", [512, 3072, None])
@pytest.mark.parametrize(
    "hidden",
    [16, 100],
)
def test_generated_models_start_near_chance(
    hidden: int, out_dim: int | None, small_sim: Any
) -> None:
    """The root cause, one level down: a freshly built multi-head hypernetwork must generate
    models that start near chance (cross-entropy ln 10 = 2.3 on digits' 10 classes) for every
    zoo model of 8x8 inputs used here, at the paper's width and at the tests' narrow one; a
    generated model that starts at loss 30 explodes under local SGD."""
    import torch.nn.functional as F

    from hyperfed.hypernet.multihead import MultiHeadHypernet

    sim = small_sim("local", ["lenet", "vgg8", "mlp"])
    x, y = sim.data.batch(torch.cat(sim.data.train_idx))
    losses = {}
    for arch, fm in sim.models.items():
        torch.manual_seed(0)
        hnet = MultiHeadHypernet({0: fm.num_params}, hidden=hidden, out_dim=out_dim)
        with torch.no_grad():
            theta = hnet.generate([0])[0]
            logits = fm.forward(theta, fm.initial_buffers(), x)
            losses[arch] = round(float(F.cross_entropy(logits, y)), 2)
    assert max(losses.values()) < 2 * math.log(10), losses
