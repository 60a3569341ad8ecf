"""What the teacher stage of drafter distillation will cost on this machine, measured before it starts.

A few timed steps on the backbone itself: AR decoding steps (one token per row, CFG rows included, at a KV cache
half an image long, where a step costs about the average over the image) and, unless the states are streamed, one
teacher-forced forward of whole sequences (the states pass). The estimate is codes x step time + the states pass,
per batch of `sample_batch` sequences, times the batches to write; it says which settings shrink it.
"""
from __future__ import annotations

import math
import time

import torch

from specgen.backbones.protocol import embed_image, image_states


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_batch(backbone, texts: list[str], guided: bool, states: bool, repeats: int = 3) -> dict[str, float]:
    """Seconds of one AR step (all rows of the batch) at a half-image cache and of one states pass of the batch."""
    g0, dev = backbone.grid, backbone.device
    rows = backbone.prompts(texts).rows(guided)
    g = g0.at(rows.length)
    B = rows.ids.shape[0]
    half = (g.height // 2) * g.stride  # image tokens already in the cache at mid-image
    codes = torch.randint(0, g.num_visual, (B // rows.reps, g.height, g.width), device=dev)
    tokens = g.image_tokens(codes).repeat(rows.reps, 1)
    embeds = torch.cat([backbone.embed_tokens(rows.ids), embed_image(backbone, tokens[:, :half])], 1)
    cache = backbone.new_cache(rows)
    backbone.forward_embeds(embeds, torch.arange(embeds.shape[1], device=dev), cache)
    step = embed_image(backbone, tokens[:, half:half + 1])
    slot = torch.tensor([embeds.shape[1]], device=dev)
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        _sync(dev)
        t0 = time.perf_counter()
        backbone.visual_logits(backbone.forward_embeds(step, slot, cache))
        _sync(dev)
        times.append(time.perf_counter() - t0)
        backbone.rollback(cache, embeds.shape[1])
    out = {"step_s": min(times[1:]), "states_s": 0.0}
    if states:  # what teacher_states runs: the whole sequences, CFG rows included, in one forward
        _sync(dev)
        t0 = time.perf_counter()
        image_states(backbone, rows, codes)
        _sync(dev)
        out["states_s"] = time.perf_counter() - t0
    return out


def describe(backbone, timing: dict[str, float], sequences: int, sample_batch: int, guided: bool,
             device: str) -> str:
    """One paragraph: the measured step costs, the estimate for `sequences` and how to shrink it."""
    g = backbone.grid
    steps = g.num_visual_tokens  # one pass a code: forced row tokens ride along with the code before them (ar.py)
    batches = math.ceil(sequences / sample_batch)
    per_batch = steps * timing["step_s"] + timing["states_s"]
    total = batches * per_batch
    size = getattr(backbone, "size_key", None)
    shrink = "data.train_shards, data.val_shards, data.shard_size (sequences a shard)" + \
        (f", {size} (the image grid; smoke runs: a small one)" if size else "")
    states = f" + {timing['states_s']:.2f} s for the states pass" if timing["states_s"] else ""
    return (f"teacher stage estimate on {device}: {sequences} sequences of {steps} AR steps ({g.height}x{g.width} "
            f"codes) in {batches} batches of {sample_batch}{' with CFG rows' if guided else ''}; measured "
            f"{timing['step_s'] * 1e3:.1f} ms a step{states} -> about {_clock(per_batch)} a batch, {_clock(total)} "
            f"in all. To shrink it: {shrink}; data.sample_batch samples more sequences side by side")


def _clock(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
