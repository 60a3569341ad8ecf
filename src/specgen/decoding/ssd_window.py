"""SSD's verification window under `carry=True` (see `specgen.decoding.ssd`): which drafted tokens of each image are
not final yet, their proposals, when an image drafts its next row, one target pass over the window, and where the
passes go (per-image change rates and tokens finalised per pass)."""
from __future__ import annotations

from bisect import bisect_left

import torch

from specgen.decoding import ssd_tail
from specgen.decoding.ssd_judge import judge
from specgen.decoding.ssd_pass_stats import PassStats
from specgen.decoding.ssd_rule import CarryRule
from specgen.decoding.state import SpecState


class CarryWindow:
    """Verification window of `carry=True`, per image: the drafted positions not final yet, with proposals.

    Image b's window is its visual positions in [final_upto[b], drafted_upto[b]); the batch's pass covers the
    union (a contiguous run of visual positions, `pos`). Each image moves on by itself: it drafts its next row
    when its window is final or it has spent rounds + 1 passes on its newest row, so no image waits for the
    batch's slowest row. An image that is `max_lead` rows ahead of the slowest one waits (it takes no part in
    passes), which bounds the width of a pass. Random draws are per image and only for its own window, so an
    image's tokens and pass count do not depend on its batch (up to floating-point differences of batched
    matmuls), and batch-1 decoding is the reference of every batch size.

    The per-image bookkeeping (where each window starts and ends, rows, passes) is kept in Python lists, not tensors:
    on a CPU each small tensor op costs microseconds of dispatch, and a pass of batch 1 spent about a fifth of its
    ops on it. Tensors hold what is per token: the window's proposals, which of its tokens are fresh drafts, and the
    first-judgement acceptance map (`accept_map`, (B, H, W))."""

    def __init__(self, st: SpecState, rule: CarryRule, drafter=None):
        B, dev, g = st.B, st.seq.device, st.g
        self.st, self.rule, self.drafter = st, rule, drafter
        self.redraft_rows = g.height if rule.redraft_rows is None else rule.redraft_rows  # re-draft above this row
        self.row_passes = [[0] * g.height for _ in range(B)]  # passes as the frontier row (`max_row_passes`)
        self.final_upto = [g.position(0, 0)] * B
        self.drafted_upto = list(self.final_upto)
        self.next_row = [0] * B  # the row each image drafts next
        self.spent = [0] * B  # passes on the image's newest row
        self.passes = [0] * B  # passes each image took part in
        self.rows_final = [[-1] * g.height for _ in range(B)]  # its passes (prefill included) when a row was final
        self.rounds = [[0] * g.height for _ in range(B)]  # passes each row took within its budget
        self.first_row = [-1] * B  # row awaiting its first pass
        self.accept_map = torch.zeros(B, g.height, g.width, dtype=torch.bool, device=dev)  # first-judgement acceptance
        self.pos = torch.zeros(0, dtype=torch.long, device=dev)  # (n,) union window, ascending
        self.slots: list[int] = []  # the same, as ints
        self.prop = torch.zeros(B, 0, g.num_visual, device=dev)  # (B, n, V) proposal of each window token
        self.fresh = torch.zeros(B, 0, dtype=torch.bool, device=dev)  # (B, n) drafted, not judged yet
        self.stats = PassStats(B, g.width, dev)  # where the passes go (`pass_stats`)
        # max_fed, per image (so that an image's passes are those of batch-1 decoding): its first slot whose state
        # is stale, and how far its states were ever computed (a row is drafted from the row above once it was)
        self.stale = [g.prefix_len] * B
        self.seen = list(self.stale)
        self.recorded = [0] * B  # first-pass acceptance recorded below this slot
        self.front_seen = None  # each image's frontier row when the rows' final passes were last updated (`judge`)
        if rule.reweight:  # the down rows' trunks and states above, per (image, row), kept by the drafting for reweight
            st.memo["down_rows"] = {}

    @property
    def row_final(self) -> torch.Tensor:
        """(B, H) each image's passes (prefill included) when each of its rows was final (-1: not yet)."""
        return torch.tensor(self.rows_final, dtype=torch.long, device=self.st.seq.device)

    @property
    def rounds_used(self) -> torch.Tensor:
        """(B, H) the passes each row took within its budget (its first rounds + 1 passes as the newest row)."""
        return torch.tensor(self.rounds, dtype=torch.long, device=self.st.seq.device)

    def image_passes(self) -> torch.Tensor:
        """(B,) the passes each image took part in, its prefill included."""
        return torch.tensor(self.passes, device=self.st.seq.device).float() + 1

    def floor(self) -> int:
        """The lowest slot whose state a draft or a pass may still read: the one before the slowest image's row
        above, or before the window."""
        g = self.st.g
        above = g.position(max(min(self.next_row) - 1, 0), 0) - 1
        return min(above, min(self.final_upto) - 1)

    def live(self) -> list[bool]:
        """Per image: has it a drafted token that is not final yet."""
        return [f < d for f, d in zip(self.final_upto, self.drafted_upto)]

    def unfinished(self) -> bool:
        """Has an image a row left to draft."""
        return min(self.next_row) < self.st.g.height

    def frontier_row(self, b: int) -> int:
        """The row of image b's first non-final visual token."""
        g = self.st.g  # offset r * stride + c is row r for c < width, and row r + 1 at an end-of-row slot (c >= width)
        return (self.final_upto[b] + (g.stride - g.width - g.prefix_len)) // g.stride

    def wants(self) -> list[bool]:
        """Per image: is its next row due (window final or row budget spent) and within its own window bound: what
        batch-1 decoding would draft now."""
        rule, g = self.rule, self.st.g
        out = []
        for b in range(self.st.B):
            nxt = self.next_row[b]
            ok = (self.final_upto[b] >= self.drafted_upto[b] or self.spent[b] > rule.rounds) and nxt < g.height
            if ok and rule.max_window_rows is not None:  # bounds the tokens fed per pass: rows not final yet
                ok = nxt - self.frontier_row(b) < rule.max_window_rows
            if ok and rule.second_row_wait is not None and nxt == 1:  # the first row's unsettled drafts make poor
                # rows above for down drafts: at most second_row_wait of its tokens not final
                ok = self.final_upto[b] >= g.position(0, g.width - 1) + 1 - rule.second_row_wait
            if ok and rule.max_fed is not None and nxt > 0:  # the row above's states must have been computed
                ok = g.position(nxt - 1, g.width - 1) <= self.seen[b]
            out.append(ok)
        return out

    def lead_ok(self) -> list[bool]:
        """Per image: is it not too far ahead of the batch's slowest unfinished image."""
        H = self.st.g.height
        if self.rule.max_lead is None or self.st.B == 1:  # one image is never ahead of itself
            return [True] * self.st.B
        behind = [r for r in self.next_row if r < H]
        if not behind:
            return [True] * self.st.B
        return [r <= min(behind) + self.rule.max_lead for r in self.next_row]

    def ready(self) -> list[int]:
        """The images that draft their next row now."""
        return [b for b, (w, ok) in enumerate(zip(self.wants(), self.lead_ok())) if w and ok]

    def add(self, images: list[int], rows: list[int], q: torch.Tensor) -> None:
        """Images drafted rows (one each) with proposals (S, W, V): extend their windows."""
        g = self.st.g
        top = g.position(max(rows), g.width - 1) + 1
        last = self.slots[-1] + 1 if self.slots else g.position(min(rows), 0)
        if top > last:  # grow the union window by the visual positions in [last, top)
            extra = [s for s in range(last, top) if g.row_col(s)[1] < g.width]
            self.slots = self.slots + extra
            self.pos = torch.cat([self.pos, torch.tensor(extra, dtype=torch.long, device=self.pos.device)])
            self.prop = torch.cat([self.prop, self.prop.new_zeros(self.st.B, len(extra), g.num_visual)], 1)
            self.fresh = torch.cat([self.fresh, self.fresh.new_zeros(self.st.B, len(extra))], 1)
        for i, (b, r) in enumerate(zip(images, rows)):
            at = bisect_left(self.slots, g.position(r, 0))  # a row's visual positions are consecutive window slots
            self.prop[b, at:at + g.width] = q[i]
            self.fresh[b, at:at + g.width] = True
            self.drafted_upto[b] = g.position(r, g.width - 1) + 1
            self.next_row[b] = r + 1
            self.spent[b] = 0
            self.first_row[b] = r

    def step(self) -> None:
        """One target pass over the union window: accept or correct each live token of the images taking part."""
        siblings = self.sibling_inputs()
        states = self.st.target_pass(self.pass_end(), siblings)
        self.judge(siblings, states)

    def sibling_inputs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Beyond the paper (`siblings` > 0): the alternatives fed with the next pass, slots (B, k) and tokens (B, k),
        or None. Most passes end at a change: the token after it was judged given the replaced token and mostly
        changes in the next pass, which then finalises only it. For each of an image's first k window tokens, the
        pass also feeds its proposal's most likely other token at the same position, seeing only the tokens before
        it. When the pass's first change draws that token, the alternative's state is the state after the change:
        the token after it is judged in the same pass, by the rule the next pass would apply (a carried token
        against the last p), and the pass finalises one more token. Columns no image uses are dropped; an image
        with fewer window tokens repeats its window's last slot with its current token (never a hit: a change
        draws another token)."""
        k = self.rule.siblings
        if not k or self.pos.numel() < 2:
            return None
        pos, B, dev = self.pos, self.st.B, self.pos.device
        n, rows = pos.numel(), torch.arange(B, device=dev)[:, None]
        final_upto = torch.tensor(self.final_upto, device=dev)
        idx = torch.searchsorted(pos, final_upto)[:, None] + torch.arange(k, device=dev)  # (B, k)
        safe = idx.clamp_max(n - 2)
        valid = (idx <= n - 2) & (pos[safe + 1] == pos[safe] + 1)
        valid &= pos[safe] + 1 < torch.tensor(self.drafted_upto, device=dev)[:, None]
        if self.rule.max_fed is not None:  # the token after an alternative is judged in this pass (and it is fed)
            valid &= pos[safe] + 1 <= torch.tensor(self.image_ends(), device=dev)[:, None]
        keep = valid.any(0)
        if not keep.any():
            return None
        cur = self.st.visual(pos)
        prop = self.prop[rows, safe].scatter(-1, cur[rows, safe][..., None], -1.0)  # the current token left out
        slots = torch.where(valid, pos[safe], pos[-1])
        tokens = torch.where(valid, prop.argmax(-1), cur[:, -1:])
        return slots[:, keep], tokens[:, keep]

    def pass_end(self) -> int:
        """The slot a pass over the window feeds up to (exclusive): the window's last token is conditioned on,
        never fed; with `max_fed`, the furthest of the taking-part images' own ends (`image_ends`)."""
        if self.rule.max_fed is None:
            return self.slots[-1]
        ends = [e for e, live, held in zip(self.image_ends(), self.live(), self.wants()) if live and not held]
        return max(ends) if ends else self.slots[-1]

    def image_ends(self) -> list[int]:
        """max_fed, per image: its pass end, at most `max_fed` slots past its first stale one, at most its window's
        last token, at least its window's first token (past an end-of-row slot): what its batch-1 pass would feed up
        to. Its window tokens at slots up to it are judged."""
        g, out = self.st.g, []
        for b in range(self.st.B):
            f = self.final_upto[b]
            first = f + (g.row_col(f)[1] >= g.width)  # its first window token
            out.append(min(self.drafted_upto[b] - 1, max(self.stale[b] + self.rule.max_fed, first)))
        return out

    def judge(self, siblings: tuple[torch.Tensor, torch.Tensor] | None = None,
              states: torch.Tensor | None = None) -> None:
        """After the pass: accept or correct each live token of the images taking part, move their windows on.
        `siblings` / `states`: the alternatives fed with the pass and their states (`sibling_inputs`). An image's
        window is a run of consecutive window slots, `range(lo, hi)`, and so is the part of it the pass judged."""
        st, pos, slots = self.st, self.pos, self.slots
        # its next row due but not drafted (held back by max_lead, or horizontal rows waiting for the batch): the
        # image waits without a pass, as if its next row came at once, so its draws stay its own
        act = [b for b, (live, held) in enumerate(zip(self.live(), self.wants())) if live and not held]
        ends, p = self._judged()
        cur = st.visual(pos)
        new = cur.clone()
        redrafts, acted, moved = [], [], None  # moved: the first slot whose token the pass changed
        for b in act:  # per-image draws, over the image's own window only
            lo = bisect_left(slots, self.final_upto[b])
            top = bisect_left(slots, self.drafted_upto[b])
            hi = top if ends is None else bisect_left(slots, min(self.drafted_upto[b], ends[b] + 1), lo, top)
            if hi <= lo:  # max_fed: the pass ended before this image's window (a batch's union window)
                continue
            acted.append((b, lo, hi))
            change = self._judge_image(b, range(lo, hi), top, None if ends is None else ends[b], cur, new, p,
                                       redrafts, siblings, states)
            if change is not None:
                moved = change if moved is None else min(moved, change)
        st.write_tokens(pos, new, moved)
        if len(acted) == st.B == 1 and acted[0][1:] == (0, len(slots)):  # the whole window: p is every proposal
            self.prop = p.to(self.prop.dtype)
        else:
            for b, lo, hi in acted:
                self.prop[b, lo:hi] = p[b, lo:hi]
        for b, tail, q in redrafts:  # re-drafted tails are judged against their drafts' q next pass
            if tail:
                at = slice(tail[0], tail[-1] + 1)  # consecutive window slots
                self.prop[b, at], self.fresh[b, at] = q, True
        for b, _, _ in acted:
            self.spent[b] += 1
            self.passes[b] += 1
        self._update_final_rows()
        drop = bisect_left(slots, min(self.final_upto))  # drop what every image has finalised
        if drop:
            self.slots = slots[drop:]
            self.pos, self.prop, self.fresh = pos[drop:], self.prop[:, drop:], self.fresh[:, drop:]

    def _judge_image(self, b: int, own: range, top: int, end: int | None, cur: torch.Tensor, new: torch.Tensor,
                     p: torch.Tensor, redrafts: list, siblings: tuple[torch.Tensor, torch.Tensor] | None,
                     states: torch.Tensor | None) -> int | None:
        """Image b's part of `judge`: its judged window slots `own` (its window ends at slot `top`; `end`: its max_fed
        pass end, or None), the tokens as fed (`cur`) and as judged (`new`, written in place), the pass's p. Moves its
        window on, appends its re-drafted tails to `redrafts`; returns the first sequence slot it changed, or None."""
        slots, lo, hi = self.slots, own.start, own.stop
        front = self.frontier_row(b)  # its first non-final row, before this pass
        nb, acc = self._accept(b, lo, hi, cur, p)
        new[b, lo:hi] = nb[0]
        changed = nb[0] != cur[b, lo:hi]
        where = changed.nonzero().flatten().tolist()
        first = where[0] if where else hi - lo - 1
        self.stats.record(b, self.fresh[b, lo:hi].clone(), changed, first)
        self.fresh[b, lo:hi] = False
        if end is not None:  # max_fed: stale from its first change on, else from where its pass ended
            self.stale[b] = slots[lo + first] if where else end
            self.seen[b] = max(self.seen[b], end)
        change = slots[lo + first] if where else None
        if states is not None and where:  # the token after the change, judged in this pass
            first += self._sibling(b, own, first, new, p, siblings, states)
        self.final_upto[b] = slots[lo + first] + 1  # final through the first change (and a sibling's judgement)
        kept = self._cap_rows(b, own, front)
        if self.rule.redraft and where and not kept:
            redrafts.append(ssd_tail.redraft(self, b, range(lo, top), first, new[b]))
        if self.rule.reweight and where and not kept:
            redrafts.append(ssd_tail.reweight(self, b, own, first, cur[b], new[b], p[b]))
        self._record_first_judgement(b, lo, hi, acc[0])
        if self.spent[b] <= self.rule.rounds:  # within the newest row's budget (later passes: carried tokens)
            self.rounds[b][self.next_row[b] - 1] += 1
        return change

    def _update_final_rows(self) -> None:
        """After a pass: where an image's frontier row moved (a row became final), record the passes it took and drop
        the kept down-row drafts of its final rows (a final row is not reweighted any more)."""
        st = self.st
        front = [self.frontier_row(b) for b in range(st.B)]
        if front == self.front_seen:  # no row became final: nothing below changes
            return
        self.front_seen = front
        if "down_rows" in st.memo:
            rows = st.memo["down_rows"]
            for key in [key for key in rows if key[1] < front[key[0]]]:
                del rows[key]
        for b, upto in enumerate(front):
            final = self.rows_final[b]
            for r in range(min(upto, st.g.height)):
                if final[r] < 0:
                    final[r] = self.passes[b] + 1

    def _judged(self) -> tuple[list[int] | None, torch.Tensor]:
        """With `max_fed` the images' pass ends (else None: every window token is judged, the pass fed the whole
        window); and p (B, n, V), each judged token's distribution from the state before it (zeros at slots no image
        judges: never read)."""
        st, pos = self.st, self.pos
        if self.rule.max_fed is None:
            return None, st.dist(st.hid[:, pos - 1])
        ends = self.image_ends()
        upto = bisect_left(self.slots, max(ends) + 1)  # the slots some image judges: up to its own end
        p = st.dist(st.hid[:, pos[:upto] - 1])
        if upto < pos.numel():
            p = torch.cat([p, p.new_zeros(p.shape[0], pos.numel() - upto, p.shape[-1])], 1)
        return ends, p

    def _record_first_judgement(self, b: int, lo: int, hi: int, accepted: torch.Tensor) -> None:
        """Image b's freshly drafted row: the acceptance of each of its tokens at its first judgement (judged at window
        slots [lo, hi), accepted or not), until the row's last token was judged (one pass without `max_fed`)."""
        r, g = self.first_row[b], self.st.g
        if r < 0:
            return
        start, end = g.position(r, 0), g.position(r, g.width - 1) + 1
        i = bisect_left(self.slots, max(start, self.recorded[b]), lo, hi)  # the row's tokens not recorded yet
        j = bisect_left(self.slots, end, i, hi)
        if j > i:  # consecutive window slots hold consecutive columns of one row
            c = self.slots[i] - start
            self.accept_map[b, r, c:c + j - i] = accepted[i - lo:j - lo]
            self.recorded[b] = self.slots[j - 1] + 1
        if self.slots[hi - 1] >= end - 1:  # its last token judged: the map is whole
            self.first_row[b] = -1

    def _accept(self, b: int, lo: int, hi: int, cur: torch.Tensor, p: torch.Tensor):
        """Judge image b's window tokens (window slots [lo, hi)) against the pass's p: (1, n) tokens, (1, n)
        accepted."""
        return judge(self.st, self.rule, cur[b:b + 1, lo:hi], p[b:b + 1, lo:hi], self.prop[b:b + 1, lo:hi],
                     self.fresh[b:b + 1, lo:hi], self.st.image_gens([b]))

    def _sibling(self, b: int, own: range, first: int, new: torch.Tensor, p: torch.Tensor,
                 siblings: tuple[torch.Tensor, torch.Tensor], states: torch.Tensor) -> int:
        """Image b's first change (window slot own[first]) drew a token fed as an alternative: judge the token after
        it against the alternative's state (which replaces the stale state at the changed slot), as the next pass
        would judge it (a carried token, its proposal this pass's p). Writes it into `new`; returns 1, or 0 when no
        alternative matched."""
        st = self.st
        c = self.slots[own[first]]
        alt_slots, tokens = siblings
        match = ((alt_slots[b] == c) & (tokens[b] == new[b, own[first]])).nonzero().flatten()
        if not match.numel() or first + 1 >= len(own) or self.slots[own[first + 1]] != c + 1:
            return 0
        rep = ssd_tail.image_rows(st, b)
        h = states[rep, int(match[0])]  # (reps, D): the state after the drawn token
        st.hid.put(rep, c, h)  # drafts and re-drafts read the state after the final token
        nxt = slice(own[first + 1], own[first + 1] + 1)
        tok = new[b:b + 1, nxt].clone()  # before it is judged (`new` is written below)
        target = st.dist(h)[:, None]  # (1, 1, V)
        out, _ = judge(st, self.rule, tok, target, p[b:b + 1, nxt], None, st.image_gens([b]))  # a carried token
        new[b, nxt] = out[0]
        c_ = self.stats.counts
        c_["sibling_hits"][b] += 1
        c_["finalised"][b] += 1
        c_["carried"][b] += 1
        c_["carried_changed"][b] += (out[0] != tok[0]).float().sum()
        return 1

    def _cap_rows(self, b: int, own: range, front: int) -> int:
        """`max_row_passes`: count the pass for image b's frontier row (`front`: the row of its first token not final
        before the pass; every row above it was final, as in the paper's rounds, where a row is verified after the
        row above is done); if that row is still b's frontier after the pass and has been it `max_row_passes` times,
        it is kept as it stands, as the paper keeps a row after its last round. Its tokens right of this pass's
        first change were judged with a left context that then changed: they are counted as unchecked (and as
        finalised). Only the frontier row can be kept: a row below it has not been the frontier yet. Returns how
        many tokens were kept that way."""
        if self.rule.max_row_passes is None:
            return 0
        self.row_passes[b][front] += 1
        if self.frontier_row(b) != front or self.row_passes[b][front] < self.rule.max_row_passes:
            return 0
        start = self.final_upto[b]
        upto = min(self.st.g.position(front + 1, 0), self.drafted_upto[b])  # through the row's end
        kept = sum(1 for i in own if start <= self.slots[i] < upto)
        self.final_upto[b] = upto
        self.stats.counts["unchecked"][b] += kept
        self.stats.counts["finalised"][b] += kept
        return kept

    def pass_stats(self) -> dict[str, torch.Tensor]:
        """Per image, where the passes went (`ssd_pass_stats.PassStats.summary`)."""
        return self.stats.summary(torch.tensor(self.passes, device=self.st.seq.device))
