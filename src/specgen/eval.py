"""Evaluate a decoding strategy on benchmarks: `python -m specgen.eval experiment=<name> [overrides]`."""
from __future__ import annotations

import hydra
import torch
from omegaconf import DictConfig

from specgen.evaluation.runner import run
from specgen.modules.predict_module import fill_image_cache
from specgen.utils.hydra import CONFIG_DIR, task_wrapper


@task_wrapper
def evaluate(cfg: DictConfig) -> dict:
    torch.manual_seed(cfg.seed)
    if cfg.get("num_threads"):
        torch.set_num_threads(cfg.num_threads)
    if cfg.get("trainer"):  # sharded: the trainer's processes fill the image cache, then rank 0 scores
        built = fill_image_cache(cfg)
        return {} if built is None else run(cfg, **built)
    return run(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    main()
