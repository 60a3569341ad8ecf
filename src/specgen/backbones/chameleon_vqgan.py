"""The decoder half of Chameleon's VQGAN (the image tokenizer of Chameleon and Lumina-mGPT), which transformers does
not ship (it has the encoder only). Loads Meta's released files: `vqgan.yaml` (`model.params`: `embed_dim`,
`n_embed`, `ddconfig`) and `vqgan.ckpt` (a Lightning checkpoint whose `state_dict` holds `quantize.embedding.*`,
`post_quant_conv.*` and `decoder.*` in the taming-transformers layout; encoder and loss weights are ignored).

Architecture (taming-transformers' decoder): codebook lookup -> 1x1 post-quant conv -> conv_in -> middle (resnet,
attention, resnet) -> per level, from the coarsest: num_res_blocks + 1 resnets (attention at the listed
resolutions), nearest x2 upsampling and a conv except at the finest level -> GroupNorm(32), swish, conv_out.
Output in [-1, 1]. Chameleon's release: 8192 codes of 256 dims, ch 128, ch_mult (1, 1, 2, 2, 4): 16x upsampling.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class _Resnet(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class _Attention(nn.Module):
    """Single-head self-attention over the pixels of a feature map, with 1x1 convolutions."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = (f(h).flatten(2).transpose(1, 2) for f in (self.q, self.k, self.v))  # (B, HW, C)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]  # (B, HW, C)
        return x + self.proj_out(out.transpose(1, 2).reshape(B, C, H, W))


class _Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Decoder(nn.Module):
    def __init__(self, ch: int, out_ch: int, ch_mult: list[int], num_res_blocks: int, attn_resolutions: list[int],
                 resolution: int, z_channels: int, **_ignored):
        super().__init__()
        levels = len(ch_mult)
        block_in = ch * ch_mult[-1]
        res = resolution // 2 ** (levels - 1)
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1, self.mid.block_2 = (_Resnet(block_in, block_in), _Attention(block_in),
                                                               _Resnet(block_in, block_in))
        ups = []
        for level in reversed(range(levels)):  # coarsest first; stored finest first (index = level)
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            block_out = ch * ch_mult[level]
            for _ in range(num_res_blocks + 1):
                up.block.append(_Resnet(block_in, block_out))
                block_in = block_out
                if res in attn_resolutions:
                    up.attn.append(_Attention(block_in))
            if level:
                up.upsample = _Upsample(block_in)
                res *= 2
            ups.insert(0, up)
        self.up = nn.ModuleList(ups)
        self.norm_out, self.conv_out = _norm(block_in), nn.Conv2d(block_in, out_ch, 3, padding=1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(range(len(self.up))):
            up = self.up[level]
            for i, block in enumerate(up.block):
                h = block(h)
                if len(up.attn):
                    h = up.attn[i](h)
            if level:
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class ChameleonVQGANDecoder(nn.Module):
    """Codes (B, H, W) -> images (B, 3, 16H, 16W) in [-1, 1] (for the released configuration)."""

    def __init__(self, embed_dim: int, n_embed: int, ddconfig: dict):
        super().__init__()
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(n_embed, embed_dim)
        self.post_quant_conv = nn.Conv2d(embed_dim, ddconfig["z_channels"], 1)
        self.decoder = _Decoder(**ddconfig)
        self.num_codes = n_embed

    @classmethod
    def from_release(cls, folder: str | Path, device="cpu") -> "ChameleonVQGANDecoder":
        """Load `vqgan.yaml` + `vqgan.ckpt` from a folder (Meta's Chameleon release, `tokenizer/`)."""
        folder = Path(folder).expanduser()
        cfg_path, ckpt_path = folder / "vqgan.yaml", folder / "vqgan.ckpt"
        if not cfg_path.is_file() or not ckpt_path.is_file():
            raise FileNotFoundError(f"Chameleon's VQGAN needs vqgan.yaml and vqgan.ckpt in {str(folder)!r}: copy the "
                                    f"release's tokenizer/ folder there, or fix generator.vqgan_path")
        params = yaml.safe_load(cfg_path.read_text())["model"]["params"]
        net = cls(params["embed_dim"], params["n_embed"], params["ddconfig"])
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        state = state.get("state_dict", state)
        mine = net.state_dict()
        missing = [k for k in mine if k not in state]
        if missing:
            raise ValueError(f"{str(ckpt_path)!r} lacks {len(missing)} decoder weights (first: {missing[:3]}): "
                             f"not a Chameleon VQGAN checkpoint in the released format")
        net.load_state_dict({k: state[k] for k in mine})
        return net.to(device).eval().requires_grad_(False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = self.quantize.embedding(codes).permute(0, 3, 1, 2)  # (B, embed_dim, H, W)
        return self.decoder(self.post_quant_conv(z))
