"""Continuous speculative decoding (CSpD) for continuous-token backbones whose per-token head samples by
Gaussian transitions (`backbones.continuous.ContinuousBackbone`: MAR, xAR, Harmon, the embedded MAR). A "MAR
step" below is one generation step of the backbone's plan (xAR: one next-X unit). The defaults are the authors'
code (MarkXCloud/CSpD, spec_decode/spec_decode_runner.py), term for term:

  1 prefill  the target runs generation steps 0 .. floor(prefill_ratio x num_iter) alone (theirs: `step <=
             num_iter * ratio`, so ratio 0 still pre-fills step 0; 5% in their demo);
  2 draft    the draft runs MAR steps on its own, each token with its own noise, until a verification step:
             a step s with s % gamma == 0 (s != 0) or the last step (theirs: `num_draft`, 4 in their demo);
  3 verify   ONE target transformer call gives the conditions of every drafted token of the round: joint (theirs:
             the tokens known before the round, every drafted token masked), guided at the scale of the round's
             last step; the target's head runs its own chain for the round's drafted tokens, from the drafts'
             initial latents and per-step noise (alignment);
  4 accept   per token by the trajectory ratio (`cspd_core`: their normaliser sign, last-step Gaussian widened by
             the inner temperature 42); every token is committed, an accepted one keeps the draft's value;
  5 correct  a rejected token is redrawn from the residual analytically from the end-of-chain Gaussians (up to
             100 proposals); the draft goes on from the corrected tokens.

Deliberate differences, each a named option (configs/decoding/cspd_*.yaml say which config uses which):
  `prefill_rule="ceil"` the smallest step count that is at least prefill_ratio of them; `rounds="fixed"`: rounds
  of `gamma` steps from the first drafted step; `verify_cfg="own_step"`: each drafted step verified at its own
  guidance scale; `normaliser="derivation"` (cspd_core); `fallback="target"` (theirs leaves a zero token when the
  residual's proposals all fail; the default here keeps the target's aligned token, counted in the stats);
  `final_std`: theirs scores the last step with each model's own learned std at t = 0, here one width for both
  (by default the schedule's clipped posterior std at step 0, within 3% of the learned ones on the shipped pair);
  `verify="stepwise"` (beyond the paper: verification with in-round context): drafted step j's tokens are
  conditioned on the known set plus the round's drafted steps < j, the gamma condition sets stacked into ONE
  transformer call (a round still costs one target latency step; rows as target-only sampling);
  `acceptance="prefix"`: the drafted steps up to the first step with a rejection anywhere in the batch, that step
  kept with its rejected tokens corrected, later steps discarded; `ratio="exact"`: the target's transitions on the
  draft's chains, the accepted token the target's deterministic tail; residual by fresh target chains.

Exactness: tokens of one MAR step are conditionally independent given the step's context, so per-token
judgement inside a step is exact. 'prefix' with `verify="stepwise"`, `ratio="exact"`, each step's own guidance
scale and `density_temperature=1` samples the target's distribution (under the same sampler, `ddim_tail`
included) up to counted residual fallbacks; every other setting is an approximation traded for acceptance.
prefill_ratio = 1 is target-only sampling, token for token. Stats count the work of both models and its
ratio to target-only sampling (`mar.work_stats`); `nfe` is the target's condition sets per image.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from specgen.decoding.cspd_core import (FALLBACKS, NORMALISERS, RATIOS, Trajectory, accept, exact_log_ratio,
                                        gaussian_residual, normaliser_log_ratio, paper_log_ratio, residual_sample,
                                        run_chain, tempered)
from specgen.backbones.continuous import check_pair
from specgen.decoding.mar import (MARState, Work, check_prompts, conditioning, head_step_fn, mar_step, step_conditions,
                                  work_stats)
from specgen.utils.validate import expect_float, expect_int

ACCEPTANCE = ("per_token", "prefix")
VERIFY = ("joint", "stepwise")
ROUNDS = ("authors", "fixed")
PREFILL_RULES = ("authors", "ceil")
VERIFY_CFG = ("round_last", "own_step")
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


def prefill_steps(prefill_ratio: float, num_iter: int, rule: str = "authors") -> int:
    """Generation steps the target runs alone: steps 0 .. floor(ratio x num_iter) (the authors': `step <= num_iter *
    ratio`), or the smallest count that is at least prefill_ratio of them (`rule="ceil"`)."""
    if rule == "authors":
        return min(num_iter, math.floor(prefill_ratio * num_iter + 1e-9) + 1)
    return min(num_iter, math.ceil(prefill_ratio * num_iter - 1e-9))


def round_end(first: int, gamma: int, num_iter: int, rule: str = "authors") -> int:
    """The last step (inclusive) of a round whose first drafted step is `first`: the next step s >= first with
    s % gamma == 0, s != 0, or the last step (the authors'), or `first + gamma - 1` (`rule="fixed"`)."""
    if rule == "fixed":
        return min(first + gamma - 1, num_iter - 1)
    return next((s for s in range(first, num_iter) if s % gamma == 0 and s != 0), num_iter - 1)


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


def target_view(s: Session, drafted: list[Drafted], d_tokens: torch.Tensor, stepwise: bool, round_cfg: bool = False):
    """The target's conditions (z_cond (N, D), z_uncond, scale (N,)) of the round's drafted tokens, stacked
    in drafted order, from one transformer call: one condition set (joint) or one per drafted step (stepwise:
    the gamma prefixes of the round's context as a batch). `round_cfg`: every token at the guidance scale of the
    round's last step (the authors'), else at its own step's."""
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
    scale = lambda d: float(drafted[-1].z[2] if round_cfg else d.z[2])
    scale = torch.cat([torch.full((len(d.idx[0]),), scale(d), device=st.dev) for d in drafted])
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


@dataclasses.dataclass
class Judge:
    """How a round is verified, judged and corrected (the options of `generate`)."""
    ratio: str = "paper"
    align: bool = True
    inner_temperature: float | None = None
    final_std: float | None = None
    normaliser: str | None = None
    acceptance: str = "per_token"
    verify: str = "joint"
    verify_cfg: str | None = None
    density_temperature: float = 1.0
    max_proposals: int = 100
    fallback: str = "target"

    def resolve(self, target, temperature: float) -> "Judge":
        """The ratio's own settings filled in: the paper ratio's width, temperature and normaliser; the guidance
        scale of verification (paper: the round's last step, as the authors'; exact: each step's own, which the
        lossless mode needs)."""
        for name, value, options in (("ratio", self.ratio, RATIOS), ("acceptance", self.acceptance, ACCEPTANCE),
                                     ("verify", self.verify, VERIFY), ("fallback", self.fallback, FALLBACKS),
                                     ("verify_cfg", self.verify_cfg or VERIFY_CFG[0], VERIFY_CFG),
                                     ("normaliser", self.normaliser or NORMALISERS[0], NORMALISERS)):
            if value not in options:
                raise ValueError(f"unknown {name} {value!r}: expected one of {options}")
        paper_only = dict(inner_temperature=self.inner_temperature, final_std=self.final_std,
                          normaliser=self.normaliser)
        if self.ratio != "paper" and any(v is not None for v in paper_only.values()):
            raise ValueError(f"{', '.join(f'{k}={v}' for k, v in paper_only.items())} belong to ratio='paper', got "
                             f"ratio={self.ratio!r}: set them to null (density_temperature tempers the exact ratio)")
        if self.inner_temperature is not None:
            expect_float("inner_temperature", self.inner_temperature, 1e-6)
        if self.final_std is not None:
            expect_float("final_std", self.final_std, 1e-12)
        expect_int("max_proposals", self.max_proposals, 1)
        if self.ratio != "paper":
            return dataclasses.replace(self, verify_cfg=self.verify_cfg or "own_step")
        return dataclasses.replace(
            self, final_std=self.final_std if self.final_std is not None else target.final_std() * temperature,
            inner_temperature=self.inner_temperature or AUTHORS_INNER_TEMPERATURE,
            normaliser=self.normaliser or "authors", verify_cfg=self.verify_cfg or "round_last")


def _check(target, draft, prefill_ratio, gamma, ddim_tail, rounds, prefill_rule):
    expect_float("prefill_ratio", prefill_ratio, 0.0, 1.0)
    expect_int("gamma", gamma, 1)
    expect_int("ddim_tail", ddim_tail, 0)
    for name, value, options in (("rounds", rounds, ROUNDS), ("prefill_rule", prefill_rule, PREFILL_RULES)):
        if value not in options:
            raise ValueError(f"unknown {name} {value!r}: expected one of {options}")
    if ddim_tail >= target.num_steps:
        raise ValueError(f"ddim_tail={ddim_tail} must be below the head's {target.num_steps} sampling steps")
    check_pair(target, draft)


@torch.no_grad()
def generate(target, prompts: list[str], rngs, draft, num_iter: int = 64, cfg_scale: float = 3.0,
             cfg_schedule: str = "linear", temperature: float = 1.0, prefill_ratio: float = 0.05, gamma: int = 4,
             rounds: str = "authors", prefill_rule: str = "authors", ratio: str = "paper", align: bool = True,
             inner_temperature: float | None = None, final_std: float | None = None, normaliser: str | None = None,
             acceptance: str = "per_token", verify: str = "joint", verify_cfg: str | None = None,
             density_temperature: float = 1.0, max_proposals: int = 100, fallback: str = "target", ddim_tail: int = 0):
    """CSpD sampling: tokens (B, L, d) and stats (acceptance, residual proposals, both models' work).

    None for the paper ratio's `inner_temperature`, `final_std`, `normaliser`: the authors' 42, the schedule's
    clipped posterior std at step 0 times the noise temperature, the authors' sign; for `verify_cfg`: the round's
    last step's scale for the paper ratio (the authors'), each step's own for the exact ratio (`Judge.resolve`)."""
    _check(target, draft, prefill_ratio, gamma, ddim_tail, rounds, prefill_rule)
    j = Judge(ratio, align, inner_temperature, final_std, normaliser, acceptance, verify, verify_cfg,
              density_temperature, max_proposals, fallback).resolve(target, temperature)
    s = start(target, draft, prompts, rngs, num_iter, cfg_scale, cfg_schedule, temperature, ddim_tail)
    sched = s.st.schedule
    num_iter = len(sched)  # the backbone's plan may fix its own step count (xAR: one step per next-X unit)
    si = prefill_steps(prefill_ratio, num_iter, prefill_rule)
    prefill(s, sched[:si])
    stats = {"drafted": 0, "accepted": 0, "proposals": 0, "fallbacks": 0, "rounds": 0}
    by_step = torch.zeros(2, len(prompts), num_iter, device=s.st.dev)  # per image: drafted, accepted per MAR step
    while si < len(sched):
        drafted, d_tokens = draft_steps(s, sched[si: round_end(si, gamma, num_iter, rounds) + 1])
        s.st.known = verify_round(s, drafted, d_tokens, j, stats, first_step=si, by_step=by_step)
        si = next((i for i, k in enumerate(sched) if k > s.st.known), len(sched))
        stats["rounds"] += 1
    work = work_stats(s.work_t, s.work_d, len(prompts), s.st.L, s.st.K, num_iter, cfg_scale)
    return s.st.tokens, {**stats, **work, "draft_calls": float(s.work_d.calls), "prefill_steps": prefill_steps(
        prefill_ratio, num_iter, prefill_rule), "accept_rate": stats["accepted"] / max(stats["drafted"], 1),
        "step_drafted": by_step[0], "step_accepted": by_step[1]}


def judge_round(s: Session, drafted: list[Drafted], d_tokens, j: Judge):
    """The round's drafted tokens judged: (z_t, chain, rows, pos, step_of, own chain or None, log ratio, accept,
    the value an accepted token takes)."""
    z_t = target_view(s, drafted, d_tokens, j.verify == "stepwise", j.verify_cfg == "round_last")
    chain = Trajectory.cat([d.chain for d in drafted])
    rows, pos = torch.cat([d.idx[0] for d in drafted]), torch.cat([d.idx[1] for d in drafted])
    step_of = torch.cat([torch.full((len(d.idx[0]),), g, device=s.st.dev) for g, d in enumerate(drafted)])
    step_p = s.head(s.target, *z_t)
    own = None
    if j.ratio == "exact":
        logr, final = exact_log_ratio(chain, step_p)
    else:
        own = own_chain(s, step_p, rows, pos, j.align)
        logr = paper_log_ratio(chain, own, j.final_std, j.inner_temperature, j.normaliser)
        final = chain.sample  # an accepted token keeps the draft's value
    ok = accept(logr, _rng(s.st, rows)[0]((len(rows),)), j.density_temperature)
    return z_t, chain, rows, pos, step_of, own, ok, final


def verify_round(s: Session, drafted: list[Drafted], d_tokens, j: Judge, stats: dict, first_step: int = 0,
                 by_step: torch.Tensor | None = None) -> int:
    """Judge a round's drafted tokens, write accepted or corrected ones into the tokens; return the new known count.

    `by_step` (2, B, num_iter), when given, receives per image the drafted and accepted counts of each MAR step
    (the round's drafted steps are `first_step`, `first_step + 1`, ...)."""
    st = s.st
    z_t, chain, rows, pos, step_of, own, ok, final = judge_round(s, drafted, d_tokens, j)
    last = len(drafted) - 1
    if j.acceptance == "prefix":  # the drafted steps up to the first one with a rejection anywhere in the batch
        last = next((g for g in range(len(drafted)) if not bool(ok[step_of == g].all())), last)
    keep = step_of <= last
    redo = keep & ~ok
    tok = final.clone()
    if redo.any():
        rand_r, randn_r = _rng(st, rows[redo])
        if j.ratio == "paper":
            log_c = normaliser_log_ratio(chain.rows(redo), own.rows(redo), j.normaliser)
            tok[redo], used, fell = gaussian_residual(own.sample[redo], chain.sample[redo], j.final_std, log_c,
                                                      rand_r, randn_r, j.max_proposals, j.fallback)
        else:
            tok[redo], used, fell = _chain_residual(s, drafted, z_t, redo, rand_r, randn_r, j.max_proposals)
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
