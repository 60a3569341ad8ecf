"""Shared pieces of the decoder tests: tiny backbones and noisy drafters, the default's carry options, an exact
joint distribution of a small grid and its chi-square test."""
import itertools

import numpy as np
import torch
from scipy import stats

from specgen.backbones.shapes_llama import ShapesLlama
from specgen.decoding.ssd_carry.tails import Redraft, Reweight
from specgen.drafters.fphi import FPhi
from specgen.drafters.mtp import MTPHeads
from helpers import tiny_llama

PROMPTS = ["a photo of a red circle", "two squares", "a large blue cross in the top left ."]


def tiny(eol: bool, codes: int = 24, grid: int = 5, sharpen: float = 20.0) -> ShapesLlama:
    return tiny_llama(eol, codes, grid, sharpen)


def noisy_drafter(m: ShapesLlama, left: bool = False) -> FPhi:
    """An imperfect drafter (many rejections); `left`: with row and left context (drafts a down row left to right)."""
    torch.manual_seed(1)
    d = FPhi(m.hidden_size, "xs", **(dict(context_kernel=3, left_context=True) if left else {}))
    for net in d.nets.values():
        torch.nn.init.normal_(net[-1].weight, std=0.05)
    if left:
        for lin in (d.left_in, d.left_block.mlp[-1]):
            torch.nn.init.normal_(lin.weight, std=0.05)
    return d


def noisy_heads(m: ShapesLlama, k: int = 3) -> MTPHeads:
    torch.manual_seed(3)
    heads = MTPHeads(m.hidden_size, k)
    for net in heads.nets.values():
        torch.nn.init.normal_(net[-1].weight, std=0.05)
    return heads


def draft_model(m: ShapesLlama, seed: int = 4) -> ShapesLlama:
    torch.manual_seed(seed)
    g = m.grid
    d = ShapesLlama(num_codes=g.num_visual, grid_size=g.height, eol=g.eol_id is not None, preset="tiny").eval()
    with torch.no_grad():
        d.model.lm_head.weight.mul_(3)
    return d


def default_carry(**kw) -> dict:
    """`ssd_carry.generate` options of the default `ssd` config (configs/decoding/ssd.yaml), with `kw` replaced."""
    return {**dict(rounds=0, max_window_rows=2, max_lead=2, draft_temperature=0.5, second_row_wait=2,
                   tails=[Redraft(4, rows=1), Reweight(2)]), **kw}


def exact_joint(m: ShapesLlama, prompt: str, cfg_scale: float) -> np.ndarray:
    """Exact probability of every image of the model's (small) grid (temperature 1), by enumeration: (V ** (H W),)
    in row-major order, one batched forward for the conditional and one for the unconditional prompt."""
    g = m.grid
    V, n = g.num_visual, g.height * g.width
    cells = torch.tensor(list(itertools.product(range(V), repeat=n)))  # (V ** n, n)
    seqs = g.grid_to_sequence(cells.view(-1, g.height, g.width))
    prompts = [m.prompt_ids([prompt])] + ([m.null_prompt_ids(1)] if cfg_scale != 1 else [])
    cols = [g.position(r, c) - 1 for r, c in itertools.product(range(g.height), range(g.width))]  # logits before
    with torch.no_grad():
        lv = [m(torch.cat([ids.expand(len(cells), -1), seqs], 1))[:, cols, g.visual_start:g.visual_start + V]
              for ids in prompts]
    logits = lv[0] if cfg_scale == 1 else lv[1] + cfg_scale * (lv[0] - lv[1])
    lp = torch.log_softmax(logits.double(), -1).gather(-1, cells[..., None]).squeeze(-1).sum(1)
    return torch.softmax(lp, 0).numpy()


def gof_pvalue(out: torch.Tensor, joint: np.ndarray) -> float:
    """Chi-square p-value of sampled images (N, H, W) against `exact_joint` (cells with expected count < 5 pooled)."""
    n, tokens = out.shape[0], out[0].numel()
    V = round(len(joint) ** (1 / tokens))
    flat = (out.reshape(n, tokens) * V ** torch.arange(tokens - 1, -1, -1)).sum(1).numpy()
    observed = np.bincount(flat, minlength=len(joint))
    expected = joint * n
    keep = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    return stats.chisquare(obs, exp).pvalue


def spy_fed(monkeypatch, m):
    """Record the positions each target forward feeds (one entry per call, the prefill first)."""
    fed, orig = [], m.forward_embeds

    def spy(embeds, slots, cache, attn_mask=None):
        fed.append(embeds.shape[1])
        return orig(embeds, slots, cache, attn_mask)
    monkeypatch.setattr(m, "forward_embeds", spy)
    return fed
