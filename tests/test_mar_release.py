"""MAR's release behind the continuous protocol: a tiny checkpoint written with MAR's own parameter names and
shapes (listed here from its module layout, not from this repo's model) loads and computes what its tensors
say; the KL-16 decoder reads LDM's layout; mismatched sizes and unsafe files are refused by name."""
import argparse
import collections
import math

import pytest
import torch

from specgen.backbones.continuous import ContinuousBackbone
from specgen.backbones.mar_release import PRESETS, load_mar_release
from specgen.decoding import cspd, mar
from specgen.decoding.sampling import make_rngs
from specgen.tokenizers.kl16 import load_kl16

class Record:
    """An arbitrary class in a checkpoint: unpickling it would run this module's code."""


TINY = dict(sizes=(32, 2, 1, 4, 16, 2), num_classes=10, buffer_size=8, grid_size=4, token_dim=3, sample_steps=5)


def mar_state_dict(D=32, enc=2, dec=1, hw=16, hd=2, L=16, buf=8, d=3, classes=10, seed=0) -> dict:
    """Random tensors under the names and shapes of LTH14/mar's `MAR` (timm Blocks, DiffLoss SimpleMLPAdaLN)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"class_emb.weight": (classes, D), "fake_latent": (1, D), "z_proj.weight": (D, d), "z_proj.bias": (D,),
              "z_proj_ln.weight": (D,), "z_proj_ln.bias": (D,), "encoder_pos_embed_learned": (1, L + buf, D),
              "encoder_norm.weight": (D,), "encoder_norm.bias": (D,), "decoder_embed.weight": (D, D),
              "decoder_embed.bias": (D,), "mask_token": (1, 1, D), "decoder_pos_embed_learned": (1, L + buf, D),
              "decoder_norm.weight": (D,), "decoder_norm.bias": (D,), "diffusion_pos_embed_learned": (1, L, D)}
    for part, depth in (("encoder_blocks", enc), ("decoder_blocks", dec)):
        for i in range(depth):
            for name, shape in (("norm1.weight", (D,)), ("norm1.bias", (D,)), ("attn.qkv.weight", (3 * D, D)),
                                ("attn.qkv.bias", (3 * D,)), ("attn.proj.weight", (D, D)), ("attn.proj.bias", (D,)),
                                ("norm2.weight", (D,)), ("norm2.bias", (D,)), ("mlp.fc1.weight", (4 * D, D)),
                                ("mlp.fc1.bias", (4 * D,)), ("mlp.fc2.weight", (D, 4 * D)), ("mlp.fc2.bias", (D,))):
                shapes[f"{part}.{i}.{name}"] = shape
    net = {"time_embed.mlp.0.weight": (hw, 256), "time_embed.mlp.0.bias": (hw,), "time_embed.mlp.2.weight": (hw, hw),
           "time_embed.mlp.2.bias": (hw,), "cond_embed.weight": (hw, D), "cond_embed.bias": (hw,),
           "input_proj.weight": (hw, d), "input_proj.bias": (hw,), "final_layer.linear.weight": (2 * d, hw),
           "final_layer.linear.bias": (2 * d,), "final_layer.adaLN_modulation.1.weight": (2 * hw, hw),
           "final_layer.adaLN_modulation.1.bias": (2 * hw,)}
    for j in range(hd):
        for name, shape in (("in_ln.weight", (hw,)), ("in_ln.bias", (hw,)), ("mlp.0.weight", (hw, hw)),
                            ("mlp.0.bias", (hw,)), ("mlp.2.weight", (hw, hw)), ("mlp.2.bias", (hw,)),
                            ("adaLN_modulation.1.weight", (3 * hw, hw)), ("adaLN_modulation.1.bias", (3 * hw,))):
            net[f"res_blocks.{j}.{name}"] = shape
    shapes.update({f"diffloss.net.{k}": v for k, v in net.items()})
    return collections.OrderedDict((k, 0.3 * torch.randn(s, generator=g)) for k, s in shapes.items())


def save_release(path, sd):
    """As MAR's training script saves: weights, EMA weights, optimizer state, epoch and the argparse args."""
    torch.save({"model": sd, "model_ema": sd, "optimizer": {}, "epoch": 799,
                "args": argparse.Namespace(model="mar_base", diffloss_d=2)}, path)


def head_direct(sd, x, t, z):
    """MAR's DiffLoss MLP written out from the raw tensors: eps and v for x (N, d), timesteps t (N,), z (N, D)."""
    w = lambda k: sd[f"diffloss.net.{k}"]
    lin = lambda h, k: h @ w(f"{k}.weight").T + w(f"{k}.bias")
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
    args = t.float()[:, None] * freqs[None]
    temb = lin(torch.nn.functional.silu(lin(torch.cat([args.cos(), args.sin()], -1), "time_embed.mlp.0")),
               "time_embed.mlp.2")
    y = temb + lin(z, "cond_embed")
    h = lin(x, "input_proj")
    for j in range(sum(1 for k in sd if k.endswith("in_ln.weight"))):
        shift, scale, gate = lin(torch.nn.functional.silu(y), f"res_blocks.{j}.adaLN_modulation.1").chunk(3, -1)
        hn = torch.nn.functional.layer_norm(h, h.shape[-1:], w(f"res_blocks.{j}.in_ln.weight"),
                                            w(f"res_blocks.{j}.in_ln.bias"), 1e-6)
        m = hn * (1 + scale) + shift
        h = h + gate * lin(torch.nn.functional.silu(lin(m, f"res_blocks.{j}.mlp.0")), f"res_blocks.{j}.mlp.2")
    shift, scale = lin(torch.nn.functional.silu(y), "final_layer.adaLN_modulation.1").chunk(2, -1)
    return lin(torch.nn.functional.layer_norm(h, h.shape[-1:], eps=1e-6) * (1 + scale) + shift, "final_layer.linear")


def test_release_checkpoint_loads_and_its_head_is_the_release_formula(tmp_path):
    sd = mar_state_dict()
    save_release(tmp_path / "checkpoint-last.pth", sd)
    m = load_mar_release(str(tmp_path / "checkpoint-last.pth"), **TINY)
    assert isinstance(m, ContinuousBackbone) and (m.seq_len, m.token_dim, m.num_steps) == (16, 3, 5)
    g = torch.Generator().manual_seed(1)
    x, zc, zu = torch.randn(6, 3, generator=g), torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    diff = m.diffusion
    for i in (4, 2, 0):
        t = torch.full((6,), int(diff.timesteps[i]))
        c, u = head_direct(sd, x, t, zc), head_direct(sd, x, t, zu)
        # guidance on epsilon, the conditional row's variance channel (MAR's forward_with_cfg)
        out = torch.cat([u[:, :3] + 2.5 * (c[:, :3] - u[:, :3]), c[:, 3:]], -1)
        ac, ac_prev = diff.s_ac[i].float(), diff.s_ac_prev[i].float()
        x0 = (x - (1 - ac).sqrt() * out[:, :3]) / ac.sqrt()
        beta = 1 - ac / ac_prev
        mean = ac_prev.sqrt() * beta / (1 - ac) * x0 + (1 - beta).sqrt() * (1 - ac_prev) / (1 - ac) * x
        got_mean, got_var = m.transition(x, i, zc, zu, 2.5)
        assert torch.allclose(got_mean, mean, atol=1e-4), i
        if i > 0:
            post = beta * (1 - ac_prev) / (1 - ac)
            frac = (out[:, 3:] + 1) / 2
            assert torch.allclose(got_var, torch.exp(frac * beta.log() + (1 - frac) * post.log()), rtol=1e-4)
        else:
            assert float(got_var.abs().max()) == 0
    cond, null = m.conditioning(["3", 7], guided=True)
    assert torch.equal(cond[0, 0], sd["class_emb.weight"][3]) and torch.equal(null[1, -1], sd["fake_latent"][0])


def test_release_loader_refuses_a_mismatched_size_and_an_unsafe_file(tmp_path):
    save_release(tmp_path / "ck.pth", mar_state_dict())
    with pytest.raises(ValueError, match=r"'fake_latent' has shape \(1, 32\) in the checkpoint, the configured "
                                         r"model has \(1, 1024\).*set generator.size"):
        load_mar_release(str(tmp_path / "ck.pth"), **{**TINY, "sizes": None}, size="large")
    with pytest.raises(ValueError, match=r"'fake_latent' has shape \(1, 32\) .* \(1, 48\)"):
        load_mar_release(str(tmp_path / "ck.pth"), **{**TINY, "sizes": (48, 2, 1, 4, 16, 2)})
    with pytest.raises(ValueError, match=r"no 'decoder_blocks.1.norm1.weight' in the checkpoint"):
        load_mar_release(str(tmp_path / "ck.pth"), **{**TINY, "sizes": (32, 2, 2, 4, 16, 2)})
    with pytest.raises(ValueError, match=r"more than 1 encoder_blocks"):
        load_mar_release(str(tmp_path / "ck.pth"), **{**TINY, "sizes": (32, 1, 1, 4, 16, 2)})
    with pytest.raises(ValueError, match=r"'encoder_pos_embed_learned' has shape \(1, 24, 32\) in the checkpoint, "
                                         r"the configured model has \(1, 72, 32\).*grid 8"):
        load_mar_release(str(tmp_path / "ck.pth"), **{**TINY, "grid_size": 8})
    torch.save({"model_ema": mar_state_dict(), "extra": Record()}, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match="cannot be read with weights_only=True .* allow_pickle=true"):
        load_mar_release(str(tmp_path / "odd.pth"), **TINY)
    assert load_mar_release(str(tmp_path / "odd.pth"), allow_pickle=True, **TINY).seq_len == 16
    with pytest.raises(FileNotFoundError, match="generator.weights_path"):
        load_mar_release(str(tmp_path / "none.pth"), **TINY)
    with pytest.raises(ValueError, match="unknown MAR size 'xl'"):
        load_mar_release(str(tmp_path / "ck.pth"), size="xl")
    assert PRESETS["huge"] == (1280, 20, 20, 16, 1536, 12)


def kl16_state_dict(ch=32, mults=(1, 2), blocks=1, z=4, seed=0) -> dict:
    """Random tensors under the names and shapes of LDM's KL decoder (post_quant_conv + decoder.*), as in
    kl16.ckpt's "model", plus encoder keys that the decoder must ignore."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"post_quant_conv.weight": (z, z, 1, 1), "post_quant_conv.bias": (z,),
              "quant_conv.weight": (2 * z, 2 * z, 1, 1), "encoder.conv_in.weight": (ch, 3, 3, 3)}
    conv = lambda name, cin, cout, k: shapes.update({f"{name}.weight": (cout, cin, k, k), f"{name}.bias": (cout,)})
    norm = lambda name, c: shapes.update({f"{name}.weight": (c,), f"{name}.bias": (c,)})

    def resnet(name, cin, cout):
        norm(f"{name}.norm1", cin), conv(f"{name}.conv1", cin, cout, 3), norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)
    c = ch * mults[-1]
    conv("decoder.conv_in", z, c, 3)
    resnet("decoder.mid.block_1", c, c), resnet("decoder.mid.block_2", c, c), norm("decoder.mid.attn_1.norm", c)
    for p in ("q", "k", "v", "proj_out"):
        conv(f"decoder.mid.attn_1.{p}", c, c, 1)
    for level in reversed(range(len(mults))):
        out = ch * mults[level]
        for j in range(blocks + 1):
            resnet(f"decoder.up.{level}.block.{j}", c if j == 0 else out, out)
        if level != 0:
            conv(f"decoder.up.{level}.upsample.conv", out, out, 3)
        c = out
    norm("decoder.norm_out", c), conv("decoder.conv_out", c, 3, 3)
    return {k: 0.1 * torch.randn(s, generator=g) for k, s in shapes.items()}


def test_kl16_decoder_reads_the_release_layout_and_decodes_into_images(tmp_path):
    sd = kl16_state_dict()
    torch.save({"model": sd}, tmp_path / "kl16.ckpt")
    sizes = dict(image_size=16, ch=32, mults=(1, 2), num_res_blocks=1, z_dim=4)
    vae = load_kl16(tmp_path / "kl16.ckpt", **sizes)
    assert set(vae.state_dict()) == {k for k in sd if not k.startswith(("encoder.", "quant_conv."))}
    tokens = torch.randn(2, 64, 4)
    img = vae.decode(tokens)
    assert img.shape == (2, 3, 16, 16) and 0 <= float(img.min()) and float(img.max()) <= 1
    z = tokens.transpose(1, 2).reshape(2, 4, 8, 8) / 0.2325  # the first layer written out: post_quant_conv
    direct = torch.nn.functional.conv2d(z, sd["post_quant_conv.weight"], sd["post_quant_conv.bias"])
    assert torch.allclose(vae.post_quant_conv(z), direct, atol=1e-6)
    with pytest.raises(ValueError, match=r"'decoder.conv_in.weight' has shape \(64, 4, 3, 3\), this decoder "
                                         r"expects \(128, 4, 3, 3\)"):
        load_kl16(tmp_path / "kl16.ckpt", **{**sizes, "mults": (1, 4)})
    del sd["decoder.up.1.upsample.conv.bias"]
    torch.save({"model": sd}, tmp_path / "broken.ckpt")
    with pytest.raises(ValueError, match="no 'decoder.up.1.upsample.conv.bias' in the checkpoint"):
        load_kl16(tmp_path / "broken.ckpt", **sizes)


def _rowwise_linear(x, weight, bias=None):
    """F.linear with every output row computed alone (a product's rows do not depend on how many rows it has)."""
    out = (x.unsqueeze(-2) * weight).sum(-1)
    return out if bias is None else out + bias


def test_release_pair_runs_cspd_and_decodes(tmp_path, monkeypatch):
    """The target and a draft of another size as CSpD pairs them; the target as its own draft accepts all."""
    save_release(tmp_path / "t.pth", mar_state_dict(seed=0))
    save_release(tmp_path / "d.pth", mar_state_dict(D=16, enc=1, dec=1, hw=8, hd=1, seed=1))
    torch.save({"model": kl16_state_dict(mults=(1, 2, 2), z=3)}, tmp_path / "kl16.ckpt")
    vae = dict(image_size=16, ch=32, mults=(1, 2, 2), num_res_blocks=1, z_dim=3)  # 4x4 latents
    t = load_mar_release(str(tmp_path / "t.pth"), vae_path=str(tmp_path / "kl16.ckpt"), vae=vae, **TINY)
    assert t.identity.count("-") == 1
    d = load_mar_release(str(tmp_path / "d.pth"), **{**TINY, "sizes": (16, 1, 1, 4, 8, 1)})
    ids = t.prompts(["1", "9"])
    assert ids == [1, 9]
    with pytest.raises(ValueError, match="prompt 'a cat' is not a class id"):
        t.prompts(["a cat"])
    # One step per round: the target's conditions and chain are the draft's, bit for bit, once the head's products
    # are invariant to their number of rows (the target evaluates a chain's steps in one call, the draft step by
    # step, and on some CPUs a GEMM's rows round differently with the row count; MAR's unclipped x0 multiplies that
    # by ~170 at the first step of a release schedule).
    monkeypatch.setattr(torch.nn.functional, "linear", _rowwise_linear)
    for ratio in ("paper", "exact"):
        _, st = cspd.generate(t, ids, make_rngs([0, 1]), t, num_iter=4, gamma=1, prefill_ratio=0.0, ratio=ratio,
                              verify="stepwise", inner_temperature=1.0 if ratio == "paper" else None,
                              prefill_rule="ceil", verify_cfg="own_step")
        assert st["accept_rate"] == 1.0, ratio
    monkeypatch.undo()
    out, st = cspd.generate(t, ids, make_rngs([0, 1]), d, num_iter=4, gamma=2)
    assert out.shape == (2, 16, 3) and 0 <= st["accept_rate"] <= 1
    ref, _ = mar.generate(t, ids, make_rngs([0, 1]), num_iter=4)
    assert t.decode(ref).shape == (2, 3, 16, 16)
