"""KL autoencoder: images -> a grid of continuous latent tokens -> images (the tokenizer of MAR-style
continuous backbones). Same convolutional trunk as the VQ tokenizer; the encoder outputs a diagonal
Gaussian per position. Tokens are scaled by `scale_factor` (1 / std of training latents, measured
after training and recorded in the exported config) so that the diffusion head sees unit scale.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from specgen.tokenizers.vq import Decoder, Encoder, to_unit_range


class KLAutoencoder(nn.Module):
    def __init__(self, image_size: int = 64, ch: int = 32, mults: tuple[int, ...] = (2, 4), z_dim: int = 4,
                 scale_factor: float = 1.0):
        super().__init__()
        self.image_size, self.z_dim, self.scale_factor = image_size, z_dim, scale_factor
        self.factor = 2 ** len(mults)
        self.encoder = Encoder(ch, tuple(mults), 2 * z_dim)
        self.decoder = Decoder(ch, tuple(mults), z_dim)

    def export_config(self) -> dict:
        """Constructor values measured in training (written into the exported config)."""
        return {"scale_factor": float(self.scale_factor)}

    @property
    def grid_size(self) -> int:
        return self.image_size // self.factor

    def moments(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, logvar), each (B, z_dim, h, w), of the unscaled posterior."""
        mean, logvar = self.encoder(to_unit_range(images, self.image_size)).chunk(2, dim=1)
        return mean, logvar.clamp(-30, 20)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, sample: bool = False) -> torch.Tensor:
        """Images -> scaled latent tokens (B, h*w, z_dim), raster order (posterior mean unless `sample`)."""
        mean, logvar = self.moments(images)
        z = mean + (0.5 * logvar).exp() * torch.randn_like(mean) if sample else mean
        return (z * self.scale_factor).flatten(2).transpose(1, 2)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Scaled latent tokens (B, h*w, z_dim) -> images (B, 3, S, S) in [0, 1]."""
        B, n, d = tokens.shape
        if n != self.grid_size ** 2 or d != self.z_dim:
            raise ValueError(f"expected tokens of shape (B, {self.grid_size ** 2}, {self.z_dim}), got {tuple(tokens.shape)}")
        z = tokens.transpose(1, 2).reshape(B, d, self.grid_size, self.grid_size) / self.scale_factor
        return ((self.decoder(z) + 1) / 2).clamp(0, 1)

    def forward(self, images: torch.Tensor):
        """Training pass: (reconstruction in [-1, 1], KL per image)."""
        mean, logvar = self.moments(images)
        z = mean + (0.5 * logvar).exp() * torch.randn_like(mean)
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).flatten(1).sum(1)
        return self.decoder(z), kl
