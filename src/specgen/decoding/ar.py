"""Plain autoregressive decoding with a KV cache and batched classifier-free guidance.

One target pass per visual token: the sampled token is fed together with any forced tokens that
follow it (end-of-row), so a 16x16 image costs 256 passes (prefill included, last token not fed).
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts, embed_image
from specgen.decoding.sampling import guided_logits, sample
from specgen.decoding.state import prompt_rows
from specgen.decoding.trace import Trace, or_silent
from specgen.utils.validate import expect_float


def visual_logits(backbone: DiscreteBackbone, hidden: torch.Tensor, cfg_scale: float, cfg_rows: bool) -> torch.Tensor:
    """Guided logits over visual codes only: (2B or B, ..., D) -> (B, ..., num_visual)."""
    return guided_logits(backbone, hidden, cfg_scale) if cfg_rows else backbone.visual_logits(hidden)


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, cfg_scale: float = 1.0,
             temperature: float = 1.0, top_k: int | None = None,
             rngs: list[torch.Generator] | None = None, use_cache: bool = True,
             cfg_rows: bool | None = None, static_cache: bool = False, trace: Trace | None = None):
    """Sample visual codes (B, H, W) for a batch of prompts. Returns (codes, stats).

    `cfg_rows` forces (True) or drops (False) the unconditional rows; by default they run iff
    cfg_scale != 1. `static_cache`: decode into the backbone's preallocated cache where it has one (AR never rolls
    back, so an append-only cache works). `use_cache=False` is the reference path: the whole sequence is fed again
    at every step. `trace`: a `decoding.trace.Trace` told of every target forward.
    """
    expect_float("cfg_scale", cfg_scale, 0.0)
    expect_float("temperature", temperature, 0.0)
    cfg_rows = cfg_scale != 1.0 if cfg_rows is None else cfg_rows
    rows = prompt_rows(prompts, cfg_rows)
    g = backbone.grid.at(rows.length)
    B, reps, device = rows.batch, rows.reps, rows.ids.device
    cache = backbone.new_cache(rows, static=static_cache) if use_cache else None
    prompt = backbone.embed_tokens(rows.ids)  # (B', P, D)
    seq = prompt
    trace = or_silent(trace)
    with trace.region("target", positions=rows.length, rows=prompt.shape[0], prefill=True):
        hidden = backbone.forward_embeds(prompt, torch.arange(rows.length, device=device),
                                         cache if use_cache else backbone.new_cache(rows))[:, -1]  # prefill
    nfe, fed = 1, 0
    codes = torch.empty(B, g.height, g.width, dtype=torch.long, device=device)
    for r in range(g.height):
        for c in range(g.width):
            tok = sample(visual_logits(backbone, hidden, cfg_scale, cfg_rows), temperature, top_k, rngs)  # (B,)
            codes[:, r, c] = tok
            if r == g.height - 1 and c == g.width - 1:
                break  # the last visual token is never fed
            feed = [tok]
            if c == g.width - 1 and g.eol_id is not None:
                feed.append(torch.full_like(tok, g.eol_token))  # forced: rides along in the same pass
            embeds = embed_image(backbone, torch.stack(feed, dim=1).repeat(reps, 1))  # (B', n, D)
            start = g.position(r, c)
            with trace.region("target", positions=embeds.shape[1], rows=embeds.shape[0], prefill=False):
                if use_cache:
                    pos = torch.arange(start, start + embeds.shape[1], device=device)
                    hidden = backbone.forward_embeds(embeds, pos, cache)[:, -1]
                else:  # reference path: recompute the whole prefix every step, into a fresh cache
                    seq = torch.cat([seq, embeds], dim=1)
                    pos = torch.arange(seq.shape[1], device=device)
                    hidden = backbone.forward_embeds(seq, pos, backbone.new_cache(rows))[:, -1]
            nfe += 1
            fed += embeds.shape[1]
    # tokens_fed: image positions fed to the target after the prefill, per image (what a pass's compute follows)
    return codes, {"nfe": nfe, "tokens_fed": torch.full((B,), float(fed), device=device)}
