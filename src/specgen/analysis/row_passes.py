"""How SSD's target passes grow along the rows: the passes an image has spent when its first k rows are final,
k = 1..H, for SSD with carry (the default) and the paper's auto-correction, at batch 1 on held-out prompts.

This is the grid-scaling argument measured on one grid. The paper's rule spends at most r + 1 passes on a row
whatever its width, so passes grow as O(n) on an n x n grid and the speed-up as n / (r + 1). With carry a pass
finalises the window up to its first change, so a row of W tokens costs about 1 + (changes that end a pass) passes,
which grows with W: the per-row slope, against W and r + 1, says which regime a strategy is in.

    python -m specgen.analysis.row_passes --backbone checkpoints/ar_shapes --tokenizer checkpoints/vq_shapes \\
        --drafter checkpoints/fphi_accept --prompts 32 --out logs/row_passes

-> <out>/row_passes.json (mean passes per k with 95% intervals, the linear fit per strategy), row_passes.png.
For strategies with carry it also reports cascades: a pass finalises its window up to the first change, and the
token after that change, judged given its replaced left neighbour, is judged again next pass; when it changes again
the pass finalised one token. The share of such passes, that token's change rate, and change rates of fresh and
carried tokens by their distance from the window's first token (json, printout and a third panel) say how much of
the passes such chains take.
The strategies are the decoding configs `ssd` (the default) and `ssd_paper` as the benchmark runs them
(`--strategy NAME` picks others); `--variant NAME=key:value,...` adds a strategy: the options of the decoding config
named by its `base` (default `ssd`) with the keys given replaced (values parsed as YAML), e.g.
`--variant dt1=draft_temperature:null --variant notail=tails:[] --variant r1=base:ssd_paper,rounds:1`: every
strategy on the same prompts and per-image seeds. A variant's `drafter:PATH` decodes it with that exported drafter
instead of --drafter, so that two drafters are compared on the same prompts and seeds
(`--strategy ssd --variant new=drafter:checkpoints/x`).
Every strategy after the first also gets its paired difference of passes per image against the first (mean and 95%
interval over the same prompts and seeds: tighter than comparing two intervals).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from specgen.backbones.loading import load_shapes_generator
from specgen.decoding import ssd, ssd_carry
from specgen.decoding.sampling import make_rngs
from specgen.evaluation.benchmarks import mixed_prompts
from specgen.utils.checkpoints import atomic_write_text, load_exported
from specgen.utils.hydra import CONFIG_DIR
from specgen.utils.plots import pyplot, save
from specgen.utils.stats import mean_ci95

DEFAULT_STRATEGIES = ("ssd", "ssd_paper")  # the repo's default and the paper's rule (configs/decoding/<name>.yaml)


DECODERS = {"specgen.decoding.ssd.generate": ssd.generate, "specgen.decoding.ssd_carry.generate": ssd_carry.generate}


def decoding_options(name: str) -> dict:
    """The options of the SSD decoding config `configs/decoding/<name>.yaml` (its `defaults` chain merged), its
    `_target_` (the decoder) included, without the drafter and the sampling settings given per run: what the
    benchmark runs. Objects (`tails`, `acceptance`) stay configs; `decoder` builds them."""
    path = Path(CONFIG_DIR) / "decoding" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("ssd*.yaml"))
        raise ValueError(f"no decoding config {name!r} ({path}): expected one of {known}")
    cfg = OmegaConf.load(path)
    base = [d for d in cfg.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    merged = OmegaConf.merge(*(OmegaConf.create({"fn": decoding_options(b)}) for b in base), cfg)
    fn = OmegaConf.to_container(merged.fn, resolve=False)
    if fn.get("_target_") not in DECODERS:
        raise ValueError(f"decoding config {name!r} is not an SSD strategy (its fn is {fn.get('_target_')!r}, "
                         f"not one of {sorted(DECODERS)})")
    for key in ("_partial_", "drafter", "cfg_scale", "temperature", "top_k"):
        fn.pop(key, None)
    return fn


def decoder(options: dict):
    """(decode function, keyword options) of a strategy's options: the `_target_` decoder, its object options
    (`tails`, `acceptance`: configs with a `_target_`) built fresh."""
    options = dict(options)
    fn = DECODERS[options.pop("_target_")]
    return fn, {k: instantiate(v) if isinstance(v, (dict, list)) else v for k, v in options.items()}


def config_strategies(names=DEFAULT_STRATEGIES) -> dict[str, dict]:
    """name -> SSD options (`decoding_options`), read from the decoding configs."""
    return {name: decoding_options(name) for name in names}


def parse_variant(text: str) -> tuple[str, dict]:
    """'name=key:value,key:value' -> (name, options): the options of decoding config `base` (default `ssd`) with
    the keys given replaced; values are YAML (0, true, null, 0.5, [])."""
    name, sep, body = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--variant {text!r}: write NAME=key:value,key:value (e.g. dt1=draft_temperature:null or "
                         f"r1=base:ssd_paper,rounds:1)")
    options = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--variant {text!r}: {item!r} is not key:value")
        options[key.strip()] = yaml.safe_load(value)
    return name, {**decoding_options(options.pop("base", "ssd")), **options}


@torch.no_grad()
def row_passes(backbone, drafter, prompts: list[str], cfg_scale: float, seed: int = 0,
               strategies: dict | None = None) -> dict:
    """Per strategy: passes (prefill included) when each row is final, per image (N, H), and their summary, with
    the tokens per image kept without a check against their final left context (`unchecked`, mean and 95%)."""
    out, drafters, totals = {}, {}, {}
    for name, options in (strategies or config_strategies()).items():
        options = dict(options)
        path = options.pop("drafter", None)  # a variant's own exported drafter
        if path is not None and path not in drafters:
            drafters[path] = load_exported(str(path)).eval()
        net = drafter if path is None else drafters[path]
        rows, unchecked, cascades = [], [], []
        for i, text in enumerate(tqdm(prompts, desc=name, unit="img")):
            fn, kwargs = decoder(options)
            _, stats = fn(backbone, backbone.prompts([text]), net, cfg_scale=cfg_scale, rngs=make_rngs([seed + i]),
                          **kwargs)
            rows.append(stats["row_final_pass"][0].float())
            unchecked.append(float(stats["unchecked_tokens"][0]) if "unchecked_tokens" in stats else 0.0)  # carry: 0
            if "change_by_distance" in stats:  # the carry window's pass statistics
                cascades.append({k: stats[k] for k in ("single_token_passes", "after_change_rate",
                                                       "change_by_distance")})
        passes = torch.stack(rows).numpy()
        out[name] = summarise(passes, backbone.grid.width, options.get("rounds", 0))
        if path is not None:
            out[name]["drafter"] = str(path)
        add_paired(out, totals, name, passes[:, -1])
        out[name]["unchecked"] = float(np.mean(unchecked))
        out[name]["unchecked_ci95"] = float(mean_ci95(np.array(unchecked)))
        if cascades:
            out[name]["cascades"] = summarise_cascades(cascades)
    return out


def add_paired(out: dict, totals: dict, name: str, image_passes: np.ndarray) -> None:
    """Record strategy `name`'s passes per image (in the prompts' order) in `out[name]` and `totals`, and, for every
    strategy after the first, its paired difference against the first (the same prompts and per-image seeds)."""
    out[name]["image_passes"] = image_passes.tolist()
    totals[name] = image_passes
    first = next(iter(totals))
    if name != first:
        diff = image_passes - totals[first]
        out[name].update(paired_vs=first, paired_diff=float(diff.mean()), paired_diff_ci95=float(mean_ci95(diff)))


def summarise_cascades(stats: list[dict]) -> dict:
    """Cascades of the carry window over images (batch-1 stats): the share of passes that finalised only their first
    token, the change rate of the token after a pass's first change when next judged, and change rates of fresh and
    carried tokens by distance from the window's first token (pooled over images; None where none was judged)."""
    single = np.array([float(s["single_token_passes"][0]) for s in stats])
    after = np.array([float(s["after_change_rate"][0]) for s in stats])
    counts = torch.stack([s["change_by_distance"][0] for s in stats]).sum(0)  # (2, 2, K)
    rates = torch.where(counts[:, 0] > 0, counts[:, 1] / counts[:, 0].clamp_min(1), float("nan"))
    as_list = lambda t: [None if np.isnan(v) else float(v) for v in t.tolist()]  # noqa: E731
    return {"single_token_passes": float(single.mean()), "single_token_passes_ci95": float(mean_ci95(single)),
            "after_change_rate": float(after.mean()), "after_change_rate_ci95": float(mean_ci95(after)),
            "fresh_rate_by_distance": as_list(rates[0]), "carried_rate_by_distance": as_list(rates[1]),
            "fresh_judged_by_distance": counts[0, 0].tolist(), "carried_judged_by_distance": counts[1, 0].tolist()}


def summarise(passes: np.ndarray, width: int, rounds: int) -> dict:
    """passes (N, H) -> mean and 95% interval per k, the ratio against AR's k x W passes, and the least-squares slope
    of passes per row over rows 2..H (the first row is drafted horizontally)."""
    n, H = passes.shape
    mean = passes.mean(0)
    ci = mean_ci95(passes, axis=0)
    k = np.arange(1, H + 1)
    slope, intercept = np.polyfit(k[1:], mean[1:], 1) if H > 2 else (float("nan"), float("nan"))
    return {"images": n, "passes": mean.tolist(), "passes_ci95": ci.tolist(),
            "ratio": (k * width / mean).tolist(), "passes_per_row": float(slope), "intercept": float(intercept),
            "width": width, "rounds_plus_one": rounds + 1, "first_row_passes": float(mean[0])}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    carry = {name: r["cascades"] for name, r in result.items() if "cascades" in r}
    fig, axes = plt.subplots(1, 3 if carry else 2, figsize=(15 if carry else 10, 4))
    a, b = axes[:2]
    for name, r in result.items():
        k = np.arange(1, len(r["passes"]) + 1)
        a.errorbar(k, r["passes"], yerr=r["passes_ci95"], marker="o", ms=3, capsize=2,
                   label=f"{name}: {r['passes_per_row']:.2f} passes / row")
        b.plot(k, r["ratio"], marker="o", ms=3, label=name)
    a.set_xlabel("rows final (k)")
    a.set_ylabel("target passes spent (prefill included)")
    a.set_title(f"passes along the rows (W = {next(iter(result.values()))['width']})")
    a.legend(fontsize=8)
    b.set_xlabel("rows final (k)")
    b.set_ylabel("AR passes / SSD passes for the first k rows")
    b.set_title("speed-up in passes as rows are added")
    b.legend(fontsize=8)
    if carry:
        c = axes[2]
        for name, r in carry.items():
            for key, style in (("carried_rate_by_distance", "-"), ("fresh_rate_by_distance", ":")):
                rates = np.array([np.nan if v is None else v for v in r[key]])
                c.plot(np.arange(len(rates)), rates, style, marker="o", ms=3, label=f"{name}: {key.split('_')[0]}")
        c.set_xlabel("distance from the window's first token (last bin: this far or more)")
        c.set_ylabel("share of judged tokens that changed")
        c.set_title("cascades: change rate along the window")
        c.legend(fontsize=8)
    save(fig, path)


def add_world_args(ap: argparse.ArgumentParser, prompts: int) -> None:
    """The arguments of an SSD analysis on one world: its checkpoints, held-out prompts, CFG, seed and strategies."""
    ap.add_argument("--backbone", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", type=int, default=prompts, help="held-out prompts (one image each, batch 1)")
    ap.add_argument("--cfg-scale", type=float, default=2.0)
    ap.add_argument("--dtype", default="float32", help="the backbone's precision (generator.dtype): float32 or bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", action="append", default=None, metavar="NAME",
                    help="an SSD decoding config (configs/decoding/NAME.yaml) instead of ssd and ssd_paper "
                         "(repeatable)")
    ap.add_argument("--variant", action="append", default=None, metavar="NAME=key:value,...",
                    help="a decoding config's options with some replaced (base:NAME picks the config, default ssd), "
                         "instead of the two default strategies, after the --strategy ones (repeatable)")


def load_world(args: argparse.Namespace) -> tuple:
    """(backbone, drafter, prompts, strategies) from `add_world_args`' arguments: the strategies named by --strategy
    and --variant, or None for the default two."""
    backbone = load_shapes_generator(args.backbone, args.tokenizer, dtype=args.dtype)
    drafter = load_exported(args.drafter).eval()
    prompts = [m["prompt"] for m in mixed_prompts("test", args.prompts, args.seed)]
    strategies = config_strategies(args.strategy) if args.strategy else None
    if args.variant:
        strategies = {**(strategies or {}), **dict(parse_variant(v) for v in args.variant)}
    return backbone, drafter, prompts, strategies


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_world_args(ap, prompts=32)
    ap.add_argument("--out", required=True, help="folder for row_passes.json and row_passes.png")
    args = ap.parse_args(argv)
    if args.prompts < 2:
        ap.error(f"--prompts {args.prompts}: give at least 2 (the intervals need two images)")
    backbone, drafter, prompts, strategies = load_world(args)
    result = row_passes(backbone, drafter, prompts, args.cfg_scale, args.seed, strategies)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "row_passes.json", json.dumps(result, indent=2))
    plot(result, out / "row_passes.png")
    H = len(next(iter(result.values()))["passes"])
    ks = sorted({1, 2, 4, H // 2, H})
    print(f"{'strategy':<22} {'passes (95%)':>14} {'row 1':>6} {'passes/row':>10} {'r+1':>4} " +
          " ".join(f"{'x@' + str(k):>7}" for k in ks) + f" {'unchecked':>14}")
    for name, r in result.items():
        total = f"{r['passes'][-1]:.1f} +-{r['passes_ci95'][-1]:.1f}"
        print(f"{name:<22} {total:>14} {r['first_row_passes']:>6.1f} {r['passes_per_row']:>10.2f} "
              f"{r['rounds_plus_one']:>4d} " + " ".join(f"{r['ratio'][k - 1]:>7.2f}" for k in ks) +
              f" {r['unchecked']:>7.1f} +-{r['unchecked_ci95']:.1f}" +
              (f"  {r['paired_diff']:+.2f} +-{r['paired_diff_ci95']:.2f} passes vs {r['paired_vs']} (paired)"
               if "paired_diff" in r else ""))
    carry = {name: r["cascades"] for name, r in result.items() if "cascades" in r}
    if carry:
        print("cascades (carry window): passes that finalised one token; change rate of the token after a pass's "
              "first change; change rates by distance from the window's first token (carried / fresh)")
        for name, c in carry.items():
            by = lambda key: " ".join("  -  " if v is None else f"{v:.2f}" for v in c[key][:8])  # noqa: E731
            print(f"{name:<22} one-token passes {c['single_token_passes']:.2f} +-{c['single_token_passes_ci95']:.2f}"
                  f"  after a change {c['after_change_rate']:.2f} +-{c['after_change_rate_ci95']:.2f}  "
                  f"carried d=0..7: {by('carried_rate_by_distance')}  fresh: {by('fresh_rate_by_distance')}")
    return result


if __name__ == "__main__":
    main()
