"""DataModule over the shapes world's rendered images (`specgen.world.dataset`)."""
from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from specgen.utils.validate import expect_float, expect_int
from specgen.world.dataset import ShapesImages


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
