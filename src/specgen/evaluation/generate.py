"""Generate images for (prompt, seed) jobs with a decoding strategy, cached on disk.

The cache folder is keyed by (backbone weights, tokenizer weights, decoding config): each image is
`<sha(prompt, seed)>.png` with its per-image statistics in a `.json` beside it, both written
atomically, so a rerun reuses finished images and an interrupted run resumes with the missing ones.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from specgen.decoding.sampling import make_rngs
from specgen.utils.checkpoints import atomic_write_text


@dataclasses.dataclass(frozen=True)
class Job:
    prompt: str
    seed: int
    meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    sample: int = dataclasses.field(default=0, compare=False)  # index among its prompt's samples

    @property
    def key(self) -> str:
        return hashlib.sha1(json.dumps([self.prompt, self.seed]).encode()).hexdigest()[:16]


def job_seed(base: int, prompt: str, index: int) -> int:
    """A per-image seed that depends only on (base seed, prompt, sample index)."""
    return int(hashlib.sha1(f"{base}|{prompt}|{index}".encode()).hexdigest()[:8], 16)


def cache_key(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _save_png(path: Path, image: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".png")
    os.close(fd)
    Image.fromarray(image).save(tmp, format="PNG")
    os.chmod(tmp, 0o644)  # mkstemp creates 0600 files
    os.replace(tmp, path)


def decode_batch(backbone, decode_fn: Callable, prompts: list[str], seeds: list[int],
                 timed: bool = True) -> tuple[np.ndarray, torch.Tensor, list[dict]]:
    """One batch through a strategy: uint8 images (B, S, S, 3), the backbone's codes, and per-image stats (plain
    Python values; with `timed`, the batch's wall clock and its share per image). The evaluation's image cache and
    `specgen.generate` both decode through here, so an image depends only on (prompt, seed, strategy, batch)."""
    encoded = backbone.prompts(list(prompts))
    t0 = time.perf_counter()
    codes, stats = decode_fn(backbone, encoded, rngs=make_rngs(seeds, backbone.device))
    images = backbone.decode(codes)
    if images.is_cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    images = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    per_image = []
    for b in range(len(prompts)):
        one = {k: (v[b].tolist() if torch.is_tensor(v) and v.ndim > 0 else float(v) if torch.is_tensor(v) else v)
               for k, v in stats.items()}
        one.update(batch_size=len(prompts))
        if timed:
            one.update(batch_wall_s=wall, latency_s=wall / len(prompts))
        per_image.append(one)
    return images, codes, per_image


def generate_images(jobs: list[Job], backbone, decode_fn: Callable, cache_dir: str | Path, batch_size: int = 32,
                    desc: str = "generating", progress: bool = True, timed: bool = True,
                    note: dict | None = None) -> tuple[list[np.ndarray], list[dict]]:
    """Images (uint8 (S, S, 3)) and per-image stats for every job, generating only the missing ones.

    `timed=False` leaves the wall-clock fields out of the stats (processes sharing a machine time nothing
    honestly); `note` is written beside the stats in each image's .json (e.g. the rank that made it)."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    todo = [j for j in jobs if not (cache_dir / f"{j.key}.png").is_file() or not (cache_dir / f"{j.key}.json").is_file()]
    bar = tqdm(total=len(todo), desc=desc, unit="img", disable=not (todo and progress))
    for start in range(0, len(todo), batch_size):
        batch = todo[start:start + batch_size]
        images, _, per_image = decode_batch(backbone, decode_fn, [j.prompt for j in batch], [j.seed for j in batch],
                                            timed=timed)
        for b, job in enumerate(batch):
            _save_png(cache_dir / f"{job.key}.png", images[b])
            atomic_write_text(cache_dir / f"{job.key}.json", json.dumps(
                {"prompt": job.prompt, "seed": job.seed, "stats": per_image[b], **(note or {})}))
        bar.update(len(batch))
    bar.close()
    out_images, out_stats = [], []
    for j in jobs:
        out_images.append(np.asarray(Image.open(cache_dir / f"{j.key}.png").convert("RGB")))
        out_stats.append(json.loads((cache_dir / f"{j.key}.json").read_text())["stats"])
    return out_images, out_stats


def image_grid(images: list[np.ndarray], ncols: int, pad: int = 2, scale: int = 2) -> np.ndarray:
    """Tile uint8 (S, S, 3) images into one uint8 grid (white padding), upscaled by `scale`."""
    s = images[0].shape[0]
    nrows = -(-len(images) // ncols)
    grid = np.full((nrows * (s + pad) + pad, ncols * (s + pad) + pad, 3), 255, np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, ncols)
        grid[pad + r * (s + pad): pad + r * (s + pad) + s, pad + c * (s + pad): pad + c * (s + pad) + s] = img
    return grid.repeat(scale, 0).repeat(scale, 1)
