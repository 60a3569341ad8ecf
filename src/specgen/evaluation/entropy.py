"""How hard is the world to draft? The mean per-token entropy of the backbone's own samples.

Speculative decoders gain where the next token is predictable. The shapes world's plain scenes are
mostly flat background, so next to natural images (whose VQ tokens under Emu3-class models carry
several nats each) its tokens are easy; reporting this number beside every speed ratio lets a reader
judge how far a speed-up would carry over.
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, image_states
from specgen.decoding import ar
from specgen.decoding.sampling import guide, make_rngs, probs


@torch.no_grad()
def token_entropy(backbone: DiscreteBackbone, prompts: list[str], cfg_scale: float = 1.0, temperature: float = 1.0,
                  top_k: int | None = None, seed: int = 0, batch: int = 16) -> dict[str, float]:
    """Mean entropy (nats and bits) of the sampling distribution at every visual token of AR samples.

    The distribution is the one the sampler draws from (CFG, temperature and top-k applied), evaluated
    teacher-forced along the backbone's own samples for `prompts`.
    """
    total, count = 0.0, 0
    for i in range(0, len(prompts), batch):
        chunk = backbone.prompts(prompts[i:i + batch])
        codes, _ = ar.generate(backbone, chunk, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k,
                               rngs=make_rngs([seed + i + k for k in range(len(chunk))], backbone.device))
        hidden, tokens = image_states(backbone, chunk.rows(cfg_scale != 1.0), codes)  # (B', L, D), (B', L)
        logits = backbone.visual_logits(hidden).float()
        if cfg_scale != 1.0:
            logits = guide(logits, cfg_scale)
        p = probs(logits, temperature, top_k)
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B, L): entropy of the token each state predicts
        visual = tokens[: len(chunk)] < backbone.grid.num_visual
        total += float(ent[visual].sum())
        count += int(visual.sum())
    nats = total / max(count, 1)
    return {"token_entropy": nats, "token_entropy_bits": nats / float(torch.log(torch.tensor(2.0)))}
