"""CSpD against the target at fewer MAR steps: one table and one plot from a continuous_speed run's metrics.json.

Per strategy: target transformer passes per generation (latency steps: `speed/target_calls` at batch 1), the
target's condition sets per image, acceptance, GenEval with its 95% interval and its paired difference to the
first strategy (the 64-step target), wall clock as a ratio to the first strategy at batch 1 and 16. A strategy is
on the front (`front_passes`, `front_wall16`) when no other has at most its passes (at least its wall-clock ratio)
and a higher GenEval; `ahead_of` names, for each strategy with a draft, the targets it beats beyond the intervals
(at most its passes, GenEval higher by more than the two intervals combined, sqrt(ci_a^2 + ci_b^2): the images
are shared, so this is conservative).

    python -m specgen.analysis.cspd_pareto <run>/metrics.json --out <folder>   -> summary.txt, pareto.json, pareto.png
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from specgen.utils.checkpoints import atomic_write_text


def rows(metrics: dict) -> list[dict]:
    """One row per strategy with a GenEval score, in the run's order."""
    names = [k[: -len("/geneval/overall")] for k in metrics if k.endswith("/geneval/overall")]
    get = lambda n, k, default=float("nan"): float(metrics.get(f"{n}/{k}", default))
    out = []
    for n in names:
        out.append({"name": n, "draft": f"{n}/accept_rate" in metrics, "passes": get(n, "speed/target_calls_bs1"),
                    "sets": get(n, "speed/target_sets_bs1"), "alpha": get(n, "accept_rate"),
                    "geneval": get(n, "geneval/overall"), "ci": get(n, "geneval/overall_ci95"),
                    "diff": get(n, "geneval/overall_diff", 0.0), "diff_ci": get(n, "geneval/overall_diff_ci95", 0.0),
                    "wall1": get(n, "speed/wall_ratio_bs1"), "wall16": get(n, "speed/wall_ratio_bs16")})
    return out


def front(table: list[dict], cost: str, lower_is_cheaper: bool = True) -> list[str]:
    """Strategies that no other beats on quality at a cost at least as low (passes) or a speed-up as high (wall)."""
    cheaper = (lambda a, b: a <= b) if lower_is_cheaper else (lambda a, b: a >= b)
    return [r["name"] for r in table
            if not any(o is not r and cheaper(o[cost], r[cost]) and o["geneval"] > r["geneval"] for o in table)]


def ahead_of(table: list[dict]) -> dict[str, list[str]]:
    """For each drafting strategy, the targets with at least its passes that it beats beyond the intervals."""
    targets = [r for r in table if not r["draft"]]
    return {r["name"]: [t["name"] for t in targets if t["passes"] >= r["passes"]
                        and r["geneval"] - t["geneval"] > math.hypot(r["ci"], t["ci"])]
            for r in table if r["draft"]}


def lines(table: list[dict]) -> list[str]:
    out = [f"{'strategy':16s} {'passes':>6s} {'sets':>5s} {'alpha':>6s} {'GenEval (95%)':>15s} {'- first (95%)':>16s} "
           f"{'wall x bs1':>10s} {'wall x bs16':>11s}"]
    for r in table:
        alpha = f"{r['alpha']:.3f}" if r["draft"] else "-"
        out.append(f"{r['name']:16s} {r['passes']:6.1f} {r['sets']:5.1f} {alpha:>6s} "
                   f"{'%.3f +-%.3f' % (r['geneval'], r['ci']):>15s} {'%+.3f +-%.3f' % (r['diff'], r['diff_ci']):>16s} "
                   f"{r['wall1']:10.2f} {r['wall16']:11.2f}")
    out.append(f"front (passes vs GenEval): {', '.join(front(table, 'passes'))}")
    out.append(f"front (wall-clock speed-up at batch 16 vs GenEval): {', '.join(front(table, 'wall16', False))}")
    beats = {k: v for k, v in ahead_of(table).items() if v}
    out.append("ahead of a target with as many passes or more, beyond the intervals: "
               + ("; ".join(f"{k} > {', '.join(v)}" for k, v in beats.items()) if beats else "none"))
    return out


def plot(table: list[dict], path: Path) -> None:
    """GenEval (95% intervals) against target passes and against the wall-clock speed-up at batch 16."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "passes", "target transformer passes per generation (latency steps)"),
                           (axes[1], "wall16", "wall-clock speed-up over the 64-step target, batch 16")):
        tg = sorted((r for r in table if not r["draft"]), key=lambda r: r[key])
        ax.errorbar([r[key] for r in tg], [r["geneval"] for r in tg], yerr=[r["ci"] for r in tg], fmt="o-",
                    color="k", capsize=3, label="target at fewer MAR steps")
        for r in tg:
            ax.annotate(r["name"], (r[key], r["geneval"]), textcoords="offset points", xytext=(4, -10), fontsize=7)
        for r in (r for r in table if r["draft"]):
            ax.errorbar([r[key]], [r["geneval"]], yerr=[r["ci"]], fmt="s", capsize=3, label=r["name"])
        ax.set_xlabel(label)
        ax.set_ylabel("GenEval overall (95% interval)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", help="metrics.json of an experiment=eval/continuous_speed run")
    ap.add_argument("--out", required=True, help="folder for summary.txt, pareto.json and pareto.png")
    a = ap.parse_args(argv)
    table = rows(json.loads(Path(a.metrics).read_text()))
    if not table:
        raise ValueError(f"{a.metrics!r} has no '<strategy>/geneval/overall': give the metrics.json of an "
                         f"experiment=eval/continuous_speed run")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = lines(table)
    print("\n".join(text))
    res = {"rows": table, "front_passes": front(table, "passes"), "front_wall16": front(table, "wall16", False),
           "ahead_of": ahead_of(table)}
    atomic_write_text(out / "summary.txt", "\n".join(text) + "\n")
    atomic_write_text(out / "pareto.json", json.dumps(res, indent=1))
    plot(table, out / "pareto.png")
    return res


if __name__ == "__main__":
    main()
