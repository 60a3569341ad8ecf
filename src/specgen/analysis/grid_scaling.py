"""SSD's pass ratio against the token grid's side: the paper's O(n) argument across world sizes.

On an n x n grid AR spends n^2 passes. The paper's rule spends at most r + 1 passes a row, so its ratio is at least
n / (r + 1) and grows linearly with the side; a rule whose passes per row grow with the row's width (carry: about
one pass per change that ends a pass) grows more slowly. Each world (a backbone, its tokenizer and its f_phi) is
decoded with the same strategies (the decoding configs, as the benchmark runs them) on the same held-out prompts at
batch 1; the table gives the pass ratio, the passes per later row, the bound n / (passes a row may take): the
paper's n / (r + 1) (none for carry or the exact rule), the tokens kept unchecked per image and, across worlds, the log-log slope of the ratio against the side (1 = linear in n, the paper's regime;
0 = flat).

    python -m specgen.analysis.grid_scaling \\
        --world 16=checkpoints/ar_shapes,checkpoints/vq_shapes,checkpoints/fphi_accept \\
        --world 32=checkpoints/ar_shapes32,checkpoints/vq_shapes128,checkpoints/fphi_shapes32 \\
        --prompts 32 --out logs/grid_scaling

-> <out>/grid_scaling.json, grid_scaling.png (ratio against side), one row_passes_<side>.png per world. Quality
at these settings is measured by the benchmark (experiment=eval/grid_scaling32 for the larger world, discrete_speed for
the default one): this tool counts passes only.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specgen.analysis import row_passes as rp
from specgen.backbones.loading import load_shapes_generator
from specgen.evaluation.benchmarks import mixed_prompts
from specgen.utils.checkpoints import atomic_write_text, load_exported
from specgen.utils.plots import pyplot, save


def parse_world(text: str) -> tuple[str, tuple[str, str, str]]:
    """'NAME=backbone,tokenizer,drafter' -> (NAME, (backbone, tokenizer, drafter))."""
    name, sep, body = text.partition("=")
    parts = body.split(",")
    if not sep or not name or len(parts) != 3 or not all(parts):
        raise ValueError(f"--world {text!r}: write NAME=<backbone folder>,<tokenizer folder>,<drafter folder>, e.g. "
                         f"16=checkpoints/ar_shapes,checkpoints/vq_shapes,checkpoints/fphi_accept")
    return name, tuple(parts)


def loglog_slope(sides: list[int], ratios: list[float]) -> float:
    """Least-squares slope of log(ratio) against log(side): 1 when the ratio grows as the side, 0 when flat."""
    if len(sides) < 2:
        return float("nan")
    return float(np.polyfit(np.log(sides), np.log(ratios), 1)[0])


def row_budget(options: dict) -> int | None:
    """The most passes a row may take under a strategy's options (`row_passes.decoding_options`): r + 1 for the
    paper's auto-correction; None for carry and the exact rule (a pass ends at the first rejection), whose rows
    have no bound."""
    if options.get("exact", False) or options.get("_target_") != "specgen.decoding.ssd.generate":
        return None
    return options.get("rounds", 0) + 1


def scaling_table(result: dict, options: dict[str, dict]) -> dict:
    """Per strategy: sides, pass ratios, the bound n / (passes a row may take) per side (`row_budget`; None with
    carry or the exact rule: their rows have no bound on their passes) and the log-log slope across worlds.
    `options`: each strategy's options."""
    worlds = sorted(result, key=lambda w: result[w]["side"])
    table = {}
    for name in result[worlds[0]]["strategies"]:
        sides = [result[w]["side"] for w in worlds]
        ratios = [result[w]["strategies"][name]["ratio"][-1] for w in worlds]
        budget = row_budget(options[name])
        table[name] = {"worlds": worlds, "sides": sides, "ratios": ratios,
                       "passes_per_row": [result[w]["strategies"][name]["passes_per_row"] for w in worlds],
                       "row_bound": [s / budget if budget else None for s in sides],
                       "loglog_slope": loglog_slope(sides, ratios)}
    return table


def plot(table: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, t in table.items():
        line, = ax.plot(t["sides"], t["ratios"], marker="o", label=f"{name} (log-log slope {t['loglog_slope']:.2f})")
        if t["row_bound"][0] is not None:
            ax.plot(t["sides"], t["row_bound"], ls="--", color=line.get_color(), alpha=0.6,
                    label=f"n / (passes a row may take), for {name}")
    ax.set_xlabel("token grid side n")
    ax.set_ylabel("AR passes / SSD passes (batch 1)")
    ax.set_title("SSD's pass ratio against the grid side")
    ax.legend(fontsize=7)
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", action="append", required=True, metavar="NAME=backbone,tokenizer,drafter",
                    help="one world size (repeatable)")
    ap.add_argument("--strategy", action="append", default=None, metavar="NAME",
                    help="SSD decoding configs to compare (default: ssd and ssd_paper)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts per world (one image each, batch 1)")
    ap.add_argument("--cfg-scale", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.prompts < 2:
        ap.error(f"--prompts {args.prompts}: give at least 2 (the intervals need two images)")
    worlds = dict(parse_world(w) for w in args.world)
    strategies = rp.config_strategies(args.strategy or rp.DEFAULT_STRATEGIES)
    prompts = [m["prompt"] for m in mixed_prompts("test", args.prompts, args.seed)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for name, (backbone_dir, tokenizer_dir, drafter_dir) in worlds.items():
        backbone = load_shapes_generator(backbone_dir, tokenizer_dir)
        drafter = load_exported(drafter_dir).eval()
        grid = backbone.grid
        if grid.height != grid.width:
            raise ValueError(f"world {name!r} has a {grid.height}x{grid.width} grid: the scaling table needs square "
                             f"grids")
        print(f"world {name}: {grid.height}x{grid.width} tokens, {args.prompts} prompts", flush=True)
        per = rp.row_passes(backbone, drafter, prompts, args.cfg_scale, args.seed, strategies)
        rp.plot(per, out / f"row_passes_{name}.png")
        result[name] = {"side": grid.width, "dirs": [backbone_dir, tokenizer_dir, drafter_dir], "strategies": per}
    table = scaling_table(result, strategies)
    atomic_write_text(out / "grid_scaling.json", json.dumps({"worlds": result, "table": table}, indent=2))
    plot(table, out / "grid_scaling.png")
    print(f"{'strategy':<12} {'side':>5} {'passes (95%)':>14} {'ratio':>7} {'n/budget':>8} {'passes/row':>10} "
          f"{'unchecked':>9}")
    for sname, t in table.items():
        for w, side, ratio, bound, slope in zip(t["worlds"], t["sides"], t["ratios"], t["row_bound"],
                                                t["passes_per_row"]):
            r = result[w]["strategies"][sname]
            total = f"{r['passes'][-1]:.1f} +-{r['passes_ci95'][-1]:.1f}"
            bound = "-" if bound is None else f"{bound:.2f}"
            print(f"{sname:<12} {side:>5d} {total:>14} {ratio:>7.2f} {bound:>8} {slope:>10.2f} "
                  f"{r['unchecked']:>9.1f}")
        print(f"{sname:<12} log-log slope of the ratio against the side: {t['loglog_slope']:.2f}")
    return {"worlds": result, "table": table}


if __name__ == "__main__":
    main()
