"""FID / IS / KID / precision-recall through torch-fidelity.

Embedded default: `ShapesFeatureNet` (trained by this repo) registered with torch-fidelity as the
feature extractor `specgen-shapes`; Inception v3 when the user gives a local weights file (the
hub download does not work offline). Reference statistics are cached under a name made from a
content hash of the reference images, so a changed reference set can never reuse stale stats.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import torch_fidelity
from torch.utils.data import Dataset
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

from specgen.utils.checkpoints import load_exported

EXTRACTOR = "specgen-shapes"


class _ShapesExtractor(FeatureExtractorBase):
    """torch-fidelity wrapper of an exported ShapesFeatureNet folder (given as the weights path)."""

    def __init__(self, name, features_list, feature_extractor_weights_path=None, **kwargs):
        super().__init__(name, features_list)
        if feature_extractor_weights_path is None:
            raise ValueError("the specgen-shapes extractor needs feature_extractor_weights_path=<exported folder>")
        self.net = load_exported(feature_extractor_weights_path).float().eval()

    def forward(self, x):
        feats, logits, _ = self.net(x)
        out = {"features": feats, "logits_unbiased": logits}
        return tuple(out[f].float() for f in self.features_list)

    @staticmethod
    def get_provided_features_list():
        return "features", "logits_unbiased"

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return {"isc": "logits_unbiased", "fid": "features", "kid": "features", "prc": "features"}[metric]

    @staticmethod
    def can_be_compiled():
        return False

    @staticmethod
    def get_dummy_input_for_compile():
        return torch.zeros(1, 3, 64, 64, dtype=torch.uint8)


def _register() -> None:
    if EXTRACTOR not in FEATURE_EXTRACTORS_REGISTRY:  # the registry is global: register once per process
        torch_fidelity.register_feature_extractor(EXTRACTOR, _ShapesExtractor)


class Images(Dataset):
    """uint8 (H, W, 3) arrays as the uint8 3xHxW tensors torch-fidelity expects."""

    def __init__(self, images: list[np.ndarray]):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.images[i], dtype=np.uint8)).permute(2, 0, 1).contiguous()  # writable copy


def content_hash(images: list[np.ndarray]) -> str:
    h = hashlib.sha1()
    for img in images:
        h.update(np.ascontiguousarray(img, dtype=np.uint8).tobytes())
    return h.hexdigest()[:16]


def fidelity(images: list[np.ndarray], reference: list[np.ndarray], extractor_dir: str | None = None,
             inception_weights: str | None = None, cache_dir: str | None = None, kid_subset_size: int = 100,
             prc: bool = True) -> dict[str, float]:
    """FID, IS (mean/std), KID (mean/std) and, optionally, precision/recall of `images` against `reference`."""
    if (extractor_dir is None) == (inception_weights is None):
        raise ValueError("give exactly one of extractor_dir (the shapes feature net) or inception_weights "
                         "(a local Inception v3 weights file)")
    path = extractor_dir or inception_weights
    if not Path(path).exists():
        raise FileNotFoundError(f"feature extractor weights {path!r} not found: train the shapes feature net with "
                                f"`python -m specgen.train experiment=train/featnet_shapes`, or give an existing file")
    n = min(len(images), len(reference))
    if n < 2:
        raise ValueError(f"FID needs at least 2 images per set, got {len(images)} and {len(reference)}")
    _register()
    kwargs = dict(feature_extractor=EXTRACTOR if extractor_dir else "inception-v3-compat",
                  feature_extractor_weights_path=path)
    metrics = torch_fidelity.calculate_metrics(
        input1=Images(images), input2=Images(reference), cuda=torch.cuda.is_available(), fid=True, isc=True,
        kid=True, prc=prc, kid_subset_size=min(kid_subset_size, n), save_cpu_ram=True, verbose=False,
        cache=cache_dir is not None, cache_root=cache_dir, input2_cache_name=f"ref-{content_hash(reference)}-"
        f"{Path(path).name}" if cache_dir else None, samples_find_deep=False, **kwargs)
    names = {"frechet_inception_distance": "fid", "inception_score_mean": "is_mean", "inception_score_std": "is_std",
             "kernel_inception_distance_mean": "kid_mean", "kernel_inception_distance_std": "kid_std",
             "precision": "precision", "recall": "recall"}
    out = {names[k]: float(v) for k, v in metrics.items() if k in names}
    out["num_images"] = float(len(images))
    return out


def features(images: list[np.ndarray], extractor_dir: str | None = None, inception_weights: str | None = None
             ) -> dict[str, torch.Tensor]:
    """Pool features (FID) and logits (IS) of uint8 images with the shapes feature net or a local Inception v3."""
    from torch_fidelity.utils import create_feature_extractor, get_featuresdict_from_dataset

    if (extractor_dir is None) == (inception_weights is None):
        raise ValueError("give exactly one of extractor_dir (the shapes feature net) or inception_weights "
                         "(a local Inception v3 weights file)")
    path = extractor_dir or inception_weights
    if not Path(path).exists():
        raise FileNotFoundError(f"feature extractor weights {path!r} not found: give an existing local file or folder")
    _register()
    cuda = torch.cuda.is_available()
    if extractor_dir:
        name, layers = EXTRACTOR, ["features", "logits_unbiased"]
    else:
        name, layers = "inception-v3-compat", ["2048", "logits_unbiased"]
    fe = create_feature_extractor(name, layers, cuda=cuda, feature_extractor_weights_path=path, verbose=False)
    out = get_featuresdict_from_dataset(Images(images), fe, 64, cuda, True, False)
    return {"pool": out[layers[0]], "logits": out["logits_unbiased"]}


def reference_statistics(images: list[np.ndarray], path: str | Path, **extractor) -> None:
    """Write FID reference statistics (mu, sigma of the pool features) of `images` to an npz."""
    from specgen.utils.checkpoints import atomic_savez

    f = features(images, **extractor)["pool"].double().numpy()
    atomic_savez(path, **gaussian_stats(f))


def fidelity_to_statistics(images: list[np.ndarray], reference_stats: str | Path, extractor_dir: str | None = None,
                           inception_weights: str | None = None) -> dict[str, float]:
    """FID against reference statistics (an npz with `mu` and `sigma`, e.g. ADM's ImageNet 256 reference batch,
    whose Inception features torch-fidelity's inception-v3-compat reproduces) and IS (10 splits)."""
    from torch_fidelity.metric_fid import fid_statistics_to_metric
    from torch_fidelity.metric_isc import isc_features_to_metric

    if not Path(reference_stats).is_file():
        raise FileNotFoundError(f"reference statistics {str(reference_stats)!r} not found: give an npz with mu and "
                                f"sigma (benchmark.fidelity.reference_stats=<npz>)")
    if len(images) < 2:
        raise ValueError(f"FID needs at least 2 images, got {len(images)}")
    ref = np.load(reference_stats)
    if "mu" not in ref or "sigma" not in ref:
        raise ValueError(f"{reference_stats}: expected arrays 'mu' and 'sigma', found {sorted(ref.files)}")
    f = features(images, extractor_dir, inception_weights)
    pool = f["pool"].double().numpy()
    mine = gaussian_stats(pool)
    theirs = {"mu": ref["mu"].astype(np.float64), "sigma": ref["sigma"].astype(np.float64)}
    if theirs["mu"].shape != mine["mu"].shape:
        raise ValueError(f"{reference_stats}: statistics of {theirs['mu'].shape[0]} features, the extractor gives "
                         f"{mine['mu'].shape[0]}: use the extractor the statistics were computed with")
    isc = isc_features_to_metric(f["logits"], splits=min(10, len(images)))
    return {"fid": float(fid_statistics_to_metric(mine, theirs, False)["frechet_inception_distance"]),
            "is_mean": isc["inception_score_mean"], "is_std": isc["inception_score_std"],
            "num_images": float(len(images))}


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """FID between two sets of pool features (rows are images): the Frechet distance of Gaussians with their means
    and covariances, torch-fidelity's formula."""
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    return float(fid_statistics_to_metric(gaussian_stats(a), gaussian_stats(b), False)["frechet_inception_distance"])


def gaussian_stats(features: np.ndarray) -> dict[str, np.ndarray]:
    """Mean and covariance (float64) of pool features, rows being images: the statistics FID compares."""
    f = np.asarray(features, np.float64)
    return {"mu": f.mean(0), "sigma": np.cov(f, rowvar=False)}


def _resamples(n: int, resamples: int, seed: int) -> np.ndarray:
    if resamples < 2:
        raise ValueError(f"a bootstrap needs at least 2 resamples, got {resamples}")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def fid_interval(images: np.ndarray, reference: np.ndarray, resamples: int = 200, seed: int = 0) -> float:
    """Half-width of a 95% interval of FID (1.96 bootstrap standard deviations) from pool features of generated
    `images` and of `reference` images for the same prompts: row i of both belongs to prompt i, and a resample draws
    prompts with replacement, so the interval holds the noise of both finite sets. A resample's duplicates bias its
    FID upwards; the standard deviation is taken around the resamples' own mean, so the interval is centred on the
    full sets' FID."""
    images, reference = np.asarray(images, np.float64), np.asarray(reference, np.float64)
    if len(images) != len(reference):
        raise ValueError(f"paired FID resampling needs one reference image per generated image, got {len(images)} "
                         f"and {len(reference)}")
    fids = [frechet_distance(images[i], reference[i]) for i in _resamples(len(images), resamples, seed)]
    return float(1.96 * np.std(fids, ddof=1))


def fid_paired_difference(images: np.ndarray, other: np.ndarray, reference: np.ndarray, resamples: int = 200,
                          seed: int = 0) -> dict[str, float]:
    """FID of `images` minus FID of `other` (another strategy's images for the same prompts and seeds, row i of all
    three sets belonging to prompt i), with a 95% interval from a paired bootstrap: each resample draws the same
    prompts for both strategies and the reference, so what the two share (the prompts, the reference draw) cancels
    in the difference."""
    images, other, reference = (np.asarray(x, np.float64) for x in (images, other, reference))
    if not len(images) == len(other) == len(reference):
        raise ValueError(f"a paired FID difference needs the same prompts for both strategies and the reference, got "
                         f"{len(images)}, {len(other)} and {len(reference)} images")
    diffs = [frechet_distance(images[i], reference[i]) - frechet_distance(other[i], reference[i])
             for i in _resamples(len(images), resamples, seed)]
    return {"fid_diff": frechet_distance(images, reference) - frechet_distance(other, reference),
            "fid_diff_ci95": float(1.96 * np.std(diffs, ddof=1))}
