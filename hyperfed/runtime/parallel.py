"""Clients trained in parallel worker processes on a CPU (``local.workers``).

On a CPU, one small model's step does not split well across threads, while clients are
independent work: ``local.workers = N`` starts N worker processes once per simulation, each
with one torch thread and the federation's data as shared-memory tensors (mapped, never
copied per round). Each round, every architecture group of participating clients is cut into
at most N contiguous chunks, and the chunks are handed to whichever worker is free; each
worker runs the unchanged ``Client.fit`` on its chunk and sends back the reply, the new client
state, the losses and the FLOPs it measured. The main process keeps the client-state store,
the server, evaluation and everything else, so the round's replies and metrics are those of
the one-process path: a client's batches and dropout masks are seeded per (run, round,
client), never per group (``engine/local.py``), so how clients are chunked changes nothing.

Processes are started with ``forkserver`` (``spawn`` where there is none, on Windows), never
with a plain ``fork``: a forked copy of a process whose OpenMP/oneDNN thread pool is running
can deadlock. The fork server is a fresh interpreter that only imports hyperfed (no torch op
has run in it, so no thread pool exists) and forks the workers from there: torch is imported
once, not once per worker as with ``spawn``, and the server is reused by later pools of the
same process (a sweep, a test suite). Pools are started once per simulation. Per-round payloads travel through pipes as raw tensor bytes (pickle
protocol 5 with out-of-band buffers): no shared-memory segment outlives a round and no file
descriptor is held per tensor.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import sys
import time
import traceback
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from multiprocessing import forkserver as mp_forkserver
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor

from hyperfed.algorithms.base import Payload, stack_payloads, unstack_payload
from hyperfed.data.federated import FederatedData
from hyperfed.errors import ConfigError, HyperfedError
from hyperfed.runtime.clients import ClientHost, Fitted, GroupCounts, StateStore
from hyperfed.runtime.cores import available_cores

log = logging.getLogger("hyperfed")

# What a worker runs for one chunk of clients of one architecture: a task tuple in, a result
# tuple out (``run_chunk``: "fit" and "evaluate" tasks). Built in the worker by ``init``.
ChunkFn = Callable[..., tuple]


# forkserver where the platform has it (Linux, macOS), else spawn; HYPERFED_START_METHOD overrides
START_METHOD = os.environ.get(
    "HYPERFED_START_METHOD",
    "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn",
)


class WorkerError(HyperfedError):
    """A worker process died or could not start (one line: which, and what to do)."""


def resolve_workers(setting: int | str, device: torch.device, max_clients: int) -> int:
    """``local.workers`` as a number of processes (1: the one-process path). "auto" (the
    default): one per available core (:func:`available_cores`), at most one per client
    trained in a round, 1 on a GPU."""
    if setting == "auto":
        return 1 if device.type != "cpu" else max(1, min(available_cores(), max_clients))
    n = int(setting)
    if n > 1 and device.type != "cpu":
        raise ConfigError(
            f"local.workers: worker processes train on the CPU, not on {device.type}; "
            "set local.workers = 1 (or device = cpu)"
        )
    return n


def stochastic_models(models: dict[str, Any], setting: int | str, vectorize: bool) -> list[str]:
    """Architectures with dropout when clients train vmapped (``local.vectorize``): a vmapped
    step draws every client's masks from the process's random stream at once, so worker
    processes would draw other masks than one process does, and such a federation trains in
    one process (a warning says so; an explicit worker count is refused). The client loop
    seeds each client's masks by (run, round, client) (``engine.local.client_rng``), so it
    has no such models."""
    if not vectorize:
        return []
    found = [name for name, fm in models.items() if fm.stochastic]
    if found and setting != "auto":
        raise ConfigError(
            f"local.workers: {', '.join(found)} uses dropout, whose masks a vmapped step draws "
            "from one process's random stream, so workers would not reproduce local.workers = "
            "1; set local.vectorize = off (the client loop seeds them per client) or "
            "local.workers = 1"
        )
    if found:
        log.warning(
            "local.workers = auto: %s uses dropout under vmap; training in one process", found
        )
    return found


def registered_here(cfg: Any, setting: int | str) -> list[str]:
    """The run's models and method registered in this Python process
    (``hyperfed.register_model`` / ``register_method``), which worker processes cannot build:
    with them ``auto`` trains in one process (logged) and an explicit worker count is refused."""
    from hyperfed.algorithms import ALGORITHMS
    from hyperfed.models.zoo import MODELS

    found = sorted(set(cfg.clients.assignment(cfg.seed)) & MODELS.added)
    if cfg.algorithm.name in ALGORITHMS.added:
        found.append(cfg.algorithm.name)
    if found and setting != "auto":
        raise ConfigError(
            f"local.workers: {found[0]!r} was registered in this Python process "
            "(hyperfed.register_model / register_method) and worker processes cannot build "
            "it; set local.workers = 1 or auto"
        )
    if found:
        log.info("local.workers = auto: %s registered in this process; one process", found)
    return found


def chunks(ids: list[int], n: int) -> list[list[int]]:
    """``ids`` cut into ``min(n, len(ids))`` contiguous pieces of near-equal size."""
    n = max(1, min(n, len(ids)))
    size, extra = divmod(len(ids), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(ids[start:end])
        start = end
    return out


# -- moving tensors through a pipe -----------------------------------------------------------
def _rebuild(dtype: torch.dtype, shape: tuple[int, ...], buf: Any) -> Tensor:
    flat = (
        torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    """Tensors as (dtype, shape, raw bytes out of band): one copy into the pipe, one out."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor) and obj.device.type == "cpu" and not obj.is_sparse:
            t = obj.detach().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            buf = pickle.PickleBuffer(raw)  # type: ignore[arg-type]
            return _rebuild, (t.dtype, tuple(t.shape), buf)
        return NotImplemented


def send(conn: Connection, obj: Any) -> None:
    buffers: list[pickle.PickleBuffer] = []
    head = io.BytesIO()
    _Pickler(head, protocol=5, buffer_callback=buffers.append).dump(obj)
    raws = [b.raw() for b in buffers]
    conn.send((head.getvalue(), [r.nbytes for r in raws]))
    for r in raws:
        conn.send_bytes(r)


def recv(conn: Connection) -> Any:
    head, sizes = conn.recv()
    buffers = []
    for size in sizes:
        buf = bytearray(size)
        if size:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        buffers.append(buf)
    return pickle.loads(head, buffers=buffers)


def compact(payload: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each tensor as its own storage (a view would send the whole storage it looks into)."""
    return {
        k: v.clone() if v.untyped_storage().nbytes() > v.numel() * v.element_size() else v
        for k, v in payload.items()
    }


def _compact_any(value: Any) -> Any:
    """A result's tensor dicts compacted (:func:`compact`); anything else as it is."""
    if isinstance(value, dict) and all(isinstance(v, Tensor) for v in value.values()):
        return compact(value)
    return value


# -- shared data -------------------------------------------------------------------------------
@dataclass
class SharedData:
    """A :class:`FederatedData` whose tensors live in shared memory, with the per-client index
    lists packed into one tensor each (a handful of shared segments, whatever the clients)."""

    shell: FederatedData  # index lists emptied
    packed: dict[str, tuple[Tensor, list[int]]]

    @staticmethod
    def of(data: FederatedData) -> SharedData:
        for t in (data.x, data.y, data.mean, data.std):
            t.share_memory_()
        packed = {}
        for name in ("train_idx", "val_idx", "test_idx"):
            idx: list[Tensor] = getattr(data, name)
            flat = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
            packed[name] = (flat.share_memory_(), [int(t.numel()) for t in idx])
        return SharedData(replace(data, train_idx=[], val_idx=[], test_idx=[]), packed)

    def data(self) -> FederatedData:
        lists = {name: list(flat.split(sizes)) for name, (flat, sizes) in self.packed.items()}
        return replace(self.shell, **lists)  # type: ignore[arg-type]


# -- the worker process ------------------------------------------------------------------------
def _worker_main(
    conn: Connection, init: Callable[..., ChunkFn], args: tuple, shared: SharedData
) -> None:
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    try:
        run = init(*args, shared.data())
    except BaseException as e:  # noqa: BLE001 - reported to the main process
        send(conn, ("error", _portable(e)))
        return
    send(conn, ("ready", os.getpid()))
    while True:
        try:
            task = recv(conn)
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            t0 = time.perf_counter()
            result = run(*task)
            busy = time.perf_counter() - t0
            send(conn, ("ok", (*(_compact_any(v) for v in result), busy)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main process
            send(conn, ("error", _portable(e)))


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """Start a spawned worker without re-running the user's ``__main__`` in it: workers need
    only hyperfed's modules, and a script without an ``if __name__ == "__main__":`` guard would
    otherwise start workers from inside its workers."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _portable(e: BaseException) -> BaseException:
    """``e`` with the worker's traceback as a note, or a RuntimeError if it cannot be pickled."""
    tb = "".join(traceback.format_exception(e)).rstrip()
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001
        e = RuntimeError(f"{type(e).__name__}: {e}")
    e.add_note(f"in a worker process (local.workers):\n{tb}")
    return e


def start_fork_server() -> None:
    """Start the fork server the workers are forked from (it imports torch and hyperfed's
    modules once, on another core) without waiting for it: called as soon as a simulation
    knows it will use workers, its imports overlap the data loading and model building."""
    if START_METHOD == "forkserver":
        mp.get_context(START_METHOD).set_forkserver_preload(["hyperfed.runtime.simulate"])
        mp_forkserver.ensure_running()


class WorkerPool:
    """N spawned worker processes, each building its chunk runner with ``init(*args, data)``
    once; :meth:`map` runs tasks on whichever is free and returns results in task order."""

    def __init__(self, n: int, init: Callable[..., ChunkFn], args: tuple, data: FederatedData):
        ctx: Any = mp.get_context(START_METHOD)
        start_fork_server()
        shared = SharedData.of(data)
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        t0 = time.perf_counter()
        try:
            for _ in range(n):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(theirs, init, args, shared), daemon=True)
                with _without_main():
                    p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(mine)
            for i in range(n):
                kind, value = self._answer(i, "starting")
                if kind == "error":
                    if isinstance(value, HyperfedError):
                        raise value
                    raise WorkerError(
                        f"local.workers: worker {i} could not build the clients "
                        f"({type(value).__name__}: {value}); an algorithm registered at run time "
                        "is unknown to worker processes: set local.workers = 1"
                    ) from value
        except BaseException:
            self.close()
            raise
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        log.info("%d worker processes started in %.1f s", n, time.perf_counter() - t0)

    @property
    def size(self) -> int:
        return len(self.procs)

    def _died(self, i: int, doing: str) -> WorkerError:
        p = self.procs[i]
        p.join(timeout=1)
        code = p.exitcode
        why = " (killed: out of memory?)" if code is not None and code < 0 else ""
        why = why or (" (its error is printed above)" if code else "")
        return WorkerError(
            f"local.workers: worker {i} (pid {p.pid}) died with exit code {code}{why} while "
            f"{doing}; rerun with fewer workers or local.workers = 1"
        )

    def _answer(self, i: int, doing: str) -> tuple[str, Any]:
        conn, proc = self.conns[i], self.procs[i]
        while True:
            ready = wait([conn, proc.sentinel])
            if conn in ready:
                try:
                    return recv(conn)  # type: ignore[no-any-return]
                except (EOFError, OSError):
                    raise self._died(i, doing) from None
            if proc.sentinel in ready and not conn.poll():
                raise self._died(i, doing)

    def map(self, tasks: list[tuple], describe: Callable[[int], str]) -> list[Any]:
        """Every task's result, in task order; a worker error is re-raised here."""
        results: list[Any] = [None] * len(tasks)
        pending = iter(range(len(tasks)))
        busy: dict[int, int] = {}  # worker -> task
        try:
            for w in range(min(self.size, len(tasks))):
                t = next(pending)
                send(self.conns[w], tasks[t])
                busy[w] = t
            while busy:
                watch = [self.conns[w] for w in busy] + [self.procs[w].sentinel for w in busy]
                ready = set(wait(watch))
                for w in list(busy):
                    if self.conns[w] not in ready and self.procs[w].sentinel not in ready:
                        continue
                    t = busy.pop(w)
                    kind, value = self._answer(w, describe(t))
                    if kind == "error":
                        raise value
                    results[t] = value
                    nxt = next(pending, None)
                    if nxt is not None:
                        send(self.conns[w], tasks[nxt])
                        busy[w] = nxt
        except BaseException:
            self.close()  # a worker mid-task cannot be trusted with the next round
            raise
        return results

    def close(self) -> None:
        _stop(self.procs, self.conns)
        self.procs, self.conns = [], []

    @property
    def closed(self) -> bool:
        return not self.procs


def _stop(procs: list[Any], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            send(conn, None)
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(timeout=1)
    for conn in conns:
        conn.close()


# -- the transport's hook ----------------------------------------------------------------------
class ParallelFit:
    """``InMemoryTransport.fit`` across worker processes: the pool is started on the first
    round and kept until :meth:`close` (or the simulation is garbage collected)."""

    def __init__(
        self,
        n: int,
        init: Callable[..., ChunkFn],
        args: tuple,
        data: FederatedData,
        split_groups: bool = True,
    ):
        self.n, self.init, self.args, self.data = n, init, args, data
        self.split = n if split_groups else 1  # chunks per group in fit (Client.splits_groups)
        self.pool: WorkerPool | None = None
        # the last round: wall seconds of fit, and the seconds workers spent in Client.fit
        self.last: dict[str, float] = {}

    def fit(
        self,
        rnd: int,
        msgs: dict[int, Payload],
        groups: Iterable[tuple[str, list[int]]],
        store: StateStore,
    ) -> Fitted:
        """:meth:`ClientHost.fit` with each group cut into chunks, one chunk per task."""
        if self.pool is None or self.pool.closed:
            self.pool = WorkerPool(self.n, self.init, self.args, self.data)
        t0 = time.perf_counter()
        plan, results = self._map(
            "fit", rnd, msgs, groups, store, self.split, stack_payloads, f"training in round {rnd}"
        )
        out = Fitted()
        new: dict[int, dict[str, Tensor]] = {}
        losses: dict[str, tuple[list[int], list[Tensor]]] = {}
        busy = 0.0
        for (name, part), (reply, state, loss, flops, seconds) in zip(plan, results):
            busy += seconds
            new.update(zip(part, unstack_payload(state, len(part))))
            out.replies.update(zip(part, unstack_payload(reply, len(part))))
            cids, parts = losses.setdefault(name, ([], []))
            cids.extend(part)
            parts.append(loss)
            out.flops += flops
        store.put(new)
        # one per group, as the one-process path has them
        out.losses = [(cids, torch.cat(parts)) for cids, parts in losses.values()]
        self.last = {"wall": time.perf_counter() - t0, "busy": busy, "tasks": len(plan)}
        return out

    def evaluate(
        self,
        split: str,
        msgs: dict[int, Payload],
        groups: Iterable[tuple[str, list[int]]],
        store: StateStore,
    ) -> list[tuple[list[int], GroupCounts]]:
        """:meth:`ClientHost.evaluate`, chunks evaluated in the workers as :meth:`fit` trains
        them (the pool must be running: a round came first)."""
        assert self.pool is not None and not self.pool.closed
        plan, results = self._map(
            "evaluate", split, msgs, groups, store, self.n, list, f"evaluating on {split}"
        )
        return [(part, (ok, tot, ls)) for (_, part), (ok, tot, ls, _) in zip(plan, results)]

    def _map(
        self,
        kind: str,
        at: Any,
        msgs: dict[int, Payload],
        groups: Iterable[tuple[str, list[int]]],
        store: StateStore,
        pieces: int,
        pack: Callable[[list[dict[str, Tensor]]], Any],
        doing: str,
    ) -> tuple[list[tuple[str, list[int]]], list[Any]]:
        """Each group cut into ``pieces`` chunks, one ``kind`` task per chunk (its messages,
        its states packed by ``pack``), run on the pool; the plan and the results in order."""
        assert self.pool is not None
        plan = [(name, part) for name, members in groups for part in chunks(members, pieces)]
        states = store.get(list(msgs))
        tasks = [
            (kind, name, part, at, [msgs[c] for c in part], pack([states[c] for c in part]))
            for name, part in plan
        ]

        def describe(t: int) -> str:
            name, part = plan[t]
            return f"{doing}: clients {part} ({name})"

        return plan, self.pool.map(tasks, describe)

    @property
    def running(self) -> bool:
        return self.pool is not None and not self.pool.closed

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def run_chunk(host: ClientHost) -> ChunkFn:
    """A worker's chunk runner: "fit" (:meth:`ClientHost.fit_group`, the group built, the
    messages stacked and the FLOPs measured there as in the main process) and "evaluate"
    (:meth:`ClientHost.evaluate_group`) tasks."""

    def run(
        kind: str, name: str, cids: list[int], at: Any, msgs: list[Payload], state: Any
    ) -> tuple:
        if kind == "evaluate":
            return host.evaluate_group(name, cids, msgs, state, at)
        return host.fit_group(name, cids, at, msgs, state)

    return run
