"""The round, written once: every transport (in-memory simulation, Flower) runs this loop.

A :class:`RoundDriver` owns the server role and talks to clients only through a
:class:`Transport` ("send these payloads to these clients, give me the replies that came
back"). One round is

1. **sample** ``participation * N`` of the clients the server allows (seeded per round, so a
   resumed run samples the same clients), and keep those the transport can reach;
2. **configure**: ``Server.configure_train`` gives one payload per client (its FLOPs are the
   server's); a decentralized method's clients get nothing;
3. **exchange**: the transport delivers them and returns the replies that came back, the
   clients' training losses and the FLOPs they measured;
4. **validate**: ``Server.validate_reply`` (dtypes, then the method's ``check_reply``: declared
   shapes, NaN/Inf), then the ``[defense]`` bounds on model updates (an absolute norm bound, a
   multiple of the round's median norm; :meth:`RoundDriver.bound_updates`), a reply the
   transport could not decode included; a rejected reply is logged and never reaches the server
   (DESIGN contract 6), but its bytes crossed; accepted updates may be norm-clipped;
5. **aggregate** the accepted replies, in one fixed order (architecture groups, then client id,
   whatever order they arrived in) -- or, for a decentralized method, **mix**: ``sum_j W_ij
   reply_j`` over the accepted active clients (:class:`~hyperfed.runtime.gossip.Gossip`), sent
   back to each client for ``Client.mix``;
6. **account** bytes (down: what the server sent; up: every reply, rejected ones included;
   gossip: a payload per link) and FLOPs in the run's totals.

Every ``eval_every`` rounds (and after the last) every reachable client's personalized model is
evaluated on its own test split and one **metrics record** is written (``metrics.jsonl``; the
same keys for every transport, listed in :data:`RECORD_KEYS`); the host checkpoints through a
callback. The one-off setup exchanges (``Server.configure_setup``) run before round 1.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from hyperfed.algorithms.base import (
    EVAL_REQUEST,
    Payload,
    Server,
    payload_bytes,
    scale_update,
    sent_model_norm,
    update_norms,
)
from hyperfed.config import DefenseConfig
from hyperfed.engine.metering import measured_flops
from hyperfed.progress import phase
from hyperfed.runtime.gossip import Gossip
from hyperfed.runtime.rundir import CheckpointWriteError, RunDir

log = logging.getLogger("hyperfed")

# ``max_update_norm = "auto"``: an update is refused beyond this many times (1 + the sent model's
# norm). Trained updates are of the order of the model's norm (a LeNet's is ~10; one round of
# SGD moves it by less than that), so 1e6 refuses nothing trained and every update that would
# take the model beyond float32's comfortable range in a few rounds (the 1e12 of issue 55).
AUTO_NORM_FACTOR = 1e6
MEDIAN_MIN_REPLIES = 3  # max_norm_ratio applies to rounds with at least this many updates

# Every metrics record has these keys (plus ``val_mean_acc`` when the clients hold a
# validation split, ``mean_acc_<group>`` for a method's named client subsets, ``bytes_payload`` / ``active_neighbors`` / ``spectral_gap_round`` for gossip, and
# ``setup`` / ``setup_seconds`` after a setup phase). Gossip records also carry :data:`BEFORE_GOSSIP_KEYS`:
# the same clients scored after their local training and before the round's mixing (the DisPFL
# lineage's moment; ``mean_acc`` is scored after mixing). docs/runs.md ("The metrics record") documents each.
RECORD_KEYS = (
    "round",
    "scores",
    "mean_acc",
    "weighted_acc",
    "min_acc",
    "max_acc",
    "std_acc",
    "test_loss",
    "client_acc",
    "client_arch",
    "eval_missing",
    "train_loss",
    "nonfinite_loss",
    "participants",
    "replied",
    "rejected",
    "bytes_up_round",
    "bytes_down_round",
    "bytes_up_per_client",
    "bytes_down_per_client",
    "bytes_up_total",
    "bytes_down_total",
    "flops_round",
    "flops_total",
    "flops_server_round",
    "flops_server_total",
    "num_clients",
    "seconds",
    "runtime",
)
# a gossip record's scores of the clients between local training and mixing (DisPFL's moment)
BEFORE_GOSSIP_KEYS = ("mean_acc_before_gossip", "client_acc_before_gossip")


# A checkpoint this large, rewritten every ``eval_every`` rounds because ``checkpoint_every`` was
# left unset, is worth a word: pFedKT's HN(large) writes 5.9 GB (~37 s) every 4 rounds.
LARGE_CHECKPOINT_BYTES = 1 << 30


def advise_on_checkpoint_size(run_dir: RunDir, every: int, rounds_left: int) -> bool:
    """Warn once that a large checkpoint is rewritten every ``every`` rounds (the default
    ``checkpoint_every = eval_every``), with its size, write time and the writes still to come.
    Whether the question is settled: False while no write has finished (a background write
    is known at the next checkpoint)."""
    if run_dir.last_checkpoint is None:
        return False
    size, seconds = run_dir.last_checkpoint
    writes_left = rounds_left // every + (rounds_left % every > 0)
    if size >= LARGE_CHECKPOINT_BYTES and writes_left > 0:
        log.warning(
            "each checkpoint is %.1f GB (%.0f s to write) and is rewritten every %d round(s) "
            "(checkpoint_every defaults to eval_every): %d more write(s) in this run; "
            "set checkpoint_every (e.g. to the run's rounds) to write it less often",
            size / 1e9,
            seconds,
            every,
            writes_left,
        )
    return True


def sample_clients(
    num_clients: int, participation: float, seed: int, rnd: int, eligible: list[int] | None = None
) -> list[int]:
    """C * N clients drawn uniformly without replacement, seeded per round (resume-safe)."""
    pool = list(range(num_clients)) if eligible is None else sorted(eligible)
    k = max(1, round(participation * len(pool)))
    if k >= len(pool):
        return pool
    rng = np.random.default_rng([seed, rnd, 7919])
    return sorted(pool[int(i)] for i in rng.choice(len(pool), size=k, replace=False))


def loss_summary(losses: list[Tensor], reference: bool) -> tuple[float, bool]:
    """(mean training loss of the round, whether it diverged), with one host sync: a NaN or
    Inf in any client's loss makes the mean non-finite. The reference loop reports no loss
    (NaN by design), which is not a divergence."""
    if not losses:
        return float("nan"), False
    mean = float(torch.cat([v.reshape(-1) for v in losses]).mean())
    return mean, not reference and not math.isfinite(mean)


@dataclass
class Exchange:
    """What came back from one exchange: replies by client id, each trained client's loss
    (tensors, concatenated in any grouping) and the FLOPs the clients measured."""

    replies: dict[int, Payload]
    losses: list[Tensor] = field(default_factory=list)
    flops: int = 0
    stats: dict[str, Tensor] = field(default_factory=dict)  # setup: per-client statistics
    # replies that came back but could not be decoded (a malformed record): why, by client id
    malformed: dict[int, str] = field(default_factory=dict)


@dataclass
class TrainExchange:
    """One training exchange, validated and not aggregated (:meth:`RoundDriver.train_exchange`):
    the payloads sent, what came back, the replies that passed validation (in aggregation order)
    and the clients whose replies did not, and the FLOPs the server spent configuring."""

    msgs: dict[int, Payload]
    got: Exchange
    accepted: dict[int, Payload]
    rejected: list[int]
    server_flops: int


@dataclass
class EvalCounts:
    """Per-client evaluation sums over the whole federation ``[N]`` (NaN: did not answer)."""

    correct: Tensor
    total: Tensor
    loss_sum: Tensor


def check_eval_counts(counts: EvalCounts, split: str = "test") -> EvalCounts:
    """``counts`` with every client whose evaluation reply is impossible set to NaN (as if it
    had not answered: listed in ``eval_missing``, out of the means), each logged: a count that
    is not a whole number, negative, more correct than evaluated, a negative loss, or a count
    missing (a NaN loss is a diverged model's, kept). The transport's tensors change in place."""
    c, t, ls = (x.double() for x in (counts.correct, counts.total, counts.loss_sum))
    answered = ~(c.isnan() & t.isnan() & ls.isnan())
    counted = t.isfinite() & (c >= 0) & (c <= t) & (c == c.round()) & (t == t.round())
    bad = answered & ~(counted & ~(ls < 0))
    for cid in torch.nonzero(bad).reshape(-1).tolist():
        log.warning(
            "evaluation (%s): rejected reply from client %d: correct %s, total %s, loss_sum %s",
            split,
            cid,
            *(float(x[cid]) for x in (c, t, ls)),
        )
        for x in (counts.correct, counts.total, counts.loss_sum):
            x[cid] = math.nan
    return counts


class Transport(Protocol):
    """How the driver reaches clients. A reply that does not come back is simply absent."""

    name: str  # "simulation", "flower": the record's ``runtime``
    reference: bool  # the papers' reference loop (reports no training loss)

    def reachable(self) -> set[int] | None:
        """Clients that can be reached now (None: all of them)."""
        ...

    def fit(self, rnd: int, msgs: dict[int, Payload]) -> Exchange:
        """Deliver one training payload per client; their replies, losses and FLOPs."""
        ...

    def setup(self, stage: int, msgs: dict[int, Payload]) -> Exchange:
        """Deliver one setup payload per client (``Client.setup``); replies and statistics."""
        ...

    def relay(self, rnd: int, W: Tensor, payloads: dict[int, Payload]) -> None:
        """Gossip: client ``i`` (the ``i``-th key of ``payloads``) gets ``sum_j W[i, j]
        payload_j`` into its state (``Client.mix``). Who computes the sum is the transport's
        business: the simulator mixes in place, Flower relays the neighbours' payloads to each
        node and the node mixes (its server never aggregates)."""
        ...

    def evaluate(self, msgs: dict[int, Payload], split: str) -> EvalCounts:
        """Each client's personalized model (``Client.eval_model``) on its own ``split``."""
        ...


@dataclass
class RoundResult:
    clients: list[int]
    train_loss: float
    bytes_up: int
    bytes_down: int
    flops: int  # the clients' (local training and whatever else they run, measured)
    rejected: list[int] = field(default_factory=list)
    replied: list[int] = field(default_factory=list)  # accepted replies
    server_flops: int = 0  # the server's round work (hypernetwork generation and update)
    extra: dict[str, Any] = field(default_factory=dict)  # algorithm-kind specific metrics
    nonfinite_loss: bool = False  # some client's training loss was NaN or Inf: it diverged


class RoundDriver:
    """Sampling, exchange, validation, aggregation or mixing, accounting, evaluation and the
    metrics record, for any transport. ``order`` is the fixed order replies are aggregated in
    (architecture groups, then client id); ``gossip`` the graph of a decentralized method."""

    def __init__(
        self,
        server: Server,
        transport: Transport,
        *,
        num_clients: int,
        participation: float,
        seed: int,
        arch_of: list[str],
        order: list[int],
        gossip: Gossip | None = None,
        groups: list[list[int]] | None = None,
        validate: bool = False,
        scores: str = "personalized",
        defense: DefenseConfig | None = None,
    ) -> None:
        self.server = server
        # what the server accepts of a client's update (config [defense])
        self.defense = defense or DefenseConfig()
        # which model the evaluation scores (algorithms.base.SCORED_MODELS), in every record
        self.scores = scores
        self.transport = transport
        self.n = num_clients
        self.participation = participation
        self.seed = seed
        self.arch_of = arch_of
        self.order = order
        self.gossip = gossip
        # configure_eval is asked per architecture group, as each group is evaluated together
        self.groups = groups or [order]
        # clients hold a validation split: records carry val_mean_acc (choose rounds on it)
        self.validate = validate
        # named client subsets reported beside the server's own eval_groups (``mean_acc_<name>``):
        # the poisoning harness's honest clients and attackers
        self.extra_groups: dict[str, list[int]] = {}
        self._warned_aggregation = False
        if gossip is not None and self.defense.aggregation != "mean":
            log.warning(
                "defense.aggregation = %s: a decentralized method mixes with its neighbours and "
                "has no server aggregation; it runs unchanged",
                self.defense.aggregation,
            )
            self._warned_aggregation = True
        self.totals = {"bytes_up": 0, "bytes_down": 0, "flops": 0, "flops_server": 0}
        self.setup_info: dict[str, Any] = {}
        self.seconds_before, self._t0 = 0.0, time.perf_counter()

    # -- helpers ---------------------------------------------------------------------------
    def _reachable(self, cids: list[int]) -> list[int]:
        online = self.transport.reachable()
        return cids if online is None else [c for c in cids if c in online]

    def _ordered(self, replies: dict[int, Payload]) -> dict[int, Payload]:
        return {c: replies[c] for c in self.order if c in replies}

    def _validate(
        self, replies: dict[int, Payload], check: Callable[[int, Payload], str | None], what: str
    ) -> tuple[dict[int, Payload], list[int]]:
        accepted, rejected = {}, []
        for c, reply in self._ordered(replies).items():
            problem = check(c, reply)
            if problem:
                log.warning("%s: rejected reply from client %d: %s", what, c, problem)
                rejected.append(c)
            else:
                accepted[c] = reply
        return accepted, rejected

    @staticmethod
    def _log_malformed(got: Exchange, what: str) -> None:
        for c, problem in got.malformed.items():
            log.warning("%s: rejected reply from client %d: %s", what, c, problem)

    def elapsed(self) -> float:
        """Wall seconds of this run so far, the time before a resume included."""
        return round(self.seconds_before + time.perf_counter() - self._t0, 3)

    def restart_clock(self) -> None:
        self._t0 = time.perf_counter()

    # -- setup -----------------------------------------------------------------------------
    def run_setup(self) -> dict[str, Any]:
        """Setup stages 0, 1, ... until the server configures none; every reachable client
        takes part. Returns (and keeps) stages, bytes, the clients' statistics, seconds."""
        t0 = time.perf_counter()
        cids = self._reachable(list(range(self.n)))
        up = down = stage = 0
        stats: dict[str, list[Tensor]] = {}
        rejected: list[int] = []
        while msgs := self.server.configure_setup(stage, cids):
            got = self.transport.setup(stage, msgs)
            up += sum(payload_bytes(p) for p in got.replies.values())
            down += sum(payload_bytes(p) for p in msgs.values())
            for k, v in got.stats.items():
                stats.setdefault(k, []).append(v.detach().float().reshape(-1).cpu())
            accepted, bad = self._validate(
                got.replies,
                lambda c, r, s=stage: self.server.check_setup_reply(s, c, r),  # type: ignore[misc]
                f"setup {stage}",
            )
            self._log_malformed(got, f"setup {stage}")
            rejected += bad + sorted(got.malformed)
            with phase(f"server: setup stage {stage}"):
                self.server.aggregate_setup(stage, accepted)
            stage += 1
        if stage == 0:
            return {}
        self.totals["bytes_up"] += up
        self.totals["bytes_down"] += down
        info: dict[str, Any] = {"stages": stage, "bytes_up": up, "bytes_down": down}
        for k, vs in stats.items():
            v = torch.cat(vs)
            info[f"{k}_mean"], info[f"{k}_max"] = float(v.mean()), float(v.max())
        info["rejected"] = rejected
        self.setup_info = {"setup": info, "setup_seconds": round(time.perf_counter() - t0, 3)}
        log.info("setup: %s in %.1f s", info, self.setup_info["setup_seconds"])
        return self.setup_info

    # -- one round -------------------------------------------------------------------------
    def run_round(self, rnd: int, *, score_before_mix: bool = False) -> RoundResult:
        """One round; with ``score_before_mix`` a gossip round also scores every client between
        local training and mixing (:data:`BEFORE_GOSSIP_KEYS` in ``RoundResult.extra``)."""
        eligible = self.server.eligible_clients(rnd)
        cids = self._reachable(sample_clients(self.n, self.participation, self.seed, rnd, eligible))
        if self.gossip is not None:
            result = self._gossip_round(rnd, cids, score_before_mix)
        else:
            result = self._server_round(rnd, cids)
        self.totals["bytes_up"] += result.bytes_up
        self.totals["bytes_down"] += result.bytes_down
        self.totals["flops"] += result.flops
        self.totals["flops_server"] += result.server_flops
        return result

    def train_exchange(self, rnd: int, cids: list[int]) -> TrainExchange:
        """Steps 2-4 of round ``rnd`` for ``cids``: the server configures their payloads, the
        transport delivers them, and the replies are validated (``Server.check_reply``) --
        nothing is aggregated or counted. A round runs this, then aggregates; an app that
        inspects what a client uploads (``hyperfed attack``) calls it alone."""
        msgs, server_flops = measured_flops(self.server.configure_train, rnd, cids)
        got = self.transport.fit(rnd, msgs)
        what = f"round {rnd}: update"
        accepted, rejected = self._validate(
            got.replies, lambda c, r: self.server.validate_reply(c, r, msgs.get(c, {})), what
        )
        accepted, outliers = self.bound_updates(accepted, msgs, what)
        self._log_malformed(got, what)
        bad = set(rejected) | set(outliers) | set(got.malformed)
        rejected = [c for c in self.order if c in bad]
        return TrainExchange(msgs, got, accepted, rejected, server_flops)

    def bound_updates(
        self, replies: dict[int, Payload], msgs: dict[int, Payload], what: str
    ) -> tuple[dict[int, Payload], list[int]]:
        """The ``[defense]`` bounds on the model updates of validated replies (those the server
        declares in ``model_updates``): refuse an update whose norm exceeds ``max_update_norm``
        or ``max_norm_ratio`` times the round's median norm (logged), then scale every update
        longer than ``clip_update_norm`` (a number, or ``"median"``: the median norm of the
        round's accepted updates) down to it. Returns (accepted, rejected)."""
        updates = self.server.model_updates()
        d = self.defense
        if not updates or not replies:
            return replies, []
        norms = {c: update_norms(updates, r, msgs.get(c, {})) for c, r in replies.items()}
        problems: dict[int, str] = {}
        for c, by_name in norms.items():
            for name, norm in by_name.items():
                bound = d.max_update_norm
                if bound == "auto":
                    bound = AUTO_NORM_FACTOR * (1 + sent_model_norm(updates, name, msgs.get(c, {})))
                if bound != "off" and not norm <= bound:
                    problems[c] = f"{name} has norm {norm:.3g} > max_update_norm {bound:.3g}"
                    break
        if d.max_norm_ratio != "off":
            for name in updates:
                pool = {c: n[name] for c, n in norms.items() if name in n and c not in problems}
                if len(pool) < MEDIAN_MIN_REPLIES:
                    continue
                median = float(torch.tensor(list(pool.values()), dtype=torch.float64).median())
                limit = d.max_norm_ratio * median
                for c, norm in pool.items():
                    if median > 0 and not norm <= limit:
                        problems[c] = (
                            f"{name} has norm {norm:.3g} > max_norm_ratio {d.max_norm_ratio:g} "
                            f"x the round's median norm {median:.3g}"
                        )
        for c, problem in problems.items():
            log.warning("%s: rejected reply from client %d: %s", what, c, problem)
        accepted = {c: r for c, r in replies.items() if c not in problems}
        clip = d.clip_update_norm
        if clip != "off":
            medians = {  # clip_update_norm = "median": each update's name, its round's median
                name: float(torch.tensor(now, dtype=torch.float64).median())
                for name in updates
                if (now := [norms[c][name] for c in accepted if name in norms[c]])
            }
            for c in accepted:
                for name, norm in norms[c].items():
                    limit = medians[name] if clip == "median" else clip
                    if norm > limit:
                        sent = msgs.get(c, {})
                        accepted[c] = scale_update(updates, accepted[c], sent, name, limit / norm)
                        log.info("%s: clipped %s of client %d from norm %.3g", what, name, c, norm)
        return accepted, sorted(problems)

    def _server_round(self, rnd: int, cids: list[int]) -> RoundResult:
        # one exchange for the round, or several in order (Server.round_exchanges: seed 000)
        batches = self.server.round_exchanges(rnd, cids)
        exchanges: list[TrainExchange] = []
        aggregate_flops = 0
        for batch in batches:
            ex = self.train_exchange(rnd, batch)
            with phase(f"server: aggregating round {rnd}"):  # e.g. a server that trains
                aggregate_flops += measured_flops(self.server.aggregate, rnd, ex.accepted)[1]
            self._check_aggregation(ex.accepted)
            exchanges.append(ex)
        losses = [loss for ex in exchanges for loss in ex.got.losses]
        train_loss, diverged = loss_summary(losses, self.transport.reference)
        rejected = {c for ex in exchanges for c in ex.rejected}
        return RoundResult(
            clients=cids,
            train_loss=train_loss,
            bytes_up=sum(payload_bytes(p) for ex in exchanges for p in ex.got.replies.values()),
            bytes_down=sum(
                payload_bytes(ex.msgs[c]) for ex, batch in zip(exchanges, batches) for c in batch
            ),
            flops=sum(ex.got.flops for ex in exchanges),
            rejected=[c for c in self.order if c in rejected],
            replied=sorted({c for ex in exchanges for c in ex.accepted}),
            server_flops=sum(ex.server_flops for ex in exchanges) + aggregate_flops,
            nonfinite_loss=diverged,
        )

    def _check_aggregation(self, accepted: dict[int, Payload]) -> None:
        """Warn once when a robust ``defense.aggregation`` was asked of a method whose server
        does not aggregate with FedAvg's rule (``Server.average_reply``, where it applies)."""
        if self._warned_aggregation or self.defense.aggregation == "mean" or not accepted:
            return
        self._warned_aggregation = True
        if not getattr(getattr(self.server, "ctx", None), "averaged", True):
            log.warning(
                "defense.aggregation = %s: %s does not aggregate with FedAvg's rule "
                "(Server.average_reply); its own aggregation runs unchanged",
                self.defense.aggregation,
                type(self.server).__name__,
            )

    def _gossip_round(
        self, rnd: int, cids: list[int], score_before_mix: bool = False
    ) -> RoundResult:
        """Seed 004, Alg. 1: local work, then ``mixed_i = sum_j W_ij payload_j`` over the
        accepted active clients; a rejected payload is not gossiped (no neighbour gets it).
        Bytes: a client sends its payload once per active neighbour and receives one from each;
        ``bytes_payload`` is the size of one copy, ``active_neighbors`` the mean degree. With
        ``score_before_mix`` every client is scored after the local work and before the mixing
        (:meth:`score_before_gossip`)."""
        assert self.gossip is not None
        got = self.transport.fit(rnd, {c: {} for c in cids})
        accepted, rejected = self._validate(
            got.replies,
            lambda c, r: self.server.validate_reply(c, r, {}),
            f"round {rnd}: payload not gossiped",
        )
        self._log_malformed(got, f"round {rnd}: payload not gossiped")
        rejected = sorted({*rejected, *got.malformed})
        active = [c for c in cids if c in accepted]
        bytes_up = bytes_down = 0
        extra: dict[str, Any] = {}
        before = self.score_before_gossip() if score_before_mix else {}
        if active:
            W = self.gossip.mixing(rnd, active)
            self.transport.relay(rnd, W, {c: accepted[c] for c in active})
            links = (W != 0).fill_diagonal_(False)
            sizes = torch.tensor([payload_bytes(accepted[c]) for c in active], dtype=torch.float64)
            degree = links.sum(1).to(torch.float64)
            bytes_up = int((sizes * degree).sum())
            bytes_down = int((links.to(torch.float64) @ sizes).sum())
            extra = {
                "bytes_payload": float(sizes.mean()),
                "active_neighbors": float(degree.mean()),
                "spectral_gap_round": self.gossip.spectral_gap(W),
            }
        extra.update(before)
        train_loss, diverged = loss_summary(got.losses, self.transport.reference)
        return RoundResult(
            clients=cids,
            train_loss=train_loss,
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            flops=got.flops,
            rejected=rejected,
            replied=active,
            extra=extra,
            nonfinite_loss=diverged,
        )

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, split: str = "test") -> dict[str, Any]:
        """Every reachable client's personalized model on its own split (DESIGN: what accuracy
        means). Clients that did not answer are NaN in ``client_acc``, left out of the means
        and listed in ``eval_missing``."""
        msgs: dict[int, Payload] = {}
        for members in self.groups:
            part = self._reachable(members)
            if part:
                self._eval_request(part)
                msgs.update(self.server.configure_eval(part))
        counts = check_eval_counts(self.transport.evaluate(msgs, split), split)
        acc = counts.correct / counts.total.clamp(min=1)
        ok = ~torch.isnan(acc)
        if not bool(ok.any()):
            raise RuntimeError("no client answered the evaluation")
        a, correct, total = acc[ok], counts.correct[ok], counts.total[ok]
        subsets = {
            f"mean_acc_{name}": float(acc[torch.tensor(ids)][ok[torch.tensor(ids)]].mean())
            for name, ids in {**self.server.eval_groups(), **self.extra_groups}.items()
            if ids and bool(ok[torch.tensor(ids)].any())
        }
        return {
            **subsets,
            "mean_acc": float(a.mean()),
            "weighted_acc": float(correct.sum() / total.sum()),
            "min_acc": float(a.min()),
            "max_acc": float(a.max()),
            "std_acc": float(a.std(unbiased=False)),
            "test_loss": float((counts.loss_sum[ok] / total.clamp(min=1)).mean()),
            "client_acc": [round(float(x), 5) for x in acc],
            "client_arch": self.arch_of,
            "eval_missing": [int(c) for c in torch.nonzero(~ok).reshape(-1)],
        }

    def score_before_gossip(self) -> dict[str, Any]:
        """Every client's model now -- after this round's local training, before its mixing --
        on its test split: ``mean_acc_before_gossip`` and ``client_acc_before_gossip`` (and
        ``val_mean_acc_before_gossip`` with a validation split). The DisPFL lineage scores
        here; ``mean_acc`` (after mixing, so a personal head meets a body it did not train
        with) stays the ranked score (docs/runs.md, "What a table ranks")."""
        test = self.evaluate()
        out = {
            "mean_acc_before_gossip": test["mean_acc"],
            "client_acc_before_gossip": test["client_acc"],
        }
        if self.validate:
            out["val_mean_acc_before_gossip"] = self.evaluate("val")["mean_acc"]
        return out

    def _eval_request(self, cids: list[int]) -> None:
        """The method's exchange before evaluation (``Server.configure_eval_request``), if any:
        a setup exchange at stage ``EVAL_REQUEST``, validated like one; bytes not counted."""
        msgs = self.server.configure_eval_request(cids)
        if not msgs:
            return
        got = self.transport.setup(EVAL_REQUEST, msgs)
        accepted, _ = self._validate(
            got.replies,
            lambda c, r: self.server.check_setup_reply(EVAL_REQUEST, c, r),
            "evaluation request",
        )
        self.server.aggregate_setup(EVAL_REQUEST, accepted)

    def record(self, rnd: int, result: RoundResult) -> dict[str, Any]:
        """The metrics record of an evaluated round (:data:`RECORD_KEYS`)."""
        n_part = max(1, len(result.clients))
        val = {"val_mean_acc": self.evaluate("val")["mean_acc"]} if self.validate else {}
        return {
            "round": rnd,
            "scores": self.scores,
            **self.evaluate(),
            **val,
            "train_loss": result.train_loss,
            "nonfinite_loss": result.nonfinite_loss,
            "participants": len(result.clients),
            "replied": result.replied,
            "rejected": result.rejected,
            "bytes_up_round": result.bytes_up,
            "bytes_down_round": result.bytes_down,
            "bytes_up_per_client": result.bytes_up / n_part,
            "bytes_down_per_client": result.bytes_down / n_part,
            "bytes_up_total": self.totals["bytes_up"],
            "bytes_down_total": self.totals["bytes_down"],
            "flops_round": result.flops,
            "flops_total": self.totals["flops"],
            "flops_server_round": result.server_flops,
            "flops_server_total": self.totals["flops_server"],
            **result.extra,
            "num_clients": self.n,
            "seconds": self.elapsed(),
            "runtime": self.transport.name,
            **self.setup_info,
        }

    # -- the loop --------------------------------------------------------------------------
    def run(
        self,
        rounds: int,
        eval_every: int,
        *,
        start_round: int = 0,
        run_dir: RunDir | None = None,
        checkpoint_every: int | None = None,
        checkpoint: Callable[[int], dict[str, Any]] | None = None,
        on_round: Callable[[int, RoundResult, dict[str, Any] | None], None] | None = None,
        on_record: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Setup (on a fresh start), then rounds ``start_round+1 .. rounds``: evaluate and
        record every ``eval_every`` rounds and after the last, checkpoint (``checkpoint(rnd)``
        gives the state to save) every ``checkpoint_every`` rounds (default: ``eval_every``).
        A checkpoint is written in the background while the next rounds run
        (``RunDir.save_checkpoint_async``); the last one is on disk when this returns, or
        raises (a write that failed: ``CheckpointWriteError``). Returns the records."""
        every = checkpoint_every or eval_every
        size_told = checkpoint_every is not None  # the user chose how often: nothing to advise
        records = []
        self.restart_clock()
        if start_round == 0:  # a resumed run did its setup before its first checkpoint
            self.run_setup()
        try:
            for rnd in range(start_round + 1, rounds + 1):
                scored = rnd % eval_every == 0 or rnd == rounds
                result = self.run_round(rnd, score_before_mix=scored)
                record = None
                if scored:
                    record = self.record(rnd, result)
                    records.append(record)
                    if run_dir is not None:
                        run_dir.append_metrics(record)
                    if on_record is not None:
                        on_record(rnd, record)
                if (
                    run_dir is not None
                    and checkpoint is not None
                    and (rnd % every == 0 or rnd == rounds)
                ):
                    run_dir.save_checkpoint_async(checkpoint(rnd))
                    if not size_told:
                        size_told = advise_on_checkpoint_size(run_dir, every, rounds - rnd)
                if on_round is not None:
                    on_round(rnd, result, record)
        except BaseException:  # an error, Ctrl-C: the checkpoint in flight is finished first
            if run_dir is not None:
                try:
                    run_dir.wait_checkpoint()
                except CheckpointWriteError as e:  # the run's own error is the one raised
                    log.error("%s", e)
            raise
        if run_dir is not None:
            run_dir.wait_checkpoint()
        return records

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self, rnd: int) -> dict[str, Any]:
        return {
            "round": rnd,
            "server": self.server.state_dict(),
            "totals": dict(self.totals),
            "setup_info": self.setup_info,
            "seconds": self.elapsed(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> int:
        self.server.load_state_dict(state["server"])
        self.totals.update(state["totals"])  # a checkpoint may predate a counter
        self.setup_info = dict(state.get("setup_info", {}))
        self.seconds_before = float(state.get("seconds", 0.0))  # a resumed run's clock goes on
        return int(state["round"])
