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

The layers return the whole preallocated buffer, so attention spans `length + 1` keys per query whatever a row
has written: cheap for the embedded world's 300-slot sequences. Position ids are the slots (the caller passes them).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class RaggedLayer(CacheLayerMixin):
    """One layer's keys and values (rows, kv heads, length + 1, head dim), written at per-row slots."""

    def __init__(self, owner: "RaggedCache", rows: int, heads: int, length: int, head_dim: int, dtype, device):
        super().__init__()
        self.owner = owner
        self.keys = torch.zeros(rows, heads, length + 1, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.is_initialized = True
        self.device = device

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated in __init__
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, at = self.owner.rows, self.owner.write_at  # (R,), (R, q)
        self.keys[rows[:, None], :, at] = key_states.transpose(1, 2).to(self.keys.dtype)  # (R, q, heads, d)
        self.values[rows[:, None], :, at] = value_states.transpose(1, 2).to(self.values.dtype)
        if self.owner.all_rows:
            return self.keys, self.values
        return self.keys[rows], self.values[rows]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class RaggedCache(Cache):
    """Preallocated per-row KV cache (see the module docstring). `length`: slots per row (the sequence's)."""

    def __init__(self, rows: int, length: int, num_layers: int, kv_heads: int, head_dim: int, dtype, device):
        self.length, self.num_rows = length, rows
        layers = [RaggedLayer(self, rows, kv_heads, length, head_dim, dtype, device) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self.rows = torch.arange(rows, device=device)
        self.write_at = torch.zeros(rows, 0, dtype=torch.long, device=device)
        self.all_rows = True

    @classmethod
    def for_config(cls, config, rows: int, length: int, dtype, device) -> "RaggedCache":
        """Sized from a `transformers` decoder config (layers, key/value heads, head width)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(rows, length, config.num_hidden_layers, kv_heads, head_dim, dtype, device)

    def feed(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """The next forward feeds cache rows `rows` (R,) at `slots` (R, q); -1 marks padding."""
        if rows.ndim != 1 or slots.ndim != 2 or slots.shape[0] != rows.numel():
            raise ValueError(f"feed takes rows (R,) and slots (R, q), got {tuple(rows.shape)} and {tuple(slots.shape)}")
        if slots.numel() and int(slots.max()) >= self.length:
            raise ValueError(f"slot {int(slots.max())} is past the cache's {self.length} slots")
        self.rows = rows
        self.all_rows = rows.numel() == self.num_rows and bool((rows == torch.arange(self.num_rows, device=rows.device)).all())
        self.write_at = torch.where(slots < 0, self.length, slots)

    def mask(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive attention mask (R, 1, q, length + 1) for tokens at `slots` (R, q): a token sees its row's slots
        up to its own; padding sees slot 0 only (its output is discarded; a row of -inf would give NaNs)."""
        keys = torch.arange(self.length + 1, device=slots.device)
        own = slots.clamp_min(0)[..., None]  # (R, q, 1)
        allowed = (keys <= own) & (keys < self.length)
        allowed = torch.where((slots < 0)[..., None], keys == 0, allowed)
        out = torch.zeros(allowed.shape, dtype=dtype, device=slots.device)
        return out.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length + 1
