"""How SSD drafts a row with f_phi (one generation's drafting): the first row (and every row of the horizontal-only
ablation) by chaining f_phi.right from the last target state, the rows below from the row above by f_phi.down, all
columns at once; a drafter with left context drafts a down row column by column (`ssd_columns.draft_columns`).
Every draft goes through the backbone's own final norm and head (a token-id drafter gives code logits itself)."""
from __future__ import annotations

import torch

from specgen.decoding.sampling import inverse_cdf, sample_probs, uniform
from specgen.decoding.ssd_columns import draft_columns
from specgen.decoding.state import SpecState
from specgen.drafters.protocol import Drafter


class Drafting:
    """The drafts of one generation: `right(row)` and `down(rows, images)` give (codes (S, W), q (S, W, V)), q the
    warped distribution each draft was drawn from (`temperature`, default the sampling one; 0: argmax drafts).

    `keep_down_rows`: keep each down row's trunk and states above, per (image, row), in `down_rows` (a carry-window
    tail proposal reads them; `ssd_carry.tails.Reweight`)."""

    def __init__(self, st: SpecState, drafter: Drafter, temperature: float | None = None,
                 keep_down_rows: bool = False):
        self.st, self.drafter, self.temperature = st, drafter, temperature
        self.tokens_out = drafter.predicts == "tokens"  # the ablation: the drafter gives code logits
        self.down_rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = (
            {} if keep_down_rows else None)
        self._left_table: torch.Tensor | None = None
        self._left_maps: tuple[torch.Tensor, ...] | None = None

    def right(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row` of every image: f_phi.right chained from the target state before the row (row 0: the last
        prompt slot; later rows: the state before the row above's last token) through the known tokens between."""
        st, g, drafter = self.st, self.st.g, self.drafter
        start = g.prefix_len - 1 if row == 0 else g.position(row - 1, g.width - 1) - 1
        h = st.hid[:, start]  # (B', D)
        is_state = True  # h is a target state until the drafter has run once
        first = g.position(row, 0)
        codes, qs = [], []
        with st.trace.region("draft", what="right", tokens=st.B * g.width):
            for pos in range(start + 1, g.position(row, g.width - 1) + 1):
                if pos >= first and (pos - first) % g.stride < g.width:  # a visual token of this row: draft it
                    q = st.dist(h, self.temperature) if is_state else st.dist_logits(h, self.temperature)  # (B, V)
                    tok = sample_probs(q, st.rngs)
                    codes.append(tok)
                    qs.append(q)
                    ids = tok.repeat(st.reps)
                else:  # a token already known (previous row, end-of-row)
                    ids = st.seq[:, pos]
                if pos < g.position(row, g.width - 1):
                    h = drafter.right(h, st.embed(ids))
                    is_state = not self.tokens_out
                    st.draft_calls += 1
        return torch.stack(codes, 1), torch.stack(qs, 1)  # (B, W), (B, W, V)

    def down(self, rows: torch.Tensor | int, images: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `rows` (S,) of images `images` (S,; default: every image), or row `rows` (an int) of every image, all
        columns at once: f_phi.down(h_{P(r-1, c) - 1}, e(x_{r-1, c})) on the row above (with left context:
        `_down_left`). For one row of every image the row above is one run of slots, read without per-image index
        tensors."""
        st, g = self.st, self.st.g
        if isinstance(rows, int):
            images, rep = list(range(st.B)), slice(None)
            start = g.position(rows - 1, 0)
            above = torch.arange(start, start + g.width, device=st.seq.device)  # (W,): the row above, every image
            hidden = st.hid.read(rep, above - 1, start - 1, start + g.width - 2)  # (B', W, D)
        else:
            images = torch.arange(st.B, device=rows.device) if images is None else images
            above = g.position(rows[:, None] - 1, torch.arange(g.width, device=rows.device)).repeat(st.reps, 1)
            rep = torch.cat([images + k * st.B for k in range(st.reps)])[:, None]  # (S', 1): the images' CFG rows
            hidden = st.hid[rep, above - 1]  # (S', W, D)
        with st.trace.region("draft", what="down", tokens=len(images) * g.width):
            if self.drafter.left_context:
                return self._down_left(above, rep, images, hidden, start if isinstance(rows, int) else None)
            h = self.drafter.down(hidden, st.embed(st.seq[rep, above]))  # (S', W, D) or logits
            st.draft_calls += 1
            q = st.dist_logits(h, self.temperature) if self.tokens_out else st.dist(h, self.temperature)
            return sample_probs(q, st.image_gens(images)), q

    def _down_left(self, above: torch.Tensor, rep, images, hidden: torch.Tensor,
                   run: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Down drafts with left context: the row trunk once, then column by column, each from the previous
        column's draft, found by fixed-point iteration (`ssd_columns.draft_columns`). `above` (S', W) with `rep`
        (S', 1), or (W,) with `rep` a slice where one row of every image is drafted (`run`: its row above's first
        slot)."""
        st, g = self.st, self.st.g
        S, k = len(images), self.drafter.left_tokens
        trunk = self.drafter.down_trunk(hidden, st.embed(st.seq[rep, above]))  # (S', W, width)
        if self.down_rows is not None:
            first_slots = [run] * S if run is not None else above[:S, 0].tolist()
            for i, (b, slot) in enumerate(zip(list(images), first_slots)):
                self.down_rows[int(b), g.row_col(slot)[0] + 1] = (trunk[i::S], hidden[i::S])  # (reps, W, ...)
        u = uniform((S, g.width), st.image_gens(images), st.seq.device)  # (S, W): the columns' draws
        if run is not None:  # the k tokens before column 0 and the row above, as slices of every image's stream
            first = run + g.stride
            before, guess = st.seq[:, first - k:first], st.seq[:S, above]
        else:
            first = above[:, :1] + g.stride  # (S', 1): each row's column 0
            before = st.seq[rep[:, :1], first - k + torch.arange(k, device=first.device)]  # (S', k)
            guess = st.seq[rep[:S], above[:S]]  # (S, W): the row above
        return draft_columns(st, self.drafter, trunk, hidden, before, self.left_table(), u, self.temperature, guess)

    def left_table(self) -> torch.Tensor:
        """(k, image tokens, width): each left map of the drafter (nearest first) applied to every image token's
        embedding (visual codes, then the forced tokens), once per generation: a row drafted column by column looks
        its left context's features up instead of computing them per column."""
        if self._left_table is None:
            st, g = self.st, self.st.g
            e = st.embed(torch.arange(g.num_visual + len(g.forced_ids), device=st.seq.device))
            self._left_table = torch.stack([m(e) for m in self.drafter.left_maps()])
        return self._left_table

    def left_maps(self) -> tuple[torch.Tensor, ...]:
        """`left_table` as k tables (image tokens, width), nearest first (split once per generation)."""
        if self._left_maps is None:
            self._left_maps = self.left_table().unbind(0)
        return self._left_maps

    def drop_rows(self, final_below: list[int]) -> None:
        """Forget the kept down rows of image b above row final_below[b] (they are final: never proposed again)."""
        if self.down_rows:
            for key in [key for key in self.down_rows if key[1] < final_below[key[0]]]:
                del self.down_rows[key]


class _Drafted:
    """What `draft_columns` reads of a state, for the rows of several batch-1 states drafted together: the CFG
    streams, the guided warped distribution (the states share backbone and sampling settings) and a call count."""

    def __init__(self, st: SpecState):
        self.reps, self.dist, self.draft_calls = st.reps, st.dist, 0


def down_together(draftings: list[Drafting], rows: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row rows[i] of the one image of draftings[i] (batch-1 generations sharing a backbone and a drafter: a
    stream's images), drafted in one drafter call (a left-context drafter: one trunk call and one fixed-point
    iteration over all rows) instead of one call per image. Each image draws from its own random stream as
    `Drafting.down` does, so its draft and proposals are the ones drafting it alone gives (up to the rounding of
    products over more rows at once). Returns (codes (1, W), q (1, W, V)) per image; the drafter calls are counted
    on the first image's state."""
    if len(draftings) == 1:
        return [draftings[0].down(rows[0])]
    lead = draftings[0]
    st0, drafter = lead.st, lead.drafter
    S, W, dev = len(draftings), st0.g.width, st0.seq.device
    hidden, tokens, before, guess, draws = [], [], [], [], []
    k = drafter.left_tokens if drafter.left_context else 0
    for d, r in zip(draftings, rows):
        st, g = d.st, d.st.g
        start = g.position(r - 1, 0)  # the row above's first slot
        above = torch.arange(start, start + W, device=dev)
        hidden.append(st.hid.read(slice(None), above - 1, start - 1, start + W - 2))  # (reps, W, D)
        tokens.append(st.seq[:, start:start + W])  # (reps, W)
        if k:
            first = start + g.stride
            before.append(st.seq[:1, first - k:first])
            guess.append(st.seq[:1, start:start + W])
        draws.append(uniform((1, W) if k else (1, W, 1), st.image_gens([0]), dev))
    # [conditional rows of every image; unconditional rows]: the layout of a batched state's CFG streams
    hidden = torch.stack(hidden, 1).flatten(0, 1)  # (reps * S, W, D)
    embeds = st0.embed(torch.stack(tokens, 1).flatten(0, 1))
    u = torch.cat(draws)
    counted = _Drafted(st0)
    with st0.trace.region("draft", what="down", tokens=S * W):
        if k:
            trunk = drafter.down_trunk(hidden, embeds)  # (reps * S, W, width)
            for i, (d, r) in enumerate(zip(draftings, rows)):
                if d.down_rows is not None:
                    d.down_rows[0, r] = (trunk[i::S], hidden[i::S])
            codes, q = draft_columns(counted, drafter, trunk, hidden, torch.cat(before), lead.left_table(), u,
                                     lead.temperature, torch.cat(guess))
        else:
            h = drafter.down(hidden, embeds)
            counted.draft_calls += 1
            q = st0.dist_logits(h, lead.temperature) if lead.tokens_out else st0.dist(h, lead.temperature)
            codes = inverse_cdf(q, u)
    st0.draft_calls += counted.draft_calls
    return [(codes[i:i + 1], q[i:i + 1]) for i in range(S)]
