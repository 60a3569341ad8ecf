"""The real-backbone commands as a user first types them, on tiny folders laid out like the downloads: the drafter's
width and the image grid read from the folder, the teacher stage's cost printed before it starts (pinned here to a
hand computation), its shards under the configured cache, plain prompt files accepted, inconsistent configs named."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from helpers import compose_cfg
from specgen.backbones.emu3 import Emu3Backbone
from specgen.backbones.janus import JanusBackbone
from specgen.backbones.lumina import LuminaBackbone
from specgen.backbones.protocol import TokenGrid
from specgen.backbones.random_models import build_tiny
from specgen.evaluation.benchmarks import real_geneval
from specgen.evaluation.geneval import read_metadata
from specgen.modules.teacher_cost import describe
from specgen.utils.hydra import CONFIG_DIR


def test_tiny_folders_default_to_the_grid_they_record(tmp_path):
    emu3 = Emu3Backbone(str(build_tiny("emu3", tmp_path / "emu3", side=3)), device="cpu")
    assert (emu3.grid.height, emu3.grid.width, emu3.grid.stride) == (3, 3, 4)  # + an end-of-line a row
    lumina_path = build_tiny("lumina_mgpt", tmp_path / "lumina", side=4)
    lumina = LuminaBackbone(str(lumina_path), vqgan_path=str(lumina_path / "vqgan"), device="cpu")
    assert lumina.resolution == 64 and (lumina.grid.height, lumina.grid.width) == (4, 4)
    small = Emu3Backbone(str(tmp_path / "emu3"), tokens_per_side=2, device="cpu")  # the override still wins
    assert small.grid.num_visual_tokens == 4


def test_teacher_estimate_equals_a_hand_computation():
    grid = TokenGrid(height=4, width=5, prefix_len=0, visual_start=0, num_visual=32, eol_id=7)
    backbone = SimpleNamespace(grid=grid, size_key="generator.tokens_per_side")
    text = describe(backbone, {"step_s": 0.01, "states_s": 0.5}, sequences=10, sample_batch=4, guided=True,
                    device="cpu")
    # 20 codes a sequence (the end-of-line tokens ride along): 20 x 10 ms + 0.5 s = 0.7 s a batch; 3 batches of 4
    assert "10 sequences of 20 AR steps (4x5 codes) in 3 batches of 4 with CFG rows" in text
    assert "about 0.7 s a batch, 2.1 s in all" in text and "generator.tokens_per_side" in text
    long = describe(backbone, {"step_s": 2.0, "states_s": 0.0}, sequences=512, sample_batch=8, guided=False,
                    device="cuda:0")
    assert "about 40.0 s a batch, 42.7 min in all" in long and "states pass" not in long  # 64 x 40 s = 2560 s


def test_teacher_shards_default_to_a_user_cache_outside_the_source_tree(tmp_path, monkeypatch):
    def cache_dir() -> str:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", ["experiment=train/fphi_real", "data.prompts_path=p.txt"])
        return str(cfg.data.cache_dir)

    monkeypatch.delenv("SPECGEN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == f"{tmp_path}/home/.cache/specgen/distill"
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "big_disk"))
    assert cache_dir() == f"{tmp_path}/big_disk/distill"


def test_fphi_real_reads_the_width_and_prints_the_cost_before_sampling(tmp_path, capsys):
    """The train command with no width and no grid flag on a tiny Emu3 folder (width 64, 4x4 codes): the export
    records the backbone's width, the estimate comes before the first sequence, the shards land in the cache."""
    from specgen.train import train
    from specgen.utils.checkpoints import load_exported

    path = build_tiny("emu3", tmp_path / "emu3", side=4, sharpen=3.0)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo blue squares\na green cross\n")
    cfg = compose_cfg("train", ["experiment=train/fphi_real", "generator=emu3", f"generator.weights_path={path}",
                                f"data.prompts_path={prompts}", "debug=smoke_fphi", "num_threads=1"], tmp_path)
    assert cfg.drafter.hidden_size == "auto" and cfg.generator.tokens_per_side is None
    train(cfg)
    printed = capsys.readouterr()
    out = printed.out
    assert "teacher stage estimate on cpu: 8 sequences of 16 AR steps (4x4 codes) in 2 batches of 4 with CFG" in out
    assert "teacher sequences" in printed.err  # the bar counts sequences
    export = Path(cfg.paths.output_dir) / "export"
    assert OmegaConf.load(export / "config.yaml").hidden_size == 64  # the resolved width, not "auto"
    assert load_exported(export).hidden_size == 64
    shards = sorted(p.name for p in (tmp_path / "cache").rglob("*.npz"))
    assert shards == ["train_00000.npz", "val_00000.npz"]


def test_janus_refuses_a_grid_its_generate_would_not_make(tmp_path):
    path = build_tiny("janus_pro", tmp_path / "janus", side=4)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["num_image_tokens"] = 9
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"image_size / patch_size = 64 / 16 gives a 4x4 = 16 codes grid .*"
                                         r"num_image_tokens is 9 .*fix one of them in config.json .*"
                                         r"generator.tokens_per_side="):
        JanusBackbone(str(path), device="cpu")


def test_janus_grid_override_generates_and_decodes_its_own_grid(tmp_path):
    """tokens_per_side replaces the config's grid (and its check): AR makes side x side codes, the VQ decoder
    decodes them at that grid, equal to transformers' decode of a VQ whose grid is that side."""
    import copy

    import torch

    from specgen.decoding import ar

    path = build_tiny("janus_pro", tmp_path / "janus", side=4, sharpen=3.0)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["num_image_tokens"] = 9  # inconsistent, but the override chooses the grid
    (path / "config.json").write_text(json.dumps(config))
    m = JanusBackbone(str(path), tokens_per_side=2, device="cpu")
    assert (m.grid.height, m.grid.width, m.grid.num_visual_tokens) == (2, 2, 4)
    assert m.size_key == "generator.tokens_per_side"
    codes, _ = ar.generate(m, m.prompts(["a red circle", "two squares"]), cfg_scale=5.0, temperature=0)
    assert codes.shape == (2, 2, 2)
    images = m.decode(codes)
    vq = copy.deepcopy(m.model.model.vqmodel)
    vq.quantize.quant_state_dims = [2, 2]  # transformers' decode at a 2 x 2 grid
    ref = ((vq.decode(codes.flatten(1)).float() + 1) / 2).clamp(0, 1)
    up = 2 ** (len(config["vq_config"]["channel_multiplier"]) - 1)  # the tiny VQ's upsampling (Janus-Pro's: 16)
    assert images.shape == (2, 3, 2 * up, 2 * up) and torch.equal(images, ref)
    with pytest.raises(ValueError, match="generator.tokens_per_side"):
        JanusBackbone(str(path), tokens_per_side=0, device="cpu")


def test_lumina_without_its_vqgan_stops_at_the_start_and_names_the_key(tmp_path):
    """The eval command without generator.vqgan_path stops before its first sample; an adapter built without it
    (f_phi's distillation needs no pixels) names the key at the first decode."""
    import torch
    from omegaconf.errors import MissingMandatoryValue

    from specgen.eval import evaluate

    path = build_tiny("lumina_mgpt", tmp_path / "lumina", side=4)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    cfg = compose_cfg("eval", ["experiment=eval/real_discrete", "generator=lumina_mgpt",
                               f"generator.weights_path={path}", "generator.device=cpu",
                               f"drafter_dir={tmp_path / 'fphi'}", f"benchmark.prompts_path={prompts}", "logger=none"],
                      tmp_path)
    with pytest.raises(MissingMandatoryValue, match="generator.vqgan_path"):
        evaluate(cfg)
    assert not list(tmp_path.rglob("*.png")) and not (tmp_path / "cache").exists()  # nothing sampled
    m = LuminaBackbone(str(path), device="cpu")
    with pytest.raises(ValueError, match=r"decoding Lumina-mGPT codes to pixels needs Chameleon's VQGAN: set "
                                         r"generator.vqgan_path="):
        m.decode(torch.zeros(1, 4, 4, dtype=torch.long))


def test_a_plain_prompt_file_is_written_unscored_and_refused_for_scoring(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text("a red circle\n\n two blue squares \n")
    assert read_metadata(plain) == [{"tag": "prompts", "include": [], "prompt": "a red circle"},
                                    {"tag": "prompts", "include": [], "prompt": "two blue squares"}]
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_metadata(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match=r"plain prompts file .*drop benchmark.detector_path"):
        real_geneval(str(plain), detector_path=str(tmp_path / "detector"), color_checkpoint=str(tmp_path / "c.pt"))
    meta = tmp_path / "meta.txt"  # GenEval's JSON lines under another suffix are still GenEval's
    meta.write_text(json.dumps({"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "2 dogs"}))
    assert read_metadata(meta)[0]["tag"] == "counting"


def test_the_drafter_width_error_still_names_the_fix(tmp_path):
    from specgen.drafters.fphi import FPhi
    from specgen.modules.distill_module import DistillModule

    path = build_tiny("janus_pro", tmp_path / "janus", side=4)
    gen = {"_target_": "specgen.backbones.janus.JanusBackbone", "weights_path": str(path), "device": "cpu"}
    with pytest.raises(ValueError, match=r"drafter.hidden_size=32 but .* width 64: set drafter.hidden_size=64 "
                                         r"\(or auto\)"):
        DistillModule(FPhi(32, "xs"), None, None, generator=gen)
    module = DistillModule({"_target_": "specgen.drafters.fphi.FPhi", "hidden_size": "auto", "preset": "xs"}, None,
                           None, generator=gen)
    assert module.net.hidden_size == 64 and module.net_overrides == {"hidden_size": 64}


RUNBOOK = Path(__file__).resolve().parents[1] / "experiments" / "real_backbones" / "README.md"


def runbook_smoke_block() -> list[str]:
    """The shell lines of the runbook's smoke block (the fenced block under 'Smoke run on tiny folders')."""
    text = RUNBOOK.read_text().split("### Smoke run on tiny folders", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["emu3", "lumina_mgpt", "janus_pro"])
def test_the_runbook_smoke_block_runs_from_a_fresh_shell_and_writes_only_the_run_and_the_cache(kind, tmp_path):
    """The runbook's two commands on a tiny folder of each kind, as a user runs them (python -m, a fresh process, a
    new working folder): each under 2 minutes, and every file they write under the run folders or the user cache;
    nothing under the repository's data/, logs/ or checkpoints/ (SPECGEN_ROOT points those at an empty folder)."""
    import os
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[1]
    work, root, home = tmp_path / "work", tmp_path / "root", tmp_path / "home"
    for d in (work, root, home):
        d.mkdir()
    env = dict(os.environ, SPECGEN_ROOT=str(root), HOME=str(home), WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(repo / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("SPECGEN_CACHE", None)
    (work / "tiny").mkdir()
    for line in runbook_smoke_block():
        line = line.replace("emu3", kind)
        if kind == "lumina_mgpt" and " generator.weights_path=" in line:
            line += f" generator.vqgan_path=tiny/{kind}/vqgan"  # the runbook's note for Lumina-mGPT
        if line.startswith("printf"):
            (work / "tiny" / "prompts.txt").write_text("a red circle\ntwo blue squares\na green cross\n")
            continue
        assert line.startswith("python -m "), line
        t0 = time.perf_counter()
        args = line.split()[1:] + (["num_threads=2"] if "specgen.backbones" not in line else [])
        done = subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (line, done.stderr[-3000:])
        assert time.perf_counter() - t0 < 120, line
        if "specgen.train" in line:
            assert "teacher stage estimate on cpu" in done.stdout
    assert not any(root.iterdir())  # the source tree's data/, logs/, checkpoints/: untouched
    cache = home / ".cache" / "specgen"
    assert len(list((cache / "distill").rglob("*.npz"))) == 2 and {p.name for p in cache.iterdir()} == {
        "distill", "image_cache"}
    assert {p.name for p in work.iterdir()} == {"tiny", "runs"}
    assert (work / "runs" / f"fphi_{kind}" / "export" / "model.safetensors").is_file()
    metrics = json.loads((work / "runs" / f"eval_{kind}" / "metrics.json").read_text())
    assert metrics["ar/speed/nfe_ratio"] == 1.0 and metrics["ssd/speed/nfe"] > 0
    images = sorted(p.relative_to(work / "runs" / f"eval_{kind}") for p in
                    (work / "runs" / f"eval_{kind}").rglob("geneval_samples*/**/*.png"))
    assert images == [Path("geneval_samples/00000/samples/0000.png")]  # the file's first prompt, one image
