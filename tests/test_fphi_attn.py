"""The `fphi_attn` drafter: row attention in the down trunk. It grows from the shipped fphi_gpu without changing a
single draft at step 0, attends to every column of the row above (both sides, positions known), drafts with SSD
(greedy output equal to AR), and the drafter report counts its attention per drafted token."""
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from helpers import compose_cfg, tiny_llama
from specgen.decoding import ar, ssd, ssd_carry
from specgen.decoding.sampling import make_rngs
from specgen.drafters.fphi import FPhi
from specgen.utils.checkpoints import build, load_exported

ROOT = Path(__file__).resolve().parents[1]


def _attn(d=16, layers=1, heads=4, **kw):
    return FPhi(d, "xs", context_kernel=3, left_context=True, down_attention=layers, attention_heads=heads, **kw)


def _trained_looking(net, std=0.1):
    torch.manual_seed(0)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=std)
    return net


def test_grown_from_fphi_gpu_it_drafts_exactly_as_fphi_gpu_at_step_0():
    gpu = load_exported(ROOT / "checkpoints" / "fphi_gpu")
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "drafter" / "fphi_attn.yaml"))
    assert cfg["down_attention"] == 1
    grown = FPhi(gpu.hidden_size, "s", context_kernel=5, left_context=True, down_attention=1,
                 attention_heads=cfg["attention_heads"]).eval()
    missing, unexpected = grown.load_state_dict(load_file(str(ROOT / "checkpoints/fphi_gpu/model.safetensors")),
                                                strict=False)  # what train.py's init_strict=false does
    assert not unexpected and missing and all(k.startswith("down_attn.") for k in missing)
    torch.manual_seed(1)
    d = gpu.hidden_size
    h, e, left = torch.randn(3, 16, d) * 4, torch.randn(3, 16, d), torch.randn(3, 16, d)
    with torch.no_grad():
        assert torch.equal(grown.down_trunk(h, e), gpu.down_trunk(h, e))
        assert torch.equal(grown.down(h, e, left), gpu.down(h, e, left))
        assert torch.equal(grown.right(h[:, 0], e[:, 0]), gpu.right(h[:, 0], e[:, 0]))
        torch.nn.init.normal_(grown.down_attn[0].out.weight, std=0.05)  # a trained block: the drafts move
        assert not torch.allclose(grown.down(h, e, left), gpu.down(h, e, left), atol=1e-3)


def test_the_training_preset_grows_fphi_gpu_into_the_attention_drafter(tmp_path):
    cfg = compose_cfg("train", ["experiment=train/fphi_attn"], tmp_path)
    net = build(OmegaConf.to_container(cfg.drafter, resolve=True))
    assert isinstance(net, FPhi) and net.down_attention == 1 and net.row_inputs == ("down",)
    assert net.context_kernel == 5 and net.left_context and net.left_tokens == 1  # fphi_gpu's shape otherwise
    assert Path(cfg.init_from).name == "fphi_gpu" and cfg.init_strict is False
    assert cfg.callbacks.time_budget.seconds > 0 and cfg.callbacks.model_checkpoint.every_n_train_steps == 50
    old = load_exported(ROOT / "checkpoints" / "fphi_gpu")  # strict load of a checkpoint without the option
    assert old.down_attention == 0 and not hasattr(old, "down_attn")


def test_every_column_attends_to_the_whole_row_above_with_positions():
    net = _trained_looking(_attn()).eval()
    h, e = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    with torch.no_grad():
        base = net.down_trunk(h, e)
        moved = h.clone()
        moved[:, 5] += torch.randn(16)  # one column (not a constant shift: the input norm removes that) of the row above: every column's trunk moves, left and right of it
        diff = (net.down_trunk(moved, e) - base).abs().sum(-1)
        assert (diff > 1e-4).all()
        net.down_attn = torch.nn.ModuleList()  # without attention the kernel-3 mixers reach two columns per block
        net.down_attention = 0
        diff = (net.down_trunk(moved, e) - net.down_trunk(h, e)).abs().sum(-1)
        assert (diff[:, 0] == 0).all() and (diff[:, 5] > 0).all()
    net = _trained_looking(FPhi(16, "xs", down_attention=1)).eval()  # attention alone, point-wise blocks
    with torch.no_grad():
        flip = torch.arange(7, -1, -1)
        # positions: reversing the row does not just reverse the trunk (a position-blind attention would)
        assert not torch.allclose(net.down_trunk(h[:, flip], e[:, flip]), net.down_trunk(h, e)[:, flip], atol=1e-4)
        trunk = net.down_trunk(h, e)
        assert torch.allclose(net(h, e, "down"), h + net.nets["down"][-2:](trunk), atol=1e-6)


def test_attention_errors_name_the_value():
    with pytest.raises(ValueError, match="attention_heads=3"):
        FPhi(16, "xs", down_attention=1, attention_heads=3)
    with pytest.raises(ValueError, match="down_attention=-1"):
        FPhi(16, "xs", down_attention=-1)
    with pytest.raises(ValueError, match=r"down_attention=1.*'down' in directions"):
        FPhi(16, "xs", down_attention=1, directions=("right",))
    with pytest.raises(ValueError, match="expected \\(..., W, D\\) inputs"):
        FPhi(16, "xs", down_attention=1)(torch.randn(2, 16), torch.randn(2, 16), "down")


@pytest.mark.parametrize("eol", [True, False])
def test_ssd_with_an_attention_drafter_equals_greedy_ar_and_drafts_with_it(eol):
    m = tiny_llama(eol=eol)
    d = _trained_looking(_attn(m.hidden_size), std=0.05).eval()
    prompts = m.prompts(["a red circle", "two blue squares"])
    ref, _ = ar.generate(m, prompts, cfg_scale=2.0, temperature=0)
    for decode, kw in ((ssd.generate, {"rounds": m.grid.width}), (ssd.generate, {"exact": True}),
                       (ssd_carry.generate, {"rounds": 1})):
        assert torch.equal(decode(m, prompts, d, cfg_scale=2.0, temperature=0, **kw)[0], ref), (eol, kw)
    kw = dict(cfg_scale=2.0, rounds=1)  # sampled drafts come from the attention drafter: zeroing its block changes them
    out, _ = ssd_carry.generate(m, prompts, d, rngs=make_rngs([0, 1]), **kw)
    torch.nn.init.zeros_(d.down_attn[0].out.weight)
    torch.nn.init.zeros_(d.down_attn[0].out.bias)
    blind, _ = ssd_carry.generate(m, prompts, d, rngs=make_rngs([0, 1]), **kw)
    assert not torch.equal(out, blind)


def test_drafter_report_counts_the_row_attention_per_down_draft():
    from specgen.analysis.drafter_report import draft_flops, matmul_flops

    d, plain = _attn(16, layers=2), FPhi(16, "xs", context_kernel=3, left_context=True)
    per_block = 2 * (16 * 48 + 16 * 16) + 4 * 8 * 16  # q, k, v and out projections; scores and mix over 8 columns
    assert d.down_attn[0].flops_per_position(8) == per_block
    assert draft_flops(d, "down", 8) == draft_flops(plain, "down") + 2 * per_block
    assert draft_flops(d, "down", 8) == matmul_flops(d.nets["down"]) + matmul_flops(d.left_block) + 2 * per_block
    assert draft_flops(d, "right", 8) == draft_flops(plain, "right")


def test_distillation_trains_the_zero_started_block_on_the_down_direction(tiny_exports, teacher):
    from specgen.modules.distill_module import DistillModule

    torch.manual_seed(0)
    net = FPhi(64, "xs", context_kernel=3, left_context=True, down_attention=1)
    for name, p in net.named_parameters():  # a trained drafter grown by the block: its output map still at zero
        if not name.startswith("down_attn."):
            torch.nn.init.normal_(p, std=0.05)
    m = DistillModule(net, str(tiny_exports / "ar"), str(tiny_exports / "vq"), directions=["down"])
    m.trainer = type("T", (), {"estimated_stepping_batches": 10, "max_steps": 10})()
    trained = {id(p) for group in m.configure_optimizers()["optimizer"].param_groups for p in group["params"]}
    assert all(id(p) in trained for p in net.down_attn.parameters())
    out = m.losses(next(iter(teacher.train_dataloader())))
    out["loss"].backward()
    assert net.down_attn[0].out.weight.grad.abs().sum() > 0  # the first step moves it off zero
