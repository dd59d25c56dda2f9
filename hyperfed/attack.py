"""Seed 000's iDLG experiment (Appendix C.8, Fig. 6): invert what one client uploads.

An app (``hyperfed attack``): it runs a :class:`~hyperfed.runtime.simulate.Simulation` and
asks its round driver for the attacked client's exchange
(:meth:`~hyperfed.runtime.driver.RoundDriver.train_exchange`: the reply validated as in every
round); the inversion itself is :mod:`hyperfed.privacy.inversion`.

The server is the attacker. In round ``R`` it sends client ``c`` its model, as the method
does, and receives the client's reply. Two kinds of target are inverted with
:func:`~hyperfed.privacy.inversion.invert_gradient`:

* **one image's gradient** (the control): ``dCE / dtheta`` of a single training image at the
  model the server sent -- what a client would leak if it uploaded one step's gradient on a
  batch of one (FedSGD). This shows what the attack can do against this model.
* **the actual upload**: every model update in the reply (``delta``; MH-pFedHNG(D)'s
  ``global_delta``; the returned ``theta`` minus the sent one for FedAvg, Ditto, pFedKT),
  read as the attacker would, as the mean gradient of one local step,
  ``-update / (lr * steps)``. (A pFedKT client starts from the model its own hypernetwork
  generates, which the server never sees; the server can only use the model it sent.)
  The client took E epochs of batch-B steps, so no single image produced it; the
  reconstruction is scored against the client's training image it resembles most (the
  attacker's best case).
* **the distilled set** (MH-pFedHNDD and its plug-ins): the server receives every client's
  synthetic images in the setup exchange; nothing is inverted, the synthetic image closest
  to one of the client's training images is scored (its label is the one the client gave),
  and the row counts the synthetic images that are copies (>= 50 dB) of any client's
  training image.

Images are compared in pixel space ([0, 1]) by PSNR, and two guesses that use no upload are
scored the same way (against the true image for a gradient, the best-matching training image
for an upload): ``chance``, the random starting point, and ``mean_image``, the mean of the
client's training images -- what an attacker who knew only the client's data distribution
would draw. A reconstruction below ``mean_image`` shows the kind of data, not an image.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hyperfed.config import ExperimentConfig, to_toml
from hyperfed.engine.codec import decode_update
from hyperfed.errors import HyperfedError
from hyperfed.models.layout import FunctionalModel
from hyperfed.privacy.inversion import (
    Inversion,
    invert_gradient,
    model_gradient,
    psnr,
    psnr_of_mse,
    starting_point,
)
from hyperfed.runtime.simulate import Simulation


class AttackError(HyperfedError, ValueError):
    """The experiment cannot run as configured (one line, for the CLI)."""


@dataclass
class AttackRow:
    target: str  # "image 3 gradient" / "upload delta"
    true_label: int | None  # None for an upload: it mixes many samples
    label: int  # the label iDLG inferred
    psnr: float  # reconstruction vs the (true / nearest) training image, dB
    chance: float  # the random starting point, scored the same way, dB
    mean_image: float  # the client's mean training image, scored the same way, dB
    distance: float  # final gradient distance
    compared_to: int  # index of that image in the client's training split
    reconstruction: Tensor = field(repr=False)  # [C, H, W] in [0, 1]
    original: Tensor = field(repr=False)


@dataclass
class AttackReport:
    algorithm: str
    dataset: str
    model: str
    client: int
    round: int
    local_steps: int
    distance: str
    iters: int
    rows: list[AttackRow]

    def to_json(self) -> dict[str, Any]:
        skip = {"reconstruction", "original"}
        rows = [{k: v for k, v in asdict(r).items() if k not in skip} for r in self.rows]
        head = {k: v for k, v in asdict(self).items() if k != "rows"}
        return {**head, "rows": rows}


def uploaded_updates(
    declared: dict[str, str], msg: dict[str, Tensor], reply: dict[str, Tensor]
) -> dict[str, str]:
    """``{reply key: message key}`` of the model updates in ``reply``, as the server role
    declares them (``Server.model_updates``; a pruned update arrives as ``<key>_idx``)."""
    return {
        key: sent
        for key, sent in declared.items()
        if (key in reply or f"{key}_idx" in reply)
        and sent in msg
        and (key != sent or reply[key].shape == msg[sent].shape)
    }


def run_attack(
    cfg: ExperimentConfig,
    *,
    client: int = 0,
    images: int = 4,
    round_: int = 1,
    distance: str = "cosine",
    iters: int = 500,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> AttackReport:
    """Run rounds ``1 .. round_ - 1`` as the method does, then attack client ``client``'s
    round-``round_`` upload and ``images`` of its training images' gradients.

    ``progress(label, total)`` returns a callback advanced once per step (a progress bar)."""
    if not 0 <= client < cfg.clients.count:
        raise AttackError(f"--client {client}: there are {cfg.clients.count} clients (0..)")
    if images < 0 or round_ < 1 or iters < 1:
        raise AttackError("--images must be >= 0, --round and --iters >= 1")
    sim = Simulation(cfg)
    if sim.gossip is not None:
        raise AttackError(f"{cfg.algorithm.name} is decentralized: there is no server to attack")
    if len(sim.data.input_shape) != 3 or not sim.data.mean.numel():
        raise AttackError(f"the attack compares images; {cfg.dataset.name} inputs are vectors")
    tick = progress or (lambda label, total: lambda: None)
    sim.run_setup()
    if round_ > 1:
        advance = tick(f"rounds 1-{round_ - 1}", round_ - 1)
        for rnd in range(1, round_):
            sim.run_round(rnd)
            advance()

    state = dict(sim.store[client])  # what the client held before this round
    # the round's exchange with this client alone, validated as in every round (not aggregated)
    exchange = sim.driver.train_exchange(round_, [client])
    msg = exchange.msgs[client]
    if client not in exchange.accepted:
        raise AttackError(
            f"client {client}'s round-{round_} reply was rejected by the server's validation "
            "(see the warning above); there is no upload to attack"
        )
    reply = exchange.accepted[client]
    updates = uploaded_updates(sim.server.model_updates(), msg, reply)
    if not updates:
        raise AttackError(
            f"{cfg.algorithm.name} uploads no model update this attack can read (reply keys: "
            f"{sorted(reply)}); it reads what a method declares in Server.model_updates "
            "(the mh_pfedhn* family, pfedhn, fedavg and the methods built on its server)"
        )
    arch = sim.arch_of[client]
    group = sim.group(arch, [client], round_)
    steps = group.plan().counts[0]
    data = sim.data
    train_x, train_y = data.batch(data.train_idx[client])
    pixels = data.pixels
    train_px = pixels(train_x)
    start = pixels(starting_point(data.input_shape, cfg.seed).to(train_x))[0]
    mean_px = train_px.mean(0)

    def nearest(img: Tensor) -> tuple[float, int]:
        scores, index = best_match(img.unsqueeze(0), train_px)
        return scores[0], index[0]

    def invert(
        fm: FunctionalModel, theta: Tensor, buffers: Tensor, target: Tensor, label: str
    ) -> Inversion:
        return invert_gradient(
            fm,
            theta,
            buffers,
            target,
            data.input_shape,
            data.num_classes,
            distance=distance,
            iters=iters,
            seed=cfg.seed,
            progress=tick(label, iters),
        )

    rows = []
    fm, theta, buffers = sim.models[arch], msg["theta"], state["buffers"]
    for i in range(min(images, len(train_x))):
        grad = model_gradient(fm, theta, buffers, train_x[i : i + 1], train_y[i : i + 1])
        inv = invert(fm, theta, buffers, grad, f"image {i} gradient")
        rec = pixels(inv.x)[0]
        rows.append(
            AttackRow(
                f"image {i} gradient",
                int(train_y[i]),
                inv.label,
                psnr(rec, train_px[i]),
                psnr(start, train_px[i]),
                psnr(mean_px, train_px[i]),
                inv.distance,
                i,
                rec.cpu(),
                train_px[i].cpu(),
            )
        )
    lr = sim.sgd.lr
    for key, sent in updates.items():
        model, buffers = sim.models[arch], state["buffers"]
        if sent == "global":  # MH-pFedHNG(D)'s global model, which every client also holds
            model = sim.client.global_fm  # type: ignore[attr-defined]
            buffers = state["global_buffers"]
        theta = msg[sent]
        if key == "theta":
            update = reply["theta"] - theta
        else:
            update = decode_update(reply, key, theta.shape[-1])
        target = -update / (lr * steps)  # the mean gradient of one local step
        inv = invert(model, theta, buffers, target, f"upload {key}")
        rec = pixels(inv.x)[0]
        score, j = nearest(rec)
        rows.append(
            AttackRow(
                f"upload {key}",
                None,
                inv.label,
                score,
                nearest(start)[0],
                nearest(mean_px)[0],
                inv.distance,
                j,
                rec.cpu(),
                train_px[j].cpu(),
            )
        )
    synthetic = sim.server.shared_synthetic()  # the data-distillation methods' merged S
    if synthetic is not None and synthetic[0].shape[0]:
        syn_x, syn_y = synthetic
        # no inversion needed: the server holds the clients' synthetic images themselves
        syn_px = pixels(syn_x)
        scores, index = best_match(syn_px, train_px)
        k = max(range(len(scores)), key=scores.__getitem__)
        score, j = scores[k], index[k]
        everyone = pixels(data.features(torch.cat(data.train_idx)))  # all clients' images
        copies = sum(c >= COPY_PSNR for c in best_match(syn_px, everyone)[0])
        rows.append(
            AttackRow(
                f"synthetic set ({syn_x.shape[0]} images, {copies} copies)",
                None,
                int(syn_y[k]),
                score,
                nearest(start)[0],
                nearest(mean_px)[0],
                0.0,
                j,
                pixels(syn_x[k : k + 1])[0].cpu(),
                train_px[j].cpu(),
            )
        )
    return AttackReport(
        cfg.algorithm.name,
        cfg.dataset.name,
        arch,
        client,
        round_,
        steps,
        distance,
        iters,
        rows,
    )


COPY_PSNR = 50.0  # dB: above this a synthetic image counts as a copy of a training image


def best_match(images: Tensor, references: Tensor) -> tuple[list[float], list[int]]:
    """For each of ``images`` ``[M, ...]``: its PSNR against the closest of ``references``
    ``[N, ...]`` and that reference's index."""
    exact = "donot_use_mm_for_euclid_dist"  # the matmul form is not 0 for equal images
    dist = torch.cdist(images.flatten(1), references.flatten(1), compute_mode=exact)
    mse, index = (dist.pow(2) / images[0].numel()).min(dim=1)
    return [psnr_of_mse(float(m)) for m in mse], [int(i) for i in index]


def save_report(report: AttackReport, out: Path, cfg: ExperimentConfig) -> list[Path]:
    """``config.toml`` (the resolved experiment), ``attack.json`` and ``attack.png`` (top:
    the image each reconstruction is compared to; bottom: the reconstruction) in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(to_toml(cfg))
    (out / "attack.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    n = len(report.rows)
    fig, axes = plt.subplots(2, n, figsize=(2.0 * n, 4.4), squeeze=False)
    for j, row in enumerate(report.rows):
        for i, img in enumerate((row.original, row.reconstruction)):
            ax = axes[i][j]
            pic = img.permute(1, 2, 0).numpy()
            ax.imshow(pic[..., 0] if pic.shape[-1] == 1 else pic, cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[0][j].set_title(row.target, fontsize=9)
        axes[1][j].set_xlabel(f"{row.psnr:.1f} dB (mean image {row.mean_image:.1f})", fontsize=8)
    axes[0][0].set_ylabel("training image")
    axes[1][0].set_ylabel("reconstruction")
    fig.suptitle(
        f"gradient inversion ({report.distance}) of client {report.client}, "
        f"{report.algorithm}, round {report.round}, {report.local_steps} local steps",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / "attack.png", dpi=110)
    plt.close(fig)
    return [out / "config.toml", out / "attack.json", out / "attack.png"]
