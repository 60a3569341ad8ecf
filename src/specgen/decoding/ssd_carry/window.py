"""The carry window (`ssd_carry.generate`): which drafted tokens of each image are not final yet, their proposals,
when an image drafts its next row, one target pass over the window, and where the passes go (per-image change rates
and tokens finalised per pass)."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from specgen.decoding.ssd_carry.stats import PassStats
from specgen.decoding.ssd_drafting import Drafting
from specgen.decoding.state import SpecState


@dataclass(frozen=True)
class Schedule:
    """When an image drafts its next row. rounds: passes on its newest row before the next is due (a row's budget,
    rounds + 1 passes); max_lead: rows an image may run ahead of the batch's slowest (None: no bound);
    max_window_rows: the next row is drafted only while fewer of the image's rows than this are not final (bounds
    the tokens fed per pass; None: no bound); second_row_wait: the second row is drafted only once at most this many
    of the first row's tokens are not final (down drafts from an unsettled first row are mostly rejected; None: no
    wait)."""

    rounds: int
    max_lead: int | None
    max_window_rows: int | None
    second_row_wait: int | None


class CarryWindow:
    """Verification window per image: the drafted positions not final yet, with proposals.

    Image b's window is its visual positions in [final_upto[b], drafted_upto[b]); the batch's pass covers the
    union (a contiguous run of visual positions, `pos`). After a pass, an image's tokens are final through its first
    change (drawn from p given a final left context); the tokens after it stay in the window, carried with this
    pass's p as their proposal. Each image moves on by itself (`Schedule`), so no image waits for the batch's
    slowest row. Random draws are per image and only for its own window, so an image's tokens and pass count do not
    depend on its batch (up to floating-point differences of batched matmuls), and batch-1 decoding is the
    reference of every batch size.

    The per-image bookkeeping (where each window starts and ends, rows, passes, which window tokens are fresh drafts,
    the first-judgement acceptance of each token) is kept in Python lists: on a CPU each small tensor op costs
    microseconds of dispatch. Tensors hold the window's proposals (B, n, V); `accept_map` (B, H, W) is built from the
    lists when read."""

    def __init__(self, st: SpecState, schedule: Schedule, drafting: Drafting, tails=(), acceptance=None):
        B, dev, g = st.B, st.seq.device, st.g
        self.st, self.schedule, self.drafting, self.tails = st, schedule, drafting, tuple(tails)
        self.acceptance, self.judgement = acceptance, acceptance.bind(st)
        self.final_upto = [g.position(0, 0)] * B
        self.drafted_upto = list(self.final_upto)
        self.next_row = [0] * B  # the row each image drafts next
        self.spent = [0] * B  # passes on the image's newest row
        self.passes = [0] * B  # passes each image took part in
        self.rows_final = [[-1] * g.height for _ in range(B)]  # its passes (prefill included) when a row was final
        self.rounds = [[0] * g.height for _ in range(B)]  # passes each row took within its budget
        self.first_row = [-1] * B  # row awaiting its first pass
        self.accepted = [[[False] * g.width for _ in range(g.height)] for _ in range(B)]  # first-judgement acceptance
        self.pos = torch.zeros(0, dtype=torch.long, device=dev)  # (n,) union window, ascending
        self.slots: list[int] = []  # the same, as ints
        self.prop = torch.zeros(B, 0, g.num_visual, device=dev)  # (B, n, V) proposal of each window token
        self.fresh: list[list[bool]] = [[] for _ in range(B)]  # per image and window slot: drafted, not judged yet
        self.reads_fresh = getattr(acceptance, "reads_fresh", True)  # whether the test reads those flags
        self.stats = PassStats(B, g.width, dev)  # where the passes go (`pass_stats`)
        self.recorded = [0] * B  # first-pass acceptance recorded below this slot
        self.front_seen = None  # each image's frontier row when the rows' final passes were last updated

    @property
    def accept_map(self) -> torch.Tensor:
        """(B, H, W) whether each token was accepted at its first judgement."""
        return torch.tensor(self.accepted, dtype=torch.bool, device=self.st.seq.device)

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
        sch, g = self.schedule, self.st.g
        out = []
        for b in range(self.st.B):
            nxt = self.next_row[b]
            ok = (self.final_upto[b] >= self.drafted_upto[b] or self.spent[b] > sch.rounds) and nxt < g.height
            if ok and sch.max_window_rows is not None:
                ok = nxt - self.frontier_row(b) < sch.max_window_rows
            if ok and sch.second_row_wait is not None and nxt == 1:
                ok = self.final_upto[b] >= g.position(0, g.width - 1) + 1 - sch.second_row_wait
            out.append(ok)
        return out

    def lead_ok(self) -> list[bool]:
        """Per image: is it not too far ahead of the batch's slowest unfinished image."""
        H = self.st.g.height
        if self.schedule.max_lead is None or self.st.B == 1:  # one image is never ahead of itself
            return [True] * self.st.B
        behind = [r for r in self.next_row if r < H]
        if not behind:
            return [True] * self.st.B
        return [r <= min(behind) + self.schedule.max_lead for r in self.next_row]

    def ready(self) -> list[int]:
        """The images that draft their next row now."""
        return [b for b, (w, ok) in enumerate(zip(self.wants(), self.lead_ok())) if w and ok]

    def draft_due(self, vertical: bool) -> None:
        """Release the states no draft or pass reads any more, and draft the rows that are due (`ready`)."""
        due = self.due(vertical)
        if due is not None:
            self.place(*due, *self.draft(*due, vertical))

    def due(self, vertical: bool) -> tuple[list[int], list[int]] | None:
        """Release the states no draft or pass reads any more; the images that draft a row now and their rows, or
        None (no image is due, or horizontal rows waiting for the batch)."""
        self.st.hid.release(self.floor())
        images = self.ready()
        if not images:
            return None
        rows = [self.next_row[b] for b in images]
        if not (vertical and min(rows) > 0) and (len(images) < self.st.B or max(rows) != min(rows)):
            return None  # horizontal rows are drafted for the whole batch at once (one chain of right steps)
        return images, rows

    def draft(self, images: list[int], rows: list[int], vertical: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts (S, W) and proposals (S, W, V) of the rows `due` gave: down from the row above, or (row 0,
        horizontal-only) chained right."""
        st, dev = self.st, self.st.seq.device
        every = len(images) == st.B and min(rows) == max(rows)  # one row of every image: no index tensors
        if vertical and min(rows) > 0:
            return self.drafting.down(rows[0] if every else torch.tensor(rows, device=dev),
                                      None if every else torch.tensor(images, device=dev))
        return self.drafting.right(rows[0])

    def place(self, images: list[int], rows: list[int], draft: torch.Tensor, q: torch.Tensor) -> None:
        """Write drafted rows in the images' sequences and windows."""
        st, g, dev = self.st, self.st.g, self.st.seq.device
        if len(images) == st.B and min(rows) == max(rows):
            start = g.position(rows[0], 0)
            st.set_tokens(torch.arange(start, start + g.width, device=dev), draft)
        else:
            cols = torch.tensor([g.position(r, 0) for r in rows], device=dev)[:, None] + torch.arange(g.width, device=dev)
            st.set_tokens(cols, draft, torch.tensor(images, device=dev))
        self.add(images, rows, q)

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
            for flags in self.fresh:
                flags.extend([False] * len(extra))
        for i, (b, r) in enumerate(zip(images, rows)):
            at = bisect_left(self.slots, g.position(r, 0))  # a row's visual positions are consecutive window slots
            _span(self.prop, b, at, g.width).copy_(q[i])
            self.fresh[b][at:at + g.width] = [True] * g.width
            self.drafted_upto[b] = g.position(r, g.width - 1) + 1
            self.next_row[b] = r + 1
            self.spent[b] = 0
            self.first_row[b] = r

    def step(self) -> None:
        """One target pass over the union window (its last token is conditioned on, never fed), then `judge`."""
        self.st.target_pass(self.slots[-1])
        self.judge()

    def judge(self) -> None:
        """After the pass: accept or correct each live token of the images taking part, move their windows on. An
        image whose next row is due but not drafted (held back by max_lead, or horizontal rows waiting for the batch)
        waits without a pass, as if its next row came at once, so its draws stay its own."""
        drive(self.judging(), self.judgement)

    def judging(self):
        """`judge` as a generator that asks for each image's judgement: it yields the judgement's arguments (tokens
        (1, n), p and q (1, n, V), fresh flags, the image's generators) and takes back (tokens, accepted), so that a
        stream can judge its images' windows in one call (`acceptance.Speculative.together`)."""
        st, pos, slots = self.st, self.pos, self.slots
        act = [b for b, (live, held) in enumerate(zip(self.live(), self.wants())) if live and not held]
        p = st.dist(st.hid.read(slice(None), pos - 1, slots[0] - 1, slots[-1] - 1))
        cur = st.visual(pos)
        # batch 1 with its window the whole window (every pass but the first of a row): judged without views
        whole = len(act) == st.B == 1 and self.final_upto[0] <= slots[0] and self.drafted_upto[0] > slots[-1]
        new = None if whole else cur.clone()
        proposals, acted, moved = [], [], None  # moved: the first slot whose token the pass changed
        for b in act:  # per-image draws, over the image's own window only: a run of window slots [lo, hi)
            lo, hi = (0, len(slots)) if whole else (bisect_left(slots, self.final_upto[b]),
                                                    bisect_left(slots, self.drafted_upto[b]))
            acted.append((b, lo, hi))
            change, judged = yield from self._judge_image(b, range(lo, hi), cur, new, p, proposals)
            new = judged if whole else new
            if change is not None:
                moved = change if moved is None else min(moved, change)
        st.write_tokens(pos, new, moved)  # `new`: the whole window's judged tokens (batch 1) or every image's
        if whole:  # p is every proposal
            self.prop = p if p.dtype == self.prop.dtype else p.to(self.prop.dtype)
        else:
            for b, lo, hi in acted:
                self.prop[b, lo:hi] = p[b, lo:hi]
        for b, tail, q in proposals:  # a tail's new tokens are judged against its proposals next pass
            if tail:  # consecutive window slots
                _span(self.prop, b, tail[0], len(tail)).copy_(q)
                self.fresh[b][tail[0]:tail[0] + len(tail)] = [True] * len(tail)
        for b, _, _ in acted:
            self.spent[b] += 1
            self.passes[b] += 1
        self._update_final_rows()
        drop = bisect_left(slots, min(self.final_upto))  # drop what every image has finalised
        if drop:
            self.slots = slots[drop:]
            self.pos, self.prop = pos[drop:], self.prop[:, drop:]
            self.fresh = [flags[drop:] for flags in self.fresh]

    def _judge_image(self, b: int, own: range, cur: torch.Tensor, new: torch.Tensor | None, p: torch.Tensor,
                     proposals: list):
        """Image b's part of `judging` (a generator: it yields its judgement's arguments): its window slots `own`, the
        tokens as fed (`cur`) and as judged (`new`, written in place; None: the image's window is the whole batch-1
        window, judged without views), the pass's p. Moves its window on, appends a tail's proposals to `proposals`;
        returns the first sequence slot it changed (or None) and the judged tokens (1, n)."""
        slots, lo, hi = self.slots, own.start, own.stop
        part = (lambda t: t) if new is None else (lambda t: t[b:b + 1, lo:hi])  # noqa: E731
        fed, fresh = part(cur), self.fresh[b][lo:hi]
        flags = torch.tensor([fresh], dtype=torch.bool, device=cur.device) if self.reads_fresh else None
        nb, acc = yield fed, part(p), part(self.prop), flags, self.st.image_gens([b])
        if new is not None:
            new[b, lo:hi] = nb[0]
        changed = nb != fed  # (1, n)
        first = next((i for i, c in enumerate(changed.tolist()[0]) if c), None)  # the first change, found in Python
        where = first is not None
        first = hi - lo - 1 if first is None else first
        self.stats.record(b, fresh, changed, first)
        self.fresh[b][lo:hi] = [False] * (hi - lo)
        self.final_upto[b] = slots[lo + first] + 1  # final through the first change
        if where and self.tails:
            row = self.st.g.row_col(slots[lo + first])[0]
            tail = next((t for t in self.tails if t.serves(row)), None)
            if tail is not None:
                judged = nb[0] if new is None else new[b]
                proposals.append((b, *tail.propose(self, b, own, first, cur[b], judged, p[b])))
        if self.first_row[b] >= 0:
            self._record_first_judgement(b, lo, hi, acc.tolist()[0])
        if self.spent[b] <= self.schedule.rounds:  # within the newest row's budget (later passes: carried tokens)
            self.rounds[b][self.next_row[b] - 1] += 1
        return (slots[lo + first] if where else None), nb

    def _update_final_rows(self) -> None:
        """After a pass: where an image's frontier row moved (a row became final), record the passes it took and drop
        the kept down-row drafts of its final rows (a final row is not proposed again)."""
        front = [self.frontier_row(b) for b in range(self.st.B)]
        if front == self.front_seen:  # no row became final: nothing below changes
            return
        self.front_seen = front
        self.drafting.drop_rows(front)
        for b, upto in enumerate(front):
            final = self.rows_final[b]
            for r in range(min(upto, self.st.g.height)):
                if final[r] < 0:
                    final[r] = self.passes[b] + 1

    def _record_first_judgement(self, b: int, lo: int, hi: int, accepted: list[bool]) -> None:
        """Image b's freshly drafted row: the acceptance of each of its tokens (window slots [lo, hi)) at its first
        judgement."""
        r, g = self.first_row[b], self.st.g  # the caller checks that a row awaits its first judgement (r >= 0)
        start, end = g.position(r, 0), g.position(r, g.width - 1) + 1
        i = bisect_left(self.slots, max(start, self.recorded[b]), lo, hi)  # the row's tokens not recorded yet
        j = bisect_left(self.slots, end, i, hi)
        if j > i:  # consecutive window slots hold consecutive columns of one row
            c = self.slots[i] - start
            self.accepted[b][r][c:c + j - i] = accepted[i - lo:j - lo]
            self.recorded[b] = self.slots[j - 1] + 1
        if self.slots[hi - 1] >= end - 1:  # its last token judged: the map is whole
            self.first_row[b] = -1

    def pass_stats(self) -> dict[str, torch.Tensor]:
        """Per image, where the passes went (`stats.PassStats.summary`)."""
        return self.stats.summary(torch.tensor(self.passes, device=self.st.seq.device))


def drive(judging, judgement) -> None:
    """Run a window's `judging` generator to its end, each judgement asked of it made by `judgement`."""
    reply = None
    while True:
        try:
            item = judging.send(reply)
        except StopIteration:
            return
        reply = judgement(*item)


def judge_together(windows: list[CarryWindow]) -> None:
    """Judge the windows of several images (a stream's, each of batch 1) after a shared pass, their judgements in one
    call where the acceptance rule can (`together`) and every image draws from its own generator; otherwise one
    window after another. Every token is the one each window's `judge` gives alone: an image's draws come from its
    own generator in the same order, and the tail proposals after its judgement draw after it, as alone."""
    together = getattr(windows[0].acceptance, "together", None) if windows else None
    if together is None or any(w.st.rngs is None for w in windows):
        for w in windows:
            w.judge()
        return
    gens = {i: w.judging() for i, w in enumerate(windows)}
    replies = dict.fromkeys(gens)
    while gens:
        asks = []
        for i in list(gens):
            try:
                asks.append((i, gens[i].send(replies[i])))
            except StopIteration:
                del gens[i]
        if asks:
            got = together([item for _, item in asks])  # every image has its own generator (checked above)
            replies = {i: r for (i, _), r in zip(asks, got)}


def _span(t: torch.Tensor, b: int, start: int, n: int) -> torch.Tensor:
    """Image b's window slots [start, start + n) of a per-image tensor (B, window, ...), as a view to write through
    (one op at batch 1, where indexing would dispatch three)."""
    return t.narrow(1, start, n) if t.shape[0] == 1 else t[b].narrow(0, start, n)
