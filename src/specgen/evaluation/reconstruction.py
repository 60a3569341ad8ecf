"""How well an image survives a tokenizer round trip: PSNR, and the share of its scene's objects that the exact
parser still finds."""
from __future__ import annotations

import json

import torch

from specgen.world import Scene, match_scene, parse


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR (dB) of images in [0, 1], (B, 3, H, W)."""
    mse = (a - b).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return 10 * torch.log10(1.0 / mse)


def objects_recovered(images: torch.Tensor, scenes: list[str], image_size: int) -> tuple[int, int]:
    """(objects the parser matches, objects in the scenes) for uint8 images (B, 3, S, S) and their scene JSONs."""
    matched = total = 0
    for img, scene in zip(images, scenes):
        m, n, _ = match_scene(Scene.from_dict(json.loads(scene)), parse(img.permute(1, 2, 0).cpu().numpy()), image_size)
        matched, total = matched + m, total + n
    return matched, total
