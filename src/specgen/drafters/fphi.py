"""f_phi: the SSD drafter. From the backbone's pre-norm hidden state h_q at position q and the
embedding of the token x_{q+1} that h_q predicted, it predicts the pre-norm hidden state one step
right (h_{q+1}) and one row down (h_{q+S}, S the row stride). Predictions go through the
backbone's own final norm and head, so f_phi never owns an output layer.

By default each direction is a point-wise residual MLP (the paper's lightweight head). With
`context_kernel=k` the down direction also mixes each column with its k - 1 neighbours along the row
above (a 1-D convolution before each residual block), so that the down draft of column c sees the
row above around c, the diagonal neighbours included (EAGLE-style context); the down input is then a
whole row (..., W, D), as SSD drafts it. With `left_context=True` the down draft of column c also sees
the token before it in the sequence (its left neighbour in the row being drafted, the end-of-row or the
previous row's last token for column 0): the row is then drafted left to right, each column from the
draft of the one before, so that a row's drafts agree with each other as the target judges them (it
verifies column c given the drafted c - 1). The row trunk runs once per row; only a small head runs per
column (`down_trunk`, `down_column`). `left_tokens=k` widens that to the k tokens before the drafted one (one
linear map per distance, so a decoder looks each up in a table per distance), and `down_extra_blocks=n` deepens the
row trunk by n residual blocks (with the row mixers); both start at zero, so a drafter grown from a trained one
(`init_strict=false`) starts as that drafter. The trunk runs once per row, so its depth costs little when decoding.
`down_attention=n` puts n pre-norm self-attention blocks (EAGLE-style: every column of the row above attends to all
of them, with a sinusoidal column position term) into the row trunk after its input layer; their output projections
start at zero, so they too grow a trained drafter without changing it at step 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from specgen.backbones.protocol import float_logits

PRESETS = {  # name -> (width multiplier of the backbone's hidden size, residual MLP blocks)
    "xs": (1, 1),
    "s": (1, 2),
    "m": (2, 2),
    "l": (2, 4),
}
DIRECTIONS = ("right", "down")


class _RowMixer(nn.Module):
    """Residual 1-D convolution along the row axis: (..., W, C) -> (..., W, C). Zero-initialised, so a
    net with mixers starts as the same net without them (a point-wise f_phi can be fine-tuned into one)."""

    def __init__(self, width: int, kernel: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, kernel, padding=kernel // 2)  # zero padding past the row's ends
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, x):
        """The convolution as one matmul over each position's k-neighbourhood (the same weights: `nn.Conv1d` keeps
        them for checkpoints; on a CPU a row of 16 positions runs about a third faster this way)."""
        F, k = torch.nn.functional, self.conv.kernel_size[0]
        y = F.pad(self.norm(x), (0, 0, k // 2, k // 2))  # (..., W + k - 1, C): zeros past the row's ends
        cols = y.unfold(-2, k, 1).flatten(-2)  # (..., W, C * k), channel-major as the conv's weight
        return x + F.silu(F.linear(cols, self.conv.weight.flatten(1), self.conv.bias))


def column_positions(width: int, channels: int, device=None, dtype=None) -> torch.Tensor:
    """(width, channels) sinusoidal position code of the columns of a row (any row width, no table to outgrow)."""
    pos = torch.arange(width, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, channels, 2, device=device, dtype=torch.float32) * (-math.log(1e4) / channels))
    code = torch.zeros(width, channels, device=device)
    code[:, 0::2], code[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)[:, : channels // 2]
    return code.to(dtype) if dtype is not None else code


class _RowAttention(nn.Module):
    """Residual pre-norm self-attention along the row axis: (..., W, C) -> (..., W, C), every column attending to
    every column of the row (non-causal: the whole row above is known when a row is drafted). The column position
    code enters the queries and keys only; the output projection is zero-initialised, so the block starts as the
    identity."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if heads < 1 or width % heads:
            raise ValueError(f"attention_heads={heads}: expected a divisor of the drafter's width {width}")
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x):
        F, W, C = torch.nn.functional, x.shape[-2], x.shape[-1]
        y = self.norm(x)
        pos = column_positions(W, C, x.device, y.dtype)
        wq, wk, wv = self.qkv.weight.chunk(3)
        bq, bk, bv = self.qkv.bias.chunk(3)
        split = (lambda t: t.unflatten(-1, (self.heads, C // self.heads)).transpose(-2, -3))  # (..., heads, W, C/h)
        q, k, v = (split(F.linear(y + pos, wq, bq)), split(F.linear(y + pos, wk, bk)), split(F.linear(y, wv, bv)))
        z = F.scaled_dot_product_attention(q, k, v).transpose(-2, -3).flatten(-2)  # (..., W, C)
        return x + self.out(z)

    def flops_per_position(self, row_width: int) -> int:
        """Matmul FLOPs per column: the projections and, over the W columns attended, the scores and the mix."""
        return 2 * (self.qkv.weight.numel() + self.out.weight.numel()) + 4 * row_width * self.out.in_features


class _Block(nn.Module):
    """Residual MLP block, optionally after a row mixer (`kernel`: context along the row axis)."""

    def __init__(self, width: int, kernel: int | None = None):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))
        if kernel:
            self.mix = _RowMixer(width, kernel)

    def forward(self, x):
        if hasattr(self, "mix"):
            x = self.mix(x)
        return x + self.mlp(self.norm(x))


def _direction_mlps(in_size: int, out_size: int, hidden_size: int, preset: str, width_mult: int | None,
                    blocks: int | None, directions: tuple[str, ...], what: str,
                    context: dict[str, int] | None = None) -> nn.ModuleDict:
    """One residual MLP per draft direction, sized by a preset (checked, with the valid choices named);
    `context` maps a direction to the kernel of the row mixers put before each of its blocks."""
    if preset not in PRESETS:
        raise ValueError(f"unknown {what} preset {preset!r}: expected one of {sorted(PRESETS)}")
    bad = [d for d in directions if d not in DIRECTIONS]
    if bad:
        raise ValueError(f"unknown {what} directions {bad}: expected a subset of {DIRECTIONS}")
    mult, n_blocks = PRESETS[preset]
    width = (width_mult or mult) * hidden_size
    context = context or {}
    return nn.ModuleDict({
        d: nn.Sequential(nn.Linear(in_size, width), *[_Block(width, context.get(d)) for _ in range(blocks or n_blocks)],
                         nn.LayerNorm(width), nn.Linear(width, out_size))
        for d in directions})


class FPhi(nn.Module):
    """Two-direction hidden-state predictor; each direction is a residual MLP over [h_q, e(x_{q+1})]."""

    predicts = "hidden"  # a pre-norm state, decoded by the backbone's own head (`drafters.protocol.Drafter`)

    def __init__(self, hidden_size: int, preset: str = "s", width_mult: int | None = None,
                 blocks: int | None = None, directions: tuple[str, ...] = DIRECTIONS, backbone_id: str = "",
                 context_kernel: int | None = None, left_context: bool = False, left_tokens: int = 1,
                 down_extra_blocks: int = 0, down_attention: int = 0, attention_heads: int = 4):
        super().__init__()
        if down_attention < 0 or (down_attention and "down" not in directions):
            raise ValueError(f"down_attention={down_attention}: expected 0, or more with 'down' in directions")
        if left_tokens < 1 or (left_tokens > 1 and not left_context):
            raise ValueError(f"left_tokens={left_tokens}: expected 1, or more with left_context=true (the tokens before "
                             f"a down draft are its left context)")
        if down_extra_blocks < 0 or (down_extra_blocks and "down" not in directions):
            raise ValueError(f"down_extra_blocks={down_extra_blocks}: expected 0, or more with 'down' in directions")
        if context_kernel is not None and (context_kernel < 1 or context_kernel % 2 == 0):
            raise ValueError(f"context_kernel={context_kernel}: expected an odd kernel >= 1 (or null: point-wise)")
        if context_kernel and "down" not in directions:
            raise ValueError(f"context_kernel={context_kernel} mixes the row above for the down direction, but "
                             f"directions={list(directions)}: add 'down' or set context_kernel=null")
        self.nets = _direction_mlps(2 * hidden_size, hidden_size, hidden_size, preset, width_mult, blocks,
                                    tuple(directions), "f_phi", {"down": context_kernel} if context_kernel else None)
        self.hidden_size, self.directions, self.backbone_id = hidden_size, tuple(directions), backbone_id
        self.context_kernel = context_kernel
        self.row_inputs = ("down",) if context_kernel or down_attention else ()  # directions fed a whole row (..., W, D)
        self.in_norm = nn.LayerNorm(hidden_size)  # pre-norm states have a large, growing scale
        for net in self.nets.values():  # start as the identity map h_q -> h_q (a strong first guess)
            nn.init.zeros_(net[-1].weight)
            nn.init.zeros_(net[-1].bias)
        self.down_extra_blocks = down_extra_blocks
        if down_extra_blocks:  # after the down net's own blocks; zero residuals: the net starts as the one without them
            width = self.nets["down"][0].out_features
            self.down_more = nn.Sequential(*[_Block(width, context_kernel) for _ in range(down_extra_blocks)])
            for blk in self.down_more:
                nn.init.zeros_(blk.mlp[-1].weight)
                nn.init.zeros_(blk.mlp[-1].bias)
        self.down_attention = down_attention
        if down_attention:  # after the down net's input layer; zero output maps: the net starts as the one without them
            width = self.nets["down"][0].out_features
            self.down_attn = nn.ModuleList([_RowAttention(width, attention_heads) for _ in range(down_attention)])
        self.left_context, self.left_tokens = left_context, left_tokens
        if left_context:
            if "down" not in directions:
                raise ValueError(f"left_context=true conditions the down direction, but directions={list(directions)}")
            width = self.nets["down"][0].out_features
            self.left_in = nn.Linear(hidden_size, width)  # embedding of the token before the drafted one
            self.left_block = _Block(width)
            # the tokens 2..k before the drafted one, each through its own map (no bias: left_in's serves them all)
            self.left_far = nn.ModuleList([nn.Linear(hidden_size, width, bias=False) for _ in range(left_tokens - 1)])
            for lin in (self.left_in, self.left_block.mlp[-1], *self.left_far):  # zero: starts without left context
                nn.init.zeros_(lin.weight)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    def forward(self, hidden: torch.Tensor, next_embed: torch.Tensor, direction: str) -> torch.Tensor:
        """(..., D) pre-norm state at q and (..., D) embedding of x_{q+1} -> (..., D) predicted pre-norm state;
        for a direction with row context, (..., W, D) states and embeddings of a whole row above."""
        if direction not in self.nets:
            raise ValueError(f"this f_phi predicts {self.directions}, not {direction!r}")
        if direction in self.row_inputs and hidden.ndim < 3:
            raise ValueError(f"f_phi.{direction} mixes context along a row: expected (..., W, D) inputs, got "
                             f"{tuple(hidden.shape)}")
        x = torch.cat([self.in_norm(hidden), next_embed], dim=-1)
        net = self.nets[direction]
        if direction == "down" and (self.down_extra_blocks or self.down_attention):
            return hidden + net[-2:](self._down_features(x))
        return hidden + net(x)

    def _down_features(self, x: torch.Tensor) -> torch.Tensor:
        """The down net's trunk on its input [norm(h), e]: input layer, row attention, blocks, extra blocks."""
        net = self.nets["down"]
        if self.down_attention:
            x = net[0](x)
            for attn in self.down_attn:
                x = attn(x)
            trunk = net[1:-2](x)
        else:
            trunk = net[:-2](x)
        return self.down_more(trunk) if self.down_extra_blocks else trunk

    def left_maps(self) -> list[nn.Linear]:
        """The maps of the tokens before a down draft, nearest first (`left_in`, then `left_far`)."""
        return [self.left_in, *self.left_far]

    def right(self, hidden: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        return self(hidden, next_embed, "right")

    def down(self, hidden: torch.Tensor, next_embed: torch.Tensor,
             left_embed: torch.Tensor | list[torch.Tensor] | None = None) -> torch.Tensor:
        """Down drafts; with left context, `left_embed` (..., D) or (..., W, D) holds the embeddings of the tokens
        before the drafted ones (teacher tokens in training; SSD drafts column by column instead), a list of
        `left_tokens` such tensors (nearest first) where the drafter reads more than one."""
        if not self.left_context:
            return self(hidden, next_embed, "down")
        if left_embed is None:
            raise ValueError("this f_phi drafts down with left context: give left_embed, or draft column by column "
                             "with down_trunk / down_column")
        return self.down_column(self.down_trunk(hidden, next_embed), hidden, left_embed)

    def down_trunk(self, hidden: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        """The part of the down net that does not depend on the left neighbour: (..., [W,] D) -> (..., [W,] width)."""
        if "down" in self.row_inputs and hidden.ndim < 3:
            raise ValueError(f"f_phi.down mixes context along a row: expected (..., W, D) inputs, got {tuple(hidden.shape)}")
        return self._down_features(torch.cat([self.in_norm(hidden), next_embed], dim=-1))

    def down_column(self, trunk: torch.Tensor, hidden: torch.Tensor,
                    left_embed: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Trunk features, the state above and the left neighbours' embeddings (one tensor, or `left_tokens` of them,
        nearest first) -> the drafted pre-norm state."""
        embeds = [left_embed] if torch.is_tensor(left_embed) else list(left_embed)
        if len(embeds) != self.left_tokens:
            raise ValueError(f"this f_phi reads the {self.left_tokens} tokens before a down draft, got {len(embeds)} "
                             f"left embeddings")
        return self.down_step(trunk, hidden, sum(m(e) for m, e in zip(self.left_maps(), embeds)))

    def down_step(self, trunk: torch.Tensor, hidden: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """`down_column` from the left neighbour's features `left_in(e)` (a decoder drafting a row column by column
        looks them up in a table of every code's, `left_in` of each code's embedding, instead of computing them per
        column). The same operations as the modules', called directly: this runs W times per drafted row."""
        F, net, blk = torch.nn.functional, self.nets["down"], self.left_block
        x = trunk + left
        norm, (up, _, down) = blk.norm, blk.mlp
        y = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        z = x + F.linear(F.silu(F.linear(y, up.weight, up.bias)), down.weight, down.bias)
        out_norm, out = net[-2], net[-1]
        z = F.layer_norm(z, out_norm.normalized_shape, out_norm.weight, out_norm.bias, out_norm.eps)
        return hidden + F.linear(z, out.weight, out.bias)


class TokenDrafter(nn.Module):
    """Ablation of f_phi that drafts token ids directly instead of hidden states.

    From the embedding of the token x_{q+1} alone (no hidden state in, none out) it gives logits over the
    visual codes of the token one step right or one row down, through its own output layer. SSD uses it in
    place of f_phi unchanged otherwise; the distillation trains it on the same head-distribution term
    (there is no state to regress). SSD's paper reports that such token-space drafts are rarely accepted.
    """

    predicts = "tokens"  # visual-code logits (`drafters.protocol.Drafter`)
    left_context, left_tokens = False, 0

    def __init__(self, hidden_size: int, num_codes: int, preset: str = "s", width_mult: int | None = None,
                 blocks: int | None = None, directions: tuple[str, ...] = DIRECTIONS, backbone_id: str = ""):
        super().__init__()
        self.nets = _direction_mlps(hidden_size, num_codes, hidden_size, preset, width_mult, blocks,
                                    tuple(directions), "drafter")
        self.hidden_size, self.num_codes = hidden_size, num_codes
        self.directions, self.backbone_id = tuple(directions), backbone_id

    def forward(self, hidden: torch.Tensor, next_embed: torch.Tensor, direction: str) -> torch.Tensor:
        """(..., D) state (unused) and (..., D) embedding of x_{q+1} -> (..., num_codes) visual-code logits."""
        if direction not in self.nets:
            raise ValueError(f"this drafter predicts {self.directions}, not {direction!r}")
        return float_logits(self.nets[direction](next_embed))

    def right(self, hidden: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        return self(hidden, next_embed, "right")

    def down(self, hidden: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        return self(hidden, next_embed, "down")
