"""experiment=eval/real_continuous on tiny random MAR and xAR releases (the command shape of a GPU run with real weights),
the class-conditional FID against reference statistics, and the GPU check script's CPU mode."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import compose_cfg
from specgen.evaluation.fidelity import fidelity_to_statistics, reference_statistics
from specgen.evaluation.runner import run
from test_mar_release import kl16_state_dict, mar_state_dict, save_release
from test_xar import xar_state_dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "real_backbones"))
import continuous_check  # noqa: E402


def test_real_continuous_runs_on_tiny_releases_with_the_flat_metric_keys(tmp_path):
    save_release(tmp_path / "target.pth", mar_state_dict(seed=0))
    save_release(tmp_path / "draft.pth", mar_state_dict(D=16, enc=1, dec=1, hw=8, hd=1, seed=1))
    torch.save({"model": kl16_state_dict(mults=(1, 2, 2), z=3)}, tmp_path / "kl16.ckpt")
    shape = ["grid_size=4", "token_dim=3", "buffer_size=8", "num_classes=10", "sample_steps=5"]
    cfg = compose_cfg("eval", [
        "experiment=eval/real_continuous", f"generator.weights_path={tmp_path / 'target.pth'}",
        f"generator.vae_path={tmp_path / 'kl16.ckpt'}", "generator.sizes=[32,2,1,4,16,2]",
        "generator.vae={image_size:16,ch:32,mults:[1,2,2],num_res_blocks:1,z_dim:3}",
        *[f"generator.{s}" for s in shape], f"mar_pair.draft_path={tmp_path / 'draft.pth'}",
        "mar_pair.draft.sizes=[16,1,1,4,8,1]", "sampler.num_iter=4", "benchmark=none", "logger=none",
        "speed.batch_sizes=[2]", "speed.num_prompts=2", "speed.prompts=[3,7]"], tmp_path)
    metrics = run(cfg)
    for name in ("target", "cspd", "cspd_lossless"):
        assert metrics[f"{name}/speed/nfe"] > 0 and f"{name}/speed/wall_ratio_bs2" in metrics, name
    assert 0 <= metrics["cspd/accept_rate"] <= 1 and metrics["cspd/speed/target_sets"] < 4
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["cspd/speed/nfe"] == pytest.approx(metrics["cspd/speed/nfe"])


def test_real_continuous_runs_on_tiny_xar_releases(tmp_path):
    torch.save(xar_state_dict(seed=0), tmp_path / "xAR-L.pth")
    torch.save(xar_state_dict(D=16, enc=1, dec=1, seed=1), tmp_path / "xAR-B.pth")
    torch.save({"model": kl16_state_dict(mults=(1, 2, 2), z=3)}, tmp_path / "kl16.ckpt")
    shape = ["grid_size=4", "unit_size=2", "token_dim=3", "num_classes=10", "sample_steps=4"]
    cfg = compose_cfg("eval", [
        "experiment=eval/real_continuous", "generator=xar",  # the pair follows the generator: xAR-B/L
        f"generator.weights_path={tmp_path / 'xAR-L.pth'}", f"generator.vae_path={tmp_path / 'kl16.ckpt'}",
        "generator.sizes=[32,2,1,4]", "generator.vae={image_size:16,ch:32,mults:[1,2,2],num_res_blocks:1,z_dim:3}",
        *[f"generator.{s}" for s in shape], f"mar_pair.draft_path={tmp_path / 'xAR-B.pth'}",
        "mar_pair.draft.sizes=[16,1,1,4]", "benchmark=none", "logger=none", "speed.batch_sizes=[2]",
        "speed.num_prompts=2", "speed.prompts=[3,7]"], tmp_path)
    assert cfg.strategies.cspd.fn.verify == "stepwise" and cfg.strategies.target.fn.cfg_schedule == "linear_steps"
    assert cfg.mar_pair.draft._target_ == "specgen.backbones.xar.load_xar" and cfg.mar_pair.draft_size == "base"
    metrics = run(cfg)
    for name in ("target", "cspd", "cspd_lossless"):
        assert metrics[f"{name}/speed/nfe"] > 0 and f"{name}/speed/wall_ratio_bs2" in metrics, name
    assert metrics["target/speed/nfe"] == 4 and 0 <= metrics["cspd/accept_rate"] <= 1


def test_class_fidelity_against_reference_statistics(tmp_path):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(12)]
    net = str(ROOT / "checkpoints" / "featnet_shapes")
    reference_statistics(images, tmp_path / "ref.npz", extractor_dir=net)
    same = fidelity_to_statistics(images, tmp_path / "ref.npz", extractor_dir=net)
    other = fidelity_to_statistics([np.full_like(im, 200) for im in images], tmp_path / "ref.npz", extractor_dir=net)
    assert abs(same["fid"]) < 1e-3 and other["fid"] > 1.0 and same["num_images"] == 12 and same["is_mean"] > 0
    with pytest.raises(FileNotFoundError, match="benchmark.fidelity.reference_stats"):
        fidelity_to_statistics(images, tmp_path / "none.npz", extractor_dir=net)


def test_gpu_check_runs_in_its_tiny_cpu_mode(tmp_path):
    out = continuous_check.main(["--tiny", "--batches", "1", "2", "--num-iter", "4", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "continuous_check.json").read_text())
    assert saved["tiny"] and set(saved["batches"]) == {"1", "2"} and out["head_steps"] == 10
    row = out["batches"][2]
    assert row["target"]["transformer_s"] > 0 and row["accept_0.9"]["paper_speedup"] > 0
    # more acceptance, more steps committed per round, a larger lossless projection
    assert row["accept_0.9"]["lossless_steps_per_round"] > row["accept_0.3"]["lossless_steps_per_round"]
    assert row["accept_0.9"]["lossless_speedup"] > row["accept_0.3"]["lossless_speedup"]
    xar = continuous_check.main(["--tiny", "--family", "xar", "--batches", "2", "--out", str(tmp_path / "xar")])
    assert xar["family"] == "xar" and xar["num_iter"] == 4 and xar["head_steps"] == 10
    assert xar["batches"][2]["target"]["tokens_per_step"] == 1 and xar["batches"][2]["target"]["head_s"] > 0


def test_real_continuous_runs_on_tiny_harmon_releases(tmp_path):
    from test_harmon import MAR_SIZES, tiny_folder

    target, draft = tiny_folder(tmp_path / "t"), tiny_folder(tmp_path / "d", hidden=16, seed=1,
                                                                    weights_name="harmon_0.5b.pth")
    cfg = compose_cfg("eval", [
        "experiment=eval/real_continuous", "generator=harmon",  # the pair follows the generator: Harmon 0.5B/1.5B
        f"generator.folder={target}", f"generator.vae_path={target / 'kl16.ckpt'}",
        f"generator.mar_sizes=[{','.join(map(str, MAR_SIZES))}]", "generator.grid_size=4", "generator.token_dim=3",
        "generator.buffer_size=8", "generator.num_classes=10", "generator.sample_steps=5",
        "generator.vae={image_size:16,ch:32,mults:[1,2,2],num_res_blocks:1,z_dim:3}",
        f"mar_pair.draft_folder={draft}", f"mar_pair.draft.mar_sizes=[{','.join(map(str, MAR_SIZES))}]",
        "mar_pair.num_iter=4", "benchmark=none", "logger=none", "speed.batch_sizes=[2]", "speed.num_prompts=2"],
        tmp_path)
    assert cfg.mar_pair.draft.size == "0.5b" and cfg.speed.prompts[0] == "a photo of a red apple on a wooden table"
    metrics = run(cfg)
    for name in ("target", "cspd", "cspd_lossless"):
        assert metrics[f"{name}/speed/nfe"] > 0 and f"{name}/speed/wall_ratio_bs2" in metrics, name
    assert metrics["target/speed/nfe"] == 4 and 0 <= metrics["cspd/accept_rate"] <= 1
