"""The options of SSD's carry window (`ssd_window.CarryWindow`), as one rule: what each does, and where it departs
from the paper."""
from __future__ import annotations

from dataclasses import dataclass


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
