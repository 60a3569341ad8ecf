"""CLIPScore on open_clip, in both definitions (say which one a number is):

- `clipscore_100cos`: 100 x cos(image, text), averaged (torchmetrics' definition);
- `clipscore_hessel`: 2.5 x max(cos, 0) per sample, then averaged (Hessel et al., 2021).

Any open_clip model name with a local checkpoint; the embedded default is `shapes-clip`, a small
CLIP (open_clip's own classes, config in configs/open_clip/) trained by this repo on the shapes world.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from specgen.utils.locations import config_dir

CONFIG_DIR = config_dir() / "open_clip"


def load_clip(model_name: str = "shapes-clip", checkpoint: str | None = None, device: str = "cpu"):
    """(model, preprocess, tokenizer) of an open_clip model, offline; `checkpoint` is a local file."""
    import open_clip  # deferred: it takes seconds to import, and only CLIP scoring needs it

    if (CONFIG_DIR / f"{model_name}.json").is_file():
        open_clip.add_model_config(CONFIG_DIR)
    if checkpoint is not None and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"CLIP checkpoint {checkpoint!r} not found: train the embedded one with "
                                f"`python -m specgen.train experiment=train/clip_shapes`, or give a local open_clip file")
    model, _, preprocess = open_clip.create_model_and_transforms(model_name, pretrained=checkpoint, device=device)
    return model.eval(), preprocess, open_clip.get_tokenizer(model_name)


@torch.no_grad()
def cosines(model, preprocess, tokenizer, images: list[np.ndarray], prompts: list[str], batch: int = 64) -> torch.Tensor:
    """Cosine similarity of each image with its own prompt, (N,)."""
    if len(images) != len(prompts):
        raise ValueError(f"one prompt per image: {len(images)} images, {len(prompts)} prompts")
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(images), batch):
        x = torch.stack([preprocess(Image.fromarray(im)) for im in images[i:i + batch]]).to(device)
        t = tokenizer(prompts[i:i + batch]).to(device)
        img = torch.nn.functional.normalize(model.encode_image(x).float(), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(t).float(), dim=-1)
        out.append((img * txt).sum(-1))
    return torch.cat(out)


def clip_score(cos: torch.Tensor) -> dict[str, float]:
    """Both CLIPScore definitions from per-sample cosines."""
    return {"clipscore_100cos": float(100 * cos.mean()), "clipscore_hessel": float((2.5 * cos.clamp_min(0)).mean())}


def build_clip(model_name: str = "shapes-clip"):
    """A randomly initialised open_clip model (what the CLIP training module trains and exports)."""
    return load_clip(model_name)[0].train()
