"""CSpD's accept + residual procedure on 1-D Gaussians, trajectory densities, alignment."""
import math

import pytest
import torch
from scipy import stats

from specgen.decoding.cspd_core import (accept, chain_logprob, evaluate_on, log_ratio, residual_sample, run_chain)


def linear_step(a: float, b: float, var: float):
    """p(x_{i-1} | x_i) = N(a + b x_i, var), one stochastic step."""
    return lambda x, i: (a + b * x, torch.full_like(x, var))


def _cspd_1d(target, draft, n, seed=0, max_proposals=64):
    g = torch.Generator().manual_seed(seed)
    x_init = torch.randn(n, 1, generator=g)
    drafted = run_chain(draft, x_init, [torch.randn(n, 1, generator=g)])
    logr, final = log_ratio(drafted, target, "exact")
    ok = accept(logr, torch.rand(n, generator=g))
    redraw, used, fell_back = residual_sample(target, draft, (n, 1), 1, g, max_proposals)
    return torch.where(ok[:, None], final, redraw).view(-1), ok, fell_back


def test_accept_plus_residual_reproduces_the_target_distribution():
    target, draft = linear_step(0.8, 0.6, 0.25), linear_step(0.2, 0.9, 0.25)
    x, ok, fell_back = _cspd_1d(target, draft, 6000)
    assert 0.2 < ok.float().mean() < 0.9 and not fell_back.any()
    sd = (0.6 ** 2 + 0.25) ** 0.5  # x_0 = 0.8 + 0.6 x_1 + 0.5 eps, x_1 ~ N(0, 1)
    assert stats.kstest(x.numpy(), "norm", args=(0.8, sd)).pvalue > 1e-3
    # the draft alone is far from the target: the test would catch a sampler that skipped verification
    xq = run_chain(draft, torch.randn(6000, 1), [torch.randn(6000, 1)]).sample.view(-1)
    assert stats.kstest(xq.numpy(), "norm", args=(0.8, sd)).pvalue < 1e-6


def test_draft_equal_to_target_accepts_everything():
    step = linear_step(0.3, 0.7, 0.1)
    _, ok, _ = _cspd_1d(step, step, 500)
    assert ok.all()


def test_trajectory_density_matches_torch_distributions():
    step = linear_step(0.1, 0.5, 0.3)
    g = torch.Generator().manual_seed(1)
    tr = run_chain(step, torch.randn(7, 2, generator=g), [torch.randn(7, 2, generator=g) for _ in range(3)])
    ref = sum(torch.distributions.Normal(m, v.sqrt()).log_prob(tr.states[k + 1]).sum(-1)
              for k, (m, v) in enumerate(zip(tr.means, tr.vars)))
    assert torch.allclose(chain_logprob(tr.states, tr.means, tr.vars), ref, atol=1e-5)
    m2, v2 = evaluate_on(step, tr.states)
    assert all(torch.allclose(a, b) for a, b in zip(m2, tr.means))


def test_alignment_lowers_the_draft_target_distance():
    target, draft = linear_step(0.5, 0.8, 0.2), linear_step(0.4, 0.75, 0.2)
    g = torch.Generator().manual_seed(2)
    n, K = 2000, 5
    x_init = torch.randn(n, 2, generator=g)
    noises = [torch.randn(n, 2, generator=g) for _ in range(K)]
    d = run_chain(draft, x_init, noises)
    aligned = run_chain(target, x_init, noises)
    independent = run_chain(target, torch.randn(n, 2, generator=g), [torch.randn(n, 2, generator=g) for _ in range(K)])
    dist_aligned = (aligned.sample - d.sample).norm(dim=-1).mean()
    dist_indep = (independent.sample - d.sample).norm(dim=-1).mean()
    assert dist_aligned < 0.5 * dist_indep
    la, _ = log_ratio(d, target, "aligned", noises, align=True)
    li, _ = log_ratio(d, target, "aligned", [torch.randn(n, 2, generator=g) for _ in range(K)], align=False)
    assert accept(la, torch.rand(n, generator=g)).float().mean() > 2 * accept(li, torch.rand(n, generator=g)).float().mean()
    with pytest.raises(ValueError, match="unknown CSpD ratio 'fast'"):
        log_ratio(d, target, "fast")


def _tiny_mar(seed=0, grid_size=4, token_dim=3, sample_steps=5):
    """A random tiny MAR whose head depends on its conditions (the zero-initialised output layers of a
    fresh head would make every token's chain ignore the context and the prompt)."""
    from specgen.backbones.mar import ShapesMAR

    torch.manual_seed(seed)
    m = ShapesMAR(grid_size=grid_size, token_dim=token_dim, preset="tiny", sample_steps=sample_steps).eval()
    with torch.no_grad():
        for p in m.diffloss.parameters():
            if not p.any():
                p.normal_(0, 0.3)
    return m


def test_mar_sampling_is_reproducible_per_image_and_follows_the_schedule():
    from specgen.decoding import mar
    from specgen.decoding.sampling import make_generators

    m = _tiny_mar()
    assert mar.schedule(16, 4)[-1] == 16 and all(a < b for a, b in zip(mar.schedule(16, 4), mar.schedule(16, 4)[1:]))
    a, st = mar.generate(m, ["a red circle", "two squares"], make_generators([1, 2]), num_iter=4)
    b, _ = mar.generate(m, ["two squares"], make_generators([2]), num_iter=4)
    assert a.shape == (2, 16, 3) and st["nfe"] == 4
    assert torch.allclose(a[1], b[0], atol=1e-5)  # an image does not depend on its batch


def test_cspd_prefill_one_is_target_only_and_draft_equal_target_accepts_all():
    from specgen.decoding import cspd, mar
    from specgen.decoding.sampling import make_generators

    m, d = _tiny_mar(0), _tiny_mar(1)
    prompts = ["a red circle", "two squares"]
    ref, _ = mar.generate(m, prompts, make_generators([3, 4]), num_iter=4)
    out, st = cspd.generate(m, prompts, make_generators([3, 4]), d, num_iter=4, prefill_ratio=1.0)
    assert torch.allclose(out, ref) and st["drafted"] == 0
    assert not torch.allclose(ref[0], mar.generate(m, ["two squares", "a red circle"], make_generators([3, 4]),
                                                   num_iter=4)[0][0], atol=1e-3)  # the prompt matters
    for ratio in ("exact", "aligned"):
        same, st = cspd.generate(m, prompts, make_generators([3, 4]), m, num_iter=4, gamma=3, ratio=ratio,
                                 prefill_ratio=0.0)
        assert st["accept_rate"] == 1.0 and st["drafted"] == 32 and st["target_sets"] == 4
        # judging every drafted step given only the tokens known before drafting rejects some of the
        # target's own drafts: later steps were drafted with the earlier drafts in their context
        _, joint = cspd.generate(m, prompts, make_generators([3, 4]), m, num_iter=4, gamma=3, ratio=ratio,
                                 prefill_ratio=0.0, verify="joint")
        assert joint["accept_rate"] < 0.9 and joint["target_sets"] == 2
    for acceptance in ("per_token", "prefix"):
        out, st = cspd.generate(m, prompts, make_generators([3, 4]), d, num_iter=4, gamma=2, acceptance=acceptance,
                                ratio="exact", max_proposals=4)
        assert out.shape == ref.shape and torch.isfinite(out).all()
        assert st["target_calls"] < 4 + st["draft_calls"]  # one target pass per drafted block


def test_cspd_prefix_exact_reproduces_target_only_sampling():
    """Lossless mode (stepwise verification, exact ratio, prefix acceptance): CSpD with a draft close to
    the target draws tokens from the target's distribution (two-sample KS per position, on the token sum
    and on a product of two positions), while the draft alone is told apart by the same test."""
    import copy

    from specgen.decoding import cspd, mar
    from specgen.decoding.sampling import make_generators

    m = _tiny_mar(0, grid_size=2, token_dim=1, sample_steps=4)
    d = copy.deepcopy(m)
    torch.manual_seed(9)
    with torch.no_grad():
        for p in d.diffloss.parameters():
            p.add_(0.06 * torch.randn_like(p))
    n = 1200
    prompts = ["a red circle"] * n
    ref, _ = mar.generate(m, prompts, make_generators(range(n)), num_iter=3, cfg_scale=1.0)
    out, st = cspd.generate(m, prompts, make_generators(range(n, 2 * n)), d, num_iter=3, cfg_scale=1.0, gamma=2,
                            prefill_ratio=0.0, ratio="exact", acceptance="prefix", max_proposals=64)
    assert 0.1 < st["accept_rate"] < 0.9 and st["fallbacks"] == 0 and st["proposals"] > 0
    assert st["target_calls"] <= 3  # a round commits at least its first drafted step
    statistics = (lambda t: t[:, 0, 0], lambda t: t[:, 3, 0], lambda t: t.sum((1, 2)), lambda t: t[:, 0, 0] * t[:, 1, 0])
    for stat in statistics:
        assert stats.ks_2samp(stat(out).numpy(), stat(ref).numpy()).pvalue > 1e-3
    draft_only, _ = mar.generate(d, prompts, make_generators(range(n)), num_iter=3, cfg_scale=1.0)
    assert stats.ks_2samp(draft_only.sum((1, 2)).numpy(), ref.sum((1, 2)).numpy()).pvalue < 1e-3


def test_cspd_bad_inputs():
    from specgen.backbones.mar import ShapesMAR
    from specgen.decoding import cspd
    from specgen.decoding.sampling import make_generators

    m = _tiny_mar()
    g = make_generators([0])
    with pytest.raises(ValueError, match=r"prefill_ratio must lie in \[0.0, 1.0\], got 1.5"):
        cspd.generate(m, ["a circle"], g, m, prefill_ratio=1.5)
    with pytest.raises(ValueError, match="gamma must be >= 1, got 0"):
        cspd.generate(m, ["a circle"], g, m, gamma=0)
    with pytest.raises(ValueError, match="unknown verify 'once'"):
        cspd.generate(m, ["a circle"], g, m, verify="once")
    other = ShapesMAR(grid_size=4, token_dim=5, preset="tiny", sample_steps=5)
    with pytest.raises(ValueError, match=r"draft tokens \(16 tokens of dim 5, patch 1\) differ"):
        cspd.generate(m, ["a circle"], g, other)
    target12 = ShapesMAR(grid_size=4, token_dim=12, preset="tiny", sample_steps=5)
    patched = ShapesMAR(grid_size=8, token_dim=3, preset="tiny", sample_steps=5, patch_size=2)  # also 16 x 12
    with pytest.raises(ValueError, match=r"patch 2\) differ from the target's \(16 of dim 12, patch 1\)"):
        cspd.generate(target12, ["a circle"], g, patched)


def test_head_chain_evaluated_in_one_call_equals_step_by_step():
    from specgen.decoding.cspd_core import evaluate_on, run_chain
    from specgen.decoding.mar import head_step_fn

    m = _tiny_mar(0)
    z = torch.randn(6, 64), torch.randn(6, 64)
    for scale in (1.0, 3.0):
        step = head_step_fn(m, z[0], z[1], scale)
        tr = run_chain(step, torch.randn(6, 3), [torch.randn(6, 3) for _ in range(m.diffusion.sample_steps)])
        assert step.batched
        ref_means, ref_vars = evaluate_on(lambda x, i: step(x, i), tr.states)  # unmarked: one call per step
        for max_rows in (1 << 16, 13):  # all steps in one call; a few steps per call
            means, vars_ = evaluate_on(step, tr.states, max_rows=max_rows)
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(means, ref_means))
            assert all(torch.allclose(a, b, atol=1e-8) for a, b in zip(vars_, ref_vars))
        assert float(vars_[-1].abs().max()) == 0 and float(vars_[0].min()) > 0


def test_cspd_trace_splits_the_log_ratio_by_step(tmp_path):
    from specgen.decoding.cspd_core import log_ratio
    from specgen.evaluation import cspd_trace

    import copy

    m = _tiny_mar(0)
    d = copy.deepcopy(m)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in d.diffloss.parameters():
            p.add_(0.02 * torch.randn_like(p))
    res = cspd_trace.trace(m, d, ["a red circle", "two squares"], [0, 1], num_iter=4)
    assert res["aligned"].shape == res["exact"].shape == (res["sigma"].shape[0], m.diffusion.sample_steps)
    rows = cspd_trace.bands(res, num_bands=5)
    total = float(res["exact"].sum(1).mean())
    assert abs(sum(r["logr_exact"] for r in rows) - total) < 1e-4 * max(1.0, abs(total))
    same = cspd_trace.trace(m, m, ["a red circle"], [0], num_iter=4)
    assert float(same["exact"].abs().max()) < 1e-4 and float(same["aligned"].abs().max()) < 1e-4
    assert float(res["exact"].sum(1).abs().max()) > 1e-3  # a different draft is seen
    summ = cspd_trace.summary(same)
    assert summ["exact/accept"] > 0.999 and summ["aligned/accept"] > 0.999
    costs = cspd_trace.costs(m, d, batch=2, num_iter=4)
    assert costs["target_only"] > 0 and costs["cspd_ceiling_speedup"] > 0


def test_context_probe_neighbour_estimate_and_report(tmp_path):
    from specgen.backbones.mar import ShapesMAR
    from specgen.evaluation.context_probe import neighbour_mean, probe, timestep_losses
    from specgen.tokenizers.kl import KLAutoencoder

    x0 = torch.arange(9.0).reshape(1, 9, 1)  # a 3x3 token grid, one channel
    mask = torch.zeros(1, 9)
    mask[0, [4, 0, 1, 3]] = 1  # centre and the top-left corner with both its neighbours unknown
    est = neighbour_mean(x0, mask, torch.full((1, 1, 1), -1.0))
    assert float(est[0, 4, 0]) == (5 + 7) / 2  # known neighbours of the centre: 5 and 7 (1 and 3 are masked)
    assert float(est[0, 0, 0]) == -1.0  # no known neighbour: the background
    assert float(est[0, 1, 0]) == 2.0  # token 1: of its neighbours 0, 2 and 4, only 2 is known
    torch.manual_seed(0)
    mar = ShapesMAR(grid_size=16, token_dim=3, preset="tiny", sample_steps=5, patch_size=2).eval()
    res = probe(mar, KLAutoencoder(image_size=64, ch=8, mults=(2, 4), z_dim=3).eval(), num_images=4,
                known=(0.0, 0.9), timesteps=(1, 900))
    assert 0 < res["foreground_share"] < 1
    keys = {k for k in res if k != "foreground_share"}
    assert keys == {f"{c}/known{k}/t{t}" for c in ("prompt", "null") for k in ("0", "0.9") for t in (1, 900)} | {
        "neighbours/known0", "neighbours/known0.9"}
    assert all(math.isfinite(v) and v <= 1 for v in res.values())
    # at t=1 x_t is the latent up to 1e-4 of noise: any bounded denoiser's x0-estimate explains it almost fully
    assert min(res[f"{c}/known{k}/t1"] for c in ("prompt", "null") for k in ("0", "0.9")) > 0.9
    # loss by timestep: the fresh head outputs epsilon = 0, so its epsilon MSE is E[noise^2] = 1 at every t,
    # and the x0 MSE it implies grows as SNR_t falls
    losses = timestep_losses(mar, KLAutoencoder(image_size=64, ch=8, mults=(2, 4), z_dim=3).eval(), num_images=4,
                             timesteps=(0, 500, 950))
    for c in ("prompt", "null"):
        assert all(abs(losses[f"{c}/t{t}/eps_mse"] - 1) < 0.1 for t in (0, 500, 950))
        assert losses[f"{c}/t0/x0_mse"] < losses[f"{c}/t500/x0_mse"] < losses[f"{c}/t950/x0_mse"]
        assert math.isclose(losses[f"{c}/t500/x0_mse"] * losses["snr/t500"], losses[f"{c}/t500/eps_mse"])
