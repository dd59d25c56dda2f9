"""Communication graphs and gossip (mixing) matrices for decentralized methods (seed 004).

A decentralized round has no server: client i replaces its shared payload by
``sum_j W[i, j] payload_j`` over its neighbours j (itself included). Definition 1 of seed 004
asks W to follow the graph (``W[i, j] > 0`` exactly on edges and the diagonal), be symmetric,
have ``null(I - W) = span(1)`` (connected graph) and ``I >= W > -I``. Its *spectral gap* is
``1 - max(|lambda_2|, |lambda_n|)`` in ``(0, 1]``: 1 for the complete graph, small for a ring.

Graphs (``adjacency(name, n)``, symmetric 0/1 without self-loops):

* ``ring``        -- i ~ i +- 1 (mod n).
* ``grid``        -- 2-D torus on the most square factorization ``n = r * c`` (r <= c, r the
  largest divisor of n not above sqrt(n)); i ~ its up/down/left/right neighbours with
  wrap-around. A prime n has only ``1 x n``, so the grid *is* the ring; ``r = 2`` gives one
  vertical neighbour (up = down), so degrees are 3 there.
* ``exponential`` -- i ~ i +- 2^k (mod n) for 2^k < n (the undirected exponential graph).
* ``full``        -- every pair.
* ``random``      -- Erdos-Renyi G(n, p), seeded; kept connected by joining each further
  connected component to the first one with one random edge.
* ``regular``     -- a uniformly random k-regular graph (``k`` neighbours each; networkx's
  ``random_regular_graph``), seeded, redrawn until connected. With ``resample = true`` a new
  one every round: seed 004 §5.2's "10 neighbours that change every round" (``k = 10``).
* ``networkx:<generator>`` -- any graph generator of networkx, e.g.
  ``networkx:watts_strogatz_graph`` with ``graph_args = {k = 4, p = 0.1}``; its ``n`` (the
  number of clients) and ``seed`` (the run's) are filled in unless given. Nodes ``0..n-1`` are
  the clients (other labels: in sorted order). With ``resample = true`` a seeded generator
  draws a new graph every round.
* ``edgelist:<path>`` -- a text file of ``u v`` lines (client ids ``0..n-1``; ``#`` starts a
  comment, further columns are ignored), e.g. exported with ``networkx.write_edgelist(g, path,
  data=False)``.

Both are undirected and must be connected and cover exactly the run's clients; self-loops are
ignored (the diagonal of W is set by the weights).

Weights (``mixing_matrix(adj, weights)``), both symmetric and doubly stochastic:

* ``metropolis`` (default) -- Metropolis-Hastings ``W[i, j] = 1 / (1 + max(d_i, d_j))`` on edges,
  ``W[i, i] = 1 - sum_j W[i, j]``. Then ``W[i, i] >= 1 / (1 + d_i) > 0``, so by Gershgorin every
  eigenvalue is > -1 (Definition 1 (iv)).
* ``uniform`` -- max-degree weights ``1 / (1 + d_max)`` on every edge, the rest on the diagonal.
  On regular graphs (ring, torus, exponential, full) both rules give ``1 / (1 + d)``.

**Partial participation** (Figure 3d). Only the round's active clients train and talk. The round
uses the graph *induced on the active clients* (inactive clients and their edges drop out) and
recomputes the weights on it (:func:`active_mixing`), so the round's matrix is again symmetric
and doubly stochastic over the active clients: the mean of their payloads is preserved and
inactive clients keep theirs. Each active client's degree in that subgraph is its number of
active neighbours this round (``active_neighbors`` in the metrics). An active client with no
active neighbour keeps its own payload. ``full`` always gives exact averaging over the active
clients.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from hyperfed.hparams import Count, Unit, chosen, paper

TOPOLOGIES = ("ring", "grid", "exponential", "full", "random", "regular")
WEIGHTS = ("metropolis", "uniform")
NETWORKX = "networkx:"  # prefix of a networkx generator's name
EDGELIST = "edgelist:"  # prefix of an edge-list file's path


def grid_shape(n: int) -> tuple[int, int]:
    """``(rows, cols)`` of the most square torus with ``rows * cols == n``."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return rows, n // rows


def check_topology(name: str, args: dict[str, Any] | None = None) -> None:
    """Raise ``ValueError`` (one line) for a topology name that cannot be built."""
    if name.startswith(NETWORKX):
        _generator(name.removeprefix(NETWORKX))
    elif name.startswith(EDGELIST):
        path = Path(name.removeprefix(EDGELIST)).expanduser()
        if not path.is_file():
            raise ValueError(f"topology {name}: no such edge-list file {str(path)!r}")
    elif name not in TOPOLOGIES:
        raise ValueError(
            f"topology must be one of {', '.join(TOPOLOGIES)}, networkx:<generator> or "
            f"edgelist:<path> (got {name!r})"
        )
    if args and not name.startswith(NETWORKX):
        raise ValueError(f"graph_args is for networkx:<generator> topologies (got {name!r})")


def adjacency(
    name: str,
    n: int,
    *,
    p: float = 0.5,
    seed: int = 0,
    k: int = 10,
    args: dict[str, Any] | None = None,
) -> Tensor:
    """Symmetric ``[n, n]`` bool adjacency (no self-loops) of a named graph (``args``: a
    networkx generator's arguments)."""
    if name.startswith((NETWORKX, EDGELIST)):
        return torch.from_numpy(_external(name, n, seed, args or {}))
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; allowed: {', '.join(TOPOLOGIES)}")
    if n < 1:
        raise ValueError(f"a graph needs at least one node (got {n})")
    adj = np.zeros((n, n), dtype=bool)
    idx = np.arange(n)

    def link(a: np.ndarray, b: np.ndarray) -> None:
        adj[a, b] = True
        adj[b, a] = True

    if name == "ring":
        link(idx, (idx + 1) % n)
    elif name == "grid":
        rows, cols = grid_shape(n)
        r, c = idx // cols, idx % cols
        link(idx, r * cols + (c + 1) % cols)
        link(idx, ((r + 1) % rows) * cols + c)
    elif name == "exponential":
        k = 1
        while k < n:
            link(idx, (idx + k) % n)
            k *= 2
    elif name == "full":
        adj[:] = True
    elif name == "regular":
        adj = _random_regular(n, k, seed)
    else:  # random
        if not 0 <= p <= 1:
            raise ValueError(f"random topology: p must be in [0, 1] (got {p})")
        rng = np.random.default_rng([seed, 4242])
        upper = np.triu(rng.random((n, n)) < p, 1)
        adj = upper | upper.T
        comps = components(adj)
        for comp in comps[1:]:  # keep it connected: one random edge to the first component
            link(np.array(rng.choice(comps[0])), np.array(rng.choice(comp)))
    np.fill_diagonal(adj, False)
    return torch.from_numpy(adj)


def _random_regular(n: int, k: int, seed: int) -> np.ndarray:
    """A connected uniformly random k-regular graph on n nodes (n * k even, k < n)."""
    import networkx as nx

    if not 0 < k < n or (n * k) % 2:
        raise ValueError(
            f"regular topology: k = {k} neighbours for {n} clients is impossible; need "
            "0 < k < clients and clients * k even"
        )
    for attempt in range(100):
        graph = nx.random_regular_graph(k, n, seed=seed * 7919 + attempt)
        adj = nx.to_numpy_array(graph, nodelist=range(n), dtype=bool)
        if len(components(adj)) == 1:
            return adj
    raise ValueError(f"regular topology: no connected {k}-regular graph on {n} nodes found")


def _generator(name: str) -> Any:
    import networkx as nx

    fn = getattr(nx, name, None)
    if name.startswith("_") or not callable(fn) or isinstance(fn, type):
        raise ValueError(
            f"topology networkx:{name}: networkx has no graph generator {name!r}; e.g. "
            "networkx:watts_strogatz_graph, networkx:cycle_graph, networkx:barabasi_albert_graph"
        )
    return fn


def _external(name: str, n: int, seed: int, args: dict[str, Any]) -> np.ndarray:
    """The adjacency of a networkx generator's graph or of an edge-list file, checked."""
    if name.startswith(NETWORKX):
        adj = _networkx_graph(name.removeprefix(NETWORKX), n, seed, args)
    else:
        adj = _edgelist_graph(Path(name.removeprefix(EDGELIST)).expanduser(), n)
    adj = adj | adj.T  # undirected
    np.fill_diagonal(adj, False)  # self-loops ignored
    comps = components(adj)
    if len(comps) > 1:
        cut = ", ".join(str(c) for c in comps[1][:5]) + (", ..." if len(comps[1]) > 5 else "")
        raise ValueError(
            f"topology {name}: the graph is disconnected ({len(comps)} components; clients "
            f"{cut} cannot reach client 0); gossip needs a connected graph"
        )
    return adj


def _networkx_graph(gen: str, n: int, seed: int, args: dict[str, Any]) -> np.ndarray:
    import networkx as nx

    fn = _generator(gen)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a generator without a signature
        params = {}  # type: ignore[assignment]
    kwargs = dict(args)
    if "n" in params:
        kwargs.setdefault("n", n)
    if "seed" in params:
        kwargs.setdefault("seed", seed)
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    try:
        graph = fn(**kwargs)
    except Exception as e:  # networkx's own message says which argument is wrong
        msg = " ".join(str(e).split())
        raise ValueError(f"topology networkx:{gen}({shown}): {type(e).__name__}: {msg}") from None
    if not isinstance(graph, nx.Graph):
        raise ValueError(f"topology networkx:{gen}: returned {type(graph).__name__}, not a graph")
    if graph.number_of_nodes() != n:
        raise ValueError(
            f"topology networkx:{gen}({shown}): the graph has {graph.number_of_nodes()} nodes, "
            f"the run has {n} clients (clients.count); choose arguments that give {n} nodes"
        )
    nodes = list(graph.nodes)
    if set(nodes) != set(range(n)):
        with contextlib.suppress(TypeError):  # unorderable labels: networkx's node order
            nodes = sorted(nodes)
    else:
        nodes = list(range(n))
    return nx.to_numpy_array(graph, nodelist=nodes, dtype=bool, weight=None)


def _edgelist_graph(path: Path, n: int) -> np.ndarray:
    """``u v`` lines (client ids); ``#`` comments and further columns ignored."""
    where = f"topology edgelist:{path}"
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{where}: cannot read the file ({e.strerror or e})") from None
    adj = np.zeros((n, n), dtype=bool)
    seen: set[int] = set()
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            u, v = int(fields[0]), int(fields[1])
        except (ValueError, IndexError):
            raise ValueError(
                f"{where}, line {number}: expected two client ids 'u v', got {line.strip()!r}"
            ) from None
        for node in (u, v):
            if not 0 <= node < n:
                raise ValueError(
                    f"{where}, line {number}: node {node} is not a client id 0..{n - 1} "
                    f"(clients.count = {n})"
                )
        adj[u, v] = adj[v, u] = True
        seen.update((u, v))
    if len(seen) != n:
        missing = sorted(set(range(n)) - seen)
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise ValueError(
            f"{where}: the file's graph has {len(seen)} nodes, the run has {n} clients "
            f"(clients.count); clients {shown} appear on no line"
        )
    return adj


def components(adj: np.ndarray | Tensor) -> list[list[int]]:
    """Connected components (lists of node ids), in order of their smallest node."""
    a = np.asarray(adj, dtype=bool)
    n = a.shape[0]
    seen = np.zeros(n, dtype=bool)
    out = []
    for start in range(n):
        if seen[start]:
            continue
        comp, stack = [], [start]
        seen[start] = True
        while stack:
            i = stack.pop()
            comp.append(i)
            for j in np.flatnonzero(a[i] & ~seen):
                seen[j] = True
                stack.append(int(j))
        out.append(sorted(comp))
    return out


def mixing_matrix(adj: Tensor, weights: str = "metropolis") -> Tensor:
    """Symmetric doubly-stochastic ``[n, n]`` float64 W supported on ``adj`` + the diagonal."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; allowed: {', '.join(WEIGHTS)}")
    a = adj.to(torch.bool).clone()
    a.fill_diagonal_(False)
    a = a | a.T
    deg = a.sum(1).to(torch.float64)
    if weights == "metropolis":
        w = 1.0 / (1.0 + torch.maximum(deg[:, None], deg[None, :]))
    else:
        d_max = float(deg.max()) if deg.numel() else 0.0
        w = torch.full_like(a, 1.0 / (1.0 + d_max), dtype=torch.float64)
    W = torch.where(a, w, torch.zeros((), dtype=torch.float64))
    return W + torch.diag(1.0 - W.sum(1))


def spectral_gap(W: Tensor) -> float:
    """``1 - max(|lambda_2|, |lambda_n|)`` of a symmetric W (1.0 for a single node)."""
    eig = torch.linalg.eigvalsh(W.to(torch.float64))  # ascending; eig[-1] == 1
    if eig.numel() < 2:
        return 1.0
    return float(1.0 - max(abs(float(eig[-2])), abs(float(eig[0]))))


def active_mixing(adj: Tensor, active: list[int], weights: str = "metropolis") -> Tensor:
    """W of the subgraph induced on ``active`` (rows/cols in the order of ``active``)."""
    idx = torch.tensor(active, dtype=torch.long)
    return mixing_matrix(adj[idx][:, idx], weights)


def topology_summary(adj: Tensor, weights: str = "metropolis") -> dict[str, float]:
    """Degree and spectral gap of the whole graph (what Figure 3a varies)."""
    deg = adj.sum(1).to(torch.float64)
    return {
        "mean_degree": float(deg.mean()),
        "spectral_gap": spectral_gap(mixing_matrix(adj, weights)),
    }


@dataclass
class GossipParams:
    """The communication graph of a decentralized method (``[algorithm]`` keys).

    Seed 004 §5.1 runs a ``random`` topology (p is not given); Figure 3a compares ``ring``,
    ``grid``, ``exponential`` and ``full``. ``networkx:<generator>`` (with ``graph_args``) and
    ``edgelist:<path>`` bring any other graph."""

    # or networkx:<generator> / edgelist:<path> (module docstring)
    topology: str = paper("random", "seed 004 §5.1")
    # networkx:<generator> only: its keyword arguments (n and seed are filled in)
    graph_args: dict[str, Any] = chosen({}, "none: the generator's own defaults")
    # edge probability of the random graph
    p: Unit = chosen(0.5, "seed 004 gives no p")
    # or "uniform" (max-degree)
    weights: Literal["metropolis", "uniform"] = chosen(
        "metropolis", "Definition 1 only constrains W; Metropolis meets it"
    )
    # random / regular topology: draw a new graph every round (time-varying)
    resample: bool = chosen(False, "fixed graph; seed 004 §5.2's setting: regular + true")
    # regular topology: neighbours per client
    k: Count = paper(10, "seed 004 §5.2 (10 neighbours per round)")

    def __post_init__(self) -> None:
        check_topology(self.topology, self.graph_args)  # the topology and its arguments together
