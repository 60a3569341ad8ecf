"""Exact scene parser: pixels -> objects (shape, colour, size, box, mask, score).

Objects are saturated, the canvas is neutral grey (plain or textured), and the sampler keeps
objects apart, so foreground = saturated pixels and one connected component = one object.
Colour is a majority vote of the nearest palette colour over the component's interior (edges
of reconstructions blend with the background); shape is the best template IoU in the box.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
from scipy import ndimage, signal

from specgen.world.render import shape_mask
from specgen.world.scene import COLORS, SHAPES, SIZES, Scene

SATURATION_THRESHOLD = 45  # neutral background has 0; the least saturated shaded object ~97
_PALETTE = np.asarray(list(COLORS.values()), np.float32)  # (C, 3)
_COLOR_NAMES = list(COLORS)
_PALETTE_SAT = _PALETTE.max(1) - _PALETTE.min(1)  # (C,)


@dataclasses.dataclass
class Detection:
    shape: str
    color: str
    size: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 (exclusive), pixels
    score: float  # in [0, 1]; from the template IoU, 1 for a clean shape
    mask: np.ndarray = dataclasses.field(repr=False)

    @property
    def center(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2


@lru_cache(maxsize=None)
def _template(shape: str, side: int) -> np.ndarray:
    """Template mask of a shape whose box is exactly side x side."""
    return shape_mask(shape, (0, 0, side, side), side)


def _sides(canvas: int, any_size: bool) -> list[tuple[str, int]]:
    """(size name, template side in px) pairs: the world's two sizes, or every side from 0.15 to 0.35 of the
    canvas named by the nearest world size."""
    world = {size: round(frac * canvas) for size, frac in SIZES.items()}
    if not any_size:
        return list(world.items())
    return [(min(world, key=lambda k: abs(world[k] - side)), side)
            for side in range(round(0.15 * canvas), round(0.35 * canvas) + 1)]


def _fit_template(mask: np.ndarray, canvas: int, search: int = 2,
                  any_size: bool = False) -> tuple[str, str, tuple[int, int, int, int], float]:
    """Best (shape, size, box, IoU) over every shape at the world's two sizes and small shifts.

    The world has exactly two object sizes, so templates are matched at those sizes, placed by the
    mask's box centre and shifted by up to `search` px: a blurred small diamond is then still a
    diamond, even when its tips fall below the threshold and its own box shrinks. `any_size` also
    tries every size in between and around (for generated objects that miss both sizes).
    """
    ys, xs = np.nonzero(mask)
    cx, cy = (xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2
    area = int(mask.sum())
    pad = canvas  # zero margin so that every shifted template window lies inside the array
    padded = np.pad(mask, pad).astype(np.float32)
    best = ("circle", "small", (0, 0, 0, 0), -1.0)
    for size, side in _sides(canvas, any_size):
        x0, y0 = int(round(cx - side / 2)) - search, int(round(cy - side / 2)) - search
        window = padded[y0 + pad: y0 + pad + side + 2 * search, x0 + pad: x0 + pad + side + 2 * search]
        for shape in SHAPES:
            t = _template(shape, side)
            inter = signal.correlate(window, t.astype(np.float32), mode="valid")  # (2s+1, 2s+1) overlaps
            iou = inter / (area + int(t.sum()) - inter)
            dy, dx = np.unravel_index(int(iou.argmax()), iou.shape)
            if iou[dy, dx] > best[3]:
                best = (shape, size, (x0 + dx, y0 + dy, x0 + dx + side, y0 + dy + side), float(iou[dy, dx]))
    return best


def parse(image: np.ndarray, min_area_frac: float = 0.005, any_size: bool = False) -> list[Detection]:
    """Parse a uint8 (H, W, 3) image into detections, largest first (`any_size`: see `_fit_template`)."""
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"parse expects an (H, W, 3) uint8 image, got shape {tuple(image.shape)}")
    img = image.astype(np.float32)
    h, w, _ = img.shape
    sat = img.max(axis=2) - img.min(axis=2)  # (H, W); 0 on the neutral canvas
    fg = sat > SATURATION_THRESHOLD
    labels, n = ndimage.label(fg)
    nearest = np.argmin(((img[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1), axis=-1)  # (H, W)
    dets: list[Detection] = []
    for i in range(1, n + 1):
        mask = labels == i
        if mask.sum() < min_area_frac * h * w:
            continue
        interior = ndimage.binary_erosion(mask)
        votes = np.bincount(nearest[interior if interior.any() else mask], minlength=len(_COLOR_NAMES))
        color = int(votes.argmax())
        # blurred edges (tokenizer reconstructions): the object's outline is where saturation
        # crosses half of its colour's saturation, as for a step edge seen through a blur
        solid = mask & (sat > 0.5 * _PALETTE_SAT[color])
        mask = solid if solid.sum() >= 0.5 * mask.sum() else mask
        shape, size, box, iou = _fit_template(ndimage.binary_fill_holes(mask), w, any_size=any_size)
        # IoU >= 0.7 is a clean shape (score 1); below 0.4 it is a blob (score 0)
        score = float(np.clip((iou - 0.4) / 0.3, 0.0, 1.0))
        dets.append(Detection(shape, _COLOR_NAMES[color], size, box, score, mask))
    dets.sort(key=lambda d: -int(d.mask.sum()))
    return dets


def match_scene(scene: Scene, dets: list[Detection], canvas: int, tol: float = 3.0) -> tuple[int, int, int]:
    """Greedy match of true objects to detections by attributes and centre distance (pixels).

    Returns (matched, n_true, n_detected).
    """
    used: set[int] = set()
    matched = 0
    for obj in scene.objects:
        x0, y0, x1, y1 = obj.box(canvas)
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        for j, d in enumerate(dets):
            if j in used or (d.shape, d.color, d.size) != (obj.shape, obj.color, obj.size):
                continue
            dx, dy = d.center
            if abs(dx - cx) <= tol and abs(dy - cy) <= tol:
                used.add(j)
                matched += 1
                break
    return matched, len(scene.objects), len(dets)
