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
from specgen.decoding.sampling import accept_or_resample, sample_probs, uniform
from specgen.decoding.ssd_columns import draft_columns
from specgen.decoding.ssd_judge import RULES
from specgen.decoding.ssd_tail import left_table
from specgen.decoding.ssd_rule import CarryRule
from specgen.decoding.ssd_window import CarryWindow
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
                draft_temperature: float | None = None,
                left_draft: str = "sequential") -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` (S,) of images `images` (S,; default: every image), all columns at once:
    f_phi.down(h_{P(r-1, c) - 1}, e(x_{r-1, c})) on the row above (with left context: see `_draft_down_left`)."""
    g = st.g
    images = torch.arange(st.B, device=rows.device) if images is None else images
    above = g.position(rows[:, None] - 1, torch.arange(g.width, device=rows.device)).repeat(st.reps, 1)  # (S', W)
    rep = torch.cat([images + k * st.B for k in range(st.reps)])[:, None]  # (S', 1): the images' CFG rows
    if getattr(drafter, "left_context", False):
        return _draft_down_left(st, drafter, above, rep, images, draft_temperature, left_draft)
    h = drafter.down(st.hid[rep, above - 1], st.embed(st.seq[rep, above]))  # (S', W, D) or code logits
    st.draft_calls += 1
    tokens_out = getattr(drafter, "predicts", "hidden") == "tokens"
    q = st.dist_logits(h, draft_temperature) if tokens_out else st.dist(h, draft_temperature)
    return sample_probs(q, st.image_gens(images)), q


def _draft_down_left(st: SpecState, drafter, above: torch.Tensor, rep: torch.Tensor, images: torch.Tensor,
                     draft_temperature: float | None,
                     left_draft: str = "sequential") -> tuple[torch.Tensor, torch.Tensor]:
    """Down drafts with left context: the row trunk once, then column by column from the previous column's draft
    (`left_draft="sequential"`, by fixed-point iteration; `"sequential_loop"`: one call per column), or every column
    in one call with the token above its left neighbour standing in for that neighbour's draft (`"above"`; column 0's
    left neighbour is known either way), or that call followed by a second one whose left neighbours are the first
    call's most likely drafts (`"refine"`)."""
    g = st.g
    hidden = st.hid[rep, above - 1]  # (S', W, D)
    trunk = drafter.down_trunk(hidden, st.embed(st.seq[rep, above]))  # (S', W, width)
    if "down_rows" in st.memo:  # kept per image and row for the carry window's reweighting (`CarryRule.reweight`)
        S, rows = len(images), g.row_col(above[:len(images), 0])[0] + 1
        for i, (b, r) in enumerate(zip(images.tolist(), rows.tolist())):
            st.memo["down_rows"][b, r] = (trunk[i::S], hidden[i::S])  # (reps, W, width), (reps, W, D)
    k = getattr(drafter, "left_tokens", 1)
    first = above[:, :1] + g.stride  # (S', 1): each row's column 0
    before = st.seq[rep[:, :1], first - k + torch.arange(k, device=first.device)]  # (S', k): the tokens before it
    table = left_table(st, drafter)  # (k, image tokens, width): each token's features at each distance

    def left_features(buf: torch.Tensor, c: int | None = None) -> torch.Tensor:
        """The left context of column c (None: every column) from `buf` (S', k + W): the k known tokens, then the row's
        (guessed) ones; the j-th token before column c is buf[:, k + c - j]."""
        if c is None:
            return sum(table[j - 1][buf[:, k - j:k - j + g.width]] for j in range(1, k + 1))
        return sum(table[j - 1][buf[:, k + c - j]] for j in range(1, k + 1))

    if left_draft in ("above", "refine"):  # x_{r,c-j} guessed as x_{r-1,c-j}
        buf = torch.cat([before, st.seq[rep, above]], 1)
        q = st.dist(drafter.down_step(trunk, hidden, left_features(buf)), draft_temperature)  # (S, W, V)
        st.draft_calls += 1
        if left_draft == "refine":  # once more, each left neighbour the first call's most likely draft
            buf = torch.cat([before, q.argmax(-1).repeat(st.reps, 1)], 1)
            q = st.dist(drafter.down_step(trunk, hidden, left_features(buf)), draft_temperature)
            st.draft_calls += 1
        return sample_probs(q, st.image_gens(images)), q
    u = uniform((len(images), g.width), st.image_gens(images), before.device)  # (S, W): the columns' draws at once
    guess = st.seq[rep[:len(images)], above[:len(images)]]  # (S, W): the row above
    return draft_columns(st, drafter, trunk, hidden, before, table, u, draft_temperature, guess,
                          "loop" if left_draft == "sequential_loop" else "fixed_point")


# options only the carry window reads: name -> (its least value, its value when off, what it does, what stands in for
# it without carry)
_CARRY_ONLY = {
    "second_row_wait": (0, None, "holds back the second row of the carry window",
                        "a row is drafted when the row above is done"),
    "max_row_passes": (1, None, "caps the passes over a carried row", "`rounds` bounds a row's passes"),
    "max_fed": (1, None, "bounds the slots a carry-window pass feeds", "a pass feeds its row"),
    "siblings": (0, 0, "judges the token after a pass's first change in the same pass",
                 "every column is judged each pass"),
    "redraft": (0, 0, "re-drafts tokens carried to the next pass", "the paper's rule keeps no carried tokens"),
    "reweight": (0, 0, "draws the tokens after a pass's first change again",
                 "the paper's rule keeps no carried tokens")}
_HIDDEN_STATES_ONLY = {  # options that read the drafter's hidden states: name -> what they do with them
    "redraft": "chains f_phi.right from a target state",
    "reweight": "reads how the drafter's prediction moves with the token before it"}


def _check_options(drafter, rule: CarryRule, exact: bool, carry: bool, temperature: float,
                   slots: int | None = None) -> None:
    """Clear errors for settings out of range or that do not combine."""
    for name, (least, off, what, without) in _CARRY_ONLY.items():
        value = getattr(rule, name)
        if value is None:
            continue
        expect_int(name, value, least)
        if value != off and not carry:
            raise ValueError(f"{name}={value} {what} and needs carry=true (without carry, {without}); set "
                             f"{name}={'null' if off is None else off} or carry=true")
    for name, what in _HIDDEN_STATES_ONLY.items():
        if getattr(rule, name) and getattr(drafter, "predicts", "hidden") == "tokens":
            raise ValueError(f"{name}={getattr(rule, name)} {what} and needs a hidden-state drafter; this one "
                             f"predicts token ids: set {name}=0")
    if slots is not None and not carry:
        raise ValueError(f"slots={slots} (continuous batching) runs the carry window per image and needs "
                         f"carry=true; set carry=true or slots=null")
    if carry and exact:
        raise ValueError("carry=True and exact=True do not combine: exact verification finalises tokens left to "
                         "right and never carries any; set one of them to false")
    expect_int("rounds", rule.rounds, 0)
    for name, least in (("max_lead", 0), ("max_window_rows", 1), ("redraft_rows", 1)):
        if getattr(rule, name) is not None:
            expect_int(name, getattr(rule, name), least)
    expect_float("temperature", temperature, 0.0)
    if rule.acceptance not in RULES:
        raise ValueError(f"acceptance={rule.acceptance!r} is not a verification rule; use one of {', '.join(RULES)}")
    if rule.acceptance != "speculative":
        if not carry:
            raise ValueError(f"acceptance={rule.acceptance!r} judges the carry window's tokens and needs carry=true; "
                             f"set carry=true or acceptance=speculative")
        expect_float("typical_epsilon", rule.typical_epsilon, 0.0)
        expect_float("typical_delta", rule.typical_delta, 0.0)
        expect_int("latent_k", rule.latent_k, 1)
        expect_float("latent_delta", rule.latent_delta, 0.0)
        if rule.latent_delta >= 1:
            raise ValueError(f"latent_delta={rule.latent_delta} would let a judgement move all of p's mass; "
                             f"use 0 <= latent_delta < 1 (LANTERN's 0.1-0.4)")
    if rule.draft_temperature is not None:
        expect_float("draft_temperature", rule.draft_temperature, 0.0)
    if rule.left_draft not in ("sequential", "sequential_loop", "above", "refine"):
        raise ValueError(f"left_draft={rule.left_draft!r} is not a way to draft a row; use sequential, "
                         f"sequential_loop, above or refine")


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, drafter, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, rngs=None, rounds: int = 2,
             exact: bool = False, vertical: bool = True, carry: bool = False,
             draft_temperature: float | None = None, max_lead: int | None = 2, max_window_rows: int | None = None,
             redraft: int = 0, redraft_rows: int | None = None, slots: int | None = None,
             max_row_passes: int | None = None, second_row_wait: int | None = None,
             acceptance: str = "speculative", typical_epsilon: float = 0.09, typical_delta: float = 0.3,
             latent_k: int = 16, latent_delta: float = 0.1, left_draft: str = "sequential", siblings: int = 0, max_fed: int | None = None, reweight: int = 0):
    """SSD sampling of visual codes (B, H, W). Returns (codes, stats).
    `draft_temperature` (default: `temperature`) warps the drafted distribution q only; 0 drafts the argmax
    (q one-hot). Verification divides by the q the draft was drawn from, so exact mode stays lossless.
    `left_draft` (drafters with left context): how a down row is drafted, with or without carry. `max_lead`,
    `max_window_rows`, `redraft`, `redraft_rows`, `max_row_passes`, `second_row_wait`, `acceptance` (and its
    `typical_*` and `latent_*`), `siblings`, `max_fed` and `reweight` shape the carry window: see `ssd_rule.CarryRule`, where each is
    documented.
    `slots` (carry only): continuous batching (`ssd_stream`): the prompts are a queue, at most `slots` images are
    in flight and a finished image hands its slot to the next prompt (null: the prompts are one fixed batch).
    stats["nfe"] counts target passes over the batch (one forward of the batch counts once);
    with carry, stats["image_passes"] counts, per image, the passes it took part in (prefill included);
    stats["row_final_pass"] (B, H): the passes spent (prefill included; per image with carry, the batch's without)
    when each row was final."""
    rule = CarryRule(rounds=rounds, max_lead=max_lead, max_window_rows=max_window_rows,
                     draft_temperature=draft_temperature, redraft=redraft, redraft_rows=redraft_rows,
                     max_row_passes=max_row_passes, second_row_wait=second_row_wait, acceptance=acceptance,
                     typical_epsilon=typical_epsilon, typical_delta=typical_delta, latent_k=latent_k,
                     latent_delta=latent_delta, left_draft=left_draft,
                     siblings=siblings, max_fed=max_fed, reweight=reweight)
    _check_options(drafter, rule, exact, carry, temperature, slots)
    check_drafter(backbone, drafter, ("right", "down") if vertical else ("right",))
    drafter = fit_drafter(backbone, drafter)
    if slots is not None:
        from specgen.decoding.ssd_stream import generate_stream
        return generate_stream(backbone, prompts, drafter, slots, rule, cfg_scale, temperature, top_k, rngs,
                               vertical)
    st = SpecState(backbone, prompts, cfg_scale, temperature, top_k, rngs)
    g = st.g
    st.target_pass(g.prefix_len)  # prefill: prompt slot and begin-of-image
    if carry:
        return _generate_carry(st, drafter, rule, vertical)
    return _generate_rows(st, drafter, rounds, exact, vertical, draft_temperature, left_draft)


def _generate_rows(st: SpecState, drafter, rounds: int, exact: bool, vertical: bool,
                   draft_temperature: float | None, left_draft: str = "sequential"):
    """The paper's auto-correction (or `exact`): the batch's rows in lockstep, each drafted then verified."""
    g, B, dev = st.g, st.B, st.seq.device
    accept_map = torch.zeros(B, g.height, g.width, dtype=torch.bool, device=dev)
    rounds_used = torch.zeros(B, g.height, dtype=torch.long, device=dev)
    unchecked = torch.zeros(B, dtype=torch.long, device=dev)  # tokens never checked against their final context
    row_final = torch.zeros(B, g.height, dtype=torch.long, device=dev)  # the batch's passes when each row was done
    for r in range(g.height):
        cols = g.position(r, torch.arange(g.width, device=dev))  # (W,)
        if r:  # drafts read the row above's states from the one before its first token on
            st.hid.release(g.position(r - 1, 0) - 1)
        if r == 0 or not vertical:
            start = g.prefix_len - 1 if r == 0 else g.position(r - 1, g.width - 1) - 1
            draft, q = _draft_right(st, drafter, start, r, draft_temperature)
        else:
            draft, q = _draft_down(st, drafter, torch.full((B,), r, device=dev), None, draft_temperature, left_draft)
        st.set_tokens(cols, draft)
        if exact:
            accept_map[:, r], rounds_used[:, r] = _verify_exact(st, cols, q)
        else:
            accept_map[:, r], rounds_used[:, r], row_unchecked = _verify_autocorrect(st, cols, q, rounds)
            unchecked += row_unchecked
        row_final[:, r] = st.nfe
    codes = st.codes()
    stats = {"nfe": st.nfe, "draft_calls": st.draft_calls, "tokens_per_pass": g.num_visual_tokens / st.nfe,
             "accept_rate": accept_map.float().mean((1, 2)), "rounds_per_row": rounds_used.float().mean(1),
             "accept_map": accept_map, "unchecked_tokens": unchecked.float(), "row_final_pass": row_final,
             "state_slots": st.hid.peak_slots, "tokens_fed": st.fed_per_image()}
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


def _generate_carry(st: SpecState, drafter, rule: CarryRule, vertical: bool):
    """`carry=True`: per-image rows over one verification window (see `ssd_window.CarryWindow`)."""
    g = st.g
    win = CarryWindow(st, rule, drafter)
    flush = 0
    while True:
        draft_due(st, win, drafter, vertical)
        if not any(win.live()):
            if not win.unfinished():
                break
            continue
        if not win.unfinished():
            flush += 1
        win.step()
    codes = st.codes()
    accept_map = win.accept_map
    return codes, {"nfe": st.nfe, "draft_calls": st.draft_calls, "tokens_per_pass": g.num_visual_tokens / st.nfe,
                   "accept_rate": accept_map.float().mean((1, 2)),
                   "rounds_per_row": win.rounds_used.float().mean(1), "accept_map": accept_map,
                   "image_passes": win.image_passes(), "row_final_pass": win.row_final,
                   "flush_passes": flush, "state_slots": st.hid.peak_slots, "tokens_fed": st.fed_per_image(),
                   **win.pass_stats()}


def draft_due(st: SpecState, win: CarryWindow, drafter, vertical: bool) -> None:
    """Release the states no draft or pass reads any more, and draft the rows that are due (`win.ready()`)."""
    g, dev, draft_temperature = st.g, st.seq.device, win.rule.draft_temperature
    st.hid.release(win.floor())
    images = win.ready()
    if not images:
        return
    rows = [win.next_row[b] for b in images]
    if vertical and min(rows) > 0:
        draft, q = _draft_down(st, drafter, torch.tensor(rows, device=dev), torch.tensor(images, device=dev),
                               draft_temperature, win.rule.left_draft)
    elif len(images) < st.B or max(rows) != min(rows):
        return  # horizontal rows are drafted for the whole batch at once (one chain of right steps)
    else:
        r = rows[0]
        start = g.prefix_len - 1 if r == 0 else g.position(r - 1, g.width - 1) - 1
        draft, q = _draft_right(st, drafter, start, r, draft_temperature)
    cols = torch.tensor([g.position(r, 0) for r in rows], device=dev)[:, None] + torch.arange(g.width, device=dev)
    st.set_tokens(cols, draft, torch.tensor(images, device=dev))
    win.add(images, rows, q)


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
