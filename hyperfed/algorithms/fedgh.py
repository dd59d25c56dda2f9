"""FedGH (Yi et al., ACM MM 2023; arXiv 2303.13137): a generalized global prediction header.

Every client k holds its own model ``F_k = h(f_k(x; w_k); theta)``: a heterogeneous feature
extractor ``f_k`` (any architecture whose representation has the common width d) and a
prediction header ``h``, one Linear(d, classes) layer that all clients share. Round t
(steps 1-4 of the paper's Figure 1; the paper's full text, and so its equation numbers, could not
be read here: the round is taken from its abstract and Figure 1's caption, the details from the
two codes, the authors' LipingYi/FedGH ``FedGH_mh.py`` and TsingZ0/HtFLlib ``servergh.py`` /
``clientgh.py``):

1. the server sends the global header ``theta^{t-1}``; the client *replaces* its local header
   by it (step 4 of round t-1, done when the header arrives);
2. the client trains its whole model (extractor and header) with ``CE(F_k(x), y)`` for E
   local epochs;
3. with the trained extractor (inference mode, one pass over its training split) it computes
   one *local averaged representation* (LAR) per class it holds,
   ``R_k^s = (1 / |D_k^s|) * sum_{(x, s) in D_k^s} f_k(x; w_k^t)``, and uploads the pairs
   ``(R_k^s, s)``;
4. the server trains the global header on the uploaded pairs, treating each LAR as one
   labelled sample: SGD steps ``theta <- theta - eta_theta * grad mean_batch CE(h(R; theta), s)``,
   ``server_epochs`` shuffled passes over the M pairs in batches of ``server_batch_size``
   (``server_epochs * ceil(M / server_batch_size)`` steps), and broadcasts it.

Payload up: ``proto_classes`` (int32 ``[S]``) and ``protos`` (``[S, d]``) for the S classes the
client holds (no sample counts: the server weights every LAR alike). Down: the header,
``classes * (d + 1)`` values. Heterogeneous clients need one representation width d, which the
server checks at join (LeNet, VGG8 and the MLP of the zoo all have d = 64).

Where the codes disagree (issue 35, item 7), and what is chosen:

* **How much the server trains the header** (``server_epochs``, ``server_batch_size``). The
  text says only that the server "trains" it on the LARs (Figure 1, step 3). LipingYi/FedGH
  loops once over the LARs, one (R, s) pair per step (1 epoch, batch 1, lr 1e-2; it also
  clips gradient norms at 50, and its loop steps the *client's* optimizer, so its header never
  moves); HtFLlib runs ``server_epochs=100`` shuffled epochs at its client batch size 10 with
  ``server_learning_rate=0.01``, about ten times more steps. Default: HtFLlib's 100 x 10,
  chosen on a validation split (val 0.889 vs 0.871 for 1 x 1, 3 seeds; docs/methods.md);
  1 x 1 is the authors' schedule. Both use plain SGD at
  lr 1e-2 (``server_lr``), as here. The pair order is shuffled each pass by a generator seeded
  by (run seed, round, pass), so a run is reproducible and resumes exactly.
* **Clipping the header step** (``server_clip``). LipingYi/FedGH clips the gradient norm at
  50, HtFLlib does not. Default: clip at 50 -- below it nothing changes (bit for bit), and it
  keeps one client whose local training exploded from wrecking the header every client gets
  (seen on 000:table2 at lr 0.05; docs/methods.md).
* **Which header a client is evaluated with** (``eval_header``). Figure 1's step 4 has the
  received global header replace the local one, so a client's model is its own extractor with
  the global header, and HtFLlib scores exactly that (``send_parameters`` sets the server head
  into every client before ``evaluate``): default ``"global"``. LipingYi/FedGH scores each
  client right after local training, i.e. with its locally trained header: ``"local"`` (the
  initial header for a client never sampled); records then say ``scores: local``.

This module also holds the pieces FedTGP shares with it (the representation width at join, the
count-free class payload and its check).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyperfed.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientGroup,
    Payload,
    PersonalModelClient,
    Server,
    ServerContext,
    chosen,
    paper,
)
from hyperfed.engine.local import client_seed
from hyperfed.engine.losses import class_means, pack_classes
from hyperfed.engine.representations import (
    KEYS,
    check_class_reply,
    common_width,
    minibatches,
    representation_join,
    uploaded_pairs,
    with_header,
)
from hyperfed.hparams import Count, Positive
from hyperfed.models.layout import FunctionalModel
from hyperfed.progress import phase

SERVER_EPOCHS, SERVER_BATCH = 100, 10  # HtFLlib's schedule; LipingYi/FedGH's is 1, 1
REFERENCE = (
    "HtFLlib (TsingZ0/HtFLlib servergh.py): server header 100 epochs x batch 10 at lr 0.01, "
    "chosen on validation; global header evaluated (paper Fig. 1 step 4). LipingYi/FedGH's "
    "1 x 1 schedule and local-header evaluation are options"
)


# -- shared with FedTGP: hyperfed.engine.representations --------------------------------------
def class_mean_reply(group: ClientGroup, theta: Tensor, buffers: Tensor) -> dict[str, Tensor]:
    """Per-class mean representation of each client's *trained* model on its training split
    (FedGH's LAR, FedTGP's client prototype), packed as ``proto_classes [C, S]`` and
    ``protos [C, S, d]`` (no counts; a client holding fewer classes pads with class -1)."""
    means, counts = class_means(
        group.fm, theta, buffers, group.data, group.client_ids, features=True
    )
    classes, values, _ = pack_classes(means, counts)
    return {KEYS[0]: classes, KEYS[1]: values}


# -- FedGH -----------------------------------------------------------------------------------
EvalHeader = Literal["global", "local"]
EVAL_HEADERS = get_args(EvalHeader)


@dataclass
class FedGHParams:
    """The server's header training (step 4) and the header a client is evaluated with; local
    training uses the ``[local]`` SGD settings."""

    server_lr: Positive = chosen(
        0.01,
        "eta_theta: both codes use 1e-2 (LipingYi/FedGH's SGD lr, HtFLlib's "
        "server_learning_rate); the paper's value could not be read here",
    )
    server_epochs: Count = chosen(
        SERVER_EPOCHS,
        "passes over the uploaded LARs per round: 1 (LipingYi/FedGH) or 100 (HtFLlib "
        "servergh.py); val 0.889 vs 0.871 for 1 x 1 (3 seeds; docs/methods.md)",
    )
    server_batch_size: Count = chosen(
        SERVER_BATCH,
        "LARs per server step: 1 (LipingYi/FedGH) or 10 (HtFLlib, its client batch size); "
        "chosen with server_epochs (docs/methods.md)",
    )
    server_clip: Positive = chosen(
        50.0,
        "the header step's gradient norm is clipped at this value, as LipingYi/FedGH does "
        "(clip_grad_norm_ 50; HtFLlib does not clip). Below it nothing changes; it keeps one "
        "client whose local training exploded from blowing up the header (docs/methods.md)",
    )
    eval_header: EvalHeader = paper(
        "global",
        "Figure 1 step 4: the received global header replaces the local one (as HtFLlib "
        "evaluates); 'local' = the locally trained header, as LipingYi/FedGH evaluates",
    )


class FedGHServer(Server):
    """Holds the global header h(.; theta) and trains it on the uploaded LARs."""

    def __init__(self, hp: FedGHParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.hp: FedGHParams = hp
        self.dim = common_width(clients, "fedgh")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            self.header = nn.Linear(self.dim, ctx.num_classes).to(ctx.device)

    def header_vector(self) -> Tensor:
        """theta as the clients' flat header entries: weight row-major, then bias."""
        w, b = self.header.weight.detach(), self.header.bias.detach()
        return torch.cat([w.reshape(-1), b])

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        header = self.header_vector()
        return {c: {"header": header} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        if self.hp.eval_header == "global":
            return self.configure_train(0, client_ids)
        return {c: {} for c in client_ids}  # "local": the client's own header, nothing crosses

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        return check_class_reply(reply, self.ctx.num_classes, self.dim)

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        """Step 4: ``server_epochs`` shuffled passes of SGD on ``CE(h(R_k^s; theta), s)`` over
        every uploaded (LAR, class) pair, ``server_batch_size`` pairs per step (the last batch
        of a pass may be short): ``server_epochs * ceil(M / server_batch_size)`` steps."""
        if not replies:
            return
        reps, labels = uploaded_pairs(replies)
        if reps.shape[0] == 0:
            return
        reps = reps.to(self.header.weight.dtype)
        onehot = F.one_hot(labels, self.ctx.num_classes).to(reps.dtype)
        with (
            torch.no_grad(),
            phase("server: training the global header", total=self.hp.server_epochs) as progress,
        ):
            for epoch in range(self.hp.server_epochs):
                seed = client_seed(self.ctx.seed, rnd, 0, salt=epoch)
                for b in minibatches(len(labels), self.hp.server_batch_size, seed, reps.device):
                    header_step(
                        self.header, reps[b], onehot[b], self.hp.server_lr, self.hp.server_clip
                    )
                progress.advance()


def header_step(
    header: nn.Linear, reps: Tensor, onehot: Tensor, lr: float, clip: float = math.inf
) -> None:
    """One SGD step of the Linear header on ``mean_batch CE(W R + b, s)``, in place, with the
    softmax-regression gradient written out (``err = (softmax(W R + b) - e_s) / n``,
    ``dW = err^T R``, ``db = sum err``): the same step as autograd + ``torch.optim.SGD``, faster
    on a CPU (100 x 10 server epochs are thousands of tiny steps a round). The
    gradient (dW, db) is scaled to norm ``clip`` when longer (``clip_grad_norm_``)."""
    err = torch.softmax(torch.addmm(header.bias, reps, header.weight.T), dim=1) - onehot
    err /= reps.shape[0]
    grad_w, grad_b = err.T @ reps, err.sum(0)
    norm = torch.sqrt(grad_w.square().sum() + grad_b.square().sum())
    scale = (clip / (norm + 1e-6)).clamp(max=1.0)
    header.weight.sub_(grad_w * scale, alpha=lr)
    header.bias.sub_(grad_b * scale, alpha=lr)


class FedGHClient(PersonalModelClient):
    hp: FedGHParams

    def __init__(self, hp: FedGHParams, ctx: ClientContext) -> None:
        super().__init__(hp, ctx)

    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        return representation_join(fm, num_samples, "fedgh")

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        # step 1: the global header replaces the local one; step 2: CE on the whole model
        theta = with_header(group.fm, state["theta"], msg["header"])
        theta, buffers, loss = group.train(theta, state["buffers"])
        # step 3: LARs of the trained extractor
        reply = class_mean_reply(group, theta, buffers)
        return reply, {"theta": theta, "buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """The client's own extractor with the global header (step 4; ``eval_header="global"``)
        or with its own header from its latest local training (``"local"``; the initial one
        for a client never sampled)."""
        if self.hp.eval_header == "local":
            return state["theta"], state["buffers"]
        return with_header(group.fm, state["theta"], msg["header"]), state["buffers"]


ALGORITHM = Algorithm(
    name="fedgh",
    summary="FedGH: heterogeneous extractors, a global header trained on the server from "
    "per-class mean representations",
    hparams=FedGHParams,
    server=FedGHServer,
    client=FedGHClient,
    # the official FedGH_mh.py: SGD lr 1e-2, momentum 0.9, weight decay 1e-3
    local_defaults={"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-3},
    reference=REFERENCE,
    scores=lambda hp: "personalized" if hp.eval_header == "global" else "local",
)
