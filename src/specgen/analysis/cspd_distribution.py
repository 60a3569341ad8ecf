"""How far CSpD's tokens are from target-only sampling: a two-sample comparison with its intervals and its power.

On a tiny random MAR pair (the embedded backbone: 4 tokens of one dimension, a 4-step head, 3 MAR steps, CFG 2),
the draft a copy of the target whose head weights are moved by a small random amount, each sampler draws n images
from its own seeds and is compared with n target-only images:

* per token position, the mean shift in units of the target's standard deviation and the log ratio of the
  standard deviations, each with its 95% interval (normal approximations: the variance of a sample variance is
  (m4 - s^4) / n), and a z score;
* two-sample KS tests on the token sum and on a product of two positions (dependence between tokens).

A sampler is told apart (`rejected`) when any |z| exceeds `z_max` (4: two-sided p 6e-5 per statistic, about 5e-4
over the 8 statistics) or a KS p value is below 1e-3. The draft's own samples are the near-miss control: the draft
is off by a fraction of a standard deviation, and the comparison must reject it (its power); lossless CSpD must not
be rejected; the other variants' deviations are reported with their intervals:

    python -m specgen.analysis.cspd_distribution --out <folder> [--images 4000]   -> <folder>/distribution.json, .txt
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch
from scipy import stats

from specgen.backbones.mar import ShapesMAR
from specgen.decoding import cspd, mar
from specgen.decoding.sampling import make_rngs
from specgen.utils.checkpoints import atomic_write_text

Z = 1.959964  # 95% two-sided
SAMPLER = dict(num_iter=3, cfg_scale=2.0)
VARIANTS = {  # name -> cspd.generate options (the configs' settings, on this pair's 3 MAR steps)
    "cspd": dict(gamma=2),
    "cspd_inround": dict(gamma=2, verify="stepwise", verify_cfg="own_step"),
    "cspd_exact": dict(gamma=2, ratio="exact", verify="stepwise"),
    "cspd_lossless": dict(gamma=2, ratio="exact", verify="stepwise", acceptance="prefix"),
}


def tiny_pair(draft_shift: float = 0.06, seed: int = 0) -> tuple[ShapesMAR, ShapesMAR]:
    """(target, draft): a random 2x2-token MAR whose head depends on its conditions, and a copy with every head
    weight moved by draft_shift x N(0, 1)."""
    torch.manual_seed(seed)
    target = ShapesMAR(grid_size=2, token_dim=1, preset="tiny", sample_steps=4, buffer_size=4).eval()
    with torch.no_grad():
        for p in target.diffloss.parameters():
            if not p.any():  # zero-initialised output layers would make every chain ignore its conditions
                p.normal_(0, 0.3)
    draft = copy.deepcopy(target)
    torch.manual_seed(seed + 9)
    with torch.no_grad():
        for p in draft.diffloss.parameters():
            p.add_(draft_shift * torch.randn_like(p))
    return target.requires_grad_(False), draft.requires_grad_(False)


def _interval(value: float, se: float) -> dict:
    return {"value": value, "ci95": [value - Z * se, value + Z * se], "z": value / se if se > 0 else 0.0}


def deviation(x: torch.Tensor, ref: torch.Tensor, z_max: float = 4.0, product=((0, 0), (1, 0))) -> dict:
    """x, ref (n, L, d) tokens: per-position standardised mean shift and log sd ratio with 95% intervals, KS p
    values on the sum and a product of two positions, and whether the comparison tells them apart."""
    x, ref = x.double().flatten(1), ref.double().flatten(1)  # (n, L * d)
    n, m = x.shape[0], ref.shape[0]
    sd_r = ref.std(0)
    out = {"positions": []}
    for k in range(x.shape[1]):
        a, b = x[:, k], ref[:, k]
        va, vb = float(a.var()), float(b.var())
        shift = float(a.mean() - b.mean()) / float(sd_r[k])
        se_shift = math.sqrt(va / n + vb / m) / float(sd_r[k])
        # log(sd_a / sd_b): var(log s^2) ~ (m4 / s^4 - 1) / n, halved for the log of the sd
        kurt = lambda t, v: float(((t - t.mean()) ** 4).mean()) / v ** 2
        se_log_sd = 0.5 * math.sqrt((kurt(a, va) - 1) / n + (kurt(b, vb) - 1) / m)
        out["positions"].append({"mean_shift_sd": _interval(shift, se_shift),
                                 "log_sd_ratio": _interval(0.5 * math.log(va / vb), se_log_sd)})
    (i, _), (j, _) = product
    out["ks_sum_p"] = float(stats.ks_2samp(x.sum(1).numpy(), ref.sum(1).numpy()).pvalue)
    out["ks_product_p"] = float(stats.ks_2samp((x[:, i] * x[:, j]).numpy(), (ref[:, i] * ref[:, j]).numpy()).pvalue)
    zs = [abs(p[s]["z"]) for p in out["positions"] for s in ("mean_shift_sd", "log_sd_ratio")]
    out["max_abs_z"] = max(zs)
    out["max_abs_mean_shift_sd"] = max(abs(p["mean_shift_sd"]["value"]) for p in out["positions"])
    out["rejected"] = out["max_abs_z"] > z_max or min(out["ks_sum_p"], out["ks_product_p"]) < 1e-3
    return out


@torch.no_grad()
def compare(n: int, variants=tuple(VARIANTS), draft_shift: float = 0.06) -> dict:
    """Target-only reference, the draft alone (the near-miss control) and each CSpD variant, n images each."""
    target, draft = tiny_pair(draft_shift)
    prompts = ["a red circle"] * n
    ref, _ = mar.generate(target, prompts, make_rngs(range(n)), **SAMPLER)
    again, _ = mar.generate(target, prompts, make_rngs(range(3 * n, 4 * n)), **SAMPLER)  # the same sampler: a null
    alone, _ = mar.generate(draft, prompts, make_rngs(range(n, 2 * n)), **SAMPLER)
    res = {"images": n, "draft_shift": draft_shift, "target_again": deviation(again, ref),
           "draft_alone": deviation(alone, ref)}
    for name in variants:
        out, st = cspd.generate(target, prompts, make_rngs(range(2 * n, 3 * n)), draft, prefill_ratio=0.0,
                                **SAMPLER, **VARIANTS[name])
        res[name] = {**deviation(out, ref), "accept_rate": st["accept_rate"], "fallbacks": st["fallbacks"],
                     "prefill_steps": st["prefill_steps"]}
    return res


def lines(res: dict) -> list[str]:
    """A table: per sampler the largest |mean shift| (target sds) and |z|, KS p values, acceptance, verdict."""
    out = [f"{res['images']} images per sampler; draft head moved by {res['draft_shift']} x N(0, 1)",
           f"{'sampler':16s} {'alpha':>6s} {'max |shift| sd':>15s} {'shift 95% (worst pos.)':>24s} {'max |z|':>8s} "
           f"{'KS sum p':>9s} {'KS prod p':>9s}  told apart"]
    for name, r in res.items():
        if not isinstance(r, dict):
            continue
        worst = max(r["positions"], key=lambda p: abs(p["mean_shift_sd"]["value"]))["mean_shift_sd"]["ci95"]
        alpha = f"{r['accept_rate']:.3f}" if "accept_rate" in r else "-"
        out.append(f"{name:16s} {alpha:>6s} {r['max_abs_mean_shift_sd']:15.3f} "
                   f"{'[%+.3f, %+.3f]' % tuple(worst):>24s} {r['max_abs_z']:8.2f} {r['ks_sum_p']:9.2g} "
                   f"{r['ks_product_p']:9.2g}  {'yes' if r['rejected'] else 'no'}")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for distribution.json and distribution.txt")
    ap.add_argument("--images", type=int, default=4000, help="images per sampler")
    ap.add_argument("--draft-shift", type=float, default=0.06, help="the draft's head weights moved by this x N(0, 1)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = compare(a.images, draft_shift=a.draft_shift)
    text = lines(res)
    print("\n".join(text))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "distribution.json", json.dumps(res, indent=1))
    atomic_write_text(out / "distribution.txt", "\n".join(text) + "\n")
    return res


if __name__ == "__main__":
    main()
