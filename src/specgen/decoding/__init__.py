"""Decoding strategies: tensors in, tensors out, one file per algorithm, one signature:

    generate(backbone, prompt_ids, [drafter,] cfg_scale=..., temperature=..., top_k=..., generators=..., **options)
        -> (codes (B, H, W), stats)
"""
from __future__ import annotations

import importlib

STRATEGIES = ("ar", "ssd", "sjd", "zipar", "mtp1d", "specdec")


def get(name: str):
    """The `generate` function of a strategy by name."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown decoding strategy {name!r}: known strategies are {', '.join(STRATEGIES)}")
    return importlib.import_module(f"specgen.decoding.{name}").generate
