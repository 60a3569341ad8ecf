"""Score a folder of DPG-Bench grids (`<item_id>.png`, 2x2 tiles, no padding) with a local VQA model.

    python -m specgen.evaluation.dpg_score <folder> --csv dpg_bench.csv --vqa <model folder> [--mode official]

Images that fail are counted (and listed), never silently dropped; `--mode official` reproduces
the released script's quirks (see `specgen.evaluation.dpg_bench`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from specgen.evaluation.dpg_bench import MODES, read_questions, score_image, summarize
from specgen.evaluation.real_models import TransformersVQA


def score_folder(folder: str | Path, questions: dict, vqa, mode: str = "fixed", num_crops: int = 4) -> dict:
    scores, cats, failed = [], {}, []
    for path in tqdm(sorted(Path(folder).glob("*.png")), desc="DPG-Bench", unit="img"):
        try:
            qs = questions[path.stem]
            s, per_cat = score_image(np.asarray(Image.open(path).convert("RGB")), qs, vqa, mode, num_crops)
        except Exception as e:  # counted and reported, unlike the released script
            failed.append(f"{path.name}: {e!r}")
            continue
        scores.append(s)
        for k, v in per_cat.items():
            cats.setdefault(k, []).extend(v)
    out = summarize(scores, cats, len(failed))
    return {**out, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--csv", required=True, help="the official question file (dpg_bench.csv)")
    ap.add_argument("--vqa", required=True, help="local transformers VQA checkpoint folder")
    ap.add_argument("--mode", choices=MODES, default="fixed")
    ap.add_argument("--crops", type=int, default=4, help="tiles scored per grid (the released script defaults to 1)")
    args = ap.parse_args()
    res = score_folder(args.folder, read_questions(args.csv, args.mode), TransformersVQA(args.vqa), args.mode, args.crops)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
