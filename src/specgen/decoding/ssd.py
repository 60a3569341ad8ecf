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

p and q are the guided (CFG), temperature- and top-k-warped distributions over visual codes; the
drafted hidden states go through the backbone's own final norm and head.
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone
from specgen.decoding.sampling import accept_or_resample, guide, probs, sample_probs
from specgen.utils.validate import expect_float, expect_int


class _Run:
    """Buffers of one batched generation: token values, latest target states, cache bookkeeping."""

    def __init__(self, backbone: DiscreteBackbone, prompt_ids: torch.Tensor, cfg_scale: float,
                 temperature: float, top_k: int | None, generators):
        self.bb, self.g = backbone, backbone.grid
        self.cfg_scale, self.temperature, self.top_k, self.gens = cfg_scale, temperature, top_k, generators
        self.B = prompt_ids.shape[0]
        ids = prompt_ids if cfg_scale == 1.0 else torch.cat([prompt_ids, backbone.null_prompt_ids(self.B)])
        self.reps = ids.shape[0] // self.B
        dev = ids.device
        T = self.g.seq_len
        self.seq = torch.zeros(ids.shape[0], T, dtype=torch.long, device=dev)  # (B', T) current tokens
        self.seq[:, : ids.shape[1]] = ids
        if self.g.eol_id is not None:
            self.seq[:, self.g.position(torch.arange(self.g.height, device=dev), self.g.width)] = self.g.eol_id
        self.hid = torch.zeros(ids.shape[0], T, backbone.hidden_size, device=dev)  # latest pre-norm states
        self.cache = backbone.new_cache()
        self.cached = 0  # cache positions [0, cached) hold the current tokens
        self.nfe = self.draft_calls = 0

    def target_pass(self, end: int) -> None:
        """Roll back to the last valid cache entry and feed the current tokens up to `end` (exclusive)."""
        if self.cached >= end:  # nothing changed that a later state depends on: no pass needed
            return
        self.bb.rollback(self.cache, self.cached)
        pos = torch.arange(self.cached, end, device=self.seq.device)
        self.hid[:, self.cached:end] = self.bb.forward_hidden(self.seq[:, self.cached:end], pos, self.cache)
        self.cached = end
        self.nfe += 1

    def dist(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B', ..., D) pre-norm states -> (B, ..., Vv) sampling distributions over visual codes."""
        g = self.g
        logits = self.bb.head(hidden)[..., g.visual_start: g.visual_start + g.num_visual]
        if self.reps == 2:
            logits = guide(logits, self.cfg_scale)
        return probs(logits.float(), self.temperature, self.top_k)

    def set_tokens(self, positions: torch.Tensor, codes: torch.Tensor) -> None:
        """Write visual codes (B, n) at positions (n,), invalidating the cache from the first change."""
        new = (codes + self.g.visual_start).repeat(self.reps, 1)
        changed = (self.seq[:, positions] != new).any(0)
        if changed.any():
            self.cached = min(self.cached, int(positions[changed.nonzero()[0, 0]]))
        self.seq[:, positions] = new

    def visual(self, positions: torch.Tensor) -> torch.Tensor:
        return self.seq[: self.B, positions] - self.g.visual_start


def _draft_right(run: _Run, drafter, start: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain f_phi.right from the target state at `start` through known tokens into row `row`."""
    g = run.g
    h = run.hid[:, start]  # (B', D)
    first = g.position(row, 0)
    codes, qs = [], []
    for pos in range(start + 1, g.position(row, g.width - 1) + 1):
        if pos >= first and (pos - first) % g.stride < g.width:  # a visual token of this row: draft it
            q = run.dist(h)  # (B, Vv)
            tok = sample_probs(q, run.gens)
            codes.append(tok)
            qs.append(q)
            ids = (tok + g.visual_start).repeat(run.reps)
        else:  # a token already known (previous row, end-of-row)
            ids = run.seq[:, pos]
        if pos < g.position(row, g.width - 1):
            h = drafter.right(h, run.bb.embed(ids))
            run.draft_calls += 1
    return torch.stack(codes, 1), torch.stack(qs, 1)  # (B, W), (B, W, Vv)


def _draft_down(run: _Run, drafter, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All columns of `row` at once: f_phi.down(h_{P(row-1, c) - 1}, e(x_{row-1, c}))."""
    g = run.g
    above = g.position(row - 1, torch.arange(g.width, device=run.seq.device))  # (W,)
    h = drafter.down(run.hid[:, above - 1], run.bb.embed(run.seq[:, above]))  # (B', W, D)
    run.draft_calls += 1
    q = run.dist(h)
    return sample_probs(q, run.gens), q


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompt_ids: torch.Tensor, drafter, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, generators=None, rounds: int = 2,
             exact: bool = False, vertical: bool = True):
    """SSD sampling of visual codes (B, H, W). Returns (codes, stats)."""
    expect_int("rounds", rounds, 0)
    expect_float("temperature", temperature, 0.0)
    run = _Run(backbone, prompt_ids, cfg_scale, temperature, top_k, generators)
    g, B, dev = run.g, run.B, prompt_ids.device
    run.target_pass(g.prefix_len)  # prefill: prompt slot and begin-of-image
    accept_map = torch.zeros(B, g.height, g.width, dtype=torch.bool, device=dev)
    rounds_used = torch.zeros(B, g.height, dtype=torch.long, device=dev)
    for r in range(g.height):
        cols = g.position(r, torch.arange(g.width, device=dev))  # (W,)
        if r == 0 or not vertical:
            start = g.prefix_len - 1 if r == 0 else g.position(r - 1, g.width - 1) - 1
            draft, q = _draft_right(run, drafter, start, r)
        else:
            draft, q = _draft_down(run, drafter, r)
        run.set_tokens(cols, draft)
        if exact:
            accept_map[:, r], rounds_used[:, r] = _verify_exact(run, cols, q)
        else:
            accept_map[:, r], rounds_used[:, r] = _verify_autocorrect(run, cols, q, rounds)
    codes = run.visual(g.position(torch.arange(g.height, device=dev)[:, None],
                                  torch.arange(g.width, device=dev)[None, :]).flatten()).view(B, g.height, g.width)
    stats = {"nfe": run.nfe, "draft_calls": run.draft_calls, "tokens_per_pass": g.num_visual_tokens / run.nfe,
             "accept_rate": accept_map.float().mean((1, 2)), "rounds_per_row": rounds_used.float().mean(1),
             "accept_map": accept_map}
    return codes, stats


def _verify_autocorrect(run: _Run, cols: torch.Tensor, q: torch.Tensor, rounds: int):
    """Verify and correct every column each pass; re-verify up to `rounds` times."""
    proposal = q
    first_accept = None
    active = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)  # images still changing
    used = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    for k in range(rounds + 1):
        run.target_pass(int(cols[-1]))  # the row's last candidate is conditioned on, never fed
        p = run.dist(run.hid[:, cols - 1])  # (B, W, Vv): column c from the state before it
        cur = run.visual(cols)
        new, accepted = accept_or_resample(cur, p, proposal, run.gens)
        changed = (new != cur).any(1)  # (B,)
        first_accept = accepted if first_accept is None else first_accept
        used += active.long()
        active &= changed
        run.set_tokens(cols, new)
        proposal = p  # a corrected token is a draw from this round's p: it proposes for the next round
        if not changed.any():
            break
    return first_accept, used


def _verify_exact(run: _Run, cols: torch.Tensor, q: torch.Tensor):
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
