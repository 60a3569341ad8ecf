"""The decoder half of MAR's KL-16 VAE (the latent-diffusion KL autoencoder, `kl16.ckpt`), written here so
that MAR's and xAR's released latents decode without their code.

Layout (LDM's `Decoder`, parameter names as in the released state dict, under its "model" entry):
post_quant_conv (1x1, z -> z), decoder.conv_in (3x3, z -> ch x mults[-1]), decoder.mid.{block_1, attn_1,
block_2}, then from the lowest resolution up, `decoder.up.{level}` (level = len(mults)-1 ... 0) with
`num_res_blocks + 1` ResNet blocks (norm1, conv1, norm2, conv2, nin_shortcut when the width changes) and a
nearest-neighbour x2 upsample + 3x3 conv except at level 0, then decoder.norm_out (GroupNorm 32) and conv_out.
The release decoder has attention only in the middle. Defaults are the release's: ch 128, mults
(1, 1, 2, 2, 4), 2 ResNet blocks per level, 16 latent channels, 256-pixel images (16x16 latents), tokens
scaled by 0.2325 (MAR's `vae_scale_factor`: decode divides by it).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from specgen.utils.validate import expect_int


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class ResnetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2, self.conv2 = _norm(c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        if c_in != c_out:
            self.nin_shortcut = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the pixels, q/k/v/proj_out as 1x1 convolutions."""

    def __init__(self, c: int):
        super().__init__()
        self.norm = _norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = (m(h).flatten(2).transpose(1, 2) for m in (self.q, self.k, self.v))  # (B, HW, C) each
        out = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(C)) v
        return x + self.proj_out(out.transpose(1, 2).reshape(B, C, H, W))


class _Up(nn.Module):
    def __init__(self, c_in: int, c_out: int, blocks: int, upsample: bool):
        super().__init__()
        self.block = nn.ModuleList([ResnetBlock(c_in if j == 0 else c_out, c_out) for j in range(blocks)])
        self.attn = nn.ModuleList()  # empty in the release (kept for the layout)
        if upsample:
            self.upsample = nn.Module()
            self.upsample.conv = nn.Conv2d(c_out, c_out, 3, padding=1)


class Decoder(nn.Module):
    def __init__(self, ch: int = 128, mults: tuple[int, ...] = (1, 1, 2, 2, 4), num_res_blocks: int = 2,
                 z_channels: int = 16, out_channels: int = 3):
        super().__init__()
        c = ch * mults[-1]
        self.conv_in = nn.Conv2d(z_channels, c, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1, self.mid.block_2 = ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)
        ups = []
        for level in reversed(range(len(mults))):
            ups.insert(0, _Up(c, ch * mults[level], num_res_blocks + 1, upsample=level != 0))
            c = ch * mults[level]
        self.up = nn.ModuleList(ups)  # up[0] is the full-resolution level, run last
        self.norm_out, self.conv_out = _norm(c), nn.Conv2d(c, out_channels, 3, padding=1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(range(len(self.up))):
            for blk in self.up[level].block:
                h = blk(h)
            if hasattr(self.up[level], "upsample"):
                h = self.up[level].upsample.conv(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.conv_out(F.silu(self.norm_out(h)))


class KL16Decoder(nn.Module):
    """Scaled latent tokens (B, h*w, z) in raster order -> images (B, 3, S, S) in [0, 1]."""

    def __init__(self, image_size: int = 256, ch: int = 128, mults: tuple[int, ...] = (1, 1, 2, 2, 4),
                 num_res_blocks: int = 2, z_dim: int = 16, scale_factor: float = 0.2325):
        super().__init__()
        self.image_size, self.z_dim, self.scale_factor = image_size, z_dim, scale_factor
        self.factor = 2 ** (len(mults) - 1)  # 16 for the release
        if image_size % self.factor:
            raise ValueError(f"image_size={image_size} must be a multiple of the decoder's factor {self.factor}")
        self.post_quant_conv = nn.Conv2d(z_dim, z_dim, 1)
        self.decoder = Decoder(ch, tuple(mults), num_res_blocks, z_dim)

    @property
    def grid_size(self) -> int:
        return self.image_size // self.factor

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        B, n, d = tokens.shape
        g = self.grid_size
        if (n, d) != (g * g, self.z_dim):
            raise ValueError(f"expected tokens of shape (B, {g * g}, {self.z_dim}), got {tuple(tokens.shape)}")
        z = tokens.transpose(1, 2).reshape(B, d, g, g) / self.scale_factor  # (B, z, g, g), unscaled
        w = self.post_quant_conv.weight
        images = self.decoder(self.post_quant_conv(z.to(w.device, w.dtype)))
        return ((images.float() + 1) / 2).clamp(0, 1)


def load_kl16(path: str | Path, device: str = "cpu", **sizes) -> KL16Decoder:
    """The KL-16 decoder from a released checkpoint (`torch.load(path)["model"]`, weights_only), frozen.

    Only `decoder.*` and `post_quant_conv.*` are read (the encoder is not needed to generate); every one of
    them must be there with the expected shape, else the error names the first bad key."""
    for k, v in sizes.items():
        if k in ("image_size", "ch", "num_res_blocks", "z_dim"):
            expect_int(f"vae.{k}", v, 1)
    model = KL16Decoder(**sizes)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"KL-16 VAE checkpoint not found at {str(path)!r}: give the local kl16.ckpt of MAR's "
                                f"release (util/download.py there fetches it), e.g. generator.vae_path=/path/kl16.ckpt")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    sd = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: expected a state dict (or one under 'model'), got {type(ckpt).__name__}")
    own = model.state_dict()
    for key, ref in own.items():
        if key not in sd:
            raise ValueError(f"{path}: no {key!r} in the checkpoint: not a KL-16 VAE of this layout (ch, mults, "
                             f"num_res_blocks, z_dim; the release: 128, (1, 1, 2, 2, 4), 2, 16)")
        if tuple(sd[key].shape) != tuple(ref.shape):
            raise ValueError(f"{path}: {key!r} has shape {tuple(sd[key].shape)}, this decoder expects {tuple(ref.shape)}: "
                             f"set the vae sizes (ch, mults, num_res_blocks, z_dim) to the checkpoint's")
    model.load_state_dict({k: sd[k] for k in own})
    return model.to(device).eval().requires_grad_(False)
