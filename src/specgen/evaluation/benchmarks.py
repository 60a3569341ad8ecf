"""Benchmarks as objects: which (prompt, seed) jobs they need, and how they score the images."""
from __future__ import annotations

from specgen.evaluation.generate import Job, job_seed
from specgen.evaluation.geneval import TASKS, ShapesDetector, Thresholds, evaluate, read_metadata, summarize


class GenEval:
    """GenEval on the shapes world (held-out prompts, exact parser) or on an official metadata file."""

    name = "geneval"

    def __init__(self, split: str = "test", prompts_per_task: int | None = 12, samples_per_prompt: int = 4,
                 metadata_file: str | None = None, detector=None, thresholds: Thresholds | None = None):
        self.split, self.prompts_per_task, self.samples = split, prompts_per_task, samples_per_prompt
        self.metadata_file = metadata_file
        self.detector = detector or ShapesDetector()
        self.thresholds = thresholds or Thresholds()

    def metadata(self) -> list[dict]:
        if self.metadata_file is not None:
            items = read_metadata(self.metadata_file)
        else:
            from specgen.world.prompts import prompts

            items = [m for t in TASKS for m in prompts(t, self.split)[: self.prompts_per_task]]
        return items

    def jobs(self, seed: int) -> list[Job]:
        return [Job(m["prompt"], job_seed(seed, m["prompt"], k), m) for m in self.metadata() for k in range(self.samples)]

    def score(self, jobs: list[Job], images) -> tuple[dict[str, float], list[dict]]:
        rows = []
        for job, image in zip(jobs, images):
            correct, reason = evaluate(self.detector.detect(image), job.meta, self.thresholds)
            rows.append({"benchmark": self.name, "tag": job.meta["tag"], "prompt": job.prompt, "seed": job.seed,
                         "correct": bool(correct), "reason": reason})
        return summarize(rows), rows


class DPGBench:
    """DPG-Bench on held-out dense shapes prompts: 4 samples per prompt as one 2x2 grid, oracle VQA."""

    name = "dpg"

    def __init__(self, split: str = "test", num_prompts: int = 24, mode: str = "fixed", vqa=None, seed: int = 0):
        import random

        from specgen.evaluation.dpg_bench import MODES, ShapesOracle
        from specgen.world.prompts import sample_prompt

        if mode not in MODES:
            raise ValueError(f"unknown DPG-Bench mode {mode!r}: expected one of {MODES}")
        rng = random.Random(seed)
        self.items = [sample_prompt(rng, "dense", split) for _ in range(num_prompts)]
        self.mode, self.vqa = mode, vqa or ShapesOracle()

    def jobs(self, seed: int) -> list[Job]:
        return [Job(m["prompt"], job_seed(seed, m["prompt"], k), m) for m in self.items for k in range(4)]

    def score(self, jobs: list[Job], images) -> tuple[dict[str, float], list[dict]]:
        from specgen.evaluation.dpg_bench import make_grid, score_image, shapes_questions, summarize

        scores, cats, rows, failed = [], {}, [], 0
        for i in range(0, len(jobs), 4):
            meta = jobs[i].meta
            try:
                s, per_cat = score_image(make_grid(list(images[i:i + 4])), shapes_questions(meta), self.vqa, self.mode)
            except Exception as e:  # counted, never silently dropped
                failed += 1
                rows.append({"benchmark": self.name, "tag": "dense", "prompt": meta["prompt"], "seed": jobs[i].seed,
                             "correct": False, "reason": f"failed: {e}"})
                continue
            scores.append(s)
            for k, v in per_cat.items():
                cats.setdefault(k, []).extend(v)
            rows.append({"benchmark": self.name, "tag": "dense", "prompt": meta["prompt"], "seed": jobs[i].seed,
                         "correct": s, "reason": ""})
        return summarize(scores, cats, failed), rows
