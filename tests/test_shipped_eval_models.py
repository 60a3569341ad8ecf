"""The shipped evaluation models (CLIP for CLIPScore, feature net for FID/IS/KID) measure what they claim."""
from pathlib import Path

import numpy as np
import pytest

from specgen.world.dataset import example

ROOT = Path(__file__).resolve().parents[1]
CLIP = ROOT / "checkpoints" / "clip_shapes" / "model.safetensors"
FEATNET = ROOT / "checkpoints" / "featnet_shapes"


def _images(seed: int, n: int, split: str = "test") -> list[tuple[str, np.ndarray]]:
    return [(m["prompt"], img) for m, img, _ in (example(i, split, seed, 64, 0.0) for i in range(n))]


def test_shipped_clip_ranks_matching_prompts_above_mismatched_ones():
    """Held-out (test-split) scenes: each image's cosine with its own prompt beats its cosine with another
    image's prompt, for nearly every image, and both CLIPScore definitions separate the two."""
    from specgen.evaluation.clipscore import clip_score, cosines, load_clip

    model, preprocess, tokenizer = load_clip("shapes-clip", str(CLIP))
    pairs = _images(seed=123, n=64)
    prompts, images = [p for p, _ in pairs], [im for _, im in pairs]
    shifted = prompts[1:] + prompts[:1]
    keep = [i for i in range(len(prompts)) if prompts[i] != shifted[i]]
    match = cosines(model, preprocess, tokenizer, [images[i] for i in keep], [prompts[i] for i in keep])
    mismatch = cosines(model, preprocess, tokenizer, [images[i] for i in keep], [shifted[i] for i in keep])
    assert (match > mismatch).float().mean() >= 0.9
    good, bad = clip_score(match), clip_score(mismatch)
    assert good["clipscore_100cos"] > bad["clipscore_100cos"] + 20
    assert good["clipscore_hessel"] > bad["clipscore_hessel"]


def _corrupt(img: np.ndarray, frac: float, rng: np.random.Generator) -> np.ndarray:
    """Overwrite a share of the 4x4 cells (token-sized) with random colours, like a broken decoder would."""
    out = img.copy()
    for k in rng.choice(256, int(frac * 256), replace=False):
        r, c = divmod(int(k), 16)
        out[4 * r: 4 * r + 4, 4 * c: 4 * c + 4] = rng.integers(0, 256, 3)
    return out


@pytest.mark.slow
def test_shipped_feature_net_fid_is_zero_on_itself_and_grows_with_corruption():
    from specgen.evaluation.fidelity import fidelity

    reference = [im for _, im in _images(seed=1, n=300)]
    other = [im for _, im in _images(seed=2, n=300)]  # same distribution, other scenes
    rng = np.random.default_rng(0)
    fid = {"self": fidelity(reference, reference, extractor_dir=str(FEATNET), prc=False)["fid"],
           "same": fidelity(other, reference, extractor_dir=str(FEATNET), prc=False)["fid"]}
    for frac in (0.05, 0.3):
        corrupted = [_corrupt(im, frac, rng) for im in other]
        fid[frac] = fidelity(corrupted, reference, extractor_dir=str(FEATNET), prc=False)["fid"]
    assert fid["self"] == pytest.approx(0.0, abs=1e-3)
    assert 0 < fid["same"] < fid[0.05] < fid[0.3]
    assert fid[0.05] > 2 * fid["same"] and fid[0.3] > 5 * fid["same"]  # clearly separated, not noise
