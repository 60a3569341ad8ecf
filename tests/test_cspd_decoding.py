"""CSpD and MAR sampling on tiny random MARs: pre-fill by steps, the draft's tokens kept, MAR's CFG schedule,
work counted against target-only sampling, exactness of the lossless mode (with and without a DDIM tail)."""
import copy

import pytest
import torch
from scipy import stats

from specgen.backbones.mar import ShapesMAR
from specgen.decoding import cspd, mar
from specgen.decoding.cspd_core import evaluate_on, run_chain
from specgen.decoding.sampling import make_rngs

PROMPTS = ["a red circle", "two squares"]


def _tiny_mar(seed=0, grid_size=4, token_dim=3, sample_steps=5, buffer_size=40):
    """A random tiny MAR whose head depends on its conditions (the zero-initialised output layers of a
    fresh head would make every token's chain ignore the context and the prompt)."""
    torch.manual_seed(seed)
    m = ShapesMAR(grid_size=grid_size, token_dim=token_dim, preset="tiny", sample_steps=sample_steps,
                  buffer_size=buffer_size).eval()
    with torch.no_grad():
        for p in m.diffloss.parameters():
            if not p.any():
                p.normal_(0, 0.3)
    return m


def _near(m, scale, seed=9):
    """A copy of `m` with every head weight perturbed by `scale` x N(0, 1)."""
    d = copy.deepcopy(m)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in d.diffloss.parameters():
            p.add_(scale * torch.randn_like(p))
    return d


def test_mar_sampling_is_reproducible_per_image_and_counts_its_work():
    m = _tiny_mar()
    assert mar.schedule(16, 4)[-1] == 16 and all(a < b for a, b in zip(mar.schedule(16, 4), mar.schedule(16, 4)[1:]))
    a, st = mar.generate(m, PROMPTS, make_rngs([1, 2]), num_iter=4)
    b, _ = mar.generate(m, ["two squares"], make_rngs([2]), num_iter=4)
    assert a.shape == (2, 16, 3) and torch.allclose(a[1], b[0], atol=1e-5)  # an image does not depend on its batch
    assert st["nfe"] == st["target_sets"] == 4 and st["target_calls"] == 4
    assert st["target_head_evals"] == 16 * 5 * 2  # every token, every denoising step, both CFG branches
    assert st["target_work_ratio"] == st["target_head_ratio"] == 1.0 and st["draft_head_evals"] == 0
    _, plain = mar.generate(m, PROMPTS, make_rngs([1, 2]), num_iter=4, cfg_scale=1.0)
    assert plain["target_head_evals"] == 16 * 5 and plain["target_work_ratio"] == 1.0


def test_schedule_allows_one_token_per_step_and_refuses_more_steps_than_tokens():
    assert mar.schedule(16, 16) == list(range(1, 17))  # the authors' regime: one token per MAR step
    m = _tiny_mar()
    _, st = cspd.generate(m, PROMPTS, make_rngs([1, 2]), _near(m, 0.05), num_iter=16, gamma=4)
    assert st["drafted"] + 2 * st["prefill_steps"] == 2 * 16  # every step after the pre-fill drafts one token
    with pytest.raises(ValueError, match="num_iter=17 MAR steps for 16 tokens.*between 1 and 16"):
        mar.generate(m, PROMPTS, make_rngs([1, 2]), num_iter=17)
    with pytest.raises(ValueError, match="num_iter=17 MAR steps for 16 tokens"):
        cspd.generate(m, PROMPTS, make_rngs([1, 2]), _near(m, 0.05), num_iter=17)


def test_linear_cfg_schedule_counts_the_tokens_known_after_the_step():
    """MAR: the scale of a step is 1 + (cfg - 1) x (known after the step, at most L - 1) / L, never 1 with
    guidance; `linear_full` reaches the full scale at the last step."""
    m = _tiny_mar()
    st = mar.MARState(m, make_rngs([0, 1]), 4)
    sched = st.schedule
    assert sched == mar.schedule(st.L, 4)
    _, _, z = mar.mar_step(m, st, mar.conditioning(m, PROMPTS, 3.0), sched[0], 3.0, "linear", 1.0)
    assert z[2] == pytest.approx(1 + 2.0 * sched[0] / 16) and z[2] > 1
    assert mar.cfg_at(3.0, "linear", 16, 16) == 2.875 and mar.cfg_at(3.0, "linear_full", 16, 16) == 3.0
    assert mar.cfg_at(3.0, "constant", 1, 16) == 3.0
    with pytest.raises(ValueError, match="unknown cfg_schedule 'cosine'.*linear_full"):
        mar.cfg_at(3.0, "cosine", 1, 16)


def test_prefill_counts_generation_steps():
    """The authors' rule pre-fills steps 0 .. floor(ratio x num_iter) (`step <= num_iter * ratio`: ratio 0 still
    pre-fills step 0); 'ceil' the smallest count that is at least the ratio."""
    assert [cspd.prefill_steps(r, 16) for r in (0.0, 0.05, 0.15, 0.25, 1.0)] == [1, 1, 3, 5, 16]
    assert [cspd.prefill_steps(r, 64) for r in (0.0, 0.05, 0.15)] == [1, 4, 10]  # 0.05 x 64 = 3.2: steps 0-3
    assert [cspd.prefill_steps(r, 16, "ceil") for r in (0.0, 0.05, 0.15, 0.25, 1.0)] == [0, 1, 3, 4, 16]
    m, d = _tiny_mar(0), _tiny_mar(1)
    sched = mar.schedule(16, 4)
    _, st = cspd.generate(m, PROMPTS, make_rngs([3, 4]), d, num_iter=4, prefill_ratio=0.5, gamma=1, prefill_rule="ceil")
    assert st["prefill_steps"] == 2 and st["drafted"] == 2 * (16 - sched[1]) and st["rounds"] == 2
    ref, _ = mar.generate(m, PROMPTS, make_rngs([3, 4]), num_iter=4)
    out, st = cspd.generate(m, PROMPTS, make_rngs([3, 4]), d, num_iter=4, prefill_ratio=1.0)
    assert torch.allclose(out, ref) and st["drafted"] == 0 and st["target_work_ratio"] == 1.0


def test_draft_equal_to_target_accepts_everything_under_stepwise_verification():
    m = _tiny_mar(0)
    for ratio in ("paper", "exact"):
        opts = dict(rounds="fixed", prefill_rule="ceil", verify_cfg="own_step",
                    **({"inner_temperature": 1.0} if ratio == "paper" else {}))
        _, st = cspd.generate(m, PROMPTS, make_rngs([3, 4]), m, num_iter=4, gamma=3, ratio=ratio,
                              prefill_ratio=0.0, verify="stepwise", **opts)
        assert st["accept_rate"] == 1.0 and st["drafted"] == 32 and st["target_sets"] == 4, ratio
        # judging every drafted step given only the tokens known before drafting (the paper's joint
        # verification) rejects some of the target's own drafts: later steps saw the earlier drafts
        _, joint = cspd.generate(m, PROMPTS, make_rngs([3, 4]), m, num_iter=4, gamma=3, ratio=ratio,
                                 prefill_ratio=0.0, verify="joint", **opts)
        assert joint["accept_rate"] < 0.9 and joint["target_sets"] == 2, ratio


def test_acceptance_is_counted_per_image_and_generation_step():
    """step_drafted / step_accepted (B, num_iter) add up to the totals; pre-fill steps draft nothing; the runner
    pools them into alpha per step."""
    from specgen.evaluation.runner import alpha_by_step

    m = _tiny_mar(0)
    d = _near(m, 0.03)
    sched = mar.schedule(16, 4)
    _, st = cspd.generate(m, PROMPTS, make_rngs([3, 4]), d, num_iter=4, gamma=2, prefill_ratio=0.25,
                          inner_temperature=1e4, prefill_rule="ceil")
    drafted, accepted = st["step_drafted"], st["step_accepted"]
    assert drafted.shape == (2, 4) and float(drafted.sum()) == st["drafted"] and float(accepted.sum()) == st["accepted"]
    assert drafted[:, 0].sum() == 0 and bool((accepted <= drafted).all())
    assert drafted[0, 1] == sched[1] - sched[0]  # the first drafted step fills its schedule's share of each image
    per_image = [{"step_drafted": drafted[b].tolist(), "step_accepted": accepted[b].tolist()} for b in range(2)]
    alpha = alpha_by_step("cspd", per_image)
    assert "cspd/alpha_by_step/s00" not in alpha
    for i in range(1, 4):
        assert alpha[f"cspd/alpha_by_step/s{i:02d}"] == pytest.approx(float(accepted[:, i].sum() / drafted[:, i].sum()))


def test_accepted_tokens_keep_the_drafts_value():
    """Everything accepted (density temperature 1e9), one round: CSpD returns the draft's own generation."""
    m, d = _tiny_mar(0), _tiny_mar(1)
    draft_only, _ = mar.generate(d, PROMPTS, make_rngs([5, 6]), num_iter=4)
    out, st = cspd.generate(m, PROMPTS, make_rngs([5, 6]), d, num_iter=4, gamma=4, prefill_ratio=0.0,
                            density_temperature=1e9, prefill_rule="ceil")
    assert st["accept_rate"] == 1.0 and torch.allclose(out, draft_only, atol=1e-6)


def test_work_is_counted_against_target_only_sampling():
    """Joint verification: one condition set per round; the paper's ratio runs the target's head once per
    drafted token and step (as sampling does) and its residual needs no head call."""
    m = _tiny_mar(0)
    d = _near(m, 0.03)
    rules = dict(rounds="fixed", prefill_rule="ceil")
    _, st = cspd.generate(m, PROMPTS, make_rngs([3, 4]), d, num_iter=4, gamma=3, prefill_ratio=0.0,
                          inner_temperature=1e4, **rules)  # the 5-step chain's last-step Gaussian is narrow: widen it
    assert st["target_sets"] == 2 and st["target_work_ratio"] == 2.0 and st["target_calls"] == 2
    assert st["target_head_evals"] == 16 * 5 * 2 and st["target_head_ratio"] == 1.0
    assert st["draft_sets"] == 4 and st["draft_work_frac"] == 1.0 and st["draft_head_frac"] == 1.0
    assert 0 < st["accept_rate"] < 1 and st["proposals"] > 0
    _, ex = cspd.generate(m, PROMPTS, make_rngs([3, 4]), d, num_iter=4, gamma=3, prefill_ratio=0.0,
                          ratio="exact", verify="stepwise", max_proposals=2, **rules)
    assert ex["target_sets"] == 4 and ex["target_work_ratio"] == 1.0
    # per image: the stochastic steps evaluated on the draft's states and the deterministic last step run by
    # the target (16 x 5 x 2), plus a fresh 5-step target chain for every residual proposal (2 images)
    rejected = ex["drafted"] - ex["accepted"]
    assert rejected > 0 and ex["target_head_evals"] >= 16 * 5 * 2 + rejected * 5 * 2 / 2


@pytest.mark.parametrize("ddim_tail", [0, 2])
def test_cspd_prefix_exact_reproduces_target_only_sampling(ddim_tail):
    """Lossless mode (stepwise verification, exact ratio, prefix acceptance): CSpD with a draft close to
    the target draws tokens from the target's distribution under the same sampler (two-sample KS per
    position, on the token sum and on a product of two positions), while the draft alone is told apart."""
    m = _tiny_mar(0, grid_size=2, token_dim=1, sample_steps=4, buffer_size=4)  # a short buffer: 1200 images are cheap
    d = _near(m, 0.06)
    n = 1200
    prompts = ["a red circle"] * n
    opts = dict(num_iter=3, cfg_scale=1.0, ddim_tail=ddim_tail)
    ref, _ = mar.generate(m, prompts, make_rngs(range(n)), **opts)
    out, st = cspd.generate(m, prompts, make_rngs(range(n, 2 * n)), d, gamma=2, prefill_ratio=0.0,
                            ratio="exact", acceptance="prefix", verify="stepwise", max_proposals=64, **opts)
    assert 0.1 < st["accept_rate"] < 0.95 and st["fallbacks"] == 0 and st["proposals"] > 0
    assert st["target_calls"] <= 3  # a round commits at least its first drafted step
    statistics = (lambda t: t[:, 0, 0], lambda t: t[:, 3, 0], lambda t: t.sum((1, 2)), lambda t: t[:, 0, 0] * t[:, 1, 0])
    for stat in statistics:
        assert stats.ks_2samp(stat(out).numpy(), stat(ref).numpy()).pvalue > 1e-3
    draft_only, _ = mar.generate(d, prompts, make_rngs(range(n)), **opts)
    assert stats.ks_2samp(draft_only.sum((1, 2)).numpy(), ref.sum((1, 2)).numpy()).pvalue < 1e-3


def test_ddim_tail_changes_the_sampler_for_both_models():
    m = _tiny_mar(0)
    a, _ = mar.generate(m, PROMPTS, make_rngs([1, 2]), num_iter=4)
    b, st = mar.generate(m, PROMPTS, make_rngs([1, 2]), num_iter=4, ddim_tail=3)
    assert not torch.allclose(a, b, atol=1e-3) and st["target_head_evals"] == 16 * 5 * 2
    out, cs = cspd.generate(m, PROMPTS, make_rngs([1, 2]), m, num_iter=4, ddim_tail=3, ratio="exact",
                            verify="stepwise", prefill_ratio=0.0, prefill_rule="ceil")
    # the same draws; the chains run in other batch shapes, which AVX-512 kernels round differently (2.3e-5 on
    # values up to 10)
    assert cs["accept_rate"] == 1.0 and torch.allclose(out, b, atol=1e-4)


def test_cspd_bad_inputs():
    m = _tiny_mar()
    g = make_rngs([0])
    with pytest.raises(ValueError, match=r"prefill_ratio must lie in \[0.0, 1.0\], got 1.5"):
        cspd.generate(m, ["a circle"], g, m, prefill_ratio=1.5)
    with pytest.raises(ValueError, match="gamma must be >= 1, got 0"):
        cspd.generate(m, ["a circle"], g, m, gamma=0)
    with pytest.raises(ValueError, match="unknown verify 'once'"):
        cspd.generate(m, ["a circle"], g, m, verify="once")
    with pytest.raises(ValueError, match="unknown ratio 'fast'"):
        cspd.generate(m, ["a circle"], g, m, ratio="fast")
    with pytest.raises(ValueError, match="inner_temperature=5.0, .* belong to ratio='paper', got ratio='exact'"):
        cspd.generate(m, ["a circle"], g, m, ratio="exact", inner_temperature=5.0)
    with pytest.raises(ValueError, match="normaliser=authors belong to ratio='paper'"):
        cspd.generate(m, ["a circle"], g, m, ratio="exact", normaliser="authors")
    for name, bad in (("rounds", "every"), ("prefill_rule", "floor"), ("verify_cfg", "first"), ("normaliser", "up"),
                      ("fallback", "none"), ("ratio", "aligned")):
        with pytest.raises(ValueError, match=f"unknown {name if name != 'fallback' else 'fallback'} '{bad}'"):
            cspd.generate(m, ["a circle"], g, m, **{name: bad})
    with pytest.raises(ValueError, match="ddim_tail=5 must be below the head's 5 sampling steps"):
        cspd.generate(m, ["a circle"], g, m, ddim_tail=5)
    other = ShapesMAR(grid_size=4, token_dim=5, preset="tiny", sample_steps=5)
    with pytest.raises(ValueError, match=r"draft tokens \(16 tokens of dim 5, patch 1\) differ"):
        cspd.generate(m, ["a circle"], g, other)
    target12 = ShapesMAR(grid_size=4, token_dim=12, preset="tiny", sample_steps=5)
    patched = ShapesMAR(grid_size=8, token_dim=3, preset="tiny", sample_steps=5, patch_size=2)  # also 16 x 12
    with pytest.raises(ValueError, match=r"patch 2\) differ from the target's \(16 of dim 12, patch 1\)"):
        cspd.generate(target12, ["a circle"], g, patched)


def test_head_chain_evaluated_in_one_call_equals_step_by_step():
    m = _tiny_mar(0)
    z = torch.randn(6, 64), torch.randn(6, 64)
    for scale, tail in ((1.0, 0), (3.0, 0), (torch.linspace(1.5, 3.0, 6), 2)):
        step = mar.head_step_fn(m, z[0], z[1], scale, ddim_tail=tail)
        tr = run_chain(step, torch.randn(6, 3), [torch.randn(6, 3) for _ in range(m.diffusion.sample_steps)])
        assert step.batched
        ref_means, ref_vars = evaluate_on(lambda x, i: step(x, i), tr.states)  # unmarked: one call per step
        for max_rows in (1 << 16, 13):  # all steps in one call; a few steps per call
            means, vars_ = evaluate_on(step, tr.states, max_rows=max_rows)
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(means, ref_means))
            assert all(torch.allclose(a, b, atol=1e-8) for a, b in zip(vars_, ref_vars))
        assert float(vars_[-1].abs().max()) == 0 and float(vars_[0].min()) > 0
        assert tr.stochastic_steps() == m.diffusion.sample_steps - 1 - tail


def test_rounds_end_where_the_authors_verify():
    """Theirs: verify after drafted step s when s % num_draft == 0 (s != 0) or s is the last step; 'fixed': gamma
    steps from the first drafted step. 64 steps, 4 pre-filled: gamma 2 gives [4], [5, 6], ..., [63]: 31 rounds."""
    def rounds(first, gamma, n, rule):
        out = []
        while first < n:
            end = cspd.round_end(first, gamma, n, rule)
            out.append(list(range(first, end + 1)))
            first = end + 1
        return out
    assert rounds(4, 4, 64, "authors")[:3] == [[4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert rounds(4, 4, 64, "authors")[-1] == [61, 62, 63] and len(rounds(4, 2, 64, "authors")) == 31
    assert rounds(0, 3, 7, "authors") == [[0, 1, 2, 3], [4, 5, 6]]  # step 0 never ends a round
    assert rounds(4, 2, 64, "fixed")[:2] == [[4, 5], [6, 7]] and len(rounds(4, 2, 64, "fixed")) == 30
    m = _tiny_mar(0)
    d = _near(m, 0.03)
    _, st = cspd.generate(m, PROMPTS, make_rngs([3, 4]), d, num_iter=16, gamma=4, prefill_ratio=0.05)
    assert st["prefill_steps"] == 1 and st["rounds"] == 4 and st["target_sets"] == 5  # [1-4] [5-8] [9-12] [13-15]
    _, st = cspd.generate(m, PROMPTS, make_rngs([3, 4]), d, num_iter=16, gamma=4, prefill_ratio=0.05, rounds="fixed")
    assert st["rounds"] == 4 and st["target_sets"] == 5  # [1-4] ... [13-15] too: 1 + 4 x 4 = 17 > 16


def test_verification_guides_every_drafted_token_at_the_rounds_last_scale():
    """The authors' `cfg_iter` in verification comes from the round's last `mask_len`: one scale for the round;
    'own_step' keeps each drafted step's own scale (MAR's linear schedule: rising along the round)."""
    m = _tiny_mar(0)
    s = cspd.start(m, _near(m, 0.03), PROMPTS, make_rngs([0, 1]), 4, 3.0, "linear")
    sched = s.st.schedule
    drafted, d_tokens = cspd.draft_steps(s, sched[:3])
    own = cspd.target_view(s, drafted, d_tokens, stepwise=True)[2]
    last = cspd.target_view(s, drafted, d_tokens, stepwise=True, round_cfg=True)[2]
    per_step = torch.cat([torch.full((len(d.idx[0]),), float(d.z[2])) for d in drafted])
    assert torch.equal(own, per_step) and len(set(own.tolist())) == 3
    assert bool((last == mar.cfg_at(3.0, "linear", sched[2], 16)).all())


def test_in_round_context_follows_the_target_at_its_full_step_count():
    """With the target as its own draft, stepwise verification (each drafted step conditioned on the round's
    earlier drafted steps, all in one call per round) returns target-only sampling at the full step count, in
    one target call per round; joint verification does not (its later steps are judged without them)."""
    m = _tiny_mar(0)
    ref, _ = mar.generate(m, PROMPTS, make_rngs([7, 8]), num_iter=8)
    opts = dict(num_iter=8, gamma=4, prefill_ratio=0.0, inner_temperature=42.0, verify_cfg="own_step")
    out, st = cspd.generate(m, PROMPTS, make_rngs([7, 8]), m, verify="stepwise", **opts)
    assert st["accept_rate"] == 1.0 and torch.allclose(out, ref, atol=1e-5)
    assert st["target_calls"] == 1 + st["rounds"] == 1 + 2 and st["target_sets"] == 8  # rounds [1-4] [5-7]
    joint, js = cspd.generate(m, PROMPTS, make_rngs([7, 8]), m, verify="joint", **opts)
    assert js["target_sets"] == 3 and js["accept_rate"] < 1.0 and not torch.allclose(joint, ref, atol=1e-3)
