"""The aten ops SSD's decoders dispatch, against AR's, at each batch size: per target pass, per target forward,
drafting and the rest (verification, bookkeeping, sampling) per pass, and drafting's ops per drafted token, split by
drafting step (right chain, down rows, re-drafts, reweighted tokens).

On a CPU, or on a GPU with a model this small, every op costs a few microseconds of dispatch (or a kernel launch)
whatever its size, so a pass's op count bounds how far passes saved can turn into wall clock: a strategy with P passes
of n ops each against AR's 256 steps of n_AR ops runs at most (256 n_AR) / (P n) times AR's speed where ops dominate.
The counts are exact (`decoding.trace.OpCount`, a dispatch-mode counter) and the same on any device; they do not
time anything. At batch sizes above 1, SSD with carry decodes as the benchmark does, a stream with that many slots
over that many prompts (`--fixed-batch`: one fixed batch instead).

    python -m specgen.analysis.ssd_ops --backbone checkpoints/ar_shapes --tokenizer checkpoints/vq_shapes \\
        --drafter checkpoints/fphi_gpu --batch-sizes 1 16 --out logs/ssd_ops

-> <out>/ssd_ops.json. Strategies: AR and the decoding configs `ssd` and `ssd_paper` (`--strategy` and `--variant`
as in `row_passes`), the same prompts and per-image seeds for each.
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from specgen.analysis.row_passes import add_world_args, config_strategies, decoder, load_world
from specgen.decoding import ar, ssd_carry
from specgen.decoding.sampling import make_rngs
from specgen.decoding.trace import OpCount
from specgen.utils.checkpoints import atomic_write_text


def strategy_fns(drafter, cfg_scale: float, strategies: dict[str, dict]) -> dict:
    """name -> (decode(backbone, prompts, rngs=, trace=, [slots=]), streams): AR first, then each SSD strategy with
    its options; `streams` whether it decodes as a stream above batch 1 (SSD with carry)."""
    out = {"ar": (functools.partial(ar.generate, cfg_scale=cfg_scale), False)}
    for name, options in strategies.items():
        fn, kwargs = decoder(options)
        out[name] = (functools.partial(fn, drafter=drafter, cfg_scale=cfg_scale, **kwargs), fn is ssd_carry.generate)
    return out


@torch.inference_mode()
def count(backbone, decode, prompts: list[str], stream: bool, seed: int = 0) -> dict:
    """One decode of `prompts` (a stream with a slot per prompt where `stream`) under `OpCount`: its summary, its
    passes and the drafting ops and tokens by drafting step."""
    kwargs = {"slots": len(prompts)} if stream and len(prompts) > 1 else {}
    with OpCount() as ops:
        _, stats = decode(backbone, backbone.prompts(prompts), rngs=make_rngs([seed + i for i in range(len(prompts))]),
                          trace=ops, **kwargs)
    passes = int(stats["nfe"])
    return {"passes": passes, "stream": bool(kwargs), **ops.summary(passes),
            "draft_by_step": {what: {"ops": n, "tokens": ops.drafted[what],
                                     "ops_per_token": n / ops.drafted[what] if ops.drafted[what] else 0.0}
                              for what, n in ops.draft.items()}}


def measure(backbone, drafter, prompts: list[str], cfg_scale: float, strategies: dict[str, dict],
            batch_sizes: list[int], seed: int = 0, fixed_batch: bool = False) -> dict:
    """{"bs<B>": {strategy: count}} with each strategy's ops per pass over AR's (`ops_ratio`)."""
    fns = strategy_fns(drafter, cfg_scale, strategies)
    out = {}
    for bs in batch_sizes:
        if bs > len(prompts):
            raise ValueError(f"batch size {bs} needs {bs} prompts, {len(prompts)} given: raise --prompts")
        rows = {name: count(backbone, fn, prompts[:bs], stream and not fixed_batch, seed)
                for name, (fn, stream) in fns.items()}
        for r in rows.values():
            r["ops_ratio"] = r["ops_per_pass"] / rows["ar"]["ops_per_pass"]
        out[f"bs{bs}"] = rows
    return out


def format_report(result: dict) -> str:
    """The counts as the lines the command prints."""
    lines = []
    for key, rows in result.items():
        lines.append(f"batch {key[2:]}: {'passes':>7} {'ops/pass':>9} {'x ar':>6} {'forward':>8} {'drafting':>9} "
                     f"{'other':>7} {'/drafted':>9}   drafting ops per drafted token by step")
        for name, r in rows.items():
            steps = ", ".join(f"{w} {s['ops_per_token']:.1f} ({s['tokens']})" for w, s in r["draft_by_step"].items())
            lines.append(f"  {name + (' (stream)' if r['stream'] else ''):<14} {r['passes']:>7} "
                         f"{r['ops_per_pass']:>9.0f} {r['ops_ratio']:>6.2f} {r['ops_per_forward']:>8.0f} "
                         f"{r['ops_draft_per_pass']:>9.0f} {r['ops_other_per_pass']:>7.0f} "
                         f"{r['ops_per_drafted_token']:>9.1f}   {steps}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_world_args(ap, prompts=16)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--fixed-batch", action="store_true", help="SSD with carry in one fixed batch, not a stream")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the counts do not depend on them)")
    ap.add_argument("--out", required=True, help="folder for ssd_ops.json")
    args = ap.parse_args(argv)
    if min(args.batch_sizes) < 1:
        ap.error(f"--batch-sizes {args.batch_sizes}: every batch size must be at least 1")
    torch.set_num_threads(args.threads)
    backbone, drafter, prompts, strategies = load_world(args)
    result = measure(backbone, drafter, prompts, args.cfg_scale, strategies or config_strategies(),
                     args.batch_sizes, args.seed, args.fixed_batch)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / "ssd_ops.json", json.dumps(result, indent=2) + "\n")
    print(format_report(result))
    return result


if __name__ == "__main__":
    main()
