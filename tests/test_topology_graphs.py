"""Topologies from networkx generators and edge-list files (issue 28 item 4)."""

from __future__ import annotations

from fractions import Fraction as F

import networkx as nx
import pytest
import torch

from hyperfed.config import load_config
from hyperfed.engine.topology import GossipParams, adjacency, mixing_matrix
from hyperfed.errors import ConfigError
from hyperfed.runtime.gossip import Gossip


def test_a_networkx_cycle_is_the_built_in_ring():
    for n in (3, 7, 10):
        ring = adjacency("ring", n)
        cycle = adjacency("networkx:cycle_graph", n)
        assert torch.equal(cycle, ring)
        assert torch.equal(mixing_matrix(cycle), mixing_matrix(ring))
    # a Watts-Strogatz graph that rewires nothing is the ring lattice: k=2 is the ring
    ws = adjacency("networkx:watts_strogatz_graph", 9, args={"k": 2, "p": 0.0})
    assert torch.equal(ws, adjacency("ring", 9))


def test_an_edge_list_file_gives_metropolis_weights_computed_by_hand(tmp_path):
    path = tmp_path / "graph.txt"
    # edges 0-1, 1-2, 1-3, 2-3; a comment, a weight column and a self-loop are ignored
    path.write_text("# four clients\n0 1\n1 2 0.5\n\n3 1\n2 3  # last edge\n2 2\n")
    W = mixing_matrix(adjacency(f"edgelist:{path}", 4))
    # degrees 1, 3, 2, 2; W_ij = 1 / (1 + max(d_i, d_j)) on edges, the rest on the diagonal
    q, t = F(1, 4), F(1, 3)
    expected = [
        [1 - q, q, 0, 0],
        [q, 1 - 3 * q, q, q],
        [0, q, 1 - q - t, t],
        [0, q, t, 1 - q - t],
    ]
    assert torch.allclose(W, torch.tensor([[float(x) for x in r] for r in expected]).double())


@pytest.mark.parametrize(
    "name,args",
    [
        ("networkx:watts_strogatz_graph", {"k": 4, "p": 0.3}),
        ("networkx:barabasi_albert_graph", {"m": 2}),
        ("networkx:random_regular_graph", {"d": 3}),
    ],
)
def test_networkx_graphs_give_a_symmetric_doubly_stochastic_w(name, args):
    adj = adjacency(name, 12, seed=3, args=args)
    W = mixing_matrix(adj)
    ones = torch.ones(12, dtype=torch.float64)
    assert torch.allclose(W.sum(0), ones) and torch.allclose(W.sum(1), ones)
    assert torch.equal(W, W.T) and bool((W >= 0).all())
    assert torch.equal(W.fill_diagonal_(0) > 0, adj)  # W follows the graph
    # n and the run's seed are filled in: the same seed gives the same graph, another not
    assert torch.equal(adj, adjacency(name, 12, seed=3, args=args))
    fn = getattr(nx, name.split(":")[1])
    graph = fn(**args, n=12, seed=3)
    assert torch.equal(adj, torch.from_numpy(nx.to_numpy_array(graph, range(12), dtype=bool)))


def test_grid_labels_are_mapped_in_sorted_order():
    adj = adjacency("networkx:grid_2d_graph", 6, args={"m": 2, "n": 3})
    # nodes (0,0) (0,1) (0,2) (1,0) (1,1) (1,2) -> 0..5
    assert adj.sum(1).tolist() == [2, 3, 2, 2, 3, 2]
    assert bool(adj[0, 1]) and bool(adj[0, 3]) and not bool(adj[0, 4])


@pytest.mark.parametrize(
    "name,n,args,words",
    [
        ("networkx:no_such_graph", 5, {}, ["no graph generator", "no_such_graph"]),
        ("networkx:Graph", 5, {}, ["no graph generator"]),  # a class, not a generator
        ("networkx:star_graph", 5, {}, ["has 6 nodes", "5 clients"]),
        ("networkx:empty_graph", 5, {}, ["disconnected", "5 components"]),
        ("networkx:watts_strogatz_graph", 8, {}, ["missing 2 required", "'k' and 'p'"]),
        ("networkx:cycle_graph", 8, {"q": 1}, ["unexpected keyword", "'q'"]),
    ],
)
def test_networkx_errors_are_one_line(name, n, args, words):
    with pytest.raises(ValueError) as err:
        adjacency(name, n, args=args)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize(
    "text,words",
    [
        ("0 1\n2 3\n", ["disconnected", "clients 2, 3 cannot reach client 0"]),
        ("0 1\n1 2\n", ["3 nodes", "4 clients", "clients 3 appear on no line"]),
        ("0 1\n1 2\n2 7\n", ["line 3", "node 7", "0..3"]),
        ("0 1\n1 x\n", ["line 2", "two client ids"]),
    ],
)
def test_edge_list_errors_are_one_line(tmp_path, text, words):
    path = tmp_path / "g.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        adjacency(f"edgelist:{path}", 4)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_config_takes_graph_args_and_gossip_reports_bad_graphs_as_config_errors(tmp_path):
    sets = [
        "algorithm.name=dfedavg",
        'algorithm.topology="networkx:watts_strogatz_graph"',
        "algorithm.graph_args={k = 4, p = 0.1}",
        "clients.models=lenet",
    ]
    hp = load_config(None, sets).hparams()
    assert hp.graph_args == {"k": 4, "p": 0.1}
    assert Gossip(hp, 10, seed=0).adj.sum(1).float().mean() == 4  # rewiring keeps the edges
    with pytest.raises(ConfigError, match=r"^algorithm.topology: .*has 11 nodes"):
        Gossip(GossipParams(topology="networkx:star_graph"), 10, seed=0)
    with pytest.raises(ConfigError, match="graph_args is for networkx"):
        load_config(None, [*sets[:1], "algorithm.topology=ring", sets[2]])
    with pytest.raises(ConfigError, match="no such edge-list file"):
        load_config(None, [sets[0], f'algorithm.topology="edgelist:{tmp_path / "none"}"'])
    with pytest.raises(ConfigError, match="did you mean dfedavg"):  # a mistyped method table
        load_config(None, [sets[0], "algorithm.dfedagv.topology=ring"])
