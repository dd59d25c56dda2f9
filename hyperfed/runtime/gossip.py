"""The communication graph of a decentralized run and its mixing matrices (seed 004, Alg. 1).

A method with ``kind="decentralized"`` has no server: the round driver
(:mod:`hyperfed.runtime.driver`) runs each active client's ``Client.fit``, validates the payload
it sends its neighbours, and hands every accepted active client ``mixed_i = sum_j W[i, j]
payload_j``, ``W`` the mixing matrix of the graph induced on the accepted active clients
(:func:`hyperfed.engine.topology.active_mixing`); ``Client.mix`` writes it into the client's
state. Inactive clients neither train, send nor receive.
"""

from __future__ import annotations

from torch import Tensor

from hyperfed.algorithms.base import Payload
from hyperfed.engine.topology import GossipParams, active_mixing, adjacency, spectral_gap
from hyperfed.errors import ConfigError


class Gossip:
    """The communication graph of a run and its per-round mixing matrices."""

    def __init__(self, hp: object, num_clients: int, seed: int) -> None:
        if not isinstance(hp, GossipParams):
            raise ConfigError(
                "algorithm: a decentralized algorithm's hyperparameters must extend "
                "GossipParams (topology, p, k, weights, resample)"
            )
        self.hp = hp
        self.n = num_clients
        self.seed = seed
        self.adj = self._adjacency(seed)

    def _adjacency(self, seed: int) -> Tensor:
        hp = self.hp
        try:
            return adjacency(hp.topology, self.n, p=hp.p, seed=seed, k=hp.k, args=hp.graph_args)
        except ValueError as e:  # a graph that cannot be built for this many clients
            msg = str(e)
            raise ConfigError(f"algorithm.topology: {msg.removeprefix('topology ')}") from None

    def graph(self, rnd: int) -> Tensor:
        """This round's graph: a fresh draw of a random / regular / networkx topology when
        resampling."""
        topology = self.hp.topology
        if self.hp.resample and (
            topology in ("random", "regular") or topology.startswith("networkx:")
        ):
            return self._adjacency(self.seed * 100_003 + rnd)
        return self.adj

    def mixing(self, rnd: int, active: list[int]) -> Tensor:
        """float64 ``[m, m]`` W over ``active`` (in that order)."""
        return active_mixing(self.graph(rnd), active, self.hp.weights)

    @staticmethod
    def mix(W: Tensor, payloads: Payload) -> Payload:
        """``sum_j W[i, j] payload_j`` for every key (a leading client axis on every tensor);
        ``W`` is ``[m, n]`` for ``n`` payloads (one row: a node mixing its neighbours')."""
        out = {}
        for k, v in payloads.items():
            flat = v.reshape(v.shape[0], -1)
            mixed = W.to(device=v.device, dtype=flat.dtype) @ flat
            out[k] = mixed.reshape(W.shape[0], *v.shape[1:])
        return out

    @staticmethod
    def spectral_gap(W: Tensor) -> float:
        return spectral_gap(W)
