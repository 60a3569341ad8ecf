"""Collect a Hydra sweep folder (or several run folders) into one table.

    python -m specgen.evaluation.collect <sweep_dir> [--metrics geneval] [--out table.csv]

Each job folder holds metrics.json and .hydra/overrides.yaml; the table has one row per job,
its overrides as the first columns and every metric matching `--metrics` after them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from specgen.utils.checkpoints import atomic_write_csv
from specgen.utils.plots import pyplot


def collect(root: str | Path, pattern: str | list[str] = "") -> list[dict]:
    patterns = [pattern] if isinstance(pattern, str) else list(pattern) or [""]
    rows = []
    for metrics_file in sorted(Path(root).rglob("metrics.json"), key=lambda p: str(p)):
        job = metrics_file.parent
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        row = {"job": str(job.relative_to(root)) if job != Path(root) else "."}
        row.update(o.split("=", 1) for o in overrides if "=" in o and not o.startswith("hydra."))
        metrics = json.loads(metrics_file.read_text())
        prefixes = {k.split("/", 1)[0] for k in metrics if "/" in k}
        keep = {k: v for k, v in metrics.items() if any(p in k for p in patterns)}
        if len(prefixes) == 1:  # one strategy per job: strip its prefix so that jobs share columns
            row.update({k.split("/", 1)[1] if "/" in k else k: v for k, v in keep.items()})
            row["decoding"] = next(iter(prefixes))
        else:  # side-by-side jobs (several strategies): keep <strategy>/<metric>
            row.update(keep)
            row["decoding"] = "+".join(sorted(prefixes))
        rows.append(row)
    if not rows:
        raise FileNotFoundError(f"no metrics.json under {str(root)!r}: point at a run or sweep folder of specgen.eval")
    return rows


def format_rows(rows: list[dict], drop_constant: bool = True) -> str:
    """Aligned text table; overrides shared by every job are left out (they say nothing)."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    if drop_constant and len(rows) > 1:
        cols = [c for c in cols if c in ("job", "decoding") or "/" in c
                or len({str(r.get(c)) for r in rows}) > 1]
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def pareto_plot(rows: list[dict], x: str, y: str, path: str | Path, label: str = "decoding") -> bool:
    """Scatter of y against x, one point per job labelled by `label` (and its varying overrides), with y's 95%
    interval where the jobs report `<y>_ci95`; PNG."""
    pts = [(r[x], r[y], r) for r in rows if isinstance(r.get(x), float) and isinstance(r.get(y), float)]
    if not pts:
        return False
    plt = pyplot()
    varying = [c for c in dict.fromkeys(k for r in rows for k in r) if "/" not in c and c not in ("job", label)
               and len({str(r.get(c)) for r in rows}) > 1]
    fig, ax = plt.subplots(figsize=(5, 4), dpi=120)
    for px, py, r in pts:
        ci = r.get(f"{y}_ci95")  # the job's 95% interval of y, where the run measured one
        ax.errorbar([px], [py], yerr=[ci] if isinstance(ci, float) else None, fmt="o", ms=5, capsize=3)
        text = " ".join([str(r.get(label, ""))] + [f"{c.split('.')[-1]}={r.get(c)}" for c in varying])
        ax.annotate(text, (px, py), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="a sweep folder (logs/<task>/multiruns/<time>) or a run folder")
    ap.add_argument("--metrics", nargs="+", default=[""],
                    help="keep metrics whose name contains any of these (e.g. geneval, ssd/speed/nfe_ratio)")
    ap.add_argument("--out", default=None, help="also write the table as CSV here")
    ap.add_argument("--plot", nargs=2, metavar=("X", "Y"), default=None,
                    help="also write <root>/pareto.png of metric Y against X, e.g. speed/wall_ratio geneval/overall")
    args = ap.parse_args()
    rows = collect(args.root, args.metrics)
    print(format_rows(rows))
    if args.plot and pareto_plot(collect(args.root), *args.plot, Path(args.root) / "pareto.png"):
        print(f"wrote {Path(args.root) / 'pareto.png'}")
    if args.out:
        atomic_write_csv(args.out, rows)


if __name__ == "__main__":
    main()
