"""Sharded evaluation: `Trainer.predict` decodes a benchmark's jobs over the trainer's processes into the image cache.

The evaluation runner generates every (prompt, seed) job into an image cache and scores the images read back from
it. With a `trainer` in the eval config (`trainer=ddp` on GPUs, under torchrun or SLURM; `trainer=ddp_cpu` on a
laptop), the generation is done first by Lightning:
1. rank 0 builds the benchmarks and lists their jobs (each image once); the list is broadcast to every rank;
2. `Trainer.predict` hands each rank a disjoint, deterministic slice of that list (Lightning's
   UnrepeatedDistributedSampler: rank r gets jobs r, r + W, r + 2W, ...) in batches of the strategy's batch size;
3. `predict_step` decodes a batch on the rank's device and writes each image and its stats into the shared cache
   (atomic writes; images already there are skipped, so an interrupted run resumes; over several nodes
   `paths.data_dir` must be on a file system they all see);
4. after a barrier, rank 0 runs the one-process runner, which finds every image cached and scores them: the same
   metrics as a one-process run, without the wall-clock fields (several processes on one machine time nothing
   honestly). A speed section (`speed:`) is measured afterwards by rank 0 alone; the other ranks return.
"""
from __future__ import annotations

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

from specgen.evaluation.generate import generate_images
from specgen.evaluation.runner import (build_benchmarks, image_cache_dir, quality_strategies, strategy_batch_size,
                                       unique_jobs)


class _Jobs(Dataset):
    def __init__(self, jobs: list):
        self.jobs = jobs

    def __len__(self):
        return len(self.jobs)

    def __getitem__(self, i):
        return self.jobs[i]


def _as_list(batch: list) -> list:
    return batch  # jobs are dataclasses: a batch stays a list of them


class JobsDataModule(L.LightningDataModule):
    """The benchmarks' unique jobs, listed once by rank 0 (which keeps the benchmarks to score them) and broadcast."""

    def __init__(self, cfg: DictConfig):
        super().__init__()
        self.cfg, self.batch_size = cfg, cfg.batch_size
        self.jobs: list | None = None
        self.benchmarks: list | None = None

    def setup(self, stage: str | None = None):
        if self.jobs is not None:  # a later strategy of the same run: the same jobs
            return
        jobs = None
        if self.trainer.global_rank == 0:  # scorers (detectors, VQA models) are built on rank 0 only
            self.benchmarks = build_benchmarks(self.cfg)
            jobs = unique_jobs(self.benchmarks, self.cfg.seed)
        self.jobs = self.trainer.strategy.broadcast(jobs, src=0)

    def predict_dataloader(self):
        return DataLoader(_Jobs(self.jobs), batch_size=self.batch_size, shuffle=False, collate_fn=_as_list)


class DecodeModule(L.LightningModule):
    """`predict_step` decodes a batch of jobs with the current strategy (`use`) into the shared image cache.

    The backbone is built in `setup`, on this process's device, and kept outside the module tree: it is frozen,
    never trained or saved, and the trainer's precision does not cast it (decoding runs in the generator's own
    dtype, `generator.dtype` where it has one)."""

    def __init__(self, generator: DictConfig, data_dir: str):
        super().__init__()
        self.generator_cfg, self.data_dir = generator, data_dir
        self.decoding: DictConfig | None = None
        self.decode_fn = None
        self.__dict__["backbone"] = None

    def use(self, decoding: DictConfig) -> None:
        """Decode with this strategy (a `decoding` config: name, fn, optional batch_size) from now on."""
        self.decoding, self.decode_fn = decoding, instantiate(decoding.fn)

    def setup(self, stage: str | None = None):
        if self.backbone is None:
            self.__dict__["backbone"] = instantiate(self.generator_cfg, device=str(self.trainer.strategy.root_device))

    def transfer_batch_to_device(self, batch: list, device: torch.device, dataloader_idx: int) -> list:
        return batch  # jobs (prompt, seed) hold no tensors; the decoder puts its own on the backbone's device

    def predict_step(self, batch: list, batch_idx: int) -> None:
        t = self.trainer
        # no autocast: trainer.precision (bf16-mixed in trainer=ddp) is a training setting; images must not depend on it
        with torch.autocast(self.device.type, enabled=False), torch.no_grad():
            generate_images(batch, self.backbone, self.decode_fn, image_cache_dir(self.data_dir, self.backbone,
                                                                                 self.decoding),
                            len(batch), progress=False, timed=t.world_size == 1,
                            note={"rank": t.global_rank, "world_size": t.world_size})


def fill_image_cache(cfg: DictConfig) -> dict | None:
    """Generate the benchmark images of every strategy of `cfg` over the processes of `cfg.trainer`.

    Returns on rank 0 what it built (`backbone`, `benchmarks`: hand them to `runner.run`; None where the process
    did not build them, as in the launching process of `ddp_spawn`), and None on every other rank."""
    trainer: L.Trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False, callbacks=[])
    has_bench = any(isinstance(n, DictConfig) and "_target_" in n for n in (cfg.get("benchmark") or {}).values())
    if not has_bench:  # a speed-only run: nothing to shard, speed is measured by one process
        return {} if trainer.global_rank == 0 else None
    # resolved here: processes started by ddp_spawn have no Hydra runtime (paths.output_dir) to resolve against
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    module, data = DecodeModule(resolved.generator, resolved.paths.data_dir), JobsDataModule(resolved)
    for decoding in quality_strategies(resolved):
        module.use(decoding)
        data.batch_size = strategy_batch_size(resolved, decoding)
        trainer.predict(module, datamodule=data, return_predictions=False)
    trainer.strategy.barrier("image cache written")
    if trainer.global_rank != 0:
        return None
    return {"backbone": module.backbone, "benchmarks": data.benchmarks}
