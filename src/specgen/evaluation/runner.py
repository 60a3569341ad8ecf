"""Evaluation job: backbone + decoding strategy + benchmarks -> metrics.json, results.csv, grid.png, W&B."""
from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from specgen.backbones.loading import file_id, weights_id
from specgen.evaluation.benchmarks import mixed_prompts
from specgen.evaluation.entropy import token_entropy
from specgen.evaluation.figures import (accept_maps_png, alpha_steps_png, captioned_grid, pareto_png,
                                         sweep_png)
from specgen.evaluation.generate import cache_key, generate_images, image_grid
from specgen.evaluation.geneval import TASKS, paired_difference
from specgen.evaluation.speed import compare, ops_table, prompts_needed
from specgen.evaluation.targets import targets_report, validate_targets
from specgen.utils.checkpoints import atomic_write_csv, atomic_write_text

log = logging.getLogger(__name__)


def speed_metrics(stats: list[dict]) -> dict[str, float]:
    """Mean per-image speed statistics: target passes, latency, and any numeric counters. Latency only when every
    image has one: images of a sharded run carry none (processes sharing a machine time nothing honestly)."""
    out = {}
    for key in stats[0]:
        vals = [s[key] for s in stats if isinstance(s.get(key), (int, float))]
        if key == "latency_s" and len(vals) < len(stats):  # some images were decoded by several processes at once
            continue
        if vals and key not in ("batch_size", "batch_wall_s"):
            out[key] = float(np.mean(vals))
    if "latency_s" in out:
        out["throughput_img_s"] = 1.0 / max(out["latency_s"], 1e-12)
    return out


def format_table(metrics: dict[str, float]) -> str:
    """Group flat `<decoding>/<section>/<name>` metrics into one aligned block per section."""
    sections: dict[str, list[tuple[str, float]]] = {}
    for key, value in metrics.items():
        head, _, name = key.rpartition("/")
        sections.setdefault(head or key, []).append((name, value))
    lines = []
    for head, items in sections.items():
        lines.append(f"[{head}]")
        order = {t: i for i, t in enumerate(TASKS + ("overall",))}
        for name, value in sorted(items, key=lambda kv: (order.get(kv[0], 99), kv[0])):
            lines.append(f"  {name:<18} {value:10.4f}")
    return "\n".join(lines)


def quality(cfg: DictConfig, backbone, decoding: DictConfig, benchmarks: list, out_dir: Path):
    """Generate (cached) and score the benchmarks' images for one strategy: (metrics, rows, grid, figures), where
    figures holds `samples` (a captioned sample grid), for speculative strategies `accept_map` (H, W), and `images`:
    the images of each benchmark that compares two strategies' images (`paired_difference`, e.g. FID), in job order."""
    name, decode_fn = decoding.name, instantiate(decoding.fn)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs_per_bench = [b.jobs(cfg.seed) for b in benchmarks]
    unique = unique_jobs(benchmarks, cfg.seed)
    cache_dir = image_cache_dir(cfg.paths.data_dir, backbone, decoding)
    log.info("%d images for %s (cache: %s)", len(unique), name, cache_dir)
    images, stats = generate_images(unique, backbone, decode_fn, cache_dir, strategy_batch_size(cfg, decoding),
                                    desc=f"{name}")
    by_key = {j.key: (img, st) for j, img, st in zip(unique, images, stats)}
    metrics, rows = {}, []
    for bench, jobs in zip(benchmarks, jobs_per_bench):
        scores, bench_rows = bench.score(jobs, [by_key[j.key][0] for j in jobs])
        metrics.update({f"{name}/{bench.name}/{k}": v for k, v in scores.items()})
        rows += [dict(r, decoding=name) for r in bench_rows]
    metrics.update({f"{name}/speed/{k}": v for k, v in speed_metrics(stats).items()})
    metrics[f"{name}/num_images"] = float(len(unique))
    figures = {"images": {b.name: [by_key[j.key][0] for j in jobs] for b, jobs in zip(benchmarks, jobs_per_bench)
                          if hasattr(b, "paired_difference")}}
    maps = [np.asarray(st["accept_map"], dtype=float) for st in stats if "accept_map" in st]
    if maps:
        figures["accept_map"] = np.mean(maps, 0)
        accept_maps_png({f"{name}: first-pass acceptance": figures["accept_map"]}, out_dir / f"accept_map_{name}.png")
    metrics.update(alpha_by_step(name, stats))
    shown = jobs_per_bench[0][:: max(1, cfg.grid_stride)]
    grid = image_grid([by_key[j.key][0] for j in shown][: cfg.grid_images], ncols=cfg.grid_cols)
    shown = shown[: cfg.caption_images]
    figures["samples"] = captioned_grid([by_key[j.key][0] for j in shown], [j.prompt for j in shown],
                                        ncols=min(6, len(shown)))
    return metrics, rows, grid, figures


def unique_jobs(benchmarks: list, seed: int) -> list:
    """The (prompt, seed) jobs of all benchmarks, each image once, in the benchmarks' order."""
    unique = list({j.key: j for b in benchmarks for j in b.jobs(seed)}.values())
    if not unique:
        raise ValueError(f"the benchmarks {[b.name for b in benchmarks]} ask for no images (no prompts, or zero "
                         f"samples per prompt): check their prompt files and counts, or run with benchmark=none "
                         f"and a speed section for speed alone")
    return unique


def image_cache_dir(data_dir: str, backbone, decoding: DictConfig) -> Path:
    """The image cache of one strategy on one backbone: keyed by the backbone's weights and precision (a suffix where
    it is not float32), the decoding config and the weights of every model that config loads."""
    fn_cfg = OmegaConf.to_container(decoding.fn, resolve=True)
    dtype = getattr(backbone, "dtype", torch.float32)
    name = backbone.identity + ("" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch."))
    return Path(data_dir) / "image_cache" / name / cache_key(fn_cfg, _weights_ids(fn_cfg))


def strategy_batch_size(cfg: DictConfig, decoding: DictConfig) -> int:
    """Images per decoding batch: the strategy's own `batch_size` (SJD asks for smaller ones), else the run's."""
    return decoding.get("batch_size") or cfg.batch_size


def quality_strategies(cfg: DictConfig) -> list[DictConfig]:
    """The decoding configs whose benchmark images a run generates: every strategy of a speed run, else `decoding`."""
    return list(cfg.strategies.values()) if cfg.get("speed") else [cfg.decoding]


def run_speed(cfg: DictConfig, backbone=None, benchmarks: list | None = None) -> dict[str, float]:
    """Every strategy of `cfg.strategies` on the same prompts and seeds: quality on the configured
    benchmarks (if any), then speed side by side (the first strategy is the reference)."""
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = OmegaConf.to_container(cfg.targets, resolve=True) if cfg.get("targets") else None
    if targets:  # a malformed spec fails now, not after the run
        validate_targets(targets, [s.name for s in cfg.strategies.values()])
    backbone = instantiate(cfg.generator) if backbone is None else backbone
    benchmarks = build_benchmarks(cfg) if benchmarks is None else benchmarks
    metrics, rows, maps, images = {}, [], {}, {}
    for dec in cfg.strategies.values():
        if benchmarks:
            m, r, grid, figs = quality(cfg, backbone, dec, benchmarks, out_dir)
            images[dec.name] = figs["images"]
            Image.fromarray(grid).save(out_dir / f"grid_{dec.name}.png")
            Image.fromarray(figs["samples"]).save(out_dir / f"samples_{dec.name}.png")
            if "accept_map" in figs:
                maps[dec.name] = figs["accept_map"]
            metrics.update({k: v for k, v in m.items() if "/speed/" not in k})
            rows += r
    metrics.update(geneval_differences(rows, [s.name for s in cfg.strategies.values()]))
    metrics.update(image_differences(benchmarks, images, [s.name for s in cfg.strategies.values()]))
    strategies = {s.name: instantiate(s.fn) for s in cfg.strategies.values()}
    batch_sizes, min_batches = list(cfg.speed.batch_sizes), int(cfg.speed.get("min_batches") or 1)
    prompts = speed_prompts(cfg, benchmarks, prompts_needed(cfg.speed.num_prompts, batch_sizes, min_batches))
    streams = tuple(s.name for s in cfg.strategies.values() if s.get("stream"))
    speed = compare(backbone, strategies, prompts, batch_sizes, cfg.speed.repeats, streams, min_batches,
                    cfg.speed.num_prompts, bool(cfg.speed.get("count_ops")))
    metrics.update(speed)
    grid = getattr(backbone, "grid", None)
    for name in strategies:
        if f"{name}/speed/accept_rate" in speed:  # headline acceptance rate of speculative strategies
            metrics[f"{name}/accept_rate"] = speed[f"{name}/speed/accept_rate"]
        if grid is not None:  # visual tokens per target pass (plain AR: just under 1)
            for key in [k for k in speed if k.startswith(f"{name}/speed/nfe") and "ratio" not in k and "ci95" not in k]:
                metrics[key.replace("/nfe", "/accept_len")] = grid.num_visual_tokens / speed[key]
    ref = next(iter(cfg.strategies.values()))
    if grid is not None and ref.name == "ar" and cfg.speed.get("entropy_prompts", 0):
        fn = ref.fn
        ent = token_entropy(backbone, prompts[: cfg.speed.entropy_prompts], fn.get("cfg_scale", 1.0),
                            fn.get("temperature", 1.0), fn.get("top_k"), seed=cfg.seed)
        metrics.update({f"ar/{k}": v for k, v in ent.items()})
    atomic_write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if rows:  # speed-only runs have none
        atomic_write_csv(out_dir / "results.csv", rows)
    names = list(strategies)
    speed_figures(cfg, metrics, names, maps, out_dir)
    table = summary_table(metrics, names, list(cfg.speed.batch_sizes))
    dtype = str(getattr(backbone, "dtype", torch.float32)).removeprefix("torch.")
    table += f"\n(target backbone in {dtype}, {torch.get_num_threads()} torch threads)"
    ops = ops_table(metrics, names, batch_sizes)
    table += f"\n\n{ops}" if ops else ""
    if targets:  # the experiment's targets: met, floor or missed, under the table
        table += "\n\n" + targets_report(metrics, targets, names[0], names)
    atomic_write_text(out_dir / "summary.txt", table + "\n")
    _log(cfg, metrics, None, rows, out_dir, summary_rows(metrics, names, list(cfg.speed.batch_sizes)))
    print(format_table(metrics))
    print(table)
    return metrics


def geneval_differences(rows: list[dict], names: list[str]) -> dict[str, float]:
    """Each strategy's GenEval overall minus the first strategy's (the reference) on the same images, with its
    paired 95% interval: `<name>/geneval/overall_diff` (and `_ci95`, `diff_pairs`)."""
    per = defaultdict(list)
    for r in rows:
        if r.get("benchmark") == "geneval":
            per[r["decoding"]].append(r)
    if not names or names[0] not in per:
        return {}
    out = {}
    for name in names[1:]:
        d = paired_difference(per.get(name, []), per[names[0]])
        out.update({f"{name}/geneval/{k}": v for k, v in d.items()})
    return out


def image_differences(benchmarks: list, images: dict[str, dict[str, list]], names: list[str]) -> dict[str, float]:
    """Each strategy's score minus the first strategy's on the benchmarks that compare two strategies' images
    (`paired_difference`: FID), from `images[strategy][benchmark]` in job order: `<name>/fidelity/fid_diff` and
    `_ci95`."""
    out = {}
    for bench in [b for b in benchmarks if hasattr(b, "paired_difference")]:
        if not names or bench.name not in images.get(names[0], {}):
            continue
        for name in [n for n in names[1:] if bench.name in images.get(n, {})]:
            d = bench.paired_difference(images[name][bench.name], images[names[0]][bench.name])
            out.update({f"{name}/{bench.name}/{k}": v for k, v in d.items()})
    return out


def speed_figures(cfg: DictConfig, metrics: dict[str, float], names: list[str], maps: dict[str, np.ndarray],
                  out_dir: Path) -> None:
    """The PNGs of a side-by-side run: quality vs passes and wall clock (Pareto), every swept setting, the
    acceptance maps side by side, and CSpD's alpha along the steps."""
    batch_sizes = list(cfg.speed.batch_sizes)
    pareto_png(metrics, names, out_dir / "speed_quality.png", min(batch_sizes))
    for key, series in swept_settings(cfg).items():
        sweep_png(metrics, series, key, out_dir / f"sweep_{key}.png", batch_sizes, ref=names[0])
    if len(maps) > 1:
        accept_maps_png(maps, out_dir / "accept_maps.png")
    if any("/alpha_by_step/" in k for k in metrics):
        alpha_steps_png(metrics, names, out_dir / "alpha_steps.png")


def swept_settings(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """Numeric decoding settings that a run's strategies sweep: {setting: {strategy: value}} for every setting on
    which three or more strategies differ while agreeing on everything else (e.g. `experiment=ablation/ssd_rounds`)."""
    flat = {s.name: _flatten(OmegaConf.to_container(s.fn, resolve=True)) for s in cfg.strategies.values()}
    out = {}
    for key in {k for f in flat.values() for k in f}:
        groups: dict[str, dict[str, float]] = {}
        for name, f in flat.items():
            value = f.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rest = json.dumps({k: v for k, v in f.items() if k != key}, sort_keys=True, default=str)
                group = groups.setdefault(rest, {})
                if float(value) not in group.values():  # a strategy identical to an earlier one adds no point
                    group[name] = float(value)
        best = max(groups.values(), key=len, default={})
        if len(best) >= 3:
            out[key.rsplit(".", 1)[-1]] = best
    return out


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        return {k: v for key, val in node.items() for k, v in _flatten(val, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


def speed_prompts(cfg: DictConfig, benchmarks: list = (), n: int | None = None) -> list[str]:
    """The speed section's prompts (`n`, default `speed.num_prompts`): `speed.prompts` (class ids for
    class-conditional models) repeated to n; with `speed.prompt_source=benchmark`, the first benchmark's own prompts
    (a real backbone's prompt file); else held-out prompts of the embedded world."""
    n = n or cfg.speed.num_prompts
    given = cfg.speed.get("prompts")
    if given:
        return [str(given[i % len(given)]) for i in range(n)]
    if cfg.speed.get("prompt_source", "world") == "benchmark" and benchmarks:
        return list(dict.fromkeys(j.prompt for j in benchmarks[0].jobs(cfg.seed)))[:n]
    return [m["prompt"] for m in mixed_prompts("test", n, cfg.seed)]


def summary_rows(metrics: dict[str, float], names: list[str], batch_sizes: list[int]) -> tuple[list[str], list[list]]:
    """(column headings, one row of cells per strategy): passes (at the largest batch size) and pass ratios against
    the reference (per batch size when there are several; a streaming strategy's at batch > 1 are per batch of that
    size, see `speed.measure`), wall-clock ratios, image positions fed to the target per image at the smallest batch
    size (a pass's compute follows them), tokens per pass,
    and every quality benchmark that ran (GenEval and DPG with their 95% intervals, CLIPScore, FID with its sample
    size and its bootstrap interval, FID and GenEval minus the first strategy's on the same prompts with their paired
    intervals); '-' where a strategy has no value."""
    ratios = [("speed/nfe_ratio", "nfe ratio", "{:.2f}")] if len(batch_sizes) < 2 else \
        [(f"speed/nfe_ratio_bs{b}", f"nfe x bs{b}", "{:.2f}") for b in batch_sizes]
    cols = [("speed/nfe", "nfe", "{:.1f}")] + ratios \
        + [(f"speed/wall_ratio_bs{b}", f"wall x bs{b}", "{:.2f}") for b in batch_sizes] \
        + [(f"speed/tokens_fed_bs{min(batch_sizes)}", f"fed bs{min(batch_sizes)}", "{:.0f}")] \
        + [("speed/accept_len", "tok/pass", "{:.2f}"), ("accept_rate", "accept", "{:.2f}"),
           ("dpg/overall", "DPG", "{:.1f}", True), ("clipscore/clipscore_100cos", "CLIP 100cos", "{:.1f}"),
           ("fidelity/fid", "FID", "{:.2f}", True), ("fidelity/fid_diff", f"FID - {names[0]}", "{:+.2f}", True),
           ("geneval/overall_diff", f"GenEval - {names[0]}", "{:+.3f}", True),
           ("geneval/overall", "GenEval (95%)", "{:.3f}", True)]
    cols = [c for c in cols if any(f"{n}/{c[0]}" in metrics for n in names)]
    fid_n = next((metrics[f"{n}/fidelity/num_images"] for n in names if f"{n}/fidelity/num_images" in metrics), None)
    heads = ["strategy"] + [c[1] + (f" (n={int(fid_n)})" if c[0] == "fidelity/fid" and fid_n else "") for c in cols]
    rows = [[n] + [_cell(metrics, f"{n}/{c[0]}", c[2], with_ci=len(c) > 3) for c in cols] for n in names]
    return heads, rows


def _cell(metrics: dict[str, float], key: str, fmt: str, with_ci: bool = False) -> str:
    """One table cell: the value (with its 95% interval `<key>_ci95` where the column shows one and the run measured
    it), or '-'."""
    if key not in metrics:
        return "-"
    ci = metrics.get(f"{key}_ci95") if with_ci else None
    return fmt.format(metrics[key]) + ("" if ci is None else f" +-{fmt.replace('{:+', '{:').format(ci)}")


def summary_table(metrics: dict[str, float], names: list[str], batch_sizes: list[int]) -> str:
    """`summary_rows` as aligned text (the table a run prints)."""
    heads, rows = summary_rows(metrics, names, batch_sizes)
    w = max([14] + [len(n) + 2 for n in names])  # the name column fits the longest strategy name
    widths = [w] + [max(18 if h.startswith("GenEval") else 14, len(h) + 2) for h in heads[1:]]
    fmt = lambda cells: f"{cells[0]:<{w}}" + "".join(f"{c:>{wd}}" for c, wd in zip(cells[1:], widths[1:]))  # noqa: E731
    return "\n".join([fmt(heads)] + [fmt(r) for r in rows])


def alpha_by_step(name: str, stats: list[dict]) -> dict[str, float]:
    """CSpD's acceptance rate at each MAR generation step, pooled over the images (`<name>/alpha_by_step/sNN`);
    steps with no drafted token (pre-fill) are left out."""
    per = [(np.asarray(st["step_drafted"], float), np.asarray(st["step_accepted"], float))
           for st in stats if "step_drafted" in st]
    if not per:
        return {}
    drafted, accepted = (np.sum([p[i] for p in per], 0) for i in (0, 1))
    return {f"{name}/alpha_by_step/s{i:02d}": float(accepted[i] / drafted[i])
            for i in range(len(drafted)) if drafted[i] > 0}






def run(cfg: DictConfig, backbone=None, benchmarks: list | None = None) -> dict[str, float]:
    """Generate (or read from the image cache) and score; `backbone` and `benchmarks` are built from `cfg` unless
    given (a sharded run hands over those it built on rank 0)."""
    if cfg.get("speed"):
        return run_speed(cfg, backbone, benchmarks)
    out_dir = Path(cfg.paths.output_dir)
    backbone = instantiate(cfg.generator) if backbone is None else backbone
    benchmarks = build_benchmarks(cfg) if benchmarks is None else benchmarks
    metrics, rows, grid, figs = quality(cfg, backbone, cfg.decoding, benchmarks, out_dir)
    atomic_write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if rows:  # speed-only runs have none
        atomic_write_csv(out_dir / "results.csv", rows)
    Image.fromarray(grid).save(out_dir / "grid.png")
    Image.fromarray(figs["samples"]).save(out_dir / "samples.png")
    _log(cfg, metrics, grid, rows, out_dir)
    print(format_table(metrics))
    return metrics


def build_benchmarks(cfg: DictConfig) -> list:
    """The configured benchmarks. Entries without `_target_` are settings an experiment gave for a benchmark
    that `benchmark=none` (or another choice) removed: they are skipped with a note, not an error."""
    out = []
    for name, node in (cfg.get("benchmark") or {}).items():
        if node is None or not isinstance(node, DictConfig):  # None, or a shared setting (benchmark.prompts_path)
            continue
        if "_target_" not in node:
            log.info("benchmark %r has settings but no benchmark chosen (benchmark=none?): skipped", name)
            continue
        out.append(instantiate(node))
    return out




def _weights_ids(node) -> list[str]:
    """Weights identities of every model a decoding config loads (exported drafters, released checkpoints):
    part of the cache key."""
    if isinstance(node, dict):
        here = [weights_id(node["dirpath"])] if "dirpath" in node else []
        here += [file_id(node["weights_path"])] if node.get("weights_path") else []
        return here + [i for v in node.values() for i in _weights_ids(v)]
    return []


def _log(cfg: DictConfig, metrics: dict, grid: np.ndarray | None, rows: list[dict], out_dir: Path,
         summary: tuple[list[str], list[list]] | None = None) -> None:
    """Metrics, the run's PNGs (as images), its per-image results and its summary (as tables) to every logger."""
    pngs = sorted(out_dir.glob("*.png"))
    for lg_cfg in (cfg.get("logger") or {}).values():
        if lg_cfg is None:
            continue
        logger = instantiate(lg_cfg)
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
        logger.log_metrics(metrics)
        if hasattr(logger, "log_image"):
            if grid is not None:
                logger.log_image("eval/grid", [grid.astype(np.uint8)])  # uint8: W&B does not rescale floats
            for png in pngs:  # paths: W&B reads the files as written
                logger.log_image(f"eval/figures/{png.stem}", [str(png)])
        if hasattr(logger, "log_table"):
            if rows:
                # one type per column: GenEval marks images correct (bool), DPG scores them (float)
                # (the union of the benchmarks' columns, as in results.csv; missing cells are None)
                columns = list(dict.fromkeys(k for r in rows for k in r))
                data = [[float(v) if isinstance(v, bool) else v for v in (r.get(c) for c in columns)] for r in rows]
                logger.log_table("eval/results", columns=columns, data=data)
            if summary:  # one row per strategy, as the printed table
                logger.log_table("eval/summary", columns=summary[0], data=summary[1])
        logger.finalize("success")
