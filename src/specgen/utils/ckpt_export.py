"""Turn a Lightning checkpoint of a run into an exported model folder (what `generator.backbone_dir`,
`init_from` and the drafter configs read), to score checkpoints along a run:

    python -m specgen.train ... callbacks.model_checkpoint.save_top_k=-1     # a .ckpt every 250 steps
    python -m specgen.utils.ckpt_export <run>/checkpoints/<name>.ckpt --like <run's export> --out <dir>

`--like` names an exported folder of the same network (the run's own export, or the model it started from):
its `config.yaml` builds the network, its weight dtype is kept and its `extra.json` (a drafter's backbone) is
copied. `--prefix` picks the module attribute holding the network (`net`; `ema` for the EMA weights of MAR runs).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specgen.utils.checkpoints import build, export, stored_weights_dtype


def ckpt_to_export(ckpt: str | Path, like: str | Path, out: str | Path, prefix: str = "net") -> Path:
    """Write the network `prefix` of the Lightning checkpoint `ckpt` as an exported folder `out`, built from
    the config of the exported folder `like`; returns `out`."""
    ckpt, like, out = Path(ckpt), Path(like), Path(out)
    if not ckpt.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(ckpt)!r}: give a .ckpt from a run's checkpoints/ folder "
                                f"(kept every 250 steps with callbacks.model_checkpoint.save_top_k=-1)")
    if not (like / "config.yaml").is_file() or not (like / "model.safetensors").is_file():
        raise FileNotFoundError(f"--like {str(like)!r} is not an exported model (expected config.yaml and "
                                f"model.safetensors): give the run's export folder or the model it started from")
    if out.resolve() == like.resolve():
        raise ValueError(f"--out {str(out)!r} is the --like folder: write the export to a new folder")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    head = prefix + "."
    net_state = {k[len(head):]: v for k, v in state["state_dict"].items() if k.startswith(head)}
    if not net_state:
        found = sorted({k.split(".")[0] for k in state["state_dict"]})
        raise ValueError(f"--prefix {prefix!r}: the checkpoint has no tensors under it (it has {found}); "
                         f"pick one of those")
    cfg = OmegaConf.load(like / "config.yaml")
    net = build(OmegaConf.to_container(cfg))
    try:
        net.load_state_dict(net_state)
    except RuntimeError as e:
        raise ValueError(f"the checkpoint's {prefix!r} weights do not fit the network of {str(like / 'config.yaml')!r}"
                         f" (another architecture?): {str(e).splitlines()[0]}") from e
    extra = json.loads((like / "extra.json").read_text()) if (like / "extra.json").is_file() else None
    metrics = {"global_step": int(state.get("global_step", -1)), "from_ckpt": str(ckpt)}
    return export(out, net, cfg, metrics=metrics, extra=extra, weights_dtype=stored_weights_dtype(like, net),
                  command=f"python -m specgen.utils.ckpt_export {ckpt} --like {like} --out {out} --prefix {prefix}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="a Lightning .ckpt of a run")
    parser.add_argument("--like", required=True, help="an exported folder of the same network (its config.yaml)")
    parser.add_argument("--out", required=True, help="folder to write the export to")
    parser.add_argument("--prefix", default="net", help="module attribute holding the network (net, ema)")
    args = parser.parse_args(argv)
    try:
        out = ckpt_to_export(args.ckpt, args.like, args.out, args.prefix)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"exported step {json.loads((out / 'metrics.json').read_text())['global_step']} -> {out}")


if __name__ == "__main__":
    main()
