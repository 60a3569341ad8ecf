"""What a target pass costs on the paper's backbones: a 1-token AR step against a row verification, on a GPU.

For each class (Emu3, Chameleon/Lumina-mGPT, Janus's Llama), a random decoder of the released 7B/8B shape in bf16
(no weights needed; `--weights kind=folder` times the real model instead), a KV cache at mid-image length, and CFG's
two rows. Timed: feeding 1 token (AR's step) and W tokens (SSD's row verification, W = 24, 48, 90), rolled back
after each, plus one f_phi draft call over a row. The projected SSD speed-up at a pass ratio r (AR passes / SSD
passes, measured by a decoding run: `ssd/speed/nfe_ratio` of metrics.json) is r x t_1 / (t_W + t_draft).

    python experiments/real_backbones/time_steps.py --out <dir> [--pass-ratio 5.2 | --metrics <metrics.json>]
    python experiments/real_backbones/time_steps.py --tiny --out <dir>     # CPU, tiny shapes: the plumbing only
-> <dir>/timings.json, <dir>/speedup.md
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import (ChameleonConfig, ChameleonModel, DynamicCache, Emu3TextConfig, LlamaConfig, LlamaModel)
from transformers.models.emu3.modeling_emu3 import Emu3TextModel

from specgen.backbones.random_models import SHAPES_7B
from specgen.drafters.fphi import FPhi

OWN_WIDTH = {"emu3": 90, "lumina_mgpt": 48, "janus_pro": 24}  # each model's row of codes (720, 768, 384 pixels)
CLASSES = {"emu3": (Emu3TextConfig, Emu3TextModel), "lumina_mgpt": (ChameleonConfig, ChameleonModel),
           "janus_pro": (LlamaConfig, LlamaModel)}


def random_decoder(kind: str, tiny: bool, device, dtype):
    """A randomly initialised text decoder of `kind`'s class at the released shape (or a tiny one)."""
    d, layers, heads, kv, ffn, vocab = (64, 2, 4, 4, 128, 512) if tiny else SHAPES_7B[kind]
    cfg_cls, model_cls = CLASSES[kind]
    extra = {"pad_token_id": 0} if tiny else {}
    extra |= {"vq_config": {"base_channels": 32, "channel_multiplier": [1, 1], "num_res_blocks": 1,
                           "num_embeddings": 16, "embed_dim": 8, "latent_channels": 8},
              "vocabulary_map": {"<image>": 3}} if kind == "lumina_mgpt" else {}
    cfg = cfg_cls(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=16384, **extra)
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False), cfg


def real_decoder(kind: str, folder: str, device: str):
    """The decoder of a real checkpoint, through its adapter (bf16 on a GPU)."""
    from specgen.backbones.emu3 import Emu3Backbone
    from specgen.backbones.janus import JanusBackbone
    from specgen.backbones.lumina import LuminaBackbone

    cls = {"emu3": Emu3Backbone, "lumina_mgpt": LuminaBackbone, "janus_pro": JanusBackbone}[kind]
    bb = cls(folder, device=device)
    return bb.decoder, bb.text_config


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def time_feed(model, cfg, context: int, q: int, rows: int, repeats: int, device, dtype) -> float:
    """Seconds per forward of q new tokens for `rows` rows on a cache of `context` tokens (rolled back each time)."""
    cache = DynamicCache(config=cfg)
    x = torch.randn(rows, context, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    model(inputs_embeds=x, position_ids=torch.arange(context, device=device)[None].expand(rows, -1), cache=cache,
          use_cache=True)
    new = torch.randn(rows, q, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    pos = torch.arange(context, context + q, device=device)[None].expand(rows, -1)
    for _ in range(2):  # warm-up
        model(inputs_embeds=new, position_ids=pos, cache=cache, use_cache=True)
        cache.crop(-q)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        model(inputs_embeds=new, position_ids=pos, cache=cache, use_cache=True)
        cache.crop(-q)  # back to the context: every timed pass sees the same cache
    _sync(device)
    return (time.perf_counter() - t0) / repeats


@torch.no_grad()
def time_draft(width: int, hidden: int, rows: int, repeats: int, device, dtype) -> float:
    """Seconds per f_phi down-draft call over a row (the lightweight 'xs' preset)."""
    net = FPhi(hidden, "xs").to(device=device, dtype=dtype).eval()
    h = torch.randn(rows, width, hidden, device=device, dtype=dtype)
    for _ in range(2):
        net.down(h, h)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        net.down(h, h)
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def table(results: dict, ratios: list[float]) -> str:
    """The projected SSD speed-up per model, row width and pass ratio, as a markdown table."""
    head = "| model | W | t_1 (ms) | t_W (ms) | t_draft (ms) | t_W / t_1 | " + \
        " | ".join(f"speed-up at r={r:g}" for r in ratios) + " |"
    lines = [head, "|" + "---|" * (6 + len(ratios))]
    for kind, res in results.items():
        t1 = res["t_1"]
        for w, tw in res["t_row"].items():
            td = res["t_draft"][w]
            own = " (own)" if int(w) == OWN_WIDTH.get(kind, -1) else ""
            cells = " | ".join(f"{r * t1 / (tw + td):.2f}x" for r in ratios)
            lines.append(f"| {kind} | {w}{own} | {1e3 * t1:.2f} | {1e3 * tw:.2f} | {1e3 * td:.2f} | {tw / t1:.2f} | "
                         f"{cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=list(CLASSES), choices=list(CLASSES))
    ap.add_argument("--widths", nargs="+", type=int, default=[24, 48, 90])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU in fp32 (checks the script, not speed)")
    ap.add_argument("--weights", nargs="*", default=[], help="kind=folder: time the real model's decoder")
    ap.add_argument("--pass-ratio", nargs="*", type=float, default=[],
                    help="AR passes / SSD passes to project at (e.g. a run's ssd/speed/nfe_ratio)")
    ap.add_argument("--metrics", nargs="*", default=[], help="metrics.json files whose ssd/speed/nfe_ratio to use")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=64)
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    widths = [4, 8] if args.tiny else args.widths
    weights = dict(w.split("=", 1) for w in args.weights)
    ratios = args.pass_ratio + [json.loads(Path(m).read_text())["ssd/speed/nfe_ratio"] for m in args.metrics]
    ratios = ratios or [2.0, 5.0, 10.0]  # illustrative when no run's ratio is given
    results = {}
    for kind in args.models:
        if kind in weights:
            model, cfg = real_decoder(kind, weights[kind], device)
        else:
            model, cfg = random_decoder(kind, args.tiny, device, dtype)
        own = OWN_WIDTH[kind] if not args.tiny else 4
        context = args.prompt_len + (own // 2) * (own + 1)  # mid-image: half the rows (and their row tokens) cached
        res = {"context": context, "rows": 2, "t_1": time_feed(model, cfg, context, 1, 2, args.repeats, device, dtype),
               "t_row": {}, "t_draft": {}, "weights": weights.get(kind, "random")}
        for w in widths:
            res["t_row"][str(w)] = time_feed(model, cfg, context, w, 2, args.repeats, device, dtype)
            res["t_draft"][str(w)] = time_draft(w, cfg.hidden_size, 2, args.repeats, device, dtype)
        results[kind] = res
        print(kind, json.dumps(res))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
            "tiny": args.tiny, "pass_ratios": ratios}
    (out / "timings.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    md = f"Device: {meta['device']}, {meta['dtype']}, CFG rows 2, cache at mid-image.\n\n" + table(results, ratios)
    (out / "speedup.md").write_text(md + "\n")
    print(md)
    return results


if __name__ == "__main__":
    main()
