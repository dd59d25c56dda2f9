"""pFedLHN (Zhu, Liu and Sun, Neural Processing Letters 55(9), 2023, "Layer-wise personalized
federated learning with hypernetwork"): a server hypernetwork that generates every layer of a
client's model with its own layer-wise module, on top of a shared extractor. A baseline of
seed 000 (Tables 1-2, [52]) and seed 003 (Tables 1-2, 5).

Hypernetwork. Client i has an embedding v_i; layer l has an embedding u_l and a layer-wise
module (an output layer ``W_l, b_l``); the MLP extractor f is shared by every layer and client
(the paper's "parameter sharing mechanism"):

    theta_i^l = W_l f(v_i + u_l) + b_l,      theta_i = concat_l theta_i^l,

so each layer is generated independently from the client's descriptor. Round t (as pFedHN):
the server sends theta_i; client i trains it for E epochs and returns
``Delta theta_i = theta~_i - theta_i``; the server back-propagates ``-Delta theta_i`` through
theta_i (the generated model moves toward the trained one) and takes one Adam step on the
mean over the round's clients for phi = (f, W_l, b_l, u_l) and the v_i. Clients are evaluated
with the generated theta_i.

Heterogeneous clients (seed 000 §4.3: "we modify them by adding multiple heads"): a client
sends the sizes of its layers at join; a layer-wise module (and its u_l) is shared by the
clients whose layer l has the same size, so clients of one architecture share all of them and
another architecture gets its own modules where its layers differ. The server thus learns a
client's layer sizes (a layer-wise generator cannot do without them), never its layer types.

This is written from the paper's abstract and the seeds' description; its full text was not
reachable for this port. Choices made here: a "layer" is a module (weight and bias together,
:func:`hyperfed.models.select.module_layers`); the client and layer embeddings are added
(one extractor input of ``embed_dim``); the extractor, the heads and the per-layer embeddings
are those of :class:`hyperfed.hypernet.multihead.MultiHeadHypernet` (one slot per layer
module, a head of its own each, one chunk of its size), composed here with the client
embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hyperfed.algorithms.base import (
    Algorithm,
    Payload,
    Server,
    ServerContext,
    chosen,
)
from hyperfed.algorithms.pfedla import UpdateClient
from hyperfed.engine.optim import adam
from hyperfed.hparams import Count, Positive, Space
from hyperfed.hypernet.multihead import MultiHeadHypernet
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.select import module_layers


@dataclass
class PFedLHNParams:
    hn_lr: Positive = chosen(3e-4, "seed 003 App. D, the hypernetwork lr its pFedLHN runs used")
    embed_dim: Count = chosen(64, "MH-pFedHN's (seed 000 §4.1), for a like-for-like baseline")
    hidden: Count = chosen(100, "MH-pFedHN's / pFedHN's extractor width (seed 000 §4.1)")
    n_layers: Count = chosen(3, "MH-pFedHN's extractor depth (seed 000 App. D.3)")


class LayerwiseHypernet(nn.Module):
    """``theta_i = concat_l W_l f(v_i + u_l) + b_l`` for clients whose layer sizes are
    ``layers[i]``; layer modules are keyed by (position, size)."""

    def __init__(self, layers: dict[int, list[int]], hp: PFedLHNParams) -> None:
        super().__init__()
        self.sizes = {c: sum(sizes) for c, sizes in layers.items()}
        slot_of: dict[tuple[int, int], int] = {}
        self.slots: dict[int, list[int]] = {}  # client -> its layers' slots, in theta's order
        for c in sorted(layers):
            self.slots[c] = [
                slot_of.setdefault((l, k), len(slot_of)) for l, k in enumerate(layers[c])
            ]
        # one MultiHeadHypernet slot per layer module: its embedding is u_l, its head (W_l,
        # b_l), its chunk the whole layer; the extractor f is shared by all of them
        self.hnet = MultiHeadHypernet(
            {s: k for (_, k), s in slot_of.items()},
            embed_dim=hp.embed_dim,
            hidden=hp.hidden,
            n_layers=hp.n_layers,
            out_dim=None,
            heads="per_client",
        )
        self.clients = nn.ParameterDict(
            {str(c): nn.Parameter(torch.randn(hp.embed_dim)) for c in sorted(layers)}
        )

    def generate(self, clients: list[int]) -> dict[int, Tensor]:
        """theta_i for each client, every layer module run once for all its clients."""
        pieces: dict[tuple[int, int], Tensor] = {}
        users: dict[int, list[int]] = {}
        for c in clients:
            for s in self.slots[c]:
                users.setdefault(s, []).append(c)
        for s, members in users.items():
            v = torch.stack([self.clients[str(c)] for c in members])  # [C, e]
            u = self.hnet.embeddings[str(s)]  # [1, e]
            codes = self.hnet.extractor(v[:, None, :] + u)  # [C, 1, hidden]
            out = self.hnet.heads[self.hnet.key[s]](codes)[:, 0]  # [C, K_l]
            for i, c in enumerate(members):
                pieces[(c, s)] = out[i]
        return {c: torch.cat([pieces[(c, s)] for s in self.slots[c]]) for c in clients}


class PFedLHNServer(Server):
    def __init__(self, hp: PFedLHNParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        layers = {c: [int(k) for k in p["layer_sizes"]] for c, p in clients.items()}
        for c, p in clients.items():
            if sum(layers[c]) != int(p["num_params"]):
                raise ValueError(f"client {c}: layer sizes do not add up to its num_params")
        torch.manual_seed(ctx.seed)
        self.hnet = LayerwiseHypernet(layers, hp).to(ctx.device)
        self.opt: torch.optim.Optimizer = adam(self.hnet.parameters(), hp.hn_lr)

    @torch.no_grad()
    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        thetas = self.hnet.generate(list(client_ids))
        return {c: {"theta": thetas[c]} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return self.configure_train(0, client_ids)

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"delta": (self.hnet.sizes[client_id],)}

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if not replies:
            return
        ids = sorted(replies)
        thetas = self.hnet.generate(ids)
        self.opt.zero_grad(set_to_none=True)
        # -Delta theta_i / |S_t|: one step on the round's mean; theta_i moves toward theta~_i
        torch.autograd.backward(
            [thetas[c] for c in ids], [-replies[c]["delta"] / len(ids) for c in ids]
        )
        self.opt.step()


class PFedLHNClient(UpdateClient):
    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        """K_i, m_i and the size of each layer (module) of the client's model, in order."""
        sizes = [sum(end - start for start, end in ranges) for ranges in module_layers(fm)]
        return {**super().join(fm, num_samples), "layer_sizes": torch.tensor(sizes)}


ALGORITHM = Algorithm(
    name="pfedlhn",
    summary="pFedLHN: layer-wise hypernetwork modules over a shared extractor (Zhu et al.)",
    hparams=PFedLHNParams,
    server=PFedLHNServer,
    client=PFedLHNClient,
    # seed 003 (Training Strategies; App. D): pFedLHN ran 1 local epoch, lr 1e-3, wd 1e-4
    local_defaults={"lr": 1e-3, "momentum": 0.9, "weight_decay": 1e-4, "epochs": 1},
    tune={"hn_lr": Space(1e-5, 1e-2, log=True)},  # the hypernetwork lr, as pFedHN's
)
