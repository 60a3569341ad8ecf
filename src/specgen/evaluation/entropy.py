"""How hard is the world to draft? The mean per-token entropy of the backbone's own samples.

Speculative decoders gain where the next token is predictable. The shapes world's plain scenes are
mostly flat background, so next to natural images (whose VQ tokens under Emu3-class models carry
several nats each) its tokens are easy; reporting this number beside every speed ratio lets a reader
judge how far a speed-up would carry over.
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone
from specgen.decoding import ar
from specgen.decoding.sampling import guide, make_rngs, probs


@torch.no_grad()
def token_entropy(backbone: DiscreteBackbone, prompts: list[str], cfg_scale: float = 1.0, temperature: float = 1.0,
                  top_k: int | None = None, seed: int = 0, batch: int = 16) -> dict[str, float]:
    """Mean entropy (nats and bits) of the sampling distribution at every visual token of AR samples.

    The distribution is the one the sampler draws from (CFG, temperature and top-k applied), evaluated
    teacher-forced along the backbone's own samples for `prompts`.
    """
    g = backbone.grid
    total, count = 0.0, 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        cond = backbone.prompt_ids(chunk)
        codes, _ = ar.generate(backbone, cond, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k,
                               rngs=make_rngs([seed + i + k for k in range(len(chunk))],
                                                          backbone.device))
        image = g.grid_to_sequence(codes)
        prefixes = [cond] if cfg_scale == 1.0 else [cond, backbone.null_prompt_ids(len(chunk))]
        seqs = torch.cat([torch.cat([p, image], 1) for p in prefixes])
        T = seqs.shape[1]
        hidden = backbone.forward_hidden(seqs[:, :-1], torch.arange(T - 1, device=seqs.device))
        logits = backbone.head(hidden)[..., g.visual_start: g.visual_start + g.num_visual].float()
        if len(prefixes) == 2:
            logits = guide(logits, cfg_scale)
        p = probs(logits, temperature, top_k)
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B, T-1): entropy of the token at t+1
        target = seqs[: len(chunk), 1:]
        visual = (target >= g.visual_start) & (target < g.visual_start + g.num_visual)
        total += float(ent[visual].sum())
        count += int(visual.sum())
    nats = total / max(count, 1)
    return {"token_entropy": nats, "token_entropy_bits": nats / float(torch.log(torch.tensor(2.0)))}
