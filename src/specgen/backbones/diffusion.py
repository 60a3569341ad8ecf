"""Per-token diffusion head (MAR's "DiffLoss"): a small adaLN MLP denoiser over one token, and a
DDPM whose reverse process exposes every step's Gaussian mean and variance and takes injected
noise, so that two heads can be run on aligned trajectories and their transition densities compared.

Defaults follow MAR: 1000 training steps with the cosine schedule, 100 respaced sampling steps,
epsilon prediction, "fixed small" (posterior) variance, noise temperature 1. `ddim_tail` > 0 (a
deviation, for CSpD's exact ratio) makes the last stochastic steps deterministic DDIM steps.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

VARIANCES = ("fixed_small", "fixed_large", "learned_range")


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of the timestep (256 frequencies) through a 2-layer MLP."""

    def __init__(self, width: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class _ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x, c):
        shift, scale, gate = self.adaLN_modulation(c).chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class _FinalLayer(nn.Module):
    def __init__(self, width: int, out_dim: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(width, out_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class DenoiserMLP(nn.Module):
    """epsilon (and, with `learn_sigma`, a variance interpolation v) from (x_t, t, c).

    token (N, d), timestep (N,), condition (N, cond_dim) -> (N, d) or (N, 2d). Module names follow
    MAR's release (`diffloss.net.*`) so that its weights load by name.
    """

    def __init__(self, token_dim: int, cond_dim: int, width: int = 128, depth: int = 3, learn_sigma: bool = True):
        super().__init__()
        self.token_dim, self.learn_sigma = token_dim, learn_sigma
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(cond_dim, width)
        self.input_proj = nn.Linear(token_dim, width)
        self.res_blocks = nn.ModuleList([_ResBlock(width) for _ in range(depth)])
        self.final_layer = _FinalLayer(width, token_dim * (2 if learn_sigma else 1))
        for blk in self.res_blocks:  # adaLN-zero: every block starts as the identity
            nn.init.zeros_(blk.adaLN_modulation[-1].weight)
            nn.init.zeros_(blk.adaLN_modulation[-1].bias)
        for m in (self.final_layer.adaLN_modulation[-1], self.final_layer.linear):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x, t, c):
        y = self.time_embed(t) + self.cond_embed(c)
        h = self.input_proj(x)
        for blk in self.res_blocks:
            h = blk(h, y)
        return self.final_layer(h, y)


def gaussian_kl(mean_q: torch.Tensor, log_var_q: torch.Tensor, mean_p: torch.Tensor,
                log_var_p: torch.Tensor) -> torch.Tensor:
    """Elementwise KL(N(mean_q, exp(log_var_q)) || N(mean_p, exp(log_var_p))); exactly 0 for equal arguments."""
    d = log_var_q - log_var_p
    return 0.5 * (torch.expm1(d) - d + (mean_q - mean_p).pow(2) * (-log_var_p).exp())


class GaussianDiffusion:
    """DDPM schedule with respacing; all tensors are float64 on CPU, cast at use."""

    def __init__(self, train_steps: int = 1000, sample_steps: int = 100, schedule: str = "cosine",
                 variance: str = "fixed_small", x0_clip: float | None = 10.0):
        if variance not in VARIANCES:
            raise ValueError(f"unknown variance type {variance!r}: expected one of {VARIANCES}")
        if not 1 <= sample_steps <= train_steps:
            raise ValueError(f"sample_steps must lie in [1, train_steps={train_steps}], got {sample_steps}")
        self.train_steps, self.sample_steps, self.variance = train_steps, sample_steps, variance
        self.x0_clip = x0_clip  # None: MAR's sampler (clip_denoised=False); 10: this repo's guard of the noisiest steps
        if schedule == "cosine":
            s = torch.arange(train_steps + 1, dtype=torch.float64) / train_steps
            f = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
        elif schedule == "linear":
            betas = torch.linspace(1e-4, 0.02, train_steps, dtype=torch.float64)
        else:
            raise ValueError(f"unknown schedule {schedule!r}: expected 'cosine' or 'linear'")
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1 - betas, 0)  # (T,)
        # respaced sampling: timesteps kept, and the betas that chain their cumulative products
        self.timesteps = torch.linspace(0, train_steps - 1, sample_steps).round().long()  # ascending
        ac = self.alphas_cumprod[self.timesteps]
        prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
        self.s_betas = 1 - ac / prev
        self.s_ac, self.s_ac_prev = ac, prev
        # per sampling step, computed once in float64: the coefficients `step_mean_var` needs
        beta, small = self.s_betas, self.s_betas * (1 - prev) / (1 - ac)
        self._coefs = torch.stack([(1 - ac).sqrt(), ac.sqrt(), prev.sqrt() * beta / (1 - ac),
                                   (1 - beta).sqrt() * (1 - prev) / (1 - ac), beta.log(), small.clamp_min(1e-20).log(),
                                   prev.sqrt(), (1 - prev).sqrt()])
        self._small = small
        self._coef_cache: dict = {}  # (device, dtype) -> the table cast there

    def vlb_term(self, eps: torch.Tensor, v: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor,
                 t: torch.Tensor) -> torch.Tensor:
        """KL(q(x_{t-1} | x_t, x0) || p(x_{t-1} | x_t)) per token in bits, training only the variance
        (eps is detached by the caller), as improved DDPM's hybrid loss; the posterior variance is
        clipped at t = 0, where the KL stands in for the decoder likelihood (latents are continuous)."""
        dev = x0.device
        ac = self.alphas_cumprod.to(dev)[t][:, None]
        ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]]).to(dev)[t][:, None]
        beta = self.betas.to(dev)[t][:, None]
        post_var = beta * (1 - ac_prev) / (1 - ac)
        post_var_clipped = torch.where(t[:, None] == 0, self.betas[1] * (1 - self.alphas_cumprod[0])
                                       / (1 - self.alphas_cumprod[1]), post_var).to(dev)
        c1, c2 = ac_prev.sqrt() * beta / (1 - ac), (1 - beta).sqrt() * (1 - ac_prev) / (1 - ac)
        x0f, xtf = x0.double(), x_t.double()
        mean_q = c1 * x0f + c2 * xtf
        x0_pred = (xtf - (1 - ac).sqrt() * eps.double()) / ac.sqrt()
        mean_p = c1 * x0_pred + c2 * xtf
        frac = (v.double() + 1) / 2
        log_var_p = frac * beta.log() + (1 - frac) * post_var_clipped.log()
        log_var_q = post_var_clipped.log()
        kl = gaussian_kl(mean_q, log_var_q, mean_p, log_var_p)
        return (kl.mean(-1) / math.log(2.0)).float()

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """Signal-to-noise ratio a_t / (1 - a_t) of training timesteps t (float64, on t's device)."""
        ac = self.alphas_cumprod.to(t.device)[t]
        return ac / (1 - ac)

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ac = self.alphas_cumprod.to(x0.device, torch.float32)[t][:, None]
        return ac.sqrt() * x0 + (1 - ac).sqrt() * noise

    def final_std(self) -> float:
        """Standard deviation of the last step's Gaussian that DDPM would use (improved DDPM's clipped
        posterior variance at step 0, the value at step 1); sampling itself takes the mean there."""
        return float(self._small[1].sqrt()) if self.sample_steps > 1 else float(self.s_betas[0].sqrt())

    def step_mean_var(self, out: torch.Tensor, x_t: torch.Tensor, i, ddim_tail: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance (both like x_t) of p(x_{i-1} | x_i) for sampling step index i (i = K-1 first).

        `i` is one index for all rows, or a LongTensor (N,) of per-row indices (several steps of a chain
        evaluated in one call). `out` is the denoiser output: epsilon, or [epsilon, v] for 'learned_range'
        (the log-variance interpolates between the posterior variance and beta by (v + 1) / 2, as in
        improved DDPM). The last step (i = 0) has variance 0: the sample is its mean. Steps 1 <= i <=
        `ddim_tail` are deterministic DDIM steps (eta = 0): mean sqrt(a_prev) x0 + sqrt(1 - a_prev) eps, variance 0.
        """
        d = x_t.shape[-1]
        eps = out[..., :d]
        key = (x_t.device, x_t.dtype)
        if key not in self._coef_cache:
            self._coef_cache[key] = self._coefs.to(x_t.device, x_t.dtype)
        table = self._coef_cache[key]  # (8, K)
        per_row = isinstance(i, torch.Tensor)
        if per_row:
            i = i.to(x_t.device)
        s1, sa, c0, ct, log_beta, log_small, sp, s1p = (table[:, i] if per_row else table[:, i:i + 1])[..., None]
        x0 = (x_t - s1 * eps) / sa
        if self.x0_clip is not None:  # guards the noisiest steps (x0 = noise / sqrt(a_t), a_t ~ 1e-8 at t = 999)
            x0 = x0.clamp(-self.x0_clip, self.x0_clip)
        mean = c0 * x0 + ct * x_t
        if ddim_tail > 0:  # eps re-derived from the clamped x0, as DDIM does
            ddim = sp * x0 + s1p * (x_t - sa * x0) / s1
            tail = (i >= 1) & (i <= ddim_tail)
            if per_row:
                mean = torch.where(tail[:, None], ddim, mean)
            elif tail:
                return ddim, torch.zeros_like(x_t)
        if not per_row and i == 0:
            return mean, torch.zeros_like(x_t)
        if self.variance == "learned_range":
            if out.shape[-1] != 2 * d:
                raise ValueError("variance 'learned_range' needs a denoiser with learn_sigma=True (2d outputs)")
            frac = (out[..., d:] + 1) / 2
            var = torch.exp(frac * log_beta + (1 - frac) * log_small)
        else:
            var = (log_small if self.variance == "fixed_small" else log_beta).exp().expand_as(x_t).clone()
        if per_row:
            var = torch.where(((i == 0) | ((i >= 1) & (i <= ddim_tail)))[:, None], torch.zeros_like(var), var)
        return mean, var
