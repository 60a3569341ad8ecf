"""Benchmarks as objects: which (prompt, seed) jobs they need, and how they score the images."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
from PIL import Image

from specgen.evaluation import dpg_bench
from specgen.evaluation.clipscore import clip_score, cosines, load_clip
from specgen.evaluation.generate import Job, job_seed
from specgen.evaluation.geneval import (TASKS, ShapesDetector, Thresholds, evaluate, is_plain_prompts,
                                        read_metadata, summarize, write_official_layout)
from specgen.evaluation.real_models import OpenClipColorClassifier, TransformersDetector, TransformersVQA
from specgen.world import render, scene_for
from specgen.world.prompts import DEFAULT_MIX, prompts, sample_prompt

log = logging.getLogger(__name__)


class GenEval:
    """GenEval on the shapes world (held-out prompts, exact parser) or on an official metadata file."""

    name = "geneval"

    def __init__(self, split: str = "test", prompts_per_task: int | None = 12, samples_per_prompt: int = 4,
                 metadata_file: str | None = None, detector=None, thresholds: Thresholds | None = None,
                 layout_dir: str | None = None, images_per_task: int | None = None):
        if images_per_task is not None and images_per_task < 1:
            raise ValueError(f"images_per_task={images_per_task!r}: give a positive number or null")
        self.split, self.prompts_per_task, self.samples = split, prompts_per_task, samples_per_prompt
        self.images_per_task = images_per_task
        self.metadata_file, self.layout_dir = metadata_file, layout_dir
        # the shapes world is scored by its exact parser; an official prompt file needs a real detector, without
        # one its images are written in the official layout and not scored
        self.detector = ShapesDetector() if detector is None and metadata_file is None else detector
        self.thresholds = thresholds or Thresholds()

    def metadata(self) -> list[dict]:
        if self.metadata_file is not None:
            items = read_metadata(self.metadata_file)
            if self.prompts_per_task is not None:  # a quick run: the first prompts of each task, in file order
                kept, seen = [], {}
                for m in items:
                    seen[m["tag"]] = seen.get(m["tag"], 0) + 1
                    if seen[m["tag"]] <= self.prompts_per_task:
                        kept.append(m)
                items = kept
                log.info("GenEval: the first %d prompts of each task of %s (%d prompts; prompts_per_task=null for "
                         "all)", self.prompts_per_task, self.metadata_file, len(items))
        else:
            items = [m for t in TASKS for m in prompts(t, self.split)[: self.prompts_per_task]]
        return items

    def samples_for(self, items: list[dict]) -> dict[str, int]:
        """Samples per prompt of each task: `samples_per_prompt`, raised where a task has few prompts so that
        every task gets at least `images_per_task` images (tight intervals for small tasks such as
        single_object, whose held-out split has a handful of prompts)."""
        counts: dict[str, int] = {}
        for m in items:
            counts[m["tag"]] = counts.get(m["tag"], 0) + 1
        if self.images_per_task is None:
            return {t: self.samples for t in counts}
        return {t: max(self.samples, -(-self.images_per_task // n)) for t, n in counts.items()}

    def jobs(self, seed: int) -> list[Job]:
        items = self.metadata()
        per = self.samples_for(items)
        return [Job(m["prompt"], job_seed(seed, m["prompt"], k), m, k) for m in items for k in range(per[m["tag"]])]

    def score(self, jobs: list[Job], images) -> tuple[dict[str, float], list[dict]]:
        if self.layout_dir is not None:  # the official evaluator can be run on this folder
            items: dict[str, tuple[dict, list]] = {}
            for job, image in zip(jobs, images):
                items.setdefault(job.prompt, (job.meta, []))[1].append(image)
            write_official_layout(self.layout_dir, list(items.values()))
        if self.detector is None:
            log.warning("GenEval scoring skipped: no detector for real images (give benchmark.detector_path and "
                        "benchmark.color_checkpoint, local weights); the images are in %s", self.layout_dir)
            return {}, []
        rows = []
        for job, image in zip(jobs, images):
            correct, reason = evaluate(self.detector.detect(image), job.meta, self.thresholds)
            rows.append({"benchmark": self.name, "tag": job.meta["tag"], "prompt": job.prompt, "sample": job.sample,
                         "seed": job.seed, "correct": bool(correct), "reason": reason})
        return summarize(rows), rows


def real_geneval(metadata_file: str, detector_path: str | None = None, color_checkpoint: str | None = None,
                 prompts_per_task: int | None = None, samples_per_prompt: int = 4, layout_dir: str | None = None,
                 color_model: str = "ViT-L-14-quickgelu", min_score: float = 0.05) -> GenEval:
    """GenEval on an official metadata file for real images: scored by a local detector and colour model when both
    paths are given, else written in the official layout only (the official evaluator can score that folder)."""
    if not metadata_file:
        raise ValueError("benchmark.prompts_path is not set: give GenEval's evaluation_metadata.jsonl (a copy: "
                         "shared/benchmarks/geneval/evaluation_metadata.jsonl)")
    detector = None
    if (detector_path or color_checkpoint) and is_plain_prompts(metadata_file):
        raise ValueError(f"benchmark.prompts_path={metadata_file!r} is a plain prompts file (one a line): GenEval "
                         f"scores only its own metadata (evaluation_metadata.jsonl, objects per prompt); drop "
                         f"benchmark.detector_path and benchmark.color_checkpoint to write the images unscored")
    if detector_path or color_checkpoint:
        if not (detector_path and color_checkpoint):
            raise ValueError(f"GenEval scoring needs both benchmark.detector_path ({detector_path!r}) and "
                             f"benchmark.color_checkpoint ({color_checkpoint!r}): give both, or neither to skip scoring")
        detector = TransformersDetector(detector_path, OpenClipColorClassifier(color_model, color_checkpoint),
                                        min_score=min_score)
    return GenEval(metadata_file=metadata_file, detector=detector, prompts_per_task=prompts_per_task,
                   samples_per_prompt=samples_per_prompt, layout_dir=layout_dir)


def score_grids(name: str, grids: list[tuple[dict, int, np.ndarray]], questions, vqa,
                mode: str) -> tuple[dict[str, float], list[dict]]:
    """DPG-Bench scores of (meta, seed, 2x2 grid) items, `questions(meta)` giving each one's question graph: the DPG
    rules (exact "yes", zeroing below a failed parent) on every crop; an item that fails is counted, never dropped."""
    scores, cats, rows, failed = [], {}, [], 0
    for meta, seed, grid in grids:
        row = {"benchmark": name, "tag": "dense", "prompt": meta["prompt"], "seed": seed}
        try:
            s, per_cat = dpg_bench.score_image(grid, questions(meta), vqa, mode)
        except Exception as e:  # counted and reported, unlike the released script
            failed += 1
            rows.append({**row, "correct": False, "reason": f"failed: {e}"})
            continue
        scores.append(s)
        for k, v in per_cat.items():
            cats.setdefault(k, []).extend(v)
        rows.append({**row, "correct": s, "reason": ""})
    return dpg_bench.summarize(scores, cats, failed), rows


def grids_of(jobs: list[Job], images) -> list[tuple[dict, int, np.ndarray]]:
    """(meta, seed, 2x2 grid) per prompt of jobs that come 4 per prompt, tiles in sample order."""
    return [(jobs[i].meta, jobs[i].seed, dpg_bench.make_grid(list(images[i:i + 4]))) for i in range(0, len(jobs), 4)]


class DPGBench:
    """DPG-Bench on held-out dense shapes prompts: 4 samples per prompt as one 2x2 grid, oracle VQA."""

    name = "dpg"

    def __init__(self, split: str = "test", num_prompts: int = 24, mode: str = "fixed", vqa=None, seed: int = 0):
        if mode not in dpg_bench.MODES:
            raise ValueError(f"unknown DPG-Bench mode {mode!r}: expected one of {dpg_bench.MODES}")
        rng = random.Random(seed)
        self.items = [sample_prompt(rng, "dense", split) for _ in range(num_prompts)]
        self.mode, self.vqa = mode, vqa or dpg_bench.ShapesOracle()

    def jobs(self, seed: int) -> list[Job]:
        return [Job(m["prompt"], job_seed(seed, m["prompt"], k), m, k) for m in self.items for k in range(4)]

    def score(self, jobs: list[Job], images) -> tuple[dict[str, float], list[dict]]:
        grids = grids_of(jobs, images)
        return score_grids(self.name, grids, dpg_bench.shapes_questions, self.vqa, self.mode)


class DPGBenchFolder:
    """DPG-Bench from its official prompt folder (`<item_id>.txt`) for real images: 4 samples per prompt written as
    `<layout_dir>/<item_id>.png`, a 2x2 grid without padding (the official layout); scored by a VQA model through
    the question graphs of `dpg_bench.csv` when both are given, else written only (the official script can score
    the folder)."""

    name = "dpg"

    def __init__(self, prompts_path: str, questions=None, vqa=None, mode: str = "fixed",
                 num_prompts: int | None = None, layout_dir: str | None = None):
        if mode not in dpg_bench.MODES:
            raise ValueError(f"unknown DPG-Bench mode {mode!r}: expected one of {dpg_bench.MODES}")
        if num_prompts is not None and num_prompts < 1:
            raise ValueError(f"benchmark.dpg.num_prompts={num_prompts!r}: give a positive number, or null for all")
        prompts = dpg_bench.read_prompts(prompts_path)  # refuses a missing or empty folder, naming it
        self.items = [{"item_id": k, "prompt": v, "tag": "dense"} for k, v in prompts.items()][:num_prompts]
        self.questions, self.vqa, self.mode, self.layout_dir = questions, vqa, mode, layout_dir

    def jobs(self, seed: int) -> list[Job]:
        return [Job(m["prompt"], job_seed(seed, m["prompt"], k), m, k) for m in self.items for k in range(4)]

    def score(self, jobs: list[Job], images) -> tuple[dict[str, float], list[dict]]:
        grids = grids_of(jobs, images)
        if self.layout_dir is not None:
            folder = Path(self.layout_dir)
            folder.mkdir(parents=True, exist_ok=True)
            for meta, _, grid in grids:
                Image.fromarray(grid).save(folder / f"{meta['item_id']}.png")
        if self.vqa is None:
            log.warning("DPG-Bench scoring skipped: no VQA model (give benchmark.vqa_path, a local transformers VQA "
                        "folder, and benchmark.questions_path, dpg_bench.csv); the grids are in %s", self.layout_dir)
            return {}, []

        def questions(meta):
            if meta["item_id"] not in self.questions:
                raise KeyError(f"no questions for item {meta['item_id']!r} in the question file")
            return self.questions[meta["item_id"]]

        return score_grids(self.name, grids, questions, self.vqa, self.mode)


def real_dpg(prompts_path: str | None, questions_path: str | None = None, vqa_path: str | None = None,
             mode: str = "fixed", num_prompts: int | None = None, layout_dir: str | None = None,
             vqa_device: str = "cpu") -> DPGBenchFolder:
    """DPG-Bench on the official prompt folder for real images: scored by a local VQA model when benchmark.vqa_path
    and benchmark.questions_path are given, else the grids are written only."""
    if not prompts_path:
        raise ValueError("benchmark.prompts_path is not set: give DPG-Bench's prompt folder (dpg_bench/prompts, one "
                         "<item_id>.txt per prompt; a copy: shared/benchmarks/dpg_bench/prompts)")
    if bool(questions_path) != bool(vqa_path):
        raise ValueError(f"DPG-Bench scoring needs both benchmark.vqa_path ({vqa_path!r}) and "
                         f"benchmark.questions_path ({questions_path!r}): give both, or neither to skip scoring")
    questions = vqa = None
    if vqa_path:
        questions = dpg_bench.read_questions(questions_path, mode)
        vqa = TransformersVQA(vqa_path, device=vqa_device)
    return DPGBenchFolder(prompts_path, questions, vqa, mode, num_prompts, layout_dir)


def mixed_prompts(split: str, n: int, seed: int) -> list[dict]:
    """n prompts of a split drawn from the training mixture of tasks (dense prompts included)."""
    rng = random.Random(seed)
    return [sample_prompt(rng, rng.choices(list(DEFAULT_MIX), weights=list(DEFAULT_MIX.values()))[0], split)
            for _ in range(n)]


class CLIPScore:
    """CLIPScore of generated images with their prompts (open_clip; both definitions reported)."""

    name = "clipscore"

    def __init__(self, checkpoint: str, model_name: str = "shapes-clip", split: str = "test", num_prompts: int = 64,
                 seed: int = 1):
        self.checkpoint, self.model_name = checkpoint, model_name
        self.items = mixed_prompts(split, num_prompts, seed)

    def jobs(self, seed: int) -> list[Job]:
        return [Job(m["prompt"], job_seed(seed, m["prompt"], 0), m) for m in self.items]

    def score(self, jobs: list[Job], images) -> tuple[dict[str, float], list[dict]]:
        model, preprocess, tokenizer = load_clip(self.model_name, self.checkpoint)
        cos = cosines(model, preprocess, tokenizer, list(images), [j.prompt for j in jobs])
        rows = [{"benchmark": self.name, "tag": j.meta["tag"], "prompt": j.prompt, "seed": j.seed,
                 "correct": float(c), "reason": "cosine"} for j, c in zip(jobs, cos)]
        return {**clip_score(cos), "num_images": float(len(jobs))}, rows


class Fidelity:
    """FID / IS / KID / precision-recall of generated images against renders of fresh scenes for the
    same prompts. FID is biased upwards on small samples: the sample size is reported with it, and its 95% interval
    and the paired difference between two strategies come from `resamples` bootstrap draws of the prompts."""

    name = "fidelity"

    def __init__(self, extractor_dir: str | None = None, inception_weights: str | None = None, split: str = "test",
                 num_prompts: int = 256, cache_dir: str | None = None, seed: int = 2, resamples: int = 200):
        self.extractor_dir, self.inception_weights, self.cache_dir = extractor_dir, inception_weights, cache_dir
        self.items = mixed_prompts(split, num_prompts, seed)
        self.resamples, self._pools = resamples, {}  # pool features by the images' content hash

    def jobs(self, seed: int) -> list[Job]:
        return [Job(m["prompt"], job_seed(seed, m["prompt"], 0), m) for m in self.items]

    def reference(self) -> list:
        rng = random.Random(12345)
        return [render(scene_for(m, rng)) for m in self.items]

    def score(self, jobs: list[Job], images) -> tuple[dict[str, float], list[dict]]:
        """FID, IS, KID, precision/recall, and the half-width of FID's 95% interval (`fid_ci95`, a bootstrap over the
        prompts: `fidelity.fid_interval`)."""
        from specgen.evaluation.fidelity import fid_interval, fidelity  # deferred: torch-fidelity takes seconds

        reference = self.reference()
        out = fidelity(list(images), reference, self.extractor_dir, self.inception_weights, self.cache_dir)
        out["fid_ci95"] = fid_interval(self._pool(images), self._reference_pool(reference), self.resamples)
        return out, []

    def paired_difference(self, images, other) -> dict[str, float]:
        """FID of `images` minus FID of `other` (two strategies' images for this benchmark's jobs, in job order) with
        a paired bootstrap 95% interval: `fid_diff`, `fid_diff_ci95`."""
        from specgen.evaluation.fidelity import fid_paired_difference

        return fid_paired_difference(self._pool(images), self._pool(other), self._reference_pool(), self.resamples)

    def _pool(self, images) -> np.ndarray:
        """Pool features of `images`, extracted once per image set (the reference, and each strategy's images, are
        met again by the paired differences)."""
        from specgen.evaluation.fidelity import content_hash, features

        key = content_hash(list(images))
        if key not in self._pools:
            pool = features(list(images), self.extractor_dir, self.inception_weights)["pool"]
            self._pools[key] = pool.double().numpy()
        return self._pools[key]

    def _reference_pool(self, reference: list | None = None) -> np.ndarray:
        return self._pool(self.reference() if reference is None else reference)


class ClassFidelity:
    """FID / IS of class-conditional samples (prompts are class ids, `per_class` images of each of the first
    `num_classes` classes) against reference statistics given by path (ImageNet: ADM's reference batch)."""

    name = "fidelity"

    def __init__(self, reference_stats: str, extractor_dir: str | None = None, inception_weights: str | None = None,
                 num_classes: int = 1000, per_class: int = 1):
        if num_classes < 1 or per_class < 1:
            raise ValueError(f"num_classes={num_classes} and per_class={per_class} must be >= 1 (FID-50K on "
                             f"ImageNet: 1000 and 50)")
        self.reference_stats, self.extractor_dir, self.inception_weights = reference_stats, extractor_dir, \
            inception_weights
        self.num_classes, self.per_class = num_classes, per_class

    def jobs(self, seed: int) -> list[Job]:
        return [Job(str(c), job_seed(seed, str(c), k), {"tag": "class", "class": c}, k)
                for c in range(self.num_classes) for k in range(self.per_class)]

    def score(self, jobs: list[Job], images) -> tuple[dict[str, float], list[dict]]:
        from specgen.evaluation.fidelity import fidelity_to_statistics  # deferred, as above

        return fidelity_to_statistics(list(images), self.reference_stats, self.extractor_dir,
                                      self.inception_weights), []
