"""Loading code of the real-image scorers, on tiny random models saved locally (no hub access)."""
import numpy as np
import pytest
import torch

from specgen.evaluation.dpg_bench import Question
from specgen.evaluation.geneval import evaluate
from specgen.evaluation.real_models import (GENEVAL_COLORS, OpenClipColorClassifier, TransformersDetector,
                                            TransformersVQA)


@pytest.fixture(scope="module")
def tiny_detector(tmp_path_factory):
    from transformers import YolosConfig, YolosForObjectDetection, YolosImageProcessor

    path = tmp_path_factory.mktemp("yolos")
    torch.manual_seed(0)
    cfg = YolosConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      image_size=[64, 64], patch_size=16, num_detection_tokens=5,
                      id2label={0: "dog", 1: "bench"}, label2id={"dog": 0, "bench": 1})
    YolosForObjectDetection(cfg).save_pretrained(path)
    YolosImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}).save_pretrained(path)
    return path


def test_transformers_detector_and_open_clip_colours_plug_into_geneval(tiny_detector):
    colors = OpenClipColorClassifier("shapes-clip")  # random weights: the plumbing is what is tested
    det = TransformersDetector(str(tiny_detector), colors, min_score=0.0)
    image = np.random.RandomState(0).randint(0, 255, (64, 64, 3)).astype(np.uint8)
    objs = det.detect(image)
    assert len(objs) == 5 and all(o.cls in ("dog", "bench") and o.color in GENEVAL_COLORS for o in objs)
    assert all(0 <= o.score <= 1 and len(o.box) == 4 for o in objs)
    correct, _ = evaluate(objs, {"tag": "single_object", "include": [{"class": "zebra", "count": 1}]})
    assert not correct  # a class the detector does not know is never found


def test_transformers_vqa_answers_from_its_label_set(tmp_path):
    from transformers import BertTokenizerFast, ViltConfig, ViltForQuestionAnswering, ViltImageProcessor, ViltProcessor

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "is", "there", "a", "dog", "?"]) + "\n")
    tok = BertTokenizerFast(vocab_file=str(vocab))
    ViltProcessor(ViltImageProcessor(size={"shortest_edge": 64}), tok).save_pretrained(tmp_path / "vilt")
    torch.manual_seed(0)
    cfg = ViltConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=64,
                     patch_size=16, max_image_length=32, vocab_size=10, max_position_embeddings=40,
                     id2label={0: "yes", 1: "no"}, label2id={"yes": 0, "no": 1})
    ViltForQuestionAnswering(cfg).save_pretrained(tmp_path / "vilt")
    vqa = TransformersVQA(str(tmp_path / "vilt"))
    ans = vqa.answer(np.zeros((64, 64, 3), np.uint8), Question(1, [0], "entity - whole (dog)", "is there a dog?"))
    assert ans in ("yes", "no")


def test_missing_weights_name_the_path():
    with pytest.raises(FileNotFoundError, match=r"object-detection checkpoint not found at '/nonexistent/det'"):
        TransformersDetector("/nonexistent/det")
