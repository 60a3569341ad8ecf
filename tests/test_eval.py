"""The eval entry point: metrics.json keys, image cache reuse and resume, GenEval rules."""
import json

import numpy as np
from pathlib import Path

import pytest

from helpers import compose_cfg, tiny_drafter_overrides
from specgen.evaluation.geneval import Object, evaluate, read_metadata, summarize

TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def _eval_cfg(tmp_path, exports, extra=()):
    return compose_cfg("eval", ["experiment=eval/ar_shapes", f"generator.backbone_dir={exports / 'ar'}",
                                f"generator.tokenizer_dir={exports / 'vq'}", "benchmark.geneval.prompts_per_task=1",
                                "benchmark.geneval.samples_per_prompt=1", "logger=csv", *extra], tmp_path)


def test_eval_writes_flat_metrics_and_reuses_cached_images(tmp_path, tiny_exports):
    from specgen.eval import evaluate as run_eval

    cfg = _eval_cfg(tmp_path, tiny_exports)
    metrics = run_eval(cfg)
    out = Path(cfg.paths.output_dir)
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == pytest.approx(metrics)
    for task in TASKS + ("overall", "overall_ci95"):
        assert 0.0 <= on_disk[f"ar/geneval/{task}"] <= 1.0
    assert on_disk["ar/speed/nfe"] == 256  # 16x16 grid: one pass per visual token
    assert (out / "grid.png").is_file() and (out / "results.csv").is_file()
    assert (out / "geneval_samples" / "00000" / "samples" / "0000.png").is_file()
    from specgen.analysis.geneval_report import read_results, report

    table = {r["task"]: r for r in report(read_results(out), [None], resamples=50)}
    assert {r["sample"] for r in read_results(out / "results.csv")} == {0}  # one sample per prompt
    for task in TASKS + ("overall",):
        assert table[task]["score"] == pytest.approx(on_disk[f"ar/geneval/{task}"])
    assert table["overall"]["binomial_ci95"] == pytest.approx(on_disk["ar/geneval/overall_ci95"])

    pngs = sorted(Path(cfg.paths.data_dir, "image_cache").rglob("*.png"))
    assert len(pngs) == 6
    stamps = {p: p.stat().st_mtime_ns for p in pngs}
    for p in pngs[:3]:  # an interrupted run: three images never written
        p.unlink()
    again = run_eval(_eval_cfg(tmp_path, tiny_exports))
    quality = {k: v for k, v in metrics.items() if "/geneval/" in k}
    assert {k: again[k] for k in quality} == quality  # same images (per-image seeds), same scores
    regenerated = [p for p in pngs if p.stat().st_mtime_ns != stamps.get(p)]
    assert sorted(regenerated) == sorted(pngs[:3])


def _obj(cls, box, color=None, score=1.0):
    return Object(cls, box, score, color)


def test_geneval_rules_in_both_directions():
    two = {"tag": "counting", "include": [{"class": "circle", "count": 2}], "exclude": [{"class": "circle", "count": 3}]}
    c = [_obj("circle", (0, 0, 10, 10)), _obj("circle", (20, 0, 30, 10))]
    assert evaluate(c, two)[0]
    assert not evaluate(c + [_obj("circle", (40, 0, 50, 10))], two)[0]  # exactly N
    assert evaluate(c + [_obj("circle", (40, 0, 50, 10), score=0.8)], two)[0]  # below the 0.9 counting threshold
    colour = {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}]}
    assert evaluate([_obj("square", (0, 0, 9, 9), "red")], colour)[0]
    assert not evaluate([_obj("square", (0, 0, 9, 9), "blue")], colour)[0]
    assert not evaluate([_obj("square", (0, 0, 9, 9), "red", score=0.2)], colour)[0]  # below 0.3
    pos = {"tag": "position", "include": [{"class": "square", "count": 1},
                                          {"class": "circle", "count": 1, "position": ["left of", 0]}]}
    assert evaluate([_obj("square", (40, 0, 50, 10)), _obj("circle", (0, 0, 10, 10))], pos)[0]
    assert not evaluate([_obj("square", (0, 0, 10, 10)), _obj("circle", (40, 0, 50, 10))], pos)[0]
    assert not evaluate([_obj("circle", (0, 0, 10, 10))], pos)[0]  # no target
    s = summarize([{"tag": "colors", "correct": True}, {"tag": "colors", "correct": False},
                   {"tag": "counting", "correct": True}])
    assert (s["colors"], s["counting"], s["overall"]) == (0.5, 1.0, 0.75)
    assert s["overall_ci95"] == pytest.approx(1.96 * (0.25 / 2) ** 0.5 / 2)


def test_official_metadata_parses_and_bad_files_name_the_line(tmp_path):
    official = Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "geneval" / "evaluation_metadata.jsonl"
    if official.is_file():
        items = read_metadata(official)
        assert len(items) == 553 and {m["tag"] for m in items} == set(TASKS)
    bad = tmp_path / "meta.jsonl"
    bad.write_text('{"tag": "colors", "include": [], "prompt": "x"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"meta.jsonl:2: not valid JSON"):
        read_metadata(bad)
    with pytest.raises(FileNotFoundError, match="evaluation_metadata.jsonl"):
        read_metadata(tmp_path / "missing.jsonl")


def test_an_empty_metadata_file_or_no_prompts_is_refused_before_generating(tmp_path, tiny_exports):
    """An empty metadata file used to generate nothing and then crash in speed_metrics (IndexError)."""
    from specgen.eval import evaluate as run_eval

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty.jsonl' holds no prompts \(it is empty\)"):
        read_metadata(empty)
    with pytest.raises(ValueError, match=r"empty.jsonl' holds no prompts"):
        run_eval(_eval_cfg(tmp_path / "a", tiny_exports, [f"+benchmark.geneval.metadata_file={empty}"]))
    with pytest.raises(ValueError, match=r"the benchmarks \['geneval'\] ask for no images"):
        run_eval(_eval_cfg(tmp_path / "b", tiny_exports, ["benchmark.geneval.prompts_per_task=0"]))


def test_other_strategies_run_through_the_same_entry_point(tmp_path, tiny_exports):
    from specgen.eval import evaluate as run_eval

    cfg = _eval_cfg(tmp_path, tiny_exports, ["decoding=zipar", "benchmark.geneval.prompts_per_task=1"])
    metrics = run_eval(cfg)
    assert "zipar/geneval/overall" in metrics
    assert metrics["zipar/speed/nfe"] < 256  # rows in parallel: fewer target passes than tokens


def test_ssd_through_the_entry_point_writes_an_acceptance_map(tmp_path, tiny_exports):
    from specgen.eval import evaluate as run_eval

    cfg = _eval_cfg(tmp_path, tiny_exports, ["decoding=ssd_paper", f"decoding.fn.drafter.dirpath={tiny_exports / 'fphi'}"])
    metrics = run_eval(cfg)
    assert metrics["ssd_paper/speed/nfe"] <= 16 * 3 + 1  # rows x (rounds + 1) + prefill
    assert 0 <= metrics["ssd_paper/speed/accept_rate"] <= 1
    assert (Path(cfg.paths.output_dir) / "accept_map_ssd_paper.png").is_file()
    cfg = _eval_cfg(tmp_path / "carry", tiny_exports, ["decoding=ssd", f"decoding.fn.drafter.dirpath={tiny_exports / 'fphi'}"])
    metrics = run_eval(cfg)  # the default: carry, images on their own rows; a batch pass counts once
    assert 1 < metrics["ssd/speed/image_passes"] <= metrics["ssd/speed/nfe"] <= 256
    assert (Path(cfg.paths.output_dir) / "accept_map_ssd.png").is_file()


def test_continuous_backbone_and_cspd_through_the_entry_point(tmp_path, tiny_exports):
    from specgen.eval import evaluate as run_eval

    base = [f"generator.backbone_dir={tiny_exports / 'mar'}", f"generator.tokenizer_dir={tiny_exports / 'kl'}",
            "decoding.fn.num_iter=4"]
    m = run_eval(_eval_cfg(tmp_path, tiny_exports, ["decoding=mar", *base]))
    assert "mar/geneval/overall" in m and m["mar/speed/nfe"] == 4  # a strategy is named as its config
    c = run_eval(_eval_cfg(tmp_path / "c", tiny_exports, ["decoding=cspd", *base, "decoding.fn.gamma=2",
                                                          f"decoding.fn.draft.dirpath={tiny_exports / 'mar'}"]))
    assert c["cspd/speed/accept_rate"] == 1.0  # draft = target: everything accepted


def test_unknown_strategy_lists_the_known_ones(tmp_path):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=r"(?s)decoding/warp.*ssd"):
        compose_cfg("eval", ["decoding=warp"], tmp_path)


def test_every_decoding_config_names_a_strategy_of_the_decoding_package(tmp_path):
    """configs/decoding/ is the list of strategies: each names a `generate` of specgen.decoding and options it takes."""
    import importlib
    import inspect

    from omegaconf import OmegaConf

    from specgen.utils.hydra import CONFIG_DIR

    names = sorted(p.stem for p in Path(CONFIG_DIR, "decoding").glob("*.yaml"))
    assert {"ar", "ssd", "sjd", "zipar", "mtp1d", "specdec", "mar", "cspd"} <= set(names)
    for name in names:
        fn = OmegaConf.to_container(compose_cfg("eval", [f"decoding={name}"], tmp_path).decoding.fn, resolve=True)
        module, _, attr = fn.pop("_target_").rpartition(".")
        assert module.startswith("specgen.decoding.") and attr == "generate", name
        params = inspect.signature(getattr(importlib.import_module(module), attr)).parameters
        unknown = {k for k in fn if not k.startswith("_")} - set(params)
        assert not unknown, f"decoding={name} sets options its generate does not take: {unknown}"


def test_collect_turns_a_sweep_folder_into_one_table(tmp_path):
    from specgen.evaluation.collect import collect, format_rows

    for job, scale, score in (("0", "1.0", 0.5), ("1", "3.0", 0.75)):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- decoding.fn.cfg_scale={scale}\n- seed=0\n")
        (tmp_path / job / "metrics.json").write_text(json.dumps({"ar/geneval/overall": score, "ar/speed/nfe": 256}))
    rows = collect(tmp_path, "geneval")
    assert [(r["decoding.fn.cfg_scale"], r["geneval/overall"]) for r in rows] == [("1.0", 0.5), ("3.0", 0.75)]
    table = format_rows(rows)
    assert "seed" not in table and "speed/nfe" not in table and "0.7500" in table
    with pytest.raises(FileNotFoundError, match="no metrics.json"):
        collect(tmp_path / "empty")
    from specgen.evaluation.collect import pareto_plot

    assert pareto_plot(collect(tmp_path), "speed/nfe", "geneval/overall", tmp_path / "p.png") is False  # ints only
    rows = [dict(r, **{"speed/wall_ratio": float(i + 1)}) for i, r in enumerate(collect(tmp_path))]
    assert pareto_plot(rows, "speed/wall_ratio", "geneval/overall", tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_official_layout_round_trip(tmp_path):
    import random

    from specgen.evaluation.geneval import read_official_layout, score_folder, write_official_layout
    from specgen.world import prompts, render, scene_for

    rng = random.Random(0)
    items = []
    for tag in TASKS:
        meta = prompts(tag, "test")[0]
        items.append((meta, [render(scene_for(meta, rng)) for _ in range(2)]))
    write_official_layout(tmp_path, items)
    assert (tmp_path / "00000" / "samples" / "0001.png").is_file()
    assert json.loads((tmp_path / "00003" / "metadata.jsonl").read_text()) == items[3][0]
    back = read_official_layout(tmp_path)
    assert [m for m, _ in back] == [m for m, _ in items]
    assert all(np.array_equal(a, b) for (_, x), (_, y) in zip(items, back) for a, b in zip(x, y))
    assert score_folder(tmp_path)["overall"] == 1.0  # rendered scenes satisfy their prompts


def test_clipscore_definitions():
    import torch

    from specgen.evaluation.clipscore import clip_score

    s = clip_score(torch.tensor([0.5, -0.2, 0.1]))
    assert s["clipscore_100cos"] == pytest.approx(100 * 0.4 / 3)
    assert s["clipscore_hessel"] == pytest.approx(2.5 * 0.6 / 3)  # negatives clamp to 0 per sample


def test_speed_comparison_reports_ratios_against_the_first_strategy():
    import functools

    import torch

    from specgen.backbones.shapes_llama import ShapesLlama
    from specgen.decoding import ar, zipar
    from specgen.evaluation.speed import compare

    torch.manual_seed(0)
    m = ShapesLlama(num_codes=16, grid_size=4, preset="tiny").eval()
    out = compare(m, {"ar": functools.partial(ar.generate, cfg_scale=2.0),
                      "zipar": functools.partial(zipar.generate, cfg_scale=2.0, window=1)},
                  ["a red circle", "two squares"], batch_sizes=[1, 2])
    assert out["ar/speed/wall_ratio_bs1"] == 1.0 and out["ar/speed/nfe_bs2"] == 16
    assert out["zipar/speed/nfe_ratio_bs2"] == pytest.approx(16 / out["zipar/speed/nfe_bs2"]) and out["zipar/speed/nfe_bs2"] < 16
    assert out["zipar/speed/images_bs1"] == 2 and out["ar/speed/peak_mem_mb_bs1"] > 0


def test_summary_table_keeps_its_columns_for_long_strategy_names():
    from specgen.evaluation.runner import summary_table

    m = {f"{n}/speed/{k}": 1.0 for n in ("cspd_t10_noalign_long", "ar") for k in ("nfe", "nfe_ratio", "wall_ratio_bs1")}
    m.update({"ar/geneval/overall_diff": 0.01, "ar/geneval/overall_diff_ci95": 0.02})
    lines = summary_table(m, ["cspd_t10_noalign_long", "ar"], [1]).splitlines()
    assert len({len(line) for line in lines}) == 1  # every row as wide as the header
    assert lines[2].startswith("ar ") and "  GenEval - cspd_t10_noalign_long" in lines[0]  # headings keep a gap


def test_summary_table_prints_dpg_with_its_interval():
    from specgen.evaluation.runner import summary_rows

    m = {"ar/dpg/overall": 81.07, "ar/dpg/overall_ci95": 5.24, "ssd/dpg/overall": 70.9}
    heads, rows = summary_rows(m, ["ar", "ssd"], [1])
    col = heads.index("DPG")
    assert rows[0][col] == "81.1 +-5.2" and rows[1][col] == "70.9"  # a run without the interval prints the value


def test_speed_averages_per_image_statistics_over_images():
    """Per-image statistics (1-D, one value per prompt, as SSD's accept_rate and image_passes) are averaged over
    all images of all batches; per-batch scalars over batches."""
    import torch

    from specgen.evaluation.speed import measure

    class Fake:
        device = torch.device("cpu")

        def prompts(self, prompts):
            return torch.arange(len(prompts))

    def decode(backbone, ids, rngs=None):  # image i of every batch: 10 x its id + 1 passes
        return None, {"nfe": 7, "image_passes": ids.float() * 10 + 1, "tokens_per_pass": float(len(ids))}

    res = measure(Fake(), decode, ["a", "b", "c"], batch_size=2)  # batches [a, b], [c]: ids (0, 1), (0,)
    assert res["image_passes"] == pytest.approx((1 + 11 + 1) / 3)
    assert res["tokens_per_pass"] == pytest.approx((2 + 1) / 2) and res["nfe"] == 7


def test_speed_interleaves_fixed_batch_strategies_batch_by_batch(caplog):
    """A machine whose speed changes during the run must not favour one strategy: every batch is decoded by each
    fixed-batch strategy in turn (same seeds), after one warm-up each; a streaming strategy runs after them in one
    call. Per-strategy results are kept apart and the reference comes first; progress is logged per batch."""
    import logging

    import torch

    from specgen.evaluation.speed import compare

    class Fake:
        device = torch.device("cpu")

        def prompts(self, prompts):
            return torch.arange(len(prompts))

    calls = []

    def strategy(name, nfe):
        def decode(backbone, ids, rngs=None, slots=None):
            calls.append((name, len(ids), rngs[0].initial_seed(), slots))
            return None, {"nfe": nfe, "image_passes": torch.full((len(ids),), float(nfe))}
        return decode

    with caplog.at_level(logging.INFO, logger="specgen.evaluation.speed"):
        out = compare(Fake(), {"ar": strategy("ar", 16), "ssd": strategy("ssd", 4),
                               "stream": strategy("stream", 4)}, ["a", "b", "c"], batch_sizes=[1, 2],
                      streams=("stream",))
    progress = [r.getMessage() for r in caplog.records if "batches of" in r.getMessage()]
    assert [m.split(",")[0] for m in progress] == [
        "speed at batch 1: 1/3 batches of 3 strategies", "speed at batch 1: 2/3 batches of 3 strategies",
        "speed at batch 1: 3/3 batches of 3 strategies", "speed at batch 2: 1/2 batches of 2 strategies",
        "speed at batch 2: 2/2 batches of 2 strategies"]
    assert progress[2].endswith("about 0 s left")
    at_bs1 = [(name, seed) for name, _, seed, _ in calls[:12]]
    assert at_bs1 == [("ar", 0), ("ssd", 0), ("stream", 0)] + [(n, s) for s in (0, 1, 2) for n in ("ar", "ssd",
                                                                                                    "stream")]
    at_bs2 = calls[12:]
    assert [(name, size, seed) for name, size, seed, _ in at_bs2[:6]] == [
        ("ar", 2, 0), ("ssd", 2, 0), ("ar", 2, 0), ("ssd", 2, 0), ("ar", 1, 2), ("ssd", 1, 2)]
    assert [name for name, *_ in at_bs2[6:]] == ["stream", "stream"] and at_bs2[-1][3] == 2  # warm-up, then all
    assert out["ssd/speed/nfe_ratio_bs1"] == 4 and out["ar/speed/nfe_bs2"] == 16 and out["ar/speed/wall_ratio_bs2"] == 1
    assert list(out)[0].startswith("ar/")


@pytest.mark.slow
def test_continuous_speed_benchmark_keys(tmp_path, tiny_exports):
    from specgen.eval import evaluate as run_eval

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    cspds = ("cspd", "cspd_noalign", "cspd_g2", "cspd_g8", "cspd_inround")
    targets = ("mar", "mar32", "mar21", "mar16")
    cfg = compose_cfg("eval", ["experiment=eval/continuous_speed", f"generator.backbone_dir={tiny_exports / 'mar'}",
                               f"generator.tokenizer_dir={tiny_exports / 'kl'}", "benchmark=geneval_fid_shapes",
                               "benchmark.geneval.prompts_per_task=1",
                               "benchmark.geneval.samples_per_prompt=1", "benchmark.geneval.images_per_task=null",
                               "benchmark.fidelity.num_prompts=4",
                               f"benchmark.fidelity.extractor_dir={root / 'featnet_shapes'}",
                               "speed.num_prompts=2", "speed.batch_sizes=[1,2]",
                               "logger=csv",
                               *[f"strategies.{s}.fn.num_iter=2" for s in (*targets, *cspds)],
                               *[f"strategies.{s}.fn.draft.dirpath={tiny_exports / 'mar'}" for s in cspds]],
                      tmp_path)
    m = run_eval(cfg)
    for key in ("cspd/accept_rate", "cspd_noalign/accept_rate", "cspd_inround/accept_rate", "cspd/speed/wall_ratio",
                "cspd/speed/wall_ratio_bs1", "mar/geneval/overall", "cspd/geneval/overall",
                "cspd/geneval/overall_ci95", "cspd/geneval/overall_diff", "cspd/geneval/overall_diff_ci95",
                "cspd_g8/fidelity/fid", "mar/fidelity/fid", "mar16/geneval/overall",
                "cspd/speed/target_work_ratio", "cspd/alpha_by_step/s01", "cspd_g2/accept_rate",
                "mar/fidelity/fid_ci95", "cspd/fidelity/fid_diff", "cspd/fidelity/fid_diff_ci95"):
        assert key in m, key
    assert m["mar/speed/wall_ratio"] == 1.0 and (tmp_path / "out" / "alpha_steps.png").is_file()
    assert "mar/geneval/overall_diff" not in m and "mar/fidelity/fid_diff" not in m  # nothing to itself
    for name in ("cspd", "mar16"):  # the same features as torch-fidelity's FID
        assert m[f"{name}/fidelity/fid_diff"] == pytest.approx(m[f"{name}/fidelity/fid"] - m["mar/fidelity/fid"],
                                                               rel=1e-3, abs=1e-3)
    # every image paired: the paired difference is the difference of the two overall scores
    assert m["cspd/geneval/overall_diff"] == pytest.approx(m["cspd/geneval/overall"] - m["mar/geneval/overall"])
    # the tiny draft is the target itself: on aligned chains the paper's ratio is 1, so nothing is rejected
    assert m["cspd/accept_rate"] == 1.0 and m["cspd_inround/accept_rate"] == 1.0
    assert m["cspd_noalign/accept_rate"] < 1.0  # the target's chain with other noise ends elsewhere


def test_cspd_ablation_shares_the_swept_setting(tmp_path):
    cfg = compose_cfg("eval", ["experiment=ablation/cspd_ablation", "ablation.gamma=16", "ablation.prefill_ratio=0.15"], tmp_path)
    assert set(cfg.strategies) == {"target", "cspd"}
    assert cfg.strategies.cspd.fn.gamma == 16 and cfg.strategies.cspd.fn.prefill_ratio == 0.15
    assert cfg.strategies.cspd.fn.ratio == "paper"


@pytest.mark.slow
def test_discrete_speed_benchmark_keys_table_and_plots(tmp_path, tiny_exports, capsys):
    """Every strategy in one run: flat keys the papers' tables need, the summary table and the PNGs."""
    import json

    from specgen.eval import evaluate as run_eval

    base = ["experiment=eval/discrete_speed", f"generator.backbone_dir={tiny_exports / 'ar'}",
            f"generator.tokenizer_dir={tiny_exports / 'vq'}", "benchmark.geneval.prompts_per_task=1",
            "benchmark.geneval.samples_per_prompt=1", "benchmark.geneval.images_per_task=2", "speed.num_prompts=2",
            "speed.batch_sizes=[1,2]", "speed.entropy_prompts=2", "logger=csv"]
    cfg = compose_cfg("eval", base + tiny_drafter_overrides("eval", base, tiny_exports, tmp_path), tmp_path)
    strategies = tuple(cfg.strategies)
    assert {"ar", "ssd", "ssd_paper", "ssd_latent", "sjd", "zipar", "mtp1d", "specdec"} <= set(strategies)
    m = run_eval(cfg)
    for s in strategies:
        for key in ("speed/nfe", "speed/nfe_ratio", "speed/latency_s", "speed/wall_ratio", "speed/wall_ratio_bs1",
                    "speed/accept_len", "geneval/overall", "geneval/overall_ci95", *[f"geneval/{t}" for t in
                                                                                      ("single_object", "two_object", "counting", "colors", "position", "color_attr")]):
            assert f"{s}/{key}" in m, f"{s}/{key}"
    assert m["ar/speed/nfe_ratio"] == 1.0 and m["ar/token_entropy"] > 0
    assert m["ssd/speed/accept_len"] == pytest.approx(256 / m["ssd/speed/nfe"])
    assert m["ar/num_images"] == 12  # images_per_task=2 with one prompt per task: 2 samples each
    out = Path(cfg.paths.output_dir)
    assert json.loads((out / "metrics.json").read_text()) == pytest.approx(m)
    assert (out / "speed_quality.png").stat().st_size > 0 and (out / "accept_map_ssd.png").is_file()
    table = capsys.readouterr().out
    assert all(f"\n{s} " in table for s in strategies) and "GenEval (95%)" in table
    assert "targets of ssd:" in table and "pass_ratio_bs1" in (out / "summary.txt").read_text()
    for bs in (1, 2):  # aten ops of one batch per strategy (speed.count_ops), AR the reference
        assert m[f"ar/speed/ops_ratio_bs{bs}"] == 1.0 and m[f"ar/speed/ops_draft_per_pass_bs{bs}"] == 0
        assert m[f"ssd/speed/ops_per_pass_bs{bs}"] > m[f"ssd/speed/ops_per_forward_bs{bs}"] > 0
        assert m[f"ssd/speed/ops_per_drafted_token_bs{bs}"] > 0 and m[f"sjd/speed/ops_per_pass_bs{bs}"] > 0
    assert "aten ops" in table and "ops_ratio_bs1" in table


def test_collect_keeps_strategy_names_of_side_by_side_jobs(tmp_path):
    """Ablation sweeps run AR and one variant per job: their metrics must not collide in the table."""
    from specgen.evaluation.collect import collect, format_rows

    for i, r in enumerate((0, 2)):
        job = tmp_path / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- experiment=ablation/ssd_ablation\n- strategies.ssd.fn.rounds={r}\n")
        (job / "metrics.json").write_text(json.dumps({"ar/speed/nfe": 272.0, "ssd/speed/nfe": 20.0 + 10 * r,
                                                      "ssd/speed/nfe_ratio": 272.0 / (20 + 10 * r)}))
    rows = collect(tmp_path, ["ssd/speed/nfe_ratio", "ar/speed/nfe"])
    assert [r["strategies.ssd.fn.rounds"] for r in rows] == ["0", "2"]
    assert rows[0]["ssd/speed/nfe_ratio"] == pytest.approx(13.6) and rows[1]["ar/speed/nfe"] == 272.0
    assert "ssd/speed/nfe" not in rows[0] and rows[0]["decoding"] == "ar+ssd"
    assert "strategies.ssd.fn.rounds" in format_rows(rows)


def test_offline_wandb_run_of_an_evaluation_holds_the_grid_and_the_table(tmp_path, tiny_exports):
    from specgen.eval import evaluate as run_eval

    cfg = _eval_cfg(tmp_path, tiny_exports, ["logger=wandb"])
    run_eval(cfg)
    runs = list((Path(cfg.paths.output_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    images = list(runs[0].rglob("media/images/**/*.png"))
    tables = list(runs[0].rglob("media/table/**/*.json"))
    assert images and tables
    from PIL import Image

    grid = np.asarray(Image.open(images[0]))
    assert grid.dtype == np.uint8 and grid.ndim == 3 and grid.max() > grid.min()  # a real uint8 image


@pytest.mark.slow
def test_quickstart_with_every_benchmark_logs_to_wandb_and_prints_one_table(tmp_path, tiny_exports, capsys):
    """The README's main job on tiny models: GenEval (bool per image) and DPG (score per image) share one W&B
    table, and the printed summary carries passes, DPG, CLIPScore and FID with its sample size."""
    from specgen.eval import evaluate as run_eval

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    base = ["experiment=eval/quickstart", f"generator.backbone_dir={tiny_exports / 'ar'}",
            f"generator.tokenizer_dir={tiny_exports / 'vq'}", "benchmark.geneval.prompts_per_task=1",
            "benchmark.geneval.samples_per_prompt=1", "benchmark.dpg.num_prompts=1", "benchmark.clipscore.num_prompts=2",
            "benchmark.fidelity.num_prompts=4", f"benchmark.clipscore.checkpoint={root / 'clip_shapes' / 'model.safetensors'}",
            f"benchmark.fidelity.extractor_dir={root / 'featnet_shapes'}", "speed.num_prompts=1", "logger=wandb"]
    cfg = compose_cfg("eval", base + tiny_drafter_overrides("eval", base, tiny_exports, tmp_path), tmp_path)
    m = run_eval(cfg)
    for s in ("ar", "ssd", "ssd_paper", "sjd"):
        for key in ("geneval/overall", "dpg/overall", "clipscore/clipscore_100cos", "fidelity/fid", "speed/nfe_ratio"):
            assert f"{s}/{key}" in m, f"{s}/{key}"
    table = capsys.readouterr().out
    assert "FID (n=4)" in table and "DPG" in table and "\nsjd " in table
    runs = list((Path(cfg.paths.output_dir) / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].rglob("media/table/**/*.json"))


@pytest.mark.slow
def test_speed_only_run_of_the_discrete_benchmark(tmp_path, tiny_exports):
    """benchmark=none on an experiment that sets GenEval sizes: speed only, no error."""
    from specgen.eval import evaluate as run_eval

    base = ["experiment=eval/discrete_speed", "benchmark=none", f"generator.backbone_dir={tiny_exports / 'ar'}",
            f"generator.tokenizer_dir={tiny_exports / 'vq'}", "~strategies.mtp1d", "~strategies.specdec",
            "speed.num_prompts=1", "speed.batch_sizes=[1]", "speed.entropy_prompts=1", "logger=none"]
    cfg = compose_cfg("eval", base + tiny_drafter_overrides("eval", base, tiny_exports, tmp_path), tmp_path)
    m = run_eval(cfg)
    assert "ssd/speed/nfe_ratio" in m and not any("/geneval/" in k for k in m)


def test_geneval_rows_carry_each_image_index_within_its_prompt():
    from specgen.evaluation.benchmarks import GenEval

    class NoObjects:
        def detect(self, image):
            return []

    bench = GenEval(prompts_per_task=2, samples_per_prompt=3, detector=NoObjects())
    jobs = bench.jobs(seed=0)
    _, rows = bench.score(jobs, [np.zeros((64, 64, 3), np.uint8)] * len(jobs))
    by_prompt = {}
    for job, row in zip(jobs, rows):
        assert (row["prompt"], row["seed"], row["sample"]) == (job.prompt, job.seed, job.sample)
        by_prompt.setdefault(row["prompt"], []).append(row["sample"])
    assert len(by_prompt) == 12 and all(v == [0, 1, 2] for v in by_prompt.values())
    assert not any(r["correct"] for r in rows)  # nothing detected: every clause fails


def _results_csv(path, rows, with_sample=True):
    import csv

    fields = ["benchmark", "tag", "prompt"] + (["sample"] if with_sample else []) + ["seed", "correct", "reason", "decoding"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: v for k, v in r.items() if k in fields})


def test_geneval_report_scores_the_first_k_samples_and_resamples_prompts(tmp_path, capsys):
    from specgen.analysis.geneval_report import main, prompt_bootstrap, read_results, report

    # colours: prompt a hits 4 of its first 4 and fails its next 2; prompt b fails its first, hits the rest
    pattern = {"a red circle": [1, 1, 1, 1, 0, 0], "a blue square": [0, 1, 1, 1, 1, 1]}
    rows = [{"benchmark": "geneval", "tag": "colors", "prompt": p, "sample": k, "seed": 100 + k,
             "correct": bool(v), "reason": "", "decoding": "ar"} for p, hits in pattern.items() for k, v in enumerate(hits)]
    rows += [{"benchmark": "geneval", "tag": "single_object", "prompt": "a cross", "sample": k, "seed": k,
              "correct": k != 2, "reason": "", "decoding": "ar"} for k in range(4)]
    rows += [{"benchmark": "dpg", "tag": "dense", "prompt": "x", "seed": 0, "correct": 0.5, "reason": "",
              "decoding": "ar"}]  # other benchmarks' rows are skipped
    _results_csv(tmp_path / "results.csv", rows)
    table = {(r["task"], r["samples_per_prompt"]): r for r in report(read_results(tmp_path), [4, None])}
    assert table["colors", 4]["score"] == pytest.approx(7 / 8) and table["colors", 4]["images"] == 8
    assert table["colors", "all"]["score"] == pytest.approx(9 / 12)
    assert table["single_object", 4]["score"] == pytest.approx(3 / 4)
    assert table["overall", 4]["score"] == pytest.approx((7 / 8 + 3 / 4) / 2)
    for r in table.values():
        assert r["prompt_boot_lo"] <= r["score"] <= r["prompt_boot_hi"]
    assert table["colors", "all"]["prompt_boot_lo"] < table["colors", "all"]["prompt_boot_hi"]  # prompts differ
    assert prompt_bootstrap([[[True, False]] * 5]) == (0.5, 0.5)  # identical prompts: no prompt spread

    # a results.csv without the sample column: a prompt's rows in file order are its samples
    _results_csv(tmp_path / "old.csv", rows, with_sample=False)
    old = report(read_results(tmp_path / "old.csv"), [4, None])
    assert [r["score"] for r in old] == [r["score"] for r in report(read_results(tmp_path), [4, None])]

    main([str(tmp_path), "--samples", "2", "all", "--out", str(tmp_path / "report.csv")])
    assert "colors" in capsys.readouterr().out and (tmp_path / "report.csv").is_file()
    with pytest.raises(FileNotFoundError, match="specgen.eval"):
        read_results(tmp_path / "missing")
    (tmp_path / "bad.csv").write_text("prompt,seed\nx,0\n")
    with pytest.raises(ValueError, match="lacks the columns"):
        read_results(tmp_path / "bad.csv")
    _results_csv(tmp_path / "dpg.csv", rows[-1:])
    with pytest.raises(ValueError, match="no GenEval rows"):
        read_results(tmp_path / "dpg.csv")
    for bad in (["--samples", "0"], ["--samples", "four"], ["--resamples", "0"]):
        with pytest.raises(SystemExit):
            main([str(tmp_path), *bad])
    assert "--samples 'four'" in capsys.readouterr().err


def test_speed_streams_prompts_through_slots_and_counts_passes_per_batch():
    """A streaming strategy gets every prompt in one call with slots = the batch size; its passes are reported per
    batch of that size (stream passes x slots / prompts), next to a fixed-batch strategy on the same prompts; at
    least min_batches batches per batch size, with a clear error when the caller gives fewer prompts."""
    import torch

    from specgen.evaluation.speed import compare, prompts_needed

    class Fake:
        device = torch.device("cpu")

        def prompts(self, prompts):
            return list(prompts)

    calls = []

    def fixed(backbone, ids, rngs=None):
        return None, {"nfe": 20}

    def stream(backbone, ids, rngs=None, slots=None):
        calls.append((len(ids), slots))
        n = len(ids)  # every image 10 passes; the stream's passes as if perfectly packed, plus a tail of 2
        return None, {"nfe": (10 * n) // (slots or 1) + (2 if slots else 0), "image_passes": torch.full((n,), 10.0)}

    prompts = [f"p{i}" for i in range(prompts_needed(4, [1, 4], 3))]
    assert len(prompts) == 12
    out = compare(Fake(), {"ar": fixed, "ssd": stream}, prompts, [1, 4], streams=("ssd",), min_batches=3,
                  num_prompts=4)
    assert out["ar/speed/images_bs1"] == 4 and out["ar/speed/images_bs4"] == 12  # 3 batches of 4
    assert calls[-1] == (12, 4)  # one call with every prompt, four slots (the warm-up came first)
    assert out["ssd/speed/nfe_bs4"] == pytest.approx((30 + 2) * 4 / 12)
    assert out["ssd/speed/nfe_ratio_bs4"] == pytest.approx(20 / ((30 + 2) * 4 / 12))
    assert out["ssd/speed/nfe_bs1"] == 10 and out["ssd/speed/stream_bs4"] == 1
    with pytest.raises(ValueError, match="give 12"):
        compare(Fake(), {"ar": fixed}, prompts[:8], [1, 4], min_batches=3, num_prompts=4)


def test_mean_ci95_by_hand():
    from specgen.utils.stats import mean_ci95

    assert mean_ci95([1.0, 3.0]) == pytest.approx(1.96 * 2 ** 0.5 / 2 ** 0.5)  # sample std of (1, 3) = sqrt(2)
    assert mean_ci95([5.0]) == 0.0 and mean_ci95([2.0, 2.0, 2.0]) == 0.0
    per_col = mean_ci95(np.array([[1.0, 0.0], [3.0, 0.0]]), axis=0)
    assert per_col.shape == (2,) and per_col[0] == pytest.approx(1.96) and per_col[1] == 0.0
    assert mean_ci95(np.ones((1, 3)), axis=0).tolist() == [0.0, 0.0, 0.0]


def test_paired_geneval_difference_against_a_hand_computation():
    from specgen.evaluation.geneval import paired_difference
    from specgen.evaluation.runner import geneval_differences, summary_rows

    def rows(name, single, colors):
        out = [dict(benchmark="geneval", tag="single_object", prompt="p", sample=i, seed=i, correct=c, decoding=name)
               for i, c in enumerate(single)]
        return out + [dict(benchmark="geneval", tag="colors", prompt="q", sample=i, seed=10 + i, correct=c,
                           decoding=name) for i, c in enumerate(colors)]

    ref, new = rows("ar", [1, 1, 0, 1], [1, 0, 0]), rows("ssd", [1, 0, 0, 1], [1, 1, 0])
    new.append(dict(benchmark="geneval", tag="colors", prompt="q", sample=9, seed=99, correct=1,
                    decoding="ssd"))  # no reference image: left out
    d = paired_difference(new, ref)
    # single_object: differences 0, -1, 0, 0 (mean -0.25, var 0.25); colors: 0, 1, 0 (mean 1/3, var 1/3)
    assert d["diff_pairs"] == 7
    assert d["overall_diff"] == pytest.approx((-0.25 + 1 / 3) / 2)
    assert d["overall_diff_ci95"] == pytest.approx(1.96 * np.sqrt(0.25 / 4 + (1 / 3) / 3) / 2)
    assert paired_difference(new, []) == {}
    m = geneval_differences(ref + new, ["ar", "ssd"])
    assert m["ssd/geneval/overall_diff"] == d["overall_diff"] and "ar/geneval/overall_diff" not in m
    heads, table = summary_rows({**m, "ar/geneval/overall": 0.7, "ssd/geneval/overall": 0.75}, ["ar", "ssd"], [1])
    col = heads.index("GenEval - ar")
    assert table[0][col] == "-" and table[1][col] == f"{d['overall_diff']:+.3f} +-{d['overall_diff_ci95']:.3f}"


def _brute_frechet(a, b):
    """FID by its definition, the matrix square roots taken by eigendecomposition of symmetric matrices:
    |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2)."""
    def sqrt_psd(m):
        w, v = np.linalg.eigh((m + m.T) / 2)
        return (v * np.sqrt(np.clip(w, 0, None))) @ v.T

    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    ra = sqrt_psd(sa)
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(sa + sb - 2 * sqrt_psd(ra @ sb @ ra)))


def test_frechet_distance_against_its_definition():
    from specgen.evaluation.fidelity import frechet_distance

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(300, 5)), rng.normal(size=(300, 5)) @ rng.normal(size=(5, 5)) + 0.5
    assert frechet_distance(a, b) == pytest.approx(_brute_frechet(a, b), rel=1e-6)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)


def test_fid_interval_matches_the_spread_of_independent_draws():
    """The bootstrap half-width over one draw of (generated, reference) features estimates 1.96 standard deviations
    of FID over independent draws from the same two distributions, and shrinks as the sets grow."""
    from specgen.evaluation.fidelity import fid_interval, frechet_distance

    rng = np.random.default_rng(1)
    mix = np.diag([1.0, 1.3, 0.8, 1.1])

    def draw(n):
        return rng.normal(size=(n, 4)) @ mix + 0.3, rng.normal(size=(n, 4))

    draws = [draw(120) for _ in range(40)]
    spread = 1.96 * np.std([frechet_distance(g, r) for g, r in draws], ddof=1)
    halves = [fid_interval(g, r, resamples=100, seed=i) for i, (g, r) in enumerate(draws[:8])]
    assert 0.6 * spread < np.mean(halves) < 1.6 * spread
    assert fid_interval(*draw(480), resamples=100) < 0.75 * np.mean(halves)  # 4x the images: about half the width
    with pytest.raises(ValueError, match="one reference image per generated image"):
        fid_interval(np.zeros((5, 4)), np.zeros((4, 4)))
    with pytest.raises(ValueError, match="at least 2 resamples"):
        fid_interval(*draw(10), resamples=1)


def test_paired_fid_difference():
    """Identical strategies differ by exactly 0; a strategy whose images are another's plus a small shift differs
    by the FIDs' difference, with a paired interval far tighter than the two single intervals combined."""
    from specgen.evaluation.fidelity import fid_interval, fid_paired_difference, frechet_distance

    rng = np.random.default_rng(2)
    ref, a = rng.normal(size=(150, 4)), rng.normal(size=(150, 4)) + 0.2
    assert fid_paired_difference(a, a, ref, resamples=20) == {"fid_diff": 0.0, "fid_diff_ci95": 0.0}
    b = a + 0.15 + 0.05 * rng.normal(size=a.shape)
    d = fid_paired_difference(b, a, ref, resamples=100)
    assert d["fid_diff"] == pytest.approx(frechet_distance(b, ref) - frechet_distance(a, ref))
    assert d["fid_diff"] - d["fid_diff_ci95"] > 0  # the shift away from the reference is resolved
    unpaired = np.hypot(fid_interval(a, ref, resamples=100), fid_interval(b, ref, resamples=100))
    assert d["fid_diff_ci95"] < 0.5 * unpaired
    with pytest.raises(ValueError, match="same prompts"):
        fid_paired_difference(a, a[:10], ref)


def test_image_differences_and_the_fid_columns():
    from specgen.evaluation.runner import image_differences, summary_rows

    class Bench:  # a benchmark comparing two strategies' images: the difference of their means
        name = "fidelity"

        def paired_difference(self, images, other):
            return {"fid_diff": float(np.mean(images) - np.mean(other)), "fid_diff_ci95": 0.5}

    class Plain:
        name = "geneval"

    images = {"ar": {"fidelity": [np.zeros(2)]}, "ssd": {"fidelity": [np.full(2, 3.0)]}, "sjd": {}}
    m = image_differences([Plain(), Bench()], images, ["ar", "ssd", "sjd"])
    assert m == {"ssd/fidelity/fid_diff": 3.0, "ssd/fidelity/fid_diff_ci95": 0.5}
    assert image_differences([Bench()], {"ssd": images["ssd"]}, ["ar", "ssd"]) == {}  # no reference images
    m.update({"ar/fidelity/fid": 4.9, "ar/fidelity/fid_ci95": 0.4, "ssd/fidelity/fid": 7.9})
    heads, rows = summary_rows(m, ["ar", "ssd", "sjd"], [1])
    fid, diff = heads.index("FID"), heads.index("FID - ar")
    assert [r[fid] for r in rows] == ["4.90 +-0.40", "7.90", "-"]
    assert [r[diff] for r in rows] == ["-", "+3.00 +-0.50", "-"]


def test_fidelity_extracts_each_image_set_once(monkeypatch):
    """The paired differences meet the reference and every strategy's images again: features are taken once per set."""
    import specgen.evaluation.fidelity as fid
    from specgen.evaluation.benchmarks import Fidelity

    calls, real = [], fid.features
    monkeypatch.setattr(fid, "features", lambda images, *a, **k: calls.append(len(images)) or real(images, *a, **k))
    bench = Fidelity(extractor_dir=str(Path(__file__).resolve().parents[1] / "checkpoints" / "featnet_shapes"),
                     num_prompts=6, resamples=10)
    a, b = bench.reference()[::-1], [np.zeros_like(im) for im in bench.reference()]
    first = bench.paired_difference(b, a)
    assert bench.paired_difference(b, a) == first and len(calls) == 3  # b, a, the reference: once each
    assert bench.paired_difference(a, a) == {"fid_diff": 0.0, "fid_diff_ci95": 0.0} and len(calls) == 3
    assert first["fid_diff"] > 0  # blank images are further from the renders than the renders reversed
