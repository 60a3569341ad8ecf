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
    """step(x_i, i) -> (mean, var) of the model's guided reverse transition for tokens with conditions z.

    `i` is a step index, or (`step.batched`) a LongTensor of per-row indices for rows that stack several
    steps' states of the same tokens (z is then repeated to match: one call evaluates a whole chain)."""
    diff = model.diffusion
    d = model.token_dim

    def step(x: torch.Tensor, i):
        if isinstance(i, torch.Tensor):
            t = diff.timesteps.to(x.device)[i.to(x.device)]
            reps = x.shape[0] // z_cond.shape[0]
            zc = z_cond.repeat(reps, 1)
            zu = None if z_uncond is None else z_uncond.repeat(reps, 1)
        else:
            t = torch.full((x.shape[0],), int(diff.timesteps[i]), device=x.device)
            zc, zu = z_cond, z_uncond
        if zu is None or scale == 1.0:
            out = model.denoise(x, t, zc)
        else:
            both = model.denoise(torch.cat([x, x]), torch.cat([t, t]), torch.cat([zc, zu]))
            c, u = both.chunk(2)
            out = torch.cat([u[:, :d] + scale * (c[:, :d] - u[:, :d]), c[:, d:]], dim=-1)
        return diff.step_mean_var(out, x, i)

    step.batched = True
    return step


def model_conditions(model, tokens, mask, cond, null, scale):
    """Per-token diffusion conditions (B, L, D) for the conditional and, with guidance, unconditional rows."""
    if scale == 1.0 and null is None:
        return model.conditions(tokens, mask, cond), None
    z = model.conditions(torch.cat([tokens, tokens]), torch.cat([mask, mask]), torch.cat([cond, null]))
    return z.chunk(2)


class MARState:
    """Tokens, known set, order and per-token noise of a batched masked-AR generation."""

    def __init__(self, model, prompts: list[str], generators, cfg_scale: float):
        m, B = model, len(prompts)
        self.dev = m.fake_latent.device
        self.L, self.K, self.d = m.seq_len, m.diffusion.sample_steps, m.token_dim
        self.generators = generators
        self.noise = token_noise(generators, self.L, self.K, self.d, self.dev)  # (B, L, K + 1, d)
        order = orders(generators, self.L, self.dev)
        self.rank = torch.empty_like(order).scatter_(1, order, torch.arange(self.L, device=self.dev).expand(B, -1))
        self.tokens = torch.zeros(B, self.L, self.d, device=self.dev)
        self.known = 0  # every image knows the tokens of rank < known

    @property
    def known_mask(self) -> torch.Tensor:
        return self.rank < self.known

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index of the tokens with rank in [lo, hi), ordered by (image, position)."""
        return ((self.rank >= lo) & (self.rank < hi)).nonzero(as_tuple=True)


def conditioning(model, prompts: list[str], cfg_scale: float):
    return model.condition(prompts), (model.null_condition(len(prompts)) if cfg_scale != 1.0 else None)


def mar_step(model, st: MARState, cond, null, target_known: int, cfg_scale: float, cfg_schedule: str,
             temperature: float, tokens: torch.Tensor | None = None, known: int | None = None):
    """One masked-AR step of `model`: sample the tokens of rank [known, target_known) into `tokens`.

    Returns (index of the new tokens, their chain, their conditions (z_cond, z_uncond, scale))."""
    from specgen.decoding.cspd_core import run_chain, tempered

    tokens = st.tokens if tokens is None else tokens
    known = st.known if known is None else known
    scale = cfg_at(cfg_scale, cfg_schedule, known, st.L)
    zc, zu = model_conditions(model, tokens, (st.rank >= known).float(), cond, null, scale)
    idx = st.span(known, target_known)
    z = (zc[idx], None if zu is None else zu[idx], scale)
    step = tempered(head_step_fn(model, *z), temperature)
    nz = st.noise[idx]  # (N, K + 1, d): the tokens' own noise
    chain = run_chain(step, nz[:, 0], [nz[:, k + 1] for k in range(st.K)])
    tokens[idx] = chain.sample
    return idx, chain, z


@torch.no_grad()
def generate(backbone, prompts: list[str], generators, num_iter: int = 16, cfg_scale: float = 3.0,
             cfg_schedule: str = "linear", temperature: float = 1.0):
    """Target-only MAR sampling: tokens (B, L, d) and stats."""
    expect_int("num_iter", num_iter, 1)
    expect_float("temperature", temperature, 0.0)
    st = MARState(backbone, prompts, generators, cfg_scale)
    cond, null = conditioning(backbone, prompts, cfg_scale)
    for target_known in schedule(st.L, num_iter):
        mar_step(backbone, st, cond, null, target_known, cfg_scale, cfg_schedule, temperature)
        st.known = target_known
    return st.tokens, {"nfe": num_iter}
