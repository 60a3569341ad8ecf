"""1D multi-token heads (Medusa-style): from the pre-norm state h_q alone, head k predicts the
pre-norm state k positions ahead (h_{q+k}), decoded by the backbone's own final norm and head, so
h_q drafts the tokens at q+2 ... q+K+1 in raster order. Trained by the same distillation module as f_phi.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from specgen.drafters.fphi import _Block


class MTPHeads(nn.Module):
    """Heads predicting the pre-norm states 1..K positions ahead (`drafters.protocol.Drafter`)."""

    predicts = "hidden"
    left_context, left_tokens = False, 0

    def __init__(self, hidden_size: int, num_heads: int = 4, blocks: int = 1, backbone_id: str = ""):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self.hidden_size, self.num_heads, self.backbone_id = hidden_size, num_heads, backbone_id
        self.directions = tuple(f"ahead_{k}" for k in range(1, num_heads + 1))
        self.in_norm = nn.LayerNorm(hidden_size)
        self.nets = nn.ModuleDict({
            d: nn.Sequential(nn.Linear(hidden_size, hidden_size), *[_Block(hidden_size) for _ in range(blocks)],
                             nn.LayerNorm(hidden_size), nn.Linear(hidden_size, hidden_size))
            for d in self.directions})
        for net in self.nets.values():  # start as the identity map, like f_phi
            nn.init.zeros_(net[-1].weight)
            nn.init.zeros_(net[-1].bias)

    def forward(self, hidden: torch.Tensor, next_embed: torch.Tensor | None, direction: str) -> torch.Tensor:
        """(..., D) state at q -> (..., D) predicted state at q + k (`direction` = 'ahead_k'); the embedding is unused."""
        if direction not in self.nets:
            raise ValueError(f"these heads predict {self.directions}, not {direction!r}")
        return hidden + self.nets[direction](self.in_norm(hidden))

    def ahead(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        return self(hidden, None, f"ahead_{k}")
