"""Copies of exported MAR folders whose diffusion head samples with fewer denoising steps (the same weights; the
head's respacing is computed from `sample_steps` when the model is built), for the regime where the transformer
dominates a generation's time:

    python experiments/continuous_speed/respaced_exports.py --steps 25 --out logs/respaced25 \
        checkpoints/mar_p2_shapes checkpoints/mar_p2_shapes_draft

writes <out>/<name>/config.yaml (sample_steps replaced) with model.safetensors linked to the original.
"""
import argparse
import os
from pathlib import Path

from omegaconf import OmegaConf


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="exported MAR folders (config.yaml + model.safetensors)")
    ap.add_argument("--steps", type=int, required=True, help="denoising steps of the head's sampler")
    ap.add_argument("--out", required=True, help="folder that receives one copy per exported folder")
    a = ap.parse_args(argv)
    made = []
    for folder in map(Path, a.folders):
        cfg = OmegaConf.load(folder / "config.yaml")
        if "sample_steps" not in cfg:
            raise ValueError(f"{folder}/config.yaml has no sample_steps: give an exported MAR folder")
        cfg.sample_steps = a.steps
        dest = Path(a.out) / folder.name
        dest.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, dest / "config.yaml")
        link = dest / "model.safetensors"
        if not link.exists():
            os.symlink((folder / "model.safetensors").resolve(), link)
        made.append(dest)
        print(dest)
    return made


if __name__ == "__main__":
    main()
