"""The world as a data set: example i of a split, rendered on the fly and reproducible from (seed, split, i)."""
from __future__ import annotations

import json
import random

import numpy as np
import torch
from torch.utils.data import Dataset

from specgen.world.prompts import sample_example
from specgen.world.render import render

# Example i of a split is drawn from Random(seed * SEED_STRIDE + i + split offset): fully reproducible.
SEED_STRIDE = 10_000_019
SPLIT_OFFSET = {"train": 0, "val": 1_000_003, "test": 2_000_003}


def example(index: int, split: str, seed: int, image_size: int, textured_frac: float,
            mix: dict[str, float] | None = None) -> tuple[dict, np.ndarray, dict]:
    """(prompt metadata, uint8 image (S, S, 3), scene dict) of one deterministic example.

    `mix` weights the tasks (default `specgen.world.prompts.DEFAULT_MIX`)."""
    rng = random.Random(seed * SEED_STRIDE + SPLIT_OFFSET[split] + index)
    meta, scene = sample_example(rng, split, image_size, mix)
    texture = "textured" if rng.random() < textured_frac else "plain"
    return meta, render(scene, image_size, texture, seed=rng.randrange(2 ** 31)), scene.to_dict()


class ShapesImages(Dataset):
    """Rendered shapes-world images, generated on the fly (nothing is stored)."""

    def __init__(self, size: int, split: str = "train", seed: int = 0, image_size: int = 64,
                 textured_frac: float = 0.0):
        self.size, self.split, self.seed = size, split, seed
        self.image_size, self.textured_frac = image_size, textured_frac

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        meta, img, scene = example(i, self.split, self.seed, self.image_size, self.textured_frac)
        return {"image": torch.from_numpy(img).permute(2, 0, 1).contiguous(),  # (3, S, S) uint8
                "scene": json.dumps(scene), "prompt": meta["prompt"]}
