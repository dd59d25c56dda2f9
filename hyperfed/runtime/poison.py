"""A poisoning harness for simulation (config ``[attack]``): some clients attack, the rest are
honest, and the records report the honest clients' accuracy apart (``mean_acc_honest``), so a
researcher can measure a defense (``[defense]``; docs/robustness.md).

Who attacks: ``attack.clients``, a list of client ids or a fraction of the clients drawn with the
run's seed (:func:`choose_attackers`; the same on a resume). What they do, ``attack.kind``:

* **update attacks** change the model updates in an attacker's training reply -- exactly the
  tensors the method declares in :meth:`~hyperfed.algorithms.base.Server.model_updates`, in the
  simulator's transport after the client trained (:meth:`Poisoning.replies`). The update ``u``
  is the reply minus the model it was trained from when the reply holds a whole model (FedAvg's
  ``theta``: minus the model sent; a gossiped model: minus the client's own before training),
  else the reply itself (MH-pFedHN's ``delta``, a pruned update's values). The attacker sends
  ``u'`` in its place:

  - ``scale``: ``u' = attack.scale * u`` (e.g. -10, 100);
  - ``sign_flip``: ``u' = -u``;
  - ``gaussian_noise``: ``u' = u + e``, ``e ~ N(0, attack.noise_std^2)`` per coordinate
    (seeded by run seed, round and client);

* ``label_flip``: the attackers train on labels ``y -> C - 1 - y`` (their training split only;
  :func:`flip_labels`), and reply as honest clients do;
* ``sample_count_lie``: the attackers declare ``attack.scale`` times their sample count at join
  (at most ``defense.max_samples``, the most a server accepts: :func:`lie_about_counts`), which is
  their FedAvg weight; they train honestly.

A method that declares no model updates gets no update attack (a warning says so).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from hyperfed.algorithms.base import VALUE_SUFFIX, Payload
from hyperfed.config import AttackConfig
from hyperfed.data.federated import FederatedData

log = logging.getLogger("hyperfed")

UPDATE_ATTACKS = ("scale", "sign_flip", "gaussian_noise")


def choose_attackers(clients: float | list[int], num_clients: int, seed: int) -> list[int]:
    """The attacking clients: the ids given, or ``round(fraction * N)`` drawn without
    replacement with the run's seed (sorted)."""
    if isinstance(clients, list):
        return sorted(clients)
    k = round(clients * num_clients)
    if k == 0:
        return []
    rng = np.random.default_rng([seed, 4099])
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


def flip_labels(data: FederatedData, attackers: list[int]) -> FederatedData:
    """``data`` with the attackers' training labels flipped, ``y -> C - 1 - y`` (a copy: the
    labels of every other sample, and the attackers' validation and test labels, unchanged)."""
    if not attackers:
        return data
    y = data.y.clone()
    idx = torch.cat([data.train_idx[c] for c in attackers]).to(y.device)
    y[idx] = data.num_classes - 1 - y[idx]
    return dataclasses.replace(data, y=y)


def lie_about_counts(
    joins: Mapping[int, Payload], attackers: list[int], scale: float, max_samples: int
) -> dict[int, Payload]:
    """The joins as the server receives them: each attacker's ``num_samples`` times ``scale``
    (rounded, within ``[1, max_samples]``); everything else as sent."""
    out = dict(joins)
    for c in attackers:
        join = dict(joins[c])
        if "num_samples" in join:
            n = join["num_samples"]
            lied = min(max(round(float(n) * scale), 1), max_samples)
            join["num_samples"] = torch.tensor(lied, dtype=n.dtype, device=n.device)
        out[c] = join
    return out


def attack_update(kind: str, u: Tensor, scale: float, noise_std: float, gen_seed: int) -> Tensor:
    """What an attacker sends in place of its update ``u`` (see the module docstring)."""
    if kind == "scale":
        return u * scale
    if kind == "sign_flip":
        return -u
    if kind == "gaussian_noise":
        gen = torch.Generator().manual_seed(gen_seed)
        noise = torch.randn(u.shape, generator=gen, dtype=torch.float64) * noise_std
        return u + noise.to(device=u.device, dtype=u.dtype)
    raise ValueError(f"not an update attack: {kind}")


class Poisoning:
    """The attack of one simulated run: its attackers and what it does to their replies."""

    def __init__(self, cfg: AttackConfig, num_clients: int, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        self.attackers = choose_attackers(cfg.clients, num_clients, seed)
        self.honest = [c for c in range(num_clients) if c not in set(self.attackers)]
        self.updates: dict[str, str] = {}

    @property
    def attacks_updates(self) -> bool:
        return self.cfg.kind in UPDATE_ATTACKS and bool(self.attackers)

    def groups(self) -> dict[str, list[int]]:
        """The subsets scored apart: ``mean_acc_honest`` and ``mean_acc_attackers``."""
        return {"honest": self.honest, "attackers": self.attackers}

    def references(self, msgs: Mapping[int, Payload], store: Mapping[int, Payload]) -> dict:
        """Before training: each attacker's own copy of a whole model it will send back but was
        not sent (a gossiped model), the reference its update is measured from."""
        if not self.attacks_updates:
            return {}
        out: dict[int, dict[str, Tensor]] = {}
        for c in self.attackers:
            if c in msgs:
                own = {
                    s: store[c][s].clone()
                    for n, s in self.updates.items()
                    if n == s and s not in msgs[c] and s in store.get(c, {})
                }
                out[c] = own
        return out

    def replies(
        self,
        rnd: int,
        replies: dict[int, Payload],
        msgs: Mapping[int, Payload],
        references: Mapping[int, Mapping[str, Tensor]] | None = None,
    ) -> dict[int, Payload]:
        """The replies as the server receives them: each attacker's model updates replaced
        (``attack.kind``); honest replies untouched."""
        if not self.attacks_updates:
            return replies
        out = dict(replies)
        for c in self.attackers:
            if c not in replies:
                continue
            reply = dict(replies[c])
            for i, (name, source) in enumerate(sorted(self.updates.items())):
                base = None
                if name == source:
                    base = msgs.get(c, {}).get(source)
                    if base is None:
                        base = (references or {}).get(c, {}).get(source)
                for key in (name, name + VALUE_SUFFIX):
                    if key not in reply:
                        continue
                    value = reply[key]
                    ref = base.to(value.dtype) if key == name and base is not None else None
                    u = value if ref is None else value - ref
                    gen_seed = ((self.seed * 1_000_003 + rnd) * 10_007 + c) * 31 + i
                    new = attack_update(
                        self.cfg.kind, u, self.cfg.scale, self.cfg.noise_std, gen_seed % 2**63
                    )
                    reply[key] = new if ref is None else ref + new
            out[c] = reply
        return out
