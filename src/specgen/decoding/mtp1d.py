"""1D multi-token prediction (Medusa-style heads), verified by lossless speculative sampling.

From the target state before the frontier token, the exact target draws the frontier token and
head k drafts the token k steps further along the raster order (end-of-row tokens are forced,
not drafted); `spec1d.speculate` verifies the run in one target pass.
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts
from specgen.decoding.sampling import sample_probs
from specgen.decoding.spec1d import speculate
from specgen.decoding.state import SpecState
from specgen.drafters.protocol import check_drafter, fit_drafter
from specgen.utils.validate import expect_float


def _head_drafter(heads):
    def draft(st: SpecState, frontier: torch.Tensor, lo: int, hi: int):
        g, B, dev = st.g, st.B, st.seq.device
        vis = st.visual_positions()
        N = vis.numel()
        index_of = torch.full((g.seq_len + heads.num_heads + 1,), -1, dtype=torch.long, device=dev)
        index_of[vis] = torch.arange(N, device=dev)
        span = hi - lo
        tokens = torch.zeros(B, span, dtype=torch.long, device=dev)
        q = torch.full((B, span, g.num_visual), 1.0 / g.num_visual, device=dev)
        drafted = torch.zeros(B, span, dtype=torch.bool, device=dev)
        start = vis[frontier.clamp_max(N - 1)]  # (B,) position of the frontier token
        h = st.hid[torch.arange(B * st.reps, device=dev), start.repeat(st.reps) - 1]  # (B', D)
        rows = torch.arange(B, device=dev)
        for k in range(heads.num_heads + 1):  # k = 0: the target itself; k >= 1: head k
            hk = h if k == 0 else heads.ahead(h, k)
            j = index_of[start + k]  # visual index drafted by this prediction, -1 for a forced token
            use = (j >= lo) & (j < hi) & (frontier < N)
            if not use.any():
                continue
            qk = st.dist(hk)  # (B, V)
            tok = sample_probs(qk, st.rngs)
            col = (j - lo).clamp(0, span - 1)
            tokens[rows[use], col[use]] = tok[use]
            q[rows[use], col[use]] = qk[use]
            drafted[rows[use], col[use]] = True
        st.draft_calls += 1
        return tokens, q, drafted
    return draft


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, drafter, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, rngs=None):
    """Sample visual codes (B, H, W) with multi-token heads drafting. Returns (codes, stats)."""
    expect_float("temperature", temperature, 0.0)
    check_drafter(backbone, drafter, ("ahead_1",))  # heads, not a right/down (SSD) drafter
    drafter = fit_drafter(backbone, drafter)
    st = SpecState(backbone, prompts, cfg_scale, temperature, top_k, rngs)
    stats = speculate(st, _head_drafter(drafter), window=drafter.num_heads + 1)
    return st.codes(), stats
