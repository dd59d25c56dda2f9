"""A Flower run's server side: the ``ServerApp``, and :class:`Deployment`, the round driver's
transport over Flower.

The algorithm's server role is run by the round driver (:mod:`hyperfed.runtime.driver`) as in
the simulator, built by the same federation builder; :class:`Deployment` only moves payloads:
one group message per node (:mod:`hyperfed.deploy.records`) holding the payloads of the clients
it serves, replies by client id, errors and late replies logged and dropped. The run directory
(``metrics.jsonl``, ``summary.md``, checkpoints, ``wire.jsonl``: one line per client and
message) is written as the simulator writes it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from torch import Tensor

from hyperfed.algorithms.base import (
    Payload,
    Server,
    check_join,
    payload_bytes,
    stack_payloads,
)
from hyperfed.config import ConfigError, to_toml
from hyperfed.deploy.appconfig import PARTITION_IDS, RunSettings, config_from_run_config
from hyperfed.deploy.records import (
    CONFIG,
    EVAL_FIELDS,
    EVALUATE,
    GOSSIP,
    JOIN,
    METRICS,
    NODE,
    SETUP,
    TRAIN,
    WEIGHTS,
    client_parts,
    decode_error,
    describe,
    group_message,
    pack_tensors,
    payload_to_record,
    record_to_payload,
)
from hyperfed.deploy.supernode import FIRST_POLL, POLL_INTERVAL, PollSchedule, shorten_object_pulls
from hyperfed.runtime.driver import EvalCounts, Exchange, RoundResult
from hyperfed.runtime.federation import Federation
from hyperfed.runtime.rundir import CheckpointWriteError, RunDir, atomic_torch_save

log = logging.getLogger("hyperfed.flower")

SERVER_STATE = "server_state.pt"  # in the run directory: the server role's final state
server_app = ServerApp()


def _check_join(
    payload: Payload, server_needs_size: bool = True, max_samples: int = 10**9
) -> str | None:
    """A join payload's problem, if any (a decentralized client tells nothing: ``{}``):
    :func:`~hyperfed.algorithms.base.check_join` (counts one integer each, a sample count in
    ``[1, max_samples]``)."""
    if server_needs_size and ("num_params" not in payload or payload["num_params"].numel() != 1):
        return "join payload has no num_params"
    return check_join(payload, max_samples)


# The server pulls for replies on a PollSchedule (FIRST_POLL seconds after a push or a reply,
# growing to POLL_INTERVAL; the nodes ask for work the same way: hyperfed.deploy.supernode).
# Flower's Grid.send_and_receive sleeps 3 s between pulls, so every message exchange cost up
# to 3 s on top of the nodes' own 3 s idle poll: ~11 s a round for 3 loopback clients whose
# training takes milliseconds.


def send_and_receive(
    grid: Grid, messages: Sequence[Message], timeout: float | None, poll: float = POLL_INTERVAL
) -> list[Message]:
    """Flower's ``Grid.send_and_receive`` (push, then pull until every message is answered or
    ``timeout`` seconds have passed; None: no limit), waiting ``FIRST_POLL`` seconds after the
    push or a reply and at most ``poll`` seconds between pulls."""
    waiting = set(grid.push_messages(messages))
    end = None if timeout is None else time.monotonic() + timeout
    schedule = PollSchedule(FIRST_POLL, poll)
    replies: list[Message] = []
    while waiting:
        got = list(grid.pull_messages(waiting))
        replies += got
        waiting -= {m.metadata.reply_to_message_id for m in got}
        if not waiting or (end is not None and time.monotonic() >= end):
            break
        if got:
            schedule.reset()
        time.sleep(schedule.next())
    return replies


class _Forward(logging.Handler):
    """Hands another logger's records to ``to``, except this module's own (``to`` has them)."""

    def __init__(self, to: logging.Handler) -> None:
        super().__init__()
        self.to = to

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith(log.name):
            self.to.handle(record)


def counts_fields(counts: EvalCounts) -> tuple[Tensor, Tensor, Tensor]:
    """The tensors of ``counts`` in the order of :data:`EVAL_FIELDS`."""
    return counts.correct, counts.total, counts.loss_sum


class ServerRunDir(RunDir):
    """The ServerApp's run directory: a checkpoint it cannot write (a full disk, a quota, an
    I/O error) is one logged line, the previous checkpoint is kept and the federation goes on
    (the nodes are waiting for it); ``on_failure`` is told, so that the nodes keep the state
    files of the checkpoint that is on disk."""

    def __init__(self, path: str | Path, on_failure: Callable[[], None]) -> None:
        super().__init__(path)
        self.on_failure = on_failure

    def save_checkpoint(self, state: dict[str, Any]) -> int:
        try:
            return super().save_checkpoint(state)
        except CheckpointWriteError as e:
            log.error("%s; the run goes on", e)
            self.on_failure()
            return 0


def save_server_state(path: Path, state: dict[str, Any]) -> bool:
    """Write the server's final state (``server_state.pt``) atomically; a write failure (a
    full disk) is one logged line and the previous file is kept. Whether it was written."""
    try:
        atomic_torch_save(path, state, "server state")
    except CheckpointWriteError as e:
        log.error("%s", e)
        return False
    return True


class Deployment:
    """The server side of a run: the algorithm's server role, run by the round driver
    (:mod:`hyperfed.runtime.driver`), and the Flower nodes it reaches -- this class is the
    driver's transport: one Flower message per node, holding the payloads of the clients it
    serves (a group message; one client is a group of one), replies by client id."""

    name = "flower"

    def __init__(self, grid: Grid, run_config: dict[str, Any]) -> None:
        self.grid = grid
        self.cfg = cfg = config_from_run_config(run_config)
        self.federation = fed = Federation(cfg)  # the simulator's builder (runtime/federation.py)
        self.algorithm = fed.algorithm
        self.settings = settings = RunSettings.from_run_config(run_config)
        self.resume = settings.resume
        self.last_checkpoint = 0  # round of the last checkpoint written (sent to the nodes)
        self.device = fed.device
        self.reference = fed.reference  # its nodes report no loss
        self.n = cfg.clients.count
        nodes = math.ceil(self.n / settings.clients_per_node)  # every client served
        self.min_nodes = settings.min_nodes or nodes
        self.join_timeout = settings.join_timeout
        self.round_timeout = settings.round_timeout
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = settings.run_dir or f"runs/{stamp}-flower-{cfg.algorithm.name}"
        self.run_dir = ServerRunDir(run_dir, self._checkpoint_failed)
        self.saved_checkpoint = 0  # round of the last checkpoint on disk
        self.node_of: dict[int, int] = {}  # client id -> Flower node id
        self.clients_of: dict[int, list[int]] = {}  # Flower node id -> the clients it serves
        self.server: Server | None = None
        self.totals: dict[str, int] = {}
        self.evaluated = 0  # evaluation exchanges so far (names their message group)

    # -- messaging ------------------------------------------------------------------------
    def exchange(
        self,
        kind: str,
        payloads: dict[int, Payload],
        config: dict[str, Any],
        group: str,
        extra: dict[int, Tensor] | None = None,
    ) -> dict[int, RecordDict]:
        """One message per node: its clients' payloads (only clients it serves, as its join
        said), replies by client id (each client's records under their own names);
        errors and late replies are logged and dropped (the run carries on with the others)."""
        by_node: dict[int, list[int]] = {}
        for cid in payloads:
            by_node.setdefault(self.node_of[cid], []).append(cid)
        messages: list[Message] = []
        for node, cids in by_node.items():
            served = ConfigRecord(
                {**config, "client-ids": cids, "checkpoint": self.last_checkpoint}
            )
            parts: dict[int, RecordDict] = {}
            for cid in cids:
                parts[cid] = part = payload_to_record(payloads[cid])
                if extra is not None:  # a gossip message: this client's row of W
                    part[WEIGHTS] = pack_tensors({"w": extra[cid]})
                view = RecordDict(dict(part))
                view[CONFIG] = served
                self.wire("down", kind, group, cid, node, view)
            content = group_message(parts, {CONFIG: served})
            messages.append(Message(content, node, kind, group_id=group, ttl=self.round_timeout))
        replies: dict[int, RecordDict] = {}
        received = send_and_receive(self.grid, messages, self.round_timeout)
        # a reply names the message it answers (ids are set when pushed); the SuperLink's
        # own error replies (an unreachable node) come from the SuperLink, not the node
        by_id = {msg.metadata.message_id: msg.metadata.dst_node_id for msg in messages}
        for reply in received:
            node_or_none = by_id.get(reply.metadata.reply_to_message_id)
            if node_or_none is None and reply.metadata.src_node_id in by_node:
                node_or_none = reply.metadata.src_node_id
            if node_or_none is None:
                continue
            node = node_or_none
            if reply.has_error():
                log.warning(
                    "%s %s: clients %s (node %d) failed: error %s %s",
                    kind,
                    group,
                    by_node[node],
                    node,
                    reply.error.code,
                    (reply.error.reason or "")[:300],
                )
                continue
            try:
                parts = client_parts(reply.content, by_node[node])
            except Exception as e:  # a malformed record: that node's replies are rejected
                log.warning(
                    "%s %s: rejected reply of node %d (clients %s): %s",
                    kind,
                    group,
                    node,
                    by_node[node],
                    decode_error(e),
                )
                continue
            for cid, view in parts.items():
                if not view:
                    continue  # the node did not answer for this client
                self.wire("up", kind, group, cid, node, view)
                replies[cid] = view
                metrics: dict[str, Any] = dict(view.metric_records.get(METRICS, {}))
                if metrics.get("state_lost"):
                    log.warning(
                        "%s %s: client %d had lost its state; it restarted from its initial state",
                        kind,
                        group,
                        cid,
                    )
        missing = sorted(set(payloads) - set(replies))
        if missing:
            log.warning("%s %s: no reply from clients %s", kind, group, missing)
        return replies

    def wire(
        self, direction: str, kind: str, group: str, cid: int, node: int, content: RecordDict
    ) -> None:
        """One line per client and message in ``wire.jsonl``: what crossed, to and from which
        client (a group message: that client's part) and node."""
        line = {
            "dir": direction,
            "type": kind,
            "group": group,
            "client": cid,
            "node": node,
            "content": describe(content),
        }
        with open(self.run_dir.path / "wire.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def online(self) -> set[int]:
        nodes = set(self.grid.get_node_ids())
        return {c for c, node in self.node_of.items() if node in nodes}

    # -- phases ---------------------------------------------------------------------------
    def wait_for_nodes(self) -> list[int]:
        deadline = time.monotonic() + self.join_timeout
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= self.min_nodes or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if len(nodes) < self.min_nodes:
            log.warning(
                "only %d of %d nodes connected after %.0f s; carrying on",
                len(nodes),
                self.min_nodes,
                self.join_timeout,
            )
        return nodes

    def join(self) -> dict[int, Payload]:
        """Every node's join: the clients it serves (``partition-ids``, one join payload each)
        -- the only clients the server sends it messages for."""
        nodes = self.wait_for_nodes()
        messages = [Message(RecordDict(), node, JOIN, group_id="join") for node in nodes]
        joins: dict[int, Payload] = {}
        replies = send_and_receive(self.grid, messages, self.join_timeout)
        # in node order, whatever order the replies came in: a client two nodes claim stays
        # with the first node, the same one every run
        rank = {node: i for i, node in enumerate(nodes)}
        for reply in sorted(replies, key=lambda r: rank.get(r.metadata.src_node_id, len(rank))):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("join: node %d failed: %s", node, (reply.error.reason or "")[:300])
                continue
            try:
                served = reply.content.config_records[NODE][PARTITION_IDS]
                cids = [int(c) for c in served]  # type: ignore[union-attr]
                views = client_parts(reply.content, cids)
                payloads = {c: record_to_payload(views[c], self.device) for c in cids}
            except Exception as e:  # a malformed join: that node is left out, logged
                log.warning("join: rejected node %d: %s", node, decode_error(e))
                continue
            accepted: list[int] = []
            for cid in cids:
                payload = payloads[cid]
                problem = _check_join(
                    payload, self.algorithm.kind == "centralized", self.cfg.defense.max_samples
                )
                if cid in self.node_of or cid in accepted or not 0 <= cid < self.n:
                    problem = f"partition id {cid} taken or out of range [0, {self.n})"
                if problem:
                    what = f"client {cid} of node {node}" if len(cids) > 1 else f"node {node}"
                    log.warning("join: rejected %s: %s", what, problem)
                    continue
                self.node_of[cid] = node
                joins[cid] = payload
                accepted.append(cid)
                self.wire("up", JOIN, "join", cid, node, views[cid])
            if accepted:
                self.clients_of[node] = accepted
        if not joins:
            raise RuntimeError("no node joined the run")
        log.info(
            "joined: clients %s of %d on %d nodes", sorted(joins), self.n, len(self.clients_of)
        )
        return dict(sorted(joins.items()))

    def build_server(self, joins: dict[int, Payload]) -> Server:
        """The server role for the nodes that joined, built as the simulator builds it."""
        ds = self.cfg.dataset.load()  # shape and classes only
        self.models = self.federation.models(ds.input_shape, ds.num_classes)
        return self.federation.server_role(joins, self.models, ds.input_shape, ds.num_classes)

    # -- the Transport the round driver talks to (runtime/driver.py) ---------------------
    def reachable(self) -> set[int] | None:
        return self.online()

    def fit(self, rnd: int, msgs: dict[int, Payload]) -> Exchange:
        out = Exchange({})
        for cid, reply in self.exchange(TRAIN, msgs, {"round": rnd}, str(rnd)).items():
            try:
                out.replies[cid] = record_to_payload(reply, self.device)
                metrics: dict[str, Any] = dict(reply.metric_records.get(METRICS, {}))
            except Exception as e:  # a rejected reply (the driver logs it), not a crash
                out.malformed[cid] = decode_error(e)
                continue
            reported = metrics.get("train_flops")  # what the client measured (engine.local)
            if isinstance(reported, int | float) and math.isfinite(reported) and reported >= 0:
                out.flops += int(reported)
            loss = metrics.get("train_loss")
            if isinstance(loss, float):
                out.losses.append(torch.tensor([loss]))
        return out

    def setup(self, stage: int, msgs: dict[int, Payload]) -> Exchange:
        out = Exchange({})
        stats: dict[str, list[float]] = {}
        got = self.exchange(SETUP, msgs, {"stage": stage}, f"setup-{stage}")
        for cid, reply in got.items():
            try:
                payload = record_to_payload(reply, self.device)
                values = {
                    k: float(v)  # type: ignore[arg-type]
                    for k, v in reply.metric_records.get(METRICS, {}).items()
                }
            except Exception as e:  # a rejected reply (the driver logs it), not a crash
                out.malformed[cid] = decode_error(e)
                continue
            out.replies[cid] = payload
            for k, v in values.items():
                stats.setdefault(k, []).append(v)
        out.stats = {k: torch.tensor(vs) for k, vs in stats.items()}
        return out

    def relay(self, rnd: int, W: Tensor, payloads: dict[int, Payload]) -> None:
        """Gossip over Flower: node ``i`` gets its neighbours' payloads (``W[i, j] != 0``,
        itself included) and its row of ``W``, and mixes them itself; the server only
        relays (it never adds payloads up)."""
        active = list(payloads)
        messages: dict[int, Payload] = {}
        rows: dict[int, Tensor] = {}
        for i, cid in enumerate(active):
            near = [j for j in range(len(active)) if W[i, j] != 0]
            messages[cid] = stack_payloads([payloads[active[j]] for j in near])
            rows[cid] = W[i, near]
        self.exchange(GOSSIP, messages, {"round": rnd}, f"gossip-{rnd}", extra=rows)

    def evaluate(self, msgs: dict[int, Payload], split: str) -> EvalCounts:
        rnd = self.evaluated = self.evaluated + 1
        got = self.exchange(EVALUATE, msgs, {"round": rnd, "split": split}, f"eval-{rnd}-{split}")
        counts = EvalCounts(*(torch.full((self.n,), math.nan) for _ in range(3)))
        for cid, reply in got.items():
            # a field missing or not a number: rejected here (logged), left NaN (no answer);
            # impossible counts are the driver's to reject (runtime.driver.check_eval_counts)
            m: Mapping[str, Any] = reply.metric_records.get(METRICS, {})
            values = [m.get(k) for k in EVAL_FIELDS]
            wrong = [
                k
                for k, v in zip(EVAL_FIELDS, values, strict=True)
                if not isinstance(v, int | float) or isinstance(v, bool)
            ]
            if wrong:
                log.warning(
                    "evaluation (%s): rejected reply from client %d: %s missing or not a number",
                    split,
                    cid,
                    ", ".join(wrong),
                )
                continue
            for into, value in zip(counts_fields(counts), values, strict=True):
                into[cid] = float(value)  # type: ignore[arg-type]
        return counts

    # -- the run --------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        state = None
        if self.resume:  # verified before anything is built (rundir.py)
            state = self.run_dir.load_checkpoint()
            if state is None:
                raise ConfigError(
                    f"resume: {self.run_dir.path} has no checkpoint; set checkpoint_every "
                    "and start the run anew"
                )
        else:
            self.run_dir.create(to_toml(cfg))
            (self.run_dir.path / "wire.jsonl").write_text("")
        self.checkpoint_state = state
        handler = logging.FileHandler(self.run_dir.path / "server.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        # the round driver's lines (rejected replies, logger "hyperfed") go there too
        driver_log, forward = logging.getLogger("hyperfed"), _Forward(handler)
        driver_log.addHandler(forward)
        try:
            return self._run()
        finally:
            log.removeHandler(handler)
            driver_log.removeHandler(forward)
            handler.close()

    def _checkpoint_failed(self) -> None:
        # the checkpoint on disk is still the previous one: the nodes keep its state files
        self.last_checkpoint = self.saved_checkpoint

    def _run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        joins = self.join()
        self.server = server = self.build_server(joins)
        driver = self.federation.driver(server, self)
        start = 0
        if self.checkpoint_state is not None:
            start = self.last_checkpoint = driver.load_state_dict(self.checkpoint_state)
            self.run_dir.truncate_metrics(start)
            log.info("resumed from the checkpoint of round %d", start)
        else:
            driver.totals["bytes_up"] += sum(payload_bytes(p) for p in joins.values())
        self.run_dir.note_machine(start, self.federation.device)  # the server's; nodes differ

        def checkpoint(rnd: int) -> dict[str, Any]:
            self.saved_checkpoint = self.last_checkpoint
            self.last_checkpoint = rnd  # nodes keep their state files from here on
            return driver.state_dict(rnd)

        def progress(rnd: int, result: RoundResult, record: dict[str, Any] | None) -> None:
            log.info(
                "round %d: %d/%d updates, train loss %.4f, %.1f s",
                rnd,
                len(result.replied),
                len(result.clients),
                result.train_loss,
                driver.elapsed(),
            )
            if record is not None:
                log.info("round %d: mean acc %.4f", rnd, record["mean_acc"])

        records = driver.run(
            cfg.rounds,
            cfg.eval_every,
            start_round=start,
            run_dir=self.run_dir,
            checkpoint_every=cfg.checkpoint_every,
            checkpoint=checkpoint if cfg.checkpoint_every else None,
            on_round=progress,
        )
        self.totals = driver.totals
        # the server's final state (not a simulator checkpoint: the client state is on the nodes)
        state = {"round": cfg.rounds, "server": server.state_dict(), "totals": dict(self.totals)}
        save_server_state(self.run_dir.path / SERVER_STATE, state)
        from hyperfed.report import write_summary

        write_summary(self.run_dir.path)
        return records


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("hyperfed %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    shorten_object_pulls()  # the replies' objects, from the SuperLink
    Deployment(grid, dict(context.run_config)).run()
