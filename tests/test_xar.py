"""xAR behind the continuous protocol: a tiny checkpoint written with the release's parameter names and shapes
(listed here from its module layout, RoPE tables and mask from its formulas) loads, and a flow step is the
Euler-Maruyama Gaussian of the velocity that the raw tensors give; the target as its own draft accepts all;
CSpD and the target sampler run on a tiny pair; mismatched files are refused by name."""
import collections
import math

import pytest
import torch
import torch.nn.functional as F

from specgen.backbones.continuous import ContinuousBackbone
from specgen.backbones.xar import XAR, load_xar
from specgen.decoding import cspd, mar
from specgen.decoding.sampling import make_rngs
from test_mar_release import Record, kl16_state_dict

TINY = dict(sizes=(32, 2, 1, 4), grid_size=4, unit_size=2, token_dim=3, num_classes=10, sample_steps=5)


def release_rope(head_dim: int, grid: int, unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The release's RoPE tables (EVA-02 style, reordered to cells): channel pair j of the first half turns by
    row x f_j, of the second half by column x f_j, f_j = 10000^(-2j / (head_dim / 2))."""
    half = head_dim // 2
    f = torch.tensor([10000 ** (-2 * j / half) for j in range(half // 2)])
    rows = []
    n = grid // unit
    for hc in range(n):
        for wc in range(n):
            for p in range(unit):
                for q in range(unit):
                    r, c = hc * unit + p, wc * unit + q
                    rows.append([r * f[j // 2] for j in range(half)] + [c * f[j // 2] for j in range(half)])
    ang = torch.tensor(rows)
    return f, ang.cos(), ang.sin()


def xar_state_dict(D=32, enc=2, dec=1, heads=4, grid=4, unit=2, c=3, classes=10, seed=0) -> dict:
    """Random tensors under the names and shapes of OliverRensu/xAR's `xAR` (models/xar.py), buffers included."""
    g = torch.Generator().manual_seed(seed)
    L, H, hd = grid * grid, int(D * 4 * 2 / 3), D // heads
    shapes = {"class_emb.weight": (classes + 1, D), "time_embed.mlp.0.weight": (D, 256), "time_embed.mlp.0.bias": (D,),
              "time_embed.mlp.2.weight": (D, D), "time_embed.mlp.2.bias": (D,), "z_proj.weight": (D, c),
              "z_proj.bias": (D,), "z_proj_ln.weight": (D,), "encoder_pos_embed_learned": (1, L, D),
              "encoder_norm.weight": (D,), "decoder_embed.weight": (D, D), "decoder_embed.bias": (D,),
              "decoder_pos_embed_learned": (1, L, D), "decoder_norm.weight": (D,), "pred.weight": (c, D),
              "pred.bias": (c,)}
    for part, depth in (("encoder_blocks", enc), ("decoder_blocks", dec)):
        for i in range(depth):
            for name, shape in (("attn.qkv.weight", (3 * D, D)), ("attn.qkv.bias", (3 * D,)),
                                ("attn.proj.weight", (D, D)), ("attn.proj.bias", (D,)), ("mlp.fc1_g.weight", (H, D)),
                                ("mlp.fc1_g.bias", (H,)), ("mlp.fc1_x.weight", (H, D)), ("mlp.fc1_x.bias", (H,)),
                                ("mlp.fc2.weight", (D, H)), ("mlp.fc2.bias", (D,)), ("ada_lin.1.weight", (6 * D, D)),
                                ("ada_lin.1.bias", (6 * D,))):
                shapes[f"{part}.{i}.{name}"] = shape
    sd = collections.OrderedDict((k, 0.3 * torch.randn(s, generator=g)) for k, s in shapes.items())
    freqs, cos, sin = release_rope(hd, grid, unit)
    for part, depth in (("encoder_blocks", enc), ("decoder_blocks", dec)):
        for i in range(depth):
            sd.update({f"{part}.{i}.attn.rope.freqs": freqs, f"{part}.{i}.attn.rope.freqs_cos": cos,
                       f"{part}.{i}.attn.rope.freqs_sin": sin})
    cell = torch.arange(L) // (unit * unit)
    sd["mask"] = torch.where(cell[None, :] <= cell[:, None], 0.0, -math.inf)[None, None]  # block-causal
    return sd


def velocity_direct(sd, cells, times, labels, heads=4, unit_tokens=4, c=3):
    """The release's network written out from the raw tensors: velocities (n, m, T*c) of cells (n, m, T*c)."""
    lin = lambda h, k: h @ sd[f"{k}.weight"].T + sd[f"{k}.bias"]
    rms = lambda h: h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    n, m, _ = cells.shape
    N, D = m * unit_tokens, sd["z_proj.weight"].shape[0]
    hd = D // heads
    args = (times * 1000).long().flatten().float()[:, None] * torch.exp(-math.log(10000) * torch.arange(128) / 128)
    temb = lin(F.silu(lin(torch.cat([args.cos(), args.sin()], -1), "time_embed.mlp.0")), "time_embed.mlp.2")
    cond = sd["class_emb.weight"][labels][:, None] + temb.view(n, m, D)  # (n, m, D)

    def block(h, p):
        mod = lin(F.silu(cond), f"{p}.ada_lin.1").repeat_interleave(unit_tokens, 1)
        g1, g2, s1, s2, b1, b2 = mod.chunk(6, -1)
        a = rms(h) * (1 + s1) + b1
        q, k, v = lin(a, f"{p}.attn.qkv").view(n, N, 3, heads, hd).permute(2, 0, 3, 1, 4)
        theta = torch.atan2(sd[f"{p}.attn.rope.freqs_sin"][:N], sd[f"{p}.attn.rope.freqs_cos"][:N])[:, ::2]
        turn = lambda u: torch.view_as_real(torch.view_as_complex(u.reshape(n, heads, N, hd // 2, 2).contiguous())
                                            * torch.polar(torch.ones_like(theta), theta)).flatten(-2)
        att = (turn(q) @ turn(k).transpose(-1, -2) / math.sqrt(hd) + sd["mask"][0, 0, :N, :N]).softmax(-1) @ v
        h = h + lin(att.transpose(1, 2).reshape(n, N, D), f"{p}.attn.proj") * g1
        a = rms(h) * (1 + s2) + b2
        return h + lin(F.gelu(lin(a, f"{p}.mlp.fc1_g")) * lin(a, f"{p}.mlp.fc1_x"), f"{p}.mlp.fc2") * g2

    h = rms(lin(cells.reshape(n, N, c), "z_proj") + sd["encoder_pos_embed_learned"][0, :N]) * sd["z_proj_ln.weight"]
    for i in range(sum(k.endswith("qkv.weight") and k.startswith("encoder") for k in sd)):
        h = block(h, f"encoder_blocks.{i}")
    h = lin(rms(h) * sd["encoder_norm.weight"], "decoder_embed") + sd["decoder_pos_embed_learned"][0, :N]
    for i in range(sum(k.endswith("qkv.weight") and k.startswith("decoder") for k in sd)):
        h = block(h, f"decoder_blocks.{i}")
    return lin(rms(h) * sd["decoder_norm.weight"], "pred").reshape(n, m, -1)


def test_release_checkpoint_loads_and_a_flow_step_is_the_euler_maruyama_gaussian(tmp_path):
    sd = xar_state_dict()
    torch.save(sd, tmp_path / "xAR-B.pth")
    m = load_xar(str(tmp_path / "xAR-B.pth"), **TINY)
    assert isinstance(m, ContinuousBackbone) and (m.seq_len, m.token_dim, m.num_steps) == (4, 12, 5)
    fresh = XAR(TINY["sizes"], 4, 2, 3, 10, 5)
    for name in ("mask", "encoder_blocks.1.attn.rope.freqs_cos", "decoder_blocks.0.attn.rope.freqs_sin"):
        assert torch.allclose(fresh.state_dict()[name], sd[name], atol=1e-6), name  # built as the release builds
    g = torch.Generator().manual_seed(1)
    tokens, x = torch.randn(3, 4, 12, generator=g), torch.randn(3, 12, generator=g)
    unknown = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1.]])  # cells 0 and 1 known: cell 2's step
    zc, zu = m.step_conditions(tokens, unknown, m.conditioning(["3", "7", "0"], guided=True))
    grid = torch.cat([torch.linspace(1, 0.04, 5, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    for i in (4, 2, 0):
        t, dt = float(grid[4 - i]), float(grid[5 - i] - grid[4 - i])
        cells = torch.cat([tokens[:, :2], x[:, None]], 1)
        times = torch.tensor([[0.0, 0.0, t]] * 3)
        vc = velocity_direct(sd, cells, times, torch.tensor([3, 7, 0]))[:, -1]
        vu = velocity_direct(sd, cells, times, torch.full((3,), 10))[:, -1]
        v = vu + 2.5 * (vc - vu)
        score = -((1 - t) * v + x) / t  # the linear path's score from the velocity
        mean = x + dt * (v - 0.5 * (2 * t) * score)  # the drift of the reverse SDE with w(t) = 2t
        got_mean, got_var = m.transition(x, i, zc[:, 2], zu[:, 2], 2.5)
        assert torch.allclose(got_mean, mean, atol=1e-4), i
        assert torch.allclose(got_var, torch.full_like(x, 2 * t * abs(dt) if i > 0 else 0.0), rtol=1e-5), i
    ode = load_xar(str(tmp_path / "xAR-B.pth"), **TINY, sampler="ode")
    mean, var = ode.transition(x, 4, zc[:, 2], None, 1.0)  # t from 1 to 0.8 on the ODE's even grid
    v = velocity_direct(sd, torch.cat([tokens[:, :2], x[:, None]], 1), torch.tensor([[0.0, 0, 1]] * 3),
                        torch.tensor([3, 7, 0]))[:, -1]
    assert torch.allclose(mean, x - 0.2 * v, atol=1e-4) and float(var.abs().max()) == 0


def test_the_target_as_its_own_draft_accepts_everything_and_gives_target_only_sampling():
    m = XAR(**{k: v for k, v in TINY.items()}).eval()
    ids, opts = [1, 9], dict(num_iter=4, cfg_scale=2.0, cfg_schedule="linear_steps")
    ref, st = mar.generate(m, ids, make_rngs([0, 1]), **opts)
    assert ref.shape == (2, 4, 12) and st["nfe"] == 4 and st["target_head_evals"] == 5 + 3 * 5 * 2  # no CFG on cell 0
    scales = [mar.cfg_at(2.2, "linear_steps", k, 4, [1, 2, 3, 4]) for k in (1, 2, 3, 4)]  # the release's per cell
    assert scales == pytest.approx([1.0, 1.4, 1.8, 2.2])
    for ratio in ("paper", "exact"):
        out, st = cspd.generate(m, ids, make_rngs([0, 1]), m, gamma=2, prefill_ratio=0.0, ratio=ratio,
                                verify="stepwise", inner_temperature=1.0 if ratio == "paper" else None,
                                prefill_rule="ceil", verify_cfg="own_step", **opts)
        assert st["accept_rate"] == 1.0 and st["drafted"] == 2 * 4, ratio
        assert torch.allclose(out, ref, atol=1e-5), ratio
    with pytest.raises(ValueError, match="use verify='stepwise'"):  # joint: cell 2 would lack drafted cell 1
        cspd.generate(m, ids, make_rngs([0, 1]), m, gamma=2, prefill_ratio=0.0, **opts)
    with pytest.raises(ValueError, match="num_iter=16: xAR generates one cell per step, 4 cells here"):
        mar.generate(m, ids, make_rngs([0, 1]), num_iter=16)


def test_a_tiny_pair_runs_cspd_and_decodes(tmp_path):
    torch.save(xar_state_dict(seed=0), tmp_path / "t.pth")
    torch.save(xar_state_dict(D=16, enc=1, dec=1, seed=1), tmp_path / "d.pth")
    torch.save({"model": kl16_state_dict(mults=(1, 2, 2), z=3)}, tmp_path / "kl16.ckpt")
    vae = dict(image_size=16, ch=32, mults=(1, 2, 2), num_res_blocks=1, z_dim=3)  # 4x4 latents
    t = load_xar(str(tmp_path / "t.pth"), vae_path=str(tmp_path / "kl16.ckpt"), vae=vae, **TINY)
    d = load_xar(str(tmp_path / "d.pth"), **{**TINY, "sizes": (16, 1, 1, 4)})
    assert t.identity.count("-") == 1 and t.prompts(["1", "9"]) == [1, 9]
    out, st = cspd.generate(t, [1, 9], make_rngs([0, 1]), d, num_iter=4, gamma=2, verify="stepwise",
                            cfg_schedule="linear_steps")
    assert out.shape == (2, 4, 12) and 0 <= st["accept_rate"] <= 1 and st["prefill_steps"] == 1
    lossless, st = cspd.generate(t, [1, 9], make_rngs([0, 1]), d, num_iter=4, gamma=2, verify="stepwise",
                                 ratio="exact", acceptance="prefix", inner_temperature=None)
    assert torch.isfinite(lossless).all() and st["drafted"] >= 3
    img = t.decode(out)
    assert img.shape == (2, 3, 16, 16) and 0 <= float(img.min()) and float(img.max()) <= 1
    cells = torch.randn(2, 4, 12)
    assert torch.equal(t.cells(t.latents(cells)), cells)  # cells <-> raster latents
    lat = t.latents(cells)  # cell 1 (top right) token (0, 1) is latent (row 0, column 3)
    assert torch.equal(lat[:, 3], cells[:, 1, 3:6])
    net = XAR(**TINY).train()  # the flow-matching loss trains every parameter but the fixed tables
    net(t.latents(cells), torch.tensor([1, 9])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
    with pytest.raises(ValueError, match="is not an xAR over the target's cells"):
        cspd.generate(t, [1], make_rngs([0]), XAR(**{**TINY, "unit_size": 1}), num_iter=4, verify="stepwise")


def test_the_loader_refuses_mismatched_files_by_key(tmp_path):
    torch.save(xar_state_dict(), tmp_path / "ck.pth")
    with pytest.raises(ValueError, match=r"'class_emb.weight' has shape \(11, 32\) in the checkpoint, the configured "
                                         r"model has \(11, 1024\).*set generator.size"):
        load_xar(str(tmp_path / "ck.pth"), **{**TINY, "sizes": None}, size="large")
    with pytest.raises(ValueError, match=r"no 'decoder_blocks.1.attn.qkv.weight' in the checkpoint"):
        load_xar(str(tmp_path / "ck.pth"), **{**TINY, "sizes": (32, 2, 2, 4)})
    with pytest.raises(ValueError, match=r"more than 1 encoder_blocks"):
        load_xar(str(tmp_path / "ck.pth"), **{**TINY, "sizes": (32, 1, 1, 4)})
    with pytest.raises(ValueError, match=r"'encoder_blocks.0.attn.rope.freqs' has shape \(2,\) in the checkpoint, "
                                         r"the configured model has \(1,\)"):  # 8 heads: another head width
        load_xar(str(tmp_path / "ck.pth"), **{**TINY, "sizes": (32, 2, 1, 8)})
    with pytest.raises(ValueError, match=r"'mask' in the checkpoint is not the one of cells of 1x1 tokens on a 4x4 "
                                         r"grid: set generator.unit_size"):  # same shapes, another layout
        load_xar(str(tmp_path / "ck.pth"), **{**TINY, "unit_size": 1})
    with pytest.raises(ValueError, match=r"'encoder_pos_embed_learned' has shape \(1, 16, 32\) in the checkpoint, the "
                                         r"configured model has \(1, 64, 32\)"):
        load_xar(str(tmp_path / "ck.pth"), **{**TINY, "grid_size": 8})
    sd = xar_state_dict()
    del sd["decoder_blocks.0.mlp.fc1_x.bias"]
    torch.save(sd, tmp_path / "broken.pth")
    with pytest.raises(ValueError, match=r"no 'decoder_blocks.0.mlp.fc1_x.bias' in the checkpoint"):
        load_xar(str(tmp_path / "broken.pth"), **TINY)
    torch.save({"model_ema": xar_state_dict(), "epoch": 3}, tmp_path / "wrapped.pth")
    with pytest.raises(ValueError, match="not the weights themselves: set generator.key"):
        load_xar(str(tmp_path / "wrapped.pth"), **TINY)
    assert load_xar(str(tmp_path / "wrapped.pth"), key="model_ema", **TINY).seq_len == 4
    torch.save({**xar_state_dict(), "extra": Record()}, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match="cannot be read with weights_only=True .* allow_pickle=true"):
        load_xar(str(tmp_path / "odd.pth"), **TINY)
    with pytest.raises(ValueError, match="unknown xAR size 'xl'"):
        load_xar(str(tmp_path / "ck.pth"), size="xl")
