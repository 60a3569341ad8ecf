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
import logging
import random
from pathlib import Path

import lightning as L
import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from specgen.backbones.hf import check_folder, folder_identity
from specgen.backbones.loading import load_shapes_generator, weights_id
from specgen.backbones.protocol import Prompts, image_states
from specgen.decoding import ar
from specgen.decoding.sampling import make_rngs
from specgen.modules.sharding import rank_loader, rank_shards, rank_world, write_rank_share
from specgen.modules.teacher_cost import describe, time_batch
from specgen.utils.checkpoints import atomic_savez, build, compact_ints, missing_shards
from specgen.utils.validate import expect_int
from specgen.world.dataset import example
from specgen.world.prompts import sample_example

log = logging.getLogger(__name__)
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
    """Item: cond and uncond teacher states (2, L, D) float32 and the predicted ids (L,), all shards in memory."""

    def __init__(self, files: list[Path]):
        parts = [np.load(f) for f in files]
        self.states = np.concatenate([p["states"] for p in parts])  # (N, 2, L, D) float16
        self.ids = np.concatenate([p["ids"] for p in parts])  # (N, L) int32

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"states": torch.from_numpy(self.states[i].astype(np.float32)),
                "ids": torch.from_numpy(self.ids[i].astype(np.int64))}


class TeacherTokens(Dataset):
    """Streamed mode. Item: the sampled codes (H, W), the predicted ids (L,) and the prompt text; the states are
    recomputed from them by the training module's frozen backbone."""

    def __init__(self, files: list[Path]):
        parts = [np.load(f) for f in files]
        self.codes = np.concatenate([p["codes"] for p in parts])  # (N, H, W) int32
        self.ids = np.concatenate([p["ids"] for p in parts])  # (N, L) int32
        self.prompts = np.concatenate([p["prompts"] for p in parts])  # (N,) unicode

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"codes": torch.from_numpy(self.codes[i].astype(np.int64)),
                "ids": torch.from_numpy(self.ids[i].astype(np.int64)), "prompt": str(self.prompts[i])}


def teacher_dataset(files: list[Path]) -> TeacherShards | TeacherTokens:
    """The dataset of teacher shards as written: states (`TeacherShards`) or, streamed, tokens (`TeacherTokens`);
    shards of both kinds in one list are an error."""
    kinds = set()
    for f in files:
        with np.load(f) as z:
            kinds.add("states" if "states" in z.files else "tokens" if "codes" in z.files else f"neither ({f})")
    if len(kinds) != 1 or not kinds <= {"states", "tokens"}:
        raise ValueError(f"teacher shards {[str(f) for f in files]} hold {sorted(kinds)}: give shards of one kind, all "
                         f"with states or all with tokens (data.stream=true writes *_tokens.npz)")
    return TeacherShards(files) if kinds == {"states"} else TeacherTokens(files)


def image_states_len(grid) -> int:
    """Teacher states (and predicted image tokens) per sequence: from the last prompt slot to the last visual token."""
    g = grid.at(0)
    return g.position(g.height - 1, g.width - 1) + 1


def size_estimate(backbone, shards: int, shard_size: int, total_shards: int, stream: bool, folder: Path) -> str:
    """What the shards to write will hold, on disk and (in-memory mode) in host memory during training."""
    g = backbone.grid
    L = image_states_len(g)
    n, n_all = shards * shard_size, total_shards * shard_size
    if stream:
        per = 4 * (L + g.num_visual_tokens) + 4 * 256  # ids and codes as int32, a prompt of up to 256 characters
        return (f"teacher tokens to write in {folder}: {shards} shards x {shard_size} sequences, at most "
                f"{n * per / 1e6:.1f} MB before compression ({per / 1e3:.0f} KB a sequence; data.stream=true: the states, "
                f"{2 * L * backbone.hidden_size * 2 / 1e6:.2f} MB a sequence in fp16, are recomputed per batch "
                f"by the frozen backbone)")
    per = 2 * L * backbone.hidden_size * 2  # conditional + unconditional branch, fp16
    return (f"teacher shards to write in {folder}: {shards} shards x {shard_size} sequences x {L} states x "
            f"{backbone.hidden_size} wide x 2 branches in fp16, about {n * per / 1e9:.2f} GB "
            f"({per / 1e6:.1f} MB a sequence); training loads all {n_all} sequences into memory "
            f"({n_all * per / 1e9:.2f} GB): data.stream=true caches only the tokens and recomputes the states")


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a file: one a line (.txt), GenEval's metadata (.jsonl, its "prompt" field), or a folder of
    DPG-Bench prompt files (one prompt per .txt)."""
    path = Path(path).expanduser()
    if path.is_dir():
        out = [f.read_text().strip() for f in sorted(path.glob("*.txt"))]
    elif path.suffix == ".jsonl":
        out = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    elif path.is_file():
        out = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        raise FileNotFoundError(f"data.prompts_path={str(path)!r} does not exist: give a text file (one prompt a "
                                f"line), GenEval's evaluation_metadata.jsonl or a DPG-Bench prompt folder")
    if not out:
        raise ValueError(f"data.prompts_path={str(path)!r} holds no prompts")
    return out


def load_teacher(hparams, device: str):
    """The frozen backbone the drafter is distilled from: a real one from `generator` (a config), or the embedded
    one from its exported folders."""
    if hparams.get("generator"):
        return build(dict(hparams.generator, device=device))
    return load_shapes_generator(hparams.backbone_dir, hparams.tokenizer_dir, device)


def teacher_key(hparams) -> str:
    """Identity of the teacher's weights without loading them."""
    if hparams.get("generator"):
        return folder_identity(check_folder(hparams.generator["weights_path"], "backbone"))
    return weights_id(hparams.backbone_dir)


class DistillDataModule(L.LightningDataModule):
    """Teacher shards of the embedded backbone (`backbone_dir`, `tokenizer_dir`, world prompts), or of a real one
    (`generator`: its config, not built here; `prompts_path`: the prompts it samples from)."""

    def __init__(self, backbone_dir: str | None, tokenizer_dir: str | None, cache_dir: str, train_shards: int = 4,
                 val_shards: int = 1, shard_size: int = 512, sample_batch: int = 64, cfg_scale: float = 3.0,
                 temperature: float = 1.0, top_k: int | None = None, batch_size: int = 16, seed: int = 0,
                 num_workers: int = 0, sample_device: str = "auto", train_source: str = "samples",
                 generator: dict | None = None, prompts_path: str | None = None, stream: bool = False):
        super().__init__()
        for name in ("train_shards", "val_shards", "shard_size", "sample_batch", "batch_size"):
            expect_int(f"data.{name}", locals()[name], 1)
        if train_source not in SOURCES:
            raise ValueError(f"data.train_source={train_source!r}: expected one of {SOURCES}")
        if generator is not None and (prompts_path is None or train_source != "samples"):
            raise ValueError(f"a real backbone is distilled on its own samples of a prompt file: set "
                             f"data.prompts_path (got {prompts_path!r}) and data.train_source=samples "
                             f"(got {train_source!r})")
        if generator is not None:
            generator = OmegaConf.to_container(generator, resolve=True) if OmegaConf.is_config(generator) else generator
        self.save_hyperparameters()
        self.hparams.generator = generator

    def _key(self, source: str = "samples") -> str:
        h = self.hparams
        spec = [teacher_key(h), h.shard_size, h.cfg_scale, h.temperature, h.top_k, h.seed]
        if source != "samples":
            spec = [teacher_key(h), h.shard_size, h.seed, source]
        if h.get("prompts_path"):
            spec.append(hashlib.sha1("\n".join(read_prompt_file(h.prompts_path)).encode()).hexdigest()[:12])
        spec.append("image_tokens")  # ids are image tokens (codes, forced tokens after them), not vocabulary ids
        return hashlib.sha1(json.dumps(spec).encode()).hexdigest()[:12]

    def shard_path(self, split: str, k: int) -> Path:
        source = self.hparams.train_source if split == "train" else "samples"
        kind = "_tokens" if self.hparams.get("stream") else ""  # streamed shards hold tokens, not states
        return Path(self.hparams.cache_dir) / self._key(source) / f"{split}_{k:05d}{kind}.npz"

    def _missing(self) -> list[tuple[str, int]]:
        h = self.hparams
        return missing_shards(self.shard_path, {"val": h.val_shards, "train": h.train_shards})  # val first: it scores every run

    def prepare_split(self, split: str) -> None:
        """Write the missing shards of one split only ('val': a held-out set for a report, without training data)."""
        self._write_missing([t for t in self._missing() if t[0] == split])

    def prepare_data(self):
        if rank_world(self.trainer)[1] > 1:  # several processes: each samples its share in setup()
            return
        self._write_missing(self._missing())

    def _write_missing(self, todo: list[tuple[str, int]]) -> None:
        if todo:
            device = self.hparams.sample_device
            self._write(todo, ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)

    def _write(self, todo: list[tuple[str, int]], device: str, others: str = "") -> None:
        h = self.hparams
        backbone = load_teacher(h, device)
        total = h.train_shards + h.val_shards
        if len(todo) < total:
            print(f"teacher shards: {total - len(todo)} of {total} already written{others}, sampling the other "
                  f"{len(todo)}")
        print(size_estimate(backbone, len(todo), h.shard_size, total, h.get("stream", False),
                            self.shard_path(*todo[0]).parent))
        self._print_time_estimate(backbone, todo)
        self._bar = tqdm(total=len(todo) * h.shard_size, desc="teacher sequences", unit="seq", dynamic_ncols=True)
        with self._bar:  # counts sequences (and their tokens) across the shards, not shards alone
            for split, k in todo:
                self._bar.set_description(f"teacher sequences ({split} shard {k})")
                self._write_shard(backbone, split, k, device)
        self._bar = None

    def _print_time_estimate(self, backbone, todo: list[tuple[str, int]]) -> None:
        """A few timed steps of the teacher, then what the shards to write will take on this machine."""
        h = self.hparams
        sampled = [t for t in todo if not (t[0] == "train" and h.train_source == "dataset")]
        if not sampled:
            return
        n = min(h.sample_batch, h.shard_size)
        guided = h.cfg_scale != 1.0
        split, k = sampled[0]
        timing = time_batch(backbone, self._prompts(split, k * h.shard_size, n, 0), guided,
                            states=not h.get("stream"))
        print(describe(backbone, timing, len(sampled) * h.shard_size, n, guided, str(backbone.device)))

    @torch.no_grad()
    def _write_shard(self, backbone, split: str, k: int, device: str = "cpu"):
        h = self.hparams
        bar = getattr(self, "_bar", None)
        states, ids, all_codes, texts = [], [], [], []
        dataset = split == "train" and h.train_source == "dataset"
        per_seq = backbone.grid.num_visual_tokens
        for start in range(0, h.shard_size, h.sample_batch):
            n = min(h.sample_batch, h.shard_size - start)
            base = (k * h.shard_size + start) * 2 + (1 if split == "val" else 0)
            if dataset:  # the world's images of new scenes, encoded by the backbone's tokenizer
                items = [example(DATASET_OFFSET + k * h.shard_size + start + i, split, h.seed, backbone.tokenizer.image_size,
                                 0.0) for i in range(n)]
                cond = backbone.prompts([meta["prompt"] for meta, _, _ in items])
                images = torch.from_numpy(np.stack([img for _, img, _ in items])).permute(0, 3, 1, 2).to(device)
                codes = backbone.tokenizer.encode(images)
            else:
                prompts = self._prompts(split, k * h.shard_size + start, n, base)
                cond = backbone.prompts(prompts)
                codes, _ = ar.generate(backbone, cond, cfg_scale=h.cfg_scale, temperature=h.temperature, top_k=h.top_k,
                                       rngs=make_rngs([h.seed * 7_919 + base + i for i in range(n)], device),
                                       static_cache=True)  # same tokens, about 3x faster
            if h.get("stream"):  # tokens only: the training module recomputes the states
                tokens = backbone.grid.at(0).image_tokens(codes)  # (n, H*stride): what the states would predict
                ids.append(tokens[:, :image_states_len(backbone.grid)].int().cpu().numpy())
                all_codes.append(codes.int().cpu().numpy())
                texts += list(cond.texts)
            else:
                both, tok = teacher_states(backbone, cond, codes, guided=True)  # (2n, L, D): cond, uncond
                states.append(torch.stack([both[:n], both[n:]], 1).half().cpu().numpy())
                ids.append(tok[:n].int().cpu().numpy())
            if bar is not None:
                bar.update(n)
                bar.set_postfix(tokens=f"{bar.n * per_seq:,}")
        # atomic: an interrupted stage resumes at this shard
        if h.get("stream"):
            # compressed, ids in int16 where they fit: about a fifth of the plain int32 file (a shard of 2048 sequences
            # of the embedded world: 0.8 MB against 5.7), small enough to carry to another machine
            atomic_savez(self.shard_path(split, k), compress=True, codes=compact_ints(np.concatenate(all_codes)),
                         ids=compact_ints(np.concatenate(ids)), prompts=np.array(texts, dtype=str))
        else:
            atomic_savez(self.shard_path(split, k), states=np.concatenate(states), ids=np.concatenate(ids))

    def _prompts(self, split: str, index: int, n: int, base: int) -> list[str]:
        """Prompts of sequences index..index+n-1 of a split: the world's, or the prompt file's (its last tenth, at
        least one, held out for validation), in order and cycled."""
        h = self.hparams
        if not h.get("prompts_path"):
            return [sample_example(random.Random(h.seed * 1_000_003 + base + 2 * i), split)[0]["prompt"]
                    for i in range(n)]
        lines = read_prompt_file(h.prompts_path)
        held = max(1, len(lines) // 10) if len(lines) > 1 else 0
        pool = (lines[len(lines) - held:] if held else lines) if split == "val" else lines[: len(lines) - held]
        return [pool[(index + i) % len(pool)] for i in range(n)]

    def setup(self, stage: str | None = None):
        h = self.hparams
        rank, world = rank_world(self.trainer)
        if world > 1:  # every rank samples its share of the missing shards on its own device
            device = str(self.trainer.strategy.root_device) if h.sample_device == "auto" else h.sample_device
            write_rank_share(self.trainer, self._missing, lambda todo: self._write(todo, device, " or left to other ranks"))
        kind = TeacherTokens if h.get("stream") else TeacherShards
        self.train_shards = rank_shards(range(h.train_shards), rank, world, "data.train_shards")
        if world > 1:
            log.info("rank %d of %d trains on teacher shards %s", rank, world, self.train_shards)
        self.train_set = kind([self.shard_path("train", k) for k in self.train_shards])
        self.val_set = kind([self.shard_path("val", k) for k in range(h.val_shards)])

    def train_dataloader(self):
        h = self.hparams
        return rank_loader(self.train_set, h.batch_size, h.num_workers, h.seed, rank_world(self.trainer)[1])

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
