"""One bad client cannot break a federation (issue 55, item 1): every reply is validated before
it touches server state, in simulation and in the Flower deployment.

Hand-sized examples, expected values computed from the definitions (FedAvg: ``sum_k n_k
theta_k / sum_k n_k`` over the accepted replies), never by calling the server's own aggregate:

- **dtype**: a float64, int64, bool or complex model in a float32 federation is rejected, and
  a pruned update's indices must be integers (``Server.validate_reply``, generic);
- **update norm** (``[defense]``): a 1e12-norm update is rejected (``max_update_norm``), one
  far above the round's median too (``max_norm_ratio``), and ``clip_update_norm`` scales an
  accepted update down to its bound;
- **join**: a sample count of 2^62, -5 or 2.5 is refused (``check_join``, ``max_samples``);
- **evaluation**: more correct than evaluated, a negative count or a missing field is rejected
  and left out of the means;
- **Flower**: a record that cannot be decoded is that client's rejected reply, and an
  in-process deployment with a hostile node (a forged sample count at join, a malformed
  training record) runs to the end with the honest nodes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from toy import Scripted, fedavg, tiny_mlp

from hyperfed.algorithms.base import Payload, Server, ServerContext, check_join
from hyperfed.config import ConfigError, DefenseConfig, load_config
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ZooNet
from hyperfed.runtime.driver import EvalCounts, check_eval_counts

K = 20  # tiny_mlp(3, 3, 2): 3*3 + 3 + 2*3 + 2 parameters


def float32_mlp() -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(ZooNet(nn.Flatten(), (3,), 2, hidden=(3,)), "tiny")


def direction(c: int, k: int = K, dtype: torch.dtype = torch.float64) -> Tensor:
    """Client c's honest update: (c + 1) / 10 in entry c, 0 elsewhere (norm (c + 1) / 10)."""
    u = torch.zeros(k, dtype=dtype)
    u[c] = (c + 1) / 10
    return u


# -- update norm ----------------------------------------------------------------------------------


def test_a_1e12_update_is_rejected_and_the_model_is_the_honest_clients_average(caplog):
    fm = tiny_mlp(3, 3, 2)
    theta0 = fm.initial_params()

    def answer(c: int, msg: Payload) -> Payload:
        if c == 2:  # norm 1e12, finite
            return {
                "theta": msg["theta"] + torch.full((K,), 1e12 / math.sqrt(K), dtype=torch.float64)
            }
        return {"theta": msg["theta"] + direction(c)}

    server, driver = fedavg([1, 3, 5], fm, answer)
    with caplog.at_level(logging.WARNING, logger="hyperfed"):
        result = driver.run_round(1)
    assert result.rejected == [2] and result.replied == [0, 1]
    assert "rejected reply from client 2: theta has norm 1e+12 > max_update_norm" in caplog.text
    # FedAvg over clients 0 (n=1) and 1 (n=3): theta0 + (1 * u0 + 3 * u1) / 4
    want = theta0.clone()
    want[0] += 0.1 * 1 / 4
    want[1] += 0.2 * 3 / 4
    torch.testing.assert_close(server.theta[str(K)], want, rtol=0, atol=1e-15)
    # the next round goes on from there (the run is not frozen)
    assert driver.run_round(2).rejected == [2]
    # the absolute bound alone refuses it (the median rule needs 3 updates, here 2 with it)
    _, driver = fedavg(
        [1, 5], fm, lambda c, m: answer(2 * c, m), DefenseConfig(max_norm_ratio="off")
    )
    assert driver.run_round(1).rejected == [1]


def test_an_update_far_above_the_rounds_median_norm_is_rejected():
    fm = tiny_mlp(3, 3, 2)
    theta0 = fm.initial_params()

    def answer(c: int, msg: Payload) -> Payload:  # client 3: 1e3 x the others, far below auto
        u = direction(c) if c < 3 else torch.full((K,), 300 / math.sqrt(K), dtype=torch.float64)
        return {"theta": msg["theta"] + u}

    server, driver = fedavg([2, 2, 2, 2], fm, answer)
    assert driver.run_round(1).rejected == [3]
    want = theta0.clone()
    want[:3] += torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64) / 3
    torch.testing.assert_close(server.theta[str(K)], want, rtol=0, atol=1e-15)
    # off: the same reply is accepted (and so dominates the average)
    _, driver = fedavg([2, 2, 2, 2], fm, answer, DefenseConfig(max_norm_ratio="off"))
    assert driver.run_round(1).rejected == []


def test_clip_update_norm_scales_each_update_down_to_the_bound():
    fm = tiny_mlp(3, 3, 2)
    theta0 = fm.initial_params()

    def answer(c: int, msg: Payload) -> Payload:  # norms 2 and 0.5
        u = torch.zeros(K, dtype=torch.float64)
        u[c] = 2.0 if c == 0 else 0.5
        return {"theta": msg["theta"] + u}

    server, driver = fedavg([1, 1], fm, answer, DefenseConfig(clip_update_norm=1.0))
    result = driver.run_round(1)
    assert result.rejected == []
    want = theta0.clone()  # client 0's update clipped to norm 1, client 1's left as it was
    want[0] += 1.0 / 2
    want[1] += 0.5 / 2
    torch.testing.assert_close(server.theta[str(K)], want, rtol=0, atol=1e-15)


def test_the_defense_section_is_validated_in_one_line():
    cfg = load_config(None, ["defense.max_update_norm=50", "defense.clip_update_norm=5"])
    assert cfg.defense.max_update_norm == 50.0 and cfg.defense.clip_update_norm == 5.0
    assert load_config(None).defense == DefenseConfig()
    for bad in (
        "defense.max_update_norm=-1",
        "defense.max_norm_ratio=auto",
        "defense.max_samples=0",
    ):
        with pytest.raises(ConfigError, match=r"^defense\."):
            load_config(None, [bad])


# -- dtype ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "why"),
    [
        (torch.float64, "theta has dtype torch.float64; expected torch.float32"),
        (torch.int64, "theta has dtype torch.int64; expected a float update"),
        (torch.bool, "theta has dtype torch.bool; expected a float or integer tensor"),
        (torch.complex64, "theta has dtype torch.complex64; expected a float or integer tensor"),
    ],
)
def test_a_reply_of_another_dtype_is_rejected_and_changes_nothing(dtype, why, caplog):
    fm = float32_mlp()
    theta0 = fm.initial_params()

    def answer(c: int, msg: Payload) -> Payload:
        if c == 1:
            return {"theta": msg["theta"].to(dtype)}
        return {"theta": msg["theta"] + direction(c, dtype=torch.float32)}

    server, driver = fedavg([1, 1], fm, answer)
    with caplog.at_level(logging.WARNING, logger="hyperfed"):
        assert driver.run_round(1).rejected == [1]
    assert why in caplog.text
    want = theta0.clone()
    want[0] += 0.1
    assert server.theta[str(K)].dtype == torch.float32
    torch.testing.assert_close(server.theta[str(K)], want, rtol=0, atol=1e-7)


class PrunedServer(Server):
    """A server whose clients send a pruned difference to the model ``theta`` it sent (as
    MH-pFedHN's) and declares nothing else: the generic checks only."""

    def model_updates(self) -> dict[str, str]:
        return {"delta": "theta"}


def test_dtype_checks_hold_for_a_method_that_declares_no_reply_shapes():
    ctx = ServerContext(0, torch.device("cpu"), 2, (3,), {"tiny": float32_mlp()})
    server = PrunedServer(None, {}, ctx)
    sent = {"theta": torch.zeros(K)}
    ok = {"delta_idx": torch.tensor([1, 4], dtype=torch.int32), "delta_val": torch.ones(2)}
    assert server.validate_reply(0, ok, sent) is None
    assert "delta_idx has dtype torch.float32; expected integer" in str(
        server.validate_reply(0, {**ok, "delta_idx": torch.tensor([1.0, 4.0])}, sent)
    )
    assert "delta_val has dtype torch.int64; expected a float update" in str(
        server.validate_reply(0, {**ok, "delta_val": torch.ones(2, dtype=torch.int64)}, sent)
    )
    for dtype in (torch.bool, torch.complex64, torch.float64, torch.float16):
        assert server.validate_reply(0, {"delta": torch.zeros(K, dtype=dtype)}, sent)
    # an integer tensor that is not an update is the method's to check (a class id)
    assert server.validate_reply(0, {"delta": torch.zeros(K), "cls": torch.tensor(3)}, sent) is None


# -- join -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "why"),
    [
        (torch.tensor(2**62), "num_samples = 4611686018427387904 is outside [1, 1000000000]"),
        (torch.tensor(-5), "num_samples = -5 is outside [1, 1000000000]"),
        (torch.tensor(0), "num_samples = 0 is outside"),
        (torch.tensor(2.5), "num_samples must be one integer"),
        (torch.tensor([3, 4]), "num_samples must be one integer"),
    ],
)
def test_a_forged_sample_count_is_refused_at_join(n, why):
    join = {"num_params": torch.tensor(K), "num_samples": n}
    assert why in str(check_join(join, DefenseConfig().max_samples))


def test_an_honest_join_passes_and_max_samples_is_the_cap():
    join = {"num_params": torch.tensor(K), "num_samples": torch.tensor(300)}
    assert check_join(join, 10**9) is None
    assert "outside [1, 299]" in str(check_join(join, 299))
    assert "num_params = 0" in str(check_join({"num_params": torch.tensor(0)}, 10))


# -- evaluation -----------------------------------------------------------------------------------


def test_impossible_evaluation_replies_are_rejected_and_left_out_of_the_means(caplog):
    nan = math.nan
    # client 0 honest (8 / 10), 1: 500 correct of 10, 2: negative, 3: total missing,
    # 4: did not answer, 5: honest (3 / 4)
    counts = EvalCounts(
        torch.tensor([8.0, 500.0, -1.0, 5.0, nan, 3.0]),
        torch.tensor([10.0, 10.0, 10.0, nan, nan, 4.0]),
        torch.tensor([2.0, 1.0, 1.0, 1.0, nan, 1.0]),
    )
    fm = float32_mlp()
    _, driver = fedavg([1] * 6, fm, lambda c, m: {}, None)
    driver.transport = Scripted(None, counts)
    with caplog.at_level(logging.WARNING, logger="hyperfed"):
        got = driver.evaluate()
    for c in (1, 2, 3):
        assert f"rejected reply from client {c}" in caplog.text
    assert "client 0" not in caplog.text and "client 5" not in caplog.text
    assert got["eval_missing"] == [1, 2, 3, 4]
    assert got["mean_acc"] == pytest.approx((0.8 + 0.75) / 2)
    assert got["weighted_acc"] == pytest.approx(11 / 14)
    # a diverged model's NaN loss is its own business, not a rejection
    ok = check_eval_counts(
        EvalCounts(torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([nan]))
    )
    assert float(ok.correct[0]) == 1.0


# -- Flower: records that cannot be decoded, a hostile node in a deployment -----------------------

flwr_app = pytest.importorskip("flwr.app", reason="Flower is not installed")


def _garbage_record() -> Any:
    """A packed tensor record whose layout is not JSON."""
    import numpy as np

    from hyperfed.deploy import records as wire

    return flwr_app.ArrayRecord(
        {
            wire.PACKED: flwr_app.Array(np.zeros(8, dtype=np.uint8)),
            wire.LAYOUT: flwr_app.Array(np.frombuffer(b"{not json", dtype=np.uint8).copy()),
        }
    )


@pytest.mark.parametrize(
    "layout",
    [
        None,  # not JSON
        [["theta", "os", [4]]],  # names no torch dtype
        [["theta", "float32", [400]]],  # more bytes than the record holds
        [["theta", "float32", [-4]]],  # an impossible shape
    ],
)
def test_a_training_record_that_cannot_be_decoded_is_a_rejected_reply(layout):
    import numpy as np

    from hyperfed.deploy import records as wire
    from hyperfed.deploy import server as server_side

    if layout is None:
        record = _garbage_record()
    else:
        record = wire._packed(np.zeros(16, dtype=np.uint8), layout)
    good = wire.payload_to_record({"theta": torch.ones(4)})
    bad = flwr_app.RecordDict({wire.PAYLOAD: record})
    d = server_side.Deployment.__new__(
        server_side.Deployment
    )  # the transport's decoding only: no grid, no run
    d.device = torch.device("cpu")
    d.exchange = lambda *args, **kwargs: {0: good, 1: bad}  # type: ignore[method-assign]
    got = d.fit(1, {0: {}, 1: {}})
    assert list(got.replies) == [0] and list(got.malformed) == [1]
    assert got.malformed[1].startswith("malformed record: ")
    assert "malformed" in str(wire.describe(bad))  # the wire log describes it, without a crash
    got = d.setup(0, {0: {}, 1: {}})
    assert list(got.replies) == [0] and list(got.malformed) == [1]


def test_an_evaluation_reply_with_a_field_missing_is_rejected_not_a_crash(caplog):
    from hyperfed.deploy import records as wire
    from hyperfed.deploy import server as server_side

    def metrics(**m: float) -> Any:
        return flwr_app.RecordDict({wire.METRICS: flwr_app.MetricRecord(m)})

    d = server_side.Deployment.__new__(server_side.Deployment)
    d.n, d.evaluated = 3, 0
    d.exchange = lambda *args, **kwargs: {  # type: ignore[method-assign]
        0: metrics(correct=3.0, total=4.0, loss_sum=1.0),
        1: metrics(correct=3.0, loss_sum=1.0),  # total missing
        2: flwr_app.RecordDict(),  # no metrics at all
    }
    with caplog.at_level(logging.WARNING, logger="hyperfed"):
        counts = d.evaluate({0: {}, 1: {}, 2: {}}, "test")
    assert counts.correct.tolist()[0] == 3.0 and math.isnan(counts.correct[1])
    assert "rejected reply from client 1: total missing" in caplog.text
    assert "rejected reply from client 2: correct, total, loss_sum missing" in caplog.text


@pytest.fixture
def _server_identity(monkeypatch):
    """Messages the ServerApp creates name the run and the server node (as in Flower's
    ServerApp process)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 77)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def test_a_deployment_with_a_hostile_node_runs_to_the_end_with_the_honest_ones(
    tmp_path, _server_identity
):
    """Five nodes of one FedAvg client each (in process, the real ServerApp and ClientApps):
    node 13 declares 2^62 samples at join and node 15 sends a join record that cannot be
    decoded (both left out of the run); node 14 sends a record that
    cannot be decoded in round 1, a 1e12-norm model in round 2, and 50x its test size as
    correct. The run completes; each is a logged rejection and the honest clients' metrics are
    untouched by them."""
    import numpy as np
    from test_flower_groups import InProcessGrid

    from hyperfed.deploy import node as client_side
    from hyperfed.deploy import records as wire
    from hyperfed.deploy import server as server_side
    from hyperfed.deploy.appconfig import RunSettings, experiment_run_config
    from hyperfed.runtime.rundir import read_metrics

    class Hostile(InProcessGrid):
        def push_messages(self, messages: list[Any]) -> list[str]:
            ids = super().push_messages(messages)
            for msg, mid in zip(messages, ids, strict=True):
                node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
                reply = self.replies[mid]
                # node n serves client n - 11: its reply is a group message of that one client
                cid = node - 11
                whole = wire.unbundle(reply.content)
                payload, metrics = (
                    wire.client_key(wire.PAYLOAD, cid),
                    wire.client_key(wire.METRICS, cid),
                )
                rnd = msg.content.config_records.get(wire.CONFIG, {}).get("round")
                if kind == wire.JOIN and node == 15:
                    reply.content[wire.BUNDLED_ARRAYS] = _garbage_record()
                    continue
                if kind == wire.JOIN and node == 13:
                    forged = wire.record_to_payload(wire.client_view(whole, cid))
                    forged["num_samples"] = torch.tensor(2**62)
                    whole[payload] = wire.pack_tensors(forged)
                elif kind == wire.TRAIN and node == 14 and rnd == 1:
                    # a layout of 400 floats over 16 bytes: this client's record cannot be read
                    whole[payload] = wire._packed(
                        np.zeros(16, np.uint8), [["theta", "float32", [400]]]
                    )
                elif kind == wire.TRAIN and node == 14:
                    theta = wire.record_to_payload(wire.client_view(whole, cid))["theta"]
                    whole[payload] = wire.pack_tensors(
                        {"theta": theta + 1e12 / theta.numel() ** 0.5}
                    )
                elif kind == wire.EVALUATE and node == 14:
                    m = whole[metrics]
                    whole[metrics] = flwr_app.MetricRecord({**m, "correct": 50 * m["total"]})
                else:
                    continue
                reply.content = wire.bundle(whole)
            return ids

    cfg = load_config(
        None,
        [
            "device=cpu",
            "seed=0",
            "rounds=2",
            "eval_every=1",
            "dataset.name=digits",
            "dataset.subsample=400",
            "partition.name=iid",
            "clients.count=5",
            "clients.models=lenet",
            "algorithm.name=fedavg",
            "local.epochs=1",
            "local.batch_size=32",
        ],
    )
    client_side._RUNTIMES.clear()
    settings = RunSettings(run_dir=str(tmp_path / "run"), min_nodes=5, join_timeout=5.0)
    run_config = {**experiment_run_config(cfg), **settings.to_run_config()}
    nodes = {11 + c: {"partition-id": c, "num-partitions": 5} for c in range(5)}
    grid = Hostile(run_config, nodes)
    try:
        records = server_side.Deployment(grid, run_config).run()  # type: ignore[arg-type]
    finally:
        client_side._RUNTIMES.clear()
    assert [r["round"] for r in records] == [1, 2]
    assert [r["round"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    for r in records:  # client 2 (node 13) never joined; client 3 (node 14) rejected throughout
        assert r["replied"] == [0, 1] and r["rejected"] == [3]
        assert r["eval_missing"] == [2, 3, 4]
    log = (tmp_path / "run" / "server.log").read_text()
    assert "join: rejected node 13: num_samples = 4611686018427387904 is outside" in log
    assert "join: rejected node 15: malformed record" in log
    assert "round 1: update: rejected reply from client 3: malformed record" in log
    assert "round 2: update: rejected reply from client 3: theta has norm 1e+12" in log
    assert "rejected reply from client 3: correct" in log
