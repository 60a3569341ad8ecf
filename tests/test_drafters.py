"""Drafters alone: shapes, which offset each output predicts, and errors that name the drafter's kind and the
experiment that distils the right one."""
import pytest
import torch

from helpers import tiny_llama
from specgen.backbones.loading import load_shapes_generator
from specgen.decoding import mtp1d, ssd
from specgen.drafters.fphi import FPhi, TokenDrafter
from specgen.drafters.mtp import MTPHeads
from specgen.modules.distill_module import DistillModule
from specgen.utils.checkpoints import REPO_ROOT, build, export, load_exported


def test_mtp_heads_shapes_directions_and_identity_start():
    heads = MTPHeads(16, num_heads=3)
    assert heads.directions == ("ahead_1", "ahead_2", "ahead_3") and heads.num_heads == 3
    h = torch.randn(2, 5, 16)  # (B, T, D) pre-norm states
    for k in (1, 2, 3):
        out = heads.ahead(h, k)
        assert out.shape == (2, 5, 16)
        assert torch.equal(out, h)  # zero-initialised last layers: each head starts as h_q -> h_q
    assert torch.equal(heads(h, torch.randn(2, 5, 16), "ahead_2"), heads(h, None, "ahead_2"))  # no embedding used
    with pytest.raises(ValueError, match=r"these heads predict \('ahead_1', 'ahead_2', 'ahead_3'\), not 'ahead_4'"):
        heads.ahead(h, 4)
    with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
        MTPHeads(16, num_heads=0)


def test_each_mtp_head_is_its_own_offset():
    """Head k alone predicts the state k positions ahead: training one head leaves the others as they were."""
    torch.manual_seed(0)
    heads = MTPHeads(16, num_heads=3, blocks=2)
    torch.nn.init.normal_(heads.nets["ahead_2"][-1].weight, std=0.1)
    h = torch.randn(4, 16)
    assert not torch.allclose(heads.ahead(h, 2), h)
    assert torch.equal(heads.ahead(h, 1), h) and torch.equal(heads.ahead(h, 3), h)
    assert len(heads.nets["ahead_1"]) == 1 + 2 + 2  # in-projection, 2 residual blocks, norm, out-projection


def test_token_drafter_reads_the_next_token_only_and_outputs_code_logits():
    torch.manual_seed(0)
    d = TokenDrafter(hidden_size=16, num_codes=24, preset="xs")
    assert d.predicts == "tokens" and d.directions == ("right", "down")
    e = torch.randn(2, 5, 16)  # (B, T, D) embeddings of x_{q+1}
    right, down = d.right(torch.randn(2, 5, 16), e), d.down(torch.zeros(2, 5, 16), e)
    assert right.shape == down.shape == (2, 5, 24)  # logits over the visual codes, no state out
    assert torch.equal(d.right(torch.zeros(2, 5, 16), e), right)  # the state is not an input
    assert not torch.allclose(right, down)  # one network per direction
    assert not torch.allclose(d.right(torch.zeros(2, 5, 16), e.flip(1)), right)
    one_way = TokenDrafter(16, 24, "xs", directions=("right",))
    with pytest.raises(ValueError, match=r"this drafter predicts \('right',\), not 'down'"):
        one_way.down(e, e)
    with pytest.raises(ValueError, match=r"unknown drafter directions \['up'\]"):
        TokenDrafter(16, 24, "xs", directions=("right", "up"))


@pytest.mark.parametrize("eol", [True, False])
def test_distillation_offsets_follow_the_row_layout(tmp_path, eol):
    """right -> the next position, down -> one row stride (width + the end-of-row token when there is one),
    ahead_k -> k positions."""
    cfg = {"_target_": "specgen.backbones.shapes_llama.ShapesLlama", "num_codes": 32, "grid_size": 4, "eol": eol,
           "preset": "tiny"}
    vq = {"_target_": "specgen.tokenizers.vq.VQAutoencoder", "image_size": 16, "ch": 8, "mults": [2, 2], "z_dim": 4,
          "num_codes": 32}
    export(tmp_path / "ar", build(cfg), cfg)
    export(tmp_path / "vq", build(vq), vq)
    stride = 4 + eol
    fphi = DistillModule(FPhi(64, "xs"), str(tmp_path / "ar"), str(tmp_path / "vq"))
    assert fphi.tasks() == [("right", 1), ("down", stride)]
    heads = DistillModule(MTPHeads(64, num_heads=3), str(tmp_path / "ar"), str(tmp_path / "vq"))
    assert heads.tasks() == [("ahead_1", 1), ("ahead_2", 2), ("ahead_3", 3)]


def test_drafter_kind_mismatches_suggest_the_right_command():
    m = tiny_llama(eol=True)
    p = m.prompts(["a red circle"])
    heads = MTPHeads(m.hidden_size, num_heads=2)
    with pytest.raises(ValueError, match=r"is an MTP checkpoint.*not an SSD drafter.*decoding=mtp1d") as err:
        ssd.generate(m, p, heads, temperature=0)
    assert "vertical=false" not in str(err.value)
    with pytest.raises(ValueError, match=r"is an f_phi \(SSD\) drafter.*not multi-token heads.*decoding=ssd"):
        mtp1d.generate(m, p, FPhi(m.hidden_size, "xs"), temperature=0)
    with pytest.raises(ValueError, match=r"MTP checkpoint.*width 32 .*experiment=train/mtp_shapes") as err:
        mtp1d.generate(m, p, MTPHeads(32, num_heads=2), temperature=0)
    assert "fphi_shapes" not in str(err.value)
    heads.backbone_id = "aaaa"
    m.identity = "bbbb-cccc"
    with pytest.raises(ValueError, match=r"MTP checkpoint.*from backbone weights 'aaaa'.*experiment=train/mtp_shapes"):
        mtp1d.generate(m, p, heads, temperature=0)
    with pytest.raises(ValueError, match=r"token-id drafter.*width 32.*experiment=train/fphi_tokens_shapes"):
        ssd.generate(m, p, TokenDrafter(32, 24, "xs"), temperature=0)
    with pytest.raises(ValueError, match=r"drafts \['right', 'down'\] but the drafter predicts only \['right'\].*"
                                         r"vertical=false"):
        m.identity = ""
        ssd.generate(m, p, FPhi(m.hidden_size, "xs", directions=("right",)), temperature=0)


def test_the_shipped_mtp_heads_given_to_ssd_are_named_as_such():
    ck = REPO_ROOT / "checkpoints"
    backbone = load_shapes_generator(str(ck / "ar_shapes"), str(ck / "vq_shapes"))
    with pytest.raises(ValueError, match=r"is an MTP checkpoint \(1D multi-token heads\), predicting \['ahead_1'"):
        ssd.generate(backbone, backbone.prompts(["a red circle"]), load_exported(ck / "mtp_shapes"))
