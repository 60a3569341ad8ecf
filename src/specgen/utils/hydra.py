"""Hydra glue: config resolvers, seeding, a task wrapper that always closes the W&B run."""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specgen.utils import locations

log = logging.getLogger(__name__)
CONFIG_DIR = str(locations.config_dir())


def repo_root() -> str:
    """The root of checkpoints/, data/ and logs/ (`paths.root_dir`): see `specgen.utils.locations`."""
    return str(locations.repo_root())


def autocast_precision(accelerator: str = "cpu", cpuinfo: str = "/proc/cpuinfo") -> str:
    """Lightning precision for training: 'bf16-mixed' on GPUs and on CPUs with native bf16 matrix units
    (AVX512-BF16 or AMX; about 1.4x faster steps than fp32 there), '32-true' on other CPUs, where bf16
    matmuls are emulated and about 10x slower than fp32 (measured on an AVX2-only AMD EPYC).
    Configs use it as `${specgen_autocast_precision:${trainer.accelerator}}`."""
    if accelerator in ("gpu", "cuda", "mps"):
        return "bf16-mixed"
    if accelerator == "auto" and torch.cuda.is_available():
        return "bf16-mixed"
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:  # not Linux: no way to tell, take the safe choice
        return "32-true"
    return "bf16-mixed" if flags & {"avx512_bf16", "amx_bf16"} else "32-true"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("specgen_root"):
        OmegaConf.register_new_resolver("specgen_root", repo_root)
    if not OmegaConf.has_resolver("specgen_autocast_precision"):
        OmegaConf.register_new_resolver("specgen_autocast_precision", autocast_precision)


def close_wandb() -> None:
    try:
        import wandb  # deferred and optional: seconds to import, and a run may log without it
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
