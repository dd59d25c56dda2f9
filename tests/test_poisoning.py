"""The poisoning harness (issue 55, item 3): ``[attack]`` in simulation.

Each attack kind's transformation on hand-sized replies, computed by hand from its definition
(hyperfed/runtime/poison.py):

- ``scale`` / ``sign_flip`` / ``gaussian_noise`` change the *update* a reply carries as declared
  by ``Server.model_updates``: a whole model minus the model sent (FedAvg), minus the client's
  own copy before training (a gossiped model), or a difference as it is (MH-pFedHN's ``delta``,
  a pruned ``delta_val``);
- ``label_flip`` trains the attackers on ``y -> C - 1 - y``;
- ``sample_count_lie`` multiplies the declared ``num_samples``;

and a simulated run reports ``mean_acc_honest`` over the honest clients.
"""

from __future__ import annotations

import pytest
import torch
from toy import toy_federation

from hyperfed.config import AttackConfig, ConfigError, load_config
from hyperfed.runtime.poison import (
    Poisoning,
    attack_update,
    choose_attackers,
    flip_labels,
    lie_about_counts,
)


def poisoning(kind: str, attackers: list[int], updates: dict[str, str], **kw) -> Poisoning:
    p = Poisoning(AttackConfig(kind=kind, clients=attackers, **kw), 4, seed=0)
    p.updates = updates
    return p


def test_attackers_are_the_ids_given_or_a_seeded_fraction():
    assert choose_attackers([3, 1], 10, 0) == [1, 3]
    three = choose_attackers(0.3, 10, 0)
    assert len(set(three)) == 3 and all(0 <= c < 10 for c in three)
    assert choose_attackers(0.3, 10, 0) == three  # the same on a resume
    assert choose_attackers(0.0, 10, 0) == []
    p = Poisoning(AttackConfig(kind="scale", clients=[1]), 3, 0)
    assert p.groups() == {"honest": [0, 2], "attackers": [1]}


def test_scale_and_sign_flip_of_a_whole_model_move_it_from_the_model_sent():
    sent = {0: {"theta": torch.tensor([1.0, 1.0])}, 1: {"theta": torch.tensor([1.0, 1.0])}}
    replies = {0: {"theta": torch.tensor([2.0, 0.0])}, 1: {"theta": torch.tensor([3.0, 1.5])}}
    # attacker 0's update is [1, -1]; scale 3 sends [1, 1] + [3, -3]
    got = poisoning("scale", [0], {"theta": "theta"}, scale=3.0).replies(1, replies, sent)
    assert got[0]["theta"].tolist() == [4.0, -2.0]
    assert got[1] is replies[1]  # the honest reply untouched
    got = poisoning("sign_flip", [0], {"theta": "theta"}).replies(1, replies, sent)
    assert got[0]["theta"].tolist() == [0.0, 2.0]
    assert replies[0]["theta"].tolist() == [2.0, 0.0]  # the client's own reply is not changed


def test_a_difference_and_a_pruned_difference_are_the_update_itself():
    sent = {1: {"theta": torch.tensor([5.0, 5.0, 5.0])}}
    delta = {1: {"delta": torch.tensor([1.0, -2.0, 0.5])}}
    got = poisoning("scale", [1], {"delta": "theta"}, scale=-10.0).replies(2, delta, sent)
    assert got[1]["delta"].tolist() == [-10.0, 20.0, -5.0]
    pruned = {1: {"delta_idx": torch.tensor([0, 2]), "delta_val": torch.tensor([1.0, 0.5])}}
    got = poisoning("sign_flip", [1], {"delta": "theta"}).replies(2, pruned, sent)
    assert got[1]["delta_val"].tolist() == [-1.0, -0.5]
    assert got[1]["delta_idx"].tolist() == [0, 2]


def test_a_gossiped_model_is_measured_from_the_attackers_own_copy_before_training():
    p = poisoning("scale", [2], {"phi": "phi"}, scale=2.0)
    store = {2: {"phi": torch.tensor([1.0, 1.0]), "buffers": torch.zeros(0)}}
    refs = p.references({2: {}}, store)  # before training
    store[2] = {"phi": torch.tensor([2.0, 0.0])}  # the client trained
    got = p.replies(1, {2: {"phi": torch.tensor([2.0, 0.0])}}, {2: {}}, refs)
    assert got[2]["phi"].tolist() == [3.0, -1.0]  # [1, 1] + 2 * [1, -1]


def test_gaussian_noise_is_added_to_the_update_seeded_per_round_and_client():
    u = torch.zeros(20_000, dtype=torch.float64)
    a = attack_update("gaussian_noise", u, 1.0, 0.5, gen_seed=7)
    assert torch.equal(a, attack_update("gaussian_noise", u, 1.0, 0.5, gen_seed=7))
    assert not torch.equal(a, attack_update("gaussian_noise", u, 1.0, 0.5, gen_seed=8))
    assert abs(float(a.std()) - 0.5) < 0.02 and abs(float(a.mean())) < 0.02
    u = torch.tensor([1.0, 2.0])
    noisy = attack_update("gaussian_noise", u, 1.0, 1e-6, gen_seed=1)
    torch.testing.assert_close(noisy, u, rtol=0, atol=1e-4)
    sent = {0: {"theta": torch.zeros(3)}}
    replies = {0: {"theta": torch.ones(3)}}
    p = poisoning("gaussian_noise", [0], {"theta": "theta"}, noise_std=0.1)
    r1, r2 = (p.replies(rnd, replies, sent)[0]["theta"] for rnd in (1, 2))
    assert not torch.equal(r1, r2) and r1.dtype == torch.float32


def test_label_flip_changes_only_the_attackers_training_labels():
    x = torch.zeros(6, 2, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    # client 0 trains on 0, 1 and tests on 4; client 1 trains on 2, 3 and tests on 5
    data = toy_federation(x, y, [torch.tensor([0, 1]), torch.tensor([2, 3])], 4)
    data.test_idx = [torch.tensor([4]), torch.tensor([5])]
    flipped = flip_labels(data, [0])
    assert flipped.y.tolist() == [3, 2, 2, 3, 0, 1]  # C - 1 - y for samples 0 and 1
    assert data.y.tolist() == [0, 1, 2, 3, 0, 1]  # the original is a copy's source, unchanged


def test_sample_count_lie_multiplies_the_declared_count_within_what_a_server_accepts():
    joins = {
        c: {"num_params": torch.tensor(20), "num_samples": torch.tensor(n)}
        for c, n in enumerate([7, 9])
    }
    lied = lie_about_counts(joins, [1], 10.0, max_samples=10**9)
    assert int(lied[1]["num_samples"]) == 90 and int(lied[0]["num_samples"]) == 7
    assert lied[1]["num_samples"].dtype == torch.int64
    assert int(lie_about_counts(joins, [1], 10.0, max_samples=50)[1]["num_samples"]) == 50
    assert int(joins[1]["num_samples"]) == 9


def test_a_simulated_attack_changes_exactly_the_attackers_replies_and_reports_honest_clients():
    from hyperfed.runtime.simulate import Simulation

    base = ["clients.count=4", "clients.models=mlp", "rounds=1", "eval_every=1"]
    base += ["dataset.subsample=300", "local.epochs=1", "algorithm.name=fedavg"]
    honest = Simulation(load_config(None, base))
    flipped = Simulation(load_config(None, [*base, "attack.kind=sign_flip", "attack.clients=[1]"]))
    a = honest.driver.train_exchange(1, [0, 1, 2, 3])
    b = flipped.driver.train_exchange(1, [0, 1, 2, 3])
    sent = a.msgs[1]["theta"]
    for c in (0, 2, 3):
        torch.testing.assert_close(b.accepted[c]["theta"], a.accepted[c]["theta"])
    # sign flip of a whole model: sent - (trained - sent)
    torch.testing.assert_close(b.accepted[1]["theta"], 2 * sent - a.accepted[1]["theta"])
    record = flipped.run()[-1]
    acc = torch.tensor(record["client_acc"])
    assert record["mean_acc_honest"] == pytest.approx(float(acc[[0, 2, 3]].mean()), abs=1e-5)
    assert record["mean_acc_attackers"] == pytest.approx(float(acc[1]), abs=1e-5)
    # the count lie reaches the server's joins (FedAvg's weights); label_flip the data
    liar = Simulation(
        load_config(None, [*base, "attack.kind=sample_count_lie", "attack.clients=[2]"])
    )
    assert int(liar.server.clients[2]["num_samples"]) == 10 * liar.data.train_sizes[2]
    assert int(liar.server.clients[0]["num_samples"]) == liar.data.train_sizes[0]
    lf = Simulation(load_config(None, [*base, "attack.kind=label_flip", "attack.clients=[3]"]))
    idx = lf.data.train_idx[3]
    assert torch.equal(lf.data.y[idx], 9 - honest.data.y[idx])
    others = torch.cat([lf.data.train_idx[c] for c in (0, 1, 2)] + lf.data.test_idx)
    assert torch.equal(lf.data.y[others], honest.data.y[others])


def test_the_attack_section_is_validated_in_one_line():
    for bad, key in (
        ("attack.kind=poison", "attack.kind"),
        ("attack.clients=1.5", "attack.clients"),
        ("attack.clients=[12]", "attack.clients"),
        ("attack.noise_std=0", "attack.noise_std"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])
