"""The carry window (`decoding.ssd_carry`): its pass accounting, per-image progress (a batch's images are their batch-1
selves, in a fixed batch and in continuous batching), its schedule options, its tail proposals (checked by hand)
and its acceptance rules. Greedy equality with AR and the chi-square tests of its settings are in
test_decoders.py."""
import pytest
import torch

from decoder_helpers import PROMPTS, default_carry, exact_joint, gof_pvalue, noisy_drafter, tiny
from specgen.decoding import ar, ssd_carry
from specgen.decoding.sampling import make_rngs
from specgen.decoding.ssd_carry.acceptance import Latent, Typical
from specgen.decoding.ssd_carry.tails import Redraft, Reweight, image_rows
from specgen.decoding.ssd_carry.window import CarryWindow
from specgen.drafters.fphi import TokenDrafter

MORE = PROMPTS + ["a green diamond", "two red circles", "a cross"]


def decode(m, p, drafter, seeds=None, **kw):
    return ssd_carry.generate(m, p, drafter, **{"cfg_scale": 3.0, **kw},
                              rngs=None if seeds is None else make_rngs(seeds))


def assert_batch_is_batch_one(m, p, drafter, out, st, images, **kw):
    """Each image of a batch decode has the tokens and passes it gets alone."""
    for i in images:
        one, st1 = decode(m, p[i:i + 1], drafter, [i], **kw)
        assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"], i


@pytest.mark.parametrize("rounds", [0, 2])
def test_carry_spends_the_row_budget_then_only_the_flush(rounds):
    """At most rounds + 1 passes per row, then passes only until the last carried token is final."""
    m = tiny(True)
    _, st = decode(m, m.prompts(PROMPTS), noisy_drafter(m), [0, 1, 2], rounds=rounds)
    assert st["flush_passes"] <= m.grid.num_visual_tokens
    assert st["nfe"] <= m.grid.height * (rounds + 1) + 1 + st["flush_passes"]
    assert (st["rounds_per_row"] <= rounds + 1).all()


@pytest.mark.parametrize("rounds", [0, 2])
def test_carry_pass_statistics_account_for_every_token_once(rounds):
    """Where the passes go: every visual token is judged fresh once and finalised once, so tokens finalised per
    pass times the image's passes is the grid, sampled or greedy; a noisy drafter's fresh drafts change more often
    than carried tokens (which are checked against the last pass's p)."""
    m = tiny(True)
    p = m.prompts(PROMPTS)
    n = m.grid.num_visual_tokens
    _, st = decode(m, p, noisy_drafter(m), [0, 1, 2], rounds=rounds)
    assert torch.allclose(st["final_per_pass"] * (st["image_passes"] - 1), torch.full((3,), float(n)))
    for key in ("fresh_change_rate", "carried_change_rate", "first_change_fresh"):
        assert ((st[key] >= 0) & (st[key] <= 1)).all(), key
    assert (st["fresh_change_rate"] > st["carried_change_rate"]).all() and (st["fresh_change_rate"] > 0.2).all()
    # cascades: by distance, every token is judged fresh once; the bins add up to the change rates; a pass whose
    # window's first token (distance 0) changed finalised only that token
    by = st["change_by_distance"]  # (B, fresh/carried, judged/changed, distance)
    assert by.shape == (3, 2, 2, 2 * m.grid.width)
    assert torch.equal(by[:, 0, 0].sum(-1), torch.full((3,), float(n)))
    for kind, key in enumerate(("fresh_change_rate", "carried_change_rate")):
        assert torch.allclose(by[:, kind, 1].sum(-1) / by[:, kind, 0].sum(-1).clamp_min(1), st[key])
    assert torch.allclose(st["single_token_passes"] * (st["image_passes"] - 1), by[:, :, 1, 0].sum(1))
    assert ((st["after_change_rate"] >= 0) & (st["after_change_rate"] <= 1)).all()
    assert (by[:, :, 1] <= by[:, :, 0]).all() and (st["single_token_passes"] > 0).all()
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    out, st = decode(m, p, noisy_drafter(m), temperature=0, rounds=rounds)
    assert torch.equal(out, ref)
    assert torch.allclose(st["final_per_pass"] * (st["image_passes"] - 1), torch.full((3,), float(n)))


def test_carry_images_progress_alone_in_a_batch():
    """Per-image rows: an image's tokens and its pass count are those it gets at batch 1 (greedy and sampled),
    the batch's passes are its slowest image's without a lead bound, and more with max_lead=0 (lockstep rows)."""
    m = tiny(True, grid=6)
    p = m.prompts(MORE[:4])
    for temperature in (0.0, 1.0):
        kw = dict(temperature=temperature, rounds=1)
        out, st = decode(m, p, noisy_drafter(m), range(4), max_lead=None, **kw)
        assert_batch_is_batch_one(m, p, noisy_drafter(m), out, st, range(4), **kw)
        assert st["nfe"] == st["image_passes"].max()
        assert len(set(st["image_passes"].tolist())) > 1  # images do differ in the passes they need
        _, lock = decode(m, p, noisy_drafter(m), range(4), max_lead=0, **kw)
        assert torch.equal(lock["image_passes"], st["image_passes"]) and lock["nfe"] >= st["nfe"]
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    assert torch.equal(decode(m, p, noisy_drafter(m), temperature=0, max_lead=1)[0], ref)


def test_bad_carry_settings_name_the_value():
    m = tiny(True)
    p, d = m.prompts(PROMPTS[:1]), noisy_drafter(m)
    for name, value in (("max_lead", -1), ("max_window_rows", 0), ("second_row_wait", -1), ("slots", 0)):
        with pytest.raises(ValueError, match=name):
            decode(m, p, d, **{name: value})
    for make, name in ((lambda: Redraft(rows=0), "rows"), (lambda: Redraft(depth=0), "depth"),
                       (lambda: Reweight(depth=-1), "depth"), (lambda: Typical(epsilon=-0.1), "epsilon"),
                       (lambda: Latent(k=0), "k"), (lambda: Latent(delta=1.0), "delta=1.0")):
        with pytest.raises(ValueError, match=name):
            make()
    tokens = TokenDrafter(m.hidden_size, m.grid.num_visual)
    with pytest.raises(ValueError, match="Reweight reads the drafter's hidden states.*set tails=\\[\\]"):
        decode(m, p, tokens, tails=[Reweight(2)])


def test_window_bound_keeps_greedy_equality_and_batch_invariance():
    """max_window_rows: outputs stay exact, a batch's images are their batch-1 selves."""
    m = tiny(True, grid=6)
    p = m.prompts(MORE[:4])
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for rows in (1, 2):
        assert torch.equal(decode(m, p, noisy_drafter(m), temperature=0, max_window_rows=rows)[0], ref)
    out, st = decode(m, p, noisy_drafter(m), range(4), max_window_rows=1)
    assert_batch_is_batch_one(m, p, noisy_drafter(m), out, st, range(4), max_window_rows=1)


def test_redraft_keeps_greedy_equality_batch_invariance_and_limits_itself_to_its_rows():
    """Redraft(k): the tail after a change is drafted again by f_phi.right; every token is still verified (greedy
    output = AR), an image's draws are its own (batch = batch 1), and the re-drafts are counted as draft calls:
    rows=1 re-drafts only the first (horizontally drafted) row, fewer than every row and more than none."""
    m = tiny(True, grid=6)
    p = m.prompts(MORE[:4])
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for rounds, rows in ((0, None), (1, None), (0, 1)):
        out, _ = decode(m, p, noisy_drafter(m), temperature=0, rounds=rounds, tails=[Redraft(3, rows=rows)])
        assert torch.equal(out, ref)
    calls = {rows: decode(m, p, noisy_drafter(m), range(4), tails=[Redraft(3, rows=rows)])[1]["draft_calls"]
             for rows in (1, 6, None)}
    plain = decode(m, p, noisy_drafter(m), range(4))[1]["draft_calls"]
    assert plain < calls[1] < calls[None] == calls[6]
    kw = dict(rounds=1, max_window_rows=2, tails=[Redraft(2, rows=None)])
    out, st = decode(m, p, noisy_drafter(m), range(4), **kw)
    assert_batch_is_batch_one(m, p, noisy_drafter(m), out, st, range(4), **kw)


def test_continuous_batching_keeps_every_image_and_counts_passes_exactly():
    """slots=S (continuous batching): greedy output equals AR's; every image's tokens and passes are its batch-1
    ones (greedy and sampled); one slot spends exactly the sum of the images' batch-1 passes, slots for every
    prompt exactly the slowest image's, and fewer slots than prompts something in between; each image reports its
    own positions fed."""
    m = tiny(True, grid=6)
    p = m.prompts(MORE)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for slots in (1, 2, 6):
        assert torch.equal(decode(m, p, noisy_drafter(m), temperature=0, slots=slots)[0], ref)
    kw = dict(rounds=1, **{k: v for k, v in default_carry().items() if k not in ("rounds", "tails")})
    alone = [decode(m, p[i:i + 1], noisy_drafter(m), [i], **kw) for i in range(6)]
    runs = {s: decode(m, p, noisy_drafter(m), range(6), slots=s, **kw) for s in (1, 3, 6)}
    for s, (out, st) in runs.items():
        for i, (one, st1) in enumerate(alone):
            assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"]
            assert st["tokens_fed"][i] == st1["tokens_fed"][0]
    passes = [st1["nfe"] for _, st1 in alone]
    assert len(set(passes)) > 1
    assert runs[1][1]["nfe"] == sum(passes) and runs[6][1]["nfe"] == max(passes)
    assert runs[6][1]["nfe"] <= runs[3][1]["nfe"] < sum(passes)
    assert runs[3][1]["nfe"] >= sum(passes) / 3  # no pass serves more than its 3 slots
    assert 0 < runs[3][1]["slot_occupancy"] <= 1


def test_continuous_batching_refuses_a_backbone_without_ragged_caches():
    m = tiny(True)

    class NoRagged:  # a backbone without per-row cache lengths (the protocol's minimum)
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name == "new_ragged_cache":
                raise AttributeError(name)
            return getattr(self.inner, name)

    with pytest.raises(ValueError, match="new_ragged_cache"):
        decode(NoRagged(m), m.prompts(PROMPTS), noisy_drafter(m), slots=2)


def test_row_final_pass_records_when_each_row_is_final():
    m = tiny(True, grid=6)
    _, st = decode(m, m.prompts(PROMPTS), noisy_drafter(m), range(3))
    rf = st["row_final_pass"]
    assert rf.shape == (3, 6) and bool((rf[:, 1:] >= rf[:, :-1]).all()) and bool((rf > 1).all())
    assert torch.equal(rf[:, -1].float(), st["image_passes"])


def test_second_row_wait_drafts_row_one_only_once_row_zero_has_settled(monkeypatch):
    """second_row_wait=m: when the second row is drafted, at most m of the first row's tokens are not final (without
    the wait, some images draft it earlier with a noisy drafter); greedy output stays AR's; each image keeps its
    batch-1 tokens and passes in a fixed batch and in continuous batching."""
    m = tiny(True, grid=6)
    p, g = m.prompts(MORE), m.grid.at(m.prompts(MORE[:1]).rows(True).length)
    kw = dict(max_window_rows=2)
    seen, add = [], CarryWindow.add

    def spy(self, images, rows, q):
        unsettled = [max(g.position(0, g.width - 1) + 1 - self.final_upto[b], 0) for b in images]
        seen.extend(u for u, r in zip(unsettled, rows) if r == 1)
        return add(self, images, rows, q)
    monkeypatch.setattr(CarryWindow, "add", spy)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    decode(m, p, noisy_drafter(m), range(6), **kw)
    assert len(seen) == 6 and max(seen) > 1  # without the wait, row 1 comes while row 0 is unsettled
    for wait in (0, 1):
        assert torch.equal(decode(m, p, noisy_drafter(m), temperature=0, second_row_wait=wait, **kw)[0], ref)
        seen.clear()
        decode(m, p, noisy_drafter(m), range(6), second_row_wait=wait, **kw)
        assert len(seen) == 6 and max(seen) <= wait
        for slots in (None, 3):
            out, st = decode(m, p, noisy_drafter(m), range(6), second_row_wait=wait, slots=slots, **kw)
            assert_batch_is_batch_one(m, p, noisy_drafter(m), out, st, range(6), second_row_wait=wait, **kw)


def test_a_left_context_drafter_drafts_a_down_row_in_fewer_calls_than_columns():
    """A down row with left context is drafted column by column by fixed-point iteration: between one call and W
    calls per row, the first row a chain of W - 1 right steps."""
    m = tiny(True)
    g = m.grid
    _, st = decode(m, m.prompts(PROMPTS[:1]), noisy_drafter(m, left=True), [0])
    right_calls = g.width - 1
    assert right_calls + g.height - 1 <= st["draft_calls"] < right_calls + (g.height - 1) * g.width


def test_typical_acceptance_in_the_carry_window():
    """Typical with a zero threshold keeps every draft: each row costs exactly one pass (prefill + H); the
    speculative test with the same noisy drafter spends more; carried_only keeps images batch-invariant."""
    m = tiny(True, grid=6)
    p = m.prompts(MORE[:4])
    kw = dict(max_window_rows=2)
    _, st = decode(m, p, noisy_drafter(m), range(4), acceptance=Typical(0.0, 0.0), **kw)
    assert st["image_passes"].tolist() == [1.0 + m.grid.height] * 4
    assert float(st["carried_change_rate"].max()) == 0.0 and float(st["fresh_change_rate"].max()) == 0.0
    _, exact = decode(m, p, noisy_drafter(m), range(4), **kw)
    _, typ = decode(m, p, noisy_drafter(m), range(4), acceptance=Typical(), **kw)
    assert float(exact["image_passes"].mean()) > float(typ["image_passes"].mean()) >= 1 + m.grid.height
    carried = dict(kw, acceptance=Typical(carried_only=True))
    out, st = decode(m, p, noisy_drafter(m), range(4), **carried)
    assert_batch_is_batch_one(m, p, noisy_drafter(m), out, st, range(4), **carried)


def _with_codebook(m, dim: int = 4, seed: int = 0):
    """Attach a tiny random VQ tokenizer so that acceptance `Latent` finds the codebook's neighbours."""
    from specgen.tokenizers.vq import VQAutoencoder

    torch.manual_seed(seed)
    return m.attach_tokenizer(VQAutoencoder(ch=8, mults=(2, 2), z_dim=dim, num_codes=m.grid.num_visual).eval())


def test_latent_acceptance_in_the_carry_window():
    """Latent: greedy output still equals AR's; delta 0 decodes the speculative test's images and passes; a large
    delta with many neighbours accepts more, so fewer passes; batch = batch 1."""
    m = _with_codebook(tiny(True, grid=6))
    p = m.prompts(MORE[:4])
    kw = dict(max_window_rows=2, tails=[Redraft(2, rows=None)])
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for carried_only in (False, True):
        out, _ = decode(m, p, noisy_drafter(m), temperature=0, acceptance=Latent(8, 0.5, carried_only), **kw)
        assert torch.equal(out, ref)
    spec, st_spec = decode(m, p, noisy_drafter(m), range(4), **kw)
    zero, st_zero = decode(m, p, noisy_drafter(m), range(4), acceptance=Latent(delta=0.0), **kw)
    assert torch.equal(spec, zero) and torch.equal(st_spec["image_passes"], st_zero["image_passes"])
    loose = dict(kw, acceptance=Latent(20, 0.6))
    out, st_loose = decode(m, p, noisy_drafter(m), range(4), **loose)
    assert float(st_loose["image_passes"].mean()) < float(st_spec["image_passes"].mean())
    assert_batch_is_batch_one(m, p, noisy_drafter(m), out, st_loose, range(4), **loose)
    carried = dict(kw, acceptance=Latent(20, 0.6, carried_only=True))
    out, st_carried = decode(m, p, noisy_drafter(m), range(4), **carried)
    assert float(st_carried["carried_change_rate"].mean()) < float(st_spec["carried_change_rate"].mean())
    assert_batch_is_batch_one(m, p, noisy_drafter(m), out, st_carried, range(2), **carried)


def _check_reweight_by_hand(m, drafter, calls) -> tuple[int, int]:
    """Each `Reweight.propose` call's proposals: q' = p * exp(f(new) - f(old)), f the guided logits computed by hand
    (the down draft through `down_column`, or f_phi.right steps from the state before the change); for the second
    tail token, new is the first one as drawn again and old as fed. Returns the first proposals checked, and the
    second ones whose first tail token was drawn other than it stood (its left token changed)."""
    checked = moved = 0
    for state, slots_before, own, first, fed, before, pb, above, cached, (slots, qs), after in calls:
        if not slots:
            continue
        g, slot = state.g, own[first + 1]
        assert slots[0] == slot
        at = slots_before[slot]
        c = at - g.position(g.row_col(at)[0], 0)

        def guided(toks, col):  # toks: the tokens after the change, nearest to it first
            h = above
            for tok in toks:
                e = m.embed_visual(tok).expand(2, -1)
                h = drafter.right(h, e) if cached is None else drafter.down_column(cached[0][:, col],
                                                                                   cached[1][:, col], e)
            cond, uncond = m.visual_logits(h)  # (2, D) in: the conditional and unconditional rows
            return uncond + 3.0 * (cond - uncond)

        new, old = before[own[first]], fed[own[first]]
        want = pb[slot] * torch.exp(guided([new], c) - guided([old], c))
        assert torch.allclose(qs[0], want / want.sum(), atol=1e-5)
        checked += 1
        if len(slots) > 1:  # the second: after the first tail token as drawn again, and as fed
            nxt = slots[1]
            path_new, path_old = ([new, after[slot]], [old, fed[slot]]) if cached is None else \
                ([after[slot]], [fed[slot]])
            want = pb[nxt] * torch.exp(guided(path_new, c + 1) - guided(path_old, c + 1))
            assert torch.allclose(qs[1], want / want.sum(), atol=1e-5)
            moved += int(after[slot] != before[slot])
    return checked, moved


def test_reweight_draws_the_token_after_a_change_from_the_reweighted_p_and_keeps_images_their_own():
    """Reweight(k): after a pass's first change, the next tokens are drawn from q' = p * f(new) / f(old), normalised
    (checked by hand for every call: the drafter's down draft through `down_column` with the new and the old left
    tokens' embeddings in a down row, or for a drafter without left context f_phi.right from the state before the
    change); an image's draws are its own (batch = batch 1); final rows leave the kept trunks."""
    m = tiny(True, grid=6)
    p = m.prompts(MORE[:4])
    d = noisy_drafter(m, left=True)
    kw = dict(max_window_rows=2, tails=[Redraft(2, rows=1), Reweight(2)])
    calls, kept = [], []
    propose = Reweight.propose

    def spy(self, win, b, own, first, fed, tokens, pb):
        at = win.slots[own[first]]
        before, state = tokens.clone(), win.st.hid[image_rows(win.st, b), at - 1].clone()
        cached = (win.drafting.down_rows or {}).get((b, win.st.g.row_col(at)[0]))
        out = propose(self, win, b, own, first, fed, tokens, pb)
        calls.append((win.st, list(win.slots), own, first, fed.clone(), before, pb, state, cached, out,
                      tokens.clone()))
        kept.append(len(win.drafting.down_rows))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Reweight, "propose", spy)
        out, st = decode(m, p, d, range(4), **kw)
        checked, moved = _check_reweight_by_hand(m, d, calls)
        assert checked >= 5 and moved >= 1 and all(c[8] is not None for c in calls if c[9][0])  # down rows
        assert max(kept) <= 4 * 2  # at most the rows not final yet of each image
        calls.clear()
        point = noisy_drafter(m)  # no left context: every row's tokens after a change from f_phi.right's chain
        decode(m, p, point, range(4), tails=[Reweight(2)], max_window_rows=2)
        assert _check_reweight_by_hand(m, point, calls)[0] >= 5 and all(c[8] is None for c in calls)
    plain = decode(m, p, d, range(4), **dict(kw, tails=[Redraft(2, rows=1)]))[1]
    assert st["draft_calls"] > plain["draft_calls"]
    assert_batch_is_batch_one(m, p, d, out, st, range(4), **kw)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    assert torch.equal(decode(m, p, point, temperature=0, **kw)[0], ref)


def test_pass_statistics_counted_at_once_equal_counting_pass_by_pass():
    """PassStats records a pass as it is and counts the recorded passes when read; the counts equal counting each
    pass as it comes (the reference below), with reads between passes."""
    from specgen.decoding.ssd_carry.stats import KEYS, PassStats

    def reference(stats, b, fresh, changed, first):
        c = stats["counts"]
        c["fresh"][b] += fresh.sum()
        c["fresh_changed"][b] += (changed & fresh).sum()
        c["carried"][b] += (~fresh).sum()
        c["carried_changed"][b] += (changed & ~fresh).sum()
        c["finalised"][b] += first + 1
        if changed.any():
            c["changed"][b] += 1
            c["first_on_fresh"][b] += fresh[first].float()
        if stats["last"][b]:
            c["after"][b] += 1
            c["after_changed"][b] += changed[0].float()
        c["single"][b] += changed[0].float()
        stats["last"][b] = changed.any()
        d = torch.arange(fresh.numel()).clamp_max(stats["dist"].shape[-1] - 1)
        kind = (~fresh).long()
        stats["dist"][b, :, 0].index_put_((kind, d), torch.ones_like(d, dtype=torch.float), accumulate=True)
        stats["dist"][b, :, 1].index_put_((kind, d), changed.float(), accumulate=True)

    torch.manual_seed(0)
    B, W = 3, 4
    new = PassStats(B, W, "cpu")
    ref = {"counts": {k: torch.zeros(B) for k in KEYS}, "last": torch.zeros(B, dtype=torch.bool),
           "dist": torch.zeros(B, 2, 2, 2 * W)}
    for step in range(60):
        b, n = int(torch.randint(B, ())), int(torch.randint(1, 3 * W, ()))  # windows longer than 2W share a bin
        fresh, changed = torch.rand(n) < 0.5, torch.rand(n) < 0.3
        first = int(changed.float().argmax()) if changed.any() else n - 1
        new.record(b, fresh.tolist(), changed[None], first)  # as the window records: flags listed, (1, n) changes
        reference(ref, b, fresh, changed, first)
        if step % 25 == 0:  # read in between: the counts so far, and later passes still follow the last one
            new.summary(torch.full((B,), step + 1))
    passes = torch.full((B,), 60)
    got = new.summary(passes)
    for k in KEYS:
        assert torch.equal(new.counts[k], ref["counts"][k]), k
    assert torch.equal(new.by_distance, ref["dist"]) and torch.equal(got["change_by_distance"], ref["dist"])
    assert torch.equal(new.summary(passes)["single_token_passes"], got["single_token_passes"])  # reading twice: same
    assert ref["counts"]["after"].sum() > 0 and ref["counts"]["first_on_fresh"].sum() > 0  # both branches ran


@pytest.mark.slow
def test_carry_window_samples_the_models_distribution_on_a_3x3_grid():
    """The default's carry settings on a 3x3 grid of 2 codes (512 images, longer carry chains than 2x2): chi-square
    of 20,000 samples against the exact joint, without and with the reweighted tokens after a change; typical
    acceptance of carried tokens on the same draws is rejected."""
    n = 20000
    m = tiny(True, codes=2, grid=3, sharpen=3.0)
    joint = exact_joint(m, PROMPTS[0], cfg_scale=2.0)
    prompts = m.prompts([PROMPTS[0]] * n)
    redraft = default_carry(tails=[Redraft(4, rows=1)])
    out, _ = ssd_carry.generate(m, prompts, noisy_drafter(m), cfg_scale=2.0, rngs=make_rngs(range(n)), **redraft)
    assert gof_pvalue(out, joint) > 1e-3
    out, _ = ssd_carry.generate(m, prompts, noisy_drafter(m), cfg_scale=2.0, rngs=make_rngs(range(n)),
                                **dict(redraft, acceptance=Typical(carried_only=True)))
    assert gof_pvalue(out, joint) < 1e-6
    out, _ = ssd_carry.generate(m, prompts, noisy_drafter(m, left=True), cfg_scale=2.0, rngs=make_rngs(range(n)),
                                **default_carry())
    assert gof_pvalue(out, joint) > 1e-3


def stream_world(left: bool, **options):
    """The tiny world of the stream tests: (model, 6 prompts, the default carry's options for a stream of 4 slots),
    after checking that such a stream with `options` decodes greedy output equal to AR's."""
    m = tiny(True, grid=6)
    p = m.prompts(MORE)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    out, _ = decode(m, p, noisy_drafter(m, left), temperature=0, slots=4, **options)
    assert torch.equal(out, ref)
    return m, p, default_carry(slots=4)


@pytest.mark.parametrize("left", [False, True])
def test_a_stream_drafts_the_rows_due_between_passes_together_with_every_image_unchanged(left):
    """batch_drafts (the default): the down rows a stream's images draft between two passes go through one drafter
    call, not one per image. Every image keeps its tokens, passes and first-judgement acceptance (greedy and sampled,
    the default's tails included: Reweight reads the rows kept per image), and the drafter is called fewer times.
    Greedy output stays AR's."""
    m, p, kw = stream_world(left)
    together = decode(m, p, noisy_drafter(m, left), range(6), **kw)
    alone = decode(m, p, noisy_drafter(m, left), range(6), batch_drafts=False, **kw)
    assert torch.equal(together[0], alone[0])
    for key in ("image_passes", "accept_map", "tokens_fed"):
        assert torch.equal(together[1][key], alone[1][key]), key
    assert together[1]["nfe"] == alone[1]["nfe"]
    assert together[1]["draft_calls"] < alone[1]["draft_calls"]


@pytest.mark.parametrize("acceptance", [None, Typical()])
def test_a_stream_judges_its_windows_together_with_every_image_unchanged(acceptance, monkeypatch):
    """batch_judge (the default): after a shared pass, the stream's windows are judged in one call
    (`Speculative.together`; a rule without one, e.g. Typical, is judged window by window). Every image keeps its
    tokens, passes, acceptance and where its passes went, sampled with the default's tails (their draws follow the
    judgement's in each image's own stream)."""
    from specgen.decoding.ssd_carry.acceptance import Speculative

    calls = []
    together = Speculative.together
    monkeypatch.setattr(Speculative, "together", staticmethod(lambda items: calls.append(len(items)) or together(items)))
    m = tiny(True, grid=6)
    p = m.prompts(MORE)
    kw = default_carry(slots=4, **({} if acceptance is None else {"acceptance": acceptance}))
    one = decode(m, p, noisy_drafter(m, True), range(6), **kw)
    many = decode(m, p, noisy_drafter(m, True), range(6), batch_judge=False, **kw)
    assert torch.equal(one[0], many[0])
    for key in ("image_passes", "accept_map", "tokens_fed", "fresh_change_rate", "carried_change_rate"):
        assert torch.equal(one[1][key], many[1][key]), key
    assert one[1]["nfe"] == many[1]["nfe"]
    if acceptance is None:
        assert max(calls) > 1  # several windows judged in one call
    else:
        assert not calls


def test_speculative_together_equals_each_window_judged_alone():
    """The judgements of windows of different lengths, each with its own generator, in one call equal each judged
    alone, draw for draw, and leave every generator where judging alone leaves it."""
    from specgen.decoding.ssd_carry.acceptance import Speculative

    torch.manual_seed(0)
    V, sizes = 7, [3, 1, 5]
    items = []
    for n in sizes:
        p, q = torch.rand(1, n, V).softmax(-1), torch.rand(1, n, V).softmax(-1)
        items.append((torch.randint(V, (1, n)), p, q, None))
    judge = Speculative().bind(None)
    alone_gens, together_gens = make_rngs(range(3)), make_rngs(range(3))
    alone = [judge(*item, [g]) for item, g in zip(items, alone_gens)]
    got = Speculative.together([(*item, [g]) for item, g in zip(items, together_gens)])
    for (t1, a1), (t2, a2) in zip(alone, got):
        assert torch.equal(t1, t2) and torch.equal(a1, a2)
    assert all(torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
               for a, b in zip(alone_gens, together_gens))
    assert not all(bool(a.all()) for _, a in alone)  # some token was redrawn: the residual draws were compared
    assert Speculative.together([(*items[0], None)]) is None  # the global stream: not judged together


def test_a_packed_stream_computes_only_its_images_tokens_and_decodes_as_padded():
    """packed (the default): a stream's forwards feed only its images' own tokens through the projections and MLPs
    (fewer token positions computed than its padded grid's), and decode as the padded stream does: greedy output is
    AR's, sampled output the padded stream's up to the rounding of products of another number of rows (on the
    machines seen, every token)."""
    from specgen.analysis.ssd_costs import Clock

    m, p, kw = stream_world(True)
    clocks = {True: Clock(), False: Clock()}
    packed = decode(m, p, noisy_drafter(m, True), range(6), trace=clocks[True], **kw)
    padded = decode(m, p, noisy_drafter(m, True), range(6), packed=False, trace=clocks[False], **kw)
    assert (packed[0] == padded[0]).float().mean() > 0.95
    grid = [f[0] * f[1] for f in clocks[True].forwards]
    assert clocks[False].computed == [f[0] * f[1] for f in clocks[False].forwards]
    assert sum(clocks[True].computed) < 0.9 * sum(grid)  # the padding is not computed


def test_per_image_attention_decodes_as_the_packed_stream():
    """per_image_attention (off by default): a packed stream's attention image by image over its own keys. Greedy
    output is AR's; sampled output the packed stream's up to the rounding of attention over fewer keys (on the
    machines seen, every token)."""
    m, p, kw = stream_world(True, per_image_attention=True)
    grouped = decode(m, p, noisy_drafter(m, True), range(6), per_image_attention=True, **kw)
    packed = decode(m, p, noisy_drafter(m, True), range(6), **kw)
    assert (grouped[0] == packed[0]).float().mean() > 0.95
