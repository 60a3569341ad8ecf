"""PIL renderer for shapes-world scenes: plain (flat colours) or textured (noisy background, shaded objects)."""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from specgen.world.scene import COLORS, Scene, SceneObject

BACKGROUND = (220, 220, 220)


def _polygon(shape: str, box: tuple[int, int, int, int]) -> list[tuple[float, float]] | None:
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    cx, cy = x0 + w / 2, y0 + h / 2
    if shape == "triangle":
        return [(cx, y0), (x1, y1), (x0, y1)]
    if shape == "diamond":
        return [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
    if shape == "cross":  # plus sign, arms one third of the side wide
        a, b = x0 + w / 3, x0 + 2 * w / 3
        c, d = y0 + h / 3, y0 + 2 * h / 3
        return [(a, y0), (b, y0), (b, c), (x1, c), (x1, d), (b, d), (b, y1), (a, y1),
                (a, d), (x0, d), (x0, c), (a, c)]
    return None


def object_mask(obj: SceneObject, canvas: int) -> np.ndarray:
    """Boolean (canvas, canvas) mask of one object, drawn without anti-aliasing."""
    return shape_mask(obj.shape, obj.box(canvas), canvas)


def shape_mask(shape: str, box: tuple[int, int, int, int], canvas: int) -> np.ndarray:
    """Boolean (canvas, canvas) mask of a shape filling the pixel box (x0, y0, x1, y1), exclusive."""
    img = Image.new("L", (canvas, canvas), 0)
    draw = ImageDraw.Draw(img)
    x0, y0, x1, y1 = box
    poly = _polygon(shape, box)
    if shape == "circle":
        draw.ellipse([x0, y0, x1 - 1, y1 - 1], fill=255)
    elif shape == "square":
        draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=255)
    else:
        # PIL polygons include their right/bottom edge: shrink by one pixel to keep the box exact
        poly = [(min(px, x1 - 1), min(py, y1 - 1)) for px, py in poly]
        draw.polygon(poly, fill=255)
    return np.asarray(img) > 0


def _texture(rng: np.random.Generator, canvas: int) -> np.ndarray:
    """Neutral grey texture: low-frequency blotches plus fine grain, saturation 0."""
    coarse = rng.uniform(-1, 1, size=(canvas // 8 + 1, canvas // 8 + 1))
    coarse = np.asarray(Image.fromarray(coarse.astype(np.float32)).resize((canvas, canvas), Image.BICUBIC))
    grain = rng.normal(0, 1, size=(canvas, canvas))
    return np.clip(205 + 18 * coarse + 6 * grain, 170, 245)


def render(scene: Scene, canvas: int = 64, texture: str = "plain", seed: int = 0) -> np.ndarray:
    """Render a scene to a uint8 (canvas, canvas, 3) array. `texture` is 'plain' or 'textured'."""
    if texture not in ("plain", "textured"):
        raise ValueError(f"texture must be 'plain' or 'textured', got {texture!r}")
    if texture == "plain":
        img = np.empty((canvas, canvas, 3), np.float32)
        img[:] = BACKGROUND
    else:
        rng = np.random.default_rng(seed)
        img = np.repeat(_texture(rng, canvas)[..., None], 3, axis=2).astype(np.float32)
    yy, xx = np.mgrid[0:canvas, 0:canvas].astype(np.float32)
    for obj in scene.objects:
        mask = object_mask(obj, canvas)
        color = np.asarray(COLORS[obj.color], np.float32)
        if texture == "plain":
            img[mask] = color
        else:
            # light from the top left: brightness 1.08 -> 0.92 across the object, kept mild so
            # the colour stays nearest to its own palette entry
            x0, y0, x1, y1 = obj.box(canvas)
            t = ((xx - x0) / max(x1 - x0, 1) + (yy - y0) / max(y1 - y0, 1)) / 2
            shade = 1.08 - 0.16 * np.clip(t, 0, 1)
            img[mask] = np.clip(color[None, :] * shade[mask][:, None], 0, 255)
    return np.round(img).astype(np.uint8)
