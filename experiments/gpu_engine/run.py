"""SSD as an engine on one GPU: AR, `ssd`, SJD and ZipAR at batch 1 and 16, on two backbones, in one run.

- `embedded`: the shipped 5M-parameter backbone (checkpoints/ar_shapes, 16x16 grid) with the shipped drafter
  (checkpoints/fphi_gpu): passes, wall ratios and overheads as users of this repo meet them;
- `paper_shape`: a randomly initialised backbone of Janus-Pro-1B's decoder shape (a Llama of 24 layers, width 2048,
  16 heads, ffn 5632; 16384 codes on a 24x24 grid without end-of-row tokens) in bfloat16, with an untrained f_phi of
  its width (the shipped drafter's architecture: row context, left context). Its passes say nothing about a trained
  pair; its cost per pass and the share of the wall clock spent outside the target's forwards do.

Per backbone and batch size, each strategy (the decoding configs' settings; `ssd` as a stream of `batch` slots
above batch 1, as the benchmark decodes it) is timed over the same prompts and seeds, batch by batch in turn, device
synchronised; then one batch again with every target forward timed (synchronised at its edges) for the overhead
share, 1 - (time in target forwards) / wall; then (the embedded backbone; `--ops`) one batch under an aten-op
counter (`decoding.trace.OpCount`). No whole-decode warm-up: a few forwards of each batch size's shapes warm the
kernels first. The timings of every block (embedded bs1, bs16, paper_shape bs1, bs16) come first, then the clocked
decodes, then the counts; a measurement that would start with less than `--reserve` seconds left before `--deadline`
is skipped and named in the output. metrics.json is rewritten (atomically) after each block.

    python experiments/gpu_engine/run.py --out logs/gpu_engine          # on the GPU, about 6-7 minutes
    python experiments/gpu_engine/run.py --smoke --out <dir>           # tiny sizes on the CPU, seconds
    bash experiments/gpu_engine/run.sh                                  # the same, with a hard time limit
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specgen.backbones.loading import load_shapes_generator
from specgen.backbones.shapes_llama import ShapesLlama
from specgen.decoding.sampling import make_rngs
from specgen.drafters.fphi import FPhi
from specgen.evaluation.benchmarks import mixed_prompts
from specgen.evaluation.speed import count_ops
from specgen.utils.checkpoints import atomic_write_text, load_exported

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ("ar", "ssd", "sjd", "zipar")  # AR first: the reference of every ratio
# (layers, width, heads, ffn, codes, grid): Janus-Pro-1B's language model (deepseek-ai/Janus-Pro-1B config.json) and
# its 384-pixel image grid of 16x16 patches; the smoke run's tiny stand-in
PAPER_SHAPE = {False: (24, 2048, 16, 5632, 16384, 24), True: (2, 64, 4, 128, 64, 4)}
# prompts per block (the first batch of each is also clocked and op-counted): batch 1 / batch 16
PROMPTS = {"embedded": (8, 32), "paper_shape": (1, 16)}


def strategy_fns(drafter) -> dict:
    """name -> (decode(backbone, prompts, rngs=, ...), streams above batch 1): the decoding configs' settings, the
    drafter given (not loaded from the config's checkpoint)."""
    out = {}
    for name in STRATEGIES:
        cfg = OmegaConf.load(ROOT / "configs" / "decoding" / f"{name}.yaml")
        fn_cfg = cfg.fn
        takes_drafter = "drafter" in fn_cfg
        if takes_drafter:
            del fn_cfg["drafter"]
        fn = instantiate(fn_cfg)
        out[name] = (functools.partial(fn, drafter=drafter) if takes_drafter else fn, bool(cfg.get("stream")))
    return out


def randomise(drafter: FPhi, std: float = 0.02) -> FPhi:
    """An untrained drafter that is not the identity map f_phi starts as (its output layers are zero at init)."""
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim > 1 and not p.abs().sum():
                p.normal_(0.0, std)
    return drafter.eval().requires_grad_(False)


def embedded(smoke: bool, device: str):
    """The shipped backbone and drafter (smoke: a tiny random pair of the same classes)."""
    if smoke:
        torch.manual_seed(0)
        bb = ShapesLlama(num_codes=32, grid_size=4, preset="tiny").eval().requires_grad_(False)
        return bb, randomise(FPhi(bb.hidden_size, "xs", context_kernel=5, left_context=True))
    bb = load_shapes_generator(str(ROOT / "checkpoints" / "ar_shapes"), str(ROOT / "checkpoints" / "vq_shapes"),
                               device=device)
    return bb, load_exported(ROOT / "checkpoints" / "fphi_gpu", device)


def paper_shape(smoke: bool, device: str):
    """A random backbone of the paper's regime (`PAPER_SHAPE`) in bfloat16 on a GPU (float32 on the CPU) and an
    untrained drafter of its width with the shipped drafter's architecture."""
    layers, width, heads, ffn, codes, grid = PAPER_SHAPE[smoke]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # built in place: 1.3B parameters are not first made in float32
    try:
        with torch.device(device):
            bb = ShapesLlama(num_codes=codes, grid_size=grid, eol=False, preset=None, num_layers=layers, width=width,
                             num_heads=heads, ffn=ffn)
            drafter = FPhi(width, "s", context_kernel=5, left_context=True)
    finally:
        torch.set_default_dtype(default)
    return bb.eval().requires_grad_(False), randomise(drafter)


class TimedForwards:
    """A backbone whose target forwards are timed, the device synchronised at each one's edges; every other
    attribute is the backbone's."""

    def __init__(self, backbone):
        self.__dict__.update(_bb=backbone, seconds=0.0, forwards=0)

    def __getattr__(self, name):
        return getattr(self._bb, name)

    def _timed(self, forward, *args, **kwargs):
        _sync(self._bb.device)
        t = time.perf_counter()
        out = forward(*args, **kwargs)
        _sync(self._bb.device)
        self.__dict__["seconds"] += time.perf_counter() - t
        self.__dict__["forwards"] += 1
        return out

    def forward_embeds(self, *args, **kwargs):
        return self._timed(self._bb.forward_embeds, *args, **kwargs)

    def forward_packed(self, *args, **kwargs):  # a stream's packed forwards (`ssd_carry.stream`)
        return self._timed(self._bb.forward_packed, *args, **kwargs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(backbone, fn, prompts: list[str], slots: int | None, seed: int) -> tuple[float, dict]:
    """(seconds, stats) of one decode of `prompts` (a stream with `slots` where given), device synchronised."""
    kwargs = {"slots": slots} if slots else {}
    rngs = make_rngs([seed + i for i in range(len(prompts))], backbone.device)
    _sync(backbone.device)
    t = time.perf_counter()
    with torch.inference_mode():
        _, stats = fn(backbone, backbone.prompts(prompts), rngs=rngs, **kwargs)
    _sync(backbone.device)
    return time.perf_counter() - t, stats


def warm(backbone, batch: int, cfg_rows: int = 2) -> None:
    """A few target forwards of this batch size's shapes (prompt, 1 position, a row, two rows), so that no decode
    pays the kernels' first calls."""
    g, dev, dt = backbone.grid, backbone.device, backbone.dtype
    with torch.inference_mode():
        for _ in range(2):
            cache = backbone.new_cache(None)
            start = 0
            for n in (g.prefix_len, 1, g.width, 2 * g.width):
                emb = torch.zeros(batch * cfg_rows, n, backbone.hidden_size, device=dev, dtype=dt)
                backbone.forward_embeds(emb, torch.arange(start, start + n, device=dev), cache)
                start += n
    _sync(dev)


class Budget:
    """Seconds left before the deadline; what was skipped for lack of them."""

    def __init__(self, deadline: float, reserve: float):
        self.start, self.deadline, self.reserve, self.skipped = time.perf_counter(), deadline, reserve, []

    def allows(self, what: str) -> bool:
        left = self.deadline - (time.perf_counter() - self.start)
        if left < self.reserve:
            self.skipped.append(f"{what} ({left:.0f} s left)")
            return False
        return True

    def spent(self) -> float:
        return time.perf_counter() - self.start


def time_block(backbone, fns: dict, prompts: list[str], batch: int, budget: Budget, where: str) -> dict:
    """Each strategy's wall clock and passes over `prompts` at `batch`: fixed batches in turn (every strategy on a
    batch before the next batch), a streaming strategy in one call with `batch` slots."""
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    acc = {name: {"wall_s": 0.0, "passes": 0.0, "images": 0} for name in fns}
    for b, chunk in enumerate(batches):
        for name, (fn, stream) in fns.items():
            if stream and batch > 1 or not budget.allows(f"{where} {name} batch {b}"):
                continue
            seconds, stats = decode(backbone, fn, chunk, None, seed=b * batch)
            a = acc[name]
            a["wall_s"] += seconds
            a["passes"] += stats["nfe"]
            a["images"] += len(chunk)
    for name, (fn, stream) in fns.items():
        if stream and batch > 1 and budget.allows(f"{where} {name} stream"):
            seconds, stats = decode(backbone, fn, prompts, batch, seed=0)
            acc[name] = {"wall_s": seconds, "passes": stats["nfe"] * batch / len(prompts) * len(batches),
                         "images": len(prompts), "stream_passes": stats["nfe"]}
    out = {}
    for name, a in acc.items():
        if not a["images"]:
            continue
        n_batches = -(-a["images"] // batch)
        out[name] = {"images": a["images"], "latency_s": a["wall_s"] / a["images"],
                     "passes": a["passes"] / n_batches,  # per batch of `batch` images (a stream's: per `batch` slots)
                     "ms_per_pass": 1e3 * a["wall_s"] / a.get("stream_passes", a["passes"])}
    ref = out.get(STRATEGIES[0])
    for r in out.values():
        r["wall_ratio"] = ref["latency_s"] / r["latency_s"] if ref else float("nan")
        r["pass_ratio"] = ref["passes"] / r["passes"] if ref else float("nan")
    return out


def clock_block(backbone, fns: dict, prompts: list[str], batch: int, rows: dict, budget: Budget, where: str) -> None:
    """Add to each strategy's row the share of one batch's wall clock outside its target forwards (each forward
    timed, the device synchronised at its edges: a decode of its own, not the timed ones)."""
    for name, (fn, stream) in fns.items():
        if name not in rows or not budget.allows(f"{where} {name} clocked"):
            continue
        timed = TimedForwards(backbone)
        seconds, _ = decode(timed, fn, prompts[:batch], batch if stream and batch > 1 else None, seed=0)
        rows[name].update({"clocked_wall_s": seconds, "target_s": timed.seconds, "forwards": timed.forwards,
                           "overhead_share": 1.0 - timed.seconds / seconds,
                           "target_ms_per_forward": 1e3 * timed.seconds / max(timed.forwards, 1)})


def ops_block(backbone, fns: dict, prompts: list[str], batch: int, rows: dict, budget: Budget, where: str) -> None:
    """Add to each strategy's row the aten ops of one batch (`evaluation.speed.count_ops`): per pass, over AR's, per
    target forward and per drafted token."""
    for name, (fn, stream) in fns.items():
        if name in rows and budget.allows(f"{where} {name} ops"):
            rows[name].update(count_ops(backbone, fn, prompts[:batch], batch, stream))
    ref = rows.get(STRATEGIES[0], {}).get("ops_per_pass")
    for r in rows.values():
        if ref and "ops_per_pass" in r:
            r["ops_ratio"] = r["ops_per_pass"] / ref


def format_block(where: str, rows: dict) -> str:
    """One block's rows as the lines the run prints."""
    cols = [("latency_s", "s/image", "{:.3f}"), ("passes", "passes", "{:.1f}"), ("pass_ratio", "pass x", "{:.2f}"),
            ("wall_ratio", "wall x", "{:.2f}"), ("ms_per_pass", "ms/pass", "{:.2f}"),
            ("target_ms_per_forward", "ms/forward", "{:.2f}"), ("overhead_share", "overhead", "{:.2f}"),
            ("ops_per_pass", "ops/pass", "{:.0f}"), ("ops_ratio", "ops x", "{:.2f}"),
            ("ops_per_drafted_token", "ops/drafted", "{:.1f}")]
    lines = [f"{where:<22}" + "".join(f"{h:>12}" for _, h, _ in cols)]
    for name, r in rows.items():
        lines.append(f"  {name:<20}" + "".join(f"{fmt.format(r[k]) if k in r else '-':>12}" for k, _, fmt in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for metrics.json and summary.txt")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (batch 1 and 2, one batch each, one "
                                                         "thread): the plumbing only")
    ap.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds for all measurements")
    ap.add_argument("--reserve", type=float, default=20.0, help="no measurement starts with fewer seconds left")
    ap.add_argument("--ops", default="embedded", help="backbones whose aten ops are counted (comma-separated, or "
                                                      "none): counting slows a decode, and the counts are the "
                                                      "same on any device")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        torch.set_num_threads(1)  # tiny models: threads only contend
    budget = Budget(args.deadline, 0.0 if args.smoke else args.reserve)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = (1, 2) if args.smoke else (1, 16)
    result = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(device) if device.startswith(
        "cuda") else platform.processor() or "cpu", "torch": torch.__version__, "smoke": args.smoke,
        "batch_sizes": list(batches), "strategies": list(STRATEGIES), "backbones": {}, "skipped": budget.skipped}
    worlds = {}
    for name, build in (("embedded", embedded), ("paper_shape", paper_shape)):
        backbone, drafter = build(args.smoke, device)
        worlds[name] = (backbone, strategy_fns(drafter))
        g = backbone.grid
        result["backbones"][name] = {
            "params": sum(p.numel() for p in backbone.parameters()), "dtype": str(backbone.dtype).removeprefix(
                "torch."), "grid": [g.height, g.width], "codes": g.num_visual,
            "drafter_params": sum(p.numel() for p in drafter.parameters())}
    blocks = [(name, i, batch) for name in worlds for i, batch in enumerate(batches)]
    counted = [] if args.ops == "none" else args.ops.split(",")
    # phases, each over every block: the wall ratios first, then the overhead shares, then the op counts, so that a
    # deadline cuts the least important measurements
    for phase in ("time", "clock", "ops"):
        for name, i, batch in blocks:
            if phase == "ops" and name not in counted:
                continue
            backbone, fns = worlds[name]
            where = f"{name} bs{batch}"
            prompts = [m["prompt"] for m in mixed_prompts("test", batch if args.smoke else PROMPTS[name][i], 0)]
            warm(backbone, batch)
            if phase == "time":
                result["backbones"][name][f"bs{batch}"] = time_block(backbone, fns, prompts, batch, budget, where)
            else:
                (clock_block if phase == "clock" else ops_block)(backbone, fns, prompts, batch,
                                                                 result["backbones"][name][f"bs{batch}"], budget, where)
            result["spent_s"] = budget.spent()
            atomic_write_text(out_dir / "metrics.json", json.dumps(result, indent=2) + "\n")
    text = [format_block(f"{name} bs{batch}", result["backbones"][name][f"bs{batch}"]) for name, _, batch in blocks]
    text.append(f"{result['device']}, {result['spent_s']:.0f} s; skipped: {', '.join(budget.skipped) or 'nothing'}")
    atomic_write_text(out_dir / "summary.txt", "\n\n".join(text) + "\n")
    print("\n\n".join(text))
    return result


if __name__ == "__main__":
    main()
