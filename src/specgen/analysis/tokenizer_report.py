"""Reconstruction report of an exported VQ tokenizer on held-out shapes-world scenes.

    python -m specgen.analysis.tokenizer_report checkpoints/vq_shapes [--n 512] [--write] [--neighbours]

Prints PSNR and parser accuracy (objects recovered from reconstructions) for plain and textured
scenes; `--write` merges the numbers into the folder's metrics.json under `report/`. `--neighbours` also
tests the premise of relaxed acceptance in latent space (`acceptance: latent`): a share of each scene's codes is
swapped for the code's j-th nearest code in the codebook (or a random code), and the report gives the PSNR of the
result against the unswapped reconstruction and the parser's accuracy on it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specgen.decoding.sampling import code_neighbours
from specgen.evaluation.reconstruction import objects_recovered, psnr
from specgen.utils.checkpoints import atomic_write_text, load_exported
from specgen.world.dataset import ShapesImages


@torch.no_grad()
def report(tokenizer, n: int = 512, batch: int = 64) -> dict[str, float]:
    out = {}
    for texture, frac in (("plain", 0.0), ("textured", 1.0)):
        ds = ShapesImages(n, "test", seed=0, image_size=tokenizer.image_size, textured_frac=frac)
        psnrs, matched, total, found_clean = [], 0, 0, 0
        for start in range(0, n, batch):
            items = [ds[i] for i in range(start, min(start + batch, n))]
            x = torch.stack([it["image"] for it in items])
            scenes = [it["scene"] for it in items]
            rec = (tokenizer.decode(tokenizer.encode(x)) * 255).round().to(torch.uint8)
            psnrs.append(psnr(rec.float() / 255, x.float() / 255))
            m, t = objects_recovered(rec, scenes, tokenizer.image_size)
            matched, total, found_clean = matched + m, total + t, found_clean + objects_recovered(
                x, scenes, tokenizer.image_size)[0]
        out[f"report/{texture}/psnr"] = float(torch.cat(psnrs).mean())
        out[f"report/{texture}/parser_acc_reconstructed"] = matched / total
        out[f"report/{texture}/parser_acc_rendered"] = found_clean / total
        out[f"report/{texture}/num_objects"] = float(total)
    return out


@torch.no_grad()
def neighbour_swaps(tokenizer, n: int = 256, share: float = 0.1, ranks: tuple[int, ...] = (1, 4, 16),
                    seed: int = 0) -> dict[str, float]:
    """Swap `share` of each held-out plain scene's codes (the same positions for every rank) for the code's rank-th
    nearest code (`code_neighbours`, as `acceptance: latent` ranks them) or a random code: PSNR against the unswapped
    reconstruction and the parser's accuracy, per rank (`report/neighbours/...`; `rank0`: no swap)."""
    ds = ShapesImages(n, "test", seed=0, image_size=tokenizer.image_size, textured_frac=0.0)
    items = [ds[i] for i in range(n)]
    x, scenes = torch.stack([it["image"] for it in items]), [it["scene"] for it in items]
    codes = tokenizer.encode(x)
    near = code_neighbours(tokenizer.quantizer.codebook, max(ranks))
    g = torch.Generator().manual_seed(seed)
    swap = torch.rand(codes.shape, generator=g) < share
    base = tokenizer.decode(codes)
    out = {}
    for rank in (0, *ranks, "random"):
        if rank == 0:
            new = codes
        elif rank == "random":
            new = torch.where(swap, torch.randint(0, tokenizer.num_codes, codes.shape, generator=g), codes)
        else:
            new = torch.where(swap, near[codes, rank - 1], codes)
        img = tokenizer.decode(new)
        key = f"report/neighbours/{'random' if rank == 'random' else f'rank{rank}'}"
        out[f"{key}/psnr"] = float(psnr(img, base).clamp_max(99).mean())
        matched, total = objects_recovered((img * 255).round().to(torch.uint8), scenes, tokenizer.image_size)
        out[f"{key}/parser_acc"] = matched / total
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="exported tokenizer folder, e.g. checkpoints/vq_shapes")
    ap.add_argument("--n", type=int, default=512, help="held-out scenes per texture")
    ap.add_argument("--write", action="store_true", help="merge the numbers into <dir>/metrics.json")
    ap.add_argument("--neighbours", action="store_true",
                    help="also swap 10%% of each scene's codes for near codes (the premise of acceptance=latent)")
    args = ap.parse_args(argv)
    tokenizer = load_exported(args.dir)
    metrics = report(tokenizer, args.n)
    if args.neighbours:
        metrics.update(neighbour_swaps(tokenizer, min(args.n, 256)))
    for k, v in metrics.items():
        print(f"{k:<45} {v:.4f}")
    if args.write:
        path = Path(args.dir) / "metrics.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        atomic_write_text(path, json.dumps({**old, **metrics}, indent=2, sort_keys=True) + "\n")
    return metrics


if __name__ == "__main__":
    main()
