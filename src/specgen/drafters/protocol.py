"""What a decoder reads from a drafter, in one place: the attributes every drafter of this package carries, and the
checks that a drafter fits the backbone it serves (width, weights, directions) and runs on its device and dtype."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specgen.backbones.protocol import DiscreteBackbone, weights_part

ATTRIBUTES = ("hidden_size", "backbone_id", "directions", "predicts", "left_context", "left_tokens")


@runtime_checkable
class Drafter(Protocol):
    """A drafter of a frozen backbone.

    hidden_size: the width of the backbone states it reads; backbone_id: the weights it was distilled from ("" when
    unknown); directions: the offsets it predicts ("right", "down"; 1D heads: "ahead_k"); predicts: "hidden" (a
    pre-norm state, decoded by the backbone's own head) or "tokens" (visual-code logits); left_context: whether its
    down direction also reads the tokens before the drafted one in its own row, and left_tokens how many of them."""

    hidden_size: int
    backbone_id: str
    directions: tuple[str, ...]
    predicts: str
    left_context: bool
    left_tokens: int


def check_protocol(drafter) -> None:
    """A clear error for an object that is not a drafter (it lacks attributes of `Drafter`)."""
    missing = [a for a in ATTRIBUTES if not hasattr(drafter, a)]
    if missing:
        raise TypeError(f"{type(drafter).__name__} is not a drafter: it has no {', '.join(missing)} "
                        f"(see specgen.drafters.protocol.Drafter); load one with specgen.api.load_drafter")
    if drafter.predicts not in ("hidden", "tokens"):
        raise ValueError(f"drafter.predicts={drafter.predicts!r}: expected 'hidden' or 'tokens'")


def check_drafter(backbone: DiscreteBackbone, drafter: Drafter, needs: tuple[str, ...] = ()) -> None:
    """A drafter must fit the backbone it serves: same width, distilled from the same weights (hence the
    same token layout and row stride), and it must predict the offsets the decoder asks for. Errors name the
    drafter's kind and the experiment that distils the right one."""
    check_protocol(drafter)
    have = drafter.directions
    if have and all(d.startswith("ahead_") for d in have):
        kind, experiment = "an MTP checkpoint (1D multi-token heads)", "train/mtp_shapes"
    elif drafter.predicts == "tokens":
        kind, experiment = "a token-id drafter (the f_phi ablation)", "train/fphi_tokens_shapes"
    else:
        kind, experiment = "an f_phi (SSD) drafter", "train/fphi_shapes"
    retrain = f"python -m specgen.train experiment={experiment} data.backbone_dir=<backbone folder>"
    if drafter.hidden_size != backbone.hidden_size:
        raise ValueError(f"the drafter ({kind}) works on hidden states of width {drafter.hidden_size} but the "
                         f"backbone's are {backbone.hidden_size}: distil one for this backbone ({retrain})")
    trained_on, using = drafter.backbone_id, weights_part(backbone.identity)
    if trained_on and using and using != trained_on:
        raise ValueError(f"the drafter ({kind}) was distilled from backbone weights {trained_on!r} but the backbone "
                         f"in use is {using!r} (another model, or another row layout): distil it again "
                         f"on this backbone ({retrain})")
    missing = [d for d in needs if d not in have]
    if not missing:
        return
    if experiment == "train/mtp_shapes":  # 1D heads where SSD's right/down drafter belongs
        raise ValueError(f"the drafter is {kind}, predicting {list(have)}, not an SSD drafter: decode with it "
                         f"as decoding=mtp1d, or give this decoder an f_phi folder (checkpoints/fphi_shapes; "
                         f"python -m specgen.train experiment=train/fphi_shapes)")
    if all(d.startswith("ahead_") for d in needs):  # an SSD drafter where multi-token heads belong
        raise ValueError(f"the drafter is {kind}, predicting {list(have)}, not multi-token heads: decode with it "
                         f"as decoding=ssd, or give decoding=mtp1d an MTP folder (checkpoints/mtp_shapes; "
                         f"python -m specgen.train experiment=train/mtp_shapes)")
    raise ValueError(f"this decoder drafts {list(needs)} but the drafter predicts only {list(have)}: "
                     f"use a drafter with directions {list(needs)} or the horizontal-only mode (vertical=false)")


def fit_drafter(backbone: DiscreteBackbone, drafter: Drafter) -> Drafter:
    """The drafter on the backbone's device and in its dtype (a drafter loads on CPU in fp32; a real backbone runs
    in bf16 on a GPU). A no-op where they already agree."""
    param = next(iter(drafter.parameters()), None) if isinstance(drafter, torch.nn.Module) else None
    if param is not None and (param.device != backbone.device or param.dtype != backbone.dtype):
        drafter.to(device=backbone.device, dtype=backbone.dtype)
    return drafter
