"""Target-only sampling of a continuous backbone (`backbones.continuous.ContinuousBackbone`): MAR's sampler
for MAR and Harmon (random order, cosine schedule), next-X for xAR (the backbone's plan says which tokens a
step fills), with classifier-free guidance (constant or linear schedules) and noise temperature; each token
drawn by the backbone's chain of Gaussian transitions.

Every token owns its noise (initial latent and per-step noise), drawn up front from its image's
generator, so a token's noise does not depend on when or by which model it is generated: this is
what aligns draft and target trajectories in CSpD, and makes runs reproducible per image.

The linear guidance schedule is MAR's (LTH14/mar `sample_tokens`, Harmon's and CSpD's the same): the scale of a
step is 1 + (cfg - 1) x (L - masked after the step) / L with the masked count clamped to at least 1, so the last
step is guided at 1 + (cfg - 1)(L - 1)/L; `linear_full` is the unclamped formula (the last step at the full scale);
`linear_steps` is xAR's: 1 + (cfg - 1) x j / (n - 1) for step j of the plan's n. `ddim_tail` > 0
(not MAR's sampler; the baseline of CSpD's deterministic-tail variant) makes the last `ddim_tail` stochastic
denoising steps deterministic (DDIM steps for a DDPM head, Euler steps of the probability-flow ODE for xAR).

Work is counted as it is done (`Work`): transformer calls, transformer rows (one image's context,
CFG branches counted) and head rows (one token at one denoising step, CFG branches counted).
"""
from __future__ import annotations

import dataclasses

import torch

from specgen.backbones.continuous import cosine_schedule as schedule  # noqa: F401  (MAR's, re-exported)
from specgen.decoding.cspd_core import run_chain, tempered
from specgen.utils.validate import expect_float, expect_int


@dataclasses.dataclass
class Work:
    """What one model computed: transformer calls and rows, denoiser rows."""
    calls: int = 0
    rows: int = 0  # transformer rows: one image's condition set per CFG branch
    head_rows: int = 0  # denoiser evaluations: one token at one denoising step per CFG branch


def token_noise(rngs, seq_len: int, steps: int, dim: int, device) -> torch.Tensor:
    """(B, L, steps + 1, dim): per image, per token, the initial latent then one noise per step."""
    return torch.stack([torch.randn(seq_len, steps + 1, dim, generator=g, device=device) for g in rngs])


CFG_SCHEDULES = ("linear", "linear_full", "constant", "linear_steps")


def cfg_at(cfg_scale: float, cfg_schedule: str, known_after: int, seq_len: int, schedule: list[int] | None = None
           ) -> float:
    """Guidance scale of a step that ends with `known_after` tokens known: MAR's linear schedule (from the tokens
    known after the step, at most L - 1: the authors' mask length is at least 1, the last step's too),
    `linear_full` (the same without the clamp: the full scale at the last step), constant, or `linear_steps`
    (xAR's: 1 at the first of the plan's steps `schedule`, cfg_scale at the last, linear in the step index)."""
    if cfg_schedule == "constant":
        return cfg_scale
    if cfg_schedule == "linear":
        return 1 + (cfg_scale - 1) * min(known_after, seq_len - 1) / seq_len
    if cfg_schedule == "linear_full":
        return 1 + (cfg_scale - 1) * known_after / seq_len
    if cfg_schedule == "linear_steps":
        if schedule is None:
            raise ValueError("cfg_schedule='linear_steps' needs the plan's schedule (tokens known after each step)")
        step, steps = schedule.index(known_after), len(schedule)
        return cfg_scale if steps == 1 else 1 + (cfg_scale - 1) * step / (steps - 1)
    raise ValueError(f"unknown cfg_schedule {cfg_schedule!r}: expected one of {CFG_SCHEDULES}")


def cfg_branches(cfg_scale: float) -> int:
    """Rows per image and token a guided model computes: 2 (conditional, unconditional) or 1 without CFG."""
    return 1 if cfg_scale == 1.0 else 2


def head_step_fn(model, z_cond: torch.Tensor, z_uncond: torch.Tensor | None, scale, ddim_tail: int = 0,
                 work: Work | None = None):
    """step(x_i, i) -> (mean, var) of the model's guided reverse transition for tokens with conditions z.

    `scale` is one guidance scale or a tensor (N,) of per-token scales (tokens of several MAR steps).
    `i` is a step index, or (`step.batched`) a LongTensor of per-row indices for rows that stack several
    steps' states of the same tokens (z is then repeated to match: one call evaluates a whole chain)."""
    guided = z_uncond is not None and (isinstance(scale, torch.Tensor) or scale != 1.0)

    def step(x: torch.Tensor, i):
        reps = x.shape[0] // z_cond.shape[0]
        zc = z_cond.repeat(reps, 1) if reps > 1 else z_cond
        zu = z_uncond.repeat(reps, 1) if reps > 1 and z_uncond is not None else z_uncond
        s = scale.repeat(reps) if isinstance(scale, torch.Tensor) and reps > 1 else scale
        if work is not None:
            work.head_rows += x.shape[0] * (2 if guided else 1)
        return model.transition(x, i, zc, zu, s, ddim_tail)

    step.batched = True
    return step


def step_conditions(model, tokens, unknown, conds, guided: bool, work: Work | None = None, image=None):
    """Per-token conditions (N, L, D) of both branches from one transformer call, counted in `work`."""
    if work is not None:
        work.calls += 1
        work.rows += tokens.shape[0] * (2 if guided else 1)
    return model.step_conditions(tokens, unknown, conds, image)


class MARState:
    """Tokens, known set, plan (order and schedule) and per-token noise of a batched generation."""

    def __init__(self, model, rngs, num_iter: int):
        B = len(rngs)
        self.dev = model.device
        self.L, self.K, self.d = model.seq_len, model.num_steps, model.token_dim
        self.rngs = rngs
        self.noise = token_noise(rngs, self.L, self.K, self.d, self.dev)  # (B, L, K + 1, d)
        self.rank, self.schedule = model.plan(rngs, num_iter)  # (B, L), known after each step
        self.tokens = torch.zeros(B, self.L, self.d, device=self.dev)
        self.known = 0  # every image knows the tokens of rank < known

    @property
    def known_mask(self) -> torch.Tensor:
        return self.rank < self.known

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index of the tokens with rank in [lo, hi), ordered by (image, position)."""
        return ((self.rank >= lo) & (self.rank < hi)).nonzero(as_tuple=True)


def conditioning(model, prompts: list, cfg_scale: float):
    """The model's conditioning of the prompts, with the unconditional branch when guided."""
    return model.conditioning(prompts, cfg_scale != 1.0)


def mar_step(model, st: MARState, conds, target_known: int, cfg_scale: float, cfg_schedule: str,
             temperature: float, tokens: torch.Tensor | None = None, known: int | None = None, ddim_tail: int = 0,
             work: Work | None = None):
    """One generation step of `model`: sample the tokens of rank [known, target_known) into `tokens`.

    Returns (index of the new tokens, their chain, their conditions (z_cond, z_uncond, scale))."""
    tokens = st.tokens if tokens is None else tokens
    known = st.known if known is None else known
    scale = cfg_at(cfg_scale, cfg_schedule, target_known, st.L, st.schedule)
    zc, zu = step_conditions(model, tokens, (st.rank >= known).float(), conds, cfg_scale != 1.0, work)
    idx = st.span(known, target_known)
    z = (zc[idx], None if zu is None else zu[idx], scale)
    step = tempered(head_step_fn(model, *z, ddim_tail=ddim_tail, work=work), temperature)
    nz = st.noise[idx]  # (N, K + 1, d): the tokens' own noise
    chain = run_chain(step, nz[:, 0], [nz[:, k + 1] for k in range(st.K)])
    tokens[idx] = chain.sample
    return idx, chain, z


def work_stats(target: Work, draft: Work, batch: int, seq_len: int, steps: int, num_iter: int,
               cfg_scale: float) -> dict[str, float]:
    """Per-image work of a generation and its ratios to target-only sampling of the same batch.

    Target-only sampling computes num_iter condition sets and seq_len x steps denoiser rows per image
    (times the CFG branches). `*_ratio` is target-only / this run (> 1: less target work);
    `draft_*_frac` is the draft's work as a fraction of the target-only target's."""
    g = cfg_branches(cfg_scale)
    sets_ref, head_ref = num_iter * g * batch, seq_len * steps * g * batch
    return {"target_calls": float(target.calls), "target_sets": target.rows / (g * batch),
            "target_head_evals": target.head_rows / batch, "draft_sets": draft.rows / (g * batch),
            "draft_head_evals": draft.head_rows / batch, "nfe": target.rows / (g * batch),
            "target_work_ratio": sets_ref / max(target.rows, 1),
            "target_head_ratio": head_ref / max(target.head_rows, 1),
            "draft_work_frac": draft.rows / sets_ref, "draft_head_frac": draft.head_rows / head_ref}


@torch.no_grad()
def generate(backbone, prompts: list[str], rngs, num_iter: int = 16, cfg_scale: float = 3.0,
             cfg_schedule: str = "linear", temperature: float = 1.0, ddim_tail: int = 0):
    """Target-only sampling: tokens (B, L, d) and stats (nfe = condition sets per image, work counts)."""
    expect_int("num_iter", num_iter, 1)
    expect_float("temperature", temperature, 0.0)
    expect_int("ddim_tail", ddim_tail, 0)
    check_prompts(prompts, rngs)
    st = MARState(backbone, rngs, num_iter)
    conds = conditioning(backbone, prompts, cfg_scale)
    work = Work()
    for target_known in st.schedule:
        mar_step(backbone, st, conds, target_known, cfg_scale, cfg_schedule, temperature, ddim_tail=ddim_tail,
                 work=work)
        st.known = target_known
    return st.tokens, work_stats(work, Work(), len(prompts), st.L, st.K, len(st.schedule), cfg_scale)


def check_prompts(prompts: list, rngs) -> None:
    """One generator per image."""
    if len(prompts) != len(rngs):
        raise ValueError(f"{len(prompts)} prompts but {len(rngs)} generators: give one generator per image "
                         f"(decoding.sampling.make_rngs(seeds))")
