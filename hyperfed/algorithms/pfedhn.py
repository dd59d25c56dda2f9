"""pFedHN (Shamsian et al., 2021), the baseline of seed 000.

One embedding vector per client, the shared MLP extractor, and a single output layer that
emits the whole parameter vector at once. For heterogeneous clients there is one output
layer per model size (seed 000 §4.3: "multiple heads"). It is the multi-head hypernetwork
with tau = 1 and N = K_i, so it reuses MH-pFedHN's server and client unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperfed.algorithms.base import Algorithm, paper
from hyperfed.algorithms.local_settings import SEED000
from hyperfed.algorithms.mh_pfedhn import MHPFedHNClient, MHPFedHNParams, MHPFedHNServer
from hyperfed.hparams import Count, Space


@dataclass
class PFedHNParams(MHPFedHNParams):
    """Same hypernetwork settings as MH-pFedHN (for a like-for-like comparison), one chunk."""

    out_dim: Count | None = paper(None, "pFedHN: one output of all K_i parameters")


ALGORITHM = Algorithm(
    name="pfedhn",
    summary="pFedHN: hypernetwork with one output layer per model size (Shamsian et al.)",
    hparams=PFedHNParams,
    server=MHPFedHNServer,
    client=MHPFedHNClient,
    local_defaults=SEED000,
    tune={"hn_lr": Space(1e-5, 1e-2, log=True)},
)
