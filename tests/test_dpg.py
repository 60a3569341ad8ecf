"""DPG-Bench: readers of the official formats, dependency zeroing, crops, the shapes oracle."""
import random
from pathlib import Path

import numpy as np
import pytest

from specgen.evaluation.dpg_bench import (Question, ShapesOracle, crops, make_grid, read_prompts, read_questions,
                                          score_image, shapes_questions, summarize)
from specgen.world import render, scene_for
from specgen.world.prompts import sample_prompt

SHARED = Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "dpg_bench"
HEADER = "item_id,text,keywords,proposition_id,dependency,category_broad,category_detailed,tuple,question_natural_language\n"


class Scripted:
    """A VQA model with fixed answers per question id."""

    def __init__(self, yes: set[int]):
        self.yes = yes

    def answer(self, image, q):
        return "yes" if q.qid in self.yes else "no"


def _questions():
    return [Question(3, [2], "attribute - texture (dog, furry)", "is the brown dog furry?"),  # grandchild first
            Question(2, [1], "attribute - color (dog, brown)", "is the dog brown?"),
            Question(1, [0], "entity - whole (dog)", "is there a dog?")]


def test_dependency_zeroing_transitive_vs_official_order():
    grid = np.zeros((8, 8, 3), np.uint8)
    qs = _questions()
    fixed, cats = score_image(grid, qs, Scripted({2, 3}), mode="fixed")
    assert fixed == 0.0  # parent 1 failed -> 2 zeroed -> 3 zeroed
    official, ocats = score_image(grid, qs, Scripted({2, 3}), mode="official")
    assert official == pytest.approx(1 / 3)  # one pass in file order: 3 kept (2 not zeroed yet), then 2 zeroed
    assert ocats["attribute - color"] == [1.0]  # official categories use the answers before zeroing
    assert score_image(grid, qs, Scripted({1, 2, 3}), mode="fixed")[0] == 1.0
    s = summarize([1.0, 0.5], {"entity - whole": [1.0, 0.0], "entity - part": [1.0]}, failed=1)
    assert s["overall"] == 75.0 and s["L1/entity"] == pytest.approx(200 / 3) and s["num_failed"] == 1
    # 95% interval over the prompts: 100 x 1.96 x sample std / sqrt(n); std of (1, 0.5) = sqrt(0.125)
    assert s["overall_ci95"] == pytest.approx(100 * 1.96 * 0.125 ** 0.5 / 2 ** 0.5)
    assert summarize([1.0], {}, failed=0)["overall_ci95"] == 0.0


def test_grid_and_crops_have_no_padding():
    tiles = [np.full((4, 4, 3), i, np.uint8) for i in range(4)]
    grid = make_grid(tiles)
    assert grid.shape == (8, 8, 3)
    assert all(np.array_equal(a, b) for a, b in zip(crops(grid), tiles))
    with pytest.raises(ValueError, match="2x2 grid"):
        crops(np.zeros((8, 6, 3), np.uint8))


def test_question_csv_reader_and_official_first_row_quirk(tmp_path):
    path = tmp_path / "dpg.csv"
    path.write_text(HEADER + '7,t,k,1,0,entity,whole,entity - whole (dog),is there a dog?\n'
                    '7,t,k,2,1,attribute,color,"attribute - color (dog, brown)",is the dog brown?\n'
                    '9,t,k,1,0,entity,whole,entity - whole (cat),is there a cat?\n')
    fixed = read_questions(path, "fixed")
    assert [q.qid for q in fixed["7"]] == [1, 2] and fixed["7"][1].parents == [1]
    assert [q.qid for q in read_questions(path, "official")["7"]] == [2]
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER.replace(",tuple", ",tup"))
    with pytest.raises(ValueError, match=r"missing columns \['tuple'\]"):
        read_questions(bad)


def test_an_empty_prompt_folder_or_file_is_refused_by_name(tmp_path):
    (tmp_path / "prompts").mkdir()
    with pytest.raises(ValueError, match=r"prompts' holds no <item_id>.txt files"):
        read_prompts(tmp_path / "prompts")
    (tmp_path / "prompts" / "a.txt").write_text("a red circle\n")
    (tmp_path / "prompts" / "b.txt").write_text("  \n")
    with pytest.raises(ValueError, match=r"prompts/b.txt'\] are empty"):
        read_prompts(tmp_path / "prompts")
    (tmp_path / "prompts" / "b.txt").write_text("two squares")
    assert read_prompts(tmp_path / "prompts") == {"a": "a red circle", "b": "two squares"}


def test_official_prompt_folder_reads():
    if not SHARED.is_dir():
        pytest.skip("reference copy of the DPG-Bench prompts not present")
    prompts = read_prompts(SHARED / "prompts")
    assert len(prompts) == 1065 and all(prompts.values())


def test_shapes_oracle_scores_rendered_scenes_perfectly_and_catches_wrong_ones():
    rng = random.Random(0)
    oracle = ShapesOracle()
    for _ in range(20):
        meta = sample_prompt(rng, "dense", "test")
        tiles = [render(scene_for(meta, rng)) for _ in range(4)]
        assert score_image(make_grid(tiles), shapes_questions(meta), oracle)[0] == 1.0
        other = sample_prompt(rng, "dense", "test")
        wrong = [render(scene_for(other, rng)) for _ in range(4)]
        assert score_image(make_grid(wrong), shapes_questions(meta), oracle)[0] < 1.0 or other == meta


def test_score_folder_counts_failures_instead_of_dropping_them(tmp_path):
    from PIL import Image

    from specgen.evaluation.dpg_score import score_folder

    rng = random.Random(1)
    meta = sample_prompt(rng, "dense", "test")
    tiles = [render(scene_for(meta, rng)) for _ in range(4)]
    Image.fromarray(make_grid(tiles)).save(tmp_path / "7.png")
    Image.fromarray(make_grid(tiles)).save(tmp_path / "8.png")  # no questions for item 8
    Image.fromarray(np.zeros((10, 6, 3), np.uint8)).save(tmp_path / "9.png")
    out = score_folder(tmp_path, {"7": shapes_questions(meta), "9": shapes_questions(meta)}, ShapesOracle())
    assert out["overall"] == 100.0 and out["num_images"] == 1 and out["num_failed"] == 2
    assert any("8.png" in f for f in out["failed"]) and any("2x2 grid" in f for f in out["failed"])
