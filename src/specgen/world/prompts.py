"""Prompt grammar of the shapes world: GenEval's six tasks plus DPG-style dense prompts.

Every prompt comes with GenEval-schema metadata (`tag`, `include`, `exclude`, `prompt`), and the
scene sampler below draws scenes that satisfy it. Prompt splits are disjoint by prompt string.
"""
from __future__ import annotations

import hashlib
import math
import random
from functools import lru_cache
from itertools import permutations

from specgen.world.scene import COLORS, PLURALS, SHAPES, SIZES, Scene, check_words, place, relations

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
ALL_TAGS = TAGS + ("dense",)
PREFIXES = ("a photo of", "an image of", "a picture of", "a drawing of")
NUMBERS = {2: "two", 3: "three", 4: "four"}
RELATIONS = ("left of", "right of", "above", "below")
REGIONS = {  # name -> (x0, y0, x1, y1) bounds of the object centre, canvas fractions
    f"{v}{' ' if v and h else ''}{h}" or "center": (j / 3, i / 3, (j + 1) / 3, (i + 1) / 3)
    for i, v in enumerate(("top", "", "bottom")) for j, h in enumerate(("left", "", "right"))
}
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = {"test": 0.15, "val": 0.10}  # of each task's prompts; the rest is train
# Training mixture over tasks (dense prompts describe the whole scene: the richest signal).
DEFAULT_MIX = {"single_object": 0.08, "two_object": 0.12, "counting": 0.16, "colors": 0.12,
               "position": 0.18, "color_attr": 0.16, "dense": 0.18}


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _enumerate(tag: str) -> list[dict]:
    out = []
    for prefix in PREFIXES:
        if tag == "single_object":
            for s in SHAPES:
                out.append({"include": [{"class": s, "count": 1}], "prompt": f"{prefix} {_a(s)}"})
        elif tag == "two_object":
            for s1, s2 in permutations(SHAPES, 2):
                out.append({"include": [{"class": s1, "count": 1}, {"class": s2, "count": 1}],
                            "prompt": f"{prefix} {_a(s1)} and {_a(s2)}"})
        elif tag == "counting":
            for s in SHAPES:
                for n, word in NUMBERS.items():
                    out.append({"include": [{"class": s, "count": n}], "exclude": [{"class": s, "count": n + 1}],
                                "prompt": f"{prefix} {word} {PLURALS[s]}"})
        elif tag == "colors":
            for c in COLORS:
                for s in SHAPES:
                    out.append({"include": [{"class": s, "count": 1, "color": c}], "prompt": f"{prefix} {_a(c)} {s}"})
        elif tag == "position":
            for s1, s2 in permutations(SHAPES, 2):
                for rel in RELATIONS:
                    # GenEval: the second clause is the subject, positioned relative to clause 0
                    out.append({"include": [{"class": s2, "count": 1},
                                            {"class": s1, "count": 1, "position": [rel, 0]}],
                                "prompt": f"{prefix} {_a(s1)} {rel} {_a(s2)}"})
        elif tag == "color_attr":
            for s1, s2 in permutations(SHAPES, 2):
                for c1 in COLORS:
                    for c2 in COLORS:
                        out.append({"include": [{"class": s1, "count": 1, "color": c1},
                                                {"class": s2, "count": 1, "color": c2}],
                                    "prompt": f"{prefix} {_a(c1)} {s1} and {_a(c2)} {s2}"})
        else:
            raise ValueError(f"unknown task {tag!r}: expected one of {TAGS}")
    return [{"tag": tag, **m} for m in out]


def _unit_hash(text: str) -> float:
    return int(hashlib.sha1(text.encode()).hexdigest()[:12], 16) / 16 ** 12


@lru_cache(maxsize=None)
def _split_table(tag: str) -> dict[str, tuple[dict, ...]]:
    items = sorted(_enumerate(tag), key=lambda m: _unit_hash(m["prompt"]))
    n_test = math.ceil(SPLIT_FRACTIONS["test"] * len(items))
    n_val = math.ceil(SPLIT_FRACTIONS["val"] * len(items))
    return {"test": tuple(items[:n_test]), "val": tuple(items[n_test:n_test + n_val]),
            "train": tuple(items[n_test + n_val:])}


def prompts(tag: str, split: str) -> list[dict]:
    """All prompts (GenEval metadata dicts) of a task in a split, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")
    if tag == "dense":
        raise ValueError("dense prompts are sampled, not enumerated: use sample_prompt(rng, 'dense', split)")
    return [dict(m) for m in _split_table(tag)[split]]


def dense_split(prompt: str) -> str:
    u = _unit_hash(prompt)
    return "test" if u < SPLIT_FRACTIONS["test"] else "val" if u < sum(SPLIT_FRACTIONS.values()) else "train"


def _dense_prompt(rng: random.Random) -> dict:
    while True:
        n = rng.randint(1, 4)
        objs = [{"shape": rng.choice(SHAPES), "color": rng.choice(list(COLORS)), "size": rng.choice(list(SIZES)),
                 "region": r} for r in rng.sample(list(REGIONS), n)]
        try:  # keep only layouts that fit (large objects in neighbouring regions may not)
            place(objs, random.Random(0), regions=[REGIONS[o["region"]] for o in objs], tries=100)
            break
        except RuntimeError:
            continue
    phrases = [f"{_a(o['size'])} {o['color']} {o['shape']} "
               f"{'in the center' if o['region'] == 'center' else 'in the ' + o['region']}" for o in objs]
    text = phrases[0] if n == 1 else " , ".join(phrases[:-1]) + " and " + phrases[-1]
    return {"tag": "dense", "objects": objs, "prompt": text + " ."}


def sample_prompt(rng: random.Random, tag: str, split: str) -> dict:
    """One prompt of a task drawn uniformly from a split."""
    if tag != "dense":
        return dict(rng.choice(_split_table(tag)[split]))
    while True:
        meta = _dense_prompt(rng)
        if dense_split(meta["prompt"]) == split:
            return meta


def _relation_holds(rel: str, subject_idx: int, target_idx: int, canvas: int, margin: float = 0.6):
    def check(objs):
        rels = relations(objs[subject_idx].box(canvas), objs[target_idx].box(canvas), threshold=margin)
        return rel in rels
    return check


def scene_for(meta: dict, rng: random.Random, canvas: int = 64) -> Scene:
    """A random scene satisfying a prompt's metadata; unmentioned attributes are random."""
    if meta["tag"] == "dense":
        specs = [{k: o[k] for k in ("shape", "color", "size")} for o in meta["objects"]]
        for o in meta["objects"]:
            check_words(o["shape"], o["color"], o["size"])
        return place(specs, rng, canvas, regions=[REGIONS[o["region"]] for o in meta["objects"]])
    specs, owner = [], []
    for ci, clause in enumerate(meta["include"]):
        check_words(clause["class"], clause.get("color"))
        for _ in range(clause["count"]):
            specs.append({"shape": clause["class"], "color": clause.get("color") or rng.choice(list(COLORS)),
                          "size": rng.choice(list(SIZES))})
            owner.append(ci)
    relation = None
    for ci, clause in enumerate(meta["include"]):
        if "position" in clause:
            rel, target = clause["position"]
            relation = _relation_holds(rel, owner.index(ci), owner.index(target), canvas)
    while True:
        try:
            return place(specs, rng, canvas, relation=relation, tries=200)
        except RuntimeError:  # too crowded at these sizes: redraw the sizes
            for s in specs:
                s["size"] = rng.choice(list(SIZES))


def sample_example(rng: random.Random, split: str = "train", canvas: int = 64,
                   mix: dict[str, float] | None = None) -> tuple[dict, Scene]:
    """A (metadata, scene) training example from the task mixture."""
    mix = mix or DEFAULT_MIX
    tag = rng.choices(list(mix), weights=list(mix.values()))[0]
    meta = sample_prompt(rng, tag, split)
    return meta, scene_for(meta, rng, canvas)


def _words() -> tuple[str, ...]:
    words = {"and", "in", "the", "center", ",", "."}
    for text in PREFIXES + RELATIONS + tuple(REGIONS):
        words.update(text.split())
    words.update(("a", "an"))
    words.update(SHAPES + tuple(PLURALS.values()) + tuple(COLORS) + tuple(SIZES) + tuple(NUMBERS.values()))
    return tuple(sorted(words))


WORDS = _words()  # the closed prompt vocabulary, in a fixed order


def tokenize_words(prompt: str) -> list[str]:
    """Split a prompt into vocabulary words; raise a clear error on any unknown word and on an empty prompt."""
    words = prompt.lower().replace(",", " , ").replace(".", " . ").split()
    if not words:  # it would silently become the unconditional prompt (the backbone's empty slot)
        raise ValueError(f"empty prompt {prompt!r}: give a description (e.g. 'a photo of a red circle'); for "
                         f"unconditional samples keep a prompt and set cfg_scale=0 (guidance then follows only the "
                         f"backbone's null prompt)")
    known = set(WORDS)
    for w in words:
        if w not in known:
            kind = "colour" if w in _GENEVAL_COLORS else "shape or word"
            raise ValueError(f"unknown {kind} {w!r} in prompt {prompt!r}: the shapes world knows the colours "
                             f"{list(COLORS)} and the shapes {list(SHAPES)}; rephrase with those words")
    return words


_GENEVAL_COLORS = {"red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
                   "gray", "grey"}
