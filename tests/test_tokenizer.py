from pathlib import Path

import pytest
import torch

from specgen.evaluation.reconstruction import objects_recovered, psnr
from specgen.tokenizers.vq import VQAutoencoder
from specgen.utils.checkpoints import load_exported
from specgen.utils.hydra import repo_root
from specgen.world.dataset import ShapesImages

SHIPPED = Path(repo_root()) / "checkpoints" / "vq_shapes"


def test_shipped_tokenizer_round_trip():
    """Held-out scenes survive encode -> decode: PSNR bound and parser accuracy on reconstructions."""
    vq = load_exported(SHIPPED)
    items = [ShapesImages(64, "test", seed=0, textured_frac=0.0)[i] for i in range(64)]
    x = torch.stack([it["image"] for it in items])
    codes = vq.encode(x)
    assert codes.shape == (64, 16, 16) and codes.dtype == torch.long
    rec = vq.decode(codes)
    rec_u8 = (rec * 255).round().to(torch.uint8)
    assert psnr(rec_u8.float() / 255, x.float() / 255).mean() > 26.0
    matched, total = objects_recovered(rec_u8, [it["scene"] for it in items], 64)
    assert matched / total >= 0.95
    assert torch.equal(vq.encode(rec_u8), vq.encode(rec_u8))  # deterministic


def test_wrong_image_size_is_rejected_with_the_fix():
    vq = VQAutoencoder(ch=16, mults=(2, 2), z_dim=8, num_codes=32)
    with pytest.raises(ValueError, match=r"\(B, 3, 64, 64\), got \(1, 3, 32, 32\).*resize to 64x64"):
        vq.encode(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 32\)"):
        vq.decode(torch.full((1, 16, 16), 40))


def test_missing_checkpoint_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m specgen.train experiment=train/vq_shapes"):
        load_exported(tmp_path / "vq_shapes")


def test_near_codes_decode_to_near_images_on_the_shipped_tokenizer():
    """The premise of `acceptance: latent`, checked by `tokenizer_report.neighbour_swaps`: swapping a tenth of the
    codes for nearer codes changes the image less (higher PSNR against the unswapped reconstruction) than for farther
    or random codes; no swap is the identity."""
    from specgen.analysis.tokenizer_report import neighbour_swaps

    m = neighbour_swaps(load_exported(SHIPPED), n=32, ranks=(1, 16))
    assert m["report/neighbours/rank0/psnr"] == 99.0 and m["report/neighbours/rank0/parser_acc"] >= 0.95
    assert m["report/neighbours/rank1/psnr"] > m["report/neighbours/rank16/psnr"] > m["report/neighbours/random/psnr"]
