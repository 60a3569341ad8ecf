"""Load shipped/exported backbones with their tokenizer, ready for decoding."""
from __future__ import annotations

import hashlib
from pathlib import Path

from specgen.backbones.hf import resolve_device_dtype
from specgen.backbones.shapes_llama import ShapesLlama
from specgen.utils.checkpoints import load_exported


def weights_id(dirpath: str | Path) -> str:
    """Identity of an exported model: a hash of its weights file."""
    if dirpath is None:
        raise ValueError("no exported model folder given (null): set it in the config, e.g. "
                         "drafter_dir=<fphi_real run>/export for experiment=eval/real_discrete")
    h = hashlib.sha1()
    with open(Path(dirpath) / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def file_id(path: str | Path) -> str:
    """Identity of released weights: a hash of the file's bytes, or of a folder's weight files (sorted by name)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pth", ".pt", ".ckpt")) \
        if path.is_dir() else [path]
    h = hashlib.sha1()
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def load_shapes_generator(backbone_dir: str, tokenizer_dir: str, device: str = "cpu", dtype: str = "float32"):
    """An embedded backbone (AR or MAR-style) with its tokenizer attached, frozen, in eval mode. `dtype`: the
    backbone's weights and states (float32, or bfloat16: on a CPU with bf16 matrix units a forward of many positions
    costs much less; the tokenizer stays in float32, and logits are float32 either way); 'auto' as the real adapters."""
    _, torch_dtype = resolve_device_dtype(device, dtype)
    backbone = load_exported(backbone_dir, device)
    if torch_dtype != next(backbone.parameters()).dtype:
        if not isinstance(backbone, ShapesLlama):
            raise ValueError(f"generator.dtype={dtype!r}: only the embedded discrete backbone runs in another "
                             f"precision than float32; drop the override for {backbone_dir}")
        backbone.to(torch_dtype)
    backbone.attach_tokenizer(load_exported(tokenizer_dir, device))
    backbone.requires_grad_(False)
    backbone.identity = f"{weights_id(backbone_dir)}-{weights_id(tokenizer_dir)}"
    return backbone
