"""The `fphi_deep` drafter: a deeper down trunk and the k tokens before each down draft. It grows from a trained
drafter (zero-initialised additions), reads exactly its k left tokens, is trained on them (teacher-forced, at each
distance), SSD drafts with it column by column (greedy output equal to AR), and a distillation can train one
direction only."""
import pytest
import torch

from helpers import tiny_llama
from specgen.backbones.protocol import embed_image
from specgen.decoding import ar, ssd, ssd_carry
from specgen.decoding.sampling import make_rngs
from specgen.decoding.ssd_carry.tails import Reweight
from specgen.drafters.fphi import FPhi
from specgen.modules.distill_module import DistillModule


def _deep(d=16, k=3, extra=2, **kw):
    return FPhi(d, "xs", context_kernel=3, left_context=True, left_tokens=k, down_extra_blocks=extra, **kw)


def test_deep_drafter_grows_from_the_left_context_one_and_reads_its_k_left_tokens():
    torch.manual_seed(0)
    base, deep = FPhi(16, "xs", context_kernel=3, left_context=True), _deep()
    for p in base.parameters():  # a trained-looking drafter: every weight non-zero
        torch.nn.init.normal_(p, std=0.1)
    missing, unexpected = deep.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith(("down_more.", "left_far.")) for k in missing)
    h, e = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    left = [torch.randn(2, 7, 16) for _ in range(3)]
    assert torch.allclose(deep.down(h, e, left), base.down(h, e, left[0]), atol=1e-6)  # step 0: the base drafter
    for p in (*deep.left_far.parameters(), *deep.down_more.parameters()):
        torch.nn.init.normal_(p, std=0.1)
    assert not torch.allclose(deep.down(h, e, left), base.down(h, e, left[0]), atol=1e-4)
    for j in range(3):  # changing the j-th token before column 4 moves column 4's draft, no other column's
        moved = [x.clone() for x in left]
        moved[j][:, 4] += 1.0
        diff = (deep.down(h, e, moved) - deep.down(h, e, left)).abs().sum(-1)
        assert (diff[:, 4] > 0).all() and (diff[:, [0, 1, 2, 3, 5, 6]] == 0).all(), j
    trunk = deep.down_trunk(h, e)  # the deeper trunk is what the column steps read
    assert torch.allclose(deep.down_column(trunk, h, left), deep.down(h, e, left), atol=1e-6)
    assert torch.allclose(deep(h, e, "down"), h + deep.nets["down"][-2:](trunk), atol=1e-6)


def test_deep_drafter_errors_name_the_value():
    with pytest.raises(ValueError, match="left_tokens=3"):
        FPhi(16, "xs", left_tokens=3)
    with pytest.raises(ValueError, match="down_extra_blocks=-1"):
        FPhi(16, "xs", down_extra_blocks=-1)
    with pytest.raises(ValueError, match="reads the 3 tokens before a down draft, got 1"):
        d = _deep()
        d.down(torch.randn(1, 5, 16), torch.randn(1, 5, 16), torch.randn(1, 5, 16))


@pytest.mark.parametrize("eol", [True, False])
def test_ssd_with_a_deep_drafter_equals_greedy_ar_and_drafts_with_it(eol):
    m = tiny_llama(eol=eol)
    torch.manual_seed(2)
    d = _deep(m.hidden_size, k=4)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.05)
    prompts = m.prompts(["a red circle", "two blue squares"])
    ref, _ = ar.generate(m, prompts, cfg_scale=2.0, temperature=0)
    for decode, kw in ((ssd.generate, {"rounds": m.grid.width}), (ssd.generate, {"exact": True}),
                       (ssd_carry.generate, {"rounds": 1}), (ssd_carry.generate, {"tails": [Reweight(2)]})):
        assert torch.equal(decode(m, prompts, d, cfg_scale=2.0, temperature=0, **kw)[0], ref), (eol, kw)
    # sampled drafts come from the k-token drafter: zeroing its far left maps changes them
    kw = dict(cfg_scale=2.0, rounds=1)
    for lin in d.left_far:  # far left tokens that matter
        torch.nn.init.normal_(lin.weight, std=1.0)
    out, _ = ssd_carry.generate(m, prompts, d, rngs=make_rngs([0, 1]), **kw)
    for lin in d.left_far:
        torch.nn.init.zeros_(lin.weight)
    near, _ = ssd_carry.generate(m, prompts, d, rngs=make_rngs([0, 1]), **kw)
    assert not torch.equal(out, near)


def test_distillation_feeds_the_k_tokens_before_each_down_draft_and_can_train_one_direction(tiny_exports, teacher):
    torch.manual_seed(0)
    net = FPhi(64, "xs", left_context=True, left_tokens=3, down_extra_blocks=1)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.05)
    m = DistillModule(net, str(tiny_exports / "ar"), str(tiny_exports / "vq"), directions=["down"]).eval()
    batch = next(iter(teacher.train_dataloader()))
    g = m.backbone.grid
    s = batch["states"].transpose(0, 1).flatten(0, 1)
    e = embed_image(m.backbone, batch["ids"].repeat(2, 1))
    idx = torch.tensor([r * g.stride + c for r in range(g.height - 1) for c in range(g.width)])

    def rows(x, shift=0):
        return x[:, idx + shift].view(len(x), g.height - 1, g.width, -1)

    pred = net.down(rows(s), rows(e), [rows(e, g.stride - j) for j in (1, 2, 3)])  # the j-th token before each
    target = rows(s, g.stride)
    rms = target.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
    out = m.losses(batch)
    assert torch.allclose(out["loss_feat_down"], ((pred - target) / rms).pow(2).mean(), atol=1e-5)
    assert not any("right" in k for k in out)  # module.directions=[down]: the right direction is not trained
    m.trainer = type("T", (), {"estimated_stepping_batches": 10, "max_steps": 10})()
    trained = {id(p) for group in m.configure_optimizers()["optimizer"].param_groups for p in group["params"]}
    assert trained and not any(id(p) in trained for p in net.nets["right"].parameters())
    assert all(id(p) in trained for p in (*net.nets["down"].parameters(), *net.down_more.parameters(),
                                          *net.left_far.parameters()))
    with pytest.raises(ValueError, match=r"module.directions=\['up'\]"):
        DistillModule(net, str(tiny_exports / "ar"), str(tiny_exports / "vq"), directions=["up"])


def test_drafter_report_counts_the_deeper_trunk_and_the_left_block_per_down_draft():
    from specgen.analysis.drafter_report import draft_flops, matmul_flops

    d = _deep(16, k=3, extra=2)
    per_block = matmul_flops(d.down_more[0])
    assert per_block == 2 * (16 * 32 * 2 + 16 * 16 * 3)  # the block's MLP and its kernel-3 row mixer
    assert draft_flops(d, "down") == matmul_flops(d.nets["down"]) + 2 * per_block + matmul_flops(d.left_block)
    assert draft_flops(d, "right") == matmul_flops(d.nets["right"])  # the left maps are lookups: never counted


def test_sure_accept_with_drafted_left_context_drafts_each_row_from_its_own_drafts(tmp_path, tiny_exports):
    """--left drafted: with the left maps at zero the drafts cannot see their left tokens, so the report equals the
    teacher-forced one; once the far maps read them, it does not; a drafter without left context is named."""
    from specgen.analysis import sure_accept
    from specgen.utils.checkpoints import export

    torch.manual_seed(0)
    cfg = {"_target_": "specgen.drafters.fphi.FPhi", "hidden_size": 64, "preset": "xs", "context_kernel": 3,
           "left_context": True, "left_tokens": 2, "down_extra_blocks": 1}
    d = FPhi(64, "xs", context_kernel=3, left_context=True, left_tokens=2, down_extra_blocks=1)
    for n, p in d.named_parameters():
        if not n.startswith(("left_in.", "left_far.")):
            torch.nn.init.normal_(p, std=0.05)
    export(tmp_path / "blind", d, cfg)
    for lin in d.left_far:
        torch.nn.init.normal_(lin.weight, std=1.0)
    export(tmp_path / "sees", d, cfg)
    base = ["--backbone", str(tiny_exports / "ar"), "--tokenizer", str(tiny_exports / "vq"), "--images", "2"]

    def run(name, left):
        res = sure_accept.main(["--drafter", str(tmp_path / name), *base, "--left", left,
                                "--out", str(tmp_path / f"{name}_{left}.json")])
        assert res["left"] == left
        return res["splits"]["all"]

    assert run("blind", "drafted") == pytest.approx(run("blind", "teacher"), abs=1e-6)
    assert run("sees", "drafted")["accept"] != pytest.approx(run("sees", "teacher")["accept"], abs=1e-6)
    with pytest.raises(ValueError, match="has no left context"):
        sure_accept.main(["--drafter", str(tiny_exports / "fphi"), *base, "--left", "drafted",
                          "--out", str(tmp_path / "x.json")])


def test_drafted_left_training_drafts_each_row_from_its_own_drafts(tiny_exports, teacher):
    """module.drafted_left: with the left maps at zero the drafted-left loss is the teacher-forced one; once the far
    maps read the left tokens it differs, and the loss reaches the left maps' weights."""
    torch.manual_seed(0)
    net = FPhi(64, "xs", left_context=True, left_tokens=2)
    for n, p in net.named_parameters():
        if not n.startswith(("left_in.", "left_far.")):
            torch.nn.init.normal_(p, std=0.05)
    batch = next(iter(teacher.train_dataloader()))
    kw = dict(backbone_dir=str(tiny_exports / "ar"), tokenizer_dir=str(tiny_exports / "vq"), directions=["down"],
              cfg_scale=2.0)
    forced, drafted = DistillModule(net, **kw).eval(), DistillModule(net, drafted_left=True, **kw).eval()
    assert torch.allclose(drafted.losses(batch)["loss"], forced.losses(batch)["loss"], atol=1e-6)
    for lin in net.left_maps():
        torch.nn.init.normal_(lin.weight, std=0.5)
    loss = drafted.losses(batch)["loss"]
    assert not torch.allclose(loss, forced.losses(batch)["loss"], atol=1e-4)
    loss.backward()
    assert all(lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0 for lin in net.left_maps())
