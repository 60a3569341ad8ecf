"""Python API: load a generator and a drafter, decode prompts with any strategy, get images, codes and statistics.

    import specgen

    gen = specgen.load_generator()                        # the shipped embedded backbone (generator=shapes_ar)
    out = specgen.generate(gen, ["a red circle above a blue square"], strategy="ssd", rounds=1)
    out.images[0]                                         # uint8 (H, W, 3)
    out.stats[0]["nfe"]                                   # target passes of that image

Everything composes the same Hydra configs as `python -m specgen.eval`: `load_generator("janus_pro",
weights_path=...)` is `generator=janus_pro generator.weights_path=...`, `strategy="ssd"` is `decoding=ssd`, and keyword
options override that strategy's `fn` settings (`rounds=1` is `decoding.fn.rounds=1`). With `seed=s`, the k-th copy of
a prompt is decoded at the evaluation's seed for sample k of that prompt, so an image equals the one the evaluation
caches for it under the same strategy and batch.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from specgen.evaluation.generate import decode_batch, job_seed
from specgen.utils.checkpoints import load_exported
from specgen.utils import locations
from specgen.utils.hydra import CONFIG_DIR

CONFIG_KEY = "_specgen_overrides"  # the composition overrides a generator was loaded with
CALL_ARGS = {"backbone", "prompts", "rngs"}  # what `generate` passes to every decode function itself


@dataclasses.dataclass
class Strategy:
    """A decoding strategy ready to run: its name, its composed `decoding` config and the decode function."""
    name: str
    config: DictConfig
    fn: Any
    batch_size: int


@dataclasses.dataclass
class Generation:
    """The outcome of `generate`: one entry per prompt, in the prompts' order."""
    prompts: list[str]
    seeds: list[int]
    images: np.ndarray        # uint8 (N, H, W, 3)
    codes: list[torch.Tensor]  # the backbone's image tokens per image (ids (H, W) or continuous (L, d))
    stats: list[dict]          # per-image statistics: nfe (target passes), acceptance, latency_s, ...


def compose(overrides: Sequence[str] = (), config: str = "eval") -> DictConfig:
    """The evaluation's config (`configs/eval.yaml`) with Hydra overrides, composed without a run directory."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name=config, overrides=list(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = None  # nothing is written by the API
    return cfg


def _as_override(key: str, value: Any) -> str:
    return f"{key}={'null' if value is None else value}"


def load_generator(name: str = "shapes_ar", overrides: Sequence[str] = (), **options) -> torch.nn.Module:
    """A backbone by its `configs/generator/<name>.yaml`, with `options` as `generator.<key>=<value>` and further
    Hydra `overrides` (e.g. `["mar_pair=xar_b"]`). Examples: `load_generator()`, `load_generator("shapes_ar",
    dtype="bfloat16")`, `load_generator("janus_pro", weights_path="/models/Janus-Pro-7B", device="cuda")`."""
    over = [f"generator={name}", *overrides, *(_as_override(f"generator.{k}", v) for k, v in options.items())]
    backbone = instantiate(compose(over).generator)
    setattr(backbone, CONFIG_KEY, over)
    return backbone


def load_drafter(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """An exported drafter (f_phi, 1D heads, a CSpD draft): a folder with config.yaml and model.safetensors, or the
    name of a shipped one under checkpoints/ (e.g. "fphi_gpu")."""
    return load_exported(_export_folder(path), device)


def _export_folder(path: str | Path) -> Path:
    """A folder as given, else the shipped one of that name under checkpoints/."""
    folder = Path(path)
    if not folder.is_dir() and not folder.is_absolute():
        shipped = locations.repo_root() / "checkpoints" / folder  # paths.checkpoint_dir's default
        folder = shipped if shipped.is_dir() else folder
    return folder


def load_strategy(name: str = "ssd", generator: torch.nn.Module | None = None, drafter: Any = None,
             overrides: Sequence[str] = (), **options) -> Strategy:
    """The decoding strategy `configs/decoding/<name>.yaml` with `options` set on its `fn` (checked against the
    function's signature). `drafter`: a loaded module, an export folder or a shipped model's name in place of the
    config's drafter (or CSpD draft). `generator`: a backbone from `load_generator`, whose composition the strategy shares (its
    `mar_pair`, paths)."""
    over = [*(getattr(generator, CONFIG_KEY, []) if generator is not None else []), f"decoding={name}", *overrides]
    dec = compose(over).decoding
    target = get_method(dec.fn._target_)
    known = (set(dec.fn) | set(inspect.signature(target).parameters)) - CALL_ARGS
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"strategy {name!r} has no option {unknown}: its options are "
                        f"{sorted(k for k in known if not k.startswith('_'))}")
    slot = next((k for k in ("drafter", "draft") if k in dec.fn), None)
    if drafter is not None and slot is None:
        raise TypeError(f"strategy {name!r} takes no drafter: drop drafter=..., or pick one that does (e.g. ssd)")
    module = drafter if isinstance(drafter, torch.nn.Module) else None
    with open_dict(dec):
        for key, value in options.items():
            dec.fn[key] = value
        if drafter is not None and module is None:
            dec.fn[slot] = {"_target_": "specgen.utils.checkpoints.load_exported", "dirpath": str(_export_folder(drafter))}
        if module is not None:
            del dec.fn[slot]
    fn = instantiate(dec.fn)
    if module is not None:
        fn = functools.partial(fn, **{slot: module})
    return Strategy(name=dec.name, config=dec, fn=fn, batch_size=int(dec.get("batch_size") or 16))


def generate(generator: torch.nn.Module, prompts: str | Sequence[str], strategy: str | Strategy = "ssd",
             seed: int = 0, seeds: Sequence[int] | None = None, batch_size: int | None = None,
             drafter: Any = None, **options) -> Generation:
    """Decode `prompts` with a strategy (a name, or a `Strategy` from `specgen.load_strategy`): images, codes and
    per-image statistics. `seeds` gives each image's seed; otherwise they follow the evaluation's per-image seeds
    from `seed`. `batch_size` defaults to the strategy's own; `drafter` and `options` as in `specgen.load_strategy`."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("generate() got no prompts: pass a prompt string or a list of them")
    if isinstance(strategy, str):
        strategy = load_strategy(strategy, generator=generator, drafter=drafter, **options)
    elif drafter is not None or options:
        raise TypeError("drafter and options belong to specgen.load_strategy(...) when a Strategy object is passed")
    if seeds is None:
        count, seeds = Counter(), []
        for p in prompts:  # the k-th copy of a prompt: the evaluation's sample k
            seeds.append(job_seed(seed, p, count[p]))
            count[p] += 1
    elif len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt, or none")
    size = batch_size or strategy.batch_size
    images, codes, stats = [], [], []
    with torch.no_grad():
        for start in range(0, len(prompts), size):
            im, co, st = decode_batch(generator, strategy.fn, prompts[start:start + size], seeds[start:start + size])
            images.append(im)
            codes += list(co.cpu())
            stats += st
    return Generation(prompts=prompts, seeds=list(seeds), images=np.concatenate(images), codes=codes, stats=stats)
