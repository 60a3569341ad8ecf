"""What decoding algorithms may see of a backbone: the token-grid layout and a small protocol per family (discrete
here; continuous in `backbones.continuous`, re-exported at the end)."""
from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class TokenGrid:
    """Where image tokens sit in the sequence.

    Layout: [prompt slot (prefix_len tokens, ending with begin-of-image)] then H rows of W visual
    tokens, each row followed by an end-of-row token when `eol_id` is set (Emu3/Lumina style; row
    stride W+1) or not (Janus style; stride W), then end-of-image.
    """

    height: int
    width: int
    prefix_len: int               # tokens before the first visual token (prompt slot + BOI)
    visual_start: int             # first visual id in the vocabulary
    num_visual: int               # visual ids are [visual_start, visual_start + num_visual)
    eol_id: int | None = None     # end-of-row token, forced after each row
    eoi_id: int | None = None     # end-of-image token, forced after the last row

    @property
    def stride(self) -> int:
        """Sequence distance between vertically adjacent visual tokens."""
        return self.width + (1 if self.eol_id is not None else 0)

    @property
    def num_visual_tokens(self) -> int:
        return self.height * self.width

    @property
    def seq_len(self) -> int:
        """Whole sequence length, end-of-image included."""
        return self.prefix_len + self.height * self.stride + (1 if self.eoi_id is not None else 0)

    def position(self, row: int | torch.Tensor, col: int | torch.Tensor):
        """Flat sequence position of visual token (row, col)."""
        return self.prefix_len + row * self.stride + col

    def row_col(self, position: int | torch.Tensor):
        """Inverse of `position` for visual positions."""
        off = position - self.prefix_len
        return off // self.stride, off % self.stride

    def grid_to_sequence(self, codes: torch.Tensor) -> torch.Tensor:
        """Visual codes (B, H, W) in [0, num_visual) -> image part of the sequence (B, H*stride [+1]) of vocab ids."""
        ids = codes + self.visual_start
        if self.eol_id is not None:
            eol = torch.full_like(ids[:, :, :1], self.eol_id)
            ids = torch.cat([ids, eol], dim=2)
        ids = ids.flatten(1)
        if self.eoi_id is not None:
            ids = torch.cat([ids, torch.full_like(ids[:, :1], self.eoi_id)], dim=1)
        return ids

    def sequence_to_grid(self, image_ids: torch.Tensor) -> torch.Tensor:
        """Inverse of `grid_to_sequence`: (B, >= H*stride) vocab ids -> codes (B, H, W)."""
        rows = image_ids[:, : self.height * self.stride].view(-1, self.height, self.stride)
        return rows[:, :, : self.width] - self.visual_start


@runtime_checkable
class DiscreteBackbone(Protocol):
    """A frozen discrete-token AR image model, as decoding algorithms see it.

    `forward_hidden` appends to `cache` and returns the last layer's hidden state BEFORE the final
    norm; `head` applies the final norm and the output projection. Positions are explicit so that
    non-contiguous sets of positions can be fed (with a 4-D additive mask where needed).
    """

    grid: TokenGrid
    hidden_size: int

    def prompt_ids(self, prompts: list[str]) -> torch.Tensor: ...          # (B, prefix_len) conditional
    def null_prompt_ids(self, batch: int) -> torch.Tensor: ...             # (B, prefix_len) unconditional
    def new_cache(self): ...
    def forward_hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache=None,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor: ...  # (B, q, D)
    def head(self, hidden: torch.Tensor) -> torch.Tensor: ...              # (B, q, V) logits
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...                # (B, q) -> (B, q, D)
    def rollback(self, cache, length: int) -> None: ...
    def decode(self, codes: torch.Tensor) -> torch.Tensor: ...             # (B, H, W) -> (B, 3, S, S) in [0, 1]


# ---- continuous backbones (MAR, xAR, Harmon): defined in backbones.continuous -------------------------------
from specgen.backbones.continuous import ContinuousBackbone  # noqa: E402,F401  (one import path for both families)
