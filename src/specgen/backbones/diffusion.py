"""Per-token diffusion head (MAR's "DiffLoss"): a small adaLN MLP denoiser over one token, and a
DDPM whose reverse process exposes every step's Gaussian mean and variance and takes injected
noise, so that two heads can be run on aligned trajectories and their transition densities compared.

Defaults follow MAR: 1000 training steps with the cosine schedule, 100 respaced sampling steps,
epsilon prediction, "fixed small" (posterior) variance, noise temperature 1.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

VARIANCES = ("fixed_small", "fixed_large")


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class _ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x, c):
        shift, scale, gate = self.adaLN_modulation(c).chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class DenoiserMLP(nn.Module):
    """epsilon(x_t, t, c): token (N, d), timestep (N,), condition (N, cond_dim) -> (N, d)."""

    def __init__(self, token_dim: int, cond_dim: int, width: int = 128, depth: int = 3):
        super().__init__()
        self.time_embed = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.cond_embed = nn.Linear(cond_dim, width)
        self.input_proj = nn.Linear(token_dim, width)
        self.res_blocks = nn.ModuleList([_ResBlock(width) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_adaLN = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.final_linear = nn.Linear(width, token_dim)
        self.width = width
        for blk in self.res_blocks:  # adaLN-zero: every block starts as the identity
            nn.init.zeros_(blk.adaLN_modulation[-1].weight)
            nn.init.zeros_(blk.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_linear.weight)
        nn.init.zeros_(self.final_linear.bias)

    def forward(self, x, t, c):
        c = self.time_embed(_timestep_embedding(t, self.width)) + self.cond_embed(c)
        h = self.input_proj(x)
        for blk in self.res_blocks:
            h = blk(h, c)
        shift, scale = self.final_adaLN(c).chunk(2, dim=-1)
        return self.final_linear(self.final_norm(h) * (1 + scale) + shift)


class GaussianDiffusion:
    """DDPM schedule with respacing; all tensors are float64 on CPU, cast at use."""

    def __init__(self, train_steps: int = 1000, sample_steps: int = 100, schedule: str = "cosine",
                 variance: str = "fixed_small"):
        if variance not in VARIANCES:
            raise ValueError(f"unknown variance type {variance!r}: expected one of {VARIANCES}")
        if not 1 <= sample_steps <= train_steps:
            raise ValueError(f"sample_steps must lie in [1, train_steps={train_steps}], got {sample_steps}")
        self.train_steps, self.sample_steps, self.variance = train_steps, sample_steps, variance
        if schedule == "cosine":
            s = torch.arange(train_steps + 1, dtype=torch.float64) / train_steps
            f = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
        elif schedule == "linear":
            betas = torch.linspace(1e-4, 0.02, train_steps, dtype=torch.float64)
        else:
            raise ValueError(f"unknown schedule {schedule!r}: expected 'cosine' or 'linear'")
        self.alphas_cumprod = torch.cumprod(1 - betas, 0)  # (T,)
        # respaced sampling: timesteps kept, and the betas that chain their cumulative products
        self.timesteps = torch.linspace(0, train_steps - 1, sample_steps).round().long()  # ascending
        ac = self.alphas_cumprod[self.timesteps]
        prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
        self.s_betas = 1 - ac / prev
        self.s_ac, self.s_ac_prev = ac, prev

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ac = self.alphas_cumprod.to(x0.device, torch.float32)[t][:, None]
        return ac.sqrt() * x0 + (1 - ac).sqrt() * noise

    def step_mean_var(self, eps: torch.Tensor, x_t: torch.Tensor, i: int) -> tuple[torch.Tensor, float]:
        """Mean and (scalar) variance of p(x_{i-1} | x_i) for sampling step index i (0-based, i = K-1 first)."""
        ac, ac_prev, beta = (float(v[i]) for v in (self.s_ac, self.s_ac_prev, self.s_betas))
        x0 = (x_t - math.sqrt(1 - ac) * eps) / math.sqrt(ac)
        x0 = x0.clamp(-10, 10)  # latent tokens are O(1); guards the first, noisiest steps
        mean = (math.sqrt(ac_prev) * beta / (1 - ac)) * x0 + (math.sqrt(1 - beta) * (1 - ac_prev) / (1 - ac)) * x_t
        var = beta * (1 - ac_prev) / (1 - ac) if self.variance == "fixed_small" else beta
        return mean, max(var, 1e-20) if i > 0 else 0.0  # the last step is deterministic
