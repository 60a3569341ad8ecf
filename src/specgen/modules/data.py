"""DataModules over the shapes world: rendered images, and tokenized (prompt, image-code) sequences."""
from __future__ import annotations

import json
import random

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from specgen.utils.validate import expect_float, expect_int
from specgen.world import render, sample_example

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


class ShapesImageDataModule(L.LightningDataModule):
    def __init__(self, image_size: int = 64, train_size: int = 200_000, val_size: int = 512,
                 batch_size: int = 32, textured_frac: float = 0.25, num_workers: int = 0, seed: int = 0):
        super().__init__()
        expect_int("data.image_size", image_size, 8)
        expect_int("data.batch_size", batch_size, 1)
        expect_float("data.textured_frac", textured_frac, 0.0, 1.0)
        self.save_hyperparameters()

    def _loader(self, split: str, size: int, shuffle: bool):
        h = self.hparams
        ds = ShapesImages(size, split, h.seed, h.image_size, h.textured_frac)
        return DataLoader(ds, batch_size=h.batch_size, shuffle=shuffle, num_workers=h.num_workers,
                          persistent_workers=h.num_workers > 0)

    def train_dataloader(self):
        return self._loader("train", self.hparams.train_size, True)

    def val_dataloader(self):
        return self._loader("val", self.hparams.val_size, False)
