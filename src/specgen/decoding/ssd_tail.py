"""The tokens after a pass's first change in SSD's carry window (`ssd_window.CarryWindow`). They were judged (or
resampled) given the token the change replaced, and change again in the next pass about a third of the time. Beyond
the paper, two ways to propose them again before that pass: `redraft` chains f_phi.right from the fresh target state
before the change through the new token; `reweight` moves the pass's own p of each by the drafter's estimate of what
the change did, p(x | old) * f(x | new) / f(x | old). Each returns (image, window slots (a list of consecutive ones,
empty when it drew nothing), proposals (m, V) or None): the new tokens are written into the window's tokens and judged
next pass against those proposals, as fresh drafts are."""
from __future__ import annotations

import torch

from specgen.decoding.sampling import inverse_cdf, sample_probs, uniform
from specgen.decoding.state import SpecState


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


def _none(b: int):
    return b, [], None


def redraft(win, b: int, own: range, first: int, tokens: torch.Tensor):
    """`redraft`: image b's tokens after its first change (window slot own[first]), up to `redraft` of them in the
    changed token's row and only in the first `redraft_rows` rows, drafted again by chaining f_phi.right from the
    target state before the change (fresh: every token before it is final) through the corrected token. Writes the
    drafts into `tokens` (n,) at the window's slots."""
    st = win.st
    if st.g.row_col(win.slots[own[first]])[0] >= win.redraft_rows:  # on ints first: most passes end here
        return _none(b)
    at, _, tail = _tail(win, own, first, win.rule.redraft)
    if not tail:
        return _none(b)
    h, tok, qs = st.hid[image_rows(st, b), at - 1], tokens[own[first]].view(1), []
    for slot in tail:
        h = win.drafter.right(h, st.embed(tok.repeat(st.reps)))  # (reps, D): the state after `tok`
        q = st.dist(h, win.rule.draft_temperature)  # (1, V)
        tok = sample_probs(q, st.image_gens([b]))
        tokens[slot] = tok[0]
        qs.append(q[0])
    st.draft_calls += len(tail)
    return b, tail, torch.stack(qs)


def reweight(win, b: int, own: range, first: int, fed: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor):
    """`reweight`: image b's tokens after its first change (window slot own[first]), up to `reweight` of them in the
    changed token's row (not in the rows `redraft` serves), drawn again from q' ~ p * f(new) / f(old). f: in a row
    drafted down (its trunk and states above kept in `st.memo["down_rows"]`), the down draft of each column given the
    new and the old left tokens; in a row drafted by f_phi.right (the first), its chain from the state before the
    change through the new and the old tokens. `fed` (n,): the window's tokens as this pass fed them; `tokens` (n,):
    as it judged them, written in place; `p` (n, V): this pass's distributions."""
    st = win.st
    at, row, tail = _tail(win, own, first, win.rule.reweight)
    if (win.rule.redraft and row < win.redraft_rows) or not tail:
        return _none(b)
    cached = st.memo["down_rows"].get((b, row))
    if cached is not None:
        return b, tail, _reweight_down(win, b, tail, at, row, cached, fed, tokens, p)
    # chain f_phi.right: the states after the new and after the old tokens, (2, reps, D)
    h = st.hid[image_rows(st, b), at - 1].expand(2, -1, -1)
    pair = torch.stack([tokens[own[first]], fed[own[first]]])
    qs = []
    for slot in tail:
        h = win.drafter.right(h, st.embed(pair)[:, None].expand(-1, st.reps, -1))
        q, tok = _redraw(st, b, p[slot], _pair_logits(st, h[:, :, None])[:, 0])
        tokens[slot] = tok
        qs.append(q)
        pair = torch.stack([tok, fed[slot]])  # the next step of the chains: after this token as drawn and as fed
    st.draft_calls += len(tail)
    return b, tail, torch.stack(qs)


def _reweight_down(win, b: int, tail: list[int], at: int, row: int, cached: tuple, fed: torch.Tensor,
                   tokens: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`reweight` in a row drafted down: each tail token's down draft given the new and the old left tokens. A tail
    token's new left tokens include the tail tokens before it, which are drawn again first; all of the tail is
    drafted and drawn in one call with those taken as they stand (as judged), and where a tail token is drawn other
    than it stood, the tokens after it are drafted and drawn again (one more call) with the same uniforms. So each
    token is drawn from the same q' as drawing them one at a time, with the same draws (a generator's n draws at once
    are its n draws one at a time). Returns the proposals (m, V); writes the tokens in place. The tail is consecutive
    window slots (consecutive columns of one row)."""
    st = win.st
    trunk, hidden = cached  # (reps, W, width), (reps, W, D)
    table = left_table(st, win.drafter)  # (k, image tokens, width)
    k, start = table.shape[0], st.g.position(row, 0)
    temperature = st.temperature if st.temperature > 0 else 1.0
    u = uniform((1, len(tail)), st.image_gens([b]), p.device)[0]  # (m,): the tail's draws, in order

    def logits(part: list[int]) -> torch.Tensor:  # (2, m, V): new, old; the k tokens before each, nearest first
        idx, feats = torch.arange(part[0], part[-1] + 1, device=tokens.device), 0
        for j in range(1, k + 1):
            if win.slots[part[0]] - j >= at:  # every one after the change: as drawn (new) and as fed (old)
                left = torch.stack([tokens[idx - j], fed[idx - j]])  # (2, m)
            else:
                left = torch.stack([torch.stack([tokens[i - j], fed[i - j]]) if win.slots[i] - j >= at
                                    else st.seq[b, win.slots[i] - j].expand(2) for i in part], 1)
            feats = feats + table[j - 1][left]  # (2, m, width)
        c = win.slots[part[0]] - start
        h = win.drafter.down_step(trunk[None, :, c:c + len(part)], hidden[None, :, c:c + len(part)], feats[:, None])
        st.draft_calls += 1
        return _pair_logits(st, h)  # h: (2, reps, m, D)

    qs, i = [], 0
    while i < len(tail):
        part = tail[i:]
        pair = logits(part)
        q = torch.softmax(p[part[0]:part[-1] + 1].log() + (pair[0] - pair[1]) / temperature, -1)  # (m - i, V)
        tok = inverse_cdf(q, u[i:])
        moved = (tok != tokens[part[0]:part[-1] + 1]).nonzero().flatten().tolist()
        n = moved[0] + 1 if moved else len(part)  # through the first token drawn other than it stood
        tokens[part[0]:part[0] + n] = tok[:n]
        qs.append(q[:n])
        i += n
    return torch.cat(qs)


def _pair_logits(st: SpecState, states: torch.Tensor) -> torch.Tensor:
    """Guided logits (2, m, V) of the drafter's states (2, reps, m, D) given the new and the old token."""
    return st.logits(states.transpose(0, 1))[0]


def _redraw(st: SpecState, b: int, p: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q' = norm(p * exp((l_new - l_old) / T)) from the drafter's guided logits (2, V) given the new and the old token,
    at the sampling temperature T, and image b's draw from it."""
    temperature = st.temperature if st.temperature > 0 else 1.0
    q = torch.softmax(p.log() + (logits[0] - logits[1]) / temperature, -1)
    return q, sample_probs(q[None], st.image_gens([b]))[0]


def left_table(st: SpecState, drafter) -> torch.Tensor:
    """(k, image tokens, width): each left map of `drafter` (nearest first) applied to every image token's embedding
    (visual codes, then the forced tokens), computed once per generation (`st.memo`): a row drafted column by column
    looks its left context's features up instead of computing them per column."""
    if "left_table" not in st.memo:
        g = st.g
        tokens = torch.arange(g.num_visual + len(g.forced_ids), device=st.seq.device)
        e = st.embed(tokens)
        maps = drafter.left_maps() if hasattr(drafter, "left_maps") else [drafter.left_in]
        st.memo["left_table"] = torch.stack([m(e) for m in maps])
    return st.memo["left_table"]
