"""A down row of SSD drafted column by column with a left-context drafter (`ssd_drafting.Drafting.down`): each column
from the previous column's draft, by fixed-point iteration (`draft_columns`) or one drafter call per column (the
reference the tests hold it against, `draft_columns_loop`)."""
from __future__ import annotations

import torch

from specgen.decoding.state import SpecState


def draft_columns(st: SpecState, drafter, trunk: torch.Tensor, hidden: torch.Tensor, before: torch.Tensor,
                  table: torch.Tensor, u: torch.Tensor, draft_temperature: float | None,
                  guess: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A down row drafted column by column, each column from the previous column's draft: trunk (S', W, width) and
    states above (S', W, D) of the rows' CFG streams, the k tokens before column 0 (S', k), the left maps' table, the
    columns' uniform draws (S, W) and a guess of the row (S, W). Each draw is made from the warped distribution as
    `inverse_cdf` makes it, so the row is a fixed function of the draws: x_c = F_c(u_c, x_{c-k}, ..., x_{c-1}).

    It finds that row by fixed-point (Jacobi) iteration: every column at once, each
    from the guess of its left tokens (the caller's: the tokens above them), then again from the drafts just made,
    recomputing only the columns right of the first draft that differs from what was assumed, until none differs.
    The columns up to that first difference read only left tokens that were right, so each call settles at least one
    more column and the row is done within W calls; at the end every draft was drawn given its final left tokens, so
    the row and its proposals are the loop's (up to the rounding of products over more rows at once) in a few calls
    instead of W (`draft_columns_loop`: one call per column)."""
    reps, k = st.reps, table.shape[0]
    S, W = u.shape
    trunks = trunk.reshape(reps, S, W, -1)  # (reps, S, W, width)
    above = hidden.reshape(reps, S, W, -1)  # (reps, S, W, D)
    buf = torch.cat([before[:S], guess], 1)  # (S, k + W): the k tokens before column 0, then the row as assumed
    maps = table.unbind(0)  # k x (image tokens, width), nearest first
    draws = u.unsqueeze(-1)  # (S, W, 1): each column's draw, scaled by its cdf's total as `inverse_cdf` does
    q = None
    lo = 0  # columns from here on read a left token that changed
    while lo < W:
        left = maps[0][buf[:, k + lo - 1:k + W - 1]]  # (S, W - lo, width): the nearest left tokens' features
        for j in range(2, k + 1):
            left = left + maps[j - 1][buf[:, k + lo - j:k + W - j]]
        cut = (lambda t: t) if lo == 0 else (lambda t: t[..., lo:, :])  # noqa: E731  (columns from lo on)
        state = drafter.down_step(cut(trunks), cut(above), left)  # (reps, S, W - lo, D)
        q_lo = st.dist(state, draft_temperature)[0] if reps == 2 else st.dist(state[0], draft_temperature)
        cdf = q_lo.cumsum(-1)  # (S, W - lo, V)
        tok = torch.searchsorted(cdf, cut(draws) * cdf[..., -1:], right=True).squeeze(-1)
        tok = tok.clamp_max(q_lo.shape[-1] - 1)
        st.draft_calls += 1
        if q is None:
            q = q_lo
        else:
            q[:, lo:].copy_(q_lo)
        assumed = buf[:, k + lo:]
        ne = tok != assumed  # columns (from lo) drawn other than assumed, in any of the rows
        differs = ne.tolist()[0] if S == 1 else ne.any(0).tolist()
        assumed.copy_(tok)
        if True not in differs:
            break
        lo += differs.index(True) + 1
    return buf[:, k:], q


def draft_columns_loop(st: SpecState, drafter, trunk: torch.Tensor, hidden: torch.Tensor, before: torch.Tensor,
                        table: torch.Tensor, u: torch.Tensor,
                        draft_temperature: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_columns` one column at a time (W drafter calls). This loop issues as few tensor ops as it can: the
    columns are split once, each CFG stream's rows are one view (reps, S, ...) to which the left features, looked up
    once per image, broadcast (the same values as drafting through the generic calls, op for op)."""
    g, reps, k = st.g, st.reps, table.shape[0]
    S = u.shape[0]
    trunks = trunk.reshape(reps, S, g.width, -1).unbind(2)  # W x (reps, S, width)
    above = hidden.reshape(reps, S, g.width, -1).unbind(2)  # W x (reps, S, D)
    draws = u.unsqueeze(-1).unbind(1)  # W x (S, 1)
    prev = list(before[:S].unbind(1))  # the k tokens before column 0, farthest first, (S,) each
    maps = table.unbind(0)  # k x (image tokens, width), nearest first
    codes, qs = [], []
    for c in range(g.width):
        left = maps[0][prev[-1]]  # (S, width): the nearest left token's features
        for j in range(2, k + 1):  # farther ones (drafters reading more than one left token)
            left = left + maps[j - 1][prev[-j]]
        state = drafter.down_step(trunks[c], above[c], left)  # (reps, S, D)
        q = st.dist(state, draft_temperature)[0] if reps == 2 else st.dist(state[0], draft_temperature)  # (S, V)
        cdf = q.cumsum(-1)
        tok = torch.searchsorted(cdf, draws[c] * cdf[:, -1:], right=True).view(S).clamp_max(q.shape[-1] - 1)
        codes.append(tok)
        qs.append(q)
        prev.append(tok)
    st.draft_calls += g.width
    return torch.stack(codes, 1), torch.stack(qs, 1)  # (S, W), (S, W, V)
