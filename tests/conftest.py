"""Test setup: offline, CPU, tiny models; nothing is written into the repository."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("SPECGEN_WANDB_OFFLINE", "true")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def one_thread():
    """Run the test on one intra-op thread (restored after): stored reference outputs were written so, and float
    reductions split over other thread counts round differently along 100-step denoising chains."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_exports(tmp_path_factory):
    """A tiny random VQ tokenizer and backbone exported like the shipped ones."""
    from specgen.utils.checkpoints import build as instantiate, export

    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    vq_cfg = {"_target_": "specgen.tokenizers.vq.VQAutoencoder", "image_size": 64, "ch": 16, "mults": [2, 2],
              "z_dim": 8, "num_codes": 64}
    ar_cfg = {"_target_": "specgen.backbones.shapes_llama.ShapesLlama", "num_codes": 64, "grid_size": 16,
              "preset": "tiny"}
    fphi_cfg = {"_target_": "specgen.drafters.fphi.FPhi", "hidden_size": 64, "preset": "xs"}
    export(root / "vq", instantiate(vq_cfg), vq_cfg)
    export(root / "ar", instantiate(ar_cfg), ar_cfg)
    export(root / "fphi", instantiate(fphi_cfg), fphi_cfg)
    mtp_cfg = {"_target_": "specgen.drafters.mtp.MTPHeads", "hidden_size": 64, "num_heads": 2}
    export(root / "mtp", instantiate(mtp_cfg), mtp_cfg)
    kl_cfg = {"_target_": "specgen.tokenizers.kl.KLAutoencoder", "image_size": 64, "ch": 16, "mults": [2, 2],
              "z_dim": 8}
    export(root / "kl", instantiate(kl_cfg), kl_cfg)
    mar_cfg = {"_target_": "specgen.backbones.mar.ShapesMAR", "grid_size": 16, "token_dim": 8, "preset": "tiny",
               "sample_steps": 5}
    export(root / "mar", instantiate(mar_cfg), mar_cfg)
    mar_p2_cfg = {**mar_cfg, "patch_size": 2}
    export(root / "mar_p2", instantiate(mar_p2_cfg), mar_p2_cfg)
    return root


@pytest.fixture(scope="module")
def teacher(tiny_exports, tmp_path_factory):
    """A distillation data module with one tiny train and one val shard of teacher samples."""
    from specgen.modules.distill_data import DistillDataModule

    dm = DistillDataModule(str(tiny_exports / "ar"), str(tiny_exports / "vq"), str(tmp_path_factory.mktemp("distill")),
                           train_shards=1, val_shards=1, shard_size=4, sample_batch=4, cfg_scale=2.0, batch_size=2)
    dm.prepare_data()
    dm.setup()
    return dm
