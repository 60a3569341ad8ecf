"""Lightning callbacks: export the trained network with its config, metrics and command."""
from __future__ import annotations

import shlex
import sys

import lightning as L
from omegaconf import DictConfig, OmegaConf

from specgen.utils.checkpoints import export


class ExportModel(L.Callback):
    """At the end of fit (and at every validation), write `pl_module.net` as an exported model folder."""

    def __init__(self, dirpath: str, net_cfg, every_validation: bool = True):
        self.dirpath, self.net_cfg, self.every_validation = dirpath, net_cfg, every_validation

    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule):
        if trainer.sanity_checking or not trainer.is_global_zero or trainer.fast_dev_run:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        metrics["global_step"] = trainer.global_step
        command = _command()
        extra = pl_module.export_extra() if hasattr(pl_module, "export_extra") else None
        net_cfg = OmegaConf.to_container(self.net_cfg, resolve=True) if isinstance(self.net_cfg, DictConfig) \
            else dict(self.net_cfg)
        if hasattr(pl_module.net, "export_config"):  # values measured in training, e.g. a latent scale
            net_cfg.update(pl_module.net.export_config())
        export(self.dirpath, pl_module.net, net_cfg, metrics, command, extra)

    def on_validation_end(self, trainer, pl_module):
        if self.every_validation:
            self._export(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._export(trainer, pl_module)


def _command() -> str:
    """The command that launched this run (the Hydra overrides when run through an entry point)."""
    from hydra.core.hydra_config import HydraConfig

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    if HydraConfig.initialized():
        return " ".join([prog] + [shlex.quote(o) for o in HydraConfig.get().overrides.task])
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])
