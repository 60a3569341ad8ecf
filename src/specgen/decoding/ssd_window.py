"""SSD's verification window under `carry=True` (see `specgen.decoding.ssd`): which drafted tokens of each image are
not final yet, their proposals, when an image drafts its next row, one target pass over the window, and where the
passes go (per-image change rates and tokens finalised per pass)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.decoding import ssd_tail
from specgen.decoding.ssd_judge import judge
from specgen.decoding.ssd_pass_stats import PassStats
from specgen.decoding.state import SpecState


@dataclass(frozen=True)
class CarryRule:
    """How the carry window moves: the options of `ssd.generate` that only `carry=True` reads (`left_draft` and
    `draft_temperature` apply without carry too; no defaults here: `generate`'s are the ones).

    rounds: passes on an image's newest row before its next row is due (a row's budget, r + 1 passes);
    max_lead: how many rows an image may run ahead of the batch's slowest (None: no bound; a stream sets None);
    max_window_rows: an image drafts its next row only while fewer of its rows than this are not final, which bounds
    the tokens fed per pass (None: no bound; the row budget `rounds` alone decides);
    draft_temperature: warps the drafted distribution q only (None: the sampling temperature; 0: argmax drafts);
    redraft (beyond the paper): after a pass, up to this many tokens right of an image's first change (in its row) are
    drafted again by f_phi.right from the fresh state before the change, instead of being carried with values that
    were judged given the replaced token (0: off); redraft_rows: re-draft only in the first this many rows (1: the
    horizontally drafted first row; None: every row);
    max_row_passes: a row judged this many times is kept as it stands, as the paper keeps a row after its r + 1
    passes; its tokens right of the last pass's first change count in stats["unchecked_tokens"] (None: no cap, every
    token is final before it is kept: approximately lossless, exact under greedy decoding);
    second_row_wait (beyond the paper): the second row is drafted (down, from the first row's states) only once at
    most this many of the first row's tokens are not final: after its first pass the horizontally drafted first row
    is still far from final, and down drafts from it are mostly rejected (None: no wait);
    acceptance: how a window token is judged: "speculative", the paper's test (keep t ~ q with prob min(1, p/q), else
    draw from the residual); beyond the paper, "typical" (Medusa's typical acceptance: keep t when
    p(t) > min(typical_epsilon, typical_delta * exp(-H(p))), else draw from p; not lossless), "typical_carried"
    (fresh drafts by the speculative test, carried tokens by the typical one) or "latent" (LANTERN's relaxed test,
    Jang et al. 2025: p(t) in the test gains the mass p gives t's `latent_k` nearest codes in the tokenizer's latent
    space, nearest first, at most `latent_delta`; not lossless, each judgement moves at most latent_delta of p's mass)
    or "latent_carried" (fresh drafts by the speculative test, carried tokens by the relaxed one);
    left_draft (drafters with left context; beyond the paper): "sequential" drafts a down row column by column, each
    from the previous column's draft, found by fixed-point iteration in a few drafter calls (`ssd_columns.draft_columns`;
    "sequential_loop": the same drafts, one call per column); "above" drafts it in one call, the token above each
    column's left neighbour standing in for that neighbour's draft (the drafts agree less with each other); "refine"
    drafts it twice in one call each, the second time with each left neighbour the first call's most likely draft;
    lossless every way (verification divides by the q each draft was drawn from); a drafter without left context
    drafts a row in one call whatever this says;
    siblings (beyond the paper): for each image's first this many window tokens, the pass also feeds the proposal's
    most likely other token at the same position; when a pass's first change draws one of them, the token after the
    change is judged in the same pass from that alternative's state, by the rule the next pass would apply (0: off;
    see `CarryWindow.sibling_inputs`);
    max_fed (beyond the paper, a wall-clock lever): an image's pass feeds at most this many slots from its first
    stale one (one more where they end at an end-of-row slot, which is fed with the token before it; None: the whole
    window). Only the window tokens whose state before them was computed by the pass are judged; the rest keep their
    drafts (or carried values) and proposals for a later pass, and a row is drafted from the row above only once every
    slot of that row has been fed. Most passes end their progress at their first change, after which they feed tokens
    whose states the next pass recomputes; on a CPU a pass costs a fixed part plus a part per slot fed. Measured on the
    shipped models: fewer slots fed, more passes, no faster at any cap (experiments/ssd_ablations);
    reweight (beyond the paper): after a pass's first change (in a row `redraft` does not serve), the next `reweight`
    tokens of that row are drawn again, each from q' proportional to p(x | old) * f(x | new) / f(x | old): the pass's
    own p of that token, judged given the token the change replaced (old), reweighted by how the drafter's prediction of
    it moves when the token before it is the new one instead of the old one (guided logits, at the sampling
    temperature): in a row drafted down by a drafter with left context, its down draft of that column given either left
    token; otherwise f_phi.right chained from the target state before the change through either token. A carried token
    was drawn given the replaced token, and changes again next pass about a third of the time (the cascades of one-token
    passes); q' keeps what the target's p knows about the rest of the context and moves it by the drafter's estimate of
    the change. The new token is judged next pass by the speculative test against q', so the rule is as exact as without
    (0: off)."""

    rounds: int
    max_lead: int | None
    max_window_rows: int | None
    draft_temperature: float | None
    redraft: int
    redraft_rows: int | None
    max_row_passes: int | None
    second_row_wait: int | None
    acceptance: str = "speculative"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    latent_k: int = 16
    latent_delta: float = 0.1
    left_draft: str = "sequential"
    siblings: int = 0
    max_fed: int | None = None
    reweight: int = 0


class CarryWindow:
    """Verification window of `carry=True`, per image: the drafted positions not final yet, with proposals.

    Image b's window is its visual positions in [final_upto[b], drafted_upto[b]); the batch's pass covers the
    union (a contiguous run of visual positions, `pos`). Each image moves on by itself: it drafts its next row
    when its window is final or it has spent rounds + 1 passes on its newest row, so no image waits for the
    batch's slowest row. An image that is `max_lead` rows ahead of the slowest one waits (it takes no part in
    passes), which bounds the width of a pass. Random draws are per image and only for its own window, so an
    image's tokens and pass count do not depend on its batch (up to floating-point differences of batched
    matmuls), and batch-1 decoding is the reference of every batch size."""

    def __init__(self, st: SpecState, rule: CarryRule, drafter=None):
        B, dev, g = st.B, st.seq.device, st.g
        self.st, self.rule, self.drafter = st, rule, drafter
        self.redraft_rows = g.height if rule.redraft_rows is None else rule.redraft_rows  # re-draft above this row
        self.row_passes = torch.zeros(B, g.height, dtype=torch.long, device=dev)  # passes as the frontier row
        self.final_upto = torch.full((B,), g.position(0, 0), dtype=torch.long, device=dev)
        self.drafted_upto = self.final_upto.clone()
        self.next_row = torch.zeros(B, dtype=torch.long, device=dev)  # the row each image drafts next
        self.spent = torch.zeros(B, dtype=torch.long, device=dev)  # passes on the image's newest row
        self.passes = torch.zeros(B, dtype=torch.long, device=dev)  # passes each image took part in
        self.row_final = torch.full((B, g.height), -1, dtype=torch.long, device=dev)  # its passes when a row was final
        self.first_row = torch.full((B,), -1, dtype=torch.long, device=dev)  # row awaiting its first pass
        self.pos = torch.zeros(0, dtype=torch.long, device=dev)  # (n,) union window, ascending
        self.prop = torch.zeros(B, 0, g.num_visual, device=dev)  # (B, n, V) proposal of each window token
        self.fresh = torch.zeros(B, 0, dtype=torch.bool, device=dev)  # (B, n) drafted, not judged yet
        self.stats = PassStats(B, g.width, dev)  # where the passes go (`pass_stats`)
        # max_fed, per image (so that an image's passes are those of batch-1 decoding): its first slot whose state
        # is stale, and how far its states were ever computed (a row is drafted from the row above once it was)
        self.stale = torch.full((B,), g.prefix_len, dtype=torch.long, device=dev)
        self.seen = self.stale.clone()
        self.recorded = torch.zeros(B, dtype=torch.long, device=dev)  # first-pass acceptance recorded below this slot
        self.front_seen = None  # each image's frontier row when the rows' final passes were last updated (`judge`)
        if rule.reweight:  # the down rows' trunks and states above, per (image, row), kept by the drafting for reweight
            st.memo["down_rows"] = {}

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
        g = self.st.g  # offset r * stride + c is row r for c < width, and row r + 1 at an end-of-row slot (c >= width)
        return (self.final_upto + (g.stride - g.width - g.prefix_len)) // g.stride

    def wants(self) -> torch.Tensor:
        """(B,) images whose next row is due (window final or row budget spent) and within their own window bound:
        what batch-1 decoding would draft now."""
        rule = self.rule
        ok = ((self.final_upto >= self.drafted_upto) | (self.spent > rule.rounds)) & (self.next_row < self.st.g.height)
        if rule.max_window_rows is not None:  # bounds the tokens fed per pass: rows not final yet, the new one included
            ok &= self.next_row - self.frontier_row() < rule.max_window_rows
        if rule.second_row_wait is not None:  # the first row's unsettled drafts make poor rows above for down drafts
            g = self.st.g  # at most second_row_wait of the first row's tokens not final: final_upto past the rest
            ok &= (self.next_row != 1) | (self.final_upto >= g.position(0, g.width - 1) + 1 - rule.second_row_wait)
        if rule.max_fed is not None:  # the row above's states must have been computed (drafts read them)
            g = self.st.g
            above_end = g.position((self.next_row - 1).clamp_min(0), g.width - 1)  # the row above's last slot
            ok &= (self.next_row == 0) | (above_end <= self.seen)
        return ok

    def lead_ok(self) -> torch.Tensor:
        """(B,) images not too far ahead of the batch's slowest unfinished image."""
        if self.rule.max_lead is None or self.st.B == 1:  # one image is never ahead of itself
            return torch.ones(self.st.B, dtype=torch.bool, device=self.next_row.device)
        unfinished = self.next_row < self.st.g.height
        if not unfinished.any():
            return torch.ones_like(unfinished)
        return self.next_row <= self.next_row[unfinished].min() + self.rule.max_lead

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
        siblings = self.sibling_inputs()
        states = self.st.target_pass(self.pass_end(), siblings)
        self.judge(accept_map, rounds_used, siblings, states)

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
        pos, B = self.pos, self.st.B
        n, rows = pos.numel(), torch.arange(B, device=pos.device)[:, None]
        idx = torch.searchsorted(pos, self.final_upto)[:, None] + torch.arange(k, device=pos.device)  # (B, k)
        safe = idx.clamp_max(n - 2)
        valid = (idx <= n - 2) & (pos[safe + 1] == pos[safe] + 1) & (pos[safe] + 1 < self.drafted_upto[:, None])
        if self.rule.max_fed is not None:  # the token after an alternative is judged in this pass (and it is fed)
            valid &= pos[safe] + 1 <= self.image_ends()[:, None]
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
            return int(self.pos[-1])
        act = self.live() & ~self.wants()
        return int(self.image_ends()[act].max()) if act.any() else int(self.pos[-1])

    def image_ends(self) -> torch.Tensor:
        """(B,) max_fed: each image's pass end, at most `max_fed` slots past its first stale one, at most its window's
        last token, at least its window's first token (past an end-of-row slot): what its batch-1 pass would feed up
        to. Its window tokens at slots up to it are judged."""
        g = self.st.g
        first = self.final_upto + (g.row_col(self.final_upto)[1] >= g.width).long()  # its first window token
        return torch.minimum(self.drafted_upto - 1, torch.maximum(self.stale + self.rule.max_fed, first))

    def judge(self, accept_map: torch.Tensor, rounds_used: torch.Tensor,
              siblings: tuple[torch.Tensor, torch.Tensor] | None = None, states: torch.Tensor | None = None) -> None:
        """After the pass: accept or correct each live token of the images taking part, move their windows on.
        `siblings` / `states`: the alternatives fed with the pass and their states (`sibling_inputs`)."""
        st, g, pos = self.st, self.st.g, self.pos
        # its next row due but not drafted (held back by max_lead, or horizontal rows waiting for the batch): the
        # image waits without a pass, as if its next row came at once, so its draws stay its own
        held = self.wants()
        act = (self.live() & ~held).nonzero().flatten()
        judged, ends, p = self._judged()
        cur = st.visual(pos)
        new = cur.clone()
        redrafts = []
        front = self.frontier_row()  # (B,) each image's row of its first non-final token, before this pass
        for b in act.tolist():  # per-image draws, over the image's own window only
            window = ((pos >= self.final_upto[b]) & (pos < self.drafted_upto[b])).nonzero().flatten()
            own = window[judged[b, window]]
            if not own.numel():  # max_fed: the pass ended before this image's window (a batch's union window)
                act = act[act != b]
                continue
            nb, acc = self._accept(b, own, cur, p)
            new[b, own] = nb[0]
            changed = nb[0] != cur[b, own]
            first = int(changed.float().argmax()) if changed.any() else own.numel() - 1
            self.stats.record(b, self.fresh[b, own], changed, first)
            self.fresh[b, own] = False
            if ends is not None:  # max_fed: stale from its first change on, else from where its pass ended
                self.stale[b] = pos[own[first]] if changed.any() else ends[b]
                self.seen[b] = torch.maximum(self.seen[b], ends[b])
            if states is not None and changed.any():  # the token after the change, judged in this pass
                first += self._sibling(b, own, first, new, p, siblings, states)
            self.final_upto[b] = pos[own[first]] + 1  # final through the first change (and a sibling's judgement)
            kept = self._cap_rows(b, own, int(front[b]))
            if self.rule.redraft and changed.any() and not kept:
                redrafts.append(ssd_tail.redraft(self, b, window, first, new[b]))
            if self.rule.reweight and changed.any() and not kept:
                redrafts.append(ssd_tail.reweight(self, b, own, first, cur[b], new[b], p[b]))
            self._record_first_judgement(b, pos[own], acc[0], accept_map)
            if self.spent[b] <= self.rule.rounds:  # within the newest row's budget (later passes: carried tokens)
                rounds_used[b, int(self.next_row[b]) - 1] += 1
        st.set_tokens(pos, new)
        acting = torch.isin(torch.arange(st.B, device=pos.device), act)[:, None] & judged  # (B, n)
        self.prop = torch.where(acting[..., None], p, self.prop)
        for b, slots, q in redrafts:  # re-drafted tails are judged against their drafts' q next pass
            self.prop[b, slots], self.fresh[b, slots] = q, True
        self.spent[act] += 1
        self.passes[act] += 1
        front = self.frontier_row()
        seen = front.tolist()
        if seen != self.front_seen:  # a row became final (else nothing below changes)
            self.front_seen = seen
            done = torch.arange(g.height, device=pos.device)[None] < front[:, None]  # (B, H) rows final
            if "down_rows" in st.memo:  # a final row is not reweighted any more
                rows = st.memo["down_rows"]
                for key in [key for key in rows if key[1] < seen[key[0]]]:
                    del rows[key]
            self.row_final = torch.where(done & (self.row_final < 0), (self.passes + 1)[:, None], self.row_final)
        keep = pos >= int(self.final_upto.min())  # drop what every image has finalised
        self.pos, self.prop, self.fresh = pos[keep], self.prop[:, keep], self.fresh[:, keep]

    def _judged(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Which window tokens each image judges after this pass, (B, n); with `max_fed` the images' pass ends (B,)
        (else None); and p (B, n, V), each judged token's distribution from the state before it (zeros at slots no
        image judges: never read)."""
        st, pos = self.st, self.pos
        if self.rule.max_fed is None:  # every window token: the pass fed the whole window
            return torch.ones(st.B, pos.numel(), dtype=torch.bool, device=pos.device), None, st.dist(st.hid[:, pos - 1])
        ends = self.image_ends()
        judged = pos[None] <= ends[:, None]  # each image's tokens up to its own end: the state before each is current
        cols = judged.any(0)
        p = st.dist(st.hid[:, pos[cols] - 1])
        if not bool(cols.all()):
            p = p.new_zeros(p.shape[0], pos.numel(), p.shape[-1]).index_copy_(1, cols.nonzero().flatten(), p)
        return judged, ends, p

    def _record_first_judgement(self, b: int, slots: torch.Tensor, accepted: torch.Tensor,
                                accept_map: torch.Tensor) -> None:
        """Image b's freshly drafted row: the acceptance of each of its tokens at its first judgement (judged at
        `slots`, accepted or not), until the row's last token was judged (one pass without `max_fed`)."""
        r, g = int(self.first_row[b]), self.st.g
        if r < 0:
            return
        rows, cols = g.row_col(slots)
        row = (rows == r) & (slots >= self.recorded[b])
        accept_map[b, r, cols[row]] = accepted[row]
        if row.any():
            self.recorded[b] = int(slots[row][-1]) + 1
        if bool((slots >= g.position(r, g.width - 1)).any()):  # its last token judged: the map is whole
            self.first_row[b] = -1

    def _accept(self, b: int, own: torch.Tensor, cur: torch.Tensor, p: torch.Tensor):
        """Judge image b's window tokens (its slots `own`) against the pass's p: (1, n) tokens, (1, n) accepted."""
        return judge(self.st, self.rule, cur[b:b + 1, own], p[b:b + 1, own], self.prop[b:b + 1, own],
                     self.fresh[b:b + 1, own], self.st.image_gens([b]))

    def _sibling(self, b: int, own: torch.Tensor, first: int, new: torch.Tensor, p: torch.Tensor,
                 siblings: tuple[torch.Tensor, torch.Tensor], states: torch.Tensor) -> int:
        """Image b's first change (window slot own[first]) drew a token fed as an alternative: judge the token after
        it against the alternative's state (which replaces the stale state at the changed slot), as the next pass
        would judge it (a carried token, its proposal this pass's p). Writes it into `new`; returns 1, or 0 when no
        alternative matched."""
        st, pos = self.st, self.pos
        c = int(pos[own[first]])
        slots, tokens = siblings
        match = ((slots[b] == c) & (tokens[b] == new[b, own[first]])).nonzero().flatten()
        if not match.numel() or first + 1 >= own.numel() or int(pos[own[first + 1]]) != c + 1:
            return 0
        rep = ssd_tail.image_rows(st, b)
        h = states[rep, int(match[0])]  # (reps, D): the state after the drawn token
        st.hid.put(rep, c, h)  # drafts and re-drafts read the state after the final token
        nxt = own[first + 1:first + 2]
        tok = new[b:b + 1, nxt]
        target = st.dist(h)[:, None]  # (1, 1, V)
        out, _ = judge(st, self.rule, tok, target, p[b:b + 1, nxt], None, st.image_gens([b]))  # a carried token
        new[b, nxt] = out[0]
        c_ = self.stats.counts
        c_["sibling_hits"][b] += 1
        c_["finalised"][b] += 1
        c_["carried"][b] += 1
        c_["carried_changed"][b] += (out[0] != tok[0]).float().sum()
        return 1

    def _cap_rows(self, b: int, own: torch.Tensor, front: int) -> int:
        """`max_row_passes`: count the pass for image b's frontier row (`front`: the row of its first token not final
        before the pass; every row above it was final, as in the paper's rounds, where a row is verified after the
        row above is done); if that row is still b's frontier after the pass and has been it `max_row_passes` times,
        it is kept as it stands, as the paper keeps a row after its last round. Its tokens right of this pass's
        first change were judged with a left context that then changed: they are counted as unchecked (and as
        finalised). Only the frontier row can be kept: a row below it has not been the frontier yet. Returns how
        many tokens were kept that way."""
        if self.rule.max_row_passes is None:
            return 0
        self.row_passes[b, front] += 1
        if int(self.frontier_row()[b]) != front or self.row_passes[b, front] < self.rule.max_row_passes:
            return 0
        pos, start = self.pos, int(self.final_upto[b])
        upto = min(self.st.g.position(front + 1, 0), int(self.drafted_upto[b]))  # through the row's end
        kept = int(((pos[own] >= start) & (pos[own] < upto)).sum())
        self.final_upto[b] = upto
        self.stats.counts["unchecked"][b] += kept
        self.stats.counts["finalised"][b] += kept
        return kept

    def pass_stats(self) -> dict[str, torch.Tensor]:
        """Per image, where the passes went (`ssd_pass_stats.PassStats.summary`)."""
        return self.stats.summary(self.passes)

