"""Continuous speculative decoding, per token: draft trajectory, density-ratio acceptance, residual.

A diffusion head samples a token by a chain of Gaussian transitions x_K -> ... -> x_0 with
p(x_{i-1} | x_i) = N(mu(x_i), var_i). Its trajectory density is N(x_K; 0, I) prod_i N(x_{i-1}; mu(x_i), var_i).

* Draft: the draft head runs its chain from x_K with per-step noise eps_i.
* Accept (`ratio="exact"`): with prob min(1, [p(tau)/q(tau)]^(1/T)), p's transitions evaluated on the
  draft's own states (x_K cancels). With T = 1 this is speculative sampling on trajectories, hence
  exact for the token: the accepted chain is a draw from p's chain.
* Accept (`ratio="aligned"`, the CSpD paper's estimate): the target runs its own chain from the same
  x_K with the same eps_i ("trajectory alignment"); p's transition i is centred at mu_p of the
  target's state and evaluated at the draft's next state. Approximate (exact only when the chains
  coincide); without alignment (`align=False`) the target's chain uses independent noise, which
  is what alignment is measured against.
* Deterministic steps (var = 0, the last DDPM step) carry no density: an accepted chain ends with
  the target's own last step, so the output token is the target's.
* Residual: a rejected token is redrawn from norm(max(0, p - q)) by acceptance-rejection with the
  analytic bound p >= max(0, p - q): propose tau ~ p, accept with max(0, 1 - q(tau)/p(tau)). At most
  `max_proposals` proposals; after that the last proposal is used (a draw from p, not the residual)
  and the fallback is counted.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

# step_fn(x_i (N, d), i) -> (mean (N, d), var (N, d)) of p(x_{i-1} | x_i), i = K-1 ... 0
StepFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class Trajectory:
    states: list[torch.Tensor]  # x_K, ..., x_0 (K + 1 tensors (N, d))
    means: list[torch.Tensor]  # mu(x_i) for i = K-1 ... 0
    vars: list[torch.Tensor]

    @property
    def sample(self) -> torch.Tensor:
        return self.states[-1]


def tempered(step: StepFn, temperature: float) -> StepFn:
    """The chain actually sampled at noise temperature t: variances scaled by t^2 (densities follow)."""
    if temperature == 1.0:
        return step
    warm = lambda x, i: (lambda m, v: (m, v * temperature ** 2))(*step(x, i))
    warm.batched = getattr(step, "batched", False)
    return warm


def run_chain(step: StepFn, x_init: torch.Tensor, noises: list[torch.Tensor]) -> Trajectory:
    """Sample a chain from x_K = x_init with injected per-step noise (one (N, d) tensor per step)."""
    states, means, vars_ = [x_init], [], []
    x = x_init
    for k, eps in enumerate(noises):
        i = len(noises) - 1 - k
        mean, var = step(x, i)
        x = mean + var.sqrt() * eps
        states.append(x)
        means.append(mean)
        vars_.append(var)
    return Trajectory(states, means, vars_)


def gauss_logpdf(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Sum over dims of log N(x; mean, var) (N,), steps with var = 0 contribute 0."""
    live = var > 0
    v = torch.where(live, var, torch.ones_like(var))
    lp = -0.5 * ((x - mean) ** 2 / v + torch.log(2 * math.pi * v))
    return torch.where(live, lp, torch.zeros_like(lp)).sum(-1)


def chain_logprob(states: list[torch.Tensor], means: list[torch.Tensor], vars_: list[torch.Tensor]) -> torch.Tensor:
    """log prod_i N(x_{i-1}; mean_i, var_i) over the stochastic steps: (N,)."""
    return sum(gauss_logpdf(states[k + 1], means[k], vars_[k]) for k in range(len(means)))


def evaluate_on(step: StepFn, states: list[torch.Tensor], max_rows: int = 4096
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Another head's transition means/variances evaluated on given states.

    The states are known, so the steps do not depend on each other: a step function marked `batched`
    (it takes a tensor of per-row step indices) evaluates the whole chain in as few calls as
    `max_rows` allows, instead of one call per step."""
    K = len(states) - 1
    if not getattr(step, "batched", False) or K == 0:
        out = [step(states[k], K - 1 - k) for k in range(K)]
        return [m for m, _ in out], [v for _, v in out]
    N = states[0].shape[0]
    per_call = max(1, max_rows // max(N, 1))
    means, vars_ = [], []
    for lo in range(0, K, per_call):
        ks = range(lo, min(K, lo + per_call))
        x = torch.cat([states[k] for k in ks])
        i = torch.cat([torch.full((N,), K - 1 - k, dtype=torch.long) for k in ks])
        m, v = step(x, i)
        means += list(m.split(N))
        vars_ += list(v.split(N))
    return means, vars_


def log_ratio(draft: Trajectory, target_step: StepFn, ratio: str = "exact", target_noises=None,
              align: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(tau)/q(tau) (N,), the target's final token (N, d)) for a drafted chain."""
    logq = chain_logprob(draft.states, draft.means, draft.vars)
    if ratio == "exact":
        means, vars_ = evaluate_on(target_step, draft.states)
        # a deterministic last step is not judged: the accepted chain ends with the target's own mean
        final = means[-1] if float(vars_[-1].max()) == 0 else draft.sample
        return chain_logprob(draft.states, means, vars_) - logq, final
    if ratio != "aligned":
        raise ValueError(f"unknown CSpD ratio {ratio!r}: expected 'exact' or 'aligned'")
    if target_noises is None:
        raise ValueError("ratio='aligned' needs the target's noises (the draft's when aligned, fresh ones when not)")
    x_init = draft.states[0] if align else torch.randn_like(draft.states[0])
    own = run_chain(target_step, x_init, target_noises)
    logp = chain_logprob(draft.states, own.means, own.vars)  # target Gaussians at its own states, draft's points
    final = own.sample if float(own.vars[-1].max()) == 0 else draft.sample
    return logp - logq, final


def accept(logr: torch.Tensor, u: torch.Tensor, density_temperature: float = 1.0) -> torch.Tensor:
    """Accept where u < min(1, exp(logr / T)); T > 1 raises acceptance at the cost of exactness."""
    return torch.log(u.clamp_min(1e-30)) < (logr / density_temperature).clamp_max(0.0)


def residual_sample(target_step: StepFn, draft_step: StepFn, shape: tuple[int, int], steps: int,
                    generator: torch.Generator | None = None, max_proposals: int = 16, device="cpu",
                    rand=None, randn=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw from norm(max(0, p - q)) by acceptance-rejection with proposals from p.

    `rand`/`randn` (shape -> tensor) replace the generator when each row needs its own stream.
    Returns (tokens (N, d), proposals used (N,), fell back (N,) bool)."""
    N, d = shape
    rand = rand or (lambda sh: torch.rand(sh, generator=generator, device=device))
    randn = randn or (lambda sh: torch.randn(sh, generator=generator, device=device))
    out = torch.zeros(shape, device=device)
    used = torch.zeros(N, dtype=torch.long, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    for _ in range(max_proposals):
        x_init = randn(shape)
        noises = [randn(shape) for _ in range(steps)]
        prop = run_chain(target_step, x_init, noises)
        logp = chain_logprob(prop.states, prop.means, prop.vars)
        qm, qv = evaluate_on(draft_step, prop.states)
        logq = chain_logprob(prop.states, qm, qv)
        u = rand((N,))
        ok = (u < (1 - torch.exp(logq - logp)).clamp_min(0)) & ~done
        out[ok] = prop.sample[ok]
        used += (~done).long()
        done |= ok
        out[~done] = prop.sample[~done]  # fallback value if nothing is accepted in the end
        if bool(done.all()):
            break
    return out, used, ~done
