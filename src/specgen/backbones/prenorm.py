"""The pre-norm last hidden state of any transformers decoder with a final RMSNorm, implemented once.

SSD's f_phi predicts the last layer's state BEFORE the final norm, but a transformers decoder returns it after
(`last_hidden_state` and `hidden_states[-1]` are both post-norm). `split_final_norm` takes the norm out of the
decoder (its forward then returns pre-norm states) and hands it back, to be applied before the head.
"""
from __future__ import annotations

import torch.nn as nn


def split_final_norm(decoder: nn.Module, attr: str = "norm") -> nn.Module:
    """Replace `decoder.<attr>` (its final norm) by identity and return the norm itself."""
    norm = getattr(decoder, attr, None)
    if norm is None or isinstance(norm, nn.Identity):
        raise ValueError(f"{type(decoder).__name__} has no final norm at .{attr} (found {type(norm).__name__}): "
                         f"give the attribute name of its last norm, or the norm was split off already")
    if not hasattr(norm, "weight"):
        raise ValueError(f"{type(decoder).__name__}.{attr} is a {type(norm).__name__}, not a norm with weights")
    setattr(decoder, attr, nn.Identity())
    return norm
