"""The tree says the truth: no machine paths in shipped files, a package that installs whole, producers named
right, loading without the config system, clear errors for broken exports."""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from specgen.utils.checkpoints import ALIASES, PRODUCERS, REPO_ROOT, build, export, load_exported, portable_path

SRC = REPO_ROOT / "src" / "specgen"
# roots of user and machine folders; a shipped file may name none of them
MACHINE_PATH = re.compile(r"(?<![\w.])(/home/|/Users/|/root/|/work/|/mnt/|/scratch/|/tmp/|[A-Z]:\\Users\\)")


def shipped_files() -> list[Path]:
    """The repository's files as a clone has them (git's list; every file outside caches without git)."""
    if (REPO_ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
        return [REPO_ROOT / p for p in out.decode().split("\0") if p and (REPO_ROOT / p).is_file()]
    skip = {".venv", ".git", "logs", "data", "outputs", "__pycache__", ".pytest_cache"}
    return [p for p in REPO_ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO_ROOT).parts)]


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary (weights, images)
    return data.decode("utf-8", errors="replace")


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_no_shipped_file_holds_an_absolute_path():
    files = shipped_files()
    assert any(p.name == "extra.json" for p in files)
    bad = []
    for path in files:
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(REPO_ROOT)
        if str(REPO_ROOT) in text:
            bad.append(f"{rel}: names this checkout ({REPO_ROOT})")
        if rel.parts[0] != "tests":  # tests spell such paths to look for them
            bad += [f"{rel}: {m.group(0)!r} at line {text[:m.start()].count(chr(10)) + 1}"
                    for m in MACHINE_PATH.finditer(text)]
        if rel.parts[0] == "checkpoints" and path.suffix == ".json":
            bad += [f"{rel}: {s!r}" for s in _strings(json.loads(text)) if os.path.isabs(s)]
    assert not bad, "absolute paths in shipped files:\n" + "\n".join(bad)


def test_no_committed_archives():
    archives = [p for p in shipped_files() if re.search(r"\.(tgz|tar|gz|zip|7z|part_\w+)$", p.name)]
    assert not archives


def test_export_writes_no_absolute_path(tmp_path):
    net = torch.nn.Linear(2, 2)
    cfg = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}
    inside = REPO_ROOT / "checkpoints" / "ar_shapes"
    export(tmp_path / "d", net, cfg, extra={"backbone_dir": str(tmp_path / "runs" / "ar"), "shipped": str(inside),
                                            "relative": "checkpoints/x", "nested": [str(tmp_path / "a"), 3]},
           metrics={"averaged_from": [str(inside), str(tmp_path / "m1")], "loss": 0.5},
           command=f"python -m specgen.train init_from={inside} hydra.run.dir={tmp_path}/run0 data.x=1")
    extra = json.loads((tmp_path / "d" / "extra.json").read_text())
    assert extra == {"backbone_dir": "ar", "shipped": "checkpoints/ar_shapes", "relative": "checkpoints/x",
                     "nested": ["a", 3]}
    metrics = json.loads((tmp_path / "d" / "metrics.json").read_text())
    assert metrics == {"averaged_from": ["checkpoints/ar_shapes", "m1"], "loss": 0.5}
    assert (tmp_path / "d" / "command.txt").read_text() == ("python -m specgen.train init_from=checkpoints/ar_shapes "
                                                            "hydra.run.dir=run0 data.x=1\n")
    assert portable_path("/somewhere/else/mtp") == "mtp"


def test_every_shipped_folder_names_the_experiment_that_exports_it():
    folders = sorted(p.parent.name for p in shipped_files()
                     if p.name == "model.safetensors" and p.parent.parent == REPO_ROOT / "checkpoints")
    assert folders and set(folders) <= set(PRODUCERS) | set(ALIASES)
    for name, target in ALIASES.items():  # an alias folder links the weights of the folder it names
        link = REPO_ROOT / "checkpoints" / name / "model.safetensors"
        target_file = REPO_ROOT / "checkpoints" / target / "model.safetensors"
        assert link.is_symlink() and link.resolve() == target_file.resolve()
    for name, exp in PRODUCERS.items():
        text = (REPO_ROOT / "configs" / "experiment" / f"{exp}.yaml").read_text()
        assert re.search(rf"^export_name: {name}\s*$", text, re.M), (name, exp)


def test_missing_export_names_its_producer(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tmp.*ar_shapes'.*experiment=train/ar_shapes"):
        load_exported(tmp_path / "ar_shapes")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_broken_weights_file_is_named_with_the_fix(tmp_path, damage):
    src = REPO_ROOT / "checkpoints" / "fphi_shapes"
    dst = tmp_path / "fphi_shapes"
    shutil.copytree(src, dst)
    data = (src / "model.safetensors").read_bytes()
    broken = {"truncated": data[: len(data) // 2], "garbage": b"not a model" * 10, "empty": b""}[damage]
    (dst / "model.safetensors").write_bytes(broken)
    with pytest.raises(ValueError, match=r"fphi_shapes/model\.safetensors' is not a complete safetensors file .*"
                                         r"truncated or corrupted.*experiment=train/fphi_shapes.*git checkout -- "
                                         r"checkpoints/fphi_shapes"):
        load_exported(dst)


def test_build_makes_nested_targets_and_refuses_hydra_options():
    net = build({"_target_": "specgen.drafters.fphi.FPhi", "hidden_size": 8, "preset": "xs",
                 "directions": ["right"]})
    assert type(net).__name__ == "FPhi" and net.directions == ("right",)
    node = build({"a": [{"_target_": "torch.nn.Identity"}, 2]})
    assert isinstance(node["a"][0], torch.nn.Identity) and node["a"][1] == 2
    with pytest.raises(ValueError, match=r"\['_partial_'\] are Hydra instantiate options"):
        build({"_target_": "torch.nn.Identity", "_partial_": True})
    with pytest.raises(ImportError, match="'specgen.drafters.nowhere.X' names nothing importable"):
        build({"_target_": "specgen.drafters.nowhere.X"})


def test_a_backbone_and_a_drafter_load_without_hydra_or_lightning():
    code = ("import sys\n"
            "from specgen.backbones.loading import load_shapes_generator\n"
            "from specgen.utils.checkpoints import load_exported\n"
            f"ck = {str(REPO_ROOT / 'checkpoints')!r}\n"
            "bb = load_shapes_generator(ck + '/ar_shapes', ck + '/vq_shapes')\n"
            "d = load_exported(ck + '/fphi_shapes')\n"
            "assert d.backbone_id and bb.identity.startswith(d.backbone_id)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'lightning', 'pytorch_lightning'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_pip_install_gives_every_subpackage(tmp_path):
    """A non-editable `pip install .` (no download: built from a copy of the source with the installed setuptools,
    into a fresh venv that sees the current one's dependencies) holds every subpackage, and each imports; the
    configs are installed with it, and the entry points' configs compose from them."""
    src = tmp_path / "src_copy"
    shutil.copytree(SRC, src / "src" / "specgen", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "configs", src / "configs")
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--ignore-installed",  # never touch the current environment's (editable) specgen
                    "--prefix", str(venv), str(src)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies as a plain path: the current venv's .pth files (the editable install) are not read
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wanted = sorted({".".join(("specgen",) + p.parent.relative_to(SRC).parts)  # every folder that holds code
                     for p in SRC.rglob("*.py") if "__pycache__" not in p.parts})
    code = ("import importlib, sys\n"
            f"for name in {wanted!r}:\n"
            "    m = importlib.import_module(name)\n"
            f"    assert m.__file__ and m.__file__.startswith({site!r}), (name, m.__file__)\n"
            # the configs travel with the package: Hydra composes the entry points' configs from them
            "from specgen.utils.locations import config_dir\n"
            f"assert str(config_dir()).startswith({site!r}), config_dir()\n"
            "from hydra import compose, initialize_config_dir\n"
            "from specgen.utils.hydra import register_resolvers\n"
            "register_resolvers()\n"
            "for name in ('eval', 'train'):\n"
            "    with initialize_config_dir(str(config_dir()), version_base='1.3'):\n"
            "        cfg = compose(name, overrides=['hydra.runtime.output_dir=.'], return_hydra_config=True)\n"
            "    assert cfg.paths.checkpoint_dir.endswith('checkpoints'), cfg.paths.checkpoint_dir\n"
            "from specgen.evaluation.clipscore import CONFIG_DIR\n"
            "assert (CONFIG_DIR / 'shapes-clip.json').is_file(), CONFIG_DIR\n"
            "print('ok')\n")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    installed = {str(p.parent.relative_to(site)).replace(os.sep, ".")
                 for p in Path(site, "specgen").rglob("__init__.py")}
    assert set(wanted) <= installed
