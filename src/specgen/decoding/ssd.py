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

from specgen.backbones.protocol import DiscreteBackbone, Prompts
from specgen.decoding.sampling import accept_or_resample, sample_probs
from specgen.decoding.state import SpecState, check_drafter, fit_drafter
from specgen.utils.validate import expect_float, expect_int


def _draft_right(st: SpecState, drafter, start: int, row: int,
                 draft_temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain f_phi.right from the target state at `start` through known tokens into row `row`."""
    g = st.g
    h = st.hid[:, start]  # (B', D)
    tokens_out = getattr(drafter, "predicts", "hidden") == "tokens"  # ablation: the drafter gives code logits
    is_state = True  # h is a target state until the drafter has run once
    first = g.position(row, 0)
    codes, qs = [], []
    for pos in range(start + 1, g.position(row, g.width - 1) + 1):
        if pos >= first and (pos - first) % g.stride < g.width:  # a visual token of this row: draft it
            q = st.dist(h, draft_temperature) if is_state else st.dist_logits(h, draft_temperature)  # (B, Vv)
            tok = sample_probs(q, st.rngs)
            codes.append(tok)
            qs.append(q)
            ids = tok.repeat(st.reps)
        else:  # a token already known (previous row, end-of-row)
            ids = st.seq[:, pos]
        if pos < g.position(row, g.width - 1):
            h = drafter.right(h, st.embed(ids))
            is_state = not tokens_out
            st.draft_calls += 1
    return torch.stack(codes, 1), torch.stack(qs, 1)  # (B, W), (B, W, Vv)


def _draft_down(st: SpecState, drafter, rows: torch.Tensor, images: torch.Tensor | None = None,
                draft_temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` (S,) of images `images` (S,; default: every image), all columns at once:
    f_phi.down(h_{P(r-1, c) - 1}, e(x_{r-1, c})) on the row above."""
    g = st.g
    images = torch.arange(st.B, device=rows.device) if images is None else images
    above = g.position(rows[:, None] - 1, torch.arange(g.width, device=rows.device)).repeat(st.reps, 1)  # (S', W)
    rep = torch.cat([images + k * st.B for k in range(st.reps)])[:, None]  # (S', 1): the images' CFG rows
    if getattr(drafter, "left_context", False):
        return _draft_down_left(st, drafter, above, rep, images, draft_temperature)
    h = drafter.down(st.hid[rep, above - 1], st.embed(st.seq[rep, above]))  # (S', W, D) or code logits
    st.draft_calls += 1
    tokens_out = getattr(drafter, "predicts", "hidden") == "tokens"
    q = st.dist_logits(h, draft_temperature) if tokens_out else st.dist(h, draft_temperature)
    return sample_probs(q, st.image_gens(images)), q


def _draft_down_left(st: SpecState, drafter, above: torch.Tensor, rep: torch.Tensor, images: torch.Tensor,
                     draft_temperature: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Down drafts with left context: the row trunk once, then column by column from the previous column's draft."""
    g = st.g
    hidden = st.hid[rep, above - 1]  # (S', W, D)
    trunk = drafter.down_trunk(hidden, st.embed(st.seq[rep, above]))  # (S', W, width)
    prev = st.seq[rep[:, 0], above[:, 0] + g.stride - 1]  # (S',) the token before column 0 (end-of-row or last)
    codes, qs = [], []
    for c in range(g.width):
        state = drafter.down_column(trunk[:, c], hidden[:, c], st.embed(prev))  # (S', D)
        q = st.dist(state, draft_temperature)  # (S, V)
        tok = sample_probs(q, st.image_gens(images))
        codes.append(tok)
        qs.append(q)
        prev = tok.repeat(st.reps)
    st.draft_calls += g.width
    return torch.stack(codes, 1), torch.stack(qs, 1)  # (S, W), (S, W, V)


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, drafter, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, rngs=None, rounds: int = 2,
             exact: bool = False, vertical: bool = True, carry: bool = False,
             draft_temperature: float | None = None, max_lead: int | None = 2, max_window_rows: int | None = None,
             redraft: int = 0):
    """SSD sampling of visual codes (B, H, W). Returns (codes, stats).
    `draft_temperature` (default: `temperature`) warps the drafted distribution q only; 0 drafts the argmax
    (q one-hot). Verification divides by the q the draft was drawn from, so exact mode stays lossless.
    `max_lead` (carry only): how many rows an image may run ahead of the batch's slowest (null: no bound);
    `max_window_rows` (carry only): an image drafts its next row only while fewer of its rows than this are not
    final, which bounds the tokens fed per pass (null: no bound; the row budget `rounds` alone decides);
    `redraft` (carry only, beyond the paper): after a pass, up to this many tokens right of an image's first change
    (in its row) are drafted again by f_phi.right from the fresh state before the change, instead of being carried
    with values that were judged given the replaced token (0: off, the carry rule as it was).
    stats["nfe"] counts target passes over the batch (one forward of the batch counts once);
    with carry, stats["image_passes"] counts, per image, the passes it took part in (prefill included)."""
    if carry and exact:
        raise ValueError("carry=True and exact=True do not combine: exact verification finalises tokens left to "
                         "right and never carries any; set one of them to false")
    expect_int("rounds", rounds, 0)
    if max_lead is not None:
        expect_int("max_lead", max_lead, 0)
    if max_window_rows is not None:
        expect_int("max_window_rows", max_window_rows, 1)
    expect_int("redraft", redraft, 0)
    if redraft and not carry:
        raise ValueError(f"redraft={redraft} re-drafts tokens carried to the next pass and needs carry=true (the "
                         f"paper's rule keeps no carried tokens); set redraft=0 or carry=true")
    if redraft and getattr(drafter, "predicts", "hidden") == "tokens":
        raise ValueError(f"redraft={redraft} chains f_phi.right from a target state and needs a hidden-state "
                         f"drafter; this one predicts token ids: set redraft=0")
    expect_float("temperature", temperature, 0.0)
    if draft_temperature is not None:
        expect_float("draft_temperature", draft_temperature, 0.0)
    check_drafter(backbone, drafter, ("right", "down") if vertical else ("right",))
    drafter = fit_drafter(backbone, drafter)
    st = SpecState(backbone, prompts, cfg_scale, temperature, top_k, rngs)
    g, B, dev = st.g, st.B, st.seq.device
    st.target_pass(g.prefix_len)  # prefill: prompt slot and begin-of-image
    if carry:
        return _generate_carry(st, drafter, rounds, vertical, max_lead, max_window_rows, draft_temperature, redraft)
    accept_map = torch.zeros(B, g.height, g.width, dtype=torch.bool, device=dev)
    rounds_used = torch.zeros(B, g.height, dtype=torch.long, device=dev)
    unchecked = torch.zeros(B, dtype=torch.long, device=dev)  # tokens never checked against their final context
    for r in range(g.height):
        cols = g.position(r, torch.arange(g.width, device=dev))  # (W,)
        if r:  # drafts read the row above's states from the one before its first token on
            st.hid.release(g.position(r - 1, 0) - 1)
        if r == 0 or not vertical:
            start = g.prefix_len - 1 if r == 0 else g.position(r - 1, g.width - 1) - 1
            draft, q = _draft_right(st, drafter, start, r, draft_temperature)
        else:
            draft, q = _draft_down(st, drafter, torch.full((B,), r, device=dev), None, draft_temperature)
        st.set_tokens(cols, draft)
        if exact:
            accept_map[:, r], rounds_used[:, r] = _verify_exact(st, cols, q)
        else:
            accept_map[:, r], rounds_used[:, r], row_unchecked = _verify_autocorrect(st, cols, q, rounds)
            unchecked += row_unchecked
    codes = st.codes()
    stats = {"nfe": st.nfe, "draft_calls": st.draft_calls, "tokens_per_pass": g.num_visual_tokens / st.nfe,
             "accept_rate": accept_map.float().mean((1, 2)), "rounds_per_row": rounds_used.float().mean(1),
             "accept_map": accept_map, "unchecked_tokens": unchecked.float(), "state_slots": st.hid.peak_slots}
    return codes, stats


def _verify_autocorrect(st: SpecState, cols: torch.Tensor, q: torch.Tensor, rounds: int):
    """Verify and correct every column each pass; re-verify up to `rounds` times."""
    proposal = q
    first_accept = None
    active = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)  # images still changing
    used = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    W = cols.numel()
    for k in range(rounds + 1):
        st.target_pass(int(cols[-1]))  # the row's last candidate is conditioned on, never fed
        p = st.dist(st.hid[:, cols - 1])  # (B, W, Vv): column c from the state before it
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
    # columns right of the last pass's first change were judged with a left context that then changed
    unchecked = torch.where(changed, W - 1 - changes.float().argmax(1).long(), torch.zeros_like(used))
    return first_accept, used, unchecked


class _Window:
    """Verification window of `carry=True`, per image: the drafted positions not final yet, with proposals.

    Image b's window is its visual positions in [final_upto[b], drafted_upto[b]); the batch's pass covers the
    union (a contiguous run of visual positions, `pos`). Each image moves on by itself: it drafts its next row
    when its window is final or it has spent rounds + 1 passes on its newest row, so no image waits for the
    batch's slowest row. An image that is `max_lead` rows ahead of the slowest one waits (it takes no part in
    passes), which bounds the width of a pass. Random draws are per image and only for its own window, so an
    image's tokens and pass count do not depend on its batch (up to floating-point differences of batched
    matmuls), and batch-1 decoding is the reference of every batch size."""

    def __init__(self, st: SpecState, rounds: int, max_lead: int | None, max_window_rows: int | None = None,
                 redraft: int = 0, drafter=None, draft_temperature: float | None = None):
        B, dev, g = st.B, st.seq.device, st.g
        self.st, self.rounds, self.max_lead, self.max_window_rows = st, rounds, max_lead, max_window_rows
        self.redraft, self.drafter, self.draft_temperature = redraft, drafter, draft_temperature
        self.final_upto = torch.full((B,), g.position(0, 0), dtype=torch.long, device=dev)
        self.drafted_upto = self.final_upto.clone()
        self.next_row = torch.zeros(B, dtype=torch.long, device=dev)  # the row each image drafts next
        self.spent = torch.zeros(B, dtype=torch.long, device=dev)  # passes on the image's newest row
        self.passes = torch.zeros(B, dtype=torch.long, device=dev)  # passes each image took part in
        self.first_row = torch.full((B,), -1, dtype=torch.long, device=dev)  # row awaiting its first pass
        self.pos = torch.zeros(0, dtype=torch.long, device=dev)  # (n,) union window, ascending
        self.prop = torch.zeros(B, 0, g.num_visual, device=dev)  # (B, n, V) proposal of each window token
        self.fresh = torch.zeros(B, 0, dtype=torch.bool, device=dev)  # (B, n) drafted, not judged yet
        # where the passes go, per image: tokens judged fresh (proposal q) or carried (proposal: the last p), how many
        # of each changed, tokens finalised, and passes whose first change fell on a fresh draft
        self.counts = {k: torch.zeros(B, device=dev) for k in
                       ("fresh", "fresh_changed", "carried", "carried_changed", "finalised", "first_on_fresh", "changed")}

    def floor(self) -> int:
        """The lowest slot whose state a draft or a pass may still read: the one before the slowest image's row
        above, or before the window."""
        g = self.st.g
        above = g.position(max(int(self.next_row.min()) - 1, 0), 0) - 1
        return min(above, int(self.final_upto.min()) - 1)

    def live(self) -> torch.Tensor:
        """(B,) images with a drafted token that is not final yet."""
        return self.final_upto < self.drafted_upto

    def frontier_row(self) -> torch.Tensor:
        """(B,) the row of each image's first non-final visual token."""
        g = self.st.g
        off = self.final_upto - g.prefix_len
        return off // g.stride + (off % g.stride >= g.width).long()  # an end-of-row slot: the next row

    def wants(self) -> torch.Tensor:
        """(B,) images whose next row is due (window final or row budget spent) and within their own window bound:
        what batch-1 decoding would draft now."""
        ok = (~self.live() | (self.spent > self.rounds)) & (self.next_row < self.st.g.height)
        if self.max_window_rows is not None:  # bounds the tokens fed per pass: rows not final yet, the new one included
            ok &= self.next_row - self.frontier_row() < self.max_window_rows
        return ok

    def lead_ok(self) -> torch.Tensor:
        """(B,) images not too far ahead of the batch's slowest unfinished image."""
        unfinished = self.next_row < self.st.g.height
        if self.max_lead is None or not unfinished.any():
            return torch.ones_like(unfinished)
        return self.next_row <= self.next_row[unfinished].min() + self.max_lead

    def ready(self) -> torch.Tensor:
        """(B,) images that draft their next row now."""
        return self.wants() & self.lead_ok()

    def add(self, images: torch.Tensor, rows: torch.Tensor, q: torch.Tensor) -> None:
        """Images (S,) drafted rows (S,) with proposals (S, W, V): extend their windows."""
        g = self.st.g
        cols = g.position(rows[:, None], torch.arange(g.width, device=rows.device))  # (S, W)
        top = int(cols.max()) + 1
        last = int(self.pos[-1]) + 1 if self.pos.numel() else int(cols.min())
        if top > last:  # grow the union window by the visual positions in [last, top)
            extra = torch.arange(last, top, device=rows.device)
            extra = extra[g.row_col(extra)[1] < g.width]
            self.pos = torch.cat([self.pos, extra])
            self.prop = torch.cat([self.prop, self.prop.new_zeros(self.st.B, extra.numel(), g.num_visual)], 1)
            self.fresh = torch.cat([self.fresh, self.fresh.new_zeros(self.st.B, extra.numel())], 1)
        idx = torch.searchsorted(self.pos, cols)  # (S, W) window slots of the drafted positions
        self.prop[images[:, None], idx] = q
        self.fresh[images[:, None], idx] = True
        self.drafted_upto[images] = cols[:, -1] + 1
        self.next_row[images] = rows + 1
        self.spent[images] = 0
        self.first_row[images] = rows

    def step(self, accept_map: torch.Tensor, rounds_used: torch.Tensor) -> None:
        """One target pass over the union window: accept or correct each live token of the images taking part."""
        st, g, pos = self.st, self.st.g, self.pos
        # its next row due but not drafted (held back by max_lead, or horizontal rows waiting for the batch): the
        # image waits without a pass, as if its next row came at once, so its draws stay its own
        held = self.wants()
        act = (self.live() & ~held).nonzero().flatten()
        st.target_pass(int(pos[-1]))  # the window's last token is conditioned on, never fed
        p = st.dist(st.hid[:, pos - 1])  # (B, n, V): each window token from the state before it
        cur = st.visual(pos)
        new = cur.clone()
        redrafts = []
        for b in act.tolist():  # per-image draws, over the image's own window only
            own = ((pos >= self.final_upto[b]) & (pos < self.drafted_upto[b])).nonzero().flatten()
            nb, acc = accept_or_resample(cur[b:b + 1, own], p[b:b + 1, own], self.prop[b:b + 1, own], st.image_gens([b]))
            new[b, own] = nb[0]
            changed = nb[0] != cur[b, own]
            first = int(changed.float().argmax()) if changed.any() else own.numel() - 1
            self.final_upto[b] = pos[own[first]] + 1  # final through the first change
            self._count(b, own, changed, first)
            if self.redraft and changed.any():
                redrafts.append(self._redraft(b, own, first, new[b]))
            r = int(self.first_row[b])
            if r >= 0:  # the first pass over a freshly drafted row: its acceptance map
                row = g.row_col(pos[own])[0] == r
                accept_map[b, r] = acc[0, row]
                self.first_row[b] = -1
            if self.spent[b] <= self.rounds:  # within the newest row's budget (later passes: carried tokens)
                rounds_used[b, int(self.next_row[b]) - 1] += 1
        st.set_tokens(pos, new)
        self.prop = torch.where(torch.isin(torch.arange(st.B, device=pos.device), act)[:, None, None], p, self.prop)
        for b, slots, q in redrafts:  # re-drafted tails are judged against their drafts' q next pass
            self.prop[b, slots], self.fresh[b, slots] = q, True
        self.spent[act] += 1
        self.passes[act] += 1
        keep = pos >= int(self.final_upto.min())  # drop what every image has finalised
        self.pos, self.prop, self.fresh = pos[keep], self.prop[:, keep], self.fresh[:, keep]

    def _redraft(self, b: int, own: torch.Tensor, first: int, tokens: torch.Tensor):
        """Re-draft image b's tokens after its first change, up to `redraft` of them in the changed token's row, by
        chaining f_phi.right from the target state before the change (fresh: every token before it is final) through
        the corrected token. Their old values were judged (or resampled) given the token the change replaced: the
        stale left context that makes carried tokens change. Writes the drafts into `tokens` (n,) at the window's
        slots; returns (b, slots, q) for the proposals."""
        st, g, pos = self.st, self.st.g, self.pos
        at = int(pos[own[first]])
        tail = own[first + 1: first + 1 + self.redraft]
        tail = tail[g.row_col(pos[tail])[0] == g.row_col(pos[own[first]])[0]]  # the changed token's row only
        if not tail.numel():
            return b, tail, self.prop.new_zeros(0, g.num_visual)
        rep = torch.tensor([b + k * st.B for k in range(st.reps)], device=pos.device)
        h, tok, qs = st.hid[rep, at - 1], tokens[own[first]].view(1), []
        for slot in tail.tolist():
            h = self.drafter.right(h, st.embed(tok.repeat(st.reps)))  # (reps, D): the state after `tok`
            q = st.dist(h, self.draft_temperature)  # (1, V)
            tok = sample_probs(q, st.image_gens([b]))
            tokens[slot] = tok[0]
            qs.append(q[0])
        st.draft_calls += tail.numel()
        return b, tail, torch.stack(qs)

    def _count(self, b: int, own: torch.Tensor, changed: torch.Tensor, first: int) -> None:
        """Add image b's pass to its counts (its window slots `own`, which of them changed, the first change)."""
        fresh, c = self.fresh[b, own], self.counts
        c["fresh"][b] += fresh.sum()
        c["fresh_changed"][b] += (changed & fresh).sum()
        c["carried"][b] += (~fresh).sum()
        c["carried_changed"][b] += (changed & ~fresh).sum()
        c["finalised"][b] += first + 1
        if changed.any():
            c["changed"][b] += 1
            c["first_on_fresh"][b] += fresh[first].float()
        self.fresh[b, own] = False

    def pass_stats(self) -> dict[str, torch.Tensor]:
        """(B,) per image: change rates of fresh drafts and of carried tokens, tokens finalised per pass, and the
        share of passes with a change whose first change (what ends the pass's progress) was a fresh draft."""
        c, div = self.counts, lambda a, b: a / b.clamp_min(1)  # noqa: E731
        return {"fresh_change_rate": div(c["fresh_changed"], c["fresh"]),
                "carried_change_rate": div(c["carried_changed"], c["carried"]),
                "final_per_pass": div(c["finalised"], self.passes.float()),
                "first_change_fresh": div(c["first_on_fresh"], c["changed"])}


def _generate_carry(st: SpecState, drafter, rounds: int, vertical: bool, max_lead: int | None,
                    max_window_rows: int | None, draft_temperature: float | None, redraft: int = 0):
    """`carry=True`: per-image rows over one verification window (see `_Window`)."""
    g, B = st.g, st.B
    dev = st.seq.device
    win = _Window(st, rounds, max_lead, max_window_rows, redraft, drafter, draft_temperature)
    accept_map = torch.zeros(B, g.height, g.width, dtype=torch.bool, device=dev)
    rounds_used = torch.zeros(B, g.height, dtype=torch.long, device=dev)
    flush = 0
    while True:
        st.hid.release(win.floor())
        ready = win.ready()
        if ready.any():
            images = ready.nonzero().flatten()
            rows = win.next_row[images]
            if vertical and int(rows.min()) > 0:
                draft, q = _draft_down(st, drafter, rows, images, draft_temperature)
            else:  # horizontal rows are drafted for the whole batch at once (one chain of right steps)
                if not bool(ready.all()) or int(rows.max()) != int(rows.min()):
                    images = None
                else:
                    r = int(rows[0])
                    start = g.prefix_len - 1 if r == 0 else g.position(r - 1, g.width - 1) - 1
                    draft, q = _draft_right(st, drafter, start, r, draft_temperature)
            if images is not None:
                st.set_tokens(g.position(rows[:, None], torch.arange(g.width, device=dev)), draft, images)
                win.add(images, rows, q)
        if not win.live().any():
            if not (win.next_row < g.height).any():
                break
            continue
        if not (win.next_row < g.height).any():
            flush += 1
        win.step(accept_map, rounds_used)
    codes = st.codes()
    return codes, {"nfe": st.nfe, "draft_calls": st.draft_calls, "tokens_per_pass": g.num_visual_tokens / st.nfe,
                   "accept_rate": accept_map.float().mean((1, 2)), "rounds_per_row": rounds_used.float().mean(1),
                   "accept_map": accept_map, "unchecked_tokens": torch.zeros(B, device=dev),
                   "image_passes": (win.passes + 1).float(), "flush_passes": flush, "state_slots": st.hid.peak_slots,
                   **win.pass_stats()}


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
