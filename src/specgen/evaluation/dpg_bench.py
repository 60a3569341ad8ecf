"""DPG-Bench: dense prompts, a question graph per prompt, a VQA model answering on each of the
four crops of a 2x2 grid image.

Scoring: a question scores 1 on an exact "yes"; it is zeroed when a parent question failed; an
image scores the mean over its questions, averaged over the crops; overall = 100 x mean over
images; L1/L2 categories from the question's tuple ("entity - whole (...)" -> L1 "entity",
L2 "entity - whole").

Two modes. `official` reproduces the released script: the CSV's first data row is dropped,
zeroing follows dict order (transitive only when parents come first), category scores use the
un-zeroed answers of the last crop, and images that fail are skipped. `fixed` keeps every row,
zeroes transitively, builds categories from the zeroed answers of every crop, and counts failures.
"""
from __future__ import annotations

import csv
import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Protocol

import numpy as np

from specgen.utils.stats import mean_ci95
from specgen.world.parse import parse
from specgen.world.prompts import REGIONS

COLUMNS = ("item_id", "text", "keywords", "proposition_id", "dependency", "category_broad",
           "category_detailed", "tuple", "question_natural_language")
MODES = ("official", "fixed")


@dataclasses.dataclass
class Question:
    qid: int
    parents: list[int]
    tuple: str
    question: str

    @property
    def category(self) -> str:  # L2, e.g. "entity - whole"
        return self.tuple.split("(")[0].strip()


class VQA(Protocol):
    def answer(self, image: np.ndarray, question: Question) -> str: ...  # uint8 (H, W, 3) -> "yes" / "no" / ...


def read_prompts(folder: str | Path) -> dict[str, str]:
    """item_id -> prompt text, from the official `prompts/<item_id>.txt` folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"DPG-Bench prompt folder {str(folder)!r} not found: pass the path of the "
                                f"dpg_bench/prompts folder (one <item_id>.txt per prompt; benchmark.prompts_path)")
    prompts = {p.stem: p.read_text().strip() for p in sorted(folder.glob("*.txt"))}
    if not prompts:
        raise ValueError(f"DPG-Bench prompt folder {str(folder)!r} holds no <item_id>.txt files: pass the "
                         f"dpg_bench/prompts folder of the ELLA repository (1065 prompts; benchmark.prompts_path)")
    empty = [k for k, v in prompts.items() if not v]
    if empty:
        raise ValueError(f"DPG-Bench prompt files {[str(folder / f'{k}.txt') for k in empty[:3]]} are empty: "
                         f"each <item_id>.txt holds one prompt")
    return prompts


def read_questions(csv_path: str | Path, mode: str = "fixed") -> dict[str, list[Question]]:
    """item_id -> questions, from the official question CSV (every field read as a string)."""
    if mode not in MODES:
        raise ValueError(f"unknown DPG-Bench mode {mode!r}: expected one of {MODES}")
    path = Path(csv_path)
    if not path.is_file():
        raise FileNotFoundError(f"DPG-Bench question file {str(path)!r} not found: pass the path of dpg_bench.csv")
    out: dict[str, list[Question]] = defaultdict(list)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {list(COLUMNS)}")
        for i, row in enumerate(reader):
            if mode == "official" and i == 0:
                continue  # the released script skips the first data row
            try:
                parents = [int(d) for d in str(row["dependency"]).split(",") if d.strip()]
                out[str(row["item_id"])].append(Question(int(row["proposition_id"]), parents, row["tuple"],
                                                         row["question_natural_language"]))
            except ValueError as e:
                raise ValueError(f"{path}:{i + 2}: bad proposition_id/dependency ({e}); expected integers") from e
    return dict(out)


def crops(grid: np.ndarray, n: int = 4) -> list[np.ndarray]:
    """The first n tiles of a 2x2 grid image with no padding (H and W must be even)."""
    h, w = grid.shape[:2]
    if h % 2 or w % 2 or h != w:
        raise ValueError(f"a DPG-Bench image is a square 2x2 grid of equal tiles, got shape {grid.shape[:2]}")
    t = h // 2
    tiles = [grid[:t, :t], grid[:t, t:], grid[t:, :t], grid[t:, t:]]
    return tiles[:n]


def make_grid(images: list[np.ndarray]) -> np.ndarray:
    """Four equal uint8 tiles -> one 2x2 grid, no padding (the official layout)."""
    if len(images) != 4 or len({im.shape for im in images}) != 1:
        raise ValueError(f"a DPG-Bench grid needs 4 images of one shape, got {[im.shape for im in images]}")
    return np.concatenate([np.concatenate(images[:2], 1), np.concatenate(images[2:], 1)], 0)


def _zero(scores: dict[int, float], questions: list[Question], transitive: bool) -> dict[int, float]:
    out = dict(scores)
    if transitive:
        parents = {q.qid: [p for p in q.parents if p != 0] for q in questions}
        changed = True
        while changed:  # propagate failures down the graph until nothing changes
            changed = False
            for q in questions:
                if out[q.qid] and any(out.get(p, 1.0) == 0 for p in parents[q.qid]):
                    out[q.qid], changed = 0.0, True
    else:
        for q in questions:  # one pass in file order, like the released script
            if any(p != 0 and out.get(p, 1.0) == 0 for p in q.parents):
                out[q.qid] = 0.0
    return out


def score_image(grid: np.ndarray, questions: list[Question], vqa: VQA, mode: str = "fixed",
                num_crops: int = 4) -> tuple[float, dict[str, list[float]]]:
    """(image score in [0, 1], L2 category -> per-question scores) for one grid image."""
    crop_scores, per_cat = [], defaultdict(list)
    for tile in crops(grid, num_crops):
        raw = {q.qid: float(vqa.answer(tile, q) == "yes") for q in questions}
        zeroed = _zero(raw, questions, transitive=mode == "fixed")
        crop_scores.append(sum(zeroed.values()) / len(zeroed))
        if mode == "fixed":
            for q in questions:
                per_cat[q.category].append(zeroed[q.qid])
    if mode == "official":  # categories from the last crop's answers before zeroing
        for q in questions:
            per_cat[q.category].append(raw[q.qid])
    return float(np.mean(crop_scores)), dict(per_cat)


def summarize(image_scores: list[float], categories: dict[str, list[float]], failed: int) -> dict[str, float]:
    out = {"overall": 100.0 * float(np.mean(image_scores)) if image_scores else 0.0,
           "overall_ci95": 100.0 * mean_ci95(image_scores),  # over the prompts (0 below two)
           "num_images": float(len(image_scores)), "num_failed": float(failed)}
    l1: dict[str, list[float]] = defaultdict(list)
    for cat, vals in categories.items():
        out[f"L2/{cat}"] = 100.0 * float(np.mean(vals))
        l1[cat.split("-")[0].strip()].extend(vals)
    out.update({f"L1/{k}": 100.0 * float(np.mean(v)) for k, v in l1.items()})
    return out


# ---- the shapes world: question graphs of dense prompts, answered exactly by the parser ----------
def shapes_questions(meta: dict) -> list[Question]:
    """Question graph of a dense shapes prompt: per object, existence, then colour, size and region."""
    out: list[Question] = []
    for obj in meta["objects"]:
        s, root = obj["shape"], len(out) + 1
        out.append(Question(root, [0], f"entity - whole ({s})", f"is there a {s}?"))
        out.append(Question(root + 1, [root], f"attribute - color ({s}, {obj['color']})",
                            f"is there a {obj['color']} {s}?"))
        out.append(Question(root + 2, [root], f"attribute - size ({s}, {obj['size']})", f"is there a {obj['size']} {s}?"))
        out.append(Question(root + 3, [root], f"relation - spatial ({s}, {obj['region']})",
                            f"is there a {s} in the {obj['region']}?"))
    return out


class ShapesOracle:
    """Answers shapes-world questions from the exact parser ("yes" iff some detected object fits)."""

    def answer(self, image: np.ndarray, question: Question) -> str:
        kind = question.category
        args = [a.strip() for a in question.tuple.split("(", 1)[1].rstrip(")").split(",")]
        h, w = image.shape[:2]
        hits = [d for d in parse(image) if d.shape == args[0]]
        if kind == "attribute - color":
            hits = [d for d in hits if d.color == args[1]]
        elif kind == "attribute - size":
            hits = [d for d in hits if d.size == args[1]]
        elif kind == "relation - spatial":
            x0, y0, x1, y1 = REGIONS[args[1]]
            hits = [d for d in hits if x0 <= d.center[0] / w < x1 and y0 <= d.center[1] / h < y1]
        elif kind != "entity - whole":
            raise ValueError(f"the shapes oracle cannot answer {question.tuple!r}")
        return "yes" if hits else "no"
