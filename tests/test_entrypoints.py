"""The real Hydra configs compose, every LightningModule trains a step, runs resume, W&B runs close."""
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from helpers import compose_cfg
from specgen.evaluation.geneval import TASKS
from specgen.utils.checkpoints import PRODUCERS
from specgen.utils.hydra import CONFIG_DIR

EXPERIMENTS = sorted(p.relative_to(Path(CONFIG_DIR, "experiment")).with_suffix("").as_posix()
                     for p in Path(CONFIG_DIR, "experiment").rglob("*.yaml"))
# training experiments choose a LightningModule (directly or through the experiment they extend)
TRAIN_EXPERIMENTS = [e for e in EXPERIMENTS if "export_name:" in Path(CONFIG_DIR, "experiment", f"{e}.yaml").read_text()]


def _tiny_train(exp: str, exports: Path) -> list[str]:
    name = exp.split("/")[-1]  # train/<name>
    o = [f"experiment={exp}", "tokenizer.ch=16", "tokenizer.mults=[2,2]", "tokenizer.z_dim=8",
         "data.batch_size=4", "num_threads=1"] + (["tokenizer.num_codes=64", "backbone.num_codes=64"] if name != "kl_shapes" else [])
    if name.startswith("mar_"):
        target = exports / ("mar_p2" if "cpu" in name else "mar")
        return [f"module.target_dir={target}"] * ("draft" in name) + [f"experiment={exp}", f"data.tokenizer_dir={exports / 'kl'}", "data.shard_size=8", "data.train_shards=1",
                "data.encode_batch=8", "data.batch_size=2", "backbone.preset=tiny", "backbone.token_dim=8",
                "backbone.sample_steps=5", "num_threads=1"]
    if name.startswith("ar"):
        o += ["backbone.preset=tiny", f"data.tokenizer_dir={exports / 'vq'}", "data.shard_size=16",
              "data.train_shards=1", "data.encode_batch=16",
              "callbacks.val_geneval.prompts_per_task=1", "callbacks.val_geneval.samples=1"]
    elif name in ("fphi_shapes", "mtp_shapes", "fphi_tokens_shapes", "fphi_accept"):  # drafters of the tiny backbone
        o = [f"experiment={exp}", f"data.backbone_dir={exports / 'ar'}", f"data.tokenizer_dir={exports / 'vq'}",
             "data.shard_size=4", "data.sample_batch=4", "data.train_shards=1", "data.batch_size=2",
             "drafter.hidden_size=64", "num_threads=1"] + (["init_from=null"] if name == "fphi_accept" else [])
    else:
        o += ["data.val_size=8"]
    return o


def _targets(node, where: str = ""):
    """(config path, node) of every node of a resolved config that names a `_target_`."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield where, node
        for k, v in node.items():
            yield from _targets(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _targets(v, f"{where}[{i}]")


def _check_targets(cfg: dict) -> list[str]:
    """Every `_target_` of `cfg` names an importable callable that takes the node's keys; the paths checked."""
    checked = []
    for where, node in _targets(cfg):
        fn = get_object(node["_target_"])
        params = inspect.signature(fn).parameters
        keys = {k for k in node if not k.startswith("_")}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            assert keys <= set(params), f"{where}: {node['_target_']} takes no {sorted(keys - set(params))}"
        checked.append(where)
    return checked


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_experiment_composes_resolves_and_names_real_objects(exp, tmp_path):
    entry = "train" if exp in TRAIN_EXPERIMENTS else "eval"
    paths = {"eval/real_continuous": ["mar_pair.draft_path=/weights/mar_base.pth"]}.get(exp, [])  # given by the user
    cfg = OmegaConf.to_container(compose_cfg(entry, [f"experiment={exp}", *paths], tmp_path), resolve=True)
    checked = _check_targets(cfg)
    if entry == "train":  # what train.py builds: data, module (with its network), trainer
        assert {"data", "module", "module.net", "trainer"} <= set(checked), checked
        assert cfg["module"]["_target_"].startswith("specgen.modules.")
        name = cfg["export_name"]
        if name in PRODUCERS:  # a shipped folder: its recorded producer is this experiment
            assert PRODUCERS[name] == exp, (f"experiment={exp} exports checkpoints/{name}, whose producer in "
                                            f"utils.checkpoints.PRODUCERS is {PRODUCERS[name]}: make them agree")
    else:  # what eval.py builds: the generator and each strategy's function
        assert "generator" in checked and any(w.endswith("fn") for w in checked), checked
        real = {"eval/real_continuous": "specgen.backbones.mar_release.load_mar_release"}  # released weights by path
        if exp in real:
            assert cfg["generator"]["_target_"] == real[exp]
        elif exp.startswith("eval/real_"):  # a real discrete backbone from a local folder (tests/test_real_backbones.py)
            assert cfg["generator"]["_target_"].startswith("specgen.backbones.emu3")
        else:
            assert cfg["generator"]["_target_"] == "specgen.backbones.loading.load_shapes_generator"


def test_every_config_group_option_composes_and_builds(tmp_path):
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    for decoding in [p.stem for p in Path(CONFIG_DIR, "decoding").glob("*.yaml")]:
        _check_targets(OmegaConf.to_container(compose_cfg("eval", [f"decoding={decoding}"], tmp_path), resolve=True))
    for drafter in [p.stem for p in Path(CONFIG_DIR, "drafter").glob("*.yaml")]:
        cfg = compose_cfg("train", ["experiment=train/fphi_shapes", f"drafter={drafter}", "drafter.hidden_size=16"], tmp_path)
        net = instantiate(cfg.drafter)
        assert isinstance(net, torch.nn.Module) and net.hidden_size == 16 and net.directions, drafter
        assert cfg.module.net.hidden_size == 16  # the distillation module trains the chosen drafter
    debug = {d: compose_cfg("train", [f"debug={d}"], tmp_path) for d in ("fast_dev_run", "overfit", "limit")}
    assert debug["fast_dev_run"].trainer.fast_dev_run is True and debug["fast_dev_run"].logger is None
    assert debug["fast_dev_run"].callbacks is None and debug["overfit"].trainer.overfit_batches > 0
    assert debug["limit"].trainer.max_steps == 20 and debug["limit"].trainer.limit_val_batches == 2
    assert all(c.ckpt_path is None for c in debug.values())  # a debug run never resumes a real run
    loggers = {lg: compose_cfg("train", [f"logger={lg}"], tmp_path).logger for lg in ("wandb", "csv", "none")}
    wandb = instantiate(loggers["wandb"].wandb)
    assert isinstance(wandb, WandbLogger) and Path(wandb.save_dir) == tmp_path / "out"
    assert wandb._offline is True  # offline unless SPECGEN_WANDB_OFFLINE=false
    csv = instantiate(loggers["csv"].csv)
    assert isinstance(csv, CSVLogger) and Path(csv.save_dir) == tmp_path / "out"
    assert not loggers["none"]
    cpu = instantiate(compose_cfg("train", ["trainer=cpu"], tmp_path).trainer, logger=False, enable_checkpointing=False)
    assert isinstance(cpu.accelerator, CPUAccelerator) and cpu.precision == "32-true" and cpu.max_steps == 1000
    gpu, ddp, spawn = (compose_cfg("train", [f"trainer={t}"], tmp_path).trainer for t in ("gpu", "ddp", "ddp_spawn"))
    assert (gpu.accelerator, gpu.devices, gpu.precision) == ("gpu", 1, "bf16-mixed")  # no GPU here: composed only
    assert (ddp.accelerator, ddp.devices, ddp.strategy) == ("gpu", "auto", "ddp")  # torchrun / SLURM / one node
    assert (spawn.devices, spawn.strategy) == (2, "ddp_spawn")  # a local Hydra multirun
    ddp_cpu = instantiate(compose_cfg("eval", ["trainer=ddp_cpu"], tmp_path).trainer, logger=False)
    assert isinstance(ddp_cpu.accelerator, CPUAccelerator) and ddp_cpu.num_devices == 2
    assert type(ddp_cpu.strategy).__name__ == "DDPStrategy" and ddp_cpu.precision == "32-true"


@pytest.mark.parametrize("pair,target,draft", [("shapes", "mar_shapes", "mar_shapes_draft"),
                                                ("shapes_p2", "mar_p2_shapes", "mar_p2_shapes_draft")])
def test_mar_pair_selects_target_and_draft_of_every_cspd_strategy(pair, target, draft, tmp_path):
    cfg = OmegaConf.to_container(compose_cfg("eval", ["experiment=eval/continuous_speed", f"mar_pair={pair}"], tmp_path),
                                 resolve=True)
    assert Path(cfg["generator"]["backbone_dir"]).name == target
    drafts = {name: Path(s["fn"]["draft"]["dirpath"]).name for name, s in cfg["strategies"].items() if "draft" in s["fn"]}
    assert set(drafts) == {"cspd", "cspd_noalign", "cspd_g2", "cspd_g8", "cspd_inround"}
    assert set(drafts.values()) == {draft}
    assert all(name == s["name"] for name, s in cfg["strategies"].items())  # a strategy is named as its key
    steps = {name: s["fn"]["num_iter"] for name, s in cfg["strategies"].items()}
    assert steps == {**{name: 64 for name in drafts}, "mar": 64, "mar32": 32, "mar21": 21, "mar16": 16}
    assert {cfg["strategies"][name]["fn"]["inner_temperature"] for name in drafts} == {42.0}  # the authors'
    assert {n: cfg["strategies"][n]["fn"]["gamma"] for n in drafts} == {
        n: {"cspd_g2": 2, "cspd_g8": 8}.get(n, 4) for n in drafts}
    assert [cfg["strategies"][n]["fn"]["align"] for n in ("cspd", "cspd_noalign")] == [True, False]
    assert {n: cfg["strategies"][n]["fn"]["verify"] for n in drafts} == {n: "stepwise" if n == "cspd_inround" else
                                                                          "joint" for n in drafts}
    exact = OmegaConf.to_container(compose_cfg("eval", ["experiment=ablation/cspd_tail_sweep", f"mar_pair={pair}"], tmp_path),
                                   resolve=True)["strategies"]
    lossless = exact["cspd_lossless"]["fn"]
    assert (lossless["ratio"], lossless["acceptance"], lossless["verify"]) == ("exact", "prefix", "stepwise")
    assert {s["fn"]["num_iter"] for s in exact.values()} == {16}  # where the exact ratio's tables were measured
    assert {s["fn"]["gamma"] for s in exact.values() if "gamma" in s["fn"]} == {4}
    assert Path(lossless["draft"]["dirpath"]).name == draft


def test_default_mar_pair_is_the_cpu_sized_one(tmp_path):
    cfg = OmegaConf.to_container(compose_cfg("eval", ["experiment=eval/continuous_speed"], tmp_path), resolve=True)
    assert Path(cfg["generator"]["backbone_dir"]).name == "mar_p2_shapes"
    assert Path(cfg["strategies"]["cspd"]["fn"]["draft"]["dirpath"]).name == "mar_p2_shapes_draft"


VAL_METRICS = {"train/vq_shapes": ("val/psnr", "val/parser_acc"), "train/featnet_shapes": ("val/loss_main", "val/acc_main"),
               "train/clip_shapes": ("val/loss", "val/acc_i2t"), "train/kl_shapes": ("val/psnr", "val/latent_std"),
               "train/mar_shapes": ("val/loss",), "train/mar_shapes_cpu": ("val/loss",),
               "train/mar_draft": ("val/loss_data",), "train/mar_draft_cpu": ("val/loss_data",),
               "train/ar_shapes": ("val/loss", "val/loss_uncond"), "train/fphi_shapes": ("val/loss",),
               "train/fphi_tokens_shapes": ("val/loss",), "train/mtp_shapes": ("val/loss",)}


@pytest.mark.parametrize("exp,extra", [("train/vq_shapes", []), ("train/featnet_shapes", ["module.net.width=8"]),
                                       ("train/clip_shapes", ["data.batch_size=4"]), ("train/kl_shapes", []), ("train/mar_shapes", []),
                                       ("train/mar_draft", []), ("train/mar_shapes_cpu", []),
                                       ("train/mar_draft_cpu", []),
                                       ("train/ar_shapes", ["backbone.eol=true"]),
                                       ("train/ar_shapes", ["backbone.eol=false"]), ("train/fphi_shapes", []),
                                       ("train/fphi_tokens_shapes", ["drafter.num_codes=64"]),
                                       ("train/mtp_shapes", [])])
def test_fast_dev_run_of_every_module(exp, extra, tmp_path, tiny_exports):
    """Every LightningModule trains and validates one batch (both row layouts of the backbone)."""
    from specgen.train import train

    base = [o for o in _tiny_train(exp, tiny_exports) if "val_geneval" not in o]  # the debug preset drops callbacks
    cfg = compose_cfg("train", base + extra + ["debug=fast_dev_run"], tmp_path)
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and metrics["train/loss"] > 0
    for key in VAL_METRICS[exp]:  # the validation batch ran and logged the module's own measures
        assert math.isfinite(metrics[key]), key
        if "acc" in key:
            assert 0 <= metrics[key] <= 1, key
    if "val/psnr" in metrics:
        assert 0 < metrics["val/psnr"] < 100


def test_resume_continues_the_step_count_and_wandb_leaves_a_run(tmp_path, tiny_exports):
    from specgen.train import train

    base = _tiny_train("train/ar_shapes", tiny_exports) + [
        "trainer.val_check_interval=1", "callbacks.model_checkpoint.every_n_train_steps=2",
        "export_name=export", "logger=wandb"]
    cfg = compose_cfg("train", base + ["trainer.max_steps=2"], tmp_path)
    metrics = train(cfg)
    # the GenEval callback scored the backbone's samples at each validation: 6 tasks x 1 prompt x 1 sample
    assert {f"val/geneval/{t}" for t in TASKS} <= set(metrics) and 0 <= metrics["val/geneval_overall"] <= 1
    assert metrics["val/geneval_overall"] == pytest.approx(sum(metrics[f"val/geneval/{t}"] for t in TASKS) / 6)
    out = Path(cfg.paths.output_dir)
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert list((out / "wandb").glob("offline-run-*"))
    assert (tmp_path / "checkpoints" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "checkpoints" / "export" / "command.txt").read_text().startswith("python")
    assert '"global_step": 2' in (tmp_path / "checkpoints" / "export" / "metrics.json").read_text()
    import torch

    cfg2 = compose_cfg("train", base + ["trainer.max_steps=4"], tmp_path)
    train(cfg2)
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4
    assert all(k.startswith("net.") for k in ckpt["state_dict"])  # helpers (val tokenizer) stay out
    # the optimizer took 4 steps in all: the second run continued the first instead of restarting
    assert int(ckpt["optimizer_states"][0]["state"][0]["step"]) == 4


def test_mar_ema_is_exported_and_resumed(tmp_path, tiny_exports):
    """The CPU-sized MAR experiment trains an EMA: it is saved in checkpoints, continued on resume, validated
    (val/loss_ema) and is what the export holds."""
    from safetensors.torch import load_file

    from specgen.train import train

    base = _tiny_train("train/mar_shapes_cpu", tiny_exports) + [
        "trainer.val_check_interval=2", "callbacks.model_checkpoint.every_n_train_steps=2", "trainer.limit_val_batches=1",
        "export_name=export", "logger=none", "module.ema_decay=0.9", "trainer.precision=32-true",
        "module.warmup_steps=1", "module.lr=1e-2"]
    cfg = compose_cfg("train", base + ["trainer.max_steps=2"], tmp_path)
    train(cfg)
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    # the checkpoint holds the EMA after the step it was saved at (not one update behind)
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert int(ckpt["state_dict"]["ema_updates"]) == 2
    ckpt["state_dict"]["ema_updates"].fill_(100)  # marks the checkpoint: a fresh start would count from 0
    torch.save(ckpt, last)
    metrics = train(compose_cfg("train", base + ["trainer.max_steps=4"], tmp_path))
    assert "val/loss_ema" in metrics and "val/loss" in metrics
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    sd = ckpt["state_dict"]
    assert ckpt["global_step"] == 4 and int(sd["ema_updates"]) == 102  # resumed at step 2, EMA state continued
    exported = load_file(str(tmp_path / "checkpoints" / "export" / "model.safetensors"))
    w = "diffloss.net.input_proj.weight"
    assert torch.allclose(exported[w].float(), sd["ema." + w], atol=2e-3)
    assert not torch.allclose(sd["ema." + w], sd["net." + w], atol=1e-4)


def test_config_value_of_wrong_type_is_named(tmp_path):
    cfg = compose_cfg("train", ["experiment=train/vq_shapes", "data.batch_size=abc"], tmp_path)
    from hydra.errors import InstantiationException

    with pytest.raises((TypeError, InstantiationException), match=r"data.batch_size must be an integer, got 'abc'"):
        instantiate(cfg.data)


def test_kl_tokenizer_export_records_the_measured_latent_scale(tmp_path, tiny_exports):
    from specgen.train import train
    from specgen.utils.checkpoints import load_exported

    cfg = compose_cfg("train", _tiny_train("train/kl_shapes", tiny_exports) + [
        "trainer.max_steps=2", "trainer.val_check_interval=2", "+trainer.limit_val_batches=2", "data.val_size=8",
        "logger=none", "export_name=kl"], tmp_path)
    train(cfg)
    cfg_text = (tmp_path / "checkpoints" / "kl" / "config.yaml").read_text()
    kl = load_exported(tmp_path / "checkpoints" / "kl")
    assert kl.scale_factor != 1.0 and f"scale_factor: {kl.scale_factor}" in cfg_text
    tokens = kl.encode(torch.zeros(2, 3, 64, 64, dtype=torch.uint8))
    assert tokens.shape == (2, 16 * 16, 8) and kl.decode(tokens).shape == (2, 3, 64, 64)


def test_slurm_launcher_config_composes():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher.partition == "gpu" and "SlurmLauncher" in cfg.hydra.launcher._target_


def test_time_budget_sets_the_step_count_and_the_schedule_follows(tmp_path, tiny_exports, monkeypatch):
    """A budget much shorter than max_steps: the run stops early, at the step count the callback chose, with
    the learning rate at its cosine floor there (the schedule read the new end). The callback's clock is
    simulated (0.01 s per training step), so the chosen count does not depend on the machine's load."""
    from specgen.modules.callbacks import TimeBudget
    from specgen.train import train

    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(TimeBudget, "clock", staticmethod(lambda: 0.01 * next(ticks)))
    base = [o for o in _tiny_train("train/ar_shapes_draft", tiny_exports) if "val_geneval" not in o]
    cfg = compose_cfg("train", base + [
        "trainer.max_steps=100000", "module.warmup_steps=2", "logger=csv", "export_name=budget",
        "callbacks.time_budget.seconds=1", "callbacks.time_budget.calibrate_from=2",
        "callbacks.time_budget.calibrate_to=6", "trainer.val_check_interval=1000"], tmp_path)
    metrics = train(cfg)
    chosen = int(metrics["budget/max_steps"])
    assert chosen == 6 + int(0.85 * (1 - 0.06) / 0.01)  # 6 steps timed, the rest of the budget at 0.01 s/step
    exported = (tmp_path / "checkpoints" / "budget" / "metrics.json").read_text()
    assert f'"global_step": {chosen}' in exported
    lr = metrics["lr-AdamW/pg1"]  # logged before the last step: within a few steps of the floor (0.1 x peak)
    assert lr < 0.15 * cfg.module.lr


def test_time_budget_rejects_bad_settings():
    from specgen.modules.callbacks import TimeBudget

    with pytest.raises(ValueError, match=r"seconds=-1.*positive"):
        TimeBudget(seconds=-1)
    with pytest.raises(ValueError, match="calibrate_from=5 must be below calibrate_to=5"):
        TimeBudget(seconds=10, calibrate_from=5, calibrate_to=5)


def test_half_precision_export_halves_parameters_and_keeps_buffers(tmp_path):
    from safetensors.torch import load_file

    from specgen.utils.checkpoints import export, load_exported

    cfg = {"_target_": "specgen.tokenizers.vq.VQAutoencoder", "image_size": 64, "ch": 16, "mults": [2, 2],
           "z_dim": 8, "num_codes": 64}  # fp32 parameters and fp32 buffers (codebook, EMA counts)
    net = instantiate(cfg)
    export(tmp_path / "half", net, cfg, weights_dtype="float16")
    stored = load_file(str(tmp_path / "half" / "model.safetensors"))
    params = dict(net.named_parameters())
    assert all(stored[k].dtype == torch.float16 for k in params)
    buffers = {k: v for k, v in net.state_dict().items() if k not in params}
    assert buffers and all(stored[k].dtype == v.dtype for k, v in buffers.items())
    back = load_exported(tmp_path / "half")
    for k, p in back.named_parameters():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, params[k].detach().half().float())
    with pytest.raises(ValueError, match="weights_dtype='int8'"):
        export(tmp_path / "bad", net, cfg, weights_dtype="int8")


def test_averaging_exports_is_the_weighted_mean_and_refuses_other_models(tmp_path):
    from safetensors.torch import load_file

    from specgen.utils.average import average_exports, main
    from specgen.utils.checkpoints import export, load_exported

    cfg = {"_target_": "specgen.backbones.shapes_llama.ShapesLlama", "num_codes": 64, "grid_size": 16,
           "preset": "tiny"}
    nets = []
    for i in range(2):
        torch.manual_seed(i)
        nets.append(instantiate(cfg))
        export(tmp_path / f"m{i}", nets[-1], cfg, weights_dtype="float16")
    average_exports([tmp_path / "m0", tmp_path / "m1"], tmp_path / "avg", weights=[3, 1])
    avg = load_exported(tmp_path / "avg")
    stored = load_file(str(tmp_path / "avg" / "model.safetensors"))
    p0, p1 = (dict(n.named_parameters()) for n in nets)
    for k, p in avg.named_parameters():
        assert stored[k].dtype == torch.float16  # the first input's storage dtype
        want = 0.75 * p0[k].detach().half().float() + 0.25 * p1[k].detach().half().float()
        torch.testing.assert_close(p, want.half().float())
    assert "--weights 0.75 0.25" in (tmp_path / "avg" / "command.txt").read_text()
    other = dict(cfg, preset="small")
    export(tmp_path / "other", instantiate(other), other)
    with pytest.raises(ValueError, match="another config.yaml"):
        average_exports([tmp_path / "m0", tmp_path / "other"], tmp_path / "bad")
    with pytest.raises(ValueError, match="one per input"):
        average_exports([tmp_path / "m0", tmp_path / "m1"], tmp_path / "bad", weights=[1.0])
    with pytest.raises(ValueError, match="is one of the inputs"):
        average_exports([tmp_path / "m0", tmp_path / "m1"], tmp_path / "m1")
    (tmp_path / "m0" / "extra.json").write_text('{"backbone_id": "a"}')
    with pytest.raises(ValueError, match="extra.json differ"):
        average_exports([tmp_path / "m0", tmp_path / "m1"], tmp_path / "bad")
    (tmp_path / "m1" / "extra.json").write_text('{"backbone_id": "a"}')
    average_exports([tmp_path / "m0", tmp_path / "m1"], tmp_path / "avg2")
    assert json.loads((tmp_path / "avg2" / "extra.json").read_text()) == {"backbone_id": "a"}
    with pytest.raises(SystemExit, match="not an exported model"):
        main(["--out", str(tmp_path / "bad"), str(tmp_path / "m0"), str(tmp_path / "missing")])


def test_prepare_only_writes_the_shards_and_trains_nothing(tmp_path, tiny_exports):
    """prepare_only (with rendering in workers) writes the same shards as the in-process path."""
    import numpy as np

    from specgen.train import train

    over = _tiny_train("train/ar_shapes", tiny_exports) + ["prepare_only=true", "data.render_workers=2"]
    cfg = compose_cfg("train", over, tmp_path)
    assert train(cfg) == {}
    shards = sorted((tmp_path / "data" / "shapes_tokens").rglob("*.npz"))
    assert [p.name for p in shards] == ["train_00000.npz", "val_00000.npz"]
    assert not (tmp_path / "out" / "checkpoints").exists()
    from specgen.world.dataset import example
    from specgen.utils.checkpoints import load_exported

    a = np.load(shards[0])
    tok = load_exported(tiny_exports / "vq")

    imgs = torch.from_numpy(np.stack([example(i, "train", cfg.seed, 64, 0.0)[1] for i in range(4)])).permute(0, 3, 1, 2)
    assert (a["codes"][:4] == tok.encode(imgs).numpy()).all()
    assert list(a["prompts"][:2]) == [example(i, "train", cfg.seed, 64, 0.0)[0]["prompt"] for i in range(2)]


def test_shards_past_the_first_and_a_task_mixture(tmp_path, tiny_exports):
    """first_train_shard skips the shards a backbone has seen; a task mixture gets its own training cache
    (validation keeps the default mixture's) and its examples follow the weights."""
    import numpy as np

    from specgen.world.dataset import example
    from specgen.train import train

    over = _tiny_train("train/ar_shapes", tiny_exports) + [
        "prepare_only=true", "data.first_train_shard=2", "data.mix={colors: 1.0}"]
    cfg = compose_cfg("train", over, tmp_path)
    assert train(cfg) == {}
    shards = sorted((tmp_path / "data" / "shapes_tokens").rglob("*.npz"))
    assert sorted(p.name for p in shards) == ["train_00002.npz", "val_00000.npz"]
    train_file = next(p for p in shards if p.name.startswith("train"))
    val_file = next(p for p in shards if p.name.startswith("val"))
    assert train_file.parent != val_file.parent
    prompts = list(np.load(train_file)["prompts"])
    assert prompts == [example(32 + i, "train", cfg.seed, 64, 0.0, {"colors": 1.0})[0]["prompt"] for i in range(16)]
    assert all(example(32 + i, "train", cfg.seed, 64, 0.0, {"colors": 1.0})[0]["tag"] == "colors" for i in range(16))
    val = list(np.load(val_file)["prompts"])
    assert val == [example(i, "val", cfg.seed, 64, 0.0)[0]["prompt"] for i in range(16)]
    from hydra.errors import InstantiationException

    with pytest.raises((ValueError, InstantiationException), match="unknown task 'colour'"):
        train(compose_cfg("train", over[:-1] + ["data.mix={colour: 1.0}"], tmp_path))


def test_init_from_starts_the_network_from_an_export(tmp_path, tiny_exports):
    from specgen.train import train
    from specgen.utils.checkpoints import load_exported

    base = _tiny_train("train/ar_shapes", tiny_exports) + ["logger=none", "export_name=cont", "trainer.max_steps=1",
                                                           "module.lr=1e-12", "module.warmup_steps=1",
                                                           "trainer.val_check_interval=1"]
    train(compose_cfg("train", base + [f"init_from={tiny_exports / 'ar'}"], tmp_path))
    src, out = load_exported(tiny_exports / "ar"), load_exported(tmp_path / "checkpoints" / "cont")
    for (k, a), (_, b) in zip(src.state_dict().items(), out.state_dict().items()):  # lr ~ 0: weights kept
        torch.testing.assert_close(a.half().float(), b, msg=k)
    with pytest.raises(FileNotFoundError, match="init_from=.*no model.safetensors"):
        train(compose_cfg("train", base + [f"init_from={tmp_path / 'nowhere'}"], tmp_path / "b"))


def test_init_strict_false_grows_a_drafter_from_an_export(tmp_path, tiny_exports):
    """fphi_accept grows row and left context onto the shipped point-wise f_phi: the export's weights are loaded
    and the new parameters start at zero; with init_strict=true the missing keys are refused, naming the switch."""
    from specgen.train import train
    from specgen.utils.checkpoints import load_exported

    base = _tiny_train("train/fphi_accept", tiny_exports) + ["logger=none", "export_name=grown", "trainer.max_steps=1",
                                                       "module.lr=1e-12", "module.warmup_steps=1", "drafter.preset=xs",
                                                       "trainer.val_check_interval=1", "trainer.limit_val_batches=1"]
    with pytest.raises(ValueError, match="init_strict=false to grow a net from it"):
        train(compose_cfg("train", base + [f"init_from={tiny_exports / 'fphi'}", "init_strict=true"], tmp_path / "a"))
    train(compose_cfg("train", base + [f"init_from={tiny_exports / 'fphi'}"], tmp_path))
    src, out = load_exported(tiny_exports / "fphi"), load_exported(tmp_path / "checkpoints" / "grown")
    assert out.left_context and out.context_kernel == 5
    grown = out.state_dict()
    for k, a in src.state_dict().items():  # lr ~ 0: the export's weights kept
        torch.testing.assert_close(a.half().float(), grown[k], msg=k)
    assert all(grown[k].abs().max() < 1e-6 for k in ("left_in.weight", "nets.down.1.mix.conv.weight"))  # new: zero


def test_training_precision_follows_the_hardware(tmp_path):
    """bf16 autocast only where bf16 matmuls are native (emulated ones are ~10x slower than fp32)."""
    from specgen.utils.hydra import autocast_precision

    avx2, amx = tmp_path / "avx2", tmp_path / "amx"
    avx2.write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    amx.write_text("flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert autocast_precision("cpu", str(avx2)) == "32-true"
    assert autocast_precision("cpu", str(amx)) == "bf16-mixed"
    assert autocast_precision("gpu", str(avx2)) == "bf16-mixed"
    assert autocast_precision("cpu", str(tmp_path / "missing")) == "32-true"
    cfg = compose_cfg("train", ["experiment=train/mar_shapes_cpu"], tmp_path)
    assert cfg.trainer.precision == autocast_precision(cfg.trainer.accelerator)
    assert compose_cfg("train", ["experiment=train/ar_shapes", "trainer=gpu"], tmp_path).trainer.precision == "bf16-mixed"


def test_a_lightning_checkpoint_becomes_an_exported_folder(tmp_path):
    from specgen.utils.ckpt_export import ckpt_to_export, main
    from specgen.utils.checkpoints import export, load_exported

    cfg = {"_target_": "specgen.backbones.shapes_llama.ShapesLlama", "num_codes": 64, "grid_size": 16,
           "preset": "tiny"}
    torch.manual_seed(0)
    export(tmp_path / "like", instantiate(cfg), cfg, weights_dtype="float16")
    (tmp_path / "like" / "extra.json").write_text('{"backbone_id": "b"}')
    torch.manual_seed(1)
    trained = instantiate(cfg)  # the weights a run's checkpoint holds, beside an optimiser state and an EMA copy
    state = {f"net.{k}": v for k, v in trained.state_dict().items()}
    state.update({f"ema.{k}": torch.zeros_like(v) for k, v in trained.state_dict().items()})
    torch.save({"state_dict": state, "global_step": 250, "optimizer_states": []}, tmp_path / "step250.ckpt")
    ckpt_to_export(tmp_path / "step250.ckpt", tmp_path / "like", tmp_path / "out")
    back = load_exported(tmp_path / "out")
    for k, p in back.named_parameters():
        torch.testing.assert_close(p, dict(trained.named_parameters())[k].detach().half().float())
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["global_step"] == 250
    assert json.loads((tmp_path / "out" / "extra.json").read_text()) == {"backbone_id": "b"}
    with pytest.raises(ValueError, match=r"--prefix 'model'.*\['ema', 'net'\]"):
        ckpt_to_export(tmp_path / "step250.ckpt", tmp_path / "like", tmp_path / "bad", prefix="model")
    other = dict(cfg, preset="small")
    export(tmp_path / "other", instantiate(other), other)
    with pytest.raises(ValueError, match="do not fit the network"):
        ckpt_to_export(tmp_path / "step250.ckpt", tmp_path / "other", tmp_path / "bad")
    with pytest.raises(SystemExit, match="no checkpoint at"):
        main([str(tmp_path / "missing.ckpt"), "--like", str(tmp_path / "like"), "--out", str(tmp_path / "bad")])
