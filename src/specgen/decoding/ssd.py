"""Spatially speculative decoding (SSD), as the paper defines it.

Per image row r (all images of the batch in lockstep):
  draft    row 0 (or every row, horizontal-only): chain f_phi.right from the last target state;
           rows r >= 1: f_phi.down on the row above's target states, all columns in one call.
  verify   one target pass over the row's candidates (rolled back to the last valid cache entry).
  accept   each candidate t ~ q kept with prob min(1, p(t)/q(t)) ...
  correct  ... else redrawn from norm(max(0, p - q)), all columns in the same pass.
  repeat   up to `rounds` more passes re-verify the corrected row (proposal = previous round's p),
           stopping when a round changes nothing. A row costs at most rounds + 1 target passes.
`exact=True` is standard speculative sampling instead (lossless): columns are accepted left to
right up to the first rejection, which is corrected, and passes repeat until the row is complete.

p and q are the guided (CFG), temperature- and top-k-warped distributions over visual codes; the drafted hidden
states go through the backbone's own final norm and head. The repo's default strategy (`ssd_carry`) keeps this
drafting and verification and leaves no token unverified (a carry window over rows).
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts
from specgen.decoding.sampling import accept_or_resample
from specgen.decoding.ssd_drafting import Drafting
from specgen.decoding.state import SpecState
from specgen.decoding.trace import Trace
from specgen.drafters.protocol import Drafter, check_drafter, fit_drafter
from specgen.utils.validate import expect_float, expect_int


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, drafter: Drafter, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, rngs: list[torch.Generator] | None = None,
             rounds: int = 2, exact: bool = False, vertical: bool = True, draft_temperature: float | None = None,
             trace: Trace | None = None) -> tuple[torch.Tensor, dict]:
    """SSD sampling of visual codes (B, H, W). Returns (codes, stats).

    rounds: re-verification passes after a row's first (a row costs at most rounds + 1 passes); exact: lossless
    speculative sampling (accept left to right up to the first rejection) instead of auto-correction; vertical:
    False is the horizontal-only ablation (every row chained by f_phi.right); draft_temperature: warps the drafted q
    only (None: `temperature`; 0: argmax drafts), verification divides by the q each draft was drawn from, so exact
    mode stays lossless; rngs: one generator per image (`sampling.make_rngs`); trace: a `decoding.trace.Trace` told
    of every target forward and drafter call.
    stats: "nfe" target passes over the batch (one forward counts once), "accept_rate" (B,) and "accept_map"
    (B, H, W) at each token's first judgement, "rounds_per_row" (B,), "unchecked_tokens" (B,) tokens kept without a
    check against their final left context, "row_final_pass" (B, H) the passes spent (prefill included) when each
    row was done, "tokens_fed" (B,) positions fed after the prefill, "draft_calls", "state_slots"."""
    expect_int("rounds", rounds, 0)
    expect_float("temperature", temperature, 0.0)
    if draft_temperature is not None:
        expect_float("draft_temperature", draft_temperature, 0.0)
    check_drafter(backbone, drafter, ("right", "down") if vertical else ("right",))
    drafter = fit_drafter(backbone, drafter)
    st = SpecState(backbone, prompts, cfg_scale, temperature, top_k, rngs, trace)
    st.target_pass(st.g.prefix_len)  # prefill: prompt slot and begin-of-image
    drafting = Drafting(st, drafter, draft_temperature)
    g, B, dev = st.g, st.B, st.seq.device
    accept_map = torch.zeros(B, g.height, g.width, dtype=torch.bool, device=dev)
    rounds_used = torch.zeros(B, g.height, dtype=torch.long, device=dev)
    unchecked = torch.zeros(B, dtype=torch.long, device=dev)  # tokens never checked against their final context
    row_final = torch.zeros(B, g.height, dtype=torch.long, device=dev)  # the batch's passes when each row was done
    for r in range(g.height):
        cols = g.position(r, torch.arange(g.width, device=dev))  # (W,)
        if r:  # drafts read the row above's states from the one before its first token on
            st.hid.release(g.position(r - 1, 0) - 1)
        draft, q = drafting.right(r) if r == 0 or not vertical else drafting.down(torch.full((B,), r, device=dev))
        st.set_tokens(cols, draft)
        if exact:
            accept_map[:, r], rounds_used[:, r] = _verify_exact(st, cols, q)
        else:
            accept_map[:, r], rounds_used[:, r], row_unchecked = _verify_autocorrect(st, cols, q, rounds)
            unchecked += row_unchecked
        row_final[:, r] = st.nfe
    stats = {"nfe": st.nfe, "draft_calls": st.draft_calls, "tokens_per_pass": g.num_visual_tokens / st.nfe,
             "accept_rate": accept_map.float().mean((1, 2)), "rounds_per_row": rounds_used.float().mean(1),
             "accept_map": accept_map, "unchecked_tokens": unchecked.float(), "row_final_pass": row_final,
             "state_slots": st.hid.peak_slots, "tokens_fed": st.fed_per_image()}
    return st.codes(), stats


def _verify_autocorrect(st: SpecState, cols: torch.Tensor, q: torch.Tensor, rounds: int):
    """Verify and correct every column each pass; re-verify up to `rounds` times. Returns the first pass's
    acceptance (B, W), the passes each image's row took (B,), and its tokens right of the last pass's first change
    (judged with a left context that then changed) (B,)."""
    proposal = q
    first_accept = None
    active = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)  # images still changing
    used = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    W = cols.numel()
    for _ in range(rounds + 1):
        st.target_pass(int(cols[-1]))  # the row's last candidate is conditioned on, never fed
        p = st.dist(st.hid[:, cols - 1])  # (B, W, V): column c from the state before it
        cur = st.visual(cols)
        new, accepted = accept_or_resample(cur, p, proposal, st.rngs)
        changes = new != cur  # (B, W)
        changed = changes.any(1)  # (B,)
        first_accept = accepted if first_accept is None else first_accept
        used += active.long()
        active &= changed
        st.set_tokens(cols, new)
        proposal = p  # a corrected token is a draw from this round's p: it proposes for the next round
        if not changed.any():
            break
    unchecked = torch.where(changed, W - 1 - changes.float().argmax(1).long(), torch.zeros_like(used))
    return first_accept, used, unchecked


def _verify_exact(st: SpecState, cols: torch.Tensor, q: torch.Tensor):
    """Lossless: accept left to right up to the first rejection, correct it, repeat until the row is done."""
    B, W = q.shape[:2]
    frontier = torch.zeros(B, dtype=torch.long, device=q.device)
    first_accept = passes = None
    col_idx = torch.arange(W, device=q.device)
    while (frontier < W).any():
        st.target_pass(int(cols[-1]))
        p = st.dist(st.hid[:, cols - 1])
        cur = st.visual(cols)
        new, accepted = accept_or_resample(cur, p, q, st.rngs)
        open_ = col_idx[None, :] >= frontier[:, None]  # (B, W) columns still undecided
        run_ok = torch.cumprod((accepted | ~open_).long(), 1).bool()  # accepted run from the frontier
        stop = torch.where(run_ok.all(1), torch.full_like(frontier, W), (~run_ok).float().argmax(1))
        fix = (col_idx[None, :] == stop[:, None]) & (frontier < W)[:, None]
        st.set_tokens(cols, torch.where(fix, new, cur))
        if first_accept is None:
            first_accept, passes = run_ok.clone(), torch.zeros(B, dtype=torch.long, device=q.device)
        passes += (frontier < W).long()
        frontier = torch.where(frontier < W, (stop + 1).clamp_max(W), frontier)
    return first_accept, passes
