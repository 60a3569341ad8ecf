"""Do a decoder's samples come from the target's distribution? The target's own log-probability of each sampled
token, teacher-forced, compared with AR's on the same prompts.

For any sampler whose images follow the target's (guided, warped) distribution P, the mean negative log-probability
per token, E_{x ~ sampler}[-log P(x_t | x_<t)], equals AR's: both are P's entropy rate. A lossless decoder must match
it within noise; a shift says the sampler over- or under-represents some tokens, and its breakdown by row and by
column says where. It is far more sensitive than FID on a few hundred images: every token of
every image is a sample.

    python -m specgen.analysis.sample_nll --backbone checkpoints/ar_shapes --tokenizer checkpoints/vq_shapes \\
        --drafter checkpoints/fphi_accept --prompts 512 --out logs/sample_nll [--strategy ssd --variant ...]

A sharper form of the same check needs no reference: for a token drawn from p given its prefix, -log p(token) has
mean H(p), so the excess -log p(token) - H(p) has mean zero token by token, whatever the prefix (a martingale
difference). Its mean over a sampler's tokens tests each token's conditional law, with the prompt-to-prompt spread
of the entropy removed: negative means too-likely tokens were kept (a draft's mode over-represented), positive
too-unlikely ones.

-> <out>/sample_nll.json: per strategy, mean NLL per token (95% interval over images), its paired difference from
AR's, the excess over the entropy (95%), the share of tokens the target gave p < 0.01, the excess per row and per
column; sample_nll.png (the excess by row and column).
Images are decoded in batches (`--batch-size`, as the quality runs decode) with one random stream per image.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from specgen.analysis.row_passes import add_world_args, decoder, decoding_options, load_world
from specgen.decoding import ar
from specgen.decoding.sampling import make_rngs
from specgen.decoding.state import SpecState
from specgen.utils.checkpoints import atomic_write_text
from specgen.utils.plots import pyplot, save
from specgen.utils.stats import mean_ci95


@torch.no_grad()
def token_logprobs(backbone, prompts, codes: torch.Tensor, cfg_scale: float, temperature: float = 1.0,
                   top_k: int | None = None) -> torch.Tensor:
    """(B, H, W) visual codes -> (2, B, H, W): the log-probability of each code under the target's sampling
    distribution given the codes before it (guided, warped as the decoders sample), and that distribution's entropy,
    in one teacher-forced pass."""
    st = SpecState(backbone, prompts, cfg_scale, temperature, top_k, None)
    g = st.g
    st.target_pass(g.prefix_len)
    pos = st.visual_positions()
    st.set_tokens(pos, codes.flatten(1))
    st.target_pass(int(pos[-1]))  # the last token is conditioned on, never fed
    p = st.dist(st.hid[:, pos - 1])  # (B, H*W, V)
    logp = p.gather(-1, codes.flatten(1)[..., None]).squeeze(-1).clamp_min(1e-30).log().view_as(codes.float())
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).view_as(logp)
    return torch.stack([logp, entropy])


@torch.no_grad()
def sample_logprobs(backbone, drafter, prompts: list[str], cfg_scale: float, seed: int, options: dict | None,
                    batch_size: int) -> torch.Tensor:
    """Decode every prompt (AR when `options` is None, else the SSD decoder of those options) and score the samples:
    (2, N, H, W) log-probabilities and entropies."""
    out = []
    for i in range(0, len(prompts), batch_size):
        texts = prompts[i:i + batch_size]
        rngs = make_rngs([seed + i + k for k in range(len(texts))])
        pr = backbone.prompts(texts)
        if options is None:
            codes, _ = ar.generate(backbone, pr, cfg_scale=cfg_scale, rngs=rngs)
        else:
            fn, kwargs = decoder(options)
            codes, _ = fn(backbone, pr, drafter, cfg_scale=cfg_scale, rngs=rngs, **kwargs)
        out.append(token_logprobs(backbone, pr, codes, cfg_scale))
        print(f"  {i + len(texts)}/{len(prompts)} images", flush=True)
    return torch.cat(out, 1)


def summarise(scores: np.ndarray, reference: np.ndarray | None) -> dict:
    """(2, N, H, W) log-probabilities and entropies -> per image means over tokens, summarised: NLL per token and
    its excess over the entropy (each with a 95% interval over images), the low-probability share, the excess per
    row and column; with a reference (AR on the same prompts), the NLL difference with a paired 95% interval."""
    logp, entropy = scores
    n = len(logp)
    excess_tok = -logp - entropy  # (N, H, W): zero mean for every token drawn from the target given its prefix
    nll, excess = -logp.reshape(n, -1).mean(1), excess_tok.reshape(n, -1).mean(1)
    out = {"images": n, "nll": float(nll.mean()), "nll_ci95": float(mean_ci95(nll)),
           "excess": float(excess.mean()), "excess_ci95": float(mean_ci95(excess)),
           "low_p_share": float((logp < np.log(0.01)).mean()),
           "excess_per_row": excess_tok.mean((0, 2)).tolist(), "excess_per_row_ci95": mean_ci95(
               excess_tok.mean(2), axis=0).tolist(),
           "excess_per_col": excess_tok.mean((0, 1)).tolist(), "excess_per_col_ci95": mean_ci95(
               excess_tok.mean(1), axis=0).tolist()}
    if reference is not None:
        diff = nll + reference[0].reshape(n, -1).mean(1)  # paired by prompt: the same prompts in the same order
        out["nll_minus_ar"] = float(diff.mean())
        out["nll_minus_ar_ci95"] = float(mean_ci95(diff))
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in result.items():
        for ax, key in ((a, "excess_per_row"), (b, "excess_per_col")):
            ax.errorbar(np.arange(len(r[key])), r[key], yerr=r[key + "_ci95"], marker="o", ms=3, capsize=2,
                        label=name)
    a.set_xlabel("row")
    b.set_xlabel("column")
    for ax in (a, b):
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_ylabel("-log p(token) - H(p), mean per token")
        ax.legend(fontsize=8)
    a.set_title("excess NLL of sampled tokens (0: drawn from p), by row")
    b.set_title("by column")
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_world_args(ap, prompts=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--no-ar", action="store_true", help="skip AR (the excess over the entropy needs no reference)")
    ap.add_argument("--out", required=True, help="folder for sample_nll.json and sample_nll.png")
    args = ap.parse_args(argv)
    if args.prompts < 2:
        ap.error(f"--prompts {args.prompts}: give at least 2 (the intervals need two images)")
    if args.batch_size < 1:
        ap.error(f"--batch-size {args.batch_size}: give at least 1")
    backbone, drafter, prompts, strategies = load_world(args)
    strategies = {**({} if args.no_ar else {"ar": None}), **(strategies or {"ssd": decoding_options("ssd")})}
    logps, result = {}, {}
    for name, options in strategies.items():
        print(f"{name}: decoding {len(prompts)} images", flush=True)
        logps[name] = sample_logprobs(backbone, drafter, prompts, args.cfg_scale, args.seed, options,
                                      args.batch_size).numpy()
        result[name] = summarise(logps[name], logps.get("ar") if name != "ar" else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "sample_nll.json", json.dumps(result, indent=2))
    plot(result, out / "sample_nll.png")
    print(f"{'strategy':<22} {'NLL/token (95%)':>18} {'- ar, paired':>18} {'NLL - entropy':>18} {'p < 0.01':>9}")
    for name, r in result.items():
        diff = f"{r['nll_minus_ar']:+.4f} +-{r['nll_minus_ar_ci95']:.4f}" if "nll_minus_ar" in r else "-"
        print(f"{name:<22} {r['nll']:>9.4f} +-{r['nll_ci95']:.4f} {diff:>18} "
              f"{r['excess']:>+9.4f} +-{r['excess_ci95']:.4f} {r['low_p_share']:>9.4f}")
    return result


if __name__ == "__main__":
    main()
