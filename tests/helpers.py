"""Compose the repo's real Hydra configs for tests, with every path under a temporary folder."""
from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

from specgen.utils.hydra import CONFIG_DIR


def compose_cfg(name: str, overrides: list[str], tmp_path) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "out")
        cfg.paths.log_dir = str(tmp_path / "logs")
        cfg.paths.data_dir = str(tmp_path / "data")
        cfg.paths.cache_dir = str(tmp_path / "cache")
        cfg.paths.checkpoint_dir = str(tmp_path / "checkpoints")
    return cfg


def tiny_llama(eol: bool, codes: int = 24, grid: int = 5, sharpen: float = 20.0, seed: int = 0):
    """A tiny random ShapesLlama whose head is sharpened so that greedy outputs vary across positions."""
    import torch

    from specgen.backbones.shapes_llama import ShapesLlama

    torch.manual_seed(seed)
    m = ShapesLlama(num_codes=codes, grid_size=grid, eol=eol, preset="tiny").eval()
    with torch.no_grad():
        m.model.lm_head.weight.mul_(sharpen)
    return m


def check_lossless_cspd(target, draft, prompts: list, opts: dict, max_proposals: int = 64, min_accept: float = 0.1,
                        cells=((0, 0), (3, 0)), product=((0, 0), (2, 0))) -> dict:
    """Lossless CSpD (exact ratio, prefix acceptance, stepwise verification) against target-only sampling of the
    same prompts: a two-sample KS test per listed token cell, on the sum and on a product of two cells, must not
    tell them apart (p > 1e-3), while the draft's own samples must be told apart on the sum (the test's power).
    Returns CSpD's stats (acceptance within [min_accept, 0.95], no residual fallback, checked here)."""
    from scipy import stats as st_

    from specgen.decoding import cspd, mar
    from specgen.decoding.sampling import make_rngs

    n = len(prompts)
    ref, _ = mar.generate(target, prompts, make_rngs(range(n)), **opts)
    out, st = cspd.generate(target, prompts, make_rngs(range(n, 2 * n)), draft, gamma=2, prefill_ratio=0.0,
                            ratio="exact", acceptance="prefix", verify="stepwise", max_proposals=max_proposals, **opts)
    assert min_accept < st["accept_rate"] < 0.95 and st["fallbacks"] == 0
    (a, i), (b, j) = product
    reads = [lambda t, c=c: t[:, c[0], c[1]] for c in cells]
    for stat in (*reads, lambda t: t.sum((1, 2)), lambda t: t[:, a, i] * t[:, b, j]):
        assert st_.ks_2samp(stat(out).numpy(), stat(ref).numpy()).pvalue > 1e-3
    draft_only, _ = mar.generate(draft, prompts, make_rngs(range(n)), **opts)
    assert st_.ks_2samp(draft_only.sum((1, 2)).numpy(), ref.sum((1, 2)).numpy()).pvalue < 1e-3
    return st


def tiny_drafter_overrides(name: str, overrides: list[str], tiny_exports, tmp_path) -> list[str]:
    """Overrides that point every strategy's drafter of a composed config at the matching tiny export, so that a
    strategy added to an experiment is covered without editing the test."""
    from pathlib import Path

    cfg = compose_cfg(name, overrides, tmp_path)
    kinds = {"fphi": "fphi", "mtp": "mtp", "ar_": "ar"}
    out = []
    for s, node in cfg.strategies.items():
        drafter = node.fn.get("drafter") if "fn" in node else None
        if drafter is None or "dirpath" not in drafter:
            continue
        base = Path(drafter.dirpath).name
        kind = next((v for k, v in kinds.items() if base.startswith(k)), None)
        if kind is None:
            raise ValueError(f"strategy {s!r}: no tiny export for a drafter at {base!r}; add its prefix to `kinds`")
        out.append(f"strategies.{s}.fn.drafter.dirpath={Path(tiny_exports) / kind}")
    return out
