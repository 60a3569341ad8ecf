"""Where SSD's wall clock goes at batch 1, against AR's, on the machine it runs on.

Every target forward is timed with the positions it feeds (through the decoders' `trace` hook), every draft call (the first row's right chain, the down
rows, the re-drafts, the reweighted tokens after a change) with its own clock, and the rest of a decode
(verification: the target's distributions, the accept/resample draws, the window's bookkeeping) is what remains of
its wall time. From all timed forwards of all strategies a per-pass cost model is fitted by least squares:

    t_pass = a + b x (positions fed)                (seconds; a: the fixed cost of a forward, b: per position)

so that a strategy's target time is about a x passes + b x positions fed. On a CPU a small model's forward of one
position is mostly fixed cost (AR's step), while a forward of a two-row window costs several times more: passes saved
and positions fed pull the wall clock in opposite directions. The report gives, per strategy, the split of its wall
time, its passes and positions fed, and two projections from the fitted model: the wall ratio against AR if drafting and
verification cost nothing, and the positions fed per image that a target wall ratio would allow at the strategy's passes
(`--target-ratio`), with drafting and verification as measured and with both free (a negative budget: the ratio is out
of reach at those passes even if nothing were fed), and the passes per image that ratio allows at the strategy's own
cost per pass (its positions fed, drafting and verification per pass as measured, and with the last two free): on a CPU
the wall ratio is about the pass ratio times AR's cost per pass over the strategy's. The strategies run interleaved,
every one on a prompt before the next prompt, so that a drift of the machine's speed falls on all of them alike.

    python -m specgen.analysis.ssd_costs --backbone checkpoints/ar_shapes --tokenizer checkpoints/vq_shapes \\
        --drafter checkpoints/fphi_accept --prompts 16 --threads 2 --out logs/ssd_costs

-> <out>/ssd_costs.json. Strategies: AR and the decoding configs `ssd` and `ssd_paper` (`--strategy NAME` and
`--variant NAME=key:value,...` instead, as in `row_passes`), the same prompts and per-image seeds for each, one
warm-up image first.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from specgen.analysis.row_passes import add_world_args, config_strategies, decoder, load_world
from specgen.decoding import ar
from specgen.decoding.trace import OpCount, Trace
from specgen.decoding.sampling import make_rngs
from specgen.utils.checkpoints import atomic_write_text

class Clock(Trace):
    """A trace that times target forwards (positions fed, rows, seconds, whether it was a prefill) and the seconds
    spent drafting (regions nest: a draft inside a draft counts once); `computed`: the token positions each forward
    computed (rows x positions, or fewer in a packed forward)."""

    def __init__(self):
        self.forwards: list[tuple[int, int, float, bool]] = []
        self.computed: list[int] = []
        self.draft_s, self._open = 0.0, []

    def reset(self):
        self.forwards, self.computed, self.draft_s = [], [], 0.0

    def enter(self, kind: str, info: dict) -> None:
        self._open.append(time.perf_counter())

    def exit(self, kind: str, info: dict) -> None:
        seconds = time.perf_counter() - self._open.pop()
        if kind == "target":
            self.forwards.append((info["positions"], info["rows"], seconds, info["prefill"]))
            self.computed.append(info.get("tokens", info["positions"] * info["rows"]))
        elif kind == "draft" and not self._open:
            self.draft_s += seconds


def decoders(backbone, drafter, cfg_scale: float, strategies: dict[str, dict]) -> dict:
    """name -> decode(prompts, rngs, trace): AR first, then each strategy's SSD decoder with its options."""
    out = {"ar": lambda p, rngs, trace: ar.generate(backbone, p, cfg_scale=cfg_scale, rngs=rngs, trace=trace)}
    for name, options in strategies.items():
        fn, kwargs = decoder(options)
        out[name] = (lambda f, o: lambda p, rngs, trace: f(backbone, p, drafter, cfg_scale=cfg_scale, rngs=rngs,
                                                           trace=trace, **o))(fn, kwargs)
    return out


@torch.inference_mode()  # as the benchmark's speed runs decode
def measure(backbone, drafter, prompts: list[str], cfg_scale: float, strategies: dict[str, dict],
            seed: int = 0) -> dict:
    """Per strategy (AR first): per-image means of wall, target, draft and other seconds, passes, positions fed
    after the prefill; and every timed forward (positions, rows, seconds) for the cost model."""
    clock = Clock()
    decode_by = decoders(backbone, drafter, cfg_scale, strategies)
    acc = {name: {"wall": 0.0, "draft": 0.0, "passes": [], "fed": [], "forwards": []} for name in decode_by}
    for name, decode in decode_by.items():
        decode(backbone.prompts(prompts[:1]), make_rngs([seed]), clock)  # warm-up
    for i, text in enumerate(prompts):  # interleaved: every strategy on a prompt before the next prompt, so that
        for name, decode in decode_by.items():  # a drift of the machine's speed falls on all of them alike
            clock.reset()
            t = time.perf_counter()
            _, stats = decode(backbone.prompts([text]), make_rngs([seed + i]), clock)
            a = acc[name]
            a["wall"] += time.perf_counter() - t
            a["draft"] += clock.draft_s
            a["forwards"] += clock.forwards
            a["passes"].append(stats["nfe"])
            a["fed"].append(float(stats["tokens_fed"][0]))
    out, n = {}, len(prompts)
    for name, a in acc.items():
        target = sum(f[2] for f in a["forwards"])  # prefills included: they are part of each decode
        out[name] = {"images": n, "wall_s": a["wall"] / n, "target_s": target / n, "draft_s": a["draft"] / n,
                     "other_s": (a["wall"] - target - a["draft"]) / n, "passes": float(np.mean(a["passes"])),
                     "tokens_fed": float(np.mean(a["fed"])), "forwards": a["forwards"]}
    return out


@torch.inference_mode()
def count_ops(backbone, drafter, prompt: str, cfg_scale: float, strategies: dict[str, dict], seed: int = 0) -> dict:
    """Per strategy (AR first), the aten ops one image's decode dispatches (`decoding.trace.OpCount`): in target
    forwards, in drafting, and the rest (verification and bookkeeping), with its passes and `OpCount.summary`'s
    per-pass figures. On a CPU a small op costs a few microseconds whatever its size, so for a model this small the
    op counts explain much of the wall clock that positions fed do not."""
    out = {}
    for name, decode in decoders(backbone, drafter, cfg_scale, strategies).items():
        with OpCount() as ops:
            _, stats = decode(backbone.prompts([prompt]), make_rngs([seed]), ops)
        s = ops.summary(int(stats["nfe"]))
        out[name] = {"target": s["ops_target"], "draft": s["ops_draft"], "other": s["ops_other"], "total": s["ops"],
                     "passes": int(stats["nfe"]), **{k: v for k, v in s.items() if k.startswith("ops_")}}
    return out


def fit_pass_cost(result: dict) -> tuple[float, float]:
    """Least-squares (a, b) of t = a + b x positions over every timed forward but the prefills (they feed the
    prompt, not image positions)."""
    rows = [(q, t) for r in result.values() for q, _, t, prefill in r["forwards"] if not prefill]
    if not rows:
        raise ValueError("no timed forward after a prefill: decode at least one image")
    q, t = np.array(rows, dtype=float).T
    b, a = np.polyfit(q, t, 1) if len(set(q)) > 1 else (0.0, float(t.mean()))
    return float(a), float(b)


def report(result: dict, target_ratio: float) -> dict:
    """The split per strategy, with ratios against AR and the cost model's projections."""
    a, b = fit_pass_cost(result)
    ref = result["ar"]
    rows = {}
    for name, r in result.items():
        model_target = a * r["passes"] + b * r["tokens_fed"]
        budget = ref["wall_s"] / target_ratio  # the wall time per image a target ratio allows
        rows[name] = {k: r[k] for k in ("wall_s", "target_s", "draft_s", "other_s", "passes", "tokens_fed")}
        rows[name].update({
            "wall_ratio": ref["wall_s"] / r["wall_s"], "pass_ratio": ref["passes"] / r["passes"],
            "fed_ratio": r["tokens_fed"] / ref["tokens_fed"], "model_target_s": model_target,
            # the wall ratio if drafting and verification were free: passes and positions fed alone
            "ratio_if_free_drafting": ref["wall_s"] / max(model_target, 1e-12),
            # positions fed per image that `target_ratio` allows at these passes, with drafting and verification as
            # now and with both free (negative: not reachable at these passes even feeding nothing)
            "fed_allowed": (budget - a * r["passes"] - r["draft_s"] - r["other_s"]) / b if b > 0 else float("nan"),
            "fed_allowed_free": (budget - a * r["passes"]) / b if b > 0 else float("nan"),
            # passes per image that `target_ratio` allows at this strategy's own cost per pass (its positions fed,
            # drafting and verification per pass as measured), and with drafting and verification free: on a CPU the
            # wall ratio is about the pass ratio times AR's cost per pass over this strategy's
            "passes_allowed": budget / (r["wall_s"] / r["passes"]),
            "passes_allowed_free": budget / (model_target / r["passes"])})
    forwards = sum(len(r["forwards"]) for r in result.values())
    return {"pass_cost": {"fixed_s": a, "per_position_s": b, "forwards": forwards}, "target_ratio": target_ratio,
            "strategies": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_world_args(ap, prompts=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--target-ratio", type=float, default=3.5, help="the wall ratio whose fed budget to report")
    ap.add_argument("--out", required=True, help="folder for ssd_costs.json")
    args = ap.parse_args(argv)
    if args.prompts < 1:
        ap.error(f"--prompts {args.prompts}: give at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    backbone, drafter, prompts, strategies = load_world(args)
    strategies = strategies or config_strategies()
    out = report(measure(backbone, drafter, prompts, args.cfg_scale, strategies, args.seed), args.target_ratio)
    out["ops"] = count_ops(backbone, drafter, prompts[0], args.cfg_scale, strategies, args.seed)  # after the clocks
    out["dtype"], out["threads"] = str(backbone.dtype).removeprefix("torch."), torch.get_num_threads()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / "ssd_costs.json", json.dumps(out, indent=2))
    pc = out["pass_cost"]
    print(f"pass cost: {pc['fixed_s'] * 1e3:.2f} ms + {pc['per_position_s'] * 1e3:.3f} ms x positions fed "
          f"({pc['forwards']} forwards, {out['threads']} threads, backbone in {out['dtype']})")
    print(f"{'strategy':<14} {'wall ms':>8} {'target':>7} {'draft':>7} {'other':>7} {'passes':>7} {'fed':>6} "
          f"{'wall x':>7} {'pass x':>7} {'x if free drafting':>18} {f'fed for {args.target_ratio:g}x':>12} "
          f"{'(free drafting)':>15} {f'passes for {args.target_ratio:g}x':>15} {'(free drafting)':>15}")
    for name, r in out["strategies"].items():
        budget = ("-",) * 4 if name == "ar" else (f"{r['fed_allowed']:.0f}", f"{r['fed_allowed_free']:.0f}",
                                                   f"{r['passes_allowed']:.1f}", f"{r['passes_allowed_free']:.1f}")
        print(f"{name:<14} {r['wall_s'] * 1e3:>8.0f} {r['target_s'] * 1e3:>7.0f} {r['draft_s'] * 1e3:>7.0f} "
              f"{r['other_s'] * 1e3:>7.0f} {r['passes']:>7.1f} {r['tokens_fed']:>6.0f} {r['wall_ratio']:>7.2f} "
              f"{r['pass_ratio']:>7.2f} {r['ratio_if_free_drafting']:>18.2f} {budget[0]:>12} {budget[1]:>15} "
              f"{budget[2]:>15} {budget[3]:>15}")
    ar_ops = out["ops"]["ar"]["total"]
    print(f"aten ops of one image's decode (the first prompt): {'target':>8} {'draft':>7} {'other':>7} {'total':>7} "
          f"{'per pass':>8} {'AR / this':>9}")
    for name, o in out["ops"].items():
        print(f"{name:<50} {o['target']:>8} {o['draft']:>7} {o['other']:>7} {o['total']:>7} "
              f"{o['total'] / o['passes']:>8.0f} {ar_ops / o['total']:>9.2f}")
    return out


if __name__ == "__main__":
    main()
