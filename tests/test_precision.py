"""The embedded backbone in bfloat16 (`generator.dtype`): weights and states in bf16, logits in float32, its images
cached apart from float32's, and a clear refusal of what it cannot run."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from specgen.backbones.loading import load_shapes_generator
from specgen.backbones.protocol import image_states
from specgen.decoding import ar, ssd_carry
from specgen.decoding.sampling import guided_logits, make_rngs
from specgen.evaluation.runner import image_cache_dir
from specgen.utils.checkpoints import load_exported

PROMPTS = ["a photo of a red circle", "a drawing of two squares"]


def _pair(tiny_exports):
    fp32 = load_shapes_generator(str(tiny_exports / "ar"), str(tiny_exports / "vq"))
    bf16 = load_shapes_generator(str(tiny_exports / "ar"), str(tiny_exports / "vq"), dtype="bfloat16")
    return fp32, bf16


def test_bf16_backbone_gives_float32_logits_close_to_float32s(tiny_exports):
    fp32, bf16 = _pair(tiny_exports)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    assert bf16.identity == fp32.identity  # the same weights: a drafter trained on them still checks out
    torch.manual_seed(0)
    codes = torch.randint(0, fp32.grid.num_visual, (len(PROMPTS), fp32.grid.height, fp32.grid.width))
    rows32, rows16 = fp32.prompts(PROMPTS).rows(guided=True), bf16.prompts(PROMPTS).rows(guided=True)
    h32, _ = image_states(fp32, rows32, codes)
    h16, _ = image_states(bf16, rows16, codes)
    assert h16.dtype == torch.bfloat16 and h32.dtype == torch.float32
    for logits in (bf16.visual_logits(h16), guided_logits(bf16, h16, 2.0)):
        assert logits.dtype == torch.float32
    p32 = torch.softmax(guided_logits(fp32, h32, 2.0), -1)
    p16 = torch.softmax(guided_logits(bf16, h16, 2.0), -1)
    tv = 0.5 * (p32 - p16).abs().sum(-1)
    assert 0 < tv.max() < 0.05, tv.max()  # bf16 moves the distributions, by little


def test_decoders_run_in_bf16_and_drafted_logits_are_float32(tiny_exports):
    _, bf16 = _pair(tiny_exports)
    fphi = load_exported(str(tiny_exports / "fphi"))
    p = bf16.prompts(PROMPTS)
    with torch.inference_mode():
        a, a_stats = ar.generate(bf16, p, cfg_scale=2.0, rngs=make_rngs([0, 1]))
        s, s_stats = ssd_carry.generate(bf16, p, fphi, cfg_scale=2.0, rngs=make_rngs([0, 1]))
    g = bf16.grid
    for out in (a, s):
        assert out.shape == (len(PROMPTS), g.height, g.width)
        assert int(out.min()) >= 0 and int(out.max()) < g.num_visual
    assert float(a_stats["nfe"]) == g.height * g.width
    assert 0 < float(s_stats["nfe"]) <= g.height * g.width
    assert next(fphi.parameters()).dtype == torch.bfloat16  # the drafter follows the states it is fed
    from specgen.drafters.fphi import TokenDrafter  # the token-id drafter's logits are float32 too

    tok = TokenDrafter(bf16.hidden_size, g.num_visual, preset="xs").to(torch.bfloat16)
    e = bf16.embed_visual(torch.zeros(3, dtype=torch.long))
    assert e.dtype == torch.bfloat16 and tok(e, e, "down").dtype == torch.float32


def test_bf16_images_are_cached_apart_and_float32_paths_are_unchanged(tiny_exports, tmp_path):
    fp32, bf16 = _pair(tiny_exports)
    dec = OmegaConf.create({"fn": {"_target_": "specgen.decoding.ar.generate", "cfg_scale": 2.0}})
    p32, p16 = image_cache_dir(str(tmp_path), fp32, dec), image_cache_dir(str(tmp_path), bf16, dec)
    assert p32.parent.name == fp32.identity  # float32 caches written before the option keep their place
    assert p16.parent.name == f"{fp32.identity}-bfloat16" and p16.name == p32.name


def test_bad_precisions_are_refused_by_name(tiny_exports):
    with pytest.raises(ValueError, match=r"generator.dtype='float8'"):
        load_shapes_generator(str(tiny_exports / "ar"), str(tiny_exports / "vq"), dtype="float8")
    with pytest.raises(ValueError, match=r"only the embedded discrete backbone"):
        load_shapes_generator(str(tiny_exports / "mar"), str(tiny_exports / "kl"), dtype="bfloat16")


def test_the_analyses_load_the_backbone_in_the_precision_asked_for(tiny_exports):
    import argparse

    from specgen.analysis.row_passes import add_world_args, load_world

    ap = argparse.ArgumentParser()
    add_world_args(ap, prompts=2)
    world = ["--backbone", str(tiny_exports / "ar"), "--tokenizer", str(tiny_exports / "vq"),
             "--drafter", str(tiny_exports / "fphi")]
    assert load_world(ap.parse_args(world))[0].dtype == torch.float32
    assert load_world(ap.parse_args(world + ["--dtype", "bfloat16"]))[0].dtype == torch.bfloat16
