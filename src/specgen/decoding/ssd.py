"""Spatially speculative decoding (SSD).

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

`carry=True` keeps the row budget but leaves no token unverified. After a pass, a column is final
when no column to its left changed in that pass (it was judged with its final left context); the
first changed column is final too (drawn from p given that context). With the plain auto-correct
rule, the columns right of the last round's first change are kept without a check against their
final context: on a world scored by an exact parser those unchecked tokens are the speckles that
cost quality at small r. With `carry`, they stay in the verification window: the next row's passes
re-verify them together with the new row's drafts (no extra pass), and after the last row, passes
go on until every token is final. The check of a carried token uses the previous round's p as its
proposal, as Jacobi-style decoders (SJD) do: approximately lossless, exact under greedy decoding.

p and q are the guided (CFG), temperature- and top-k-warped distributions over visual codes; the
drafted hidden states go through the backbone's own final norm and head.
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone
from specgen.decoding.sampling import accept_or_resample, sample_probs
from specgen.decoding.state import SpecState, check_drafter
from specgen.utils.validate import expect_float, expect_int


def _draft_right(run: SpecState, drafter, start: int, row: int,
                 draft_temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain f_phi.right from the target state at `start` through known tokens into row `row`."""
    g = run.g
    h = run.hid[:, start]  # (B', D)
    tokens_out = getattr(drafter, "predicts", "hidden") == "tokens"  # ablation: the drafter gives code logits
    is_state = True  # h is a target state until the drafter has run once
    first = g.position(row, 0)
    codes, qs = [], []
    for pos in range(start + 1, g.position(row, g.width - 1) + 1):
        if pos >= first and (pos - first) % g.stride < g.width:  # a visual token of this row: draft it
            q = run.dist(h, draft_temperature) if is_state else run.dist_logits(h, draft_temperature)  # (B, Vv)
            tok = sample_probs(q, run.gens)
            codes.append(tok)
            qs.append(q)
            ids = (tok + g.visual_start).repeat(run.reps)
        else:  # a token already known (previous row, end-of-row)
            ids = run.seq[:, pos]
        if pos < g.position(row, g.width - 1):
            h = drafter.right(h, run.bb.embed(ids))
            is_state = not tokens_out
            run.draft_calls += 1
    return torch.stack(codes, 1), torch.stack(qs, 1)  # (B, W), (B, W, Vv)


def _draft_down(run: SpecState, drafter, row: int,
                draft_temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All columns of `row` at once: f_phi.down(h_{P(row-1, c) - 1}, e(x_{row-1, c}))."""
    g = run.g
    above = g.position(row - 1, torch.arange(g.width, device=run.seq.device))  # (W,)
    h = drafter.down(run.hid[:, above - 1], run.bb.embed(run.seq[:, above]))  # (B', W, D) or code logits
    run.draft_calls += 1
    tokens_out = getattr(drafter, "predicts", "hidden") == "tokens"
    q = run.dist_logits(h, draft_temperature) if tokens_out else run.dist(h, draft_temperature)
    return sample_probs(q, run.gens), q


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompt_ids: torch.Tensor, drafter, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, generators=None, rounds: int = 2,
             exact: bool = False, vertical: bool = True, carry: bool = False,
             draft_temperature: float | None = None):
    """SSD sampling of visual codes (B, H, W). Returns (codes, stats).
    `draft_temperature` (default: `temperature`) warps the drafted distribution q only; 0 drafts the argmax
    (q one-hot). Verification divides by the q the draft was drawn from, so exact mode stays lossless."""
    expect_int("rounds", rounds, 0)
    expect_float("temperature", temperature, 0.0)
    if draft_temperature is not None:
        expect_float("draft_temperature", draft_temperature, 0.0)
    check_drafter(backbone, drafter, ("right", "down") if vertical else ("right",))
    run = SpecState(backbone, prompt_ids, cfg_scale, temperature, top_k, generators)
    g, B, dev = run.g, run.B, prompt_ids.device
    run.target_pass(g.prefix_len)  # prefill: prompt slot and begin-of-image
    accept_map = torch.zeros(B, g.height, g.width, dtype=torch.bool, device=dev)
    rounds_used = torch.zeros(B, g.height, dtype=torch.long, device=dev)
    unchecked = torch.zeros(B, dtype=torch.long, device=dev)  # tokens never checked against their final context
    pending = _Pending(B, dev) if carry and not exact else None
    for r in range(g.height):
        cols = g.position(r, torch.arange(g.width, device=dev))  # (W,)
        if r == 0 or not vertical:
            start = g.prefix_len - 1 if r == 0 else g.position(r - 1, g.width - 1) - 1
            draft, q = _draft_right(run, drafter, start, r, draft_temperature)
        else:
            draft, q = _draft_down(run, drafter, r, draft_temperature)
        run.set_tokens(cols, draft)
        if exact:
            accept_map[:, r], rounds_used[:, r] = _verify_exact(run, cols, q)
        elif pending is not None:
            accept_map[:, r], rounds_used[:, r] = pending.verify(run, cols, q, rounds)
        else:
            accept_map[:, r], rounds_used[:, r], row_unchecked = _verify_autocorrect(run, cols, q, rounds)
            unchecked += row_unchecked
    if pending is not None:
        pending.flush(run)
    codes = run.codes()
    stats = {"nfe": run.nfe, "draft_calls": run.draft_calls, "tokens_per_pass": g.num_visual_tokens / run.nfe,
             "accept_rate": accept_map.float().mean((1, 2)), "rounds_per_row": rounds_used.float().mean(1),
             "accept_map": accept_map, "unchecked_tokens": unchecked.float()}
    if pending is not None:
        stats["flush_passes"] = pending.extra_passes
    return codes, stats


def _verify_autocorrect(run: SpecState, cols: torch.Tensor, q: torch.Tensor, rounds: int):
    """Verify and correct every column each pass; re-verify up to `rounds` times."""
    proposal = q
    first_accept = None
    active = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)  # images still changing
    used = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    W = cols.numel()
    for k in range(rounds + 1):
        run.target_pass(int(cols[-1]))  # the row's last candidate is conditioned on, never fed
        p = run.dist(run.hid[:, cols - 1])  # (B, W, Vv): column c from the state before it
        cur = run.visual(cols)
        new, accepted = accept_or_resample(cur, p, proposal, run.gens)
        changes = new != cur  # (B, W)
        changed = changes.any(1)  # (B,)
        first_accept = accepted if first_accept is None else first_accept
        used += active.long()
        active &= changed
        run.set_tokens(cols, new)
        proposal = p  # a corrected token is a draw from this round's p: it proposes for the next round
        if not changed.any():
            break
    # columns right of the last pass's first change were judged with a left context that then changed
    unchecked = torch.where(changed, W - 1 - changes.float().argmax(1).long(), torch.zeros_like(used))
    return first_accept, used, unchecked


class _Pending:
    """Verification window of `carry=True`: the visual positions not final yet, with their proposals."""

    def __init__(self, B: int, device):
        self.final_upto = torch.zeros(B, dtype=torch.long, device=device)  # positions < this are final
        self.pos = torch.zeros(0, dtype=torch.long, device=device)  # (n,) window positions, ascending
        self.prop: torch.Tensor | None = None  # (B, n, V) proposal of each window token
        self.extra_passes = 0

    def _pass(self, run: SpecState) -> torch.Tensor:
        """One target pass over the window: accept or correct every non-final token; advance the frontier.
        Returns (B, n) accepted."""
        pos = self.pos
        run.target_pass(int(pos[-1]))
        p = run.dist(run.hid[:, pos - 1])
        cur = run.visual(pos)
        new, accepted = accept_or_resample(cur, p, self.prop, run.gens)
        final = pos[None, :] < self.final_upto[:, None]
        new = torch.where(final, cur, new)
        changed = new != cur
        n = pos.numel()
        first = torch.where(changed.any(1), changed.float().argmax(1), torch.full_like(self.final_upto, n - 1))
        self.final_upto = torch.maximum(self.final_upto, pos[first] + 1)  # through the first change
        run.set_tokens(pos, new)
        keep = pos >= int(self.final_upto.min())  # drop what every image has finalised
        self.pos, self.prop = pos[keep], p[:, keep]
        return accepted

    def live(self) -> torch.Tensor:
        """(B,) images with a token in the window that is not final yet."""
        if self.pos.numel() == 0:
            return torch.zeros_like(self.final_upto, dtype=torch.bool)
        return self.final_upto <= self.pos[-1]

    def verify(self, run: SpecState, cols: torch.Tensor, q: torch.Tensor, rounds: int):
        """Add a drafted row to the window; spend up to rounds + 1 passes on it."""
        self.pos = torch.cat([self.pos, cols])
        self.prop = q if self.prop is None else torch.cat([self.prop, q], 1)
        first_accept = None
        used = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
        for _ in range(rounds + 1):
            used += self.live().long()
            accepted = self._pass(run)
            first_accept = accepted[:, -cols.numel():] if first_accept is None else first_accept
            if not self.live().any():
                break
        return first_accept, used

    def flush(self, run: SpecState) -> None:
        """Passes until every token is final (each pass finalises at least one token of every image)."""
        while self.live().any():
            self._pass(run)
            self.extra_passes += 1


def _verify_exact(run: SpecState, cols: torch.Tensor, q: torch.Tensor):
    """Lossless: accept left to right up to the first rejection, correct it, repeat until the row is done."""
    B, W = q.shape[:2]
    frontier = torch.zeros(B, dtype=torch.long, device=q.device)
    first_accept = passes = None
    col_idx = torch.arange(W, device=q.device)
    while (frontier < W).any():
        run.target_pass(int(cols[-1]))
        p = run.dist(run.hid[:, cols - 1])
        cur = run.visual(cols)
        new, accepted = accept_or_resample(cur, p, q, run.gens)
        open_ = col_idx[None, :] >= frontier[:, None]  # (B, W) columns still undecided
        run_ok = torch.cumprod((accepted | ~open_).long(), 1).bool()  # accepted run from the frontier
        stop = torch.where(run_ok.all(1), torch.full_like(frontier, W), (~run_ok).float().argmax(1))
        fix = (col_idx[None, :] == stop[:, None]) & (frontier < W)[:, None]
        run.set_tokens(cols, torch.where(fix, new, cur))
        if first_accept is None:
            first_accept, passes = run_ok.clone(), torch.zeros(B, dtype=torch.long, device=q.device)
        passes += (frontier < W).long()
        frontier = torch.where(frontier < W, (stop + 1).clamp_max(W), frontier)
    return first_accept, passes
