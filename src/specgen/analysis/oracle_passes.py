"""How many of SSD's passes a better drafter could remove: the default rule with the target itself as the drafter.

An oracle drafter drafts a row column by column from the target's own distribution given the sequence as it is when
the row is drafted (its rows above as they stand then, not final yet in the carry window, and the row's own drafts
to its left), through uncounted target forwards of its own. Its drafts are what a perfect f_phi would propose: a
fresh draft is accepted for sure unless a token before it changes afterwards (q = p at draft temperature null). So
the passes left are the rule's own: corrections travelling along the window, drafts made from rows that were not
final yet. The difference between the default drafter's passes and the oracle's bounds what any drafter can still
gain under the same rule.

    python -m specgen.analysis.oracle_passes --backbone checkpoints/ar_shapes --tokenizer checkpoints/vq_shapes \\
        --drafter checkpoints/fphi_gpu --prompts 64 --seed 7 --out logs/oracle_passes

Strategies, all from `configs/decoding/ssd.yaml` on the same prompts and per-image seeds at batch 1:
- `ssd`: the default (f_phi drafts);
- `oracle_down`: the default with the oracle drafting the rows below the first (at the target's temperature; the first
  row is f_phi's, horizontally chained, as in the default);
- `oracle_all`: the oracle drafts every row, and no re-drafts after a change (no `Redraft` tail: they are f_phi's);
- `oracle_down_t05` / `_t07` / `_t085`: `oracle_down` with the oracle's drafts drawn at temperature 0.5 / 0.7 / 0.85:
  a perfect drafter made worse by a known amount, so that passes can be read against down acceptance (`accept_down`:
  the rows below the first, each draft at its first judgement).
-> <out>/oracle_passes.json: `row_passes`' summary per strategy, per-image passes and paired differences against
`ssd`. The oracle's own forwards are not counted (it is a bound, not a decoder).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specgen.analysis.row_passes import add_paired, decoder, decoding_options, summarise
from specgen.backbones.loading import load_shapes_generator
from specgen.decoding.sampling import inverse_cdf, make_rngs, uniform
from specgen.decoding.ssd_drafting import Drafting
from specgen.evaluation.benchmarks import mixed_prompts
from specgen.utils.checkpoints import atomic_write_text, load_exported


def oracle_row(st, row: int, images: torch.Tensor, temperature: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `row` of images `images` (S,) drafted column by column from the target's distribution given the current
    sequence (uncounted forwards on a cache of its own; the decoder's cache and tokens are untouched):
    codes (S, W), q (S, W, V)."""
    g, bb, dev = st.g, st.bb, st.seq.device
    first = g.position(row, 0)
    seq = st.seq.clone()
    rep = torch.cat([images + k * st.B for k in range(st.reps)])  # the images' rows, CFG branches included
    cache = bb.new_cache(st.rows)
    embeds = torch.cat([bb.embed_tokens(st.rows.ids), st.embed(seq[:, g.prefix_len:first])], 1)
    h = bb.forward_embeds(embeds, torch.arange(first, device=dev), cache)[:, -1]  # (B', D): the state before (row, 0)
    u = uniform((len(images), g.width), st.image_gens(images), dev)
    codes, qs = [], []
    for c in range(g.width):
        q = st.dist(h, temperature)[images]  # (S, V)
        tok = inverse_cdf(q, u[:, c])
        codes.append(tok)
        qs.append(q)
        seq[rep, first + c] = tok.repeat(st.reps)
        if c < g.width - 1:
            h = bb.forward_embeds(st.embed(seq[:, first + c:first + c + 1]),
                                  torch.tensor([first + c], device=dev), cache)[:, -1]
    return torch.stack(codes, 1), torch.stack(qs, 1)


def oracle_drafting(rows: str, temperature: float | None = None) -> type:
    """A `Drafting` class (the decoders' `drafting=` hook) whose down drafts (`rows="down"`) or every row's drafts
    (`"all"`) come from `oracle_row` at `temperature` (None: the target's), whatever drafter the decoder is given."""
    if rows not in ("down", "all"):
        raise ValueError(f"oracle rows={rows!r}: use 'down' (rows below the first) or 'all'")

    class OracleDrafting(Drafting):
        def down(self, rows_: torch.Tensor | int, images: torch.Tensor | None = None):
            if isinstance(rows_, int):  # row rows_ of every image
                rows_ = torch.full((self.st.B,), rows_, device=self.st.seq.device)
            images = torch.arange(self.st.B, device=rows_.device) if images is None else images
            if len(set(rows_.tolist())) != 1:
                raise ValueError(f"the oracle drafts one row at a time; got rows {rows_.tolist()} (decode at batch 1)")
            return oracle_row(self.st, int(rows_[0]), images, temperature)

        def right(self, row: int):
            if rows == "down":
                return super().right(row)
            return oracle_row(self.st, row, torch.arange(self.st.B, device=self.st.seq.device), temperature)

    return OracleDrafting


def strategies() -> dict[str, tuple[dict, str | None, float | None]]:
    """name -> (the default's options, oracle rows or None, oracle temperature)."""
    default = decoding_options("ssd")
    no_redraft = [t for t in default.get("tails", []) if not t["_target_"].endswith(".Redraft")]
    return {"ssd": (default, None, None),
            "oracle_down": (default, "down", None),
            "oracle_all": ({**default, "tails": no_redraft}, "all", None),
            "oracle_down_t05": (default, "down", 0.5),  # a perfect drafter's drafts drawn colder: less acceptance
            "oracle_down_t07": (default, "down", 0.7),
            "oracle_down_t085": (default, "down", 0.85)}


@torch.inference_mode()
def oracle_passes(backbone, drafter, prompts: list[str], cfg_scale: float, seed: int = 0,
                  names: list[str] | None = None) -> dict:
    """Per strategy: `row_passes.summarise` of the passes when each row is final, per-image passes and the paired
    difference against the first strategy."""
    out, totals = {}, {}
    chosen = strategies() if names is None else {n: strategies()[n] for n in names}
    for name, (options, rows, temperature) in chosen.items():
        per_image, accept = [], []
        for i, text in enumerate(tqdm(prompts, desc=name, unit="img")):
            fn, kwargs = decoder(options)
            if rows:
                kwargs["drafting"] = oracle_drafting(rows, temperature)
            _, stats = fn(backbone, backbone.prompts([text]), drafter, cfg_scale=cfg_scale, rngs=make_rngs([seed + i]),
                          **kwargs)
            per_image.append(stats["row_final_pass"][0].float())
            accept.append(stats["accept_map"][0, 1:].float().mean().item())  # rows below the first, first judgement
        passes = torch.stack(per_image).numpy()
        out[name] = summarise(passes, backbone.grid.width, options.get("rounds", 0))
        out[name].update(oracle=rows, oracle_temperature=temperature, accept_down=float(sum(accept) / len(accept)))
        add_paired(out, totals, name, passes[:, -1])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--drafter", required=True, help="the default's drafter (f_phi), for `ssd` and the first row")
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts, one image each at batch 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cfg-scale", type=float, default=2.0)
    ap.add_argument("--strategy", action="append", choices=sorted(strategies()),
                    help="strategies to run (repeatable; default: all, `ssd` first)")
    ap.add_argument("--out", required=True, help="folder for oracle_passes.json")
    args = ap.parse_args(argv)
    if args.prompts < 2:
        ap.error(f"--prompts {args.prompts}: give at least 2 (the intervals need two images)")
    backbone = load_shapes_generator(args.backbone, args.tokenizer)
    drafter = load_exported(args.drafter).eval()
    prompts = [m["prompt"] for m in mixed_prompts("test", args.prompts, args.seed)]
    result = oracle_passes(backbone, drafter, prompts, args.cfg_scale, args.seed, args.strategy)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "oracle_passes.json", json.dumps(result, indent=2))
    H = len(next(iter(result.values()))["passes"])
    print(f"{'strategy':<18} {'passes (95%)':>14} {'row 1':>6} {'passes/row':>10} {'x AR':>6} {'accept down':>11}  "
          f"paired")
    for name, r in result.items():
        paired = (f"{r['paired_diff']:+.2f} +-{r['paired_diff_ci95']:.2f} vs {r['paired_vs']}"
                  if "paired_diff" in r else "")
        print(f"{name:<18} {r['passes'][-1]:>7.1f} +-{r['passes_ci95'][-1]:<4.1f} {r['first_row_passes']:>6.1f} "
              f"{r['passes_per_row']:>10.2f} {r['ratio'][H - 1]:>6.2f} {r['accept_down']:>11.3f}  {paired}")
    return result


if __name__ == "__main__":
    main()
