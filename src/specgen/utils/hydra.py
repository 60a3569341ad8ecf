"""Hydra glue: config resolvers, seeding, a task wrapper that always closes the W&B run."""
from __future__ import annotations

import functools
import logging
from pathlib import Path

from omegaconf import OmegaConf

log = logging.getLogger(__name__)
CONFIG_DIR = str(Path(__file__).resolve().parents[3] / "configs")


def repo_root() -> str:
    """The repository root (where configs/ and the shipped checkpoints/ live)."""
    return str(Path(__file__).resolve().parents[3])


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("specgen_root"):
        OmegaConf.register_new_resolver("specgen_root", repo_root)


def close_wandb() -> None:
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.finish()


def task_wrapper(fn):
    """Run a task and close the W&B run whatever happens (one W&B run per sweep job)."""

    @functools.wraps(fn)
    def wrapped(cfg):
        try:
            return fn(cfg)
        finally:
            close_wandb()

    return wrapped


register_resolvers()
