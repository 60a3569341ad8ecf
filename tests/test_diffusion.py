"""The DDPM reverse process, driven by the analytic optimal denoiser of 1-D Gaussian data, samples that data."""
import math

import pytest
import torch
from scipy import stats

from specgen.backbones.diffusion import DenoiserMLP, GaussianDiffusion


def optimal_eps(x_t, ac, m, s):
    """E[eps | x_t] when x0 ~ N(m, s^2) and x_t = sqrt(ac) x0 + sqrt(1 - ac) eps."""
    return (x_t - math.sqrt(ac) * m) * math.sqrt(1 - ac) / (ac * s * s + 1 - ac)


@pytest.mark.parametrize("variance", ["fixed_small", "fixed_large"])
def test_reverse_process_reproduces_gaussian_data(variance):
    m, s = 0.7, 0.4
    diff = GaussianDiffusion(train_steps=1000, sample_steps=100, variance=variance)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 1, generator=g, dtype=torch.float64)
    for i in reversed(range(diff.sample_steps)):
        eps = optimal_eps(x, float(diff.s_ac[i]), m, s)
        mean, var = diff.step_mean_var(eps, x, i)
        x = mean + var.sqrt() * torch.randn(x.shape, generator=g, dtype=torch.float64)
    assert stats.kstest(x.view(-1).numpy(), "norm", args=(m, s)).pvalue > 1e-3


def test_denoiser_shapes_and_identity_start():
    net = DenoiserMLP(token_dim=4, cond_dim=8, width=32, depth=2)
    out = net(torch.randn(5, 4), torch.randint(0, 1000, (5,)), torch.randn(5, 8))
    assert out.shape == (5, 8) and torch.all(out == 0)  # [eps, v]; zero-initialised output layer
    diff = GaussianDiffusion(variance="learned_range")
    mean, var = diff.step_mean_var(out, torch.randn(5, 4), 50)
    beta, small = float(diff.s_betas[50]), float(diff.s_betas[50] * (1 - diff.s_ac_prev[50]) / (1 - diff.s_ac[50]))
    assert torch.allclose(var, torch.full_like(var, math.sqrt(beta * small)))  # v = 0: the geometric mean
    with pytest.raises(ValueError, match="unknown variance type 'learned'"):
        GaussianDiffusion(variance="learned")
