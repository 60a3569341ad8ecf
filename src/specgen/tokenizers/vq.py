"""Convolutional VQ autoencoder: images -> a grid of discrete codes -> images.

Downsampling factor 2**len(mults); the codebook is l2-normalised (cosine lookup), updated by
EMA, with dead codes restarted from the batch, which keeps small codebooks fully used on CPU.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.net = nn.Sequential(nn.GroupNorm(8, ch), nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1),
                                 nn.GroupNorm(8, ch), nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1))

    def forward(self, x):
        return x + self.net(x)


class Encoder(nn.Module):
    def __init__(self, ch: int, mults: tuple[int, ...], z_dim: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, ch, 3, padding=1)]
        c = ch
        for m in mults:
            layers += [ResBlock(c), nn.Conv2d(c, ch * m, 4, stride=2, padding=1)]
            c = ch * m
        layers += [ResBlock(c), nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, z_dim, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self, ch: int, mults: tuple[int, ...], z_dim: int):
        super().__init__()
        c = ch * mults[-1]
        layers: list[nn.Module] = [nn.Conv2d(z_dim, c, 3, padding=1), ResBlock(c)]
        for m in reversed((1,) + tuple(mults[:-1])):
            layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, ch * m, 3, padding=1), ResBlock(ch * m)]
            c = ch * m
        layers += [nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, z):
        return self.net(z)


class CosineEMAQuantizer(nn.Module):
    """Nearest code by cosine similarity; codebook updated by EMA of assigned (normalised) inputs."""

    def __init__(self, num_codes: int, dim: int, decay: float = 0.99, dead_after: int = 50):
        super().__init__()
        self.decay, self.dead_after = decay, dead_after
        self.register_buffer("codebook", F.normalize(torch.randn(num_codes, dim), dim=1))
        self.register_buffer("ema_sum", self.codebook.clone())
        self.register_buffer("ema_count", torch.ones(num_codes))
        self.register_buffer("idle_steps", torch.zeros(num_codes))

    def lookup(self, z: torch.Tensor) -> torch.Tensor:
        """(B, D, h, w) -> codes (B, h, w)."""
        flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]), dim=1)  # (N, D)
        return (flat @ self.codebook.t()).argmax(1).view(z.shape[0], z.shape[2], z.shape[3])

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> (B, D, h, w)."""
        return self.codebook[codes].permute(0, 3, 1, 2)

    def forward(self, z: torch.Tensor):
        zn = F.normalize(z, dim=1)
        codes = self.lookup(zn)
        q = self.embed(codes)
        commit = F.mse_loss(zn, q.detach())
        if self.training:
            self._ema_update(zn.detach(), codes)
        q = zn + (q - zn).detach()  # straight-through
        return q, codes, commit

    @torch.no_grad()
    def _ema_update(self, zn: torch.Tensor, codes: torch.Tensor):
        flat = zn.permute(0, 2, 3, 1).reshape(-1, zn.shape[1])
        onehot = F.one_hot(codes.view(-1), self.codebook.shape[0]).type_as(flat)  # (N, K)
        counts = onehot.sum(0)
        self.ema_count.mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.ema_sum.mul_(self.decay).add_(onehot.t() @ flat, alpha=1 - self.decay)
        self.codebook.copy_(F.normalize(self.ema_sum, dim=1))
        self.idle_steps.add_(1).mul_((counts == 0).float())
        dead = (self.idle_steps > self.dead_after).nonzero().view(-1)
        if len(dead):  # restart dead codes on random batch vectors
            pick = flat[torch.randint(0, flat.shape[0], (len(dead),), device=flat.device)]
            self.codebook[dead] = pick
            self.ema_sum[dead] = pick
            self.ema_count[dead] = 1.0
            self.idle_steps[dead] = 0


def to_unit_range(x: torch.Tensor, image_size: int) -> torch.Tensor:
    """Validate (B, 3, S, S) uint8 or [0, 1] images and map them to [-1, 1]."""
    if x.ndim != 4 or x.shape[1] != 3 or x.shape[2] != image_size or x.shape[3] != image_size:
        raise ValueError(f"the tokenizer expects images of shape (B, 3, {image_size}, {image_size}), "
                         f"got {tuple(x.shape)}: resize to {image_size}x{image_size} or use a "
                         f"tokenizer trained at that resolution")
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    return x * 2 - 1


class VQAutoencoder(nn.Module):
    """Images in [0, 1], (B, 3, S, S) <-> codes (B, S/f, S/f) with f = 2**len(mults)."""

    def __init__(self, image_size: int = 64, ch: int = 32, mults: tuple[int, ...] = (2, 4),
                 z_dim: int = 16, num_codes: int = 512, ema_decay: float = 0.99):
        super().__init__()
        self.image_size, self.num_codes = image_size, num_codes
        self.factor = 2 ** len(mults)
        self.encoder = Encoder(ch, tuple(mults), z_dim)
        self.quantizer = CosineEMAQuantizer(num_codes, z_dim, ema_decay)
        self.decoder = Decoder(ch, tuple(mults), z_dim)

    @property
    def grid_size(self) -> int:
        return self.image_size // self.factor

    def _check(self, x: torch.Tensor) -> torch.Tensor:
        return to_unit_range(x, self.image_size)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) uint8 or float in [0, 1] -> codes (B, h, w) long."""
        return self.quantizer.lookup(self.encoder(self._check(images)))

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> images (B, 3, S, S) float in [0, 1]."""
        if codes.min() < 0 or codes.max() >= self.num_codes:
            raise ValueError(f"codes must lie in [0, {self.num_codes}), got range "
                             f"[{int(codes.min())}, {int(codes.max())}]")
        return ((self.decoder(self.quantizer.embed(codes)) + 1) / 2).clamp(0, 1)

    def forward(self, images: torch.Tensor):
        """Training pass: returns (reconstruction in [-1, 1], codes, commitment loss)."""
        q, codes, commit = self.quantizer(self.encoder(self._check(images)))
        return self.decoder(q), codes, commit
