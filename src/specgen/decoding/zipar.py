"""ZipAR: decode several rows at once, without verification (lossy, training-free).

Row r+1 starts once row r has `window` tokens; every target pass then samples the next token of
each active row and feeds them together at their own (non-contiguous) positions. A token attends
to every cached token at an earlier raster position, so tokens of the row above that do not exist
yet are simply missing from its context (the approximation). A new row's first token is predicted
from the row above's end-of-row token, fed early (row layouts), or from the newest token of the row
above (plain grid). `window = W` is plain AR decoding, token for token.
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts, embed_image
from specgen.decoding.sampling import guided_logits, sample
from specgen.decoding.state import prompt_rows
from specgen.utils.validate import expect_float, expect_int


def _mask(slot_pos: torch.Tensor, new_pos: torch.Tensor, batch: int, dtype) -> torch.Tensor:
    """Additive (B, 1, q, S + q) mask: query at position p sees every slot at a position <= p."""
    keys = torch.cat([slot_pos, new_pos])  # (S + q,)
    allowed = keys[None, :] <= new_pos[:, None]  # (q, S + q); a query sees itself
    m = torch.zeros(allowed.shape, dtype=dtype, device=new_pos.device)
    m.masked_fill_(~allowed, torch.finfo(dtype).min)
    return m[None, None].expand(batch, 1, -1, -1)


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, rngs=None, window: int = 4):
    """Sample visual codes (B, H, W) with ZipAR's parallel row schedule. Returns (codes, stats)."""
    expect_float("temperature", temperature, 0.0)
    g = backbone.grid
    expect_int("window", window, 1)
    if window > g.width:
        raise ValueError(f"window={window} does not fit the grid: a row has {g.width} tokens, so a row can wait for "
                         f"at most {g.width} tokens of the row above (window={g.width} is plain AR)")
    rows = prompt_rows(prompts, cfg_scale != 1.0)
    g = g.at(rows.length)
    B, reps, dev = rows.batch, rows.reps, rows.ids.device
    cache = backbone.new_cache(rows)
    h = backbone.forward_embeds(backbone.embed_tokens(rows.ids), torch.arange(rows.length, device=dev), cache)
    slot_pos = torch.arange(rows.length, device=dev)
    state = {0: h[:, -1]}  # row -> state predicting its next token (B', D)
    count = [0] * g.height
    codes = torch.empty(B, g.height, g.width, dtype=torch.long, device=dev)
    nfe, fed = 1, 0
    while count[-1] < g.width:
        active = [r for r in range(g.height) if r in state and count[r] < g.width]
        feed_ids, feed_pos, targets = [], [], []  # targets: rows whose next state each output becomes
        for r in active:
            logits = guided_logits(backbone, state[r], cfg_scale) if reps == 2 else backbone.visual_logits(state[r])
            tok = sample(logits, temperature, top_k, rngs)
            c = count[r]
            codes[:, r, c] = tok
            count[r] += 1
            if r == g.height - 1 and c == g.width - 1:
                continue  # the image's last token is never fed
            start_next = r + 1 < g.height and r + 1 not in state and count[r] >= window
            feed_ids.append(tok.repeat(reps))
            feed_pos.append(g.position(r, c))
            targets.append(([r] if c < g.width - 1 else []) + ([r + 1] if start_next and g.eol_id is None else []))
            if start_next and g.eol_id is not None:  # end-of-row token: fed early, it starts the next row
                feed_ids.append(torch.full((rows.ids.shape[0],), g.eol_token, device=dev))
                feed_pos.append(g.position(r, g.width))
                targets.append([r + 1])
            if start_next:
                state[r + 1] = None  # started: its first state arrives with this pass
        if not feed_ids:
            break  # only the image's last token was left
        order = sorted(range(len(feed_pos)), key=lambda i: feed_pos[i])
        pos = torch.tensor([feed_pos[i] for i in order], device=dev)
        x = torch.stack([feed_ids[i] for i in order], 1)  # (B', q)
        out = backbone.forward_embeds(embed_image(backbone, x), pos, cache,
                                      attn_mask=_mask(slot_pos, pos, x.shape[0], h.dtype))
        slot_pos = torch.cat([slot_pos, pos])
        nfe += 1
        fed += pos.numel()
        for j, i in enumerate(order):
            for r in targets[i]:
                state[r] = out[:, j]
    return codes, {"nfe": nfe, "tokens_per_pass": g.num_visual_tokens / nfe,
                   "tokens_fed": torch.full((B,), float(fed), device=dev)}
