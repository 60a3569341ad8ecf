"""Where do an SSD drafter's down drafts lose acceptance: at positions where the backbone is sure of the next token
(its guided distribution's largest probability above a threshold, 0.9 by default) or where it is not?

Images are sampled by AR from the backbone on held-out prompts; each image's states are teacher-forced, and the
drafter drafts every down position from the row above's states (with left context: the teacher's token before
it), as in validation. Per split (all, sure, unsure) it reports the expected acceptance sum min(p, q) of drafts
sampled from q at draft temperature 1 and at `--draft-temperature` (SSD drafts colder: configs/decoding/ssd.yaml),
p at the argmax of q (drafts taken greedily), the ceiling of greedy drafts p(argmax p), and top-1 agreement; p and
q are CFG-guided.

    python -m specgen.analysis.sure_accept --drafter checkpoints/fphi_accept --backbone checkpoints/ar_shapes \\
        --tokenizer checkpoints/vq_shapes --images 48 --out logs/sure_accept/fphi_accept.json

`--left drafted` (drafters with left context): each row is drafted column by column as SSD drafts it, the tokens
before a column being the row's own drafts (sampled from q at `--draft-temperature`; the teacher's before column 0),
while p stays the target's on the teacher's row: how much of the teacher-forced acceptance survives drafted left
context.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specgen.backbones.protocol import embed_image, image_states
from specgen.decoding import ar
from specgen.decoding.sampling import guide, make_rngs
from specgen.evaluation.benchmarks import mixed_prompts
from specgen.modules.distill_module import DistillModule, guided_terms
from specgen.utils.checkpoints import atomic_write_text, load_exported

SPLITS = ("all", "sure", "unsure")


def position_terms(t_logits: torch.Tensor, d_logits: torch.Tensor, cfg_scale: float,
                   draft_temperature: float) -> dict[str, torch.Tensor]:
    """Per position, from target and draft logits stacked [cond; uncond] as (2B, ..., V) (the layout of
    `distill_module.guided_terms`, which computes the acceptance terms): the guided target's largest probability and
    the terms of the module docstring, each (B, ...). Guidance is linear in the logits, so the drafts at a
    temperature are those of the draft logits divided by it."""
    hot, cold = guided_terms(t_logits, d_logits, cfg_scale), guided_terms(t_logits, d_logits / draft_temperature,
                                                                          cfg_scale)
    t, d = guide(t_logits, cfg_scale), guide(d_logits, cfg_scale)
    top = t.softmax(-1).max(-1).values
    return {"max_p": top, "accept": hot["accept"], "accept_cold": cold["accept"],
            "accept_argmax": hot["accept_argmax"], "ceiling_argmax": top,
            "top1": (d.argmax(-1) == t.argmax(-1)).float()}


def split_means(terms: dict[str, torch.Tensor], threshold: float) -> dict[str, dict[str, float]]:
    """Mean of every term over all positions, the sure ones (max p > threshold) and the rest; `share`: each split's
    fraction of the positions (a split with no position has no means)."""
    sure = terms["max_p"] > threshold
    masks = {"all": torch.ones_like(sure), "sure": sure, "unsure": ~sure}
    out = {}
    for name, m in masks.items():
        row = {"share": float(m.float().mean())}
        if m.any():
            row.update({k: float(v[m].mean()) for k, v in terms.items() if k != "max_p"})
        out[name] = row
    return out


@torch.inference_mode()
def measure(drafter_dir: str, backbone_dir: str, tokenizer_dir: str, images: int, cfg_scale: float,
            draft_temperature: float, threshold: float, seed: int = 0, batch: int = 8, left: str = "teacher") -> dict:
    """The splits of the drafter's down drafts over `images` AR samples (held-out prompts, per-image seeds)."""
    module = DistillModule(load_exported(drafter_dir).eval(), backbone_dir, tokenizer_dir, cfg_scale=cfg_scale)
    module.setup()
    module.eval()
    if "down" not in module.net.directions:
        raise ValueError(f"{drafter_dir} drafts {list(module.net.directions)}: this report needs a down direction")
    if left == "drafted" and not getattr(module.net, "left_context", False):
        raise ValueError(f"--left drafted: {drafter_dir} has no left context (its down drafts read no left tokens); "
                         f"use --left teacher")
    if left == "drafted" and cfg_scale == 1.0:
        raise ValueError("--left drafted needs CFG (--cfg-scale other than 1): its drafts are drawn from the guided q")
    gen = torch.Generator().manual_seed(seed)
    bb = module.backbone
    prompts = [m["prompt"] for m in mixed_prompts("test", images, seed)]
    parts: dict[str, list[torch.Tensor]] = {}
    for i in range(0, images, batch):
        chunk = prompts[i:i + batch]
        codes, _ = ar.generate(bb, bb.prompts(chunk), cfg_scale=cfg_scale,
                               rngs=make_rngs([seed * 100_003 + i + k for k in range(len(chunk))]))
        states, ids = image_states(bb, bb.prompts(chunk).rows(True), codes)  # [cond; uncond] (CFG 1: cond only)
        states, embeds = states.float(), embed_image(bb, ids).float()
        (pred, target), = module._pairs("down", bb.grid.stride, states, embeds)
        if left == "drafted":
            pred = module.down_drafted_left(states, embeds, draft_temperature, gen)
        terms = position_terms(module._visual(target), module._visual(pred), cfg_scale, draft_temperature)
        for k, v in terms.items():
            parts.setdefault(k, []).append(v.flatten())
    terms = {k: torch.cat(v) for k, v in parts.items()}
    return {"drafter": drafter_dir, "images": images, "left": left, "positions": int(terms["max_p"].numel()),
            "threshold": threshold, "draft_temperature": draft_temperature, "cfg_scale": cfg_scale,
            "splits": split_means(terms, threshold)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--backbone", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--images", type=int, default=48, help="AR samples on held-out prompts")
    ap.add_argument("--cfg-scale", type=float, default=2.0)
    ap.add_argument("--draft-temperature", type=float, default=0.5)
    ap.add_argument("--threshold", type=float, default=0.9, help="'sure': the target's largest probability above this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--left", choices=("teacher", "drafted"), default="teacher",
                    help="a down draft's left tokens: the teacher's, or the row's own drafts (as SSD drafts a row)")
    ap.add_argument("--out", required=True, help="json file to write")
    args = ap.parse_args(argv)
    if args.images < 1:
        ap.error(f"--images {args.images}: give at least 1")
    if args.draft_temperature <= 0 or not 0 < args.threshold < 1:
        ap.error(f"--draft-temperature {args.draft_temperature} must be > 0 and --threshold {args.threshold} in (0, 1)")
    out = measure(args.drafter, args.backbone, args.tokenizer, args.images, args.cfg_scale, args.draft_temperature,
                  args.threshold, args.seed, left=args.left)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out, indent=2))
    print(f"{args.drafter}: {out['positions']} down positions, {args.images} images; sure (max p > {args.threshold:g}):"
          f" {out['splits']['sure']['share']:.3f} of them")
    print(f"{'split':<8} {'share':>6} {'accept':>7} {f'T={args.draft_temperature:g}':>7} {'argmax':>7} "
          f"{'ceiling':>8} {'top1':>6}")
    for name in SPLITS:
        r = out["splits"][name]
        if "accept" in r:
            print(f"{name:<8} {r['share']:>6.3f} {r['accept']:>7.3f} {r['accept_cold']:>7.3f} "
                  f"{r['accept_argmax']:>7.3f} {r['ceiling_argmax']:>8.3f} {r['top1']:>6.3f}")
    return out


if __name__ == "__main__":
    main()
