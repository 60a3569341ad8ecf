"""What decoding algorithms may see of a continuous-token backbone (MAR, xAR, Harmon, the embedded MAR).

A continuous model generates an image of L tokens (each a vector of d numbers) in `num_iter` generation
steps. Each step runs the backbone's transformer once on the tokens known so far and yields a condition
vector for every token position; a per-token head then samples each new token by a chain of K Gaussian
transitions x_K -> ... -> x_0, x_K ~ N(0, I):

    p(x_{i-1} | x_i, z) = N(mean(x_i, i, z), diag(var(x_i, i, z))),    i = K-1, ..., 0,

with guidance (the conditional and unconditional conditions of a token, and a scale) applied inside the
backbone, because only it knows which output guidance acts on (MAR's epsilon, xAR's velocity). A transition
with var = 0 is deterministic (DDPM's last step, a DDIM or ODE tail). Which tokens a step fills is the
backbone's plan: a random order per image with MAR's cosine schedule (MAR, Harmon), or next-X units in
raster order (xAR).

Speculative decoding (CSpD) needs exactly this: the draft and target heads' transitions on shared noise,
a transformer call for many known sets at once (verification), and the plan; the target-only sampler needs
the same pieces. Nothing here says how the model is built.
"""
from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ContinuousBackbone(Protocol):
    """A frozen continuous-token image model with a per-token Gaussian reverse process.

    `conditioning(prompts, guided)` is opaque to decoders: they pass it back to `step_conditions`, naming
    with `image` which of its images each row of tokens belongs to (so one call can score several known
    sets of the same images). Per-token conditions are tensors (rows, L, D) that decoders only index,
    concatenate and hand to `transition`.
    """

    seq_len: int    # L tokens per image
    token_dim: int  # d numbers per token
    num_steps: int  # K Gaussian transitions per token

    @property
    def device(self) -> torch.device: ...

    def prompts(self, prompts: list[str]) -> list: ...  # validated prompts, as the runner passes them

    def conditioning(self, prompts: list, guided: bool) -> Any: ...  # both branches when guided

    def plan(self, rngs: list[torch.Generator], num_iter: int) -> tuple[torch.Tensor, list[int]]:
        """(rank (B, L): each token's place in its image's generation order, tokens known after each step)."""

    def step_conditions(self, tokens: torch.Tensor, unknown: torch.Tensor, conditioning: Any,
                        image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens (N, L, d), unknown (N, L) (1 = not known), row -> image (N,) or None (row b is image b)
        -> per-token conditions (N, L, D), conditional and unconditional (None without guidance)."""

    def transition(self, x: torch.Tensor, i: int | torch.Tensor, z_cond: torch.Tensor,
                   z_uncond: torch.Tensor | None, scale: float | torch.Tensor, tail: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Guided p(x_{i-1} | x_i): x (N, d), step i (one int, or (N,) per row), conditions (N, D), scale (one,
        or (N,)) -> (mean, var), both (N, d). Steps 1..`tail` are made deterministic (var 0)."""

    def final_std(self) -> float: ...  # the width of a last-step Gaussian, for CSpD's paper ratio

    def check_draft(self, draft: "ContinuousBackbone") -> None: ...  # raises if draft tokens differ

    def decode(self, tokens: torch.Tensor) -> torch.Tensor: ...  # (B, L, d) -> (B, 3, S, S) in [0, 1]


def cosine_schedule(seq_len: int, num_iter: int) -> list[int]:
    """Tokens known after each of the num_iter steps (MAR's cosine schedule, at least one per step)."""
    if not 1 <= num_iter <= seq_len:
        raise ValueError(f"num_iter={num_iter} MAR steps for {seq_len} tokens: every step must sample at least one "
                         f"token, so set num_iter between 1 and {seq_len} ({seq_len}: one token per step)")
    known, out = 0, []
    for step in range(num_iter):
        masked = math.floor(seq_len * math.cos(math.pi / 2 * (step + 1) / num_iter))
        masked = max(0, min(seq_len - known - 1, masked)) if step < num_iter - 1 else 0
        known = seq_len - masked
        out.append(known)
    return out


def random_ranks(rngs: list[torch.Generator], seq_len: int, device) -> torch.Tensor:
    """(B, L): each token's rank in a random generation order per image, drawn from the image's generator."""
    order = torch.stack([torch.randperm(seq_len, generator=g, device=device) for g in rngs])  # (B, L)
    return torch.empty_like(order).scatter_(1, order, torch.arange(seq_len, device=device).expand(len(rngs), -1))


def check_pair(target: ContinuousBackbone, draft: ContinuousBackbone) -> None:
    """A draft must fill the target's tokens with chains of the same length (noise is shared step by step)."""
    target.check_draft(draft)
    if draft.num_steps != target.num_steps:
        raise ValueError(f"the draft's head takes {draft.num_steps} steps per token, the target's "
                         f"{target.num_steps}: give both the same sample_steps (CSpD compares their chains step "
                         f"by step)")


def class_ids(prompts: list, num_classes: int) -> list[int]:
    """Class-conditional prompts: ints, or strings of an int ("207"), each in [0, num_classes)."""
    out = []
    for p in prompts:
        try:
            c = int(p)
        except (TypeError, ValueError):
            raise ValueError(f"prompt {p!r} is not a class id: a class-conditional model takes class ids in "
                             f"[0, {num_classes}) (ImageNet: 0-999), e.g. '207'") from None
        if not 0 <= c < num_classes or str(c) != str(p).strip():
            raise ValueError(f"class id {p!r} is not an integer in [0, {num_classes})")
        out.append(c)
    return out


def attach_decoder(model, tokenizer, fix: str):
    """Attach the latent decoder that `model.decode` uses (kept out of the state dict: it is a separate export),
    after checking that its latent grid and channels are the model's; `fix` tells the user what to give instead."""
    if tokenizer.z_dim != model.latent_dim or tokenizer.grid_size != model.latent_grid:
        raise ValueError(f"tokenizer gives {tokenizer.grid_size}x{tokenizer.grid_size} latents of dim "
                         f"{tokenizer.z_dim}, {type(model).__name__} makes {model.latent_grid}x{model.latent_grid} of "
                         f"dim {model.latent_dim}: {fix}")
    model.__dict__["tokenizer"] = tokenizer
    return model
