"""Shared sampling utilities: guidance, temperature/top-k warping, per-row reproducible draws."""
from __future__ import annotations

import torch


def guide(logits: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Classifier-free guidance on stacked [cond; uncond] logits (2B, ..., V) -> (B, ..., V)."""
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + cfg_scale * (cond - uncond)


def guided_logits(backbone, hidden: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Guided visual-code logits from stacked [cond; uncond] pre-norm states (2B, ..., D) -> (B, ..., num_visual):
    the backbone's `guided_visual_logits` where it has one (a linear head: the rows are mixed before the projection,
    half of it), else `guide` on its `visual_logits`."""
    fast = getattr(backbone, "guided_visual_logits", None)
    return fast(hidden, cfg_scale) if fast is not None else guide(backbone.visual_logits(hidden), cfg_scale)


def warp(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """Temperature and top-k on (..., V) logits; temperature 0 means greedy (returned unchanged)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature > 0 and temperature != 1.0:  # x / 1 is x: no op to dispatch
        logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def probs(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """The sampling distribution of `sample` (one-hot at the argmax when temperature is 0)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(warp(logits, temperature, top_k), dim=-1)


def uniform(shape: tuple[int, ...], rngs: list[torch.Generator] | None, device) -> torch.Tensor:
    """Uniform noise (B, ...) whose row b depends only on rngs[b]. An AR image therefore does not depend
    on its batch; decoders that run a batch in lockstep (the speculative ones) draw from every row's stream at
    every pass of the batch, so their images (not their distributions) can depend on the batch's slowest image."""
    if rngs is None:
        return torch.rand(shape, device=device)
    if len(rngs) != shape[0]:
        raise ValueError(f"need one RNG per row: {shape[0]} rows, {len(rngs)} rngs")
    if len(rngs) == 1:  # the same draws as the stack below in one op (batch 1 draws every drafted token)
        return torch.rand(shape, generator=rngs[0], device=device)
    return torch.stack([torch.rand(shape[1:], generator=g, device=device) for g in rngs])


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
           rngs: list[torch.Generator] | None = None) -> torch.Tensor:
    """Draw token ids from (B, ..., V) logits by the Gumbel-max trick (argmax when temperature is 0)."""
    if temperature == 0:
        return logits.argmax(-1)
    warped = warp(logits, temperature, top_k)
    u = uniform(tuple(warped.shape), rngs, warped.device).clamp_(1e-20, 1.0 - 1e-7)
    return (warped - torch.log(-torch.log(u))).argmax(-1)


def make_rngs(seeds: list[int], device="cpu") -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def sample_probs(p: torch.Tensor, rngs: list[torch.Generator] | None = None) -> torch.Tensor:
    """Draw ids from probabilities (B, ..., V) by inverse CDF (exact argmax for one-hot rows)."""
    return inverse_cdf(p, uniform(tuple(p.shape[:-1]) + (1,), rngs, p.device))


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Ids from probabilities (..., V) at uniform draws u (...,) in [0, 1): `sample_probs` with its draws given (a
    decoder drawing one token per step can draw the uniforms of all its steps at once: per generator, n draws at once
    are the n draws one at a time). `u` may also be (..., 1): the same draws, one op fewer."""
    cdf = p.cumsum(-1)
    x = u * cdf[..., -1:] if u.dim() == p.dim() else (u * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(p.shape[-1] - 1)


def accept_or_resample(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                       rngs: list[torch.Generator] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling at every position: keep token t ~ q with prob min(1, p(t)/q(t)), else
    redraw from the residual norm(max(0, p - q)). tokens (B, N), p/q (B, N, V) -> (tokens, accepted)."""
    at = tokens.unsqueeze(-1)
    return _keep_or_residual(tokens, p.gather(-1, at).squeeze(-1), p, q, rngs, at)


def accept_or_resample_drawn(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, u_keep: torch.Tensor,
                             u_redraw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_or_resample` with its draws given: u_keep (B, N) for the tests, u_redraw (B, N, 1) for the residual
    draws, as `accept_or_resample` draws them from a row's generator (first the N tests, then the N redraws). So
    tokens of several images, each with its own generator, are judged in one call with each image's own draws."""
    at = tokens.unsqueeze(-1)
    return _keep_or_residual(tokens, p.gather(-1, at).squeeze(-1), p, q, None, at, (u_keep, u_redraw))


def _keep_or_residual(tokens: torch.Tensor, pt: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                      rngs: list[torch.Generator] | None, at: torch.Tensor | None = None,
                      draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each token with prob min(1, pt/q(t)) (pt: the target's mass for it), else redraw from norm(max(0, p - q));
    `at`: the tokens as (..., 1) gather indices, where the caller has them; `draws`: the tests' and the redraws'
    uniforms given (`accept_or_resample_drawn`) instead of drawn from `rngs`."""
    qt = q.gather(-1, tokens.unsqueeze(-1) if at is None else at).squeeze(-1)
    u = uniform(tuple(tokens.shape), rngs, tokens.device) if draws is None else draws[0]
    accepted = u * qt < pt  # u < pt/q without dividing
    resid = (p - q).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    # p == q: rejection had prob 0 (where mass is 0 the quotient is never selected: no clamp needed)
    resid = torch.where(mass > 1e-9, resid / mass, p)
    redrawn = sample_probs(resid, rngs) if draws is None else inverse_cdf(resid, draws[1])
    return torch.where(accepted, tokens, redrawn), accepted


def typical_accept(tokens: torch.Tensor, p: torch.Tensor, epsilon: float, delta: float,
                   rngs: list[torch.Generator] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Typical acceptance (Medusa, Cai et al. 2024) at every position: keep token t when the target finds it
    plausible, p(t) > min(epsilon, delta * exp(-H(p))), else redraw from p. Not lossless: every plausible token is
    kept whatever distribution proposed it (under greedy decoding, p one-hot, it keeps exactly the argmax).
    tokens (B, N), p (B, N, V) -> (tokens, accepted)."""
    pt = p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)
    accepted = pt > torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    return torch.where(accepted, tokens, sample_probs(p, rngs)), accepted


def code_neighbours(embeddings: torch.Tensor, k: int) -> torch.Tensor:
    """Each code's k nearest other codes in the tokenizer's latent space, nearest first: (V, D) code embeddings ->
    (V, k) ids (Euclidean distance; for a cosine codebook of unit vectors the same order as cosine similarity)."""
    V = embeddings.shape[0]
    if not 1 <= k < V:
        raise ValueError(f"k={k} neighbours: a code has {V - 1} other codes; use 1 <= k <= {V - 1} (acceptance Latent)")
    e = embeddings.detach().float()
    out = []
    for start in range(0, V, 1024):  # blocks of rows: Emu3's 32k codes would need a 4 GB distance matrix at once
        dist = torch.cdist(e[start:start + 1024], e)
        rows = torch.arange(dist.shape[0], device=dist.device)
        dist[rows, rows + start] = float("inf")  # a code is not its own neighbour
        out.append(dist.topk(k, dim=-1, largest=False).indices)
    return torch.cat(out)


def relaxed_accept(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, neighbours: torch.Tensor, delta: float,
                   rngs: list[torch.Generator] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LANTERN's relaxed speculative test (Jang et al. 2025): keep token t ~ q with prob min(1, p~(t)/q(t)), where
    p~(t) adds to p(t) the mass p gives t's nearest codes in latent space (nearest first, as many as keep the added
    mass <= delta: moving that mass onto t changes p by at most delta in total variation); else redraw from the
    residual norm(max(0, p - q)). Not lossless (delta 0: `accept_or_resample` exactly; under greedy decoding, p
    one-hot, it keeps exactly the argmax for delta < 1). tokens (B, N), p/q (B, N, V), neighbours (V, k) ->
    (tokens, accepted)."""
    near = p.gather(-1, neighbours[tokens])  # (B, N, k) p of each token's neighbours, nearest first
    added = near.cumsum(-1)
    added = torch.where(added <= delta, added, torch.zeros_like(added)).amax(-1)  # the longest prefix within delta
    return _keep_or_residual(tokens, p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) + added, p, q, rngs)
