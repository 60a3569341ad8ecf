"""GPU check of the continuous side: MAR-H-shaped target and MAR-B-shaped draft at random init (bf16 autocast
on a GPU, float32 on CPU), the cost of one target generation step against one draft step (the transformer
call) and of the head's chains for the step's tokens (100 DDPM steps), at several batch sizes, and the
CSpD speed-up these costs project for a given acceptance. `--family xar`: xAR-L- and xAR-B-shaped models, 4
cells, 50 flow steps; there the transformer is the flow network, so a step's "transformer call" does no work
and the "head" is the network run on context + cell at every flow step (as written here: the release caches
the context's keys and values, this recomputes them). The projection adds the target's chain cost per drafted
step, so on xAR it does not credit running the chains of a round's drafted cells side by side.

* paper (joint verification, per-token acceptance): every drafted step is committed, so the projection
  does not depend on acceptance; per image a round of gamma steps costs gamma draft steps, one target
  transformer call and the target's own chains for the drafted tokens (the head's cost of target-only
  sampling);
* lossless (stepwise verification, prefix acceptance): a round commits its drafted steps up to the first
  with a rejection; with per-token acceptance a and n tokens per step, a step survives with a^n.

Random weights say nothing about acceptance: measure it with real weights (experiment=eval/real_continuous)
and pass it with --accept. `--tiny` runs the same on tiny models on CPU (the test suite does).

    python experiments/real_backbones/continuous_check.py --out logs/continuous_check          # GPU
    python experiments/real_backbones/continuous_check.py --tiny --batches 1 2 --out logs/cc_tiny  # anywhere
    python experiments/real_backbones/continuous_check.py --family xar --out logs/continuous_check_xar  # GPU
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch

from specgen.backbones.continuous import cosine_schedule
from specgen.backbones.mar_release import PRESETS, build_mar_release
from specgen.backbones.xar import PRESETS as XAR_PRESETS, XAR
from specgen.decoding.cspd_core import run_chain
from specgen.decoding.mar import head_step_fn
from specgen.decoding.sampling import make_rngs

TINY = {"target": (64, 2, 2, 4, 64, 2), "draft": (32, 1, 1, 4, 32, 1)}
TINY_XAR = {"target": (32, 2, 2, 4), "draft": (16, 1, 1, 4)}
CFG = {"mar": 3.2, "xar": 2.3}  # MAR-H's, xAR-L's guidance scale


def build_pair(tiny: bool, device: str, family: str = "mar"):
    """(target, draft): MAR-H and MAR-B shapes, or xAR-L and xAR-B (or tiny ones), random init, frozen."""
    if family == "xar":
        kw = dict(grid_size=4, unit_size=2, token_dim=4, sample_steps=10) if tiny else dict(sample_steps=50)
        sizes = TINY_XAR if tiny else {"target": XAR_PRESETS["large"], "draft": XAR_PRESETS["base"]}
        build = lambda k: XAR(sizes[k], **kw).eval()
    else:
        kw = dict(grid_size=4, token_dim=4, buffer_size=8, sample_steps=10) if tiny else {}
        sizes = TINY if tiny else {"target": PRESETS["huge"], "draft": PRESETS["base"]}
        build = lambda k: build_mar_release(sizes=sizes[k], **kw)
    return tuple(build(k).to(device).requires_grad_(False) for k in ("target", "draft"))


def _clock(fn, device, repeats: int = 3) -> float:
    fn()  # warm-up
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


@torch.no_grad()
def step_costs(model, batch: int, num_iter: int, cfg_scale: float, device: str) -> dict:
    """Seconds of one mid-generation step at `batch` images: the transformer call (both CFG branches) and the
    head's whole chain for the step's new tokens."""
    L, d = model.seq_len, model.token_dim
    rank, sched = model.plan(make_rngs(range(batch), device), num_iter)
    mid = num_iter // 2
    known, new = sched[mid - 1] if mid else 0, sched[mid] - (sched[mid - 1] if mid else 0)
    tokens = torch.randn(batch, L, d, device=device)
    conds = model.conditioning(list(range(batch)), cfg_scale != 1.0)
    unknown = (rank >= known).float()
    transformer = lambda: model.step_conditions(tokens, unknown, conds)
    zc, zu = transformer()
    idx = ((rank >= known) & (rank < sched[mid])).nonzero(as_tuple=True)  # the step's tokens
    n = len(idx[0])
    z = zc[idx], None if zu is None else zu[idx]
    step = head_step_fn(model, z[0], z[1], cfg_scale)
    x, noise = torch.randn(n, d, device=device), [torch.randn(n, d, device=device) for _ in range(model.num_steps)]
    return {"transformer_s": _clock(transformer, device), "head_s": _clock(lambda: run_chain(step, x, noise), device),
            "tokens_per_step": new}


def projection(t: dict, q: dict, num_iter: int, gamma: int, prefill_steps: int, accept: float) -> dict:
    """Projected time ratio target-only / CSpD (module docstring), per image, from per-step costs."""
    target_only = num_iter * (t["transformer_s"] + t["head_s"])
    drafted = num_iter - prefill_steps
    rounds = math.ceil(drafted / gamma)
    draft = drafted * (q["transformer_s"] + q["head_s"])
    paper = prefill_steps * (t["transformer_s"] + t["head_s"]) + draft + rounds * t["transformer_s"] + \
        drafted * t["head_s"]
    survive = accept ** t["tokens_per_step"]  # a drafted step with every token accepted
    committed = sum(survive ** j for j in range(gamma))  # steps a round commits: the first always (corrected)
    lossless_rounds = drafted / committed
    per_round = gamma * (q["transformer_s"] + q["head_s"]) + t["transformer_s"] + gamma * t["head_s"]
    lossless = prefill_steps * (t["transformer_s"] + t["head_s"]) + lossless_rounds * per_round
    return {"paper_speedup": target_only / paper, "lossless_speedup": target_only / lossless,
            "lossless_steps_per_round": committed}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for continuous_check.json")
    ap.add_argument("--tiny", action="store_true", help="tiny models on CPU instead of the release shapes")
    ap.add_argument("--family", choices=("mar", "xar"), default="mar", help="MAR-H/MAR-B or xAR-L/xAR-B shapes")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--num-iter", type=int, default=256, help="generation steps (MAR's evaluation: 256; xAR: its cells)")
    ap.add_argument("--cfg-scale", type=float, default=None, help="default: MAR-H's 3.2, xAR-L's 2.3")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prefill-ratio", type=float, default=0.05)
    ap.add_argument("--accept", type=float, nargs="+", default=[0.3, 0.6, 0.9], help="per-token acceptance rates")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    target, draft = build_pair(a.tiny, device, a.family)
    cfg_scale = a.cfg_scale if a.cfg_scale is not None else CFG[a.family]
    num_iter = min(a.num_iter, target.seq_len)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    prefill = min(num_iter, math.ceil(a.prefill_ratio * num_iter - 1e-9))
    rows = {}
    with amp:
        for b in a.batches:
            t, q = (step_costs(m, b, num_iter, cfg_scale, device) for m in (target, draft))
            rows[b] = {"target": t, "draft": q, "transformer_ratio": t["transformer_s"] / q["transformer_s"],
                       "head_ratio": t["head_s"] / q["head_s"],
                       **{f"accept_{x:g}": projection(t, q, num_iter, a.gamma, prefill, x) for x in a.accept}}
            print(f"{a.family} batch {b}: target step {t['transformer_s'] * 1e3:.2f} ms + head {t['head_s'] * 1e3:.2f} ms, "
                  f"draft step {q['transformer_s'] * 1e3:.2f} ms + head {q['head_s'] * 1e3:.2f} ms")
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tiny": a.tiny, "family": a.family,
           "num_iter": num_iter, "head_steps": target.num_steps, "gamma": a.gamma, "prefill_steps": prefill,
           "batches": rows, "dtype": "bf16 autocast" if device == "cuda" else "float32"}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "continuous_check.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
