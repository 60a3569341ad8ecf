"""Sharded evaluation: two CPU processes (DDP, gloo) fill the image cache and rank 0 scores the same metrics as
one process; each rank decodes a disjoint, deterministic slice; an interrupted sharded run resumes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("ar/speed/latency_s", "ar/speed/throughput_img_s")


def _overrides(exports: Path) -> list[str]:
    return ["experiment=eval/ar_shapes", f"generator.backbone_dir={exports / 'ar'}", f"generator.tokenizer_dir={exports / 'vq'}",
            "benchmark.geneval.prompts_per_task=1", "benchmark.geneval.samples_per_prompt=2", "batch_size=3",
            "logger=csv", "num_threads=1"]


def _sharded(tmp: Path, exports: Path, trainer: tuple = ("trainer=ddp_cpu",)) -> subprocess.CompletedProcess:
    """`python -m specgen.eval ... trainer=ddp_cpu`: Lightning starts the second process itself (as on a GPU node)."""
    paths = [f"paths.{k}_dir={tmp / k}" for k in ("data", "log", "checkpoint")] + [f"hydra.run.dir={tmp / 'out'}"]
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "specgen.eval", *_overrides(exports), *trainer, *paths],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow  # about 45 s: two DDP runs of two processes each
def test_two_processes_merge_into_the_one_process_metrics_and_resume(tmp_path, tiny_exports):
    from specgen.eval import evaluate as run_eval

    one = run_eval(compose_cfg("eval", _overrides(tiny_exports), tmp_path / "one"))
    _sharded(tmp_path / "ddp", tiny_exports)
    merged = json.loads((tmp_path / "ddp" / "out" / "metrics.json").read_text())
    assert set(one) - set(merged) == set(TIMING)  # several processes on one machine time nothing honestly
    assert merged == pytest.approx({k: v for k, v in one.items() if k not in TIMING})
    assert merged["ar/num_images"] == 12 and merged["ar/speed/nfe"] == 256

    (cache_one,), (cache_ddp,) = (list((tmp_path / d / "data" / "image_cache").glob("*/*")) for d in ("one", "ddp"))
    assert cache_one.name == cache_ddp.name  # the same cache key: a one-process run would reuse these images
    notes = {p.stem: json.loads(p.read_text()) for p in cache_ddp.glob("*.json")}
    assert len(notes) == 12 and {n["world_size"] for n in notes.values()} == {2}
    for p in cache_one.glob("*.png"):  # the same pixels, though batched differently
        assert np.array_equal(np.asarray(Image.open(p)), np.asarray(Image.open(cache_ddp / p.name)))
    cfg = compose_cfg("eval", _overrides(tiny_exports), tmp_path / "keys")
    from specgen.evaluation.runner import build_benchmarks, unique_jobs

    order = [j.key for j in unique_jobs(build_benchmarks(cfg), cfg.seed)]
    assert [notes[k]["rank"] for k in order] == [i % 2 for i in range(12)]  # rank r: jobs r, r + 2, ...

    gone = sorted(cache_ddp.glob("*.png"))[:4]  # an interrupted run: four images never written
    stamps = {p: p.stat().st_mtime_ns for p in cache_ddp.glob("*.png")}
    for p in gone:
        p.unlink()
    _sharded(tmp_path / "ddp", tiny_exports)
    redone = sorted(p for p in cache_ddp.glob("*.png") if p.stat().st_mtime_ns != stamps.get(p))
    assert redone == gone
    assert json.loads((tmp_path / "ddp" / "out" / "metrics.json").read_text()) == pytest.approx(merged)


@pytest.mark.slow  # about 30 s
def test_ddp_spawn_processes_merge_into_the_same_metrics(tmp_path, tiny_exports):
    """ddp_spawn (local multiruns): the spawned processes have no Hydra runtime; the config reaches them resolved."""
    from specgen.eval import evaluate as run_eval

    one = run_eval(compose_cfg("eval", _overrides(tiny_exports), tmp_path / "one"))
    _sharded(tmp_path / "spawn", tiny_exports, ("trainer=ddp_spawn", "trainer.accelerator=cpu", "trainer.precision=32-true"))
    merged = json.loads((tmp_path / "spawn" / "out" / "metrics.json").read_text())
    assert merged == pytest.approx({k: v for k, v in one.items() if k not in TIMING})
