"""Scorers for real images behind the same interfaces as the shapes-world ones, loaded from local paths
(no hub access): a transformers object detector + an open_clip zero-shot colour classifier for
GenEval, and a transformers VQA model for DPG-Bench.

GenEval's official evaluator uses Mask2Former and CLIP ViT-L/14 on the masked crop; any transformers
`AutoModelForObjectDetection` checkpoint plugs in here (boxes only: colours are classified on the box
crop over a grey background, GenEval's `bgcolor` default).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from specgen.evaluation.clipscore import load_clip
from specgen.evaluation.geneval import Object

GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")


def _need(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found at {str(path)!r}: download it once elsewhere and give its local "
                                f"folder (model hubs are not reached at run time)")
    return path


class OpenClipColorClassifier:
    """Zero-shot colour of an object crop with GenEval's prompts and colour list."""

    def __init__(self, model_name: str, checkpoint: str | None = None, device: str = "cpu",
                 colors: tuple[str, ...] = GENEVAL_COLORS):
        if checkpoint is not None:
            _need(checkpoint, "open_clip checkpoint")
        self.model, self.preprocess, self.tokenizer = load_clip(model_name, checkpoint, device)
        self.colors, self.device, self._text = colors, device, {}

    @torch.no_grad()
    def _text_features(self, cls: str) -> torch.Tensor:
        if cls not in self._text:
            feats = []
            for c in self.colors:
                t = self.tokenizer([tpl.format(c=c, cls=cls) for tpl in COLOR_TEMPLATES]).to(self.device)
                f = torch.nn.functional.normalize(self.model.encode_text(t).float(), dim=-1).mean(0)
                feats.append(torch.nn.functional.normalize(f, dim=0))
            self._text[cls] = torch.stack(feats)  # (C, D)
        return self._text[cls]

    @torch.no_grad()
    def __call__(self, crop: np.ndarray, cls: str) -> str:
        x = self.preprocess(Image.fromarray(crop)).unsqueeze(0).to(self.device)
        img = torch.nn.functional.normalize(self.model.encode_image(x).float(), dim=-1)
        return self.colors[int((img @ self._text_features(cls).t()).argmax())]


class TransformersDetector:
    """GenEval detector from a local transformers object-detection checkpoint (+ optional colour classifier)."""

    def __init__(self, model_path: str, color_classifier: OpenClipColorClassifier | None = None,
                 min_score: float = 0.05, device: str = "cpu", background: int = 153):
        from transformers import AutoImageProcessor, AutoModelForObjectDetection  # deferred: seconds to import

        path = _need(model_path, "object-detection checkpoint")
        self.processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForObjectDetection.from_pretrained(path, local_files_only=True).to(device).eval()
        self.colors, self.min_score, self.device, self.background = color_classifier, min_score, device, background

    @torch.no_grad()
    def detect(self, image: np.ndarray) -> list[Object]:
        inputs = self.processor(images=image, return_tensors="pt").to(self.device)
        out = self.model(**inputs)
        res = self.processor.post_process_object_detection(out, threshold=self.min_score,
                                                           target_sizes=[image.shape[:2]])[0]
        objs = []
        for score, label, box in zip(res["scores"].tolist(), res["labels"].tolist(), res["boxes"].tolist()):
            cls = self.model.config.id2label[int(label)]
            color = None
            if self.colors is not None:
                x0, y0, x1, y1 = (int(round(v)) for v in box)
                crop = image[max(y0, 0):max(y1, y0 + 1), max(x0, 0):max(x1, x0 + 1)]
                color = self.colors(crop if crop.size else image, cls)
            objs.append(Object(cls, tuple(box), float(score), color))
        return objs


class TransformersVQA:
    """DPG-Bench answerer from a local transformers VQA checkpoint (classification heads such as ViLT)."""

    def __init__(self, model_path: str, device: str = "cpu"):
        from transformers import AutoModelForVisualQuestionAnswering, AutoProcessor  # deferred, as above

        path = _need(model_path, "VQA checkpoint")
        self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForVisualQuestionAnswering.from_pretrained(path, local_files_only=True).to(device).eval()
        self.device = device

    @torch.no_grad()
    def answer(self, image: np.ndarray, question) -> str:
        text = getattr(question, "question", question)
        inputs = self.processor(images=Image.fromarray(image), text=text, return_tensors="pt").to(self.device)
        logits = self.model(**inputs).logits
        return self.model.config.id2label[int(logits.argmax(-1))].strip().lower()
