"""f_phi trained for acceptance: the row-context preset, the guided-distribution terms against a hand
computation, the row layout of the down targets, the right-direction rollout, a distillation step, and the
drafter report."""
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_llama
from specgen.analysis import drafter_report
from specgen.backbones.protocol import embed_image
from specgen.decoding import ar, ssd, ssd_carry
from specgen.decoding.sampling import make_rngs
from specgen.drafters.fphi import FPhi
from specgen.modules.distill_data import DistillDataModule
from specgen.modules.distill_module import DistillModule, guided_terms


def test_row_context_drafter_starts_point_wise_and_then_sees_its_neighbours():
    torch.manual_seed(0)
    ctx, flat = FPhi(16, "xs", context_kernel=3), FPhi(16, "xs")
    missing, unexpected = ctx.load_state_dict(flat.state_dict(), strict=False)
    assert not unexpected and all(".mix." in k for k in missing)
    for net in (ctx, flat):  # leave the identity start so that outputs depend on the inputs
        torch.nn.init.normal_(net.nets["down"][-1].weight, std=0.1)
    ctx.nets["down"][-1].weight.data.copy_(flat.nets["down"][-1].weight)
    h, e = torch.randn(2, 6, 16), torch.randn(2, 6, 16)  # (B, W, D): a whole row above
    assert torch.allclose(ctx.down(h, e), flat.down(h, e), atol=1e-6)  # zero-initialised mixers
    torch.nn.init.normal_(ctx.nets["down"][1].mix.conv.weight, std=0.1)
    h2 = h.clone()
    h2[:, 3] += 1.0  # change column 3 of the row above
    moved = (ctx.down(h2, e) - ctx.down(h, e)).abs().sum(-1)[0]  # (W,)
    assert moved[2] > 0 and moved[4] > 0 and moved[0] == 0 and moved[5] == 0  # kernel 3: columns 2..4 only
    moved_flat = (flat.down(h2, e) - flat.down(h, e)).abs().sum(-1)[0]
    assert moved_flat[3] > 0 and (moved_flat[[0, 1, 2, 4, 5]] == 0).all()  # point-wise: column 3 only
    assert ctx.right(h[:, 0], e[:, 0]).shape == (2, 16)  # the right direction stays point-wise


def test_row_mixer_is_its_convolution_along_the_row():
    """The mixer computes its Conv1d (zero padding past the row's ends) as one matmul over each position's
    neighbourhood: the same outputs and gradients as the module's own convolution, for any leading dimensions."""
    from specgen.drafters.fphi import _RowMixer

    torch.manual_seed(0)
    mix = _RowMixer(8, 5)
    torch.nn.init.normal_(mix.conv.weight, std=0.3)
    torch.nn.init.normal_(mix.conv.bias)
    for shape in ((3, 6, 8), (2, 4, 6, 8), (6, 8)):
        x = torch.randn(*shape, requires_grad=True)
        y = mix.norm(x).reshape(-1, shape[-2], shape[-1]).transpose(1, 2)  # (N, C, W)
        ref = x + F.silu(mix.conv(y)).transpose(1, 2).reshape(shape)
        out = mix(x)
        assert torch.allclose(out, ref, atol=1e-5)
        g_out = torch.autograd.grad(out.square().sum(), (x, mix.conv.weight))
        g_ref = torch.autograd.grad(ref.square().sum(), (x, mix.conv.weight))
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(g_out, g_ref))


def test_row_context_errors_name_the_value():
    with pytest.raises(ValueError, match="context_kernel=4: expected an odd kernel"):
        FPhi(16, "xs", context_kernel=4)
    with pytest.raises(ValueError, match=r"directions=\['right'\]: add 'down' or set context_kernel=null"):
        FPhi(16, "xs", directions=("right",), context_kernel=3)
    with pytest.raises(ValueError, match=r"expected \(\.\.\., W, D\) inputs, got \(2, 16\)"):
        FPhi(16, "xs", context_kernel=3).down(torch.randn(2, 16), torch.randn(2, 16))


def test_guided_terms_match_a_hand_computation():
    torch.manual_seed(0)
    t, d = torch.randn(2 * 3, 5), torch.randn(2 * 3, 5)  # [cond; uncond] logits of 3 positions
    s = 2.0
    p = torch.softmax(t[3:] + s * (t[:3] - t[3:]), -1)
    q = torch.softmax(d[3:] + s * (d[:3] - d[3:]), -1)
    out = guided_terms(t, d, s)
    assert torch.allclose(out["kl"], (p * (p.log() - q.log())).sum(-1), atol=1e-6)
    assert torch.allclose(out["accept"], torch.minimum(p, q).sum(-1), atol=1e-6)
    assert torch.allclose(out["accept_argmax"], p[torch.arange(3), q.argmax(-1)])
    same = guided_terms(t, t, s)
    assert torch.allclose(same["accept"], torch.ones(3)) and same["kl"].abs().max() < 1e-6


def _module(tiny_exports, **kw):
    torch.manual_seed(0)
    return DistillModule(FPhi(64, "xs", context_kernel=kw.pop("context_kernel", None)), str(tiny_exports / "ar"),
                         str(tiny_exports / "vq"), **kw)


def test_down_targets_are_one_row_below_and_right_chains_its_own_predictions(tiny_exports, teacher):
    """With the identity start (pred = input state), every regression term is a hand-computable distance
    between teacher states: down pairs (r, c) -> (r + 1, c) over whole rows, right's chain step k pairs q -> q + k."""
    m = _module(tiny_exports, rollout=2).eval()
    batch = next(iter(teacher.train_dataloader()))
    out = m.losses(batch)
    s = batch["states"].transpose(0, 1).flatten(0, 1)  # (2B, L, D)
    g = m.backbone.grid

    def feat(pred, target):
        return (((pred - target) / target.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)) ** 2).mean()
    idx = torch.tensor([r * g.stride + c for r in range(g.height - 1) for c in range(g.width)])
    assert torch.allclose(out["loss_feat_down"], feat(s[:, idx], s[:, idx + g.stride]), atol=1e-5)
    assert torch.allclose(out["loss_feat_right"], feat(s[:, :-1], s[:, 1:]), atol=1e-5)
    assert torch.allclose(out["loss_feat_right_chain2"], feat(s[:, :-2], s[:, 2:]), atol=1e-5)
    assert "loss_feat_right_chain3" not in out


def test_a_distillation_step_on_the_guided_loss_raises_expected_acceptance(tiny_exports, teacher):
    """Steps on a fixed batch with the guided term (KL and TV) raise sum min(p, q) of the guided distributions;
    the loss includes the guided term at its weight."""
    batch = next(iter(teacher.train_dataloader()))
    for loss in ("kl", "tv"):
        m = _module(tiny_exports, guided_weight=1.0, guided_loss=loss, kl_weight=0.0, context_kernel=3)
        with torch.no_grad():
            before = m.losses(batch)
            off = _module(tiny_exports, guided_weight=0.0, kl_weight=0.0, context_kernel=3).losses(batch)
        guided = before["loss_guided_kl_down"] if loss == "kl" else 1 - before["accept_down"]
        assert torch.allclose(before["loss"] - off["loss"],
                              guided + (before["loss_guided_kl_right"] if loss == "kl" else 1 - before["accept_right"]),
                              atol=1e-4)
        opt = torch.optim.Adam(m.net.parameters(), lr=3e-3)
        for _ in range(30):
            opt.zero_grad()
            m.losses(batch)["loss"].backward()
            opt.step()
        with torch.no_grad():
            after = m.losses(batch)
        assert after["accept_down"] > before["accept_down"], loss
        assert 1 - after["accept_down"] < 0.8 * (1 - before["accept_down"]), loss  # a fifth of the rejections gone
        assert after["loss"] < before["loss"]


def test_bad_distillation_options_name_the_value(tiny_exports):
    with pytest.raises(ValueError, match="module.guided_loss='l2'"):
        _module(tiny_exports, guided_loss="l2")
    with pytest.raises(ValueError, match="module.rollout"):
        _module(tiny_exports, rollout=0)


@pytest.mark.parametrize("eol", [True, False])
def test_ssd_with_a_row_context_drafter_equals_greedy_ar(eol):
    m = tiny_llama(eol=eol)
    torch.manual_seed(1)
    drafter = FPhi(m.hidden_size, "xs", context_kernel=3)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.05)  # an imperfect drafter: many rejections
    prompts = m.prompts(["a red circle", "two blue squares"])
    ref, _ = ar.generate(m, prompts, cfg_scale=2.0, temperature=0)
    for decode, kw in ((ssd.generate, {"rounds": m.grid.width}), (ssd_carry.generate, {"rounds": 1}),
                       (ssd.generate, {"exact": True})):
        out, st = decode(m, prompts, drafter, cfg_scale=2.0, temperature=0, **kw)
        assert torch.equal(out, ref), kw
    _, st = ssd_carry.generate(m, prompts, drafter, cfg_scale=2.0, rounds=1, rngs=make_rngs([0, 1]))
    assert st["nfe"] < m.grid.num_visual_tokens


def test_drafter_report_scores_exports_and_writes_json(tiny_exports, teacher, tmp_path):
    shard = str(teacher.shard_path("val", 0))
    out = tmp_path / "report.json"
    report = drafter_report.main(["--drafters", str(tiny_exports / "fphi"), "--backbone", str(tiny_exports / "ar"),
                                  "--tokenizer", str(tiny_exports / "vq"), "--shards", shard, "--out", str(out)])
    row = json.loads(out.read_text())[str(tiny_exports / "fphi")]
    assert row == pytest.approx(report[str(tiny_exports / "fphi")])
    assert row["sequences"] == 4
    for d in ("right", "down"):
        assert 0 < row[f"accept_{d}"] <= 1 and 0 <= row[f"accept_argmax_{d}"] <= 1 and 0 <= row[f"top1_{d}"] <= 1
        assert 0 < row[f"flops_per_draft_{d}"] < row["backbone_flops_per_token"]
    with pytest.raises(FileNotFoundError, match="--shards 'nope.npz' is not a file"):
        drafter_report.main(["--drafters", "x", "--backbone", "x", "--tokenizer", "x", "--shards", "nope.npz",
                             "--out", str(out)])


def test_drafter_report_samples_its_own_validation_shard_once(tiny_exports, teacher, tmp_path):
    """--val-sequences N: the distillation stage's validation shard (same key and seeds), written once, no train data."""
    args = ["--drafters", str(tiny_exports / "fphi"), "--backbone", str(tiny_exports / "ar"),
            "--tokenizer", str(tiny_exports / "vq"), "--out", str(tmp_path / "r.json"), "--cfg-scale", "2"]
    shard = teacher.shard_path("val", 0)
    stamp = shard.stat().st_mtime_ns
    reused = drafter_report.main(args + ["--val-sequences", "4", "--cache-dir", str(teacher.hparams.cache_dir)])
    given = drafter_report.main(args + ["--shards", str(shard)])
    assert reused == given and shard.stat().st_mtime_ns == stamp  # the stage's own shard, not sampled again
    fresh = tmp_path / "cache"
    drafter_report.main(args + ["--val-sequences", "4", "--cache-dir", str(fresh)])
    assert [p.name for p in fresh.rglob("*.npz")] == ["val_00000.npz"]
    with pytest.raises(SystemExit):
        drafter_report.main(args)  # neither --shards nor --val-sequences


def test_left_context_drafter_starts_as_the_one_without_and_drafts_rows_left_to_right():
    """left_context=True: zero-initialised (equal to the drafter it grows from), trained on the token before each
    drafted one (teacher-forced), and SSD drafts column by column; greedy output still equals AR."""
    torch.manual_seed(0)
    base, left = FPhi(16, "xs", context_kernel=3), FPhi(16, "xs", context_kernel=3, left_context=True)
    missing, unexpected = left.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("left_") for k in missing)
    h, e = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    assert torch.allclose(left.down(h, e, torch.randn(2, 5, 16)), base.down(h, e), atol=1e-6)
    for w in (left.left_in.weight, left.left_block.mlp[-1].weight, left.nets["down"][-1].weight):
        torch.nn.init.normal_(w, std=0.1)
    l1, l2 = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    l2[:, 3] = l1[:, 3]
    diff = (left.down(h, e, l1) - left.down(h, e, l2)).abs().sum(-1)
    assert (diff[:, 3] == 0).all() and (diff[:, [0, 1, 2, 4]] > 0).all()  # column c reads its own left token only
    with pytest.raises(ValueError, match="give left_embed"):
        left.down(h, e)
    for eol in (True, False):
        m = tiny_llama(eol=eol)
        d = FPhi(m.hidden_size, "xs", context_kernel=3, left_context=True)
        for p in d.parameters():
            torch.nn.init.normal_(p, std=0.05)
        prompts = m.prompts(["a red circle", "two blue squares"])
        ref, _ = ar.generate(m, prompts, cfg_scale=2.0, temperature=0)
        for decode, kw in ((ssd.generate, {"rounds": m.grid.width}), (ssd_carry.generate, {"rounds": 1}),
                           (ssd.generate, {"exact": True})):
            assert torch.equal(decode(m, prompts, d, cfg_scale=2.0, temperature=0, **kw)[0], ref), (eol, kw)


def test_left_context_is_trained_on_the_token_before_each_drafted_one(tiny_exports, teacher):
    """The distillation feeds row r + 1's left neighbours (the sequence token before each position): a drafter
    whose left head copies its input shows it, as the loss then changes with the left tokens only."""
    torch.manual_seed(0)
    m = DistillModule(FPhi(64, "xs", left_context=True), str(tiny_exports / "ar"), str(tiny_exports / "vq")).eval()
    torch.nn.init.normal_(m.net.left_in.weight, std=0.1)
    torch.nn.init.normal_(m.net.left_block.mlp[-1].weight, std=0.1)
    torch.nn.init.normal_(m.net.nets["down"][-1].weight, std=0.1)
    batch = next(iter(teacher.train_dataloader()))
    g = m.backbone.grid
    s = batch["states"].transpose(0, 1).flatten(0, 1)
    e = embed_image(m.backbone, batch["ids"].repeat(2, 1))
    idx = torch.tensor([r * g.stride + c for r in range(g.height - 1) for c in range(g.width)])
    pred = m.net.down(s[:, idx].view(len(s), g.height - 1, g.width, -1), e[:, idx].view(len(s), g.height - 1, g.width, -1),
                      e[:, idx + g.stride - 1].view(len(s), g.height - 1, g.width, -1))
    target = s[:, idx + g.stride].view_as(pred)
    rms = target.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
    assert torch.allclose(m.losses(batch)["loss_feat_down"], ((pred - target) / rms).pow(2).mean(), atol=1e-5)


def test_dataset_source_teacher_forces_world_images_and_keeps_sampled_validation(tiny_exports, teacher, tmp_path):
    """train_source=dataset: training shards hold the teacher's states on VQ-encoded world images (not samples),
    under new keys; validation stays the backbone's samples, the same files as the sampled source's."""
    from specgen.backbones.loading import load_shapes_generator
    from specgen.modules.distill_data import DATASET_OFFSET, teacher_states
    from specgen.world.dataset import example

    dm = DistillDataModule(str(tiny_exports / "ar"), str(tiny_exports / "vq"), teacher.hparams.cache_dir,
                           train_shards=1, val_shards=1, shard_size=4, sample_batch=4, cfg_scale=2.0,
                           train_source="dataset")
    assert dm.shard_path("val", 0) == teacher.shard_path("val", 0)
    assert dm.shard_path("train", 0) != teacher.shard_path("train", 0)
    dm.prepare_data()
    bb = load_shapes_generator(str(tiny_exports / "ar"), str(tiny_exports / "vq"))
    items = [example(DATASET_OFFSET + i, "train", 0, 64, 0.0) for i in range(4)]
    images = torch.stack([torch.from_numpy(img) for _, img, _ in items]).permute(0, 3, 1, 2)
    cond = bb.prompts([meta["prompt"] for meta, _, _ in items])
    states, ids = teacher_states(bb, cond, bb.tokenizer.encode(images))
    shard = __import__("numpy").load(dm.shard_path("train", 0))
    assert torch.equal(torch.from_numpy(shard["ids"]).long(), ids)
    assert torch.allclose(torch.from_numpy(shard["states"][:, 0]).float(), states, atol=2e-2, rtol=1e-2)  # fp16
    with pytest.raises(ValueError, match="data.train_source='web'"):
        DistillDataModule("a", "b", "c", train_source="web")


def test_drafter_report_reads_streamed_token_shards_as_their_states(tiny_exports, teacher, tmp_path):
    """A token shard (data.stream=true) scores as the states shard of the same samples (the states recomputed by the
    frozen backbone); a list mixing the two kinds is named."""
    h = teacher.hparams
    dm = DistillDataModule(str(tiny_exports / "ar"), str(tiny_exports / "vq"), h.cache_dir, train_shards=1,
                           val_shards=1, shard_size=4, sample_batch=4, cfg_scale=2.0, stream=True)
    dm.prepare_data()
    states, tokens = teacher.shard_path("val", 0), dm.shard_path("val", 0)
    assert tokens.name.endswith("_tokens.npz") and tokens.parent == states.parent
    args = ["--drafters", str(tiny_exports / "fphi"), "--backbone", str(tiny_exports / "ar"),
            "--tokenizer", str(tiny_exports / "vq"), "--cfg-scale", "2", "--out", str(tmp_path / "r.json")]
    a = drafter_report.main(args + ["--shards", str(states)])[str(tiny_exports / "fphi")]
    b = drafter_report.main(args + ["--shards", str(tokens)])[str(tiny_exports / "fphi")]
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-3) for k in a)
    with pytest.raises(ValueError, match="give shards of one kind"):
        drafter_report.main(args + ["--shards", str(states), str(tokens)])
