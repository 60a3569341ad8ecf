"""Where SSD's wall clock goes at a batch size above 1, against AR's, on the machine it runs on: can passes saved
still turn into wall clock once the target's forwards are batched?

AR decodes the prompts as one fixed batch; SSD with carry as the benchmark runs it above batch 1, a stream with a
slot per prompt (`ssd_carry.generate(..., slots=B)`). Every target forward is timed with the positions and rows it
feeds (`ssd_costs.Clock`), drafting with its own clock, the rest of the wall time is verification and bookkeeping.
The report gives per strategy the split of its wall time, its passes, the positions each forward feeds per row, the
token positions it computes per image (the arithmetic: AR computes one position a row a pass; a padded stream
computes rows x positions, a packed one only its images' own tokens) and two ceilings of SSD's wall ratio against AR:
the forwards alone (AR's wall over SSD's target seconds: drafting, verification and bookkeeping free) and forwards
at AR's cost per position (AR's target seconds over SSD's computed positions priced at AR's seconds per
row-position). Where a forward's cost grows with the positions it feeds, the first ceiling is what no
hot-path work can pass at this batch size on this machine.

    python -m specgen.analysis.batch_costs --backbone checkpoints/ar_shapes --tokenizer checkpoints/vq_shapes \\
        --drafter checkpoints/fphi_gpu --prompts 16 --dtype bfloat16 --threads 2 --out logs/batch_costs

-> <out>/batch_costs.json (strategy: AR and the decoding config `ssd`, or `--strategy` / `--variant`).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specgen.analysis.row_passes import add_world_args, config_strategies, decoder, load_world
from specgen.analysis.ssd_costs import Clock
from specgen.decoding import ar, ssd_carry
from specgen.decoding.sampling import make_rngs
from specgen.utils.checkpoints import atomic_write_text


@torch.inference_mode()
def measure(backbone, drafter, prompts: list[str], cfg_scale: float, strategies: dict[str, dict],
            seed: int = 0, repeats: int = 1) -> dict:
    """Per strategy (AR first): wall, target, draft and other seconds per image, passes, the mean positions a forward
    feeds per row and its rows, and the row-positions computed per image, over `repeats` decodes of the batch (a
    warm-up decode of two prompts first)."""
    fns = {"ar": (lambda p, rngs, trace: ar.generate(backbone, p, cfg_scale=cfg_scale, rngs=rngs, trace=trace))}
    for name, options in strategies.items():
        fn, kwargs = decoder(options)
        if fn is ssd_carry.generate:
            kwargs = {**kwargs, "slots": len(prompts)}  # as the benchmark decodes above batch 1
        fns[name] = (lambda f, o: lambda p, rngs, trace: f(backbone, p, drafter, cfg_scale=cfg_scale, rngs=rngs,
                                                           trace=trace, **o))(fn, kwargs)
    clock, n, out = Clock(), len(prompts), {}
    for decode in fns.values():
        decode(backbone.prompts(prompts[:2]), make_rngs([seed, seed + 1]), clock)
    acc = {name: {"wall": 0.0, "draft": 0.0, "passes": 0.0, "forwards": [], "computed": []} for name in fns}
    for _ in range(repeats):  # interleaved: a drift of the machine's speed falls on every strategy alike
        for name, decode in fns.items():
            clock.reset()
            t = time.perf_counter()
            _, stats = decode(backbone.prompts(prompts), make_rngs([seed + i for i in range(n)]), clock)
            a = acc[name]
            a["wall"] += time.perf_counter() - t
            a["draft"] += clock.draft_s
            a["passes"] += float(stats["nfe"])
            a["forwards"] += clock.forwards
            a["computed"] += clock.computed
    images = n * repeats
    for name, a in acc.items():
        steps = [f for f in a["forwards"] if not f[3]]  # after the prefills
        computed = [c for f, c in zip(a["forwards"], a["computed"]) if not f[3]]
        target = sum(f[2] for f in a["forwards"])
        out[name] = {"images": images, "wall_s": a["wall"] / images, "target_s": target / images,
                     "draft_s": a["draft"] / images, "other_s": (a["wall"] - target - a["draft"]) / images,
                     "passes": a["passes"] / repeats, "rows": max(f[1] for f in a["forwards"]),
                     "positions_per_forward": sum(f[0] for f in steps) / max(len(steps), 1),
                     "row_positions_per_image": sum(f[0] * f[1] for f in steps) / images,
                     "computed_per_image": sum(computed) / images,  # fewer than row-positions where packed
                     "step_s": sum(f[2] for f in steps) / max(len(steps), 1)}
    return out


def report(result: dict) -> dict:
    """Ratios against AR and the two ceilings (module docstring), per strategy."""
    base = result["ar"]
    per_position = base["step_s"] / base["rows"]  # AR's seconds per row-position of a forward
    out = {}
    for name, r in result.items():
        out[name] = {**r, "wall_ratio": base["wall_s"] / r["wall_s"],
                     "pass_ratio": base["passes"] / r["passes"],
                     "compute_ratio": r["computed_per_image"] / base["computed_per_image"],
                     "ceiling_forwards": base["wall_s"] / r["target_s"],
                     "ceiling_ar_cost": base["target_s"] / (r["computed_per_image"] * per_position)}
    return out


def format_report(rows: dict, batch: int) -> str:
    lines = [f"batch {batch}: {'passes':>7} {'q/forward':>9} {'rows':>5} {'ms/forward':>10} {'wall x':>7} "
             f"{'computed x':>10} {'ceiling fwd':>11} {'ceiling AR-cost':>15}   wall split (target / draft / other)"]
    for name, r in rows.items():
        split = " / ".join(f"{r[k] / r['wall_s']:.0%}" for k in ("target_s", "draft_s", "other_s"))
        lines.append(f"  {name:<8} {r['passes']:>7.1f} {r['positions_per_forward']:>9.1f} {r['rows']:>5} "
                     f"{1e3 * r['step_s']:>10.2f} {r['wall_ratio']:>7.2f} {r['compute_ratio']:>10.2f} "
                     f"{r['ceiling_forwards']:>11.2f} {r['ceiling_ar_cost']:>15.2f}   {split}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_world_args(ap, prompts=16)
    ap.add_argument("--repeats", type=int, default=1, help="decodes of the batch per strategy")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", required=True, help="folder for batch_costs.json")
    args = ap.parse_args(argv)
    if args.prompts < 2 or args.repeats < 1:
        ap.error(f"--prompts {args.prompts} --repeats {args.repeats}: a batch needs at least 2 prompts, and one repeat")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    backbone, drafter, prompts, strategies = load_world(args)
    strategies = strategies or config_strategies(["ssd"])
    rows = report(measure(backbone, drafter, prompts, args.cfg_scale, strategies, args.seed, args.repeats))
    result = {"batch": len(prompts), "dtype": args.dtype, "threads": torch.get_num_threads(), "strategies": rows}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / "batch_costs.json", json.dumps(result, indent=2) + "\n")
    print(format_report(rows, len(prompts)))
    return result


if __name__ == "__main__":
    main()
