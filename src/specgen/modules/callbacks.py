"""Lightning callbacks: export the trained network with its config, metrics and command; fit a run into a time
budget; score a backbone's samples on GenEval at each validation."""
from __future__ import annotations

import shlex
import sys
import time

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from specgen.decoding import ar
from specgen.decoding.sampling import make_rngs
from specgen.evaluation.benchmarks import GenEval
from specgen.utils.checkpoints import export, load_exported


class ExportModel(L.Callback):
    """At the end of fit (and at every validation), write the trained network as an exported model folder:
    `pl_module.export_net` where the module defines one (e.g. its EMA weights), else `pl_module.net`."""

    def __init__(self, dirpath: str, net_cfg, every_validation: bool = True, weights_dtype: str = "float32"):
        self.dirpath, self.net_cfg, self.every_validation = dirpath, net_cfg, every_validation
        self.weights_dtype = weights_dtype

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, FSDPStrategy):  # rank 0's `net` holds only its shard of the weights
            raise ValueError("callbacks.export cannot gather FSDP-sharded weights (trainer=fsdp): run with "
                             "callbacks.export=null and export the run's last.ckpt (a full state dict) with "
                             "`python -m specgen.utils.ckpt_export <run>/checkpoints/last.ckpt --like <folder> --out <dir>`")

    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule):
        if trainer.sanity_checking or not trainer.is_global_zero or trainer.fast_dev_run:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        metrics["global_step"] = trainer.global_step
        command = _command()
        extra = pl_module.export_extra() if hasattr(pl_module, "export_extra") else None
        net_cfg = OmegaConf.to_container(self.net_cfg, resolve=True) if isinstance(self.net_cfg, DictConfig) \
            else dict(self.net_cfg)
        net = getattr(pl_module, "export_net", pl_module.net)
        if hasattr(net, "export_config"):  # values measured in training, e.g. a latent scale
            net_cfg.update(net.export_config())
        net_cfg.update(getattr(pl_module, "net_overrides", {}))  # values resolved at build (drafter.hidden_size=auto)
        export(self.dirpath, net, net_cfg, metrics, command, extra, self.weights_dtype)

    def on_validation_end(self, trainer, pl_module):
        if self.every_validation:
            self._export(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._export(trainer, pl_module)


def _command() -> str:
    """The command that launched this run (the Hydra overrides when run through an entry point)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    if HydraConfig.initialized():
        return " ".join([prog] + [shlex.quote(o) for o in HydraConfig.get().overrides.task])
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])


class TimeBudget(L.Callback):
    """Fit the run into `seconds` of wall-clock time by choosing its step count from the measured speed.

    Between steps `calibrate_from` and `calibrate_to` the callback times training steps, then sets
    `trainer.max_steps` to the steps that fit in what is left of the budget (times `safety`, which
    leaves room for validations and export), never above the configured `max_steps`. The warmup-cosine
    schedules read `trainer.max_steps` at every step, so the learning rate decays to its floor at the
    new end. A hard stop at `seconds` remains as a guard. With `seconds: null` it does nothing.
    The chosen step count is logged (`budget/max_steps`) and ends up in the exported metrics
    (`global_step`), so a run on another machine can reproduce it with `trainer.max_steps=<that>`.
    """

    def __init__(self, seconds: float | None = None, calibrate_from: int = 20, calibrate_to: int = 120,
                 safety: float = 0.85):
        if seconds is not None and seconds <= 0:
            raise ValueError(f"callbacks.time_budget.seconds={seconds!r}: give a positive number of seconds or null")
        if not 0 <= calibrate_from < calibrate_to:
            raise ValueError(f"callbacks.time_budget: calibrate_from={calibrate_from} must be below "
                             f"calibrate_to={calibrate_to}")
        self.seconds, self.lo, self.hi, self.safety = seconds, calibrate_from, calibrate_to, safety
        self._t0 = self._t_lo = None

    @staticmethod
    def clock() -> float:
        """Wall-clock seconds (a method, so that tests can drive the callback with a simulated clock)."""
        return time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        self._t0 = self.clock()
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.seconds is None or trainer.fast_dev_run:
            return
        now, done = self.clock(), trainer.global_step - self._start_step
        if done == self.lo:
            self._t_lo = now
        elif done == self.hi and self._t_lo is not None:
            per_step = (now - self._t_lo) / (self.hi - self.lo)
            left = self.seconds - (now - self._t0)
            steps = trainer.global_step + int(self.safety * left / per_step)
            cap = trainer.fit_loop.epoch_loop.max_steps
            if cap is not None and cap > 0:
                steps = min(steps, cap)
            trainer.fit_loop.epoch_loop.max_steps = max(steps, trainer.global_step + 1)
            pl_module.log("budget/max_steps", float(trainer.fit_loop.epoch_loop.max_steps), rank_zero_only=True)
            print(f"[time budget] {1 / per_step:.1f} steps/s -> max_steps={trainer.fit_loop.epoch_loop.max_steps}",
                  flush=True)
        if now - self._t0 > self.seconds:
            print(f"[time budget] {self.seconds:.0f} s spent at step {trainer.global_step}: stopping", flush=True)
            trainer.should_stop = True


class ValGenEval(L.Callback):
    """At each validation, sample validation prompts with the AR backbone being trained (plain AR decoding) and
    log their GenEval scores (`val/geneval/<task>`, `val/geneval_overall`) by the world's exact parser.
    The tokenizer that decodes the samples is held here, so it never enters the module or its checkpoints."""

    def __init__(self, tokenizer_dir: str, prompts_per_task: int = 3, samples: int = 2, cfg_scale: float = 2.0):
        self.tokenizer_dir, self.cfg_scale = tokenizer_dir, cfg_scale
        self.bench = GenEval(split="val", prompts_per_task=prompts_per_task, samples_per_prompt=samples)
        self._tokenizer = None

    @torch.no_grad()
    def scores(self, backbone, device) -> dict[str, float]:
        """GenEval task scores of the backbone's samples of the validation prompts."""
        if self._tokenizer is None:
            self._tokenizer = load_exported(self.tokenizer_dir, device)
        jobs = self.bench.jobs(seed=0)
        codes, _ = ar.generate(backbone, backbone.prompts([j.prompt for j in jobs]), cfg_scale=self.cfg_scale,
                               rngs=make_rngs([j.seed for j in jobs], device))
        images = (self._tokenizer.to(device).decode(codes).float() * 255).round().to(torch.uint8)
        scores, _ = self.bench.score(jobs, list(images.permute(0, 2, 3, 1).cpu().numpy()))
        return scores

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        scores = self.scores(pl_module.net, pl_module.device)
        pl_module.log_dict({f"val/geneval/{k}": v for k, v in scores.items()}, prog_bar=False)
        pl_module.log("val/geneval_overall", scores["overall"], prog_bar=True)
