"""The CSpD draft sized as the paper's pairs, and its distillation on both CFG branches."""
import numpy as np
import pytest
import torch

from specgen.backbones.mar import ShapesMAR
from specgen.modules.mar_module import MARDraftModule
from specgen.utils.checkpoints import export, load_exported


def test_quarter_preset_is_about_a_quarter_of_the_target():
    size = lambda preset: sum(p.numel() for p in ShapesMAR(grid_size=16, token_dim=4, patch_size=2,
                                                            preset=preset).parameters())
    assert 0.2 < size("quarter") / size("small") < 0.3


def _step(module, batch, seed=1):
    torch.manual_seed(seed), np.random.seed(seed)  # the same masks, timesteps and noise
    return float(module.training_step(batch, 0).detach())


def test_uncond_prob_distils_the_unconditional_branch(tmp_path):
    """uncond_prob=1: every image is distilled with the null condition, so the prompts do not matter;
    uncond_prob=0 distils the conditional branch, where they do."""
    cfg = {"_target_": "specgen.backbones.mar.ShapesMAR", "grid_size": 4, "token_dim": 3, "preset": "tiny",
           "sample_steps": 10}
    torch.manual_seed(0)
    target = ShapesMAR(**{k: v for k, v in cfg.items() if k != "_target_"})
    with torch.no_grad():  # a fresh head outputs zeros whatever the condition: perturb every weight
        for p in target.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export(tmp_path / "target", target, cfg)
    latents = torch.randn(4, 16, 3)
    a = {"latents": latents, "prompt": ["a red circle", "two squares", "a blue cross", "a green triangle"]}
    b = {"latents": latents, "prompt": ["a blue cross", "a red circle", "two squares", "a red circle"]}
    losses = {}
    for prob in (0.0, 1.0):
        torch.manual_seed(2)
        draft = ShapesMAR(**{k: v for k, v in cfg.items() if k != "_target_"}).eval()
        module = MARDraftModule(draft, str(tmp_path / "target"), data_weight=0.0, uncond_prob=prob)
        losses[prob] = (_step(module, a), _step(module, b))
    assert losses[1.0][0] == pytest.approx(losses[1.0][1], rel=1e-6)
    assert abs(losses[0.0][0] - losses[0.0][1]) > 1e-4 * losses[0.0][0]
    with pytest.raises(ValueError, match=r"module.uncond_prob must lie in \[0.0, 1.0\], got 1.5"):
        MARDraftModule(load_exported(tmp_path / "target"), str(tmp_path / "target"), uncond_prob=1.5)
