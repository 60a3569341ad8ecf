"""The embedded shapes world: scenes, prompts, renderer and exact parser."""
from specgen.world.parse import Detection, match_scene, parse
from specgen.world.prompts import (ALL_TAGS, TAGS, prompts, sample_example, sample_prompt, scene_for)
from specgen.world.render import render
from specgen.world.scene import COLORS, SHAPES, SIZES, Scene, SceneObject, relations, sample_scene

__all__ = ["ALL_TAGS", "COLORS", "Detection", "SHAPES", "SIZES", "Scene", "SceneObject", "TAGS", "match_scene",
           "parse", "prompts", "relations", "render", "sample_example", "sample_prompt", "sample_scene", "scene_for"]
