"""Continuous speculative decoding (CSpD) for continuous-token backbones whose per-token head samples by
Gaussian transitions (`backbones.continuous.ContinuousBackbone`: MAR, xAR, Harmon, the embedded MAR). A "MAR
step" below is one generation step of the backbone's plan (xAR: one next-X unit).

  prefill  the target runs the first ceil(prefill_ratio x num_iter) MAR steps alone (the paper's
           pre-filling counts generation steps; 5% of 256 in the authors' demo);
  draft    the draft model runs `gamma` MAR steps on its own, each token with its own noise;
  verify   ONE target transformer call gives the conditions of every drafted token of the round:
           `verify="joint"` (the paper's, as in the authors' code): one condition set, the tokens known
           before drafting; `verify="stepwise"`: step j's tokens are conditioned on what the draft saw
           (known set plus drafted steps < j): gamma condition sets padded into one call, so the target's
           transformer work equals target-only sampling's. The target's head then runs its own chain for all
           the round's drafted tokens at once (ratios 'paper', 'aligned') or is evaluated on the draft's
           chains (ratio 'exact');
  accept   per token by the trajectory ratio (`cspd_core`), `acceptance`='per_token' (the paper's: every
           drafted token judged on its own and committed) or 'prefix' (the drafted steps up to the first
           step with a rejection anywhere in the batch, that step kept with its rejected tokens corrected,
           later steps discarded: the batch stays in lockstep). An accepted token keeps the draft's value
           (ratio 'exact': the target's deterministic tail from the draft's last stochastic state);
  correct  a rejected token is redrawn from the residual: analytically from the end-of-chain Gaussians
           (ratio 'paper'), or by acceptance-rejection with fresh target chains (the others).

Exactness: tokens of one MAR step are conditionally independent given the step's context, so per-token
judgement inside a step is exact. 'prefix' with `verify="stepwise"`, `ratio="exact"` and
`density_temperature=1` samples the target's distribution (under the same sampler, `ddim_tail` included)
up to counted residual fallbacks; every other setting is an approximation traded for acceptance.
prefill_ratio = 1 is target-only sampling, token for token. Stats count the work of both models and its
ratio to target-only sampling (`mar.work_stats`); `nfe` is the target's condition sets per image.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from specgen.decoding.cspd_core import (RATIOS, Trajectory, accept, aligned_log_ratio, exact_log_ratio,
                                        gaussian_residual, normaliser_log_ratio, paper_log_ratio, residual_sample,
                                        run_chain, tempered)
from specgen.backbones.continuous import check_pair
from specgen.decoding.mar import (MARState, Work, check_prompts, conditioning, head_step_fn, mar_step, step_conditions,
                                  work_stats)
from specgen.utils.validate import expect_float, expect_int

ACCEPTANCE = ("per_token", "prefix")
VERIFY = ("joint", "stepwise")
AUTHORS_INNER_TEMPERATURE = 42.0  # the authors' code (spec_decode_runner.py)


@dataclasses.dataclass
class Drafted:
    idx: tuple[torch.Tensor, torch.Tensor]  # (image, position) of the step's tokens
    chain: Trajectory
    z: tuple  # the draft's (z_cond, z_uncond, scale) for these tokens
    start: int  # tokens known before the step
    end: int  # tokens known after it


@dataclasses.dataclass
class Session:
    """One batched CSpD generation: state, both models' conditioning, sampler settings, work counters."""
    target: object
    draft: object
    st: MARState
    conds_t: object  # each model's own conditioning (opaque: passed back to it)
    conds_d: object
    num_iter: int
    cfg_scale: float
    cfg_schedule: str
    temperature: float
    ddim_tail: int
    work_t: Work = dataclasses.field(default_factory=Work)
    work_d: Work = dataclasses.field(default_factory=Work)

    @property
    def sampler(self):
        return self.cfg_scale, self.cfg_schedule, self.temperature

    @property
    def guided(self) -> bool:
        return self.cfg_scale != 1.0

    def head(self, model, z_cond, z_uncond, scale):
        """The tempered step function of a model's head, counted in that model's work."""
        work = self.work_t if model is self.target else self.work_d
        return tempered(head_step_fn(model, z_cond, z_uncond, scale, self.ddim_tail, work), self.temperature)


def start(target, draft, prompts: list[str], rngs, num_iter: int = 16, cfg_scale: float = 3.0,
          cfg_schedule: str = "linear", temperature: float = 1.0, ddim_tail: int = 0) -> Session:
    check_prompts(prompts, rngs)
    st = MARState(target, rngs, num_iter)
    return Session(target, draft, st, conditioning(target, prompts, cfg_scale), conditioning(draft, prompts, cfg_scale),
                   num_iter, cfg_scale, cfg_schedule, temperature, ddim_tail)


def prefill_steps(prefill_ratio: float, num_iter: int) -> int:
    """Generation steps the target runs alone: the smallest count that is at least prefill_ratio of them."""
    return min(num_iter, math.ceil(prefill_ratio * num_iter - 1e-9))


def prefill(s: Session, ends: list[int]) -> None:
    """Target-only MAR steps, each ending with `ends[j]` tokens known."""
    for end in ends:
        mar_step(s.target, s.st, s.conds_t, end, *s.sampler, ddim_tail=s.ddim_tail, work=s.work_t)
        s.st.known = end


def draft_steps(s: Session, ends: list[int]) -> tuple[list[Drafted], torch.Tensor]:
    """The draft's MAR steps on a copy of the tokens: (one Drafted per step, the drafted tokens (B, L, d))."""
    d_tokens, known, out = s.st.tokens.clone(), s.st.known, []
    for end in ends:
        idx, chain, z = mar_step(s.draft, s.st, s.conds_d, end, *s.sampler, tokens=d_tokens, known=known,
                                 ddim_tail=s.ddim_tail, work=s.work_d)
        out.append(Drafted(idx, chain, z, known, end))
        known = end
    return out, d_tokens


def target_view(s: Session, drafted: list[Drafted], d_tokens: torch.Tensor, stepwise: bool):
    """The target's conditions (z_cond (N, D), z_uncond, scale (N,)) of the round's drafted tokens, stacked
    in drafted order, from one transformer call: one condition set (joint) or one per drafted step."""
    st = s.st
    G = len(drafted)
    if not stepwise:
        zc, zu = step_conditions(s.target, st.tokens, (st.rank >= st.known).float(), s.conds_t, s.guided, s.work_t)
        per_step = [(zc, zu)] * G
    else:  # step j sees the known set plus drafted steps < j: mask (G * B, L), row g * B + b is image b
        mask = torch.cat([(st.rank >= d.start).float() for d in drafted])
        image = torch.arange(len(st.rngs), device=st.dev).repeat(G)
        zc, zu = step_conditions(s.target, d_tokens.repeat(G, 1, 1), mask, s.conds_t, s.guided, s.work_t, image)
        per_step = list(zip(zc.chunk(G), [None] * G if zu is None else zu.chunk(G)))
    z_c = torch.cat([c[d.idx] for (c, _), d in zip(per_step, drafted)])
    z_u = None if zu is None else torch.cat([u[d.idx] for (_, u), d in zip(per_step, drafted)])
    scale = torch.cat([torch.full((len(d.idx[0]),), float(d.z[2]), device=st.dev) for d in drafted])
    return z_c, z_u, scale


def own_chain(s: Session, step, rows: torch.Tensor, pos: torch.Tensor, align: bool) -> Trajectory:
    """The target's own chain for drafted tokens: their own noise (aligned) or fresh noise from their image's stream."""
    st = s.st
    nz = st.noise[rows, pos] if align else _rng(st, rows)[1]((len(rows), st.K + 1, st.d))  # (N, K + 1, d)
    return run_chain(step, nz[:, 0], [nz[:, k + 1] for k in range(st.K)])


def _rng(st: MARState, rows: torch.Tensor):
    """rand/randn that draw each token's numbers from its own image's RNG."""
    order = torch.argsort(rows, stable=True)  # one call per image, not per token: rows grouped by image
    images, counts = torch.unique_consecutive(rows[order], return_counts=True)
    groups = list(zip(images.tolist(), counts.tolist()))

    def draw(fn, shape):
        out = torch.zeros(shape, device=st.dev)
        if groups:
            out[order] = torch.cat([fn((n, *shape[1:]), generator=st.rngs[b], device=st.dev) for b, n in groups])
        return out
    return (lambda shape: draw(torch.rand, shape)), (lambda shape: draw(torch.randn, shape))


def _check(target, draft, prefill_ratio, gamma, ratio, acceptance, verify, inner_temperature, final_std, ddim_tail):
    expect_float("prefill_ratio", prefill_ratio, 0.0, 1.0)
    expect_int("gamma", gamma, 1)
    expect_int("ddim_tail", ddim_tail, 0)
    for name, value, options in (("ratio", ratio, RATIOS), ("acceptance", acceptance, ACCEPTANCE),
                                 ("verify", verify, VERIFY)):
        if value not in options:
            raise ValueError(f"unknown {name} {value!r}: expected one of {options}")
    if ratio != "paper" and (inner_temperature is not None or final_std is not None):
        raise ValueError(f"inner_temperature={inner_temperature} and final_std={final_std} belong to ratio='paper', "
                         f"got ratio={ratio!r}: set them to null (density_temperature tempers the other ratios)")
    if inner_temperature is not None:
        expect_float("inner_temperature", inner_temperature, 1e-6)
    if final_std is not None:
        expect_float("final_std", final_std, 1e-12)
    if ddim_tail >= target.num_steps:
        raise ValueError(f"ddim_tail={ddim_tail} must be below the head's {target.num_steps} sampling steps")
    check_pair(target, draft)


@torch.no_grad()
def generate(target, prompts: list[str], rngs, draft, num_iter: int = 16, cfg_scale: float = 3.0,
             cfg_schedule: str = "linear", temperature: float = 1.0, prefill_ratio: float = 0.05, gamma: int = 4,
             ratio: str = "paper", align: bool = True, inner_temperature: float | None = None,
             final_std: float | None = None, acceptance: str = "per_token", verify: str = "joint",
             density_temperature: float = 1.0, max_proposals: int = 16, ddim_tail: int = 0):
    """CSpD sampling: tokens (B, L, d) and stats (acceptance, residual proposals, both models' work).

    `inner_temperature` and `final_std` (ratio 'paper' only; None: the authors' 42 and the schedule's
    clipped posterior std at step 0 times the noise temperature) set the last-step Gaussian."""
    _check(target, draft, prefill_ratio, gamma, ratio, acceptance, verify, inner_temperature, final_std, ddim_tail)
    s = start(target, draft, prompts, rngs, num_iter, cfg_scale, cfg_schedule, temperature, ddim_tail)
    if ratio == "paper":
        final_std = final_std if final_std is not None else target.final_std() * temperature
        inner_temperature = inner_temperature if inner_temperature is not None else AUTHORS_INNER_TEMPERATURE
    judge = dict(ratio=ratio, align=align, inner_temperature=inner_temperature, final_std=final_std,
                 acceptance=acceptance, density_temperature=density_temperature, max_proposals=max_proposals)
    sched = s.st.schedule
    num_iter = len(sched)  # the backbone's plan may fix its own step count (xAR: one step per next-X unit)
    si = prefill_steps(prefill_ratio, num_iter)
    prefill(s, sched[:si])
    stats = {"drafted": 0, "accepted": 0, "proposals": 0, "fallbacks": 0, "rounds": 0}
    by_step = torch.zeros(2, len(prompts), num_iter, device=s.st.dev)  # per image: drafted, accepted per MAR step
    while si < len(sched):
        drafted, d_tokens = draft_steps(s, sched[si: si + gamma])
        s.st.known = verify_round(s, drafted, d_tokens, verify == "stepwise", stats, **judge, first_step=si,
                                  by_step=by_step)
        si = next((i for i, k in enumerate(sched) if k > s.st.known), len(sched))
        stats["rounds"] += 1
    work = work_stats(s.work_t, s.work_d, len(prompts), s.st.L, s.st.K, num_iter, cfg_scale)
    return s.st.tokens, {**stats, **work, "draft_calls": float(s.work_d.calls), "prefill_steps": prefill_steps(
        prefill_ratio, num_iter), "accept_rate": stats["accepted"] / max(stats["drafted"], 1),
        "step_drafted": by_step[0], "step_accepted": by_step[1]}


def verify_round(s: Session, drafted: list[Drafted], d_tokens, stepwise: bool, stats: dict, ratio: str, align: bool,
                 inner_temperature, final_std, acceptance: str, density_temperature: float, max_proposals: int,
                 first_step: int = 0, by_step: torch.Tensor | None = None) -> int:
    """Judge a round's drafted tokens, write accepted or corrected ones into the tokens; return the new known count.

    `by_step` (2, B, num_iter), when given, receives per image the drafted and accepted counts of each MAR step
    (the round's drafted steps are `first_step`, `first_step + 1`, ...)."""
    st = s.st
    z_t = target_view(s, drafted, d_tokens, stepwise)
    chain = Trajectory.cat([d.chain for d in drafted])
    rows, pos = torch.cat([d.idx[0] for d in drafted]), torch.cat([d.idx[1] for d in drafted])
    step_of = torch.cat([torch.full((len(d.idx[0]),), j, device=st.dev) for j, d in enumerate(drafted)])
    step_p = s.head(s.target, *z_t)
    rand, randn = _rng(st, rows)
    own = None
    if ratio == "exact":
        logr, final = exact_log_ratio(chain, step_p)
    else:
        own = own_chain(s, step_p, rows, pos, align)
        logr = (paper_log_ratio(chain, own, final_std, inner_temperature) if ratio == "paper"
                else aligned_log_ratio(chain, own))
        final = chain.sample  # an accepted token keeps the draft's value
    ok = accept(logr, rand((len(rows),)), density_temperature)
    last = len(drafted) - 1
    if acceptance == "prefix":  # the drafted steps up to the first one with a rejection anywhere in the batch
        last = next((j for j in range(len(drafted)) if not bool(ok[step_of == j].all())), last)
    keep = step_of <= last
    redo = keep & ~ok
    tok = final.clone()
    if redo.any():
        rand_r, randn_r = _rng(st, rows[redo])
        if ratio == "paper":
            tok[redo], used, fell = gaussian_residual(own.sample[redo], chain.sample[redo], final_std,
                                                      normaliser_log_ratio(chain.rows(redo), own.rows(redo)),
                                                      rand_r, randn_r, max_proposals)
        else:
            tok[redo], used, fell = _chain_residual(s, drafted, z_t, redo, rand_r, randn_r, max_proposals)
        stats["proposals"] += int(used.sum())
        stats["fallbacks"] += int(fell.sum())
    st.tokens[rows[keep], pos[keep]] = tok[keep]
    stats["drafted"] += int(keep.sum())
    stats["accepted"] += int((keep & ok).sum())
    if by_step is not None:
        at = (rows[keep], first_step + step_of[keep])
        by_step[0].index_put_(at, torch.ones_like(at[1], dtype=by_step.dtype), accumulate=True)
        by_step[1].index_put_(at, ok[keep].to(by_step.dtype), accumulate=True)
    return drafted[last].end


def _chain_residual(s: Session, drafted: list[Drafted], z_t, redo: torch.Tensor, rand, randn, max_proposals: int):
    """Residual by fresh target chains (exact and aligned ratios) for the rows `redo` of the round."""
    zc_d = torch.cat([d.z[0] for d in drafted])
    zu_d = None if drafted[0].z[1] is None else torch.cat([d.z[1] for d in drafted])
    sub = lambda z: None if z is None else z[redo]
    step_p = s.head(s.target, z_t[0][redo], sub(z_t[1]), z_t[2][redo])
    step_q = s.head(s.draft, zc_d[redo], sub(zu_d), z_t[2][redo])
    return residual_sample(step_p, step_q, (int(redo.sum()), s.st.d), s.st.K, max_proposals=max_proposals,
                           device=s.st.dev, rand=rand, randn=randn)
