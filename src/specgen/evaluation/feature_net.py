"""A small convolutional classifier of shapes-world images: the embedded feature extractor for
FID / KID / precision-recall (its penultimate features) and IS (its class logits).

Targets: the (shape, colour) class of the largest object (softmax head: IS needs a categorical
distribution) and which (shape, colour) pairs are present (multi-label head: richer features).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specgen.world.scene import COLORS, SHAPES

NUM_CLASSES = len(SHAPES) * len(COLORS)


def class_index(shape: str, color: str) -> int:
    return SHAPES.index(shape) * len(COLORS) + list(COLORS).index(color)


class ShapesFeatureNet(nn.Module):
    def __init__(self, image_size: int = 64, width: int = 32, feature_dim: int = 128):
        super().__init__()
        self.image_size, self.feature_dim = image_size, feature_dim
        c = width
        self.body = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(8, c), nn.SiLU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * c), nn.SiLU(),
            nn.Conv2d(2 * c, 4 * c, 3, stride=2, padding=1), nn.GroupNorm(8, 4 * c), nn.SiLU(),
            nn.Conv2d(4 * c, 4 * c, 3, stride=2, padding=1), nn.GroupNorm(8, 4 * c), nn.SiLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * c, feature_dim), nn.SiLU())
        self.main_head = nn.Linear(feature_dim, NUM_CLASSES)  # largest object's (shape, colour)
        self.present_head = nn.Linear(feature_dim, NUM_CLASSES)  # every (shape, colour) in the scene

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """uint8 or [0, 1] float (B, 3, S, S) -> (features (B, F), main logits, present logits)."""
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        feats = self.body(x * 2 - 1)
        return feats, self.main_head(feats), self.present_head(feats)
