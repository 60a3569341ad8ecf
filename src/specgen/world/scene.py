"""Scenes of the shapes world: a few coloured shapes on a canvas, and a seeded sampler."""
from __future__ import annotations

import dataclasses
import random
from typing import Iterable, Sequence

# The closed world. Colours are the GenEval colours that stay distinct under shading and
# against a neutral background (black and white are left out: they collide with the grey canvas).
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")
PLURALS: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles",
                           "diamond": "diamonds", "cross": "crosses"}
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "orange": (255, 140, 0), "yellow": (240, 220, 20),
    "green": (30, 160, 50), "blue": (30, 70, 220), "purple": (130, 40, 180),
    "pink": (255, 105, 180), "brown": (130, 75, 25),
}
# Object side as a fraction of the canvas side: 12 px and 20 px on the default 64 px canvas.
SIZES: dict[str, float] = {"small": 0.1875, "large": 0.3125}
MAX_OBJECTS = 4
# Minimum gap between object boxes, as a fraction of the canvas (4 px at 64): keeps objects
# apart after tokenizer reconstruction, so the parser never merges two of them.
MIN_GAP = 0.0625


@dataclasses.dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str
    size: str
    cx: float  # centre, as a fraction of the canvas width
    cy: float  # centre, as a fraction of the canvas height

    def box(self, canvas: int) -> tuple[int, int, int, int]:
        """Pixel box (x0, y0, x1, y1), exclusive upper corner."""
        side = round(SIZES[self.size] * canvas)
        x0 = round(self.cx * canvas - side / 2)
        y0 = round(self.cy * canvas - side / 2)
        return x0, y0, x0 + side, y0 + side


@dataclasses.dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]

    def to_dict(self) -> dict:
        return {"objects": [dataclasses.asdict(o) for o in self.objects]}

    @staticmethod
    def from_dict(d: dict) -> "Scene":
        return Scene(tuple(SceneObject(**o) for o in d["objects"]))


def check_words(shape: str | None = None, color: str | None = None, size: str | None = None) -> None:
    """Raise a ValueError naming any word outside the world's closed vocabulary."""
    for value, known, kind in ((shape, SHAPES, "shape"), (color, COLORS, "colour"), (size, SIZES, "size")):
        if value is not None and value not in known:
            raise ValueError(f"unknown {kind} {value!r}: the shapes world knows {sorted(known)}; "
                             f"use one of these words")


def _boxes_apart(a: SceneObject, b: SceneObject, canvas: int) -> bool:
    ax0, ay0, ax1, ay1 = a.box(canvas)
    bx0, by0, bx1, by1 = b.box(canvas)
    gap = MIN_GAP * canvas
    return ax1 + gap <= bx0 or bx1 + gap <= ax0 or ay1 + gap <= by0 or by1 + gap <= ay0


def place(specs: Sequence[dict], rng: random.Random, canvas: int = 64,
          regions: Sequence[tuple[float, float, float, float] | None] | None = None,
          relation=None, tries: int = 2000) -> Scene:
    """Place objects given as dicts (shape, color, size) at random, non-overlapping positions.

    `regions[i]` optionally bounds object i's centre to (x0, y0, x1, y1) in canvas fractions;
    `relation(objects) -> bool` is an extra constraint (e.g. a GenEval position relation).
    """
    if len(specs) > MAX_OBJECTS:
        raise ValueError(f"a scene holds at most {MAX_OBJECTS} objects, got {len(specs)}")
    for _ in range(tries):
        objs: list[SceneObject] = []
        for i, spec in enumerate(specs):
            half = SIZES[spec["size"]] / 2 + 1.0 / canvas
            lo_x, lo_y, hi_x, hi_y = half, half, 1 - half, 1 - half
            if regions is not None and regions[i] is not None:
                # one pixel inside the region: pixel rounding of the box must not move the centre out
                rx0, ry0, rx1, ry1 = (v + d / canvas for v, d in zip(regions[i], (1, 1, -1, -1)))
                lo_x, lo_y, hi_x, hi_y = max(lo_x, rx0), max(lo_y, ry0), min(hi_x, rx1), min(hi_y, ry1)
                if lo_x > hi_x or lo_y > hi_y:
                    break
            for _ in range(50):
                obj = SceneObject(spec["shape"], spec["color"], spec["size"],
                                  rng.uniform(lo_x, hi_x), rng.uniform(lo_y, hi_y))
                if all(_boxes_apart(obj, o, canvas) for o in objs):
                    objs.append(obj)
                    break
            else:
                break
        if len(objs) == len(specs) and (relation is None or relation(objs)):
            return Scene(tuple(objs))
    raise RuntimeError(f"could not place {len(specs)} objects on a {canvas}px canvas after {tries} tries")


def random_specs(n: int, rng: random.Random, shapes: Iterable[str] = SHAPES) -> list[dict]:
    """n objects with random shape, colour and size."""
    shapes = list(shapes)
    return [{"shape": rng.choice(shapes), "color": rng.choice(list(COLORS)), "size": rng.choice(list(SIZES))}
            for _ in range(n)]


def sample_scene(rng: random.Random, canvas: int = 64) -> Scene:
    """An unconstrained random scene of 1 to MAX_OBJECTS objects."""
    n = rng.randint(1, MAX_OBJECTS)
    while True:
        try:
            return place(random_specs(n, rng), rng, canvas)
        except RuntimeError:  # four large objects may not fit: draw new sizes
            continue


def relations(box_a: Sequence[float], box_b: Sequence[float], threshold: float = 0.5,
              shrink: float = 0.1) -> set[str]:
    """GenEval's relative position of box A to box B (xyxy boxes).

    The centre offset is shrunk by `shrink` x the summed box sizes, normalised by the offset's
    length, and each axis compared with +-`threshold` (GenEval: shrink 0.1, threshold 0.5).
    """
    ax0, ay0, ax1, ay1 = box_a[:4]
    bx0, by0, bx1, by1 = box_b[:4]
    off_x, off_y = (ax0 + ax1 - bx0 - bx1) / 2, (ay0 + ay1 - by0 - by1) / 2
    dims_x, dims_y = abs(ax1 - ax0) + abs(bx1 - bx0), abs(ay1 - ay0) + abs(by1 - by0)
    rx = max(abs(off_x) - shrink * dims_x, 0.0) * (1 if off_x > 0 else -1 if off_x < 0 else 0)
    ry = max(abs(off_y) - shrink * dims_y, 0.0) * (1 if off_y > 0 else -1 if off_y < 0 else 0)
    if abs(rx) < 1e-3 and abs(ry) < 1e-3:
        return set()
    norm = (off_x ** 2 + off_y ** 2) ** 0.5
    dx, dy = rx / norm, ry / norm
    out = set()
    if dx < -threshold:
        out.add("left of")
    if dx > threshold:
        out.add("right of")
    if dy < -threshold:
        out.add("above")
    if dy > threshold:
        out.add("below")
    return out
