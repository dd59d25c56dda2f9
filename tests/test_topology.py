"""Mixing matrices (seed 004, Definition 1) and the gossip step."""

from __future__ import annotations

import pytest
import torch

from hyperfed.engine.topology import (
    TOPOLOGIES,
    GossipParams,
    active_mixing,
    adjacency,
    components,
    grid_shape,
    mixing_matrix,
    spectral_gap,
)
from hyperfed.runtime.gossip import Gossip


@pytest.mark.parametrize("weights", ["metropolis", "uniform"])
@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 12, 16])
def test_definition_1(name: str, n: int, weights: str) -> None:
    if name == "regular" and n < 2:
        pytest.skip("no regular graph with neighbours on one node")
    adj = adjacency(name, n, p=0.2, seed=1, k=1 if n == 2 else 2 + (n > 7))
    assert torch.equal(adj, adj.T) and not bool(adj.diagonal().any())
    W = mixing_matrix(adj, weights)
    assert torch.allclose(W, W.T)
    assert bool((W >= 0).all())
    assert torch.allclose(W.sum(1), torch.ones(n, dtype=W.dtype))
    # (i) positive exactly on the edges and the diagonal
    assert torch.equal(W > 0, adj | torch.eye(n, dtype=torch.bool))
    eig = torch.linalg.eigvalsh(W)
    assert float(eig.min()) > -1 + 1e-9 and float(eig.max()) <= 1 + 1e-9  # (iv)
    assert len(components(adj)) == 1  # every named graph is connected ...
    gap = spectral_gap(W)
    assert 0 < gap <= 1 + 1e-12  # ... so 1 is a simple eigenvalue (iii)


def test_spectral_gap_orders_the_topologies() -> None:
    """Figure 3a's ordering: denser graphs mix faster."""
    gaps = [spectral_gap(mixing_matrix(adjacency(t, 16))) for t in TOPOLOGIES[:4]]
    assert gaps == sorted(gaps)  # ring < grid < exponential < full
    assert gaps[-1] == pytest.approx(1.0)


def test_grid_is_the_most_square_torus() -> None:
    assert grid_shape(16) == (4, 4)
    assert grid_shape(12) == (3, 4)
    assert grid_shape(7) == (1, 7)
    assert torch.equal(adjacency("grid", 7), adjacency("ring", 7))  # prime: a ring
    assert adjacency("grid", 16).sum(1).tolist() == [4] * 16
    assert adjacency("exponential", 16).sum(1).tolist() == [7] * 16  # +-1, 2, 4, 8 (8 twice)


def test_random_graph_is_seeded_and_connected() -> None:
    a = adjacency("random", 30, p=0.02, seed=5)
    assert torch.equal(a, adjacency("random", 30, p=0.02, seed=5))
    assert len(components(a)) == 1
    assert not torch.equal(a, adjacency("random", 30, p=0.02, seed=6))
    assert torch.equal(adjacency("random", 8, p=1.0), adjacency("full", 8))


def test_active_subgraph_keeps_w_doubly_stochastic() -> None:
    adj = adjacency("ring", 8)
    active = [0, 1, 2, 5]  # 0-1-2 a path, 5 alone
    W = active_mixing(adj, active)
    assert torch.allclose(W.sum(0), torch.ones(4, dtype=W.dtype))
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=W.dtype))
    assert W[3].tolist() == [0, 0, 0, 1]  # no active neighbour: keeps its own payload
    assert W[0, 2] == 0 and W[0, 1] > 0
    x = torch.randn(4, 3, dtype=torch.float64)
    assert torch.allclose((W @ x).mean(0), x.mean(0))  # the mean over active clients is kept


def test_full_graph_gossip_is_exact_averaging() -> None:
    gossip = Gossip(GossipParams(topology="full"), 10, seed=0)
    active = [1, 3, 4, 8]
    payload = {"phi": torch.randn(4, 5), "z": torch.randn(4, 2, 3)}
    mixed = Gossip.mix(gossip.mixing(1, active), payload)
    for k, v in payload.items():
        assert mixed[k].shape == v.shape
        assert torch.allclose(mixed[k], v.mean(0, keepdim=True).expand_as(v), atol=1e-6)


def test_resampled_random_graph_changes_per_round() -> None:
    gossip = Gossip(GossipParams(topology="random", p=0.3, resample=True), 12, seed=0)
    assert not torch.equal(gossip.graph(1), gossip.graph(2))
    assert torch.equal(gossip.graph(3), gossip.graph(3))


def test_gossip_params_are_validated() -> None:
    """The topology with its arguments in __post_init__; single fields by their annotations,
    through the config path (one line naming the key)."""
    from hyperfed.config import ConfigError, validate_hparams

    with pytest.raises(ValueError, match="topology must be one of"):
        GossipParams(topology="star")
    with pytest.raises(ConfigError, match=r"^algorithm\.p: allowed: .*1.*\(got 1\.5\)"):
        validate_hparams(GossipParams, {"p": 1.5})
    with pytest.raises(ConfigError, match=r"^algorithm\.weights: .*metropolis.*uniform"):
        validate_hparams(GossipParams, {"weights": "max"})
    with pytest.raises(ConfigError, match=r"^algorithm\.k: allowed: .*\(got 0\)"):
        validate_hparams(GossipParams, {"k": 0})


def test_regular_gives_every_client_k_neighbours_redrawn_each_round() -> None:
    """Seed 004 §5.2: every client talks to k neighbours that change every round. Each round's
    graph is k-regular and connected (so W meets Definition 1, test above); rounds differ; a
    round's graph is a function of (seed, round) only, so a resumed run sees the same one."""
    hp = GossipParams(topology="regular", k=4, resample=True)
    gossip = Gossip(hp, 12, seed=3)
    graphs = [gossip.graph(r) for r in (1, 2, 3)]
    for adj in graphs:
        assert adj.sum(1).tolist() == [4] * 12 and torch.equal(adj, adj.T)
        assert len(components(adj)) == 1
    assert not torch.equal(graphs[0], graphs[1]) and not torch.equal(graphs[1], graphs[2])
    assert torch.equal(Gossip(hp, 12, seed=3).graph(2), graphs[1])
    fixed = Gossip(GossipParams(topology="regular", k=4), 12, seed=3)
    assert torch.equal(fixed.graph(1), fixed.graph(2))  # resample off: one graph
    W = fixed.mixing(1, list(range(12)))
    assert torch.allclose(W, W.T) and torch.allclose(W.sum(0), torch.ones(12, dtype=W.dtype))
    assert torch.allclose(W.diagonal(), torch.full((12,), 1 / 5, dtype=W.dtype))  # 1/(1+k)


@pytest.mark.parametrize("n, k", [(5, 3), (4, 4), (4, 0)])
def test_impossible_regular_graphs_are_refused(n: int, k: int) -> None:
    with pytest.raises(ValueError, match="impossible"):
        adjacency("regular", n, k=k)
