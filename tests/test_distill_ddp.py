"""Multi-process training: f_phi, MTP and the MAR draft distilled by two CPU processes (DDP, gloo), each rank
writing its share of the missing data shards and training on its own training shards; the FSDP route's config."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import compose_cfg
from test_entrypoints import _tiny_train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 20 s each: two processes, teacher sampling, a few steps
@pytest.mark.parametrize("exp", ["train/fphi_shapes", "train/mtp_shapes", "train/mar_draft_cpu"])
def test_two_processes_distil_a_drafter_on_their_own_shards(exp, tmp_path, tiny_exports):
    paths = [f"paths.{k}_dir={tmp_path / k}" for k in ("data", "log", "checkpoint")] + [f"hydra.run.dir={tmp_path / 'out'}"]
    run = [*_tiny_train(exp, tiny_exports), "data.train_shards=2", "trainer=ddp_cpu", "trainer.max_steps=3",
           "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "logger=none", *paths]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "specgen.train", *run], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    kind = "token" if exp.startswith("train/mar") else "teacher"
    assert f"rank 0 of 2 trains on {kind} shards [0]" in out and f"rank 1 of 2 trains on {kind} shards [1]" in out
    export = tmp_path / "checkpoint" / compose_cfg("train", [f"experiment={exp}"], tmp_path).export_name
    assert json.loads((export / "metrics.json").read_text())["global_step"] == 3  # written by rank 0 at the end
    from specgen.utils.checkpoints import load_exported

    assert isinstance(load_exported(export), torch.nn.Module)


def test_a_rank_trains_on_its_shards_and_lightning_does_not_split_them_again():
    import lightning as L
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DistributedSampler

    from specgen.modules.sharding import rank_loader, rank_shards

    assert rank_shards(range(4), 1, 2, "data.train_shards") == [1, 3]
    assert rank_shards(range(2, 6), 0, 2, "data.train_shards") == [2, 4]  # first_train_shard=2
    with pytest.raises(ValueError, match=r"data.train_shards=3 training shards do not divide among 2 processes"):
        rank_shards(range(3), 0, 2, "data.train_shards")
    loader = rank_loader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=0, seed=0, world=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)  # not launched: no processes
    kept = trainer._data_connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING)
    assert kept is loader and isinstance(kept.sampler, DistributedSampler) and len(kept) == 4  # all 8 items
    loader.sampler.set_epoch(1)
    assert sorted(int(i) for i in loader.sampler) == list(range(8))


def test_fsdp_is_configured_for_gpus_and_refused_on_cpu(tmp_path):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from lightning.pytorch.strategies import FSDPStrategy

    cfg = compose_cfg("train", ["experiment=train/fphi_real", "trainer=fsdp", "data.prompts_path=p.txt"], tmp_path)
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDPStrategy) and strategy._state_dict_type == "full"
    assert (cfg.trainer.accelerator, cfg.trainer.precision) == ("gpu", "bf16-mixed")
    with pytest.raises(InstantiationException, match="requires a GPU accelerator"):  # Lightning runs FSDP on GPUs only
        instantiate(cfg.trainer, accelerator="cpu", logger=False)
    with pytest.raises(InstantiationException, match=r"trainer.strategy.wrap names 'torch.nn.Lineer'"):
        instantiate(cfg.trainer.strategy, wrap=["torch.nn.Lineer"])
