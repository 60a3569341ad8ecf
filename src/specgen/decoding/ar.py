"""Plain autoregressive decoding with a KV cache and batched classifier-free guidance.

One target pass per visual token: the sampled token is fed together with any forced tokens that
follow it (end-of-row), so a 16x16 image costs 256 passes (prefill included, last token not fed).
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone
from specgen.decoding.sampling import guide, sample
from specgen.utils.validate import expect_float


def _batch_for_cfg(backbone: DiscreteBackbone, prompt_ids: torch.Tensor, cfg_rows: bool) -> torch.Tensor:
    """Stack [cond; uncond] prompt slots when guidance is on: (B, P) -> (2B, P)."""
    if not cfg_rows:
        return prompt_ids
    return torch.cat([prompt_ids, backbone.null_prompt_ids(prompt_ids.shape[0])], dim=0)


def visual_logits(backbone: DiscreteBackbone, hidden: torch.Tensor, cfg_scale: float, cfg_rows: bool) -> torch.Tensor:
    """Guided logits over visual codes only: (2B or B, ..., D) -> (B, ..., num_visual)."""
    g = backbone.grid
    logits = backbone.head(hidden)[..., g.visual_start: g.visual_start + g.num_visual]
    return guide(logits, cfg_scale) if cfg_rows else logits


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompt_ids: torch.Tensor, cfg_scale: float = 1.0,
             temperature: float = 1.0, top_k: int | None = None,
             rngs: list[torch.Generator] | None = None, use_cache: bool = True,
             cfg_rows: bool | None = None, cache=None):
    """Sample visual codes (B, H, W) for prompt slots (B, P). Returns (codes, stats).

    `cfg_rows` forces (True) or drops (False) the unconditional rows; by default they run iff
    cfg_scale != 1. `cache`: an empty cache to decode into (default: `backbone.new_cache()`); AR never rolls
    back, so an append-only preallocated cache works too.
    """
    g = backbone.grid
    expect_float("cfg_scale", cfg_scale, 0.0)
    expect_float("temperature", temperature, 0.0)
    cfg_rows = cfg_scale != 1.0 if cfg_rows is None else cfg_rows
    ids = _batch_for_cfg(backbone, prompt_ids, cfg_rows)  # (B', P)
    B, reps = prompt_ids.shape[0], ids.shape[0] // prompt_ids.shape[0]
    device = ids.device
    cache = (backbone.new_cache() if cache is None else cache) if use_cache else None
    seq = ids
    hidden = backbone.forward_hidden(ids, torch.arange(ids.shape[1], device=device), cache)[:, -1]  # prefill
    nfe = 1
    codes = torch.empty(B, g.height, g.width, dtype=torch.long, device=device)
    for r in range(g.height):
        for c in range(g.width):
            tok = sample(visual_logits(backbone, hidden, cfg_scale, cfg_rows), temperature, top_k, rngs)  # (B,)
            codes[:, r, c] = tok
            if r == g.height - 1 and c == g.width - 1:
                break  # the last visual token is never fed
            feed = [tok + g.visual_start]
            if c == g.width - 1 and g.eol_id is not None:
                feed.append(torch.full_like(tok, g.eol_id))  # forced: rides along in the same pass
            feed_ids = torch.stack(feed, dim=1).repeat(reps, 1)  # (B', n)
            start = g.position(r, c)
            if use_cache:
                pos = torch.arange(start, start + feed_ids.shape[1], device=device)
                hidden = backbone.forward_hidden(feed_ids, pos, cache)[:, -1]
            else:  # reference path: recompute the whole prefix every step
                seq = torch.cat([seq, feed_ids], dim=1)
                hidden = backbone.forward_hidden(seq, torch.arange(seq.shape[1], device=device))[:, -1]
            nfe += 1
    return codes, {"nfe": nfe}
