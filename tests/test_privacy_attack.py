"""Gradient inversion (iDLG, seed 000 Appendix C.8): the label rule, the input
reconstruction, which upload keys are attacked, and the ``hyperfed attack`` command."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import SMALL as BASE
from cli_helpers import invoke
from cli_helpers import sets as _sets

from hyperfed.attack import best_match, uploaded_updates
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model
from hyperfed.privacy.inversion import (
    PSNR_MAX,
    infer_label,
    invert_gradient,
    model_gradient,
    psnr,
    total_variation,
)

SMALL = [*BASE, "rounds=1"]


def _model(name: str, shape: tuple[int, ...], classes: int = 5) -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(build_model(name, shape, classes))


@pytest.mark.parametrize("name", ["lenet", "mlp", "vgg8"])
def test_label_rule_recovers_every_class_from_one_sample_gradient(name):
    # the classifier's input comes out of a ReLU (>= 0): only the true row sums negative
    fm = _model(name, (1, 8, 8))
    theta, buffers = fm.initial_params(), fm.initial_buffers()
    gen = torch.Generator().manual_seed(1)
    for label in range(5):
        x = torch.randn(1, 1, 8, 8, generator=gen)
        grad = model_gradient(fm, theta, buffers, x, torch.tensor([label]))
        assert infer_label(fm, grad, 5) == label


def test_model_gradient_is_the_modules_gradient():
    fm = _model("lenet", (1, 8, 8))
    x, y = torch.randn(2, 1, 8, 8), torch.tensor([1, 4])
    fm.module.eval()
    torch.nn.functional.cross_entropy(fm.module(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in fm.module.parameters()])
    got = model_gradient(fm, fm.initial_params(), fm.initial_buffers(), x, y)
    torch.testing.assert_close(got, expected)


def test_cosine_inversion_rebuilds_an_mlp_input():
    # an MLP's first-layer gradient is delta x^T: the input is identifiable from it
    fm = _model("mlp", (1, 6, 6))
    theta, buffers = fm.initial_params(), fm.initial_buffers()
    x = torch.rand(1, 1, 6, 6, generator=torch.Generator().manual_seed(2)) * 2 - 1
    grad = model_gradient(fm, theta, buffers, x, torch.tensor([3]))
    inv = invert_gradient(fm, theta, buffers, grad, (1, 6, 6), 5, iters=150, tv=0.0)
    assert inv.label == 3
    assert inv.distance < 0.1 * inv.initial_distance
    assert (inv.x - x).norm() / x.norm() < 0.15


def test_l2_inversion_lowers_the_gradient_distance():
    fm = _model("mlp", (1, 4, 4))
    theta, buffers = fm.initial_params(), fm.initial_buffers()
    x = torch.randn(1, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    grad = model_gradient(fm, theta, buffers, x, torch.tensor([0]))
    inv = invert_gradient(fm, theta, buffers, grad, (1, 4, 4), 5, distance="l2", iters=10)
    assert inv.distance < 0.5 * inv.initial_distance


def test_inversion_refuses_bad_arguments():
    fm = _model("mlp", (1, 4, 4))
    theta, buffers = fm.initial_params(), fm.initial_buffers()
    with pytest.raises(ValueError, match="distance"):
        invert_gradient(fm, theta, buffers, theta, (1, 4, 4), 5, distance="l1")
    with pytest.raises(ValueError, match="shape"):
        invert_gradient(fm, theta, buffers, theta[:-1], (1, 4, 4), 5)


def test_psnr_and_total_variation_by_hand():
    a = torch.zeros(1, 2, 2)
    assert psnr(a + 0.1, a) == pytest.approx(20.0)  # mse 0.01 -> 10 log10(100)
    assert psnr(a, a) == PSNR_MAX
    img = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]]]])  # vertical 0, horizontal 1
    assert float(total_variation(img)) == pytest.approx(1.0)


def test_uploaded_updates_reads_deltas_pruned_deltas_and_returned_models():
    t, g = torch.zeros(5), torch.zeros(3)
    msg = {"theta": t, "global": g}
    pruned = {"global_delta_idx": torch.tensor([0]), "global_delta_val": torch.ones(1)}
    mh = {"delta": "theta", "global_delta": "global"}  # MHPFedHNServer.model_updates()
    assert uploaded_updates(mh, msg, {"delta": t, **pruned}) == mh
    fedavg = {"theta": "theta"}
    assert uploaded_updates(fedavg, {"theta": t}, {"theta": t + 1}) == fedavg
    assert uploaded_updates(fedavg, {"theta": t}, {"theta": g}) == {}  # not the sent model
    assert uploaded_updates({}, {}, {"prototypes": g}) == {}


def test_servers_declare_what_they_upload():
    """The attack reads declarations, never payload key names (issue 18 item 3)."""
    from hyperfed.algorithms import get_algorithm

    assert get_algorithm("fedavg").server.model_updates(None) == {"theta": "theta"}  # type: ignore[arg-type]
    assert get_algorithm("mh_pfedhng").server.model_updates(None)["global_delta"] == "global"  # type: ignore[arg-type]
    assert get_algorithm("fedproto").server.model_updates(None) == {}  # type: ignore[arg-type]


def test_attack_command_writes_report_and_figure(tmp_path):
    out = tmp_path / "att"
    res = invoke(
        "attack",
        *_sets([*SMALL, "algorithm.name=mh_pfedhng"]),
        "--images",
        "1",
        "--iters",
        "3",
        "--out",
        str(out),
    )
    assert res.exit_code == 0, res.output
    report = json.loads((out / "attack.json").read_text())
    targets = [r["target"] for r in report["rows"]]
    assert targets == ["image 0 gradient", "upload delta", "upload global_delta"]
    first = report["rows"][0]
    assert first["label"] == first["true_label"]  # iDLG's label rule on one sample
    for row in report["rows"]:  # the no-information guesses are scored like the attack
        assert 0 < row["chance"] < row["mean_image"] < 100
    assert report["local_steps"] >= 1 and report["algorithm"] == "mh_pfedhng"
    assert (out / "attack.png").stat().st_size > 0
    assert 'name = "mh_pfedhng"' in (out / "config.toml").read_text()  # rerunnable
    assert "upload global_delta" in res.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--client", "7"], "--client 7: there are 3 clients"),
        (["--set", "algorithm.name=local"], "uploads no model update"),
        (["--set", "dataset.name=synthetic", "--set", "clients.models=mlp"], "are vectors"),
    ],
)
def test_attack_command_refuses_in_one_line(tmp_path, extra, message):
    out = tmp_path / "att"
    res = invoke("attack", *_sets(SMALL), *extra, "--iters", "1", "--out", str(out))
    assert res.exit_code == 2
    assert message in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists()


def test_attack_scores_the_distilled_set_the_server_receives(tmp_path):
    # real-initialized synthetic images after 2 distillation iterations are still the data
    dd = [
        "algorithm.name=mh_pfedhndd",
        "algorithm.distill_model=lenet",
        "algorithm.distill_iters=2",
        "algorithm.distill_batch_real=8",
        "algorithm.ipc=2",
    ]
    out = tmp_path / "att"
    res = invoke(
        "attack", *_sets([*SMALL, *dd]), "--images", "0", "--iters", "2", "--out", str(out)
    )
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "attack.json").read_text())["rows"]
    assert [r["target"] for r in rows][0] == "upload delta"
    syn = rows[-1]
    assert syn["target"].startswith("synthetic set (")
    assert syn["psnr"] > syn["mean_image"] + 20


def test_best_match_finds_copies_and_near_copies():
    refs = torch.rand(5, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    images = torch.stack([refs[3], refs[1] + 0.01, torch.zeros(1, 4, 4)])
    scores, index = best_match(images, refs)
    assert index[:2] == [3, 1]
    assert scores[0] == PSNR_MAX  # an exact copy
    assert scores[1] == pytest.approx(40.0, abs=1e-3)  # mse 1e-4
    assert scores[2] < 20


def test_pixels_undo_the_normalization(digits_data):
    idx = digits_data.train_idx[0][:5]
    raw = digits_data.x[idx].float() / 255
    torch.testing.assert_close(digits_data.pixels(digits_data.features(idx)), raw)


def test_attack_gets_the_rounds_reply_validation(monkeypatch):
    """The attacked reply passes Server.check_reply as in every round (issue 38 item 2): a
    reply the server rejects is not attacked."""
    from hyperfed.algorithms import get_algorithm
    from hyperfed.attack import AttackError, run_attack
    from hyperfed.config import load_config

    cfg = load_config(None, SMALL)
    server = get_algorithm("fedavg").server
    monkeypatch.setattr(server, "check_reply", lambda self, cid, reply: "forged by the test")
    with pytest.raises(AttackError, match="rejected by the server's validation"):
        run_attack(cfg, images=0, iters=1)
