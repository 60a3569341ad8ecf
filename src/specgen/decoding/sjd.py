"""Speculative Jacobi decoding (SJD): a window of draft tokens after the frontier is refined by
Jacobi iterations; each draft is the previous pass's target prediction at its index (q = that p),
verified by probabilistic acceptance with residual resampling (`spec1d.speculate`). Indices never
predicted yet are initialised by `init`: 'random' (uniform codes) or 'vertical' (the code one row
up, q one-hot on it; random on the first row).

Memory: a draft's q is the target p of the previous pass at its index, so only the indices from the slowest
image's frontier to one past the window are kept (a `StateWindow` over visual indices, released as the frontier
moves), not (B, N, V) distributions of the whole image (about 1 GB per image at Emu3's 8100 x 32768).
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts
from specgen.decoding.sampling import sample_probs
from specgen.decoding.spec1d import speculate
from specgen.decoding.state import SpecState, StateWindow
from specgen.utils.validate import expect_float, expect_int

INITS = ("random", "vertical")


class _Jacobi:
    def __init__(self, st: SpecState, init: str):
        g, dev = st.g, st.seq.device
        self.init, self.W = init, g.width
        N, V = g.num_visual_tokens, g.num_visual
        self.prev = StateWindow(st.B, V, dev, torch.float32)  # last target p seen at each visual index, a window
        self.seen = torch.zeros(st.B, N, dtype=torch.bool, device=dev)

    def observe(self, idx: torch.Tensor, p: torch.Tensor) -> None:
        # the indices of one pass are contiguous (the span and one past it)
        self.prev.write(int(idx[0]), p.float())
        self.seen[:, idx] = True

    def __call__(self, st: SpecState, frontier: torch.Tensor, lo: int, hi: int):
        B, V, dev = st.B, st.g.num_visual, st.seq.device
        self.prev.release(lo)  # lo (the slowest frontier) never moves back: indices before it are final
        idx = torch.arange(lo, hi, device=dev)
        fresh = ~self.seen[:, idx]
        rows = torch.arange(B, device=dev)[:, None]
        seen = bool((~fresh).any())  # none seen yet: nothing to read (the first round)
        q = self.prev[rows, idx[None]] if seen else torch.zeros(B, hi - lo, V, device=dev)  # (B, span, V)
        init_q = torch.full((B, hi - lo, V), 1.0 / V, device=dev)
        if self.init == "vertical":
            above = idx - self.W
            vis = st.visual_positions()
            up = st.visual(vis[above.clamp_min(0)])  # (B, span) codes one row up (current values)
            onehot = torch.nn.functional.one_hot(up.clamp(0, V - 1), V).float()  # unset entries are masked below
            init_q = torch.where((above >= 0)[None, :, None], onehot, init_q)
        q = torch.where(fresh[..., None], init_q, q)
        tokens = sample_probs(q, st.rngs)
        drafted = (idx[None, :] >= frontier[:, None])
        return tokens, q, drafted


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, rngs=None, window: int = 16,
             init: str = "random"):
    """Sample visual codes (B, H, W) by speculative Jacobi decoding. Returns (codes, stats)."""
    expect_float("temperature", temperature, 0.0)
    expect_int("window", window, 1)
    if init not in INITS:
        raise ValueError(f"unknown SJD init {init!r}: expected one of {INITS}")
    st = SpecState(backbone, prompts, cfg_scale, temperature, top_k, rngs)
    jacobi = _Jacobi(st, init)
    stats = speculate(st, jacobi, window=window, observe=jacobi.observe)
    stats["dist_slots"] = jacobi.prev.peak_slots  # the most visual indices whose p was held at once
    return st.codes(), stats
