"""Speculative sampling along the raster order, shared by 1D drafters (multi-token heads, a draft model).

Each round, per image with frontier n (visual tokens final so far):
  draft    a drafter proposes tokens for visual indices n, n+1, ... (a contiguous st, with q);
  verify   one target pass over every image's span (fed from the smallest frontier);
  accept   drafts left to right with prob min(1, p/q) up to the first rejection ...
  correct  ... which is redrawn from norm(max(0, p - q)); if all drafts pass, one bonus token is
           drawn from p. Lossless: the output distribution is the target's.
"""
from __future__ import annotations

from typing import Callable

import torch

from specgen.decoding.sampling import accept_or_resample, sample_probs
from specgen.decoding.state import SpecState

# draft_fn(state, frontier (B,), lo, hi) -> (tokens (B, hi-lo), q (B, hi-lo, V), drafted (B, hi-lo) bool)
DraftFn = Callable[[SpecState, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@torch.no_grad()
def speculate(st: SpecState, draft_fn: DraftFn, window: int, observe=None) -> dict:
    """Fill all visual tokens of `st` by draft/verify rounds. Returns per-image statistics.

    `observe(indices, p)`, when given, sees every pass's target distributions (Jacobi drafters reuse them).
    """
    g, B, dev = st.g, st.B, st.seq.device
    vis = st.visual_positions()  # (N,)
    N = vis.numel()
    st.target_pass(g.prefix_len)  # prefill
    frontier = torch.zeros(B, dtype=torch.long, device=dev)
    accepted_total = torch.zeros(B, dtype=torch.long, device=dev)
    while (frontier < N).any():
        lo, hi = int(frontier.min()), min(N, int(frontier.max()) + window)
        st.hid.release(int(vis[lo]) - 1)  # drafts and checks read states from the frontier's on
        idx = torch.arange(lo, hi, device=dev)
        tokens, q, drafted = draft_fn(st, frontier, lo, hi)
        keep = idx[None, :] < frontier[:, None]  # final tokens stay as they are
        st.set_tokens(vis[idx], torch.where(keep, st.visual(vis[idx]), tokens))
        # feed through the last draft (and a following end-of-row) so p exists one index past it
        st.target_pass(int(vis[hi]) if hi < N else int(vis[N - 1]))
        pidx = torch.arange(lo, min(hi + 1, N), device=dev)
        p = st.dist(st.hid[:, vis[pidx] - 1])  # (B, span', V)
        if observe is not None:
            observe(pidx, p)
        span = hi - lo
        cur = st.visual(vis[idx])
        new, acc = accept_or_resample(cur, p[:, :span], q, st.rngs)
        ok = torch.cumprod((acc | ~drafted).long(), 1).bool() & drafted  # accepted run from the frontier
        n_ok = ok.sum(1)
        stop = frontier + n_ok  # (B,) first index that is not final yet
        live = frontier < N
        rejected = n_ok < drafted.sum(1)
        col = (stop - lo).clamp(0, p.shape[1] - 1)
        rows = torch.arange(B, device=dev)
        # a rejected draft is redrawn from the residual; a fully accepted run earns a bonus draw from p
        fix_tok = torch.where(rejected, new[rows, col.clamp_max(span - 1)], sample_probs(p[rows, col], st.rngs))
        has_fix = live & (stop < N) & (stop - lo < p.shape[1])
        final = st.visual(vis[pidx])  # (B, span') incl. one index past the span
        final[rows[has_fix], col[has_fix]] = fix_tok[has_fix]
        st.set_tokens(vis[pidx], final)
        accepted_total += torch.where(live, n_ok, torch.zeros_like(n_ok))
        frontier = torch.where(live, stop + has_fix.long(), frontier)
    return {"nfe": st.nfe, "draft_calls": st.draft_calls, "tokens_per_pass": N / st.nfe,
            "accepted_drafts": accepted_total.float(), "state_slots": st.hid.peak_slots,
            "tokens_fed": st.fed_per_image()}
