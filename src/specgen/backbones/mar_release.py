"""MAR's released class-conditional ImageNet 256x256 models (Li et al. 2024, LTH14/mar): MAR-B/L/H from a
local `checkpoint-last.pth`, with the KL-16 VAE decoder, behind the continuous protocol.

The release's module layout is `ShapesMAR` with `cond="class"` (same parameter names): a buffer of 64
slots each holding the class embedding (`fake_latent` for the unconditional branch), a bidirectional MAE
encoder over the buffer and the known tokens, a decoder with mask tokens, and the DiffLoss MLP head, over
16x16 KL-16 tokens of dimension 16 (patch size 1). Sizes (MAR's README, "Evaluation"):

    size    width  depth (encoder = decoder)  heads  DiffLoss width x depth  CFG (linear)  params
    base    768    12                         12     1024 x 6                2.9           208M
    large   1024   16                         16     1280 x 8                3.0           479M
    huge    1280   20                         16     1536 x 12               3.2           943M

Sampling (decoding config, not here): 256 generation steps, 100 DDPM steps (cosine schedule, learned
variance, x0 not clipped, as MAR's sampler), temperature 1.0, linear CFG schedule. The weights used for
evaluation are `model_ema`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specgen.backbones.loading import file_id
from specgen.backbones.mar import ShapesMAR
from specgen.tokenizers.kl16 import load_kl16

# size -> (width, encoder depth, decoder depth, heads, DiffLoss width, DiffLoss depth)
PRESETS = {"base": (768, 12, 12, 12, 1024, 6), "large": (1024, 16, 16, 16, 1280, 8),
           "huge": (1280, 20, 20, 16, 1536, 12)}
PAPER_CFG = {"base": 2.9, "large": 3.0, "huge": 3.2}  # MAR's README, with the linear schedule


def read_checkpoint(path: str | Path, key: str | None = "model_ema", allow_pickle: bool = False) -> dict:
    """The state dict under `key` of a torch checkpoint (or a .safetensors file), read with weights_only.

    MAR's checkpoints also hold the training `args` (an argparse.Namespace), allowed here as a plain record;
    anything else that needs unpickling is refused unless `allow_pickle` (trusted files only: unpickling
    runs code)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found at {str(path)!r}: download it once elsewhere and give its "
                                f"local path (e.g. generator.weights_path=/path/checkpoint-last.pth)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if allow_pickle:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    else:
        try:
            with torch.serialization.safe_globals([argparse.Namespace]):
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch names the global it refused
            raise ValueError(f"{path} cannot be read with weights_only=True ({str(e).splitlines()[0]}): if you "
                             f"trust the file, set allow_pickle=true (e.g. generator.allow_pickle=true), or "
                             f"re-save its state dict with torch.save or safetensors") from None
    if key is None:
        return ckpt
    if not isinstance(ckpt, dict) or key not in ckpt:
        found = sorted(ckpt)[:6] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise KeyError(f"{path}: no {key!r} entry (found {found}); MAR releases hold 'model_ema' and 'model'")
    return ckpt[key]


def check_state_dict(model: torch.nn.Module, sd: dict, source: str, hint: str) -> None:
    """Every parameter of `model` in `sd` with its shape, and nothing else; the error names the first bad key."""
    own = model.state_dict()
    for key, ref in own.items():
        if key not in sd:
            raise ValueError(f"{source}: no {key!r} in the checkpoint: {hint}")
        if tuple(sd[key].shape) != tuple(ref.shape):
            raise ValueError(f"{source}: {key!r} has shape {tuple(sd[key].shape)} in the checkpoint, the configured "
                             f"model has {tuple(ref.shape)}: {hint}")
    extra = sorted(set(sd) - set(own))
    if extra:
        raise ValueError(f"{source}: {len(extra)} checkpoint keys have no place in the model (first: {extra[0]!r}): "
                         f"{hint}")


def _check_sizes(sizes: tuple[int, ...], sd: dict, source: str, hint: str) -> None:
    """The widths and depths of `sizes` against the file before building the model (a MAR-H takes seconds)."""
    D, enc, dec, _, hw, hd = sizes
    expect = {"fake_latent": (1, D), "diffloss.net.input_proj.weight": (hw, None),
              f"encoder_blocks.{enc - 1}.norm1.weight": (D,), f"decoder_blocks.{dec - 1}.norm1.weight": (D,),
              f"diffloss.net.res_blocks.{hd - 1}.in_ln.weight": (hw,)}
    for key, shape in expect.items():
        if key not in sd:
            raise ValueError(f"{source}: no {key!r} in the checkpoint: {hint}")
        got = tuple(sd[key].shape)
        if any(e is not None and e != g for e, g in zip(shape, got)) or len(got) != len(shape):
            want = tuple("*" if e is None else e for e in shape)
            raise ValueError(f"{source}: {key!r} has shape {got} in the checkpoint, the configured model has {want}: "
                             f"{hint}")
    for part, depth in (("encoder_blocks", enc), ("decoder_blocks", dec), ("diffloss.net.res_blocks", hd)):
        if f"{part}.{depth}.{'in_ln' if 'res' in part else 'norm1'}.weight" in sd:
            raise ValueError(f"{source}: the checkpoint has more than {depth} {part}: {hint}")


def build_mar_release(size: str = "base", sizes: tuple[int, ...] | None = None, num_classes: int = 1000,
                      buffer_size: int = 64, grid_size: int = 16, token_dim: int = 16, sample_steps: int = 100
                      ) -> ShapesMAR:
    """A MAR of a release size (or explicit `sizes`, the PRESETS tuple), randomly initialised, in eval mode."""
    if sizes is None and size not in PRESETS:
        raise ValueError(f"unknown MAR size {size!r}: expected one of {sorted(PRESETS)} (or explicit sizes)")
    return ShapesMAR(grid_size=grid_size, token_dim=token_dim, cond="class", num_classes=num_classes,
                     buffer_size=buffer_size, sample_steps=sample_steps, variance="learned_range", x0_clip=None,
                     sizes=tuple(sizes) if sizes is not None else PRESETS[size]).eval()


def load_mar_release(weights_path: str, size: str = "base", vae_path: str | None = None,
                     sizes: tuple[int, ...] | None = None, sample_steps: int = 100, num_classes: int = 1000,
                     buffer_size: int = 64, grid_size: int = 16, token_dim: int = 16, key: str = "model_ema",
                     allow_pickle: bool = False, device: str = "cpu", vae: dict | None = None) -> ShapesMAR:
    """A released MAR (weights under `key`) with the KL-16 decoder attached when `vae_path` is given, frozen,
    in float32 (run it under torch.autocast for bf16: the sampler's tokens and noise stay float32).

    The configured size must match the file: a mismatch is refused with the first key that differs."""
    if sizes is None and size not in PRESETS:
        raise ValueError(f"unknown MAR size {size!r}: expected one of {sorted(PRESETS)} (or explicit sizes)")
    sd = read_checkpoint(weights_path, key, allow_pickle)
    what = f"sizes={tuple(sizes)}" if sizes is not None else f"size={size!r}"
    hint = (f"the file is not a MAR of {what} (grid {grid_size}, token dim {token_dim}, buffer {buffer_size}): set "
            f"generator.size to base, large or huge as the file is")
    _check_sizes(tuple(sizes) if sizes is not None else PRESETS[size], sd, str(weights_path), hint)
    model = build_mar_release(size, sizes, num_classes, buffer_size, grid_size, token_dim, sample_steps)
    check_state_dict(model, sd, str(weights_path), hint)
    model.load_state_dict(sd)
    model = model.to(device).requires_grad_(False).eval()
    ids = [file_id(weights_path)]
    if vae_path is not None:
        model.attach_tokenizer(load_kl16(vae_path, device, **(vae or {})))
        ids.append(file_id(vae_path))
    model.identity = "-".join(ids)
    return model
