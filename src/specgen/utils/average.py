"""Average the weights of exported models of one architecture (checkpoint averaging along a run).

    python -m specgen.utils.average --out logs/ar_avg checkpoints/ar_shapes logs/ar_train/export [--weights 0.5 0.5]

Every input must be an exported folder (`model.safetensors` + `config.yaml`) with the same `config.yaml`;
floating-point tensors are averaged in fp32 and stored in the dtype of the first input, other tensors must
agree. The output folder gets the averaged weights, the shared config (and `extra.json`, which must be the same
in every input: a drafter's backbone) and a `command.txt` naming the inputs.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from specgen.utils.checkpoints import build, export, stored_weights_dtype


def _read(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    weights, config = folder / "model.safetensors", folder / "config.yaml"
    if not weights.is_file() or not config.is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not an exported model (expected model.safetensors and "
                                f"config.yaml there): pass folders written by the export callback")
    return load_file(str(weights)), OmegaConf.to_yaml(OmegaConf.load(config))  # yaml text: compared across inputs


def average_exports(inputs: list[str | Path], out: str | Path, weights: list[float] | None = None) -> Path:
    """Write the weighted mean of the exported models `inputs` to the folder `out`; returns `out`."""
    inputs = [Path(p) for p in inputs]
    if len(inputs) < 2:
        raise ValueError(f"got {len(inputs)} input folder(s): averaging needs at least two")
    weights = [1.0 / len(inputs)] * len(inputs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(inputs):
        raise ValueError(f"--weights has {len(weights)} value(s) for {len(inputs)} inputs: give one per input")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--weights {weights}: use non-negative weights with a positive sum")
    out = Path(out)
    if any(out.resolve() == p.resolve() for p in inputs):
        raise ValueError(f"--out {str(out)!r} is one of the inputs: write the average to a new folder")
    total = sum(weights)
    weights = [w / total for w in weights]
    states, configs = zip(*(_read(p) for p in inputs))
    for p, cfg, state in zip(inputs[1:], configs[1:], states[1:]):
        if cfg != configs[0]:
            raise ValueError(f"{str(p)!r} has another config.yaml than {str(inputs[0])!r}: only models of one "
                             f"architecture (one config) can be averaged")
        if state.keys() != states[0].keys():
            raise ValueError(f"{str(p)!r} and {str(inputs[0])!r} hold different tensors: not the same model")
    extras = {(p / "extra.json").read_text() if (p / "extra.json").is_file() else None for p in inputs}
    if len(extras) > 1:
        raise ValueError("the inputs' extra.json differ (e.g. drafters of different backbones): average only "
                         "models trained against the same backbone")
    mean = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            mean[key] = sum(w * s[key].to(torch.float32) for w, s in zip(weights, states))
        else:
            for p, s in zip(inputs[1:], states[1:]):
                if not torch.equal(s[key], first):
                    raise ValueError(f"non-float tensor {key!r} differs between {str(inputs[0])!r} and {str(p)!r}")
            mean[key] = first
    cfg = OmegaConf.create(configs[0])
    net = build(OmegaConf.to_container(cfg))
    net.load_state_dict(mean)
    extra = extras.pop()
    command = ("python -m specgen.utils.average --out " + shlex.quote(str(out)) + " "
               + " ".join(shlex.quote(str(p)) for p in inputs) + " --weights " + " ".join(f"{w:g}" for w in weights))
    return export(out, net, cfg, metrics={"averaged_from": [str(p) for p in inputs], "weights": weights},
                  command=command, extra=None if extra is None else json.loads(extra),
                  weights_dtype=stored_weights_dtype(inputs[0], net))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="exported model folders (same config.yaml)")
    parser.add_argument("--out", required=True, help="folder to write the averaged model to")
    parser.add_argument("--weights", nargs="+", type=float, default=None, help="one weight per input (normalised)")
    args = parser.parse_args(argv)
    try:
        out = average_exports(args.inputs, args.out, args.weights)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"averaged {len(args.inputs)} models -> {out}")


if __name__ == "__main__":
    main()
