"""Pre-tokenized (prompt, image tokens) examples for backbone training, cached on disk in shards
(VQ codes for discrete backbones, scaled KL latents for continuous ones).

Encoding images with the VQ tokenizer is the expensive part, so it runs once: shard k holds
examples [k * shard_size, (k + 1) * shard_size) of the deterministic example stream, and its file
is keyed by a hash of everything that determines it (tokenizer weights, resolution, seed, task
mixture, ...). An interrupted preparation resumes at the first missing shard. Training reads shards
[first_train_shard, first_train_shard + train_shards): a continuation of a trained backbone can start
past the shards it has seen, on examples it has never met.
"""
from __future__ import annotations

import hashlib
import json
import logging
from functools import cached_property
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from specgen.modules.sharding import rank_loader, rank_shards, rank_world, write_rank_share
from specgen.utils.checkpoints import atomic_savez, load_exported, missing_shards
from specgen.utils.validate import expect_float, expect_int
from specgen.world.dataset import example
from specgen.world.prompts import ALL_TAGS

log = logging.getLogger(__name__)


def _file_sha(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


class TokenShards(Dataset):
    """Concatenated shards: item = prompt text and VQ codes (H, W) int64 or KL latents (L, d) float32."""

    def __init__(self, files: list[Path]):
        parts = [np.load(f, allow_pickle=False) for f in files]
        self.key = "codes" if "codes" in parts[0] else "latents"
        self.data = np.concatenate([p[self.key] for p in parts])
        self.prompts = np.concatenate([p["prompts"] for p in parts])

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x = self.data[i].astype(np.int64 if self.key == "codes" else np.float32)
        return {"prompt": str(self.prompts[i]), self.key: torch.from_numpy(x)}


class _Examples(Dataset):
    """The deterministic example stream at given indices, rendered in DataLoader workers."""

    def __init__(self, indices: range, split: str, seed: int, image_size: int, textured_frac: float,
                 mix: dict[str, float] | None = None):
        self.indices, self.split, self.seed, self.size, self.textured = indices, split, seed, image_size, textured_frac
        self.mix = mix

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        meta, img, _ = example(self.indices[i], self.split, self.seed, self.size, self.textured, self.mix)
        return meta["prompt"], img


def _stack(items):
    return torch.from_numpy(np.stack([img for _, img in items])), [p for p, _ in items]


def _check_mix(mix) -> dict[str, float] | None:
    """A task mixture {task: weight} as plain floats; None keeps the default mixture."""
    if mix is None:
        return None
    if not hasattr(mix, "items"):
        raise ValueError(f"data.mix={mix!r} is not a mapping: give task weights, e.g. "
                         f"data.mix='{{colors: 0.3, dense: 0.7}}', or null for the default mixture")
    out = {}
    for tag, w in mix.items():
        if tag not in ALL_TAGS:
            raise ValueError(f"data.mix has an unknown task {tag!r}: expected some of {list(ALL_TAGS)}")
        out[str(tag)] = expect_float(f"data.mix.{tag}", w, 0.0)
    if sum(out.values()) <= 0:
        raise ValueError(f"data.mix={out} has no positive weight: give at least one task a weight > 0")
    return out


class ShapesTokenDataModule(L.LightningDataModule):
    def __init__(self, tokenizer_dir: str, cache_dir: str, image_size: int = 64, train_shards: int = 12,
                 val_shards: int = 1, shard_size: int = 10_000, textured_frac: float = 0.0, batch_size: int = 32,
                 num_workers: int = 0, seed: int = 0, encode_batch: int = 256, encode_device: str = "auto",
                 render_workers: int = 0, first_train_shard: int = 0, mix: dict | None = None):
        super().__init__()
        for name, value in (("train_shards", train_shards), ("val_shards", val_shards), ("shard_size", shard_size),
                            ("batch_size", batch_size), ("encode_batch", encode_batch)):
            expect_int(f"data.{name}", value, 1)
        expect_int("data.first_train_shard", first_train_shard, 0)
        expect_float("data.textured_frac", textured_frac, 0.0, 1.0)
        self.mix = _check_mix(mix)
        self.save_hyperparameters(ignore=["mix"])

    @cached_property
    def _tokenizer_sha(self) -> str:  # hashed once, not once per shard path
        return _file_sha(Path(self.hparams.tokenizer_dir) / "model.safetensors")

    def _key(self, split: str = "train") -> str:
        h = self.hparams
        fields = [self._tokenizer_sha, h.image_size, h.shard_size, h.textured_frac, h.seed]
        # The mixture shapes the training shards only: validation keeps the default mixture, so validation
        # losses stay comparable across mixtures; the default keeps the hash of caches written before `mix`.
        if self.mix is not None and split == "train":
            fields.append(sorted(self.mix.items()))
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    def _train_range(self) -> range:
        return range(self.hparams.first_train_shard, self.hparams.first_train_shard + self.hparams.train_shards)

    def _shard_path(self, split: str, k: int) -> Path:
        return Path(self.hparams.cache_dir) / self._key(split) / f"{split}_{k:05d}.npz"

    def _missing(self) -> list[tuple[str, int]]:
        return missing_shards(self._shard_path, {"train": self._train_range(), "val": range(self.hparams.val_shards)})

    def prepare_data(self):
        if rank_world(self.trainer)[1] > 1:  # several processes: each tokenizes its share in setup()
            return
        todo = self._missing()
        if todo:
            device = self.hparams.encode_device
            self._write(todo, ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)

    def _write(self, todo: list[tuple[str, int]], device: str) -> None:
        tokenizer = load_exported(self.hparams.tokenizer_dir, device)
        for split, k in tqdm(todo, desc="tokenizing shards", unit="shard"):
            self._write_shard(tokenizer, split, k, device)

    @torch.no_grad()
    def _write_shard(self, tokenizer, split: str, k: int, device: str = "cpu"):
        h = self.hparams
        codes, prompts = [], []
        stream = _Examples(range(k * h.shard_size, (k + 1) * h.shard_size), split, h.seed, h.image_size,
                           h.textured_frac, self.mix if split == "train" else None)
        loader = DataLoader(stream, batch_size=h.encode_batch, num_workers=h.render_workers, collate_fn=_stack)
        for images, batch_prompts in tqdm(loader, desc=f"{split} shard {k}", leave=False):
            # VQ: codes (B, h, w); KL: scaled latents (B, L, d)
            enc = tokenizer.encode(images.permute(0, 3, 1, 2).to(device)).cpu().numpy()
            codes.append(enc.astype(np.uint16) if enc.dtype.kind == "i" else enc.astype(np.float16))
            prompts += batch_prompts
        data = np.concatenate(codes)
        atomic_savez(self._shard_path(split, k), **{"codes" if data.dtype == np.uint16 else "latents": data},
                     prompts=np.asarray(prompts))

    def setup(self, stage: str | None = None):
        h = self.hparams
        rank, world = rank_world(self.trainer)
        if world > 1:  # every rank tokenizes its share of the missing shards on its own device
            device = str(self.trainer.strategy.root_device) if h.encode_device == "auto" else h.encode_device
            write_rank_share(self.trainer, self._missing, lambda todo: self._write(todo, device))
        self.train_shards = rank_shards(self._train_range(), rank, world, "data.train_shards")
        if world > 1:
            log.info("rank %d of %d trains on token shards %s", rank, world, self.train_shards)
        self.train_set = TokenShards([self._shard_path("train", k) for k in self.train_shards])
        self.val_set = TokenShards([self._shard_path("val", k) for k in range(h.val_shards)])

    def train_dataloader(self):
        h = self.hparams
        return rank_loader(self.train_set, h.batch_size, h.num_workers, h.seed, rank_world(self.trainer)[1])

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
