"""A KV cache whose rows advance independently: continuous batching for decoders over a `transformers` decoder.

A `DynamicCache` holds one length for the whole batch, so every row of a pass feeds the same slots and a row that
is done idles until the batch's slowest one is. `RaggedCache` preallocates every layer's keys and values to the
whole sequence (`length` slots, plus one scratch slot) and writes each row's new entries at that row's own slots:
before a forward, `feed(rows, slots)` names the cache rows taking part (R, any subset) and the slot of every fed
token (R, q; -1 for padding, written to the scratch slot). The matching attention mask (`mask`) lets a token at
slot s see its row's entries at slots <= s and nothing else, so

- rows feed different numbers of tokens at different slots in one forward (ragged windows, padded to the longest);
- rolling a row back needs no copy: entries above the row's valid length are overwritten before any token can
  attend to them (a token at slot s only sees slots <= s, and every slot below s is fed before or with it);
- a row can start a new sequence at slot 0 while the others go on (continuous batching).

The layers return the buffer up to the highest slot fed (`visible`), so attention spans that many keys per query
whatever a row has written: cheap for the embedded world's 300-slot sequences. Position ids are the slots (the
caller passes them).

Packed forwards (`feed(..., pack=index)`): the forward's input is only the real tokens, (1, N) in the order of
`index` (their flat places in the (R, q) grid of `slots`), so the projections and the MLPs see no padding; attention
(`ragged_attention`, registered with transformers as "specgen_ragged") scatters the queries into the padded grid,
runs the same masked attention as a padded forward and gathers the real tokens' outputs back. A stream whose
windows differ in length feeds about half of its padded grid (`ssd_carry.stream`). With `feed(..., groups=)`
attention too runs image by image, each image's rows over their own queries and keys (views of the cache: a call a
group and layer, no copies), the same states up to the rounding of products of other shapes.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "specgen_ragged"


def ragged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, *args,
                     ragged_pack: tuple | None = None, **kwargs):
    """transformers' SDPA attention, for packed queries (1, H, N, d) where `ragged_pack` is (index (N,), rows,
    width, groups): scattered into the padded grid (rows, H, width, d), attended with the (rows, 1, width, keys) mask
    over the cache's rows, gathered back to (1, N, H, d). With `groups` (`feed(..., groups=)`) each group of rows is
    attended alone over its own keys, its queries only (`_grouped_attention`). Without a pack it is transformers'
    SDPA attention itself."""
    if ragged_pack is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    index, rows, width, groups = ragged_pack
    if groups is not None:
        return _grouped_attention(module, query, key, value, attention_mask, groups, *args, **kwargs), None
    heads, dim = query.shape[1], query.shape[3]
    grid = query.new_zeros(rows * width, heads, dim).index_copy_(0, index, query[0].transpose(0, 1))
    out, _ = sdpa_attention_forward(module, grid.view(rows, width, heads, dim).transpose(1, 2), key, value,
                                    attention_mask, *args, **kwargs)  # (rows, width, H, d)
    return out.reshape(rows * width, heads, dim)[index][None], None


def _grouped_attention(module, query, key, value, attention_mask, groups: tuple, *args, **kwargs) -> torch.Tensor:
    """Packed queries (1, H, N, d) attended group by group: `groups` is (step, [(first, n, keys), ...]) in the
    pack's order, a group the cache rows first, first + step, ... (as many as `key`'s rows over step), n tokens each
    (its rows' first n grid columns, consecutive in the pack) over their first `keys` slots. Every slice is a view:
    no key or value is copied, and no padded query or key is computed."""
    step, parts = groups
    reps, heads, dim = key.shape[0] // step, query.shape[1], query.shape[3]
    outs, off = [], 0
    for first, n, keys in parts:
        q = query[0, :, off:off + reps * n].view(heads, reps, n, dim).transpose(0, 1)  # (reps, H, n, d)
        rows = slice(first, None, step)
        out, _ = sdpa_attention_forward(module, q, key[rows, :, :keys], value[rows, :, :keys],
                                        attention_mask[rows, :, :n, :keys], *args, **kwargs)  # (reps, n, H, d)
        outs.append(out.reshape(reps * n, heads, dim))
        off += reps * n
    return torch.cat(outs)[None]


AttentionInterface.register(ATTENTION, ragged_attention)


class RaggedLayer(CacheLayerMixin):
    """One layer's keys and values, stored (rows, length + 1, kv heads, head dim) so that a feed is one row-major
    `index_copy_`, returned as (rows, kv heads, keys, head dim) views over the slots any fed token can see."""

    def __init__(self, owner: "RaggedCache", rows: int, heads: int, length: int, head_dim: int, dtype, device):
        super().__init__()
        self.owner = owner
        self.buf_k = torch.zeros(rows, length + 1, heads, head_dim, dtype=dtype, device=device)
        self.buf_v = torch.zeros_like(self.buf_k)
        self.is_initialized = True
        self.device = device

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated in __init__
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        R, T1, h, d = self.buf_k.shape
        for buf, new in ((self.buf_k, key_states), (self.buf_v, value_states)):
            buf.view(R * T1, h, d).index_copy_(0, o.flat, new.transpose(1, 2).reshape(-1, h, d).to(buf.dtype))
        keys, values = self.buf_k[:, :o.visible], self.buf_v[:, :o.visible]
        if not o.all_rows:
            keys, values = keys[o.rows], values[o.rows]
        self.keys, self.values = keys.transpose(1, 2), values.transpose(1, 2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.visible, 0

    def get_seq_length(self) -> int:
        return self.owner.visible

    def get_max_length(self) -> int:
        return self.buf_k.shape[1] - 1


class RaggedCache(Cache):
    """Preallocated per-row KV cache (see the module docstring). `length`: slots per row (the sequence's)."""

    def __init__(self, rows: int, length: int, num_layers: int, kv_heads: int, head_dim: int, dtype, device):
        self.length, self.num_rows = length, rows
        layers = [RaggedLayer(self, rows, kv_heads, length, head_dim, dtype, device) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self.rows = torch.arange(rows, device=device)
        self.write_at = torch.zeros(rows, 0, dtype=torch.long, device=device)
        self.flat = self.write_at.flatten()
        self.pack = None  # (index, rows, width, groups) of a packed forward
        self.all_rows = True
        self.visible = 1  # keys a forward attends over: slots [0, visible), the highest fed slot's and below

    @classmethod
    def for_config(cls, config, rows: int, length: int, dtype, device) -> "RaggedCache":
        """Sized from a `transformers` decoder config (layers, key/value heads, head width)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(rows, length, config.num_hidden_layers, kv_heads, head_dim, dtype, device)

    def feed(self, rows: torch.Tensor, slots: torch.Tensor, pack: torch.Tensor | None = None,
             groups: tuple | None = None) -> None:
        """The next forward feeds cache rows `rows` (R,) at `slots` (R, q); -1 marks padding. `pack` (N,): the forward
        is packed, its tokens those at these flat places of the (R, q) grid, in this order (`pack_args`). `groups`
        (a packed forward of every row): attention group by group instead of over the padded grid, (step, [(first,
        n, keys), ...]) in the pack's order (`_grouped_attention`)."""
        if groups is not None and (pack is None or rows.numel() != self.num_rows):
            raise ValueError("feed(groups=) needs pack= and every cache row fed (a group names cache rows)")
        if rows.ndim != 1 or slots.ndim != 2 or slots.shape[0] != rows.numel():
            raise ValueError(f"feed takes rows (R,) and slots (R, q), got {tuple(rows.shape)} and {tuple(slots.shape)}")
        top = int(slots.max()) if slots.numel() else -1  # the highest slot fed
        if top >= self.length:
            raise ValueError(f"slot {top} is past the cache's {self.length} slots")
        self.rows = rows
        self.all_rows = rows.numel() == self.num_rows and bool((rows == torch.arange(self.num_rows, device=rows.device)).all())
        self.write_at = torch.where(slots < 0, self.length, slots)
        self.flat = (rows[:, None] * (self.length + 1) + self.write_at).flatten()  # (R q,): rows x slots, every layer's
        if pack is not None:
            self.flat = self.flat[pack]
        self.pack = None if pack is None else (pack, *slots.shape, groups)
        self.visible = top + 1 if top >= 0 else 1

    def mask(self, slots: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Additive attention mask (R, 1, q, visible) for the tokens at `slots` (R, q) of the last `feed`: a token
        sees its row's slots up to its own; padding sees slot 0 only (its output is discarded; a row of -inf would
        give NaNs). `positions` (R, q; default: the slots): a token written at a slot past its position (an
        alternative token, fed beside the token at its position) sees the slots below its position and its own."""
        keys = torch.arange(self.visible, device=slots.device)
        own = slots.clamp_min(0)[..., None]  # (R, q, 1)
        below = own if positions is None else positions[..., None]
        allowed = (keys < below) | (keys == own)
        allowed = torch.where((slots < 0)[..., None], keys == 0, allowed)
        out = torch.zeros(allowed.shape, dtype=dtype, device=slots.device)
        return out.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.visible
