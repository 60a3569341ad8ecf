"""Cached data shards split across the processes of a multi-process run (DDP, FSDP).

The shard caches (teacher states or tokens for distillation, VQ codes or KL latents for backbones) are written once
and read by every run. Under a trainer of W processes, rank r
- writes its share of the missing shards (missing[r::W], in `setup`, so that every GPU samples the teacher instead of
  rank 0 alone in `prepare_data`), after which all ranks meet at a barrier;
- trains on its own training shards only (shards[r::W]: host memory holds 1/W of them), shuffled each epoch.
The training shards must divide evenly among the ranks: every rank then has the same number of batches per epoch
(DDP's collectives hang when one rank's epoch ends first). Validation shards are read whole and split by
Lightning's distributed sampler. In one process nothing changes: `prepare_data` writes every missing shard.
Over several nodes the cache folder (`data.cache_dir`) must be on a file system they all see.

FSDP (`trainer=fsdp`, `fsdp_strategy`) is the route for drafters of 7B-scale backbones, whose f_phi (235-470M
parameters at width 4096) holds weights, gradients and Adam moments of 16 bytes a parameter in fp32: FSDP shards
those over the GPUs. The frozen teacher is outside the module tree (never trained or saved), so each GPU still
holds a whole copy of it (about 16 GB in bf16 at 8B).
"""
from __future__ import annotations

import importlib
from typing import Callable, Sequence

import lightning as L
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def rank_world(trainer: L.Trainer | None) -> tuple[int, int]:
    """(global rank, number of processes) of the run a data module is attached to; (0, 1) without a trainer."""
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


def rank_shards(indices: Sequence[int], rank: int, world: int, name: str) -> list[int]:
    """This rank's training shards, indices[rank::world]; the shards must divide evenly among the ranks."""
    indices = list(indices)
    if len(indices) % world:
        raise ValueError(f"{name}={len(indices)} training shards do not divide among {world} processes: give a "
                         f"multiple of {world} (every rank needs as many batches per epoch as the others)")
    return indices[rank::world]


def write_rank_share(trainer: L.Trainer, missing: Callable[[], list], write: Callable[[list], None]) -> None:
    """Every rank writes missing()[rank::world] (listed after a barrier, so all ranks see the same list), then all
    wait until the last shard is on disk."""
    rank, world = rank_world(trainer)
    trainer.strategy.barrier("list the missing shards")
    todo = missing()[rank::world]
    if todo:
        write(todo)
    trainer.strategy.barrier("shards written")


def rank_loader(dataset: Dataset, batch_size: int, num_workers: int, seed: int, world: int) -> DataLoader:
    """A shuffled training loader. In several processes the dataset is already this rank's shards: a one-replica
    DistributedSampler shuffles it per epoch (Lightning calls its set_epoch) and, being a DistributedSampler,
    keeps Lightning from splitting these shards among the ranks a second time."""
    if world == 1:
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=num_workers)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=num_workers)


def fsdp_strategy(wrap: Sequence[str], **kwargs) -> FSDPStrategy:
    """Lightning's FSDPStrategy with every module of the named classes (dotted paths) as its own shard unit;
    `kwargs` go to the strategy (sharding_strategy, state_dict_type, ...)."""
    classes = set()
    for path in wrap:
        module, _, name = path.rpartition(".")
        try:
            classes.add(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"trainer.strategy.wrap names {path!r}, which is no importable class ({err}): give "
                             f"dotted paths of module classes, e.g. torch.nn.Linear") from err
    return FSDPStrategy(auto_wrap_policy=classes, **kwargs)
