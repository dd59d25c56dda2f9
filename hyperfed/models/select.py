"""Layer selectors: which entries of a model's flat parameter vector a method treats apart.

* :func:`norm_mask` -- the affine parameters of every normalization layer (FedBN, PartialFed);
* :func:`split_by_mask` -- a :class:`~hyperfed.models.split.BodyHead` view from such a mask
  (FedBN, FedRep, PartialFed);
* :func:`module_layers` -- the model's layers as ranges of theta (pFedLA, pFedLHN);
* :func:`select_names` -- parameter names by prefix or glob (MH-pFedHN's layer modes).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import Tensor, nn

from hyperfed.errors import ConfigError
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.split import BodyHead

# normalization layers whose affine parameters FedBN keeps on the client
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
)


def norm_mask(fm: FunctionalModel) -> Tensor:
    """Bool ``[K]``: True on the affine parameters of every normalization layer of ``fm``
    (found from the module tree and the parameter layout, not from naming conventions)."""
    names = set()
    for mod_name, mod in fm.module.named_modules():
        if isinstance(mod, NORM_LAYERS):
            for p_name, _ in mod.named_parameters(recurse=False):
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    mask = torch.zeros(fm.num_params, dtype=torch.bool)
    for seg in fm.layout.segments:
        if seg.name in names:
            mask[seg.offset : seg.end] = True
    return mask


def split_by_mask(mask: Tensor, device: torch.device | None = None) -> BodyHead:
    """A :class:`BodyHead` view whose ``head`` is the True entries of ``mask`` (the client's
    own part) and whose ``body`` is the rest (the shared part); either may be empty."""
    body_idx = torch.nonzero(~mask).squeeze(1)
    head_idx = torch.nonzero(mask).squeeze(1)
    order = torch.argsort(torch.cat([body_idx, head_idx]))
    dev = device or torch.device("cpu")
    return BodyHead(body_idx.to(dev), head_idx.to(dev), order.to(dev))


def module_layers(fm: FunctionalModel) -> list[list[tuple[int, int]]]:
    """The model's layers as lists of ``(start, end)`` ranges of theta: parameter tensors
    whose names share the module prefix (everything before the last '.') form one layer."""
    layers: dict[str, list[tuple[int, int]]] = {}
    for seg in fm.layout.segments:
        layers.setdefault(seg.name.rsplit(".", 1)[0], []).append((seg.offset, seg.end))
    return list(layers.values())


def select_names(fm: FunctionalModel, mode: str, client: int) -> list[str]:
    """The parameter names ``mode`` selects (MH-pFedHN's personal/frozen layer modes):
    comma-separated entries, each a name prefix (``"fc.2"``) or, with ``*``/``?``/``[``, a glob over names (``"*.bn*"``: every
    BatchNorm of a ResNet). An entry that names nothing in the client's model is an error."""
    names = fm.layout.names
    chosen_names: list[str] = []
    for entry in (e.strip() for e in mode.split(",")):
        if not entry:
            continue
        if any(ch in entry for ch in "*?["):
            hit = [n for n in names if fnmatchcase(n, entry) or fnmatchcase(n, entry + ".*")]
        else:
            hit = [n for n in names if n.startswith(entry)]
        if not hit:
            tops = sorted({n.rsplit(".", 1)[0] for n in names})
            raise ConfigError(
                f"layer mode {mode!r} of client {client}: {entry!r} names no parameter of its "
                f"model {fm.name} (layers: {', '.join(tops[:8])}{', ...' if len(tops) > 8 else ''})"
            )
        chosen_names += hit
    return chosen_names
