"""The Emu3, Lumina-mGPT (Chameleon) and Janus-Pro adapters on tiny random models of their transformers classes,
saved with `save_pretrained` and loaded back from the folder: the protocol's contracts (cached = full forward, block
verification with rollback, pre-norm states, forced tokens, padding) and every lossless decoder equal to greedy AR."""
from pathlib import Path

import pytest
import torch

from specgen.backbones.chameleon_vqgan import ChameleonVQGANDecoder
from specgen.backbones.emu3 import Emu3Backbone
from specgen.backbones.janus import JanusBackbone
from specgen.backbones.lumina import LuminaBackbone
from specgen.backbones.protocol import DiscreteBackbone, embed_image, image_states
from specgen.backbones.random_models import build_tiny, write_tiny_vqgan
from specgen.decoding import ar, sjd, ssd, ssd_carry
from specgen.decoding.sampling import guide, guided_logits
from specgen.decoding.ssd_carry.acceptance import Latent
from specgen.drafters.fphi import FPhi

PROMPTS = ["a red circle", "two blue squares left of a large green cross"]
KINDS = ["emu3", "lumina_mgpt", "janus_pro"]
CFG = 3.0  # Emu3's scale: two branches, padded jointly


def load(kind: str, path) -> DiscreteBackbone:
    if kind == "emu3":
        return Emu3Backbone(str(path), tokens_per_side=4, device="cpu")
    if kind == "lumina_mgpt":
        return LuminaBackbone(str(path), resolution=64, vqgan_path=str(path / "vqgan"), device="cpu")
    return JanusBackbone(str(path), device="cpu")


@pytest.fixture(scope="module", params=KINDS)
def real(request, tmp_path_factory):
    path = build_tiny(request.param, tmp_path_factory.mktemp(request.param), side=4, sharpen=3.0)
    return request.param, path, load(request.param, path)


def noisy_fphi(m):
    torch.manual_seed(1)
    d = FPhi(m.hidden_size, "xs")
    for net in d.nets.values():
        torch.nn.init.normal_(net[-1].weight, std=0.05)  # an imperfect drafter: many rejections
    return d


def test_cached_greedy_decoding_equals_the_full_forward(real):
    kind, _, m = real
    assert isinstance(m, DiscreteBackbone) and m.dtype == torch.float32 and m.device.type == "cpu"
    p = m.prompts(PROMPTS)
    rows = p.rows(True)
    assert rows.padded  # prompts of different lengths (and Emu3's longer negative prompt): left padding
    codes, st = ar.generate(m, p, cfg_scale=CFG, temperature=0)
    assert len(torch.unique(codes)) > 3 and st["nfe"] == 16
    states, tokens = image_states(m, rows, codes)  # one forward of the whole sequences
    greedy = guide(m.visual_logits(states), CFG).argmax(-1)  # (B, L): what each state predicts
    visual = tokens[:2] < m.grid.num_visual
    assert torch.equal(greedy[visual].view(2, 4, 4), codes)
    alone, _ = ar.generate(m, m.prompts(PROMPTS[1:]), cfg_scale=CFG, temperature=0)
    assert torch.equal(alone[0], codes[1])  # padding is invisible: an image does not depend on its batch


def test_block_verification_after_rollback_equals_a_fresh_forward(real):
    kind, _, m = real
    rows = m.prompts(PROMPTS).rows(True)
    P = rows.length
    g = m.grid.at(P)
    tokens = g.image_tokens(torch.randint(0, g.num_visual, (2, 4, 4))).repeat(2, 1)  # (4, 4*stride)
    embeds = torch.cat([m.embed_tokens(rows.ids), embed_image(m, tokens)], 1)
    n = embeds.shape[1]
    full = m.forward_embeds(embeds, torch.arange(n), m.new_cache(rows))
    cache = m.new_cache(rows)
    m.forward_embeds(embeds[:, :P + 6], torch.arange(P + 6), cache)
    m.rollback(cache, P + 2)  # drop four drafted tokens ...
    block = m.forward_embeds(embeds[:, P + 2:], torch.arange(P + 2, n), cache)  # ... and verify a block again
    assert cache.get_seq_length() == n
    assert torch.allclose(block, full[:, P + 2:], atol=1e-4)
    with pytest.raises(ValueError, match="cannot roll a cache"):
        m.rollback(cache, n + 1)


def test_prenorm_state_is_the_final_norms_input_and_the_head_is_the_models(real):
    kind, path, m = real
    ids = torch.tensor([m.prompts(PROMPTS[:1]).cond[0]])
    h = m.forward_embeds(m.embed_tokens(ids), torch.arange(ids.shape[1]), m.new_cache(m.prompts(PROMPTS[:1]).rows(False)))
    fresh = load(kind, path)  # a second copy: hook its decoder's own final norm, as transformers runs it
    seen = {}
    norm = fresh.final_norm
    handle = norm.register_forward_hook(lambda mod, args, out: seen.update(inp=args[0], out=out))
    decoder = fresh.decoder
    decoder.norm = norm  # put the norm back where the model has it
    try:
        out = decoder(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        decoder.norm = torch.nn.Identity()
        handle.remove()
    assert torch.allclose(seen["inp"], h, atol=1e-5) and torch.allclose(out, norm(h), atol=1e-5)
    if kind == "janus_pro":
        ref = fresh.model.model.generation_head(out)
    else:  # the model's own head, at the vocabulary ids of the visual codes
        ref = fresh.model.lm_head(out)[..., fresh.visual_ids]
    assert torch.allclose(m.visual_logits(h), ref, atol=1e-4)


def test_guided_logits_mix_before_a_linear_head_and_equal_guiding_the_logits(real):
    """sampling.guided_logits: Emu3's and Lumina's heads are linear (the rows are mixed before the projection), Janus's
    generation head is not (its logits are guided); every way, the guided logits of the model's own head."""
    kind, _, m = real
    torch.manual_seed(0)
    h = torch.randn(2, 5, m.hidden_size) * 3  # [cond; uncond] rows of one image, 5 states each
    assert (m.guided_visual_logits is None) == (kind == "janus_pro")
    assert torch.allclose(guided_logits(m, h, CFG), guide(m.visual_logits(h), CFG), atol=1e-4)


def test_forced_tokens_and_prompt_headers_are_in_place(real):
    kind, _, m = real
    p = m.prompts(PROMPTS)
    g = m.grid
    if kind == "janus_pro":
        assert g.eol_id is None and g.stride == g.width  # 24 x 24 codes, no row tokens
        assert all(len(c) == len(u) and c[0] == u[0] and c[-1] == u[-1] == m.boi for c, u in zip(p.cond, p.uncond))
        assert set(p.uncond[0][1:-1]) == {p.pad_id}
        return
    eol = m.tokenizer.convert_tokens_to_ids("<|extra_200|>" if kind == "emu3" else "<reserved08799>")
    assert g.eol_id == eol and g.stride == g.width + 1
    assert torch.equal(embed_image(m, torch.tensor([g.eol_token])), m.embed_tokens(torch.tensor([eol])))
    tokens = g.image_tokens(torch.zeros(1, 4, 4, dtype=torch.long))
    assert (tokens[0, g.width::g.stride] == g.eol_token).all()  # an end-of-row token after every row
    if kind == "emu3":
        header = m.tokenizer.encode("<|image start|>4*4<|image token|>", add_special_tokens=False)
        assert all(c[-len(header):] == tuple(header) for c in p.cond + p.uncond)
        seq = m.image_sequence(torch.zeros(2, 4, 4, dtype=torch.long))
        assert (seq[:, 4:20:5] == eol).all() and seq[0, -3:].tolist() == list(m.tail)
    else:
        size = m.tokenizer.convert_tokens_to_ids("<reserved08802>")  # 64 pixels = two 32-pixel patches
        assert all(c[-3:] == (m.tokenizer.convert_tokens_to_ids("<racm3:break>"), size, size) for c in p.cond)
        assert p.uncond[0] == p.cond[0][-3:]  # Lumina's unconditional branch starts at begin-of-image


def test_every_lossless_decoder_equals_greedy_ar(real):
    kind, _, m = real
    p = m.prompts(PROMPTS)
    ref, _ = ar.generate(m, p, cfg_scale=CFG, temperature=0)
    d = noisy_fphi(m)
    runs = {"ssd": (ssd.generate, dict(rounds=4)), "ssd_carry": (ssd_carry.generate, dict(rounds=1, max_window_rows=2)),
            "ssd_exact": (ssd.generate, dict(exact=True))}
    for name, (decode, kw) in runs.items():
        out, _ = decode(m, p, d, cfg_scale=CFG, temperature=0, **kw)
        assert torch.equal(out, ref), name
    out, _ = sjd.generate(m, p, cfg_scale=CFG, temperature=0, window=4)
    assert torch.equal(out, ref), "sjd"


def test_latent_acceptance_reads_each_adapters_codebook(real):
    """`code_embeddings()` is the adapter's VQ codebook, one row per visual code; SSD with acceptance `Latent` finds
    its neighbours there and still equals greedy AR."""
    kind, _, m = real
    e = m.code_embeddings()
    assert e.ndim == 2 and e.shape[0] == m.grid.num_visual
    p = m.prompts(PROMPTS)
    ref, _ = ar.generate(m, p, cfg_scale=CFG, temperature=0)
    out, _ = ssd_carry.generate(m, p, noisy_fphi(m), cfg_scale=CFG, temperature=0, acceptance=Latent(4, 0.3))
    assert torch.equal(out, ref)


def test_decoding_to_pixels(real):
    kind, _, m = real
    images = m.decode(torch.randint(0, m.grid.num_visual, (2, 4, 4)))
    side = {"emu3": 8, "lumina_mgpt": 64, "janus_pro": 8}[kind]  # tiny VQ models: x2, x16 (as released), x2
    assert images.shape == (2, 3, side, side) and 0 <= float(images.min()) and float(images.max()) <= 1


def test_chameleon_vqgan_loads_the_released_format(tmp_path):
    net = write_tiny_vqgan(tmp_path / "vq", codes=16)
    loaded = ChameleonVQGANDecoder.from_release(tmp_path / "vq")
    codes = torch.randint(0, 16, (2, 3, 3))
    with torch.no_grad():
        assert torch.equal(loaded(codes), net(codes))
    assert loaded(codes).shape == (2, 3, 48, 48)  # 16x, as the release's five levels
    state = torch.load(tmp_path / "vq" / "vqgan.ckpt", weights_only=False)
    del state["state_dict"]["decoder.conv_out.weight"]
    torch.save(state, tmp_path / "vq" / "vqgan.ckpt")
    with pytest.raises(ValueError, match="lacks 1 decoder weights"):
        ChameleonVQGANDecoder.from_release(tmp_path / "vq")
    with pytest.raises(FileNotFoundError, match="vqgan.yaml and vqgan.ckpt"):
        ChameleonVQGANDecoder.from_release(tmp_path / "nowhere")


def test_bad_folders_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no Emu3-Gen checkpoint at '.*nothing'.*generator.weights_path"):
        Emu3Backbone(str(tmp_path / "nothing"), device="cpu")
    with pytest.raises(ValueError, match="generator.weights_path is not set"):
        JanusBackbone("???", device="cpu")


def test_geneval_metadata_honours_prompts_per_task(tmp_path):
    import json

    from specgen.evaluation.benchmarks import GenEval

    meta = tmp_path / "evaluation_metadata.jsonl"
    rows = [{"tag": t, "include": [{"class": "dog", "count": 1}], "prompt": f"{t} {i}"}
            for t in ("single_object", "counting") for i in range(5)]
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(GenEval(metadata_file=str(meta), prompts_per_task=None).metadata()) == 10
    sub = GenEval(metadata_file=str(meta), prompts_per_task=2).metadata()
    assert [m["prompt"] for m in sub] == ["single_object 0", "single_object 1", "counting 0", "counting 1"]


def test_real_discrete_decodes_every_strategy_into_a_geneval_folder(tmp_path):
    """The eval command of a real backbone on a tiny Emu3 folder: AR, SSD, SJD and ZipAR on an official-format prompt
    file, images in GenEval's layout, the flat speed keys, scoring skipped without a detector."""
    import json

    from helpers import compose_cfg
    from specgen.eval import evaluate as run_eval
    from specgen.utils.checkpoints import export

    path = build_tiny("emu3", tmp_path / "emu3", side=4, sharpen=3.0)
    identity = load("emu3", path).identity
    fphi_cfg = {"_target_": "specgen.drafters.fphi.FPhi", "hidden_size": 64, "preset": "xs", "backbone_id": identity}
    export(tmp_path / "fphi", FPhi(64, "xs", backbone_id=identity), fphi_cfg)
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text("".join(json.dumps({"tag": t, "include": [{"class": "dog", "count": 1}], "prompt": p}) + "\n"
                            for t, p in [("single_object", "a photo of a dog"), ("counting", "two red circles")]))
    cfg = compose_cfg("eval", ["experiment=eval/real_discrete", "generator=emu3", f"generator.weights_path={path}",
                               "generator.tokens_per_side=4", "generator.device=cpu", f"drafter_dir={tmp_path / 'fphi'}",
                               f"benchmark.prompts_path={meta}", "benchmark.geneval.samples_per_prompt=1",
                               "speed.num_prompts=2", "logger=csv"], tmp_path)
    metrics = run_eval(cfg)
    out = Path(cfg.paths.output_dir)
    for name in ("ar", "ssd", "sjd", "zipar"):
        for key in ("nfe", "nfe_ratio", "latency_s", "wall_ratio"):
            assert f"{name}/speed/{key}" in metrics, (name, key)
    assert metrics["ar/speed/nfe"] == 16 and metrics["ar/speed/nfe_ratio"] == 1.0
    folder = out / "geneval_samples" / "00001"
    assert json.loads((folder / "metadata.jsonl").read_text())["prompt"] == "two red circles"
    assert (folder / "samples" / "0000.png").is_file() and not any("geneval/overall" in k for k in metrics)


def test_fphi_real_distils_from_a_prompt_file_and_its_export_refuses_another_backbone(tmp_path):
    """The train command of a real backbone on a tiny Janus folder: teacher shards sampled from a prompt file, a few
    steps of the distillation module, an export that records the weights and that SSD refuses on other weights."""
    from helpers import compose_cfg
    from specgen.train import train
    from specgen.utils.checkpoints import load_exported

    path = build_tiny("janus_pro", tmp_path / "janus", side=4, sharpen=3.0)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo blue squares\na green cross\n")
    cfg = compose_cfg("train", ["experiment=train/fphi_real", "generator=janus_pro", f"generator.weights_path={path}",
                                "generator.device=cpu", f"data.prompts_path={prompts}", "trainer.max_steps=3",
                                "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "drafter.hidden_size=64",
                                "data.train_shards=1", "data.shard_size=4", "data.sample_batch=4", "data.batch_size=2",
                                "num_threads=1", "logger=csv"], tmp_path)
    metrics = train(cfg)
    assert metrics["train/loss"] > 0
    export = Path(cfg.paths.output_dir) / "export"
    d = load_exported(export)
    m = load("janus_pro", path)
    assert d.backbone_id == m.identity
    ref, _ = ar.generate(m, m.prompts(PROMPTS), cfg_scale=CFG, temperature=0)
    assert torch.equal(ssd.generate(m, m.prompts(PROMPTS), d, cfg_scale=CFG, temperature=0, rounds=4)[0], ref)
    other = load("janus_pro", build_tiny("janus_pro", tmp_path / "other", side=4, seed=1))
    with pytest.raises(ValueError, match="distilled from backbone weights"):
        ssd.generate(other, other.prompts(PROMPTS), d, temperature=0)


def test_the_gpu_timing_script_runs_at_tiny_sizes_on_cpu(tmp_path):
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "experiments" / "real_backbones" / "time_steps.py"
    spec = importlib.util.spec_from_file_location("time_steps", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = mod.main(["--tiny", "--out", str(tmp_path), "--repeats", "2", "--pass-ratio", "4"])
    assert set(results) == {"emu3", "lumina_mgpt", "janus_pro"}
    assert all(r["t_1"] > 0 and set(r["t_row"]) == {"4", "8"} for r in results.values())
    md = (tmp_path / "speedup.md").read_text()
    assert md.count("| emu3 |") == 2 and "speed-up at r=4" in md


def test_streamed_teacher_data_trains_on_the_same_batches_and_resumes_by_shard(tmp_path, capsys, monkeypatch):
    """data.stream=true on a tiny Emu3 folder: the shards hold the sampled tokens only, the module's frozen backbone
    recomputes the states, and a training step sees the same batches and losses as the in-memory shards (up to their
    fp16 rounding); the size estimate is printed before sampling and a deleted shard alone is written again."""
    import zipfile

    import numpy as np

    from specgen.modules.distill_data import DistillDataModule
    from specgen.modules.distill_module import DistillModule
    from specgen.utils.checkpoints import compact_ints

    path = build_tiny("emu3", tmp_path / "emu3", side=4, sharpen=3.0)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo blue squares left of a large green cross\na green cross\n")
    gen = {"_target_": "specgen.backbones.emu3.Emu3Backbone", "weights_path": str(path), "tokens_per_side": 4,
           "device": "cpu"}
    kw = dict(backbone_dir=None, tokenizer_dir=None, cache_dir=str(tmp_path / "cache"), train_shards=2, val_shards=1,
              shard_size=3, sample_batch=2, cfg_scale=CFG, top_k=8, batch_size=2, generator=gen,
              prompts_path=str(prompts))
    dms = {}
    for stream in (False, True):
        dms[stream] = DistillDataModule(**kw, stream=stream)
        dms[stream].prepare_data()
        dms[stream].setup()
    printed = capsys.readouterr().out
    assert "MB a sequence in fp16, are recomputed" in printed and "training loads all 9 sequences" in printed
    streamed = np.load(dms[True].shard_path("train", 1))
    assert set(streamed.files) == {"codes", "ids", "prompts"} and streamed["codes"].shape == (3, 4, 4)
    # compressed, the ids in the narrowest of int16 / int32 that holds them (a real vocabulary can pass int16)
    widest = max(int(streamed[k].max()) for k in ("codes", "ids"))
    assert {streamed[k].dtype for k in ("codes", "ids")} == {np.dtype(np.int16 if widest < 2 ** 15 else np.int32)}
    assert compact_ints(np.array([0, 2 ** 15])).dtype == np.int32 and compact_ints(np.array([-3, 511])).dtype == np.int16
    with zipfile.ZipFile(dms[True].shard_path("train", 1)) as z:
        assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist())
    torch.manual_seed(0)
    module = DistillModule(FPhi(64, "xs"), None, None, generator=gen, cfg_scale=CFG).eval()
    batched = DistillModule(FPhi(64, "xs"), None, None, generator=gen, cfg_scale=CFG, state_batch=2).eval()
    batches = {}
    for stream, dm in dms.items():
        torch.manual_seed(3)  # the same shuffle for both
        batches[stream] = list(dm.train_dataloader())
    assert len(batches[True]) == 3
    mixed = 0
    for full, lazy in zip(batches[False], batches[True]):
        assert torch.equal(full["ids"], lazy["ids"])
        states = module.batch_states(lazy)
        # two prompts per teacher call (state_batch=2, of different lengths in some batch): the states of one at a time
        mixed += len({len(t) for t in lazy["prompt"]}) > 1
        assert torch.allclose(batched.batch_states(lazy), states, rtol=1e-4, atol=1e-5)
        assert torch.allclose(states, module.batch_states(full), rtol=2e-3, atol=2e-3)  # fp16 shards
        with torch.no_grad():
            a, b = module.losses(full), module.losses(lazy)
        assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-4) for k in a), {k: (a[k], b[k]) for k in a}
    assert mixed  # the batched teacher call saw prompts of different lengths
    # resumable: a missing shard is written again, alone, with the same tokens
    before = {k: streamed[k].copy() for k in streamed.files}
    dms[True].shard_path("train", 1).unlink()
    written = []
    original = DistillDataModule._write_shard
    def counted(self, bb, split, k, dev="cpu"):
        written.append((split, k))
        return original(self, bb, split, k, dev)

    monkeypatch.setattr(DistillDataModule, "_write_shard", counted)
    dms[True].prepare_data()
    assert written == [("train", 1)] and "2 of 3 already written" in capsys.readouterr().out
    again = np.load(dms[True].shard_path("train", 1))
    assert all(np.array_equal(before[k], again[k]) for k in before)


DPG_HEADER = ("item_id,text,keywords,proposition_id,dependency,category_broad,category_detailed,tuple,"
              "question_natural_language\n")


def _dpg_files(tmp_path):
    """A DPG-Bench prompt folder (two items) and question file in the official formats."""
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "a.txt").write_text("a red circle above two blue squares\n")
    (folder / "b.txt").write_text("a green cross\n")
    rows = [("a", 1, "0", "entity - whole (circle)"), ("a", 2, "1", "attribute - color (circle, red)"),
            ("a", 3, "2", "attribute - texture (circle, red, shiny)"), ("a", 4, "0", "entity - whole (square)"),
            ("b", 1, "0", "entity - whole (cross)"), ("b", 2, "1", "attribute - color (cross, green)")]
    csv = tmp_path / "dpg_bench.csv"
    csv.write_text(DPG_HEADER + "".join(f'{i},t,k,{q},"{d}",x,y,"{t}",question {q}?\n' for i, q, d, t in rows))
    return folder, csv


class TileVQA:
    """A stand-in VQA model: finds which generated image a crop is, records it, and answers "no" to chosen
    (image, question id) pairs, "yes" to the rest."""

    def __init__(self, images, no: set[tuple[int, int]]):
        self.images, self.no, self.seen = images, no, []

    def answer(self, tile, question) -> str:
        k = [i for i, im in enumerate(self.images) if im.shape == tile.shape and (im == tile).all()]
        assert len(k) == 1, "a crop is not exactly one generated image: the grid is padded or misplaced"
        self.seen.append((k[0], question.qid))
        return "no" if (k[0], question.qid) in self.no else "yes"


def test_dpg_bench_folder_scores_real_backbone_grids_by_the_dpg_rules(tmp_path):
    """DPG-Bench's prompt folder on a tiny Emu3: 4 samples per prompt written as <item_id>.png, a 2x2 grid without
    padding in sample order, every crop asked every question, failed parents zeroing their descendants."""
    import functools

    import numpy as np
    from PIL import Image

    from specgen.evaluation.benchmarks import DPGBenchFolder, real_dpg
    from specgen.evaluation.dpg_bench import read_questions
    from specgen.evaluation.generate import generate_images

    m = load("emu3", build_tiny("emu3", tmp_path / "emu3", side=4, sharpen=1.0))  # a flat head: 8 distinct images
    folder, csv = _dpg_files(tmp_path)
    bench = DPGBenchFolder(str(folder), read_questions(csv), None, layout_dir=str(tmp_path / "grids"))
    jobs = bench.jobs(seed=0)
    assert [(j.meta["item_id"], j.sample) for j in jobs] == [(i, k) for i in "ab" for k in range(4)]
    images, _ = generate_images(jobs, m, functools.partial(ar.generate, cfg_scale=CFG), tmp_path / "cache", 4)
    assert len({im.tobytes() for im in images}) == 8 and images[0].shape == (8, 8, 3)
    # item a: crop 0 fails question 1 (so 2 and 3, transitively), crop 1 fails question 2 (so 3); item b: crop 2
    # (image 6) fails question 1 (so 2)
    bench.vqa = TileVQA(images, no={(0, 1), (1, 2), (6, 1)})
    scores, rows = bench.score(jobs, images)
    a, b = (1 / 4 + 2 / 4 + 1 + 1) / 4, (1 + 1 + 0 + 1) / 4
    assert scores["overall"] == pytest.approx(100 * (a + b) / 2) and scores["num_failed"] == 0
    assert [r["correct"] for r in rows] == pytest.approx([a, b])
    assert [k for k, _ in bench.vqa.seen] == [k for k in range(8) for _ in range(4 if k < 4 else 2)]  # crop order
    grid = np.asarray(Image.open(tmp_path / "grids" / "a.png"))
    assert grid.shape == (16, 16, 3) and (grid[:8, 8:] == images[1]).all() and (grid[8:, :8] == images[2]).all()
    # an item without questions is counted as failed, not dropped
    bench.questions = {"a": bench.questions["a"]}
    assert bench.score(jobs, images)[0]["num_failed"] == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"prompt folder '.*empty' holds no <item_id>.txt files"):
        real_dpg(str(empty))
    with pytest.raises(ValueError, match="benchmark.prompts_path is not set"):
        real_dpg(None)
    with pytest.raises(ValueError, match=r"needs both benchmark.vqa_path \('v'\) and benchmark.questions_path"):
        real_dpg(str(folder), vqa_path="v")


def test_real_discrete_writes_dpg_bench_grids_and_skips_scoring_without_a_vqa_model(tmp_path):
    """The eval command with benchmark=dpg_real on a tiny Emu3 folder: DPG-Bench's prompt folder, the official grids,
    the flat speed keys, no DPG score without local VQA weights."""
    from PIL import Image

    from helpers import compose_cfg
    from specgen.eval import evaluate as run_eval
    from specgen.utils.checkpoints import export

    path = build_tiny("emu3", tmp_path / "emu3", side=4, sharpen=3.0)
    identity = load("emu3", path).identity
    fphi_cfg = {"_target_": "specgen.drafters.fphi.FPhi", "hidden_size": 64, "preset": "xs", "backbone_id": identity}
    export(tmp_path / "fphi", FPhi(64, "xs", backbone_id=identity), fphi_cfg)
    folder, _ = _dpg_files(tmp_path)
    cfg = compose_cfg("eval", ["experiment=eval/real_discrete", "benchmark=dpg_real", "generator=emu3",
                               f"generator.weights_path={path}", "generator.tokens_per_side=4", "generator.device=cpu",
                               f"drafter_dir={tmp_path / 'fphi'}", f"benchmark.prompts_path={folder}",
                               "benchmark.dpg.num_prompts=1", "speed.num_prompts=1", "~strategies.zipar", "logger=csv"],
                      tmp_path)
    metrics = run_eval(cfg)
    assert {"ar/speed/nfe", "ssd/speed/nfe_ratio", "sjd/speed/wall_ratio"} <= set(metrics)
    assert not any("/dpg/" in k for k in metrics)
    grids = sorted((Path(cfg.paths.output_dir) / "dpg_samples").iterdir())
    assert [g.name for g in grids] == ["a.png"] and Image.open(grids[0]).size == (16, 16)
