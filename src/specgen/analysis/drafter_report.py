"""How well do SSD drafters serve the backbone? Per direction, on held-out teacher samples: top-1 agreement,
expected acceptance under the CFG-guided distributions (sum min(p, q): drafts sampled from q; p(argmax q):
drafts taken greedily), the guided KL, and the drafter's size and cost per drafted token against the backbone's.

    python -m specgen.analysis.drafter_report --drafters checkpoints/fphi_shapes <export> ... \
        --backbone checkpoints/ar_shapes --tokenizer checkpoints/vq_shapes \
        --shards data/distill/<key>/val_00000.npz --cfg-scale 2 --out logs/drafter_report.json
    # or let it sample (once, then reuse) a validation shard of N sequences: --val-sequences 512

The shards are those the distillation stage writes (`data/distill/<key>/val_*.npz`, a key per backbone and
sampling settings); use a validation shard, never one a drafter was trained on. FLOPs per drafted token count
2 x the multiply-accumulates of the direction's linear and convolution layers, plus a row attention's scores and mix
over the row's W columns; the backbone's count its transformer blocks and head (attention over the context not
included: a lower bound), so the ratio errs against the drafter.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from specgen.modules.distill_data import DistillDataModule, teacher_dataset
from specgen.modules.distill_module import DistillModule
from specgen.utils.checkpoints import atomic_write_text, load_exported

METRICS = ("top1", "accept", "accept_argmax", "loss_guided_kl")


def matmul_flops(module: nn.Module) -> int:
    """2 x multiply-accumulates per position of the module's Linear and Conv1d layers."""
    return sum(2 * m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))


def draft_flops(net: nn.Module, direction: str, row_width: int = 0) -> int:
    """Matmul FLOPs per drafted token of one direction: its net, and for a down draft the deeper trunk, the row
    attention (its projections and, over the `row_width` columns attended, scores and mix) and the left block where
    the drafter has them (the left maps are table lookups when decoding: not counted)."""
    if direction != "down":
        return matmul_flops(net.nets[direction])
    extra = [getattr(net, name) for name in ("down_more", "left_block") if hasattr(net, name)]
    attn = sum(a.flops_per_position(row_width) for a in getattr(net, "down_attn", []))
    return matmul_flops(net.nets[direction]) + sum(matmul_flops(m) for m in extra) + attn


def backbone_flops(backbone) -> int:
    """Per-token matmul FLOPs of the backbone's blocks and head (the embedding table is a lookup)."""
    return matmul_flops(backbone.model.model.layers) + matmul_flops(backbone.model.lm_head)


@torch.no_grad()
def evaluate(drafter_dir: str, backbone_dir: str, tokenizer_dir: str, shards: list[str], cfg_scale: float,
             batch_size: int = 16) -> dict:
    """Mean per-direction metrics of one exported drafter over the shards' sequences."""
    module = DistillModule(load_exported(drafter_dir), backbone_dir, tokenizer_dir, cfg_scale=cfg_scale,
                           state_batch=batch_size)  # token shards: the states of a batch in one teacher call
    module.eval()
    sums: dict[str, float] = {}
    n = 0
    for batch in DataLoader(teacher_dataset([Path(s) for s in shards]), batch_size=batch_size):  # states, or tokens
        out = module.losses(batch)
        for key, value in out.items():
            if key.split("_")[0] in ("top1", "accept", "loss") and "chain" not in key and key != "loss":
                sums[key] = sums.get(key, 0.0) + float(value) * len(batch["ids"])
        n += len(batch["ids"])
    net, bb = module.net, module.backbone
    row = {k: v / n for k, v in sums.items() if any(k.startswith(m + "_") for m in METRICS)}
    row.update({"sequences": n, "params": sum(p.numel() for p in net.parameters()),
                "backbone_params": sum(p.numel() for p in bb.parameters()),
                "backbone_flops_per_token": backbone_flops(bb)})
    for d in net.directions:
        row[f"flops_per_draft_{d}"] = draft_flops(net, d, bb.grid.width)
    return row


def validation_shard(backbone_dir: str, tokenizer_dir: str, cache_dir: str, sequences: int, cfg_scale: float) -> Path:
    """The distillation stage's validation shard of `sequences` teacher samples at `cfg_scale`, written if missing
    (the same file, key and seeds as `experiment=train/fphi_shapes data.shard_size=<sequences>` writes)."""
    data = DistillDataModule(backbone_dir, tokenizer_dir, cache_dir, train_shards=1, val_shards=1,
                             shard_size=sequences, sample_batch=min(64, sequences), cfg_scale=cfg_scale)
    data.prepare_split("val")
    return data.shard_path("val", 0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", nargs="+", required=True, help="exported drafter folders")
    ap.add_argument("--backbone", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shards", nargs="+", default=None, help="held-out teacher shards (val_*.npz, or streamed val_*_tokens.npz)")
    ap.add_argument("--val-sequences", type=int, default=None, metavar="N",
                    help="instead of --shards: sample (or reuse) one validation shard of N sequences from the backbone "
                         "at --cfg-scale into --cache-dir, as the distillation stage writes it")
    ap.add_argument("--cache-dir", default="data/distill", help="teacher shard cache of --val-sequences")
    ap.add_argument("--cfg-scale", type=float, default=2.0, help="the CFG scale the drafter will serve")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    if (args.shards is None) == (args.val_sequences is None):
        ap.error("give either --shards (existing val_*.npz files) or --val-sequences N (sample a validation shard)")
    if args.val_sequences is not None:
        args.shards = [str(validation_shard(args.backbone, args.tokenizer, args.cache_dir, args.val_sequences,
                                            args.cfg_scale))]
    for s in args.shards:
        if not Path(s).is_file():
            raise FileNotFoundError(f"--shards {s!r} is not a file: give val_*.npz files written by the distillation "
                                    f"stage (python -m specgen.train experiment=train/fphi_shapes prepare_only=true)")
    report = {d: evaluate(d, args.backbone, args.tokenizer, args.shards, args.cfg_scale) for d in args.drafters}
    atomic_write_text(args.out, json.dumps(report, indent=2))
    dirs = sorted({k.split("_")[-1] for r in report.values() for k in r if k.startswith("accept_")})
    print(f"{'drafter':<32} {'params':>9} {'FLOPs/draft':>12} " +
          " ".join(f"{m + '_' + d:>20}" for d in dirs for m in ("top1", "accept", "accept_argmax")))
    for name, r in report.items():
        flops = max(v for k, v in r.items() if k.startswith("flops_per_draft_"))
        print(f"{Path(name).name:<32} {r['params']:>9d} {flops / r['backbone_flops_per_token']:>11.1%} " +
              " ".join(f"{r.get(m + '_' + d, float('nan')):>20.3f}" for d in dirs for m in ("top1", "accept", "accept_argmax")))
    return report


if __name__ == "__main__":
    main()
