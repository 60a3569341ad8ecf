"""The one-GPU drafter script's chain, run on the CPU for a few steps per stage (SMOKE=1)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about a minute: a speed run, teacher samples and three short trainings
def test_drafter_script_smoke_writes_speed_teacher_shards_and_three_drafters(tmp_path):
    logs = tmp_path / "logs"
    env = dict(os.environ, SMOKE="1", PY=sys.executable, LOGS=str(logs))
    run = subprocess.run(["bash", "experiments/gpu_retrain/drafter.sh"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    status = (logs / "status.txt").read_text()
    for stage in ("speed", "teacher", "fphi_gpu", "fphi_gpu_r2", "fphi_gpu_tv"):
        assert f"{stage} rc=0 " in status, status
    assert "teacher shards written: 2 of 2" in status
    speed = json.loads((logs / "speed" / "metrics.json").read_text())
    assert speed["ssd/speed/nfe_bs1"] < speed["ar/speed/nfe_bs1"] == 256
    for name in ("fphi_gpu", "fphi_gpu_r2", "fphi_gpu_tv"):
        export = logs / "checkpoints" / name
        assert (export / "model.safetensors").is_file()
        metrics = json.loads((export / "metrics.json").read_text())
        assert metrics["global_step"] == 3 and 0.0 < metrics["val/accept_down"] <= 1.0
        assert "init_from=" in (export / "command.txt").read_text()
    assert "module.guided_loss=tv" in (logs / "checkpoints" / "fphi_gpu_tv" / "command.txt").read_text()


def test_engine_script_smoke_measures_every_strategy_on_both_backbones(tmp_path):
    """experiments/gpu_engine (SMOKE=1: tiny sizes on the CPU): AR, ssd, SJD and ZipAR at batch 1 and 2 on both
    backbones, each with its passes (AR's: one per image token), wall and pass ratios against AR, the share of the
    wall clock outside the target forwards, and on the embedded backbone the aten ops per pass; nothing skipped."""
    logs = tmp_path / "engine"
    env = dict(os.environ, SMOKE="1", PY=sys.executable, LOGS=str(logs))
    run = subprocess.run(["bash", "experiments/gpu_engine/run.sh"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    m = json.loads((logs / "metrics.json").read_text())
    assert m["smoke"] and m["skipped"] == [] and m["batch_sizes"] == [1, 2]
    assert m["backbones"]["embedded"]["grid"] == [4, 4] and m["backbones"]["paper_shape"]["dtype"] == "float32"
    for name, world in m["backbones"].items():
        assert world["params"] > 0 and world["drafter_params"] > 0
        for bs in ("bs1", "bs2"):
            rows = world[bs]
            assert list(rows) == ["ar", "ssd", "sjd", "zipar"]
            assert rows["ar"]["passes"] == 16 and rows["ar"]["wall_ratio"] == rows["ar"]["pass_ratio"] == 1.0
            for r in rows.values():
                assert r["images"] == int(bs[2:]) and r["latency_s"] > 0 and 0 < r["overhead_share"] < 1
                assert r["pass_ratio"] == pytest.approx(16 / r["passes"]) and r["forwards"] >= 2
            assert 1 <= rows["ssd"]["passes"] < 16
            counted = name == "embedded"  # the paper shape's ops are not counted by default (--ops)
            assert ("ops_per_pass" in rows["ssd"]) == counted
            if counted:
                assert rows["ar"]["ops_ratio"] == 1.0 and rows["ssd"]["ops_per_drafted_token"] > 0
                assert rows["ssd"]["ops_ratio"] == pytest.approx(rows["ssd"]["ops_per_pass"] / rows["ar"]["ops_per_pass"])
    summary = (logs / "summary.txt").read_text()
    assert "paper_shape bs2" in summary and "overhead" in summary and "gpu_engine rc=0" in (logs / "run.log").read_text()
