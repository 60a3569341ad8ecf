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
