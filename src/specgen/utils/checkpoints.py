"""Exported model folders: weights (safetensors) + config.yaml + metrics.json + command.txt [+ extra.json].

Loading a folder needs torch, safetensors and omegaconf only (no Hydra, no Lightning): `build` makes the
object that `config.yaml`'s `_target_` names, so a backbone or drafter loads outside the config system.
"""
from __future__ import annotations

import csv
import importlib
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specgen.utils.locations import repo_root

REPO_ROOT = repo_root()  # the clone (or $SPECGEN_ROOT): where shipped checkpoints are named from
# The experiment that exports each shipped folder (its `export_name`), for error messages.
PRODUCERS = {"vq_shapes": "train/vq_shapes", "kl_shapes": "train/kl_shapes", "ar_shapes": "train/ar_shapes",
             "ar_shapes_draft": "train/ar_shapes_draft", "fphi_shapes": "train/fphi_shapes",
             "fphi_accept": "train/fphi_accept", "fphi_accept16": "train/fphi_accept16",
             "fphi_gpu": "train/fphi_gpu", "fphi_tokens_shapes": "train/fphi_tokens_shapes",
             "mtp_shapes": "train/mtp_shapes", "featnet_shapes": "train/featnet_shapes",
             "clip_shapes": "train/clip_shapes", "mar_shapes": "train/mar_shapes",
             "mar_shapes_draft": "train/mar_draft", "mar_p2_shapes": "train/mar_shapes_cpu",
             "mar_p2_shapes_draft": "train/mar_draft_cpu", "mar_p2_shapes_draft_q": "train/mar_draft_q_cpu",
             "ar_shapes32": "train/ar_shapes32", "fphi_shapes32": "train/fphi_shapes32",
             "ar_shapes24": "train/ar_shapes24", "fphi_shapes24": "train/fphi_shapes24"}
# Shipped folders whose weights file is a link to another shipped folder's: the same network under another config
# (vq_shapes128, vq_shapes96: the factor-4 VQ at 128 and 96 px, 32x32 and 24x24 grids; a convolutional tokenizer
# takes any multiple of its factor).
ALIASES = {"vq_shapes128": "vq_shapes", "vq_shapes96": "vq_shapes"}


def reproduce_hint(dirpath: str | Path) -> str:
    """The command that makes an exported folder, by its name (a generic pointer for other names)."""
    name = Path(dirpath).name
    name = ALIASES.get(name, name)
    if name in PRODUCERS:
        return f"python -m specgen.train experiment={PRODUCERS[name]}"
    return "the training command of this model (see the README)"


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600 files
    os.replace(tmp, path)


def atomic_write_csv(path: str | Path, rows: list[dict]) -> None:
    """Write dict rows as CSV atomically; the header is the union of the rows' keys in order of appearance
    (rows of different benchmarks may differ in columns; missing cells are left empty)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def atomic_savez(path: str | Path, compress: bool = False, **arrays) -> None:
    """np.savez (np.savez_compressed with `compress`) to a temp file in the same folder, then rename: a half-written
    file is never picked up."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
    os.close(fd)
    (np.savez_compressed if compress else np.savez)(tmp, **arrays)
    os.replace(tmp, path)


def compact_ints(a: np.ndarray) -> np.ndarray:
    """Integer ids in int16 when every one fits (the embedded world's vocabulary), else int32 (a real backbone's)."""
    a = np.asarray(a)
    fits = a.size == 0 or (int(a.min()) >= np.iinfo(np.int16).min and int(a.max()) <= np.iinfo(np.int16).max)
    return a.astype(np.int16 if fits else np.int32)


def missing_shards(shard_path, counts: dict[str, int | range]) -> list[tuple[str, int]]:
    """(split, index) of the shards not written yet, for `shard_path(split, k)` and, per split, a shard
    count (shards 0..n-1) or a range of shard indices."""
    return [(s, k) for s, n in counts.items() for k in (range(n) if isinstance(n, int) else n)
            if not shard_path(s, k).is_file()]


def export(dirpath: str | Path, net: torch.nn.Module, net_cfg: DictConfig | dict, metrics: dict | None = None,
           command: str | None = None, extra: dict | None = None, weights_dtype: str = "float32") -> Path:
    """Save a module's weights and the config that builds it into `dirpath`.

    `weights_dtype="float16"` stores fp32 *parameters* in half precision (half the size on disk;
    they load back into the fp32 module); buffers (e.g. diffusion schedules) keep their dtype.
    No absolute path is written (a folder that moves to another machine, or into the repository, must carry no
    path of the machine that wrote it): path strings in `metrics` and `extra`, and path arguments of `command`
    (`key=/abs/path` or a bare `/abs/path`), become `portable_path`s.
    """
    if weights_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"weights_dtype={weights_dtype!r}: use float32, float16 or bfloat16")
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    params = {k for k, _ in net.named_parameters()}
    cast = getattr(torch, weights_dtype)
    state = {k: (v.detach().to(cast) if k in params and v.dtype == torch.float32 else v.detach()).cpu().contiguous()
             for k, v in net.state_dict().items()}
    fd, tmp = tempfile.mkstemp(dir=dirpath, prefix=".model.")
    os.close(fd)
    save_file(state, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dirpath / "model.safetensors")
    cfg = OmegaConf.create(OmegaConf.to_container(net_cfg, resolve=True) if isinstance(net_cfg, DictConfig)
                           else net_cfg)
    atomic_write_text(dirpath / "config.yaml", OmegaConf.to_yaml(cfg))
    if metrics is not None:
        atomic_write_text(dirpath / "metrics.json", json.dumps(_portable(metrics), indent=2, sort_keys=True) + "\n")
    if command is not None:
        atomic_write_text(dirpath / "command.txt", portable_command(command).strip() + "\n")
    if extra is not None:
        atomic_write_text(dirpath / "extra.json", json.dumps(_portable(extra), indent=2,
                                                             sort_keys=True) + "\n")
    return dirpath


def portable_path(path: str) -> str:
    """A path as exports record it: relative to the repository root when it lies inside it (the shipped
    `checkpoints/<name>`), else only its last component (a name, not a path to follow: identities such as a
    drafter's `backbone_id` are weight hashes, never paths). Relative paths are kept as they are."""
    if not os.path.isabs(path):
        return path
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else resolved.name


def portable_command(command: str) -> str:
    """`command` with each absolute path argument (`/a/b` or `key=/a/b`) made `portable_path`."""
    def word(w: str) -> str:
        key, eq, value = w.rpartition("=") if "=" in w else ("", "", w)
        return key + eq + portable_path(value) if os.path.isabs(value) else w

    return "\n".join(" ".join(word(w) for w in line.split(" ")) for line in command.split("\n"))


def _portable(value):
    """`value` with every absolute path string (in nested dicts and lists too) made `portable_path`."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    return portable_path(value) if isinstance(value, str) else value


def stored_weights_dtype(dirpath: str | Path, net: torch.nn.Module) -> str:
    """The dtype an exported folder stores `net`'s parameters in (`export`'s `weights_dtype`)."""
    params = dict(net.named_parameters())
    with safe_open(str(Path(dirpath) / "model.safetensors"), framework="pt") as f:  # reads one tensor, not all
        key = next((k for k in f.keys() if k in params), None)
        return "float32" if key is None else str(f.get_tensor(key).dtype).removeprefix("torch.")


def build(spec):
    """The object a config node describes, without Hydra: a dict with `_target_` (a dotted path to a class or
    function) is called with its other keys as keyword arguments, nested nodes and lists built first."""
    if isinstance(spec, (list, tuple)):
        return [build(v) for v in spec]
    if not isinstance(spec, dict):
        return spec
    other = [k for k in spec if k.startswith("_") and k != "_target_"]
    if other:
        raise ValueError(f"config keys {other} are Hydra instantiate options that exported configs do not use: "
                         f"give plain keyword arguments under `_target_`")
    kwargs = {k: build(v) for k, v in spec.items() if k != "_target_"}
    return _locate(spec["_target_"])(**kwargs) if "_target_" in spec else kwargs


def _locate(path: str):
    """The attribute a dotted path names (`pkg.module.Class` or `pkg.module.Class.method`)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name not in {".".join(parts[:i]) for i in range(1, cut + 1)}:
                raise  # the module exists but imports something that is missing: that is the error to show
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise ImportError(f"_target_ {path!r} names nothing importable: the config was written by another version of "
                      f"specgen, or the class moved (set `_target_` to its current module path)")


def load_exported(dirpath: str | Path, map_location: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the module from `dirpath/config.yaml` and load its weights (in eval mode)."""
    if dirpath is None:
        raise ValueError("no exported model folder given (dirpath is null): set it in the config, e.g. "
                         "drafter_dir=<fphi_real run>/export for experiment=eval/real_discrete")
    dirpath = Path(dirpath)
    hint = reproduce_hint(dirpath)
    if not (dirpath / "model.safetensors").is_file() or not (dirpath / "config.yaml").is_file():
        raise FileNotFoundError(f"no exported model at {str(dirpath)!r} (expected model.safetensors and config.yaml "
                                f"there): create it with `{hint}`, or point the config at an existing folder")
    net = build(OmegaConf.to_container(OmegaConf.load(dirpath / "config.yaml"), resolve=True))
    weights = dirpath / "model.safetensors"
    try:
        state = load_file(str(weights), device=str(map_location))
    except SafetensorError as err:
        raise ValueError(f"{str(weights)!r} is not a complete safetensors file ({err}): it is truncated or "
                         f"corrupted. Export it again (`{hint}`), or, for a shipped model, restore it "
                         f"(`git checkout -- checkpoints/{dirpath.name}`, or download the repository again)") from err
    net.load_state_dict(state)
    extra = dirpath / "extra.json"
    if extra.is_file() and hasattr(net, "backbone_id"):  # drafters: the backbone they were distilled from
        net.backbone_id = json.loads(extra.read_text()).get("backbone_id", "") or net.backbone_id
    return net.to(map_location).eval()
