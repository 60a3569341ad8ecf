"""The DDPM reverse process, driven by the analytic optimal denoiser of 1-D Gaussian data, samples that data."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from specgen.backbones.diffusion import DenoiserMLP, GaussianDiffusion


def optimal_eps(x_t, ac, m, s):
    """E[eps | x_t] when x0 ~ N(m, s^2) and x_t = sqrt(ac) x0 + sqrt(1 - ac) eps."""
    return (x_t - math.sqrt(ac) * m) * math.sqrt(1 - ac) / (ac * s * s + 1 - ac)


@pytest.mark.parametrize("variance", ["fixed_small", "fixed_large"])
def test_reverse_process_reproduces_gaussian_data(variance):
    m, s = 0.7, 0.4
    diff = GaussianDiffusion(train_steps=1000, sample_steps=100, variance=variance)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 1, generator=g, dtype=torch.float64)
    for i in reversed(range(diff.sample_steps)):
        eps = optimal_eps(x, float(diff.s_ac[i]), m, s)
        mean, var = diff.step_mean_var(eps, x, i)
        x = mean + var.sqrt() * torch.randn(x.shape, generator=g, dtype=torch.float64)
    assert stats.kstest(x.view(-1).numpy(), "norm", args=(m, s)).pvalue > 1e-3


def test_ddim_tail_is_deterministic_and_keeps_the_data_distribution():
    """The last 30 stochastic steps as DDIM steps (eta = 0), driven by the optimal denoiser: variance 0 there,
    the mean is sqrt(a_prev) x0 + sqrt(1 - a_prev) eps, per-row indices agree, the data are still reproduced."""
    m, s, tail = 0.7, 0.4, 30
    diff = GaussianDiffusion(train_steps=1000, sample_steps=100, variance="fixed_small")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 1, generator=g, dtype=torch.float64)
    for i in reversed(range(diff.sample_steps)):
        ac = float(diff.s_ac[i])
        eps = optimal_eps(x, ac, m, s)
        mean, var = diff.step_mean_var(eps, x, i, ddim_tail=tail)
        if 1 <= i <= tail:
            x0 = (x - math.sqrt(1 - ac) * eps) / math.sqrt(ac)
            prev = float(diff.s_ac_prev[i])
            assert float(var.abs().max()) == 0
            assert torch.allclose(mean, math.sqrt(prev) * x0 + math.sqrt(1 - prev) * eps, atol=1e-9)
            rows_mean, rows_var = diff.step_mean_var(eps[:3], x[:3], torch.full((3,), i), ddim_tail=tail)
            assert torch.allclose(rows_mean, mean[:3]) and float(rows_var.abs().max()) == 0
        x = mean + var.sqrt() * torch.randn(x.shape, generator=g, dtype=torch.float64)
    assert stats.kstest(x.view(-1).numpy(), "norm", args=(m, s)).pvalue > 1e-3
    post = diff.s_betas * (1 - diff.s_ac_prev) / (1 - diff.s_ac)
    assert diff.final_std() == pytest.approx(float(post[1].sqrt()))  # improved DDPM's clipped value at step 0


def test_denoiser_shapes_and_identity_start():
    net = DenoiserMLP(token_dim=4, cond_dim=8, width=32, depth=2)
    out = net(torch.randn(5, 4), torch.randint(0, 1000, (5,)), torch.randn(5, 8))
    assert out.shape == (5, 8) and torch.all(out == 0)  # [eps, v]; zero-initialised output layer
    diff = GaussianDiffusion(variance="learned_range")
    mean, var = diff.step_mean_var(out, torch.randn(5, 4), 50)
    beta, small = float(diff.s_betas[50]), float(diff.s_betas[50] * (1 - diff.s_ac_prev[50]) / (1 - diff.s_ac[50]))
    assert torch.allclose(var, torch.full_like(var, math.sqrt(beta * small)))  # v = 0: the geometric mean
    with pytest.raises(ValueError, match="unknown variance type 'learned'"):
        GaussianDiffusion(variance="learned")


def test_mar_backbone_trains_one_step_and_returns_conditions():
    from specgen.backbones.mar import ShapesMAR

    torch.manual_seed(0)
    mar = ShapesMAR(grid_size=4, token_dim=3, preset="tiny", sample_steps=10)
    cond = mar.condition(["a red circle", "two squares"])
    assert cond.shape == (2, mar.buffer_size, 64)
    tokens = torch.randn(2, 16, 3)
    loss = mar(tokens, cond)
    loss.backward()
    assert torch.isfinite(loss) and mar.z_proj.weight.grad is not None
    mask = torch.zeros(2, 16)
    mask[:, 5:] = 1
    z = mar.conditions(tokens, mask, cond)
    assert z.shape == (2, 16, 64)
    # known tokens condition the unknown ones: changing a known token changes the conditions
    t2 = tokens.clone()
    t2[:, 0] += 1
    assert not torch.allclose(mar.conditions(t2, mask, cond)[:, 10], z[:, 10])
    # rows knowing different numbers of tokens (padded, padding hidden) equal the rows computed alone
    ragged = torch.stack([mask[0], torch.ones(16), (torch.arange(16) % 3 == 0).float()])
    t3, c3 = torch.cat([tokens, tokens[:1]]), torch.cat([cond, cond[:1]])
    together = mar.conditions(t3, ragged, c3)
    alone = torch.cat([mar.conditions(t3[i:i + 1], ragged[i:i + 1], c3[i:i + 1]) for i in range(3)])
    assert torch.allclose(together, alone, atol=1e-5)
    assert not torch.allclose(together[0], together[2], atol=1e-3)


def test_mar_patches_of_the_latent_grid():
    """patch_size=2 (MAR's patchify): tokens are 2x2 latent patches, decoding unpatchifies, training runs."""
    from specgen.backbones.mar import ShapesMAR
    from specgen.decoding.mar import generate
    from specgen.decoding.sampling import make_rngs
    from specgen.tokenizers.kl import KLAutoencoder

    torch.manual_seed(0)
    mar = ShapesMAR(grid_size=4, token_dim=3, preset="tiny", sample_steps=4, patch_size=2)
    assert (mar.seq_len, mar.token_dim, mar.grid_size) == (4, 12, 2)
    lat = torch.randn(2, 16, 3)
    tok = mar.patchify(lat)
    assert tok.shape == (2, 4, 12)
    grid = lat.reshape(2, 4, 4, 3)  # (B, row, col, d)
    # token 1 is the patch of rows 0-1, columns 2-3; channel-major inside a token, as MAR's patchify
    assert torch.equal(tok[:, 1].reshape(2, 3, 2, 2), grid[:, 0:2, 2:4].permute(0, 3, 1, 2))
    assert torch.equal(mar.unpatchify(tok), lat)
    loss = mar(lat, mar.condition(["a red circle", "two squares"]))
    loss.backward()
    assert torch.isfinite(loss)
    kl = KLAutoencoder(image_size=16, ch=8, mults=(2, 4), z_dim=3)  # 16 px / 4 = a 4x4 latent grid
    mar.eval().attach_tokenizer(kl)
    tokens, _ = generate(mar, ["a red circle"], make_rngs([0], "cpu"), num_iter=2)
    assert tokens.shape == (1, 4, 12)
    assert torch.allclose(mar.decode(tokens), kl.decode(mar.unpatchify(tokens)))
    with pytest.raises(ValueError, match="patch_size=3"):
        ShapesMAR(grid_size=4, token_dim=3, preset="tiny", patch_size=3)
    with pytest.raises(ValueError, match="tokenizer gives 2x2"):
        ShapesMAR(grid_size=4, token_dim=3, preset="tiny", patch_size=2).attach_tokenizer(
            KLAutoencoder(image_size=8, ch=8, mults=(2, 4), z_dim=3))


def test_mar_mask_ratio_distributions():
    """MAR's truncated normal stays in [min, 1]; the cosine option reaches the well-known contexts
    (mean 2/pi for minimum 0) and always masks at least one token; bad options are named."""
    from specgen.backbones.mar import ShapesMAR

    np.random.seed(0)
    mar = ShapesMAR(grid_size=4, token_dim=3, preset="tiny")
    r = np.array([mar.mask_ratio() for _ in range(2000)])
    assert r.min() >= 0.7 and r.max() <= 1.0
    cos = ShapesMAR(grid_size=4, token_dim=3, preset="tiny", mask_ratio_dist="cosine", mask_ratio_min=0.0)
    r = np.array([cos.mask_ratio() for _ in range(4000)])
    assert abs(r.mean() - 2 / math.pi) < 0.02 and (r < 0.3).mean() > 0.15
    # the share masked below 1/2 is P(cos(pi u / 2) < 1/2) = P(u > 2/3) = 1/3
    assert abs((r < 0.5).mean() - 1 / 3) < 0.03
    for _ in range(200):
        mask, known = cos.random_mask(3, "cpu")
        assert (mask.sum(1) >= 1).all() and (mask.sum(1) == cos.seq_len - known).all()
    with pytest.raises(ValueError, match="mask_ratio_dist"):
        ShapesMAR(grid_size=4, token_dim=3, preset="tiny", mask_ratio_dist="uniform")
    with pytest.raises(ValueError, match="mask_ratio_min"):
        ShapesMAR(grid_size=4, token_dim=3, preset="tiny", mask_ratio_min=1.5)


def test_mar_min_snr_weighting():
    """Min-SNR: the epsilon MSE of timestep t is scaled by min(SNR_t, gamma) / SNR_t (1 at the noisy
    timesteps, gamma / SNR_t at the clean ones), the same draws otherwise; null keeps MAR's loss."""
    from specgen.backbones.mar import ShapesMAR

    torch.manual_seed(0)
    plain = ShapesMAR(grid_size=4, token_dim=3, preset="tiny", variance="fixed_small")
    weighted = ShapesMAR(grid_size=4, token_dim=3, preset="tiny", variance="fixed_small", min_snr_gamma=5.0)
    weighted.load_state_dict(plain.state_dict())
    ac = plain.diffusion.alphas_cumprod
    t = torch.tensor([0, 100, 300, 500, 999])
    snr = ac[t] / (1 - ac[t])
    w = weighted.min_snr_weight(t)
    assert torch.allclose(w.double(), torch.minimum(snr, torch.full_like(snr, 5.0)) / snr, rtol=1e-6)
    assert w[-1] == 1 and w[0] < 1e-3 and bool((w[1:] >= w[:-1]).all())  # noisier -> weight up to 1
    x0, z = torch.randn(64, 3), torch.randn(64, 64)
    torch.manual_seed(1)
    lp = plain.diffusion_loss(x0, z)
    torch.manual_seed(1)
    tt = torch.randint(0, 1000, (64,))  # the timesteps diffusion_loss draws first
    torch.manual_seed(1)
    lw = weighted.diffusion_loss(x0, z)
    assert torch.allclose(lw, lp * weighted.min_snr_weight(tt), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(lw, lp)
    with pytest.raises(ValueError, match="min_snr_gamma"):
        ShapesMAR(grid_size=4, token_dim=3, preset="tiny", min_snr_gamma=0)


def test_mar_module_ema_follows_the_weights():
    """EMA: starts at the weights fitting starts from, then e <- d e + (1 - d) p with d = min(decay, (1+n)/(10+n));
    it is the exported network, and the module without it exports its raw weights."""
    from specgen.backbones.mar import ShapesMAR
    from specgen.modules.mar_module import MARModule

    torch.manual_seed(0)
    module = MARModule(ShapesMAR(grid_size=4, token_dim=3, preset="tiny"), ema_decay=0.5)
    assert module.export_net is module.ema
    with torch.no_grad():
        module.net.z_proj.weight.add_(1.0)  # e.g. init_from loaded other weights before fit
    module.on_fit_start()
    assert torch.equal(module.ema.z_proj.weight, module.net.z_proj.weight)
    expected = module.ema.z_proj.weight.clone()
    for n in range(12):
        with torch.no_grad():
            module.net.z_proj.weight.add_(torch.randn_like(module.net.z_proj.weight))
        module.update_ema()
        d = min(0.5, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * module.net.z_proj.weight
    assert torch.allclose(module.ema.z_proj.weight, expected, atol=1e-6)
    assert int(module.ema_updates) == 12
    assert not torch.allclose(module.ema.z_proj.weight, module.net.z_proj.weight)
    module.on_fit_start()  # a resumed run keeps its EMA
    assert torch.allclose(module.ema.z_proj.weight, expected, atol=1e-6)
    assert not any(p.requires_grad for p in module.ema.parameters())
    plain = MARModule(ShapesMAR(grid_size=4, token_dim=3, preset="tiny"))
    assert plain.ema is None and plain.export_net is plain.net
    with pytest.raises(ValueError, match="module.ema_decay"):
        MARModule(ShapesMAR(grid_size=4, token_dim=3, preset="tiny"), ema_decay=1.5)


def test_vlb_term_vanishes_for_the_true_posterior():
    diff = GaussianDiffusion()
    x0, noise = torch.randn(6, 4), torch.randn(6, 4)
    t = torch.tensor([1, 10, 100, 500, 900, 999])
    x_t = diff.q_sample(x0, t, noise)
    exact = diff.vlb_term(noise, -torch.ones(6, 4), x0, x_t, t)  # true eps, v = -1: the posterior variance
    assert torch.allclose(exact, torch.zeros(6), atol=1e-5)
    assert (diff.vlb_term(noise + 0.5, torch.zeros(6, 4), x0, x_t, t) > 0).all()


def test_mar_release_layout_loads_by_name(tmp_path):
    """A tiny model saved with MAR's key names under 'model_ema' loads into the same outputs."""
    from specgen.backbones.mar import ShapesMAR
    from specgen.backbones.mar_release import load_mar_release

    torch.manual_seed(0)
    src = ShapesMAR(grid_size=4, token_dim=3, cond="class", num_classes=10, buffer_size=8,
                    sizes=(32, 2, 1, 4, 16, 2), sample_steps=5).eval()
    sd = src.state_dict()
    for k in ("z_proj.weight", "class_emb.weight", "fake_latent", "encoder_blocks.1.attn.qkv.weight",
              "decoder_blocks.0.mlp.fc2.bias", "diffloss.net.time_embed.mlp.2.weight",
              "diffloss.net.res_blocks.1.adaLN_modulation.1.weight", "diffloss.net.final_layer.linear.weight"):
        assert k in sd, k  # the official release's names
    torch.save({"model_ema": sd, "model": sd}, tmp_path / "checkpoint-last.pth")
    tiny = dict(sizes=(32, 2, 1, 4, 16, 2), num_classes=10, buffer_size=8, grid_size=4, token_dim=3, sample_steps=5)
    loaded = load_mar_release(str(tmp_path / "checkpoint-last.pth"), **tiny)
    tokens, mask = torch.randn(2, 16, 3), torch.cat([torch.zeros(2, 6), torch.ones(2, 10)], 1)
    cond = loaded.condition(torch.tensor([3, 7]))
    assert torch.allclose(loaded.conditions(tokens, mask, cond), src.conditions(tokens, mask, src.condition(torch.tensor([3, 7]))))
    with pytest.raises(KeyError, match="no 'ema' entry"):
        load_mar_release(str(tmp_path / "checkpoint-last.pth"), key="ema", **tiny)


def test_transition_kl_matches_torch_distributions():
    from specgen.modules.mar_module import transition_kl

    diff = GaussianDiffusion(variance="learned_range")
    g = torch.Generator().manual_seed(3)
    x_t, step = torch.randn(6, 4, generator=g), torch.tensor([1, 2, 10, 50, 98, 99])
    out_q, out_p = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    out_q[:, 4:], out_p[:, 4:] = out_q[:, 4:].tanh(), out_p[:, 4:].tanh()  # v in [-1, 1]
    (mq, vq), (mp, vp) = diff.step_mean_var(out_q, x_t, step), diff.step_mean_var(out_p, x_t, step)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mq, vq.sqrt()),
                                            torch.distributions.Normal(mp, vp.sqrt())).sum(-1).mean()
    assert torch.allclose(transition_kl(diff, out_q, out_p, x_t, step), ref, rtol=1e-4)
    assert float(transition_kl(diff, out_p, out_p, x_t, step)) == 0.0


def test_mar_draft_module_transition_kl(tmp_path):
    """kl_weight > 0: a draft equal to the target loses nothing; another draft loses more, with gradients."""
    from specgen.backbones.mar import ShapesMAR
    from specgen.modules.mar_module import MARDraftModule
    from specgen.utils.checkpoints import export, load_exported

    cfg = {"_target_": "specgen.backbones.mar.ShapesMAR", "grid_size": 4, "token_dim": 3, "preset": "tiny",
           "sample_steps": 10, "variance": "learned_range"}
    torch.manual_seed(0)
    export(tmp_path / "target", ShapesMAR(**{k: v for k, v in cfg.items() if k != "_target_"}), cfg)
    batch = {"latents": torch.randn(4, 16, 3), "prompt": ["a red circle", "two squares", "a blue cross",
                                                           "a green triangle"]}
    same = MARDraftModule(load_exported(tmp_path / "target"), str(tmp_path / "target"), data_weight=0.0,
                          kl_weight=1.0)
    same.net.train(False)  # no dropout: the draft computes exactly what the target does
    assert float(same.training_step(batch, 0).detach()) == pytest.approx(0.0, abs=1e-8)
    draft = load_exported(tmp_path / "target")
    with torch.no_grad():  # (a fresh model's denoiser outputs zeros: perturb every weight)
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other = MARDraftModule(draft, str(tmp_path / "target"), data_weight=0.0, kl_weight=1.0)
    other.net.train(False)
    torch.manual_seed(1), np.random.seed(1)  # the same timesteps, noise and masks (numpy draws the mask ratio)
    with_kl = other.training_step(batch, 0)
    other.hparams.kl_weight = 0.0
    torch.manual_seed(1), np.random.seed(1)
    without = other.training_step(batch, 0)
    assert float(with_kl.detach()) > float(without.detach()) > 0
    with_kl.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in other.net.parameters())
    with pytest.raises(ValueError, match="module.kl_weight"):
        MARDraftModule(load_exported(tmp_path / "target"), str(tmp_path / "target"), kl_weight=-1.0)
