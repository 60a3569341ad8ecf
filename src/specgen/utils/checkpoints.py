"""Exported model folders: weights (safetensors) + config.yaml + metrics.json + command.txt."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

# How each shipped checkpoint is made, for error messages.
REPRODUCE = {
    "vq_shapes": "python -m specgen.train experiment=vq_shapes",
    "ar_shapes": "python -m specgen.train experiment=ar_shapes",
}


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
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def atomic_savez(path: str | Path, **arrays) -> None:
    """np.savez to a temp file in the same folder, then rename: a half-written file is never picked up."""
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
    os.close(fd)
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


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
        atomic_write_text(dirpath / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if command is not None:
        atomic_write_text(dirpath / "command.txt", command.strip() + "\n")
    if extra is not None:
        atomic_write_text(dirpath / "extra.json", json.dumps(extra, indent=2, sort_keys=True) + "\n")
    return dirpath


def stored_weights_dtype(dirpath: str | Path, net: torch.nn.Module) -> str:
    """The dtype an exported folder stores `net`'s parameters in (`export`'s `weights_dtype`)."""
    from safetensors import safe_open

    params = dict(net.named_parameters())
    with safe_open(str(Path(dirpath) / "model.safetensors"), framework="pt") as f:  # reads one tensor, not all
        key = next((k for k in f.keys() if k in params), None)
        return "float32" if key is None else str(f.get_tensor(key).dtype).removeprefix("torch.")


def load_exported(dirpath: str | Path, map_location: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the module from `dirpath/config.yaml` and load its weights (in eval mode)."""
    from hydra.utils import instantiate

    dirpath = Path(dirpath)
    if not (dirpath / "model.safetensors").is_file() or not (dirpath / "config.yaml").is_file():
        name = dirpath.name
        hint = REPRODUCE.get(name, "the training command of this model (see the README)")
        raise FileNotFoundError(f"no exported model at {str(dirpath)!r} (expected model.safetensors and config.yaml "
                                f"there): create it with `{hint}`, or point the config at an existing folder")
    net = instantiate(OmegaConf.load(dirpath / "config.yaml"))
    net.load_state_dict(load_file(str(dirpath / "model.safetensors"), device=str(map_location)))
    extra = dirpath / "extra.json"
    if extra.is_file() and hasattr(net, "backbone_id"):  # drafters: the backbone they were distilled from
        net.backbone_id = json.loads(extra.read_text()).get("backbone_id", "") or net.backbone_id
    return net.to(map_location).eval()
