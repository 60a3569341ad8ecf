"""Draft-model speculative decoding: a smaller AR model over the same vocabulary and token grid
drafts `window` tokens autoregressively (with its own KV cache and CFG rows); the target verifies
them in one pass with lossless speculative sampling (`spec1d.speculate`).
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts
from specgen.decoding.sampling import sample_probs
from specgen.decoding.spec1d import speculate
from specgen.decoding.state import SpecState
from specgen.utils.validate import expect_float, expect_int


def _model_drafter(draft: SpecState):
    def propose(st: SpecState, frontier: torch.Tensor, lo: int, hi: int):
        B, dev = st.B, st.seq.device
        vis, dvis = st.visual_positions(), draft.visual_positions()  # the two prompts may differ in length
        draft.set_tokens(dvis[:lo], st.visual(vis[:lo]))  # sync the final tokens
        draft.hid.release(int(dvis[lo]) - 1)
        span = hi - lo
        tokens = torch.zeros(B, span, dtype=torch.long, device=dev)
        q = torch.zeros(B, span, st.g.num_visual, device=dev)
        for i in range(lo, hi):
            draft.target_pass(int(dvis[i]))  # the draft model's state before token i
            qi = draft.dist(draft.hid[:, int(dvis[i]) - 1])
            known = i < frontier
            tok = torch.where(known, st.visual(vis[i:i + 1])[:, 0], sample_probs(qi, st.rngs))
            draft.set_tokens(dvis[i:i + 1], tok[:, None])
            tokens[:, i - lo], q[:, i - lo] = tok, qi
        st.draft_calls = draft.nfe
        idx = torch.arange(lo, hi, device=dev)
        drafted = (idx[None, :] >= frontier[:, None]) & (idx[None, :] < frontier[:, None] + span)
        return tokens, q, drafted
    return propose


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, drafter: DiscreteBackbone,
             cfg_scale: float = 3.0, temperature: float = 1.0, top_k: int | None = None, rngs=None,
             window: int = 4):
    """Sample visual codes (B, H, W), `window` draft tokens per target pass. Returns (codes, stats)."""
    expect_float("temperature", temperature, 0.0)
    expect_int("window", window, 1)
    if drafter.grid != backbone.grid:
        raise ValueError(f"the draft model's token grid {drafter.grid} differs from the target's {backbone.grid}: "
                         f"train the draft model on the same tokenizer and layout")
    st = SpecState(backbone, prompts, cfg_scale, temperature, top_k, rngs)
    draft = SpecState(drafter, drafter.prompts(list(prompts.texts)), cfg_scale, temperature, top_k, rngs)
    draft.target_pass(draft.g.prefix_len)
    stats = speculate(st, _model_drafter(draft), window=window)
    return st.codes(), stats
