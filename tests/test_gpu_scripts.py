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
