"""Continuous speculative decoding, per token: draft trajectory, density-ratio acceptance, residual.

A diffusion head samples a token by a chain of Gaussian transitions x_K -> ... -> x_0 with
p(x_{i-1} | x_i) = N(mu(x_i), var_i); the last step(s) may be deterministic (var = 0: DDPM's last step,
and a DDIM tail). Each token's chain uses its own noise: x_K and eps_K ... eps_1, x_{i-1} = mu + sigma eps_i.

Ratios (`ratio`):
* "paper" (the CSpD paper's criterion p(Y_p)/q(Y_q), as the authors' code evaluates it, `DistributionProcessor`
  in their spec_decode_runner.py): the target runs its OWN chain Y_p, the draft its own Y_q, from the same x_K
  with the same eps_i (alignment). With shared noise each stochastic step's exponent -eps^2/2 is the same on both
  chains, so only per-step normalisers and the last step are left. The chain ends with a deterministic step,
  scored by a last-step Gaussian of width T sigma_f (`inner_temperature` T, 42 in the authors' code) centred on
  each model's end point and evaluated at the drafted token x^q_0 (where the draft's own Gaussian is 1):
      log r = N - |x^q_0 - x^p_0|^2 / (2 T^2 sigma_f^2),
  with the normaliser term N (`normaliser`):
      "authors":    N = sum_i sum_d log(sigma^p_{i,d} / sigma^q_{i,d})  (their `fixed_term`, prod sigma_p / sigma_q)
      "derivation": N = sum_i sum_d log(sigma^q_{i,d} / sigma^p_{i,d})  (the densities' own normalisers, 1/sigma)
  over the stochastic steps. The authors' sign is the reciprocal of what the densities give; it is their code.
  Approximation, stated: r compares densities of two different trajectories, not one trajectory under two
  models, so accepting with min(1, r) does not make the output the target's distribution; the last-step
  density is a Gaussian of chosen width, not the model's (deterministic) last step. Without alignment
  (independent noise) the exponents do not cancel: the estimator drops them all the same (as the authors'
  code does). The accepted token is the draft's.
* "exact": the target's transitions evaluated on the draft's own stochastic states (x_K cancels): with
  density temperature 1 this is speculative sampling on the stochastic part of the trajectory, hence
  exact; the accepted token is the target's deterministic tail run from the draft's last stochastic state.

Residuals (a rejected token is redrawn):
* `gaussian_residual` (ratio "paper", the paper's way): from norm(max(0, c P - Q)), P and Q the two
  models' end-of-chain Gaussians N(x^p_0, sigma_f^2) and N(x^q_0, sigma_f^2), c = exp(N) (the authors': their
  `subtracted_distribution_unormalize`, 1 - Q / (fixed_term P)),
  by acceptance-rejection against the bound c P (proposals from P, around the target's aligned token;
  accept with max(0, 1 - Q / (c P))): no denoiser call. The inner temperature widens only the acceptance
  test, not the residual, as in the authors' code.
* `residual_sample` (exact ratio): from norm(max(0, p - q)) over trajectories, proposals are fresh target
  chains, accepted with max(0, 1 - q(tau)/p(tau)).
Both stop after `max_proposals`; the fallback (the target's aligned token, or the last proposal) is counted.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

# step_fn(x_i (N, d), i) -> (mean (N, d), var (N, d)) of p(x_{i-1} | x_i), i = K-1 ... 0
StepFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
RATIOS = ("paper", "exact")
NORMALISERS = ("authors", "derivation")
FALLBACKS = ("target", "zero")


@dataclasses.dataclass
class Trajectory:
    states: list[torch.Tensor]  # x_K, ..., x_0 (K + 1 tensors (N, d))
    means: list[torch.Tensor]  # mu(x_i) for i = K-1 ... 0
    vars: list[torch.Tensor]

    @property
    def sample(self) -> torch.Tensor:
        return self.states[-1]

    @staticmethod
    def cat(chains: list["Trajectory"]) -> "Trajectory":
        """The chains of several token sets stacked into one (rows in the given order)."""
        join = lambda lists: [torch.cat(parts) for parts in zip(*lists)]
        return Trajectory(join([c.states for c in chains]), join([c.means for c in chains]),
                          join([c.vars for c in chains]))

    def rows(self, keep: torch.Tensor) -> "Trajectory":
        return Trajectory([s[keep] for s in self.states], [m[keep] for m in self.means], [v[keep] for v in self.vars])

    def stochastic_steps(self) -> int:
        """Number of leading steps with noise; the steps after them are all deterministic (var = 0)."""
        k = len(self.vars)
        while k > 0 and float(self.vars[k - 1].max()) == 0:
            k -= 1
        return k


def tempered(step: StepFn, temperature: float) -> StepFn:
    """The chain actually sampled at noise temperature t: variances scaled by t^2 (densities follow)."""
    if temperature == 1.0:
        return step
    warm = lambda x, i: (lambda m, v: (m, v * temperature ** 2))(*step(x, i))
    warm.batched = getattr(step, "batched", False)
    return warm


def run_chain(step: StepFn, x_init: torch.Tensor, noises: list[torch.Tensor], top: int | None = None) -> Trajectory:
    """Sample a chain from x_init with injected per-step noise (one (N, d) tensor per step).

    The first step has index `top` (default len(noises) - 1: a whole chain), the last index top - len + 1."""
    top = len(noises) - 1 if top is None else top
    states, means, vars_ = [x_init], [], []
    x = x_init
    for k, eps in enumerate(noises):
        mean, var = step(x, top - k)
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


def evaluate_on(step: StepFn, states: list[torch.Tensor], max_rows: int = 4096, top: int | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Another head's transition means/variances evaluated on given states (states[k] at step top - k).

    The states are known, so the steps do not depend on each other: a step function marked `batched`
    (it takes a tensor of per-row step indices) evaluates the whole chain in as few calls as
    `max_rows` allows, instead of one call per step."""
    K = len(states) - 1
    top = K - 1 if top is None else top
    if not getattr(step, "batched", False) or K == 0:
        out = [step(states[k], top - k) for k in range(K)]
        return [m for m, _ in out], [v for _, v in out]
    N = states[0].shape[0]
    per_call = max(1, max_rows // max(N, 1))
    means, vars_ = [], []
    for lo in range(0, K, per_call):
        ks = range(lo, min(K, lo + per_call))
        x = torch.cat([states[k] for k in ks])  # (len(ks) * N, d)
        i = torch.cat([torch.full((N,), top - k, dtype=torch.long) for k in ks])
        m, v = step(x, i)
        means += list(m.split(N))
        vars_ += list(v.split(N))
    return means, vars_


def log_sigma_ratio(draft: Trajectory, own: Trajectory) -> torch.Tensor:
    """sum over the stochastic steps and dims of log sigma^p - log sigma^q, each model on its own chain (N,): the
    log of the authors' `fixed_term`; steps where either model is deterministic are left out."""
    out = torch.zeros(draft.sample.shape[0], device=draft.sample.device)
    for vq, vp in zip(draft.vars, own.vars):
        live = (vq > 0) & (vp > 0)
        one = torch.ones_like(vq)
        out = out + 0.5 * (torch.where(live, vp, one).log() - torch.where(live, vq, one).log()).sum(-1)
    return out


def normaliser_log_ratio(draft: Trajectory, own: Trajectory, normaliser: str = "authors") -> torch.Tensor:
    """The paper ratio's normaliser term N (module docstring) of each drafted token (N,)."""
    if normaliser not in NORMALISERS:
        raise ValueError(f"unknown normaliser {normaliser!r}: expected one of {NORMALISERS}")
    n = log_sigma_ratio(draft, own)
    return n if normaliser == "authors" else -n


def paper_log_ratio(draft: Trajectory, own: Trajectory, final_std: float, inner_temperature: float,
                    normaliser: str = "authors") -> torch.Tensor:
    """The paper's log p(Y_p)/q(Y_q) (module docstring): the normaliser term plus the last-step Gaussian (N,)."""
    gap = ((draft.sample - own.sample) / (inner_temperature * final_std)).pow(2).sum(-1)
    return normaliser_log_ratio(draft, own, normaliser) - 0.5 * gap


def exact_log_ratio(draft: Trajectory, target_step: StepFn) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(tau)/q(tau) over the stochastic steps (N,), the target's tail from the draft's last stochastic state)."""
    K, k0 = len(draft.means), draft.stochastic_steps()
    logq = chain_logprob(draft.states[:k0 + 1], draft.means[:k0], draft.vars[:k0])
    means, vars_ = evaluate_on(target_step, draft.states[:k0 + 1], top=K - 1)
    logp = chain_logprob(draft.states[:k0 + 1], means, vars_)
    x = draft.states[k0]
    tail = run_chain(target_step, x, [torch.zeros_like(x)] * (K - k0), top=K - 1 - k0)  # deterministic: no noise
    return logp - logq, tail.sample


def accept(logr: torch.Tensor, u: torch.Tensor, density_temperature: float = 1.0) -> torch.Tensor:
    """Accept where u < min(1, exp(logr / T)); T > 1 raises acceptance at the cost of exactness."""
    return torch.log(u.clamp_min(1e-30)) < (logr / density_temperature).clamp_max(0.0)


def gaussian_residual(mu_p: torch.Tensor, mu_q: torch.Tensor, std, log_c: torch.Tensor, rand, randn,
                      max_proposals: int = 100, fallback: str = "target"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw from norm(max(0, c N(mu_p, std^2) - N(mu_q, std^2))) by acceptance-rejection with proposals
    from N(mu_p, std^2) (bound c P), accepted with max(0, 1 - Q / (c P)). `rand`/`randn` map a shape to a
    tensor (one stream per row). Returns (tokens (N, d), proposals used (N,), fell back (N,) bool); a row
    that accepts none of `max_proposals` gets mu_p, the target's aligned token (`fallback="target"`), or zeros
    (`"zero"`: what the authors' sampler leaves there after its 100 tries)."""
    if fallback not in FALLBACKS:
        raise ValueError(f"unknown residual fallback {fallback!r}: expected one of {FALLBACKS}")
    N = mu_p.shape[0]
    out = mu_p.clone() if fallback == "target" else torch.zeros_like(mu_p)
    used = torch.zeros(N, dtype=torch.long, device=mu_p.device)
    done = torch.zeros(N, dtype=torch.bool, device=mu_p.device)
    for _ in range(max_proposals):
        x = mu_p + std * randn(tuple(mu_p.shape))
        log_q_over_p = (((x - mu_p) ** 2 - (x - mu_q) ** 2) / (2 * std ** 2)).sum(-1)  # log Q(x) - log P(x)
        ok = (rand((N,)) < (1 - torch.exp(log_q_over_p - log_c)).clamp_min(0)) & ~done
        out[ok] = x[ok]
        used += (~done).long()
        done |= ok
        if bool(done.all()):
            break
    return out, used, ~done


def residual_sample(target_step: StepFn, draft_step: StepFn, shape: tuple[int, int], steps: int,
                    rng: torch.Generator | None = None, max_proposals: int = 16, device="cpu",
                    rand=None, randn=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw from norm(max(0, p - q)) over trajectories by acceptance-rejection with fresh target chains.

    `rand`/`randn` (shape -> tensor) replace `rng` when each row needs its own stream.
    Returns (tokens (N, d), proposals used (N,), fell back (N,) bool)."""
    N, d = shape
    rand = rand or (lambda sh: torch.rand(sh, generator=rng, device=device))
    randn = randn or (lambda sh: torch.randn(sh, generator=rng, device=device))
    out = torch.zeros(shape, device=device)
    used = torch.zeros(N, dtype=torch.long, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    for _ in range(max_proposals):
        x_init = randn(shape)
        noises = [randn(shape) for _ in range(steps)]
        prop = run_chain(target_step, x_init, noises)
        k0 = prop.stochastic_steps()  # deterministic steps carry no density
        logp = chain_logprob(prop.states[:k0 + 1], prop.means[:k0], prop.vars[:k0])
        qm, qv = evaluate_on(draft_step, prop.states[:k0 + 1], top=steps - 1)
        logq = chain_logprob(prop.states[:k0 + 1], qm, qv)
        u = rand((N,))
        ok = (u < (1 - torch.exp(logq - logp)).clamp_min(0)) & ~done
        out[ok] = prop.sample[ok]
        used += (~done).long()
        done |= ok
        out[~done] = prop.sample[~done]  # fallback value if nothing is accepted in the end
        if bool(done.all()):
            break
    return out, used, ~done
