"""The Python API decodes what the evaluation entry point decodes, and names bad options."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import compose_cfg


def _cli_images(tmp_path, exports, decoding: list[str]):
    """The evaluation's cached images and their (prompt, seed, stats), in the benchmark's job order."""
    from specgen.eval import evaluate

    cfg = compose_cfg("eval", ["experiment=eval/ar_shapes", f"generator.backbone_dir={exports / 'ar'}",
                               f"generator.tokenizer_dir={exports / 'vq'}", "benchmark.geneval.prompts_per_task=1",
                               "benchmark.geneval.samples_per_prompt=1", "logger=none", *decoding], tmp_path)
    evaluate(cfg)
    from specgen.evaluation.runner import build_benchmarks, unique_jobs

    cache = next(Path(cfg.paths.data_dir, "image_cache").rglob("*.json")).parent
    jobs = unique_jobs(build_benchmarks(cfg), cfg.seed)  # the order the evaluation decoded them in, one batch
    rows = [json.loads((cache / f"{j.key}.json").read_text()) for j in jobs]
    images = {(r["prompt"], r["seed"]): np.asarray(Image.open(cache / f"{j.key}.png").convert("RGB"))
              for r, j in zip(rows, jobs)}
    return rows, images


@pytest.mark.parametrize("name", ["ar", "ssd"])
def test_api_images_and_passes_equal_the_evaluation_entry_point(name, tmp_path, tiny_exports):
    import specgen

    extra = [f"decoding={name}"] + ([f"decoding.fn.drafter.dirpath={tiny_exports / 'fphi'}"] if name == "ssd" else [])
    rows, cli = _cli_images(tmp_path, tiny_exports, extra)
    assert len(rows) == 6
    gen = specgen.load_generator(backbone_dir=str(tiny_exports / "ar"), tokenizer_dir=str(tiny_exports / "vq"))
    drafter = str(tiny_exports / "fphi") if name == "ssd" else None
    # the evaluation decodes its six jobs as one batch; with seed=0 the API draws the same per-image seeds
    prompts = [r["prompt"] for r in rows]
    out = specgen.generate(gen, prompts, strategy=name, drafter=drafter, seeds=[r["seed"] for r in rows])
    by_seed = specgen.generate(gen, prompts, strategy=name, drafter=drafter)
    assert by_seed.seeds == [r["seed"] for r in rows]
    for r, image, st in zip(rows, out.images, out.stats):
        assert np.array_equal(image, cli[(r["prompt"], r["seed"])])
        assert st["nfe"] == r["stats"]["nfe"]
    assert np.array_equal(by_seed.images, out.images)
    assert out.images.dtype == np.uint8 and out.images.shape == (6, 64, 64, 3)
    assert out.codes[0].shape == (16, 16)


def test_strategy_options_drafter_module_and_bad_input(tiny_exports):
    import specgen

    gen = specgen.load_generator(backbone_dir=str(tiny_exports / "ar"), tokenizer_dir=str(tiny_exports / "vq"))
    by_path = specgen.load_strategy("ssd_paper", generator=gen, drafter=str(tiny_exports / "fphi"), rounds=2)
    assert specgen.load_strategy("ssd_paper", drafter="fphi_gpu").config.fn.drafter.dirpath.endswith("checkpoints/fphi_gpu")
    assert by_path.config.fn.rounds == 2 and by_path.name == "ssd_paper"
    module = specgen.load_drafter(tiny_exports / "fphi")
    by_module = specgen.load_strategy("ssd_paper", generator=gen, drafter=module, rounds=2)
    a = specgen.generate(gen, ["a red circle"] * 2, by_path)
    b = specgen.generate(gen, ["a red circle"] * 2, by_module)
    assert np.array_equal(a.images, b.images) and a.seeds == b.seeds and a.seeds[0] != a.seeds[1]
    with pytest.raises(TypeError, match=r"no option \['roundz'\].*'rounds'"):
        specgen.load_strategy("ssd_paper", drafter=module, roundz=2)
    with pytest.raises(TypeError, match="takes no drafter"):
        specgen.load_strategy("ar", drafter=module)
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        specgen.generate(gen, "a red circle", "ar", seeds=[1, 2])
    with pytest.raises(ValueError, match="no prompts"):
        specgen.generate(gen, [], "ar")


def test_importing_the_package_loads_no_framework():
    code = "import sys, specgen; print(any(m.split('.')[0] in ('hydra', 'lightning') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert callable(__import__("specgen").generate)
