"""Continuous speculative decoding (CSpD) for masked-AR backbones with diffusion heads.

  prefill  the target generates MAR steps until `prefill_ratio` of the tokens are known;
  draft    the draft model runs `gamma` MAR steps on its own, each token with its own noise;
  verify   ONE batched target call gives the conditions of every drafted token.
           `verify="stepwise"`: the tokens of drafted step j are conditioned on what the draft saw,
           the known set plus the drafted steps < j (gamma condition sets, padded into one call: the
           target's context equals the draft's, as in speculative decoding of a causal model).
           `verify="joint"`: one condition set, the tokens known before drafting (cheaper by a factor
           of about gamma in compute; approximate: later steps are judged without the drafts they saw);
  accept   per token by the trajectory density ratio (`cspd_core`), `acceptance`='per_token'
           (every drafted token judged on its own) or 'prefix' (the drafted steps up to the first step
           with a rejection anywhere in the batch, that step kept with its rejected tokens corrected;
           later steps are discarded, which keeps the batch in lockstep);
  correct  a rejected token is redrawn from the residual by acceptance-rejection from the target.

Exactness: tokens of one MAR step are conditionally independent given the step's context, so per-token
judgement inside a step is exact. Across steps, 'prefix' with `verify="stepwise"`, `ratio="exact"`,
`density_temperature=1` samples the target's distribution (up to counted residual fallbacks);
'per_token' keeps drafts of later steps whose context held a rejected draft, and `ratio="aligned"` is the
paper's estimate of the ratio: both are approximations, traded for acceptance.
Both models use each token's own pre-drawn noise, so prefill_ratio = 1 is target-only sampling,
token for token, and `align` controls whether the target's chain for the 'aligned' ratio shares it.
"""
from __future__ import annotations

import torch

from specgen.decoding.cspd_core import accept, log_ratio, residual_sample, tempered
from specgen.decoding.mar import MARState, cfg_at, conditioning, head_step_fn, mar_step, model_conditions, schedule
from specgen.utils.validate import expect_float, expect_int

ACCEPTANCE = ("per_token", "prefix")
VERIFY = ("stepwise", "joint")


def _check(target, draft, prefill_ratio: float, gamma: int, acceptance: str, verify: str) -> None:
    expect_float("prefill_ratio", prefill_ratio, 0.0, 1.0)
    expect_int("gamma", gamma, 1)
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"unknown acceptance {acceptance!r}: expected one of {ACCEPTANCE}")
    if verify not in VERIFY:
        raise ValueError(f"unknown verify {verify!r}: expected one of {VERIFY}")
    target.check_draft(draft)


def _rng(st: MARState, rows: torch.Tensor):
    """rand/randn that draw each token's numbers from its own image's generator."""
    rows = rows.tolist()

    def draw(fn, shape):
        if not rows:
            return torch.zeros(shape, device=st.dev)
        return torch.stack([fn(tuple(shape[1:]), generator=st.generators[b], device=st.dev) for b in rows])
    return (lambda shape: draw(torch.rand, shape)), (lambda shape: draw(torch.randn, shape))


def _sub(z, keep):
    zc, zu, scale = z
    return zc[keep], None if zu is None else zu[keep], scale


@torch.no_grad()
def generate(target, prompts: list[str], generators, draft, num_iter: int = 16, cfg_scale: float = 3.0,
             cfg_schedule: str = "linear", temperature: float = 1.0, prefill_ratio: float = 0.05, gamma: int = 4,
             ratio: str = "aligned", align: bool = True, acceptance: str = "per_token",
             density_temperature: float = 1.0, max_proposals: int = 16, verify: str = "stepwise"):
    """CSpD sampling: tokens (B, L, d) and stats (accept rate, target/draft calls, residual proposals)."""
    _check(target, draft, prefill_ratio, gamma, acceptance, verify)
    st = MARState(target, prompts, generators, cfg_scale)
    cond_t, null_t = conditioning(target, prompts, cfg_scale)
    cond_d, null_d = conditioning(draft, prompts, cfg_scale)
    sched, si = schedule(st.L, num_iter), 0
    stats = {"target_calls": 0, "target_sets": 0, "draft_calls": 0, "drafted": 0, "accepted": 0, "proposals": 0,
             "fallbacks": 0}  # target_sets: condition sets the target computed (its compute, in passes)
    opts = (cfg_scale, cfg_schedule, temperature)
    while si < len(sched) and st.known < prefill_ratio * st.L:  # prefill with the target
        mar_step(target, st, cond_t, null_t, sched[si], *opts)
        st.known, si = sched[si], si + 1
        stats["target_calls"] += 1
        stats["target_sets"] += 1
    while si < len(sched):
        drafted, d_tokens, d_known = [], st.tokens.clone(), st.known
        for tk in sched[si: si + gamma]:  # draft: gamma masked-AR steps of the draft model
            drafted.append(mar_step(draft, st, cond_d, null_d, tk, *opts, tokens=d_tokens, known=d_known) + (d_known,))
            d_known = tk
        stats["draft_calls"] += len(drafted)
        stats["target_calls"] += 1  # one batched target call judges every drafted token
        st.known = _verify(target, draft, st, drafted, d_tokens if verify == "stepwise" else None,
                           (cond_t, null_t), opts, ratio, align, acceptance, density_temperature, max_proposals, stats)
        si = next((i for i, k in enumerate(sched) if k > st.known), len(sched))
    return st.tokens, {**stats, "accept_rate": stats["accepted"] / max(stats["drafted"], 1),
                       "nfe": stats["target_calls"]}


def _target_conditions(target, st, drafted, d_tokens, conds, cfg_scale):
    """The target's per-token conditions for each drafted step, from one batched call.

    d_tokens given (stepwise): step j's context is the known set plus drafted steps < j, one padded
    condition set per step. None (joint): every step gets the context known before drafting."""
    cond, null = conds
    if d_tokens is None:
        zc, zu = model_conditions(target, st.tokens, (st.rank >= st.known).float(), cond, null, cfg_scale)
        return [(zc, zu)] * len(drafted), 1
    G = len(drafted)
    mask = torch.cat([(st.rank >= start).float() for *_, start in drafted])
    rep = lambda t: None if t is None else t.repeat(G, *([1] * (t.dim() - 1)))
    zc, zu = model_conditions(target, rep(d_tokens), mask, rep(cond), rep(null), cfg_scale)
    split = lambda z: [None] * G if z is None else list(z.chunk(G))
    return list(zip(split(zc), split(zu))), G


def _verify(target, draft, st, drafted, d_tokens, conds, opts, ratio, align, acceptance, density_temperature,
            max_proposals, stats) -> int:
    """Judge the drafted tokens, write accepted or corrected ones into st.tokens; return the new known count."""
    cfg_scale, cfg_schedule, temperature = opts
    per_step, sets = _target_conditions(target, st, drafted, d_tokens, conds, cfg_scale)
    stats["target_sets"] += sets
    judged = []
    for (idx, chain, z_draft, start), (zc, zu) in zip(drafted, per_step):
        scale = cfg_at(cfg_scale, cfg_schedule, start, st.L)
        z_t = (zc[idx], None if zu is None else zu[idx], scale)
        nz = st.noise[idx]
        noises = [nz[:, k + 1] for k in range(st.K)] if align else [torch.randn_like(nz[:, 0]) for _ in range(st.K)]
        logr, final = log_ratio(chain, tempered(head_step_fn(target, *z_t), temperature), ratio, noises, align)
        rand, _ = _rng(st, idx[0])
        judged.append((idx, accept(logr, rand((len(logr),)), density_temperature), final, z_t, z_draft))
    step_end = [int(st.rank[i].max()) for i, *_ in judged]  # last rank of each drafted step
    stop_rank = step_end[-1]
    if acceptance == "prefix":  # keep the steps up to the first one with a rejection anywhere in the batch
        stop_rank = next((end for (_, ok, *_), end in zip(judged, step_end) if not bool(ok.all())), stop_rank)
    for idx, ok, final, z_t, z_d in judged:
        keep = st.rank[idx] <= stop_rank
        redo = keep & ~ok
        tok = final.clone()
        if redo.any():  # residual: acceptance-rejection with proposals from the target's own chains
            rand, randn = _rng(st, idx[0][redo])
            r_tok, used, fell = residual_sample(
                tempered(head_step_fn(target, *_sub(z_t, redo)), temperature),
                tempered(head_step_fn(draft, *_sub(z_d, redo)), temperature), (int(redo.sum()), st.d), st.K,
                max_proposals=max_proposals, device=st.dev, rand=rand, randn=randn)
            tok[redo] = r_tok
            stats["proposals"] += int(used.sum())
            stats["fallbacks"] += int(fell.sum())
        st.tokens[idx[0][keep], idx[1][keep]] = tok[keep]
        stats["drafted"] += int(keep.sum())
        stats["accepted"] += int((keep & ok).sum())
    return stop_rank + 1
