"""Compose the repo's real Hydra configs for tests, with every path under a temporary folder."""
from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

from specgen.utils.hydra import CONFIG_DIR


def compose_cfg(name: str, overrides: list[str], tmp_path) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "out")
        cfg.paths.log_dir = str(tmp_path / "logs")
        cfg.paths.data_dir = str(tmp_path / "data")
        cfg.paths.checkpoint_dir = str(tmp_path / "checkpoints")
    return cfg


def tiny_llama(eol: bool, codes: int = 24, grid: int = 5, sharpen: float = 20.0, seed: int = 0):
    """A tiny random ShapesLlama whose head is sharpened so that greedy outputs vary across positions."""
    import torch

    from specgen.backbones.shapes_llama import ShapesLlama

    torch.manual_seed(seed)
    m = ShapesLlama(num_codes=codes, grid_size=grid, eol=eol, preset="tiny").eval()
    with torch.no_grad():
        m.model.lm_head.weight.mul_(sharpen)
    return m
