"""Lossless CSpD (configs/decoding/cspd_lossless.yaml: exact ratio, prefix acceptance, stepwise verification) on
the real families' modules, tiny and random: MAR's release layout, xAR's and Harmon's (slow). A draft near the
target is accepted often but not always, the residual never falls back, and the tokens CSpD gives cannot be told from target-only
sampling (two-sample KS per position, on the sum and on a product of two positions) while the draft's own
samples can (the test has the power to see a wrong distribution)."""
import pytest
import torch

from specgen.backbones.mar_release import build_mar_release
from specgen.backbones.xar import XAR
from helpers import check_lossless_cspd
from test_mar_release import mar_state_dict
from test_xar import xar_state_dict

N = 2000  # images per sampler; one token dimension, four tokens (MAR) or four cells of one token (xAR)


def _near(sd: dict, scale: float, keep=lambda key: False) -> dict:
    """sd with every float tensor but the kept ones (and the fixed tables) moved by scale x N(0, 1)."""
    g = torch.Generator().manual_seed(5)
    fixed = lambda k: keep(k) or k == "mask" or ".rope." in k
    return {k: v if fixed(k) else v + scale * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def mar_pair():
    """MAR's release layout (2x2 tokens of dim 1); the draft differs in the DiffLoss head. Both sample with x0
    clipped at 10 (`x0_clip`, the embedded MAR's guard), not the release's unclipped x0: at t = 999 (a ~ 3e-5)
    that multiplies any draft-target difference of random heads by ~1/sqrt(a), so no draft would be both
    accepted and told apart (a trained head predicts eps ~ x_t there)."""
    sd = mar_state_dict(D=16, enc=1, dec=1, hw=16, hd=1, L=4, buf=2, d=1, classes=4)
    sd = {k: v * 0.1 if "final_layer.linear" in k else v for k, v in sd.items()}  # epsilon of order 1
    models = []
    for weights in (sd, _near(sd, 0.03, keep=lambda k: not k.startswith("diffloss"))):
        m = build_mar_release(sizes=(16, 1, 1, 4, 16, 1), num_classes=4, buffer_size=2, grid_size=2, token_dim=1,
                              sample_steps=4)
        m.load_state_dict(weights)
        m.diffusion.x0_clip = 10.0
        models.append(m.requires_grad_(False))
    return (*models, dict(num_iter=3, cfg_scale=2.0))


def xar_pair():
    """xAR's release layout on a 2x2 grid with cells of one token of dim 1 (4 next-X units), the release's SDE."""
    sd = xar_state_dict(D=16, enc=1, dec=1, heads=1, grid=2, unit=1, c=1, classes=4)
    models = []
    for weights in (sd, _near(sd, 0.1)):
        m = XAR((16, 1, 1, 1), grid_size=2, unit_size=1, token_dim=1, num_classes=4, sample_steps=4).eval()
        m.load_state_dict(weights)
        models.append(m.requires_grad_(False))
    return (*models, dict(num_iter=4, cfg_scale=2.0, cfg_schedule="linear_steps"))


@pytest.mark.parametrize("family", ["mar_release", "xar"])
def test_lossless_cspd_samples_the_target_on_the_real_families(family):
    target, draft, opts = {"mar_release": mar_pair, "xar": xar_pair}[family]()
    prompts = [1] * N
    st = check_lossless_cspd(target, draft, prompts, opts)
    assert st["proposals"] > 0


@pytest.mark.slow
def test_lossless_cspd_samples_the_target_on_harmon(tmp_path):
    """Harmon (tiny Qwen2 + MAR head of 16 tokens x 3 dims): the draft's head's final layer moved by 0.01 x N(0, 1).
    Both clip x0 at 10 as in the MAR-release case. With 48 dimensions per image the draft's own samples are told
    apart on the sum; acceptance is low (about 0.03), so the check covers accepted tokens, residual draws and the
    prefix rule together."""
    from test_harmon import _load, tiny_folder

    t = _load(tiny_folder(tmp_path)).requires_grad_(False)
    d = _load(tmp_path).requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "diffloss" in name and "final_layer" in name:
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    t.mar.diffusion.x0_clip = d.mar.diffusion.x0_clip = 10.0
    n = 1000
    prompts = t.prompts(["a red circle"] * n)
    opts = dict(num_iter=3, cfg_scale=2.0)
    check_lossless_cspd(t, d, prompts, opts, min_accept=0.01, cells=((0, 0), (15, 2)), product=((0, 0), (5, 1)))
