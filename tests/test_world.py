import random

import numpy as np
import pytest

from specgen.world import match_scene, parse, prompts, relations, render, sample_example, scene_for
from specgen.world.prompts import SPLITS, TAGS, WORDS, sample_prompt, tokenize_words
from specgen.evaluation.geneval import Object, evaluate


@pytest.mark.parametrize("texture,any_size", [("plain", False), ("textured", False), ("plain", True)])
def test_parser_recovers_rendered_scenes(texture, any_size):
    rng = random.Random(123)
    matched = total = extra = 0
    for i in range(400):
        _, scene = sample_example(rng)
        m, n, d = match_scene(scene, parse(render(scene, 64, texture, seed=i), any_size=any_size), 64)
        matched, total, extra = matched + m, total + n, extra + (d - m)
    assert total > 800
    assert matched / total >= 0.99
    assert extra / total <= 0.01


def test_any_size_parse_reads_shapes_between_and_around_the_world_sizes():
    from specgen.world.render import shape_mask
    from specgen.world.scene import COLORS, SHAPES

    for side in range(10, 23):  # the world draws 12 and 20 px objects on a 64 px canvas
        for shape in SHAPES:
            img = np.full((64, 64, 3), 200, np.uint8)
            img[shape_mask(shape, (20, 24, 20 + side, 24 + side), 64)] = COLORS["orange"]
            (det,) = parse(img, any_size=True)
            assert (det.shape, det.color) == (shape, "orange"), (shape, side)
            assert det.size == ("small" if side <= 16 else "large")  # the nearest world size (16: a tie)
            assert det.score == 1.0


def test_scenes_satisfy_their_prompts_under_geneval_rules():
    """Rendered training scenes, parsed and scored with GenEval's rules, pass their own prompt."""
    rng = random.Random(7)
    for tag in TAGS:
        for _ in range(40):
            meta = sample_prompt(rng, tag, "train")
            img = render(scene_for(meta, rng), 64)
            dets = [Object(d.shape, d.box, d.score, d.color) for d in parse(img)]
            ok, reason = evaluate(dets, meta)
            assert ok, (meta["prompt"], reason)


def test_prompt_splits_are_disjoint_and_cover_every_task():
    for tag in TAGS:
        sets = {s: {m["prompt"] for m in prompts(tag, s)} for s in SPLITS}
        assert all(sets[s] for s in SPLITS), tag
        assert not (sets["train"] & sets["test"]) and not (sets["train"] & sets["val"]) and not (sets["val"] & sets["test"])
    rng = random.Random(0)
    dense = {sample_prompt(rng, "dense", "test")["prompt"] for _ in range(50)}
    dense_train = {sample_prompt(rng, "dense", "train")["prompt"] for _ in range(200)}
    assert not dense & dense_train


def test_metadata_follows_geneval_schema():
    m = prompts("position", "test")[0]
    assert set(m) == {"tag", "include", "prompt"}
    assert m["include"][1]["position"][1] == 0 and m["include"][1]["position"][0] in ("left of", "right of", "above", "below")
    c = prompts("counting", "test")[0]
    assert c["exclude"][0]["count"] == c["include"][0]["count"] + 1
    assert all(w in WORDS for t in TAGS for mm in prompts(t, "test") for w in tokenize_words(mm["prompt"]))


def test_relations_follow_geneval_geometry():
    a, b = (0, 0, 10, 10), (30, 0, 40, 10)
    assert relations(a, b) == {"left of"} and relations(b, a) == {"right of"}
    assert relations((0, 0, 10, 10), (0, 30, 10, 40)) == {"above"}
    # centres 4 px apart with 20 px of summed width: the 0.1 shrink cancels the offset
    assert relations((0, 0, 10, 10), (4, 0, 14, 10)) == set()


def test_unknown_words_name_the_word_and_the_fix():
    with pytest.raises(ValueError, match=r"unknown colour 'black'.*red"):
        tokenize_words("a photo of a black circle")
    with pytest.raises(ValueError, match=r"'dog'.*circle"):
        tokenize_words("a photo of a dog")
    with pytest.raises(ValueError, match="unknown shape 'hexagon'"):
        scene_for({"tag": "single_object", "include": [{"class": "hexagon", "count": 1}]}, random.Random(0))


@pytest.mark.parametrize("prompt", ["", "   "])
def test_an_empty_prompt_is_refused_not_made_unconditional(prompt):
    from specgen.backbones.mar import ShapesMAR
    from specgen.backbones.shapes_llama import ShapesLlama

    with pytest.raises(ValueError, match=r"empty prompt.*cfg_scale=0"):
        tokenize_words(prompt)
    with pytest.raises(ValueError, match="empty prompt"):
        ShapesLlama(num_codes=16, grid_size=4, preset="tiny").prompt_ids(["a red circle", prompt])
    with pytest.raises(ValueError, match="empty prompt"):
        ShapesMAR(grid_size=4, token_dim=3, preset="tiny", sample_steps=2).prompts([prompt])


def test_renderer_is_deterministic_and_textured_differs():
    _, scene = sample_example(random.Random(5))
    a, b = render(scene, 64, "textured", seed=3), render(scene, 64, "textured", seed=3)
    assert np.array_equal(a, b)
    plain = render(scene, 64)
    assert a.shape == plain.shape == (64, 64, 3) and a.dtype == np.uint8
    assert len(np.unique(a.reshape(-1, 3), axis=0)) > 4 * len(np.unique(plain.reshape(-1, 3), axis=0))
