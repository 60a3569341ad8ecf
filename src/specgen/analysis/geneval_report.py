"""GenEval task scores of a finished run at several sample counts, with image- and prompt-level intervals.

    python -m specgen.analysis.geneval_report <run>/results.csv [--samples 4 7 20] [--out report.csv]

A GenEval score is a mean over prompts and over samples of each prompt. With few samples per prompt the
sampling noise of the images dominates (one image of 96 moves a task score by 0.01); with few prompts, the
choice of prompts does. For each strategy and task this prints the score from the first K samples of every
prompt (K = 4 is GenEval's protocol; `all` uses every image the run made), the number of images, a binomial
95% half-width over images, and a 95% bootstrap interval that resamples prompts (each prompt keeps its
images), which also covers how much the score depends on which prompts were drawn.
"""
from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

from specgen.evaluation.geneval import TASKS
from specgen.utils.checkpoints import atomic_write_csv

REQUIRED = ("tag", "prompt", "correct")


def read_results(path: str | Path) -> list[dict]:
    """GenEval rows of a run's results.csv, each with its sample index (the order of a prompt's rows if the
    file predates the `sample` column: runs list a prompt's samples in order)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: pass a run folder of `python -m specgen.eval` "
                                f"(or its results.csv)")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: lacks the columns {missing}; expected a results.csv written by specgen.eval")
        rows = [r for r in reader if r.get("benchmark", "geneval") == "geneval" and r["tag"] in TASKS]
    if not rows:
        raise ValueError(f"{path}: no GenEval rows; run a GenEval benchmark first (e.g. experiment=eval/ar_shapes)")
    seen: dict[tuple[str, str], int] = defaultdict(int)
    for r in rows:
        key = (r.get("decoding", ""), r["prompt"])
        r["sample"] = int(r["sample"]) if r.get("sample") not in (None, "") else seen[key]
        seen[key] += 1
        if r["correct"] not in ("True", "False"):
            raise ValueError(f"{path}: correct={r['correct']!r} for {r['prompt']!r}; expected True or False")
        r["correct"] = r["correct"] == "True"
    return rows


def _boot_means(per_prompt: list[list[bool]], rng: np.random.Generator, resamples: int) -> np.ndarray:
    hits = np.array([sum(v) for v in per_prompt], dtype=float)
    counts = np.array([len(v) for v in per_prompt], dtype=float)
    idx = rng.integers(0, len(hits), size=(resamples, len(hits)))
    return hits[idx].sum(1) / counts[idx].sum(1)


def prompt_bootstrap(per_task: list[list[list[bool]]], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of task scores (a task score: mean over its images) when each
    task's prompts, with all their images, are resampled."""
    rng = np.random.default_rng(seed)
    means = np.mean([_boot_means(p, rng, resamples) for p in per_task], axis=0)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def _row(decoding: str, task: str, k: int | None, per_task: list[list[list[bool]]], resamples: int) -> dict:
    scores = [sum(map(sum, p)) / sum(map(len, p)) for p in per_task]
    score = float(np.mean(scores))
    n = [sum(map(len, p)) for p in per_task]
    var = sum(s * (1 - s) / m for s, m in zip(scores, n)) / len(scores) ** 2  # tasks independent
    lo, hi = prompt_bootstrap(per_task, resamples)
    return {"decoding": decoding, "task": task, "samples_per_prompt": "all" if k is None else k,
            "prompts": sum(map(len, per_task)), "images": sum(n), "correct": sum(sum(map(sum, p)) for p in per_task),
            "score": score, "binomial_ci95": 1.96 * float(np.sqrt(var)), "prompt_boot_lo": lo, "prompt_boot_hi": hi}


def report(rows: list[dict], samples: list[int | None], resamples: int = 2000) -> list[dict]:
    """Rows per (strategy, task, K): the score from the first K samples of each prompt (K None: all), then
    `overall` (the mean of the task scores, as GenEval reports it) for each strategy and K."""
    groups: dict[str, dict[str, dict[str, dict[int, bool]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(dict)))
    for r in rows:
        groups[r.get("decoding", "")][r["tag"]][r["prompt"]][r["sample"]] = r["correct"]
    out = []
    for decoding, tasks in sorted(groups.items()):
        order = sorted(tasks, key=TASKS.index)
        for k in samples:
            per_task = {}
            for tag in order:
                per_prompt = [[v for s, v in sorted(by_sample.items()) if k is None or s < k]
                              for by_sample in tasks[tag].values()]
                per_task[tag] = [v for v in per_prompt if v]
                out.append(_row(decoding, tag, k, [per_task[tag]], resamples))
            if len(order) > 1:
                out.append(_row(decoding, "overall", k, list(per_task.values()), resamples))
    return out


def format_report(table: list[dict]) -> str:
    lines = [f"{'strategy':<12}{'task':<15}{'K':>5}{'prompts':>9}{'images':>8}{'score':>10}{'+-img':>8}"
             f"{'prompt bootstrap 95%':>24}"]
    for r in table:
        lines.append(f"{r['decoding']:<12}{r['task']:<15}{r['samples_per_prompt']!s:>5}{r['prompts']:>9}{r['images']:>8}"
                     f"{r['score']:>10.4f}{r['binomial_ci95']:>8.3f}"
                     f"{'[' + format(r['prompt_boot_lo'], '.3f') + ', ' + format(r['prompt_boot_hi'], '.3f') + ']':>24}")
    return "\n".join(lines)


def _parse_k(text: str) -> int | None:
    if text == "all":
        return None
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"--samples {text!r}: give positive integers or 'all'")
    return k


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a run folder of specgen.eval, or its results.csv")
    ap.add_argument("--samples", nargs="+", type=_parse_k, default=[4, None],
                    help="sample counts per prompt to report (default: 4 all)")
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--out", help="also write the table as CSV here")
    a = ap.parse_args(argv)
    if a.resamples < 1:
        ap.error(f"--resamples {a.resamples}: give a positive number of bootstrap resamples (e.g. 2000)")
    table = report(read_results(a.results), a.samples, a.resamples)
    print(format_report(table))
    if a.out:
        atomic_write_csv(a.out, table)
    return table


if __name__ == "__main__":
    main()
