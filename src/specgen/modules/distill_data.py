"""Self-distillation data: sequences sampled from the frozen backbone and its pre-norm hidden states.

A separate, cached stage (the teacher is expensive, the student cheap): shard k holds `shard_size`
sequences sampled with plain AR decoding for training-split prompts, and for each the teacher's
pre-norm last-layer states from the begin-of-image position to the last visual token, under
the conditional and the unconditional prompt (CFG drafts need both). Shards are keyed by the
backbone's weights and the sampling settings, written atomically, and resumed by shard.

`train_source="dataset"` replaces the sampled training sequences by the world's own images (new scenes of
training prompts, VQ-encoded), teacher-forced: one forward pass per sequence instead of H x W sampling
steps, so many more sequences per CPU hour, at the cost of a context distribution that is the data's, not the
backbone's samples at the decoding CFG. Validation shards are always the backbone's samples (the
distribution SSD serves), so both sources are judged on it.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from specgen.backbones.loading import load_shapes_generator, weights_id
from specgen.backbones.protocol import Prompts, image_states
from specgen.decoding import ar
from specgen.decoding.sampling import make_rngs
from specgen.utils.checkpoints import atomic_savez, missing_shards
from specgen.utils.validate import expect_int
from specgen.world.dataset import example
from specgen.world.prompts import sample_example

SOURCES = ("samples", "dataset")
DATASET_OFFSET = 10_000_000  # example indices of dataset-source shards: far past any backbone training shard


def teacher_states(backbone, prompts: Prompts, codes: torch.Tensor,
                   guided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm states and image tokens of the image part, from the last prompt slot to the last visual token.

    Returns (states (B', L, D), tokens (B', L)) where states[:, i] sits at slot prefix_len - 1 + i and tokens[:, i]
    is the image token it predicts (slot prefix_len + i); with `guided`, B unconditional rows follow the B
    conditional ones (the model's own unconditional prompt).
    """
    return image_states(backbone, prompts.rows(guided), codes)


class TeacherShards(Dataset):
    """Item: cond and uncond teacher states (2, L, D) float32 and the predicted ids (L,)."""

    def __init__(self, files: list[Path]):
        parts = [np.load(f) for f in files]
        self.states = np.concatenate([p["states"] for p in parts])  # (N, 2, L, D) float16
        self.ids = np.concatenate([p["ids"] for p in parts])  # (N, L) int32

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"states": torch.from_numpy(self.states[i].astype(np.float32)),
                "ids": torch.from_numpy(self.ids[i].astype(np.int64))}


class DistillDataModule(L.LightningDataModule):
    def __init__(self, backbone_dir: str, tokenizer_dir: str, cache_dir: str, train_shards: int = 4,
                 val_shards: int = 1, shard_size: int = 512, sample_batch: int = 64, cfg_scale: float = 3.0,
                 temperature: float = 1.0, top_k: int | None = None, batch_size: int = 16, seed: int = 0,
                 num_workers: int = 0, sample_device: str = "auto", train_source: str = "samples"):
        super().__init__()
        for name in ("train_shards", "val_shards", "shard_size", "sample_batch", "batch_size"):
            expect_int(f"data.{name}", locals()[name], 1)
        if train_source not in SOURCES:
            raise ValueError(f"data.train_source={train_source!r}: expected one of {SOURCES}")
        self.save_hyperparameters()

    def _key(self, source: str = "samples") -> str:
        h = self.hparams
        spec = [weights_id(h.backbone_dir), h.shard_size, h.cfg_scale, h.temperature, h.top_k, h.seed]
        if source != "samples":
            spec = [weights_id(h.backbone_dir), h.shard_size, h.seed, source]
        spec.append("image_tokens")  # ids are image tokens (codes, forced tokens after them), not vocabulary ids
        return hashlib.sha1(json.dumps(spec).encode()).hexdigest()[:12]

    def shard_path(self, split: str, k: int) -> Path:
        source = self.hparams.train_source if split == "train" else "samples"
        return Path(self.hparams.cache_dir) / self._key(source) / f"{split}_{k:05d}.npz"

    def prepare_data(self):
        h = self.hparams
        todo = missing_shards(self.shard_path, {"val": h.val_shards, "train": h.train_shards})  # val first: it scores every run
        if not todo:
            return
        device = h.sample_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        backbone = load_shapes_generator(h.backbone_dir, h.tokenizer_dir, device)
        for split, k in tqdm(todo, desc="sampling teacher shards", unit="shard"):
            self._write_shard(backbone, split, k, device)

    @torch.no_grad()
    def _write_shard(self, backbone, split: str, k: int, device: str = "cpu"):
        h = self.hparams
        states, ids = [], []
        dataset = split == "train" and h.train_source == "dataset"
        for start in tqdm(range(0, h.shard_size, h.sample_batch), desc=f"{split} shard {k}", leave=False):
            n = min(h.sample_batch, h.shard_size - start)
            base = (k * h.shard_size + start) * 2 + (1 if split == "val" else 0)
            if dataset:  # the world's images of new scenes, encoded by the backbone's tokenizer
                items = [example(DATASET_OFFSET + k * h.shard_size + start + i, split, h.seed, backbone.tokenizer.image_size,
                                 0.0) for i in range(n)]
                cond = backbone.prompts([meta["prompt"] for meta, _, _ in items])
                images = torch.from_numpy(np.stack([img for _, img, _ in items])).permute(0, 3, 1, 2).to(device)
                codes = backbone.tokenizer.encode(images)
            else:
                prompts = [sample_example(random.Random(h.seed * 1_000_003 + base + 2 * i), split)[0]["prompt"]
                           for i in range(n)]
                cond = backbone.prompts(prompts)
                codes, _ = ar.generate(backbone, cond, cfg_scale=h.cfg_scale, temperature=h.temperature, top_k=h.top_k,
                                       rngs=make_rngs([h.seed * 7_919 + base + i for i in range(n)], device),
                                       static_cache=True)  # same tokens, about 3x faster
            both, tok = teacher_states(backbone, cond, codes, guided=True)  # (2n, L, D): conditional, unconditional
            states.append(torch.stack([both[:n], both[n:]], 1).half().cpu().numpy())
            ids.append(tok[:n].int().cpu().numpy())
        # atomic: an interrupted stage resumes at this shard
        atomic_savez(self.shard_path(split, k), states=np.concatenate(states), ids=np.concatenate(ids))

    def setup(self, stage: str | None = None):
        h = self.hparams
        self.train_set = TeacherShards([self.shard_path("train", k) for k in range(h.train_shards)])
        self.val_set = TeacherShards([self.shard_path("val", k) for k in range(h.val_shards)])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
