"""Does a MAR-style backbone use its context? Share of a masked token's latent variance that its
denoiser explains, as a function of how many other tokens of the image it is shown.

For rendered validation scenes (exact latents from the KL tokenizer), a random share of the tokens is
made known; each masked token is noised to x_t at a few diffusion timesteps, and the denoiser's
x0-estimate, (x_t - sqrt(1 - a_t) eps) / sqrt(a_t), is compared with the true latent. Reported per
timestep: 1 - MSE / Var over masked foreground tokens (those far from the image's background latent),
for the prompt and for the null condition. A model that uses its context explains more as more tokens
are known; equal rows mean the context is ignored. For scale, `neighbours` is a context-only estimate with
no model: the mean of a masked token's known 4-neighbours (the background latent when it has none).

    python -m specgen.analysis.context_probe --backbone checkpoints/mar_p2_shapes \
        --tokenizer checkpoints/kl_shapes --out logs/context_probe/mar_p2.json [--losses]

`--losses` adds the training loss by timestep with every token masked (`timestep_losses`).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

from specgen.utils.checkpoints import atomic_write_text, load_exported
from specgen.world.prompts import sample_example
from specgen.world.render import render


def scenes(backbone, tokenizer, num_images: int, seed: int):
    """Validation scenes of the shapes world: their model tokens (B, L, d), the prompt and null conditions."""
    rng = random.Random(seed)
    examples = [sample_example(rng, "val") for _ in range(num_images)]
    images = torch.tensor(np.stack([render(s) for _, s in examples])).permute(0, 3, 1, 2).float() / 255
    conds = {"prompt": backbone.condition([m["prompt"] for m, _ in examples]),
             "null": backbone.null_condition(num_images)}
    return backbone.patchify(tokenizer.encode(images)), conds


@torch.no_grad()
def probe(backbone, tokenizer, num_images: int = 64, known: tuple[float, ...] = (0.0, 0.5, 0.9),
          timesteps: tuple[int, ...] = (500, 750, 900, 975), seed: int = 0) -> dict[str, float]:
    x0, conds = scenes(backbone, tokenizer, num_images, seed)
    B, L, d = x0.shape
    background = x0.median(dim=1, keepdim=True).values
    foreground = (x0 - background).norm(dim=-1) > 0.3 * d ** 0.5
    diff = backbone.diffusion
    g = torch.Generator().manual_seed(seed)
    order = torch.argsort(torch.rand(B, L, generator=g), dim=1)
    noise = torch.randn(B * L, d, generator=g)
    out = {"foreground_share": float(foreground.float().mean())}
    for share in known:
        n = int(L * share)
        mask = torch.ones(B, L).scatter(1, order[:, :n], 0.0)  # the first n of each order are known
        sel = (mask > 0.5).reshape(-1) & foreground.reshape(-1)
        x = x0.reshape(B * L, d)[sel]
        var = float(((x - x.mean(0)) ** 2).mean())
        est = neighbour_mean(x0, mask, background).reshape(B * L, d)[sel]
        out[f"neighbours/known{share:g}"] = 1 - float(((est - x) ** 2).mean()) / var
        for cond_name, cond in conds.items():
            z = backbone.conditions(x0, mask, cond, n).reshape(B * L, -1)[sel]
            for t in timesteps:
                a = diff.alphas_cumprod[t].float()
                tt = torch.full((x.shape[0],), t)
                x_t = diff.q_sample(x, tt, noise[sel])
                x0_hat = (x_t - (1 - a).sqrt() * backbone.denoise(x_t, tt, z)[:, :d]) / a.sqrt()
                out[f"{cond_name}/known{share:g}/t{t}"] = 1 - float(((x0_hat - x) ** 2).mean()) / var
    return out


@torch.no_grad()
def timestep_losses(backbone, tokenizer, num_images: int = 64,
                    timesteps: tuple[int, ...] = (0, 50, 150, 300, 500, 700, 850, 950), seed: int = 0) -> dict[str, float]:
    """The training loss by timestep, every token masked: epsilon MSE (what MAR's loss averages over uniform t)
    and the x0 MSE it implies (epsilon MSE / SNR_t), for the prompt and the null condition. Shows which
    timesteps dominate the unweighted loss (the clean ones) and how little the noisy ones count."""
    x0, conds = scenes(backbone, tokenizer, num_images, seed)
    B, L, d = x0.shape
    x = x0.reshape(B * L, d)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(timesteps), B * L, d, generator=g)
    snrs = backbone.diffusion.snr(torch.tensor(timesteps)).tolist()
    out = {f"snr/t{t}": snr for t, snr in zip(timesteps, snrs)}
    for cond_name, cond in conds.items():
        z = backbone.conditions(x0, torch.ones(B, L), cond, 0).reshape(B * L, -1)
        for j, (t, snr) in enumerate(zip(timesteps, snrs)):
            tt = torch.full((B * L,), t)
            eps = backbone.denoise(backbone.diffusion.q_sample(x, tt, noise[j]), tt, z)[:, :d]
            mse = float(((eps - noise[j]) ** 2).mean())
            out[f"{cond_name}/t{t}/eps_mse"] = mse
            out[f"{cond_name}/t{t}/x0_mse"] = mse / snr
    return out


def neighbour_mean(x0: torch.Tensor, mask: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """(B, L, d): per token, the mean of its known 4-neighbours on the token grid, else the background."""
    B, L, d = x0.shape
    g = int(round(L ** 0.5))
    known = (mask < 0.5).float().reshape(B, 1, g, g)
    grid = x0.transpose(1, 2).reshape(B, d, g, g) * known
    kernel = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])[None, None]
    total = torch.nn.functional.conv2d(grid.reshape(B * d, 1, g, g), kernel, padding=1).reshape(B, d, g, g)
    count = torch.nn.functional.conv2d(known, kernel, padding=1)
    est = (total / count.clamp(min=1)).flatten(2).transpose(1, 2)
    return torch.where((count.flatten(2).transpose(1, 2) > 0), est, background.expand(B, L, d))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", required=True, help="exported MAR-style backbone folder")
    p.add_argument("--tokenizer", required=True, help="its KL tokenizer folder (e.g. checkpoints/kl_shapes)")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--losses", action="store_true", help="also the loss by timestep (epsilon and x0 MSE)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    backbone = load_exported(args.backbone).eval()
    tokenizer = load_exported(args.tokenizer).eval()
    res = probe(backbone, tokenizer, args.images)
    if args.losses:
        res["losses"] = timestep_losses(backbone, tokenizer, args.images)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(res, indent=1))
    model_keys = [k for k in res if k != "losses" and k.count("/") == 2]
    steps = sorted({k.rsplit("/", 1)[1] for k in model_keys}, key=lambda s: int(s[1:]))
    print(f"explained share of masked foreground latent variance ({res['foreground_share']:.2f} of tokens foreground)")
    print(f"{'condition':<11}{'known':>6}" + "".join(f"{s:>9}" for s in steps))
    for key in sorted({k.rsplit("/", 1)[0] for k in model_keys}):
        cond, known = key.split("/")
        print(f"{cond:<11}{known[5:]:>6}" + "".join(f"{res[f'{key}/{s}']:>9.3f}" for s in steps))
    for key in sorted(k for k in res if k.startswith("neighbours/")):
        print(f"{'neighbours':<11}{key.split('/')[1][5:]:>6}{res[key]:>9.3f}  (no model, any t)")
    if args.losses:
        losses = res["losses"]
        ts = sorted({k.split("/")[1] for k in losses if k.startswith("snr/")}, key=lambda s: int(s[1:]))
        print("\nloss by timestep, every token masked (x0 MSE = epsilon MSE / SNR)")
        print(f"{'':<18}" + "".join(f"{t:>9}" for t in ts))
        print(f"{'SNR':<18}" + "".join(f"{losses[f'snr/{t}']:>9.3g}" for t in ts))
        for cond in ("prompt", "null"):
            for kind in ("eps_mse", "x0_mse"):
                print(f"{cond + ' ' + kind:<18}" + "".join(f"{losses[f'{cond}/{t}/{kind}']:>9.4f}" for t in ts))
    return res


if __name__ == "__main__":
    main()
