"""Imports point down the layers only: utils -> world -> tokenizers -> backbones -> drafters -> decoding ->
evaluation -> modules and entry points; analysis scripts sit apart and may import anything. The models and the
decoders import neither Lightning nor Hydra (a backbone or drafter loads without the config system)."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "specgen"
LAYERS = ["utils", "world", "tokenizers", "backbones", "drafters", "decoding", "evaluation", "modules"]
ENTRY_POINTS = {"train", "eval", "api"}  # src/specgen/train.py, eval.py, api.py: the top, with modules
APART = {"analysis"}
NO_FRAMEWORK = {"utils", "world", "tokenizers", "backbones", "drafters", "decoding"}  # plain torch below here
FRAMEWORKS = {"lightning", "pytorch_lightning", "hydra"}
TOP = len(LAYERS) - 1


def rank(module: str) -> int | None:
    """Layer index of a `specgen.<part>...` module; None for the package root and for analysis (apart)."""
    parts = module.split(".")
    if parts[0] != "specgen" or len(parts) < 2:
        return None
    if parts[1] in ENTRY_POINTS:
        return TOP
    if parts[1] in APART:
        return None
    if parts[1] not in LAYERS:
        raise AssertionError(f"specgen.{parts[1]} is in no layer: add it to LAYERS (or APART) in {__file__}")
    return LAYERS.index(parts[1])


def imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported module) of every import in a file, function-local ones included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = module.split(".")[: -node.level]
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                out.append((node.lineno, node.module))
    return out


def violations(source: str, module: str) -> list[str]:
    """Imports of `module` (its source given) that point up the layers, or into Lightning/Hydra from below."""
    here = rank(module)
    if here is None:
        return []
    bad = []
    for line, target in imports(source, module):
        there = rank(target)
        if there is not None and there > here:
            bad.append(f"{module}:{line} imports {target} ({LAYERS[there]} is above {LAYERS[here]})")
        if module.split(".")[1] in NO_FRAMEWORK and target.split(".")[0] in FRAMEWORKS:
            bad.append(f"{module}:{line} imports {target} (no Lightning or Hydra in {module.split('.')[1]})")
        if module.split(".")[1] not in APART and target.split(".")[:2] == ["specgen", "analysis"]:
            bad.append(f"{module}:{line} imports {target} (analysis scripts are imported by nothing)")
    return bad


def modules() -> dict[str, Path]:
    return {".".join(("specgen",) + p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
            for p in SRC.rglob("*.py")}


def test_imports_point_down_the_layers():
    found = modules()
    assert "specgen.decoding.ar" in found and "specgen.evaluation.runner" in found
    bad = [v for name, path in sorted(found.items()) for v in violations(path.read_text(), name)]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


@pytest.mark.parametrize("module,source,expected", [
    ("specgen.backbones.x", "from specgen.decoding import ar", "backbones.x:1 imports specgen.decoding (decoding is "
                                                               "above backbones)"),
    ("specgen.evaluation.x", "def f():\n    from specgen.modules.data import ShapesImageDataModule",
     "evaluation.x:2 imports specgen.modules.data (modules is above evaluation)"),
    ("specgen.decoding.x", "import specgen.eval", "decoding.x:1 imports specgen.eval (modules is above decoding)"),
    ("specgen.drafters.x", "from hydra.utils import instantiate", "no Lightning or Hydra in drafters"),
    ("specgen.evaluation.x", "from specgen.analysis import context_probe", "analysis scripts are imported by nothing"),
    ("specgen.world.dataset", "from ..decoding import ar", "world.dataset:1 imports specgen.decoding"),
])
def test_the_check_catches_an_import_against_the_layers(module, source, expected):
    assert any(expected in v for v in violations(source, module)), violations(source, module)


def test_downward_and_apart_imports_pass():
    assert not violations("from specgen.backbones.protocol import DiscreteBackbone\nimport torch", "specgen.decoding.x")
    assert not violations("from specgen.modules.data import ShapesImageDataModule", "specgen.analysis.x")
    assert not violations("from hydra.utils import instantiate", "specgen.evaluation.runner")
