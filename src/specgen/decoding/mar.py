"""Masked-AR sampling of a continuous backbone (MAR): random order, cosine mask schedule, per-token
diffusion head with classifier-free guidance (constant or linear schedule) and noise temperature.

Every token owns its noise (initial latent and per-step noise), drawn up front from its image's
generator, so a token's noise does not depend on when or by which model it is generated: this is
what aligns draft and target trajectories in CSpD, and makes runs reproducible per image.
"""
from __future__ import annotations

import math

import torch

from specgen.utils.validate import expect_float, expect_int


def schedule(seq_len: int, num_iter: int) -> list[int]:
    """Tokens known after each of the num_iter steps (MAR's cosine schedule, at least one per step)."""
    known, out = 0, []
    for step in range(num_iter):
        masked = math.floor(seq_len * math.cos(math.pi / 2 * (step + 1) / num_iter))
        masked = max(0, min(seq_len - known - 1, masked)) if step < num_iter - 1 else 0
        known = seq_len - masked
        out.append(known)
    return out


def token_noise(generators, seq_len: int, steps: int, dim: int, device) -> torch.Tensor:
    """(B, L, steps + 1, dim): per image, per token, the initial latent then one noise per step."""
    return torch.stack([torch.randn(seq_len, steps + 1, dim, generator=g, device=device) for g in generators])


def orders(generators, seq_len: int, device) -> torch.Tensor:
    """(B, L) a random generation order per image."""
    return torch.stack([torch.randperm(seq_len, generator=g, device=device) for g in generators])


def cfg_at(cfg_scale: float, cfg_schedule: str, known: int, seq_len: int) -> float:
    """Guidance scale for a step that starts with `known` tokens (Muse/MAR linear schedule or constant)."""
    if cfg_schedule == "constant":
        return cfg_scale
    if cfg_schedule == "linear":
        return 1 + (cfg_scale - 1) * known / seq_len
    raise ValueError(f"unknown cfg_schedule {cfg_schedule!r}: expected 'linear' or 'constant'")


def head_step_fn(model, z_cond: torch.Tensor, z_uncond: torch.Tensor | None, scale: float):
    """step(x_i, i) -> (mean, var) of the model's guided reverse transition for tokens with conditions z."""
    diff = model.diffusion
    d = model.token_dim

    def step(x: torch.Tensor, i: int):
        t = torch.full((x.shape[0],), int(diff.timesteps[i]), device=x.device)
        if z_uncond is None or scale == 1.0:
            out = model.denoise(x, t, z_cond)
        else:
            both = model.denoise(torch.cat([x, x]), torch.cat([t, t]), torch.cat([z_cond, z_uncond]))
            c, u = both.chunk(2)
            out = torch.cat([u[:, :d] + scale * (c[:, :d] - u[:, :d]), c[:, d:]], dim=-1)
        return diff.step_mean_var(out, x, i)

    return step


def model_conditions(model, tokens, mask, cond, null, scale):
    """Per-token diffusion conditions (B, L, D) for the conditional and, with guidance, unconditional rows."""
    if scale == 1.0 and null is None:
        return model.conditions(tokens, mask, cond), None
    z = model.conditions(torch.cat([tokens, tokens]), torch.cat([mask, mask]), torch.cat([cond, null]))
    return z.chunk(2)


@torch.no_grad()
def generate(backbone, prompts: list[str], generators, num_iter: int = 16, cfg_scale: float = 3.0,
             cfg_schedule: str = "linear", temperature: float = 1.0):
    """Target-only MAR sampling: tokens (B, L, d) and stats."""
    from specgen.decoding.cspd_core import run_chain, tempered

    expect_int("num_iter", num_iter, 1)
    expect_float("temperature", temperature, 0.0)
    m, B = backbone, len(prompts)
    dev = m.fake_latent.device
    L, K, d = m.seq_len, m.diffusion.sample_steps, m.token_dim
    noise = token_noise(generators, L, K, d, dev)
    order = orders(generators, L, dev)
    cond, null = m.condition(prompts), (m.null_condition(B) if cfg_scale != 1.0 else None)
    tokens = torch.zeros(B, L, d, device=dev)
    known_mask = torch.zeros(B, L, dtype=torch.bool, device=dev)
    known, calls = 0, 0
    for target_known in schedule(L, num_iter):
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(L, device=dev).expand(B, -1))
        new = (rank >= known) & (rank < target_known)  # (B, L) tokens of this step
        scale = cfg_at(cfg_scale, cfg_schedule, known, L)
        zc, zu = model_conditions(m, tokens, (~known_mask).float(), cond, null, scale)
        calls += 1
        idx = new.nonzero(as_tuple=True)
        step = tempered(head_step_fn(m, zc[idx], None if zu is None else zu[idx], scale), temperature)
        nz = noise[idx]  # (N, K + 1, d)
        chain = run_chain(step, nz[:, 0], [nz[:, k + 1] for k in range(K)])
        tokens[idx] = chain.sample
        known_mask |= new
        known = target_known
    return tokens, {"nfe": calls}
