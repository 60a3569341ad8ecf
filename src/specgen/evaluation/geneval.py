"""GenEval scoring rules, re-implemented over pluggable detectors.

Rules (as in the official evaluator): detections above 0.3 confidence (0.9 for every class in
counting prompts), at most 16 per class, most confident first; each include clause takes the top
`count` detections of its class and needs at least `count` of them; a colour clause needs `count`
of those to have the colour; a position clause needs every one of them to stand in the relation
to every object matched by its target clause; include clauses are ANDed, exclude clauses (`count`
or more of a class) ORed. Task score = mean over images; overall = mean of the six task scores.
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from specgen.utils.checkpoints import atomic_write_text
from specgen.world.parse import parse
from specgen.world.scene import relations

TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


@dataclasses.dataclass
class Object:
    """A detection as the rules see it."""

    cls: str
    box: tuple[float, float, float, float]  # x0, y0, x1, y1
    score: float
    color: str | None = None  # filled by the detector or by a colour classifier


class Detector(Protocol):
    def detect(self, image: np.ndarray) -> list[Object]: ...  # uint8 (H, W, 3)


class ShapesDetector:
    """The exact shapes-world parser as a GenEval detector (classes are shape names). `any_size` fits shape
    templates at every size, not only the world's two (a check of how much the two-size fit costs generated
    images whose objects miss both sizes)."""

    def __init__(self, any_size: bool = False):
        self.any_size = any_size

    def detect(self, image: np.ndarray) -> list[Object]:
        return [Object(d.shape, tuple(float(v) for v in d.box), d.score, d.color)
                for d in parse(image, any_size=self.any_size)]


@dataclasses.dataclass(frozen=True)
class Thresholds:
    detection: float = 0.3
    counting: float = 0.9
    max_objects: int = 16
    position: float = 0.1  # centre offset shrink, x summed box sizes


def group_by_class(objects: list[Object], tag: str, th: Thresholds = Thresholds()) -> dict[str, list[Object]]:
    """Per class: objects above the task's threshold, most confident first, at most max_objects."""
    limit = th.counting if tag == "counting" else th.detection
    out: dict[str, list[Object]] = defaultdict(list)
    for o in sorted(objects, key=lambda o: -o.score):
        if o.score > limit and len(out[o.cls]) < th.max_objects:
            out[o.cls].append(o)
    return dict(out)


def evaluate(objects: list[Object], meta: dict, th: Thresholds = Thresholds()) -> tuple[bool, str]:
    """Score one image against its GenEval metadata: (correct, reason)."""
    found = group_by_class(objects, meta["tag"], th)
    correct, reasons, matched = True, [], []
    for req in meta.get("include", []):
        cls, n = req["class"], req["count"]
        top = found.get(cls, [])[:n]
        ok = len(top) >= n
        if not ok:
            reasons.append(f"expected {cls}>={n}, found {len(top)}")
        if ok and "color" in req:
            hits = sum(o.color == req["color"] for o in top)
            if hits < n:
                ok = False
                reasons.append(f"expected {req['color']} {cls}>={n}, found {hits} {req['color']}")
        if ok and "position" in req:
            rel, target = req["position"]
            if matched[target] is None:
                ok = False
                reasons.append(f"no target for {cls} to be {rel}")
            elif not all(rel in relations(o.box, t.box, shrink=th.position) for o in top for t in matched[target]):
                ok = False
                reasons.append(f"expected {cls} {rel} target")
        matched.append(top if ok else None)
        correct &= ok
    for req in meta.get("exclude", []):
        if len(found.get(req["class"], [])) >= req["count"]:
            correct = False
            reasons.append(f"expected {req['class']}<{req['count']}, found {len(found[req['class']])}")
    return correct, "; ".join(reasons)


def summarize(results: list[dict]) -> dict[str, float]:
    """Task scores (mean over images) and overall (mean of the tasks present) from per-image results."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in results:
        by_task[r["tag"]].append(float(r["correct"]))
    scores = {t: float(np.mean(v)) for t, v in by_task.items() if t in TASKS}
    if scores:
        scores["overall"] = float(np.mean(list(scores.values())))
        # 95% interval half-width of the overall score (binomial per task, tasks independent)
        var = sum(scores[t] * (1 - scores[t]) / len(by_task[t]) for t in scores if t != "overall")
        scores["overall_ci95"] = float(1.96 * np.sqrt(var) / (len(scores) - 1))
    return scores


def paired_difference(results: list[dict], reference: list[dict]) -> dict[str, float]:
    """GenEval overall of `results` minus that of `reference`, over the images both scored (the same task, prompt,
    sample and seed: a side-by-side run's), with the 95% interval of the paired difference: per task the mean of
    per-image differences (variance: their sample variance / n), overall the mean over tasks (tasks independent).
    Where the two strategies' outcomes on an image correlate (a prompt's own difficulty), the interval is tighter
    than an unpaired difference's. Returns {} when no image pairs up; `diff_pairs` counts the pairs."""
    key = lambda r: (r["tag"], r["prompt"], int(r["sample"]), int(r["seed"]))  # noqa: E731
    ref = {key(r): float(r["correct"]) for r in reference if r["tag"] in TASKS}
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in results:
        if r["tag"] in TASKS and key(r) in ref:
            by_task[r["tag"]].append(float(r["correct"]) - ref[key(r)])
    if not by_task:
        return {}
    diffs = [np.mean(d) for d in by_task.values()]
    var = sum(np.var(d, ddof=1) / len(d) for d in by_task.values() if len(d) > 1)
    return {"overall_diff": float(np.mean(diffs)), "overall_diff_ci95": float(1.96 * np.sqrt(var) / len(diffs)),
            "diff_pairs": float(sum(len(d) for d in by_task.values()))}


def is_plain_prompts(path: str | Path) -> bool:
    """A text file of one prompt a line (not .jsonl, its first line not a JSON object)."""
    path = Path(path)
    if path.suffix == ".jsonl" or not path.is_file():
        return False
    first = next((line for line in path.read_text().splitlines() if line.strip()), "")
    return not first.lstrip().startswith("{")


def _empty(path: Path):
    raise ValueError(f"prompts file {str(path)!r} holds no prompts (it is empty)")


def read_metadata(path: str | Path) -> list[dict]:
    """Read an official `evaluation_metadata.jsonl`, naming the line of any malformed entry; a plain text file of
    prompts (one a line) gives entries of tag "prompts" with no objects (written, never scored)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GenEval metadata file {str(path)!r} not found: pass the path of "
                                f"evaluation_metadata.jsonl from the GenEval repository (prompts/ folder)")
    out = []
    if is_plain_prompts(path):  # one prompt a line: images only, no GenEval tags or objects to score them by
        return [{"tag": "prompts", "include": [], "prompt": line.strip()}
                for line in path.read_text().splitlines() if line.strip()] or _empty(path)
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            meta = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from e
        missing = [k for k in ("tag", "include", "prompt") if k not in meta]
        if missing:
            raise ValueError(f"{path}:{lineno}: GenEval metadata lacks {missing}; expected keys tag, include, prompt")
        out.append(meta)
    if not out:
        raise ValueError(f"GenEval metadata file {str(path)!r} holds no prompts (it is empty): pass the "
                         f"evaluation_metadata.jsonl of the GenEval repository, one JSON object per line")
    return out


def write_official_layout(root: str | Path, items: list[tuple[dict, list[np.ndarray]]]) -> Path:
    """Write images in the official evaluator's layout: <root>/<NNNNN>/metadata.jsonl (one JSON object)
    and <root>/<NNNNN>/samples/<NNNN>.png, one folder per prompt in the given order."""
    root = Path(root)
    for i, (meta, images) in enumerate(items):
        folder = root / f"{i:05d}"
        (folder / "samples").mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "metadata.jsonl", json.dumps(meta) + "\n")
        for k, img in enumerate(images):
            Image.fromarray(np.asarray(img, dtype=np.uint8)).save(folder / "samples" / f"{k:04d}.png")
    return root


def read_official_layout(root: str | Path) -> list[tuple[dict, list[np.ndarray]]]:
    """Read a folder in the official layout back (only .png samples, as the official evaluator does)."""
    root = Path(root)
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit()):
        meta_file = folder / "metadata.jsonl"
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{meta_file}: expected one JSON object with the prompt's metadata ({e})") from e
        images = [np.asarray(Image.open(p).convert("RGB")) for p in sorted((folder / "samples").glob("*.png"))]
        out.append((meta, images))
    return out


def score_folder(root: str | Path, detector: Detector | None = None, th: Thresholds = Thresholds()) -> dict[str, float]:
    """GenEval scores of a folder in the official layout, with the given detector (default: the shapes parser)."""
    detector = detector or ShapesDetector()
    rows = [{"tag": meta["tag"], "correct": evaluate(detector.detect(img), meta, th)[0]}
            for meta, images in read_official_layout(root) for img in images]
    return summarize(rows)
