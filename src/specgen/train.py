"""Train a model of the repo: `python -m specgen.train experiment=<name> [overrides]`."""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file

from specgen.utils.hydra import CONFIG_DIR, task_wrapper

log = logging.getLogger(__name__)


def _resume_path(cfg: DictConfig) -> str | None:
    """`ckpt_path=last` resumes from the run folder's last.ckpt when one exists."""
    if cfg.ckpt_path == "last":
        last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        return str(last) if last.is_file() else None
    if cfg.ckpt_path is not None and not Path(cfg.ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path!r} does not exist: give a Lightning .ckpt file, "
                                f"'last' (resume the run folder) or null (start fresh)")
    return cfg.ckpt_path


def _init_weights(module: L.LightningModule, dirpath: str, strict: bool = True) -> None:
    """Start `module.net` from an exported model folder (fine-tuning / continued training with a new schedule);
    `strict=False` lets parameters the export lacks keep their initialisation (a net grown from the export)."""
    weights = Path(dirpath) / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"init_from={dirpath!r} has no model.safetensors: give an exported model folder "
                                f"(e.g. checkpoints/ar_shapes) or null")
    missing, unexpected = module.net.load_state_dict(load_file(str(weights)), strict=False)
    if missing and not unexpected and not strict:
        log.info("init_from=%s: %d parameters not in the export keep their initialisation (%s, ...)",
                 dirpath, len(missing), missing[0])
    elif missing or unexpected:
        raise ValueError(f"init_from={dirpath!r} does not match the configured network: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; use the backbone/drafter config the export was made with"
                         + ("" if unexpected else ", or init_strict=false to grow a net from it"))
    log.info("initialised %s from %s", type(module.net).__name__, dirpath)


@task_wrapper
def train(cfg: DictConfig) -> dict:
    L.seed_everything(cfg.seed, workers=True)
    torch.set_num_threads(cfg.get("num_threads") or torch.get_num_threads())
    # _convert_="all": plain lists/dicts in hparams, so checkpoints load with weights_only=True
    datamodule: L.LightningDataModule = instantiate(cfg.data, _convert_="all")
    if cfg.get("prepare_only"):  # write the data caches (token / teacher shards) and stop
        datamodule.prepare_data()
        log.info("prepare_only: data of %s is ready", type(datamodule).__name__)
        return {}
    module: L.LightningModule = instantiate(cfg.module, _convert_="all")
    if cfg.get("init_from"):
        _init_weights(module, cfg.init_from, cfg.get("init_strict", True))
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    if not loggers:  # nothing to monitor into (logger=none)
        callbacks = [c for c in callbacks if not isinstance(c, L.pytorch.callbacks.LearningRateMonitor)]
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    log.info("fitting %s on %s", type(module).__name__, type(datamodule).__name__)
    trainer.fit(module, datamodule=datamodule, ckpt_path=_resume_path(cfg))
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
