"""Tail proposals of the carry window (`tails:` of `ssd_carry.generate`; beyond the paper). The tokens after a pass's
first change were judged (or resampled) given the token the change replaced, and change again in the next pass
about a third of the time. A tail proposal gives them new values and proposals before that pass: `Redraft` chains
f_phi.right from the fresh target state before the change through the new token; `Reweight` moves the pass's own p
of each by the drafter's estimate of what the change did, p(x | old) * f(x | new) / f(x | old). The new tokens are
judged next pass against those proposals, as fresh drafts are, so a tail is as exact as the rule without it.

Of a list of tails, the first that `serves` the changed token's row proposes (e.g. [Redraft(rows=1), Reweight()]:
re-drafts in the first row, reweighting below it). `propose` returns (window slots, a list of consecutive ones, empty
when it drew nothing; proposals (m, V) or None) and writes the new tokens in place."""
from __future__ import annotations

import torch

from specgen.decoding.sampling import inverse_cdf, sample_probs
from specgen.decoding.state import SpecState
from specgen.utils.validate import expect_int


def image_rows(st: SpecState, b: int) -> torch.Tensor:
    """(reps,) the rows of image b's streams (conditional, then unconditional) in the state's (B', ...) tensors."""
    return torch.tensor([b + k * st.B for k in range(st.reps)], device=st.seq.device)


def _tail(win, own: range, first: int, depth: int) -> tuple[int, int, list[int]]:
    """(slot of the change, its row, the window slots of up to `depth` tokens after it in that row); `own`: the
    image's window slots."""
    g, slots = win.st.g, win.slots
    at = slots[own[first]]
    row = g.row_col(at)[0]
    end = g.position(row, g.width)
    return at, row, [i for i in own[first + 1: first + 1 + depth] if slots[i] < end]


class _Tail:
    keeps_down_rows = False  # whether the drafting must keep each down row's trunk and states above

    def check(self, drafter) -> None:
        if drafter.predicts == "tokens":
            raise ValueError(f"{type(self).__name__} reads the drafter's hidden states, and this drafter predicts "
                             f"token ids: set tails=[]")

    def serves(self, row: int) -> bool:
        return True


class Redraft(_Tail):
    """Up to `depth` tokens after an image's first change, in its row, drafted again by chaining f_phi.right from
    the target state before the change (fresh: every token before it is final) through the corrected token; only
    in the first `rows` rows (None: every row)."""

    def __init__(self, depth: int = 4, rows: int | None = 1):
        self.depth = expect_int("depth", depth, 1)
        self.rows = None if rows is None else expect_int("rows", rows, 1)

    def serves(self, row: int) -> bool:
        return self.rows is None or row < self.rows

    def propose(self, win, b: int, own: range, first: int, fed: torch.Tensor, tokens: torch.Tensor,
                p: torch.Tensor):
        st, drafting = win.st, win.drafting
        at, _, tail = _tail(win, own, first, self.depth)
        if not tail:
            return [], None
        h, tok, qs = st.hid[image_rows(st, b), at - 1], tokens[own[first]].view(1), []
        with st.trace.region("draft", what="redraft", tokens=len(tail)):
            for slot in tail:
                h = drafting.drafter.right(h, st.embed(tok.repeat(st.reps)))  # (reps, D): the state after `tok`
                q = st.dist(h, drafting.temperature)  # (1, V)
                tok = sample_probs(q, st.image_gens([b]))
                tokens[slot] = tok[0]
                qs.append(q[0])
        st.draft_calls += len(tail)
        return tail, torch.stack(qs)


class Reweight(_Tail):
    """Up to `depth` tokens after an image's first change, in its row, drawn again from q' ~ p * f(new) / f(old),
    f the drafter's guided distribution of each at the sampling temperature given the new and the old token before
    it: in a row drafted down, its down draft of that column (left context); otherwise f_phi.right chained from the
    state before the change through either token."""

    keeps_down_rows = True

    def __init__(self, depth: int = 2):
        self.depth = expect_int("depth", depth, 1)

    def propose(self, win, b: int, own: range, first: int, fed: torch.Tensor, tokens: torch.Tensor,
                p: torch.Tensor):
        """`fed` (n,): the window's tokens as this pass fed them; `tokens` (n,): as it judged them, written in place;
        `p` (n, V): this pass's distributions."""
        st = win.st
        at, row, tail = _tail(win, own, first, self.depth)
        if not tail:
            return [], None
        with st.trace.region("draft", what="reweight", tokens=len(tail)):
            cached = win.drafting.down_rows.get((b, row))
            if cached is not None:
                return tail, _reweight_down(win, b, tail, at, row, cached, fed, tokens, p)
            # chain f_phi.right: the states after the new and after the old tokens, (2, reps, D)
            h = st.hid[image_rows(st, b), at - 1].expand(2, -1, -1)
            pair = torch.stack([tokens[own[first]], fed[own[first]]])
            qs = []
            for slot in tail:
                h = win.drafting.drafter.right(h, st.embed(pair)[:, None].expand(-1, st.reps, -1))
                q, tok = _redraw(st, b, p[slot], _pair_logits(st, h[:, :, None])[:, 0])
                tokens[slot] = tok
                qs.append(q)
                pair = torch.stack([tok, fed[slot]])  # the chains' next step: after this token as drawn and as fed
            st.draft_calls += len(tail)
            return tail, torch.stack(qs)


def _reweight_down(win, b: int, tail: list[int], at: int, row: int, cached: tuple, fed: torch.Tensor,
                   tokens: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`Reweight` in a row drafted down: each tail token's down draft given the new and the old left tokens. A tail
    token's new left tokens include the tail tokens before it, which are drawn again first; all of the tail is
    drafted and drawn in one call with those taken as they stand (as judged), and where a tail token is drawn other
    than it stood, the tokens after it are drafted and drawn again (one more call) with the same uniforms. So each
    token is drawn from the same q' as drawing them one at a time, with the same draws. Returns the proposals (m, V);
    writes the tokens in place. The tail is consecutive window slots (consecutive columns of one row)."""
    st, drafter = win.st, win.drafting.drafter
    trunk, hidden = cached  # (reps, W, width), (reps, W, D)
    table = win.drafting.left_maps()  # k x (image tokens, width)
    k, start = len(table), st.g.position(row, 0)
    temperature = st.temperature if st.temperature > 0 else 1.0
    gens = st.image_gens([b])  # (m, 1): the tail's draws, in order (one generator's m draws: `uniform`'s)
    u = torch.rand((len(tail), 1), device=p.device) if gens is None else torch.rand(
        (len(tail), 1), generator=gens[0], device=p.device)

    def logits(part: list[int]) -> torch.Tensor:  # (2, m, V): new, old; the k tokens before each, nearest first
        a, b_, feats = part[0], part[-1] + 1, None
        for j in range(1, k + 1):
            if win.slots[a] - j >= at:  # every one after the change: as drawn (new) and as fed (old)
                left = torch.stack([tokens[a - j:b_ - j], fed[a - j:b_ - j]])  # (2, m)
            else:
                left = torch.stack([torch.stack([tokens[i - j], fed[i - j]]) if win.slots[i] - j >= at
                                    else st.seq[b, win.slots[i] - j].expand(2) for i in part], 1)
            f = table[j - 1][left]  # (2, m, width)
            feats = f if feats is None else feats + f
        c = win.slots[a] - start
        # (2, reps, m, D): the pair broadcasts over the CFG streams (the same sums as with the rows repeated)
        h = drafter.down_step(trunk[:, c:c + len(part)], hidden[:, c:c + len(part)], feats[:, None])
        st.draft_calls += 1
        return _pair_logits(st, h)

    qs, i = [], 0
    while i < len(tail):
        part = tail[i:]
        new, old = logits(part).unbind(0)
        shift = new - old if temperature == 1.0 else (new - old) / temperature
        q = torch.softmax(p[part[0]:part[-1] + 1].log() + shift, -1)  # (m - i, V)
        tok = inverse_cdf(q, u[i:] if i else u)
        stood = tokens[part[0]:part[-1] + 1]
        if torch.equal(tok, stood):  # every one drawn as it stood (one op): nothing to write
            qs.append(q)
            break
        moved = (tok != stood).tolist()
        n = moved.index(True) + 1  # through the first token drawn other than it stood
        tokens.narrow(0, part[0], n).copy_(tok if n == len(part) else tok[:n])
        qs.append(q if n == len(part) else q[:n])
        i += n
    return qs[0] if len(qs) == 1 else torch.cat(qs)


def _pair_logits(st: SpecState, states: torch.Tensor) -> torch.Tensor:
    """Guided logits (2, m, V) of the drafter's states (2, reps, m, D) given the new and the old token."""
    return st.logits(states.transpose(0, 1))[0]


def _redraw(st: SpecState, b: int, p: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q' = norm(p * exp((l_new - l_old) / T)) from the drafter's guided logits (2, V) given the new and the old token,
    at the sampling temperature T, and image b's draw from it."""
    temperature = st.temperature if st.temperature > 0 else 1.0
    q = torch.softmax(p.log() + (logits[0] - logits[1]) / temperature, -1)
    return q, sample_probs(q[None], st.image_gens([b]))[0]
