"""The figures a run writes: the Pareto front, swept settings, captioned sample grids, and what reaches W&B."""
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import compose_cfg
from specgen.evaluation.figures import captioned_grid, pareto_front, pareto_png, sweep_png


def test_pareto_front_is_the_set_of_undominated_points():
    rng = np.random.default_rng(0)
    for _ in range(20):
        pts = [tuple(map(float, p)) for p in rng.integers(0, 6, size=(12, 2))]
        front = pareto_front(pts)
        brute = [i for i, p in enumerate(pts)
                 if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in pts)]
        assert sorted(front) == brute
        assert [pts[i][0] for i in front] == sorted(pts[i][0] for i in front)
    # AR is slow but best, ssd fast and nearly as good, sjd dominated by ssd
    assert pareto_front([(1.0, 0.87), (5.0, 0.85), (2.9, 0.77)]) == [0, 1]


def test_captioned_grid_puts_each_prompt_under_its_image():
    imgs = [np.full((64, 64, 3), c, np.uint8) for c in (0, 80, 160)]
    long = "a red circle to the left of a blue square and two green triangles below a yellow star " * 3
    grid = captioned_grid(imgs, ["a red circle", long, ""], ncols=2, scale=2, lines=3)
    side, pad = 128, 4
    assert grid.dtype == np.uint8 and grid.shape[1] == 2 * (side + pad) + pad
    assert (grid[pad:pad + side, pad:pad + side] == 0).all()  # the first image, upscaled, in its cell
    caption = grid[pad + side + 1: pad + side + 40, pad:pad + side]
    assert (caption < 128).any()  # dark text under the first image
    empty = grid[pad + side + 1: pad + side + 40, 2 * pad + side: 2 * pad + 2 * side]
    assert (empty < 128).any()  # the long caption is wrapped, not dropped
    with pytest.raises(ValueError, match="3 images but 2 captions"):
        captioned_grid(imgs, ["a", "b"])


def test_pareto_and_sweep_pngs_from_flat_metrics(tmp_path):
    m = {"ar/geneval/overall": 0.86, "ar/geneval/overall_ci95": 0.05, "ar/speed/nfe_ratio_bs1": 1.0,
         "ar/speed/wall_ratio_bs1": 1.0}
    for r, (ratio, q) in enumerate([(5.3, 0.80), (5.0, 0.83), (4.9, 0.84)]):
        m.update({f"ssd_r{r}/speed/nfe_ratio_bs1": ratio, f"ssd_r{r}/speed/nfe_ratio_ci95_bs1": 0.3,
                  f"ssd_r{r}/speed/wall_ratio_bs1": ratio / 2, f"ssd_r{r}/geneval/overall": q,
                  f"ssd_r{r}/geneval/overall_ci95": 0.03})
    names = ["ar", "ssd_r0", "ssd_r1", "ssd_r2"]
    assert pareto_png(m, names, tmp_path / "p.png", 1)
    assert Image.open(tmp_path / "p.png").size[0] > Image.open(tmp_path / "p.png").size[1]  # two panels
    assert sweep_png(m, {f"ssd_r{r}": r for r in range(3)}, "rounds", tmp_path / "s.png", [1], ref="ar")
    assert not sweep_png(m, {"ssd_r0": 0}, "rounds", tmp_path / "t.png", [1])  # one point is no sweep
    assert not pareto_png({"ar/speed/nfe_ratio_bs1": 1.0}, ["ar"], tmp_path / "q.png", 1)  # no quality: no plot


def test_the_rounds_experiment_is_recognised_as_a_sweep(tmp_path):
    from specgen.evaluation.runner import swept_settings

    cfg = compose_cfg("eval", ["experiment=ablation/ssd_rounds"], tmp_path)
    assert swept_settings(cfg) == {"rounds": {f"ssd_r{r}": float(r) for r in range(5)}}
    assert swept_settings(compose_cfg("eval", ["experiment=eval/discrete_speed"], tmp_path)) == {}


def test_speed_ratio_interval_grows_with_the_spread_of_passes():
    from specgen.evaluation import speed

    class Fake:
        device = __import__("torch").device("cpu")

        def prompts(self, texts):
            return texts

    def decoder(passes):
        it = iter(passes * 10)
        return lambda backbone, x, rngs=None: (None, {"nfe": next(it)})

    ref = lambda backbone, x, rngs=None: (None, {"nfe": 256})  # noqa: E731
    out = speed.compare(Fake(), {"ar": ref, "steady": decoder([50, 50]), "spread": decoder([30, 70])},
                        ["a", "b", "c", "d"], [1])
    assert out["ar/speed/nfe_ci95_bs1"] == 0.0 and out["steady/speed/nfe_ratio_ci95_bs1"] == 0.0
    assert out["spread/speed/nfe_ratio_bs1"] == pytest.approx(256 / 50)
    # 4 timed images: 30, 70, 30, 70 (the warm-up drew the first value)
    sd = np.std([70, 30, 70, 30], ddof=1)
    assert out["spread/speed/nfe_ci95_bs1"] == pytest.approx(1.96 * sd / 2)
    assert out["spread/speed/nfe_ratio_ci95_bs1"] == pytest.approx(256 / 50 * 1.96 * sd / 2 / 50)


def test_a_rounds_run_writes_its_figures_and_logs_them_to_wandb(tmp_path, tiny_exports):
    """experiment=ablation/ssd_rounds with GenEval on tiny models: the sweep plot, the acceptance maps side by side,
    captioned samples and the Pareto plot are written, and reach the offline W&B run with the summary table."""
    from specgen.eval import evaluate as run_eval

    fphi = [f"strategies.ssd_{s}.fn.drafter.dirpath={tiny_exports / 'fphi'}" for s in ("r0", "r1", "r2")]
    drop = [f"~strategies.ssd_{s}" for s in ("r3", "r4", "paper", "pointwise", "redraft")]
    cfg = compose_cfg("eval", ["experiment=ablation/ssd_rounds", "benchmark=geneval_shapes", *drop,
                               f"generator.backbone_dir={tiny_exports / 'ar'}", f"generator.tokenizer_dir={tiny_exports / 'vq'}",
                               "benchmark.geneval.prompts_per_task=1", "benchmark.geneval.samples_per_prompt=1",
                               "speed.num_prompts=2", "speed.batch_sizes=[1]", "logger=wandb", *fphi], tmp_path)
    m = run_eval(cfg)
    out = Path(cfg.paths.output_dir)
    for png in ("sweep_rounds.png", "accept_maps.png", "speed_quality.png", "samples_ssd_r1.png", "samples_ar.png"):
        assert (out / png).stat().st_size > 0, png
    assert "ssd_r1/speed/nfe_ratio_ci95_bs1" in m
    assert (out / "summary.txt").read_text().splitlines()[0].startswith("strategy")
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    images = {p.name.split("_")[0] for p in runs[0].rglob("media/images/**/*.png")}
    assert len(list(runs[0].rglob("media/images/**/*.png"))) >= 5, images
    tables = [json.loads(p.read_text()) for p in runs[0].rglob("media/table/**/*.json")]
    summary = [t for t in tables if t["columns"][0] == "strategy"]
    assert summary and [row[0] for row in summary[0]["data"]] == list(cfg.strategies)
