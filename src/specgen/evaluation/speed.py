"""Speed of decoding strategies measured side by side: same backbone, prompts, seeds and process.

For each batch size and strategy: one warm-up batch, then `repeats` timed passes over the prompts
(device synchronised), the fixed-batch strategies interleaved batch by batch (each batch decoded by every strategy in
turn), so that the machine's changing speed on shared cores does not favour one of them; continuous-batching
strategies (one call over all prompts) are timed after them. Reports latency per image, throughput, target passes (NFE) per image with a 95% interval over batches,
draft calls, and peak memory (CUDA allocator on GPU; the process's peak RSS, reset per measurement,
on CPU), plus wall-clock and NFE ratios against the reference strategy (the first one listed). With `count_ops`, one
more decode of each strategy's first batch counts the aten ops it dispatches (`decoding.trace.OpCount`), per target
pass, per target forward and per drafted token, apart from the timed decodes (counting slows a decode).
"""
from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path

import numpy as np
import torch

from specgen.decoding.sampling import make_rngs
from specgen.decoding.trace import OpCount
from specgen.utils.stats import mean_ci95

log = logging.getLogger(__name__)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _add_extra(extra: dict, stats: dict, images: int) -> None:
    """Collect a call's other statistics: per call (scalars) or per image (1-D, one per prompt; averaged over
    images later)."""
    for k, v in stats.items():
        if k in ("nfe", "draft_calls"):
            continue
        if isinstance(v, (int, float)):
            extra.setdefault(k, []).append(float(v))
        elif isinstance(v, torch.Tensor) and v.dim() == 1 and len(v) == images:
            extra.setdefault(k, []).extend(v.detach().float().cpu().tolist())


def measure(backbone, decode_fn, prompts: list[str], batch_size: int, repeats: int = 1, seed: int = 0,
            stream: bool = False) -> dict:
    """Latency/throughput/NFE/memory of one strategy at one batch size. `stream` (batch sizes above 1): the
    decoder takes every prompt in one call with `slots=batch_size` (continuous batching) instead of fixed batches."""
    if stream and batch_size > 1:
        return _measure_stream(backbone, decode_fn, prompts, batch_size, repeats, seed)
    return measure_interleaved(backbone, {"only": decode_fn}, prompts, batch_size, repeats, seed)["only"]


def measure_interleaved(backbone, decode_fns: dict, prompts: list[str], batch_size: int, repeats: int = 1,
                        seed: int = 0) -> dict[str, dict]:
    """`measure` of several fixed-batch strategies at once: every batch is decoded by each strategy in turn, with the
    same seeds, so that a change of the machine's speed during the run (shared cores) reaches every strategy alike
    and cancels in the wall-clock ratios, instead of favouring whichever strategy ran while the machine was fast.
    Peak memory is reset before each call and kept per strategy."""
    device = backbone.device
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    ids = [backbone.prompts(b) for b in batches]
    for fn in decode_fns.values():  # warm-up
        with torch.inference_mode():
            fn(backbone, ids[0], rngs=make_rngs(range(len(batches[0])), device))
    acc = {name: {"wall": 0.0, "nfe": [], "drafts": [], "extra": {}, "peak": []} for name in decode_fns}
    n, total, start = 0, repeats * len(ids), time.perf_counter()
    every = max(1, total // 10)  # progress about ten times per call
    for r in range(repeats):
        for b, x in enumerate(ids):
            seeds = [seed + 1000 * r + b * batch_size + i for i in range(len(x))]
            for name, fn in decode_fns.items():
                a = acc[name]
                rngs = make_rngs(seeds, device)
                _reset_peak(device)
                _sync(device)
                t0 = time.perf_counter()
                with torch.inference_mode():  # every strategy alike: no autograd bookkeeping on any tensor
                    _, stats = fn(backbone, x, rngs=rngs)
                _sync(device)
                a["wall"] += time.perf_counter() - t0
                a["peak"].append(_peak_mb(device))
                a["nfe"].append(stats["nfe"])
                a["drafts"].append(stats.get("draft_calls", 0))
                _add_extra(a["extra"], stats, len(x))
            n += len(x)
            done = r * len(ids) + b + 1
            if done % every == 0 or done == total:
                spent = time.perf_counter() - start
                log.info("speed at batch %d: %d/%d batches of %d strategies, %.0f s, about %.0f s left",
                         batch_size, done, total, len(decode_fns), spent, spent * (total - done) / done)
    # nfe_ci95: the 95% interval of the mean passes per batch (at batch 1: per image); 0 for a constant count (AR's)
    out = {}
    for name, a in acc.items():
        peak = [v for v in a["peak"] if not np.isnan(v)]
        out[name] = {"latency_s": a["wall"] / n, "throughput_img_s": n / a["wall"], "nfe": float(np.mean(a["nfe"])),
                     "nfe_ci95": mean_ci95(a["nfe"]), "draft_calls": float(np.mean(a["drafts"])),
                     "peak_mem_mb": max(peak) if peak else float("nan"), "images": float(n),
                     **{k: float(np.mean(v)) for k, v in a["extra"].items()}}
    return out


def _measure_stream(backbone, decode_fn, prompts: list[str], slots: int, repeats: int, seed: int) -> dict:
    """`measure` for a continuous-batching decoder: all prompts in one call, at most `slots` in flight, the same
    per-image seeds as fixed batches. `nfe` is per batch of `slots` images, (stream passes) x slots / prompts, so
    it compares with a fixed-batch strategy's passes per batch; its interval comes from the per-image passes'
    (the stream's passes are about their sum over slots x occupancy)."""
    device = backbone.device
    ids = backbone.prompts(prompts)
    with torch.inference_mode():  # warm-up
        decode_fn(backbone, ids[:slots], rngs=make_rngs(range(min(slots, len(prompts))), device), slots=slots)
    _reset_peak(device)
    wall, nfe, drafts, extra, per_image = 0.0, [], [], {}, []
    for r in range(repeats):
        rngs = make_rngs([seed + 1000 * r + i for i in range(len(prompts))], device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            _, stats = decode_fn(backbone, ids, rngs=rngs, slots=slots)
        _sync(device)
        wall += time.perf_counter() - t0
        nfe.append(stats["nfe"] * slots / len(prompts))
        drafts.append(stats.get("draft_calls", 0) * slots / len(prompts))
        per_image += stats["image_passes"].float().cpu().tolist()
        _add_extra(extra, stats, len(prompts))
    n = len(prompts) * repeats
    mean_nfe = float(np.mean(nfe))
    rel = mean_ci95(per_image) / float(np.mean(per_image))
    return {"latency_s": wall / n, "throughput_img_s": n / wall, "nfe": mean_nfe, "nfe_ci95": mean_nfe * rel,
            "draft_calls": float(np.mean(drafts)), "peak_mem_mb": _peak_mb(device), "images": float(n),
            "stream": 1.0, **{k: float(np.mean(v)) for k, v in extra.items()}}


def count_ops(backbone, decode_fn, prompts: list[str], batch_size: int, stream: bool = False, seed: int = 0) -> dict:
    """The aten ops of one decode of the first `batch_size` prompts (`OpCount.summary`: per pass, per target forward,
    per drafted token), a stream's with `slots=batch_size` over those prompts. A decoder that takes no `trace`
    is counted whole: its total and ops per pass only (its regions unknown)."""
    batch = backbone.prompts(prompts[:batch_size])
    kwargs = {"slots": batch_size} if stream and batch_size > 1 else {}
    takes_trace = "trace" in inspect.signature(decode_fn).parameters
    with torch.inference_mode(), OpCount() as ops:
        if takes_trace:
            kwargs["trace"] = ops
        _, stats = decode_fn(backbone, batch, rngs=make_rngs([seed + i for i in range(len(batch))], backbone.device),
                             **kwargs)
    out = ops.summary(int(stats["nfe"]))
    return out if takes_trace else {k: out[k] for k in ("ops", "ops_per_pass")}


def compare(backbone, strategies: dict, prompts: list[str], batch_sizes: list[int], repeats: int = 1,
            streams: tuple[str, ...] = (), min_batches: int = 1, num_prompts: int | None = None,
            ops: bool = False) -> dict:
    """Flat metrics `<name>/speed/<key>_bs<B>` for every strategy, ratios against the first one. Strategies named in
    `streams` decode with continuous batching at batch sizes above 1 (see `measure`). At batch size B every
    strategy gets the first max(num_prompts, min_batches x B) prompts (`num_prompts`: default all), so that a
    stream has prompts to refill its slots with; give at least `prompts_needed(...)` of them. `ops`: also the aten
    ops of one batch per strategy (`count_ops`), with `ops_ratio` their ops per pass over the reference's."""
    out: dict[str, float] = {}
    ref = next(iter(strategies))
    need = prompts_needed(num_prompts or len(prompts), batch_sizes, min_batches)
    if len(prompts) < need:
        raise ValueError(f"{len(prompts)} speed prompts for min_batches={min_batches} at batch sizes {batch_sizes}: "
                         f"give {need} (prompts_needed), or lower speed.min_batches")
    for bs in batch_sizes:
        use = prompts[: max(num_prompts or len(prompts), min_batches * bs)]
        fixed = {name: fn for name, fn in strategies.items() if not (name in streams and bs > 1)}
        log.info("speed: %s at batch %d (%d prompts, interleaved batch by batch)", ", ".join(fixed), bs, len(use))
        results = measure_interleaved(backbone, fixed, use, bs, repeats)
        for name, fn in strategies.items():
            if name not in fixed:
                log.info("speed: %s at batch %d (%d prompts, continuous batching)", name, bs, len(use))
                results[name] = measure(backbone, fn, use, bs, repeats, stream=True)
        results = {name: results[name] for name in strategies}  # the reference first
        if ops:  # after the timed decodes: counting slows a decode
            log.info("speed: counting aten ops of one batch of %d per strategy", bs)
            for name, fn in strategies.items():
                results[name].update(count_ops(backbone, fn, use, bs, name in streams))
                results[name]["ops_ratio"] = results[name]["ops_per_pass"] / results[ref]["ops_per_pass"]
        for name, res in results.items():
            res["wall_ratio"] = results[ref]["latency_s"] / res["latency_s"]
            res["nfe_ratio"] = results[ref]["nfe"] / res["nfe"]
            # first-order interval of the ratio from both means' intervals (the reference's is 0 for AR)
            res["nfe_ratio_ci95"] = res["nfe_ratio"] * float(np.hypot(res["nfe_ci95"] / res["nfe"],
                                                                     results[ref]["nfe_ci95"] / results[ref]["nfe"]))
            out.update({f"{name}/speed/{k}_bs{bs}": v for k, v in res.items()})
            if bs == max(batch_sizes):  # the largest batch also under plain names
                out.update({f"{name}/speed/{k}": v for k, v in res.items()})
    return out


def prompts_needed(num_prompts: int, batch_sizes: list[int], min_batches: int = 1) -> int:
    """How many prompts `compare` needs: `num_prompts`, or `min_batches` batches of the largest batch size."""
    return max([num_prompts] + [min_batches * b for b in batch_sizes])


def ops_table(metrics: dict[str, float], names: list[str], batch_sizes: list[int]) -> str:
    """The aten-op counts of a run with `count_ops` as the lines it prints under its table ('' without them): per
    batch size, each strategy's ops per target pass (and over the reference's), per target forward, drafting and
    the rest per pass, and drafting's ops per drafted token ('-' for a decoder that reports no regions)."""
    if not any(f"{n}/speed/ops_per_pass_bs{b}" in metrics for n in names for b in batch_sizes):
        return ""
    w = max([14] + [len(n) + 2 for n in names])
    cols = [("ops_per_pass", "ops/pass", "{:.0f}"), ("ops_ratio", f"x {names[0]}", "{:.2f}"),
            ("ops_per_forward", "in forward", "{:.0f}"), ("ops_draft_per_pass", "drafting", "{:.0f}"),
            ("ops_other_per_pass", "other", "{:.0f}"), ("ops_per_drafted_token", "/drafted tok", "{:.1f}")]
    lines = ["aten ops (one batch per strategy, counted apart from the timing): per target pass, in one target "
             "forward, drafting and the rest per pass, drafting per drafted token"]
    for b in batch_sizes:
        lines.append(f"{f'batch {b}':<{w}}" + "".join(f"{h:>13}" for _, h, _ in cols))
        for n in names:
            if f"{n}/speed/ops_per_pass_bs{b}" in metrics:
                cells = [fmt.format(metrics[f"{n}/speed/{k}_bs{b}"]) if f"{n}/speed/{k}_bs{b}" in metrics else "-"
                         for k, _, fmt in cols]
                lines.append(f"{n:<{w}}" + "".join(f"{c:>13}" for c in cells))
    return "\n".join(lines)
