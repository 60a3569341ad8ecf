"""CSpD's per-token pieces on 1-D Gaussian chains: ratios against brute force, residuals against closed forms."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from specgen.decoding.cspd_core import (Trajectory, accept, chain_logprob, evaluate_on, exact_log_ratio,
                                        gaussian_residual, normaliser_log_ratio, paper_log_ratio, residual_sample,
                                        run_chain)


def linear_step(a: float, b: float, var: float, last_deterministic: bool = False):
    """p(x_{i-1} | x_i) = N(a + b x_i, var); with `last_deterministic` step 0 is its mean (var 0), as DDPM's."""
    return lambda x, i: (a + b * x, torch.full_like(x, 0.0 if last_deterministic and i == 0 else var))


def _chains(target, draft, n, K, d=1, seed=0, shared=True):
    g = torch.Generator().manual_seed(seed)
    x_init, noises = torch.randn(n, d, generator=g), [torch.randn(n, d, generator=g) for _ in range(K)]
    q = run_chain(draft, x_init, noises)
    p = run_chain(target, x_init, noises) if shared else run_chain(
        target, torch.randn(n, d, generator=g), [torch.randn(n, d, generator=g) for _ in range(K)])
    return q, p


def _cspd_1d(target, draft, n, seed=0, max_proposals=64):
    g = torch.Generator().manual_seed(seed)
    drafted = run_chain(draft, torch.randn(n, 1, generator=g), [torch.randn(n, 1, generator=g)])
    logr, final = exact_log_ratio(drafted, target)
    ok = accept(logr, torch.rand(n, generator=g))
    redraw, used, fell_back = residual_sample(target, draft, (n, 1), 1, g, max_proposals)
    return torch.where(ok[:, None], final, redraw).view(-1), ok, fell_back


def test_exact_accept_plus_residual_reproduces_the_target_distribution():
    target, draft = linear_step(0.8, 0.6, 0.25), linear_step(0.2, 0.9, 0.25)
    x, ok, fell_back = _cspd_1d(target, draft, 6000)
    assert 0.2 < ok.float().mean() < 0.9 and not fell_back.any()
    sd = (0.6 ** 2 + 0.25) ** 0.5  # x_0 = 0.8 + 0.6 x_1 + 0.5 eps, x_1 ~ N(0, 1)
    assert stats.kstest(x.numpy(), "norm", args=(0.8, sd)).pvalue > 1e-3
    # the draft alone is far from the target: the test would catch a sampler that skipped verification
    xq = run_chain(draft, torch.randn(6000, 1), [torch.randn(6000, 1)]).sample.view(-1)
    assert stats.kstest(xq.numpy(), "norm", args=(0.8, sd)).pvalue < 1e-6


def test_draft_equal_to_target_has_ratio_one_under_every_ratio():
    step = linear_step(0.3, 0.7, 0.1, last_deterministic=True)
    q, p = _chains(step, step, 500, K=4, d=3)
    exact, final = exact_log_ratio(q, step)
    ratios = {"exact": exact, "paper": paper_log_ratio(q, p, 0.05, 1.0),
              "paper_derivation": paper_log_ratio(q, p, 0.05, 1.0, "derivation")}
    for name, logr in ratios.items():
        assert float(logr.abs().max()) < 1e-5, name
        assert accept(logr, torch.rand(500)).all(), name
    assert torch.allclose(final, q.sample)  # the target's deterministic last step from the draft's state


def _brute_force_paper(q, p, target, draft, sigma_f, T):
    """log p(Y_p) - log q(Y_q) with every density written out: each model's transitions recomputed on its own
    chain (stochastic steps), then the last-step Gaussians of width T sigma_f at the drafted token."""
    K = len(q.means)
    total = torch.zeros(q.sample.shape[0], dtype=torch.float64)
    for k in range(K - 1):  # the last step (k = K - 1) is deterministic
        for chain, step, sign in ((p, target, 1.0), (q, draft, -1.0)):
            mean, var = step(chain.states[k], K - 1 - k)
            lp = torch.distributions.Normal(mean.double(), var.double().sqrt()).log_prob(chain.states[k + 1].double())
            total += sign * lp.sum(-1)
    x = q.sample.double()
    final = lambda centre: torch.distributions.Normal(centre.double(), T * sigma_f).log_prob(x).sum(-1)
    return total + final(p.sample) - final(q.sample)


def test_paper_ratio_equals_the_formula_evaluated_by_brute_force():
    """Shared noise: the implementation (normalisers + last-step Gaussian) equals every density written out,
    so the exponents do cancel; with independent noise the exponents stay, and the estimator drops them."""
    target = linear_step(0.5, 0.8, 0.2, last_deterministic=True)
    draft = linear_step(0.45, 0.78, 0.26, last_deterministic=True)
    for T, sigma_f in ((1.0, 0.1), (5.0, 0.03)):
        q, p = _chains(target, draft, 400, K=6, d=2, seed=1)
        ref = _brute_force_paper(q, p, target, draft, sigma_f, T)
        got = paper_log_ratio(q, p, sigma_f, T, normaliser="derivation")
        assert torch.allclose(got.double(), ref, atol=1e-4)
        n_derivation = float(normaliser_log_ratio(q, p, "derivation").mean())
        assert abs(n_derivation - 5 * 2 * 0.5 * math.log(0.26 / 0.2)) < 1e-4
        assert float(normaliser_log_ratio(q, p, "authors").mean()) == pytest.approx(-n_derivation)
        qi, pi = _chains(target, draft, 400, K=6, d=2, seed=1, shared=False)
        exponents = sum(0.5 * (qi.states[k + 1] - qi.means[k]).pow(2).sum(-1) / 0.26
                        - 0.5 * (pi.states[k + 1] - pi.means[k]).pow(2).sum(-1) / 0.2 for k in range(5))
        brute = _brute_force_paper(qi, pi, target, draft, sigma_f, T)
        got = paper_log_ratio(qi, pi, sigma_f, T, normaliser="derivation").double()
        assert torch.allclose(got, brute - exponents.double(), atol=1e-4)
        assert float(exponents.abs().mean()) > 1.0  # the dropped terms are not small


def test_paper_ratio_equals_the_authors_formula_computed_by_hand():
    """Two tokens of dim 2, a 3-step chain (2 stochastic steps, the last deterministic) with every sigma written
    down: the authors' judge_accept is p_unnorm(x) * fixed_term * prod(std_q) / (q_unnorm(x) * prod(std_p)) with
    fixed_term = prod over steps and dims of sigma_p / sigma_q, x the draft's token (its own Gaussian is 1 there)
    and the last-step widths T sigma_f (one width for both models: prod(std_q) / prod(std_p) = 1)."""
    sq = torch.tensor([[[0.5, 0.4], [0.3, 0.2]], [[0.6, 0.6], [0.25, 0.1]]])  # (token, step, dim) draft sigmas
    sp = torch.tensor([[[0.45, 0.5], [0.3, 0.1]], [[0.7, 0.5], [0.2, 0.2]]])  # target sigmas
    x_q = torch.tensor([[0.30, -0.10], [1.00, 0.20]])  # drafted tokens
    x_p = torch.tensor([[0.32, -0.16], [0.90, 0.25]])  # the target's aligned end points
    zero, T, sigma_f = torch.zeros(2, 2), 42.0, 0.006

    def chain(sig, end):  # states and means do not enter the paper ratio; the last step has variance 0
        return Trajectory([zero, zero, zero, end], [zero] * 3, [sig[:, 0] ** 2, sig[:, 1] ** 2, zero])

    by_hand = []
    for n in range(2):
        fixed_term = math.prod(float(sp[n, k, d] / sq[n, k, d]) for k in range(2) for d in range(2))
        gap2 = sum(float(x_q[n, d] - x_p[n, d]) ** 2 for d in range(2))
        by_hand.append(math.log(fixed_term) - gap2 / (2 * (T * sigma_f) ** 2))
    got = paper_log_ratio(chain(sq, x_q), chain(sp, x_p), sigma_f, T)
    assert got.tolist() == pytest.approx(by_hand, rel=1e-5)
    assert by_hand[0] == pytest.approx(math.log(0.45 / 0.5 * 0.5 / 0.4 * 1.0 * 0.5) - 0.004 / (2 * 0.252 ** 2))
    derivation = paper_log_ratio(chain(sq, x_q), chain(sp, x_p), sigma_f, T, normaliser="derivation")
    gap_terms = [h - math.log(math.prod(float(sp[n, k, d] / sq[n, k, d]) for k in range(2) for d in range(2)))
                 for n, h in enumerate(by_hand)]
    assert derivation.tolist() == pytest.approx([g - (h - g) for g, h in zip(gap_terms, by_hand)], rel=1e-5)
    with pytest.raises(ValueError, match="unknown normaliser 'flipped'"):
        normaliser_log_ratio(chain(sq, x_q), chain(sp, x_p), "flipped")


def test_shared_noise_gives_a_higher_ratio_than_independent_noise():
    target = linear_step(0.5, 0.8, 0.2, last_deterministic=True)
    draft = linear_step(0.47, 0.8, 0.2, last_deterministic=True)  # a small error in the mean
    q, p = _chains(target, draft, 3000, K=5, d=2, seed=2)
    qi, pi = _chains(target, draft, 3000, K=5, d=2, seed=2, shared=False)
    alpha = lambda a, b: float(paper_log_ratio(a, b, 0.1, 2.0).clamp_max(0).exp().mean())
    shared, independent = alpha(q, p), alpha(qi, pi)
    assert shared > 0.7 and independent < 0.5 * shared, (shared, independent)


def _residual_cdf(x, mu_p, mu_q, s, c):
    """CDF of norm(max(0, c N(mu_p, s^2) - N(mu_q, s^2))) for mu_q > mu_p: supported below x*."""
    x_star = (mu_p + mu_q) / 2 + s * s * math.log(c) / (mu_q - mu_p)
    mass = lambda t: c * stats.norm.cdf(t, mu_p, s) - stats.norm.cdf(t, mu_q, s)
    return mass(min(x, x_star)) / mass(x_star)


@pytest.mark.parametrize("c", [1.0, 1.6])
def test_gaussian_residual_matches_its_closed_form(c):
    g = torch.Generator().manual_seed(3)
    rand, randn = (lambda sh: torch.rand(sh, generator=g)), (lambda sh: torch.randn(sh, generator=g))
    n, mu_p, mu_q, s = 4000, 0.0, 0.8, 0.5
    mp, mq = torch.full((n, 1), mu_p), torch.full((n, 1), mu_q)
    x, used, fell = gaussian_residual(mp, mq, s, torch.full((n,), math.log(c)), rand, randn, max_proposals=200)
    assert not fell.any() and float(used.float().mean()) > 1.2  # proposals beyond x* are rejected
    cdf = lambda v: np.array([_residual_cdf(float(t), mu_p, mu_q, s, c) for t in v])
    assert stats.kstest(x.view(-1).numpy(), cdf).pvalue > 1e-3
    plain = (mp + s * randn((n, 1))).view(-1)  # broken control: proposals taken without the test
    assert stats.kstest(plain.numpy(), cdf).pvalue < 1e-6


def test_gaussian_residual_counts_its_fallbacks():
    """With c -> 0 the residual sits far in the tail: few proposals pass, the rest fall back to mu_p."""
    g = torch.Generator().manual_seed(4)
    rand, randn = (lambda sh: torch.rand(sh, generator=g)), (lambda sh: torch.randn(sh, generator=g))
    mp, mq = torch.zeros(500, 2), torch.full((500, 2), 0.01)
    x, used, fell = gaussian_residual(mp, mq, 1.0, torch.full((500,), -30.0), rand, randn, max_proposals=3)
    assert fell.float().mean() > 0.9 and bool((used == 3).all())
    assert torch.equal(x[fell], mp[fell])


def test_trajectory_density_matches_torch_distributions():
    step = linear_step(0.1, 0.5, 0.3)
    g = torch.Generator().manual_seed(1)
    tr = run_chain(step, torch.randn(7, 2, generator=g), [torch.randn(7, 2, generator=g) for _ in range(3)])
    ref = sum(torch.distributions.Normal(m, v.sqrt()).log_prob(tr.states[k + 1]).sum(-1)
              for k, (m, v) in enumerate(zip(tr.means, tr.vars)))
    assert torch.allclose(chain_logprob(tr.states, tr.means, tr.vars), ref, atol=1e-5)
    m2, v2 = evaluate_on(step, tr.states)
    assert all(torch.allclose(a, b) for a, b in zip(m2, tr.means))


def test_exact_ratio_with_a_deterministic_tail_judges_only_the_stochastic_steps():
    """Two deterministic last steps: the ratio covers the stochastic ones, the token is the target's tail."""
    tail = lambda a, b, var: (lambda x, i: (a + b * x, torch.full_like(x, 0.0 if i <= 1 else var)))
    target, draft = tail(0.5, 0.8, 0.2), tail(0.4, 0.7, 0.2)
    q, _ = _chains(target, draft, 50, K=4)
    assert q.stochastic_steps() == 2
    logr, final = exact_log_ratio(q, target)
    means = [target(q.states[k], 3 - k)[0] for k in range(2)]
    ref = sum(torch.distributions.Normal(m, 0.2 ** 0.5).log_prob(q.states[k + 1]).sum(-1)
              - torch.distributions.Normal(q.means[k], 0.2 ** 0.5).log_prob(q.states[k + 1]).sum(-1)
              for k, m in enumerate(means))
    assert torch.allclose(logr, ref, atol=1e-5)
    assert torch.allclose(final, 0.5 + 0.8 * (0.5 + 0.8 * q.states[2]))
