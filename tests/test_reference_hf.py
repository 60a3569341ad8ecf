"""The Emu3, Janus-Pro and Lumina-mGPT (Chameleon) adapters against transformers' own classes on the same tiny random
weights: the prompts the official generation code builds (Emu3's and Janus' processors, Lumina's item processor and
conversation template), the pre-norm states and image-vocabulary logits of a teacher-forced sequence against the
class's plain forward (per row, unpadded, where the adapter runs a padded [cond; uncond] batch), greedy CFG images
against transformers' `generate` (Emu3 with the row-constraining `prefix_allowed_tokens_fn` of its docs, Janus in
image mode) or, for Lumina, a loop written here after its inference code, and decoded pixels against transformers'
`decode_image_tokens` (Chameleon's VQGAN: against a forward written here from Meta's state-dict layout).

Tolerance: 1e-4 absolute in float32 (the issue's target); each test prints its measured maximum difference."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import (ChameleonForConditionalGeneration, Emu3ForConditionalGeneration, Emu3ImageProcessor,
                          Emu3Processor, JanusForConditionalGeneration, JanusImageProcessor, JanusProcessor)

from specgen.backbones.emu3 import NEGATIVE_PROMPT, POSITIVE_PROMPT, Emu3Backbone
from specgen.backbones.janus import JanusBackbone
from specgen.backbones.lumina import LuminaBackbone
from specgen.backbones.protocol import image_states
from specgen.backbones.random_models import build_tiny
from specgen.decoding import ar

PROMPTS = ["a red circle", "two blue squares left of a large green cross"]
SIDE = 4
TOL = 1e-4


def report(what: str, a: torch.Tensor, b: torch.Tensor) -> float:
    diff = float((a.detach().float() - b.detach().float()).abs().max())
    print(f"{what}: max abs difference {diff:.2e} (tolerance {TOL:g})")
    assert a.shape == b.shape and diff <= TOL, (what, a.shape, b.shape, diff)
    return diff


def reference_states(decoder: torch.nn.Module, run, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `run(ids)` (the class's own forward) and catch the input of the decoder's own final norm (pre-norm)."""
    seen = {}
    handle = decoder.norm.register_forward_hook(lambda mod, args, out: seen.update(pre=args[0]))
    try:
        out = run(ids)
    finally:
        handle.remove()
    return seen["pre"], out


def adapter_rows(m, codes: torch.Tensor):
    """The adapter's teacher-forced pre-norm states and image-vocabulary logits of [cond; uncond] rows (padded)."""
    p = m.prompts(PROMPTS)
    rows = p.rows(True)
    states, tokens = image_states(m, rows, codes)
    return p, rows, states, m.visual_logits(states)


def check_rows_against_reference(m, codes, sequences, ref_forward, name):
    """Per row (conditional prompts, then unconditional ones) the class's forward of that row alone, unpadded."""
    p, rows, states, logits = adapter_rows(m, codes)
    L = states.shape[1]
    worst = 0.0
    for r, prompt in enumerate(list(p.cond) + list(p.uncond)):
        ids = torch.tensor([list(prompt) + sequences[r % len(PROMPTS)]])  # prompt + the image part as the model reads it
        pre, ref_logits = ref_forward(ids)
        P = len(prompt)
        worst = max(worst, report(f"{name} row {r} pre-norm states", states[r], pre[0, P - 1: P - 1 + L]))
        worst = max(worst, report(f"{name} row {r} image-vocabulary logits", logits[r], ref_logits[0, P - 1: P - 1 + L]))
    return worst


# ---- Emu3 -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emu3(tmp_path_factory):
    path = build_tiny("emu3", tmp_path_factory.mktemp("emu3"), side=SIDE, sharpen=3.0)
    m = Emu3Backbone(str(path), tokens_per_side=SIDE, device="cpu")
    ref = Emu3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = Emu3Processor(Emu3ImageProcessor(), m.tokenizer)
    visual = torch.tensor([m.tokenizer.convert_tokens_to_ids("<|visual token %06d|>" % k) for k in range(32)])
    return m, ref, proc, visual


def emu3_processor_ids(proc, text: str) -> list[int]:
    """Emu3's processor in image-generation mode at the grid's area (8x VQ): bos, text, image header."""
    area = (8 * SIDE) ** 2
    return proc(text=[text], return_for_image_generation=True, image_area=area)["input_ids"][0]


def test_emu3_prompts_are_its_processors(emu3):
    m, _, proc, _ = emu3
    p = m.prompts(PROMPTS)
    for text, cond, uncond in zip(PROMPTS, p.cond, p.uncond):
        assert list(cond) == list(emu3_processor_ids(proc, text + POSITIVE_PROMPT))
        assert list(uncond) == list(emu3_processor_ids(proc, NEGATIVE_PROMPT))  # the docs' negative_prompt_ids


def test_emu3_states_and_logits_equal_the_class_forward(emu3):
    m, ref, _, visual = emu3
    torch.manual_seed(0)
    codes = torch.randint(0, 32, (2, SIDE, SIDE))
    seqs = [m.image_sequence(codes[i:i + 1])[0].tolist() for i in range(2)]  # rows with end-of-line, as Emu3 writes
    text = ref.model.text_model

    def forward(ids):
        pre, out = reference_states(text, lambda x: ref(input_ids=x, use_cache=False).logits, ids)
        return pre, out[..., visual]
    check_rows_against_reference(m, codes, seqs, forward, "emu3")


def emu3_prefix_fn(m, visual: torch.Tensor):
    """The row constraint of transformers' Emu3 image-generation example: visual tokens, an end-of-line after each
    row of W, then end-of-frame, end-of-image and end-of-sequence."""
    H = W = SIDE
    tok = m.tokenizer

    def allowed(batch_id, input_ids):
        start = torch.nonzero(input_ids == tok.convert_tokens_to_ids("<|image token|>"), as_tuple=True)[0][0]
        offset = input_ids.shape[0] - start
        if offset % (W + 1) == 0:
            return [tok.convert_tokens_to_ids("<|extra_200|>")]
        if offset == (W + 1) * H + 1:
            return [tok.convert_tokens_to_ids("<|extra_201|>")]
        if offset == (W + 1) * H + 2:
            return [tok.convert_tokens_to_ids("<|image end|>")]
        if offset >= (W + 1) * H + 3:
            return [tok.eos_token_id]
        return visual.tolist()
    return allowed


def test_emu3_greedy_cfg_image_and_pixels_equal_transformers_generate(emu3):
    m, ref, proc, visual = emu3
    codes, _ = ar.generate(m, m.prompts(PROMPTS), cfg_scale=3.0, temperature=0)  # a padded batch of two
    assert len(torch.unique(codes)) > 3
    neg = torch.tensor([emu3_processor_ids(proc, NEGATIVE_PROMPT)])
    for i, text in enumerate(PROMPTS):
        ids = torch.tensor([emu3_processor_ids(proc, text + POSITIVE_PROMPT)])
        out = ref.generate(ids, max_new_tokens=SIDE * (SIDE + 1) + 3, do_sample=False, guidance_scale=3.0,
                           negative_prompt_ids=neg, prefix_allowed_tokens_fn=emu3_prefix_fn(m, visual))
        image = out[:, ids.shape[1]:]
        assert image[0].tolist() == m.image_sequence(codes[i:i + 1])[0].tolist()  # same codes, same layout
        pixels = ref.model.decode_image_tokens(image, height=SIDE, width=SIDE)  # [-1, 1]
        report(f"emu3 image {i} decoded pixels", m.decode(codes[i:i + 1]), ((pixels + 1) / 2).clamp(0, 1))


# ---- Janus-Pro --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def janus(tmp_path_factory):
    path = build_tiny("janus_pro", tmp_path_factory.mktemp("janus"), side=SIDE, sharpen=3.0)
    m = JanusBackbone(str(path), device="cpu")
    ref = JanusForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = JanusProcessor(JanusImageProcessor(), m.tokenizer, num_image_tokens=SIDE * SIDE)
    return m, ref, proc


DEEPSEEK_SFT = "<|User|>: {}\n\n<|Assistant|>:"  # Janus' 'deepseek' conversation format, empty system prompt


def test_janus_prompts_are_its_processors_and_its_generate_unconditional(janus):
    m, ref, proc = janus
    p = m.prompts(PROMPTS)
    for text, cond, uncond in zip(PROMPTS, p.cond, p.uncond):
        ids = proc(text=DEEPSEEK_SFT.format(text), generation_mode="image")["input_ids"][0]
        assert list(cond) == list(ids)
        keep = [t in (m.tokenizer.bos_token_id, m.boi) for t in ids]  # generate(): all but BOS and BOI padded
        assert list(uncond) == [t if k else ref.generation_config.pad_token_id for t, k in zip(ids, keep)]
    assert m.grid.num_visual_tokens == ref.model.vision_model.config.num_image_tokens


def test_janus_states_and_logits_equal_the_class_forward(janus):
    m, ref, _ = janus
    torch.manual_seed(0)
    codes = torch.randint(0, 32, (2, SIDE, SIDE))
    lm = ref.model.language_model
    p = m.prompts(PROMPTS)
    _, rows, states, logits = adapter_rows(m, codes)
    L = states.shape[1]
    for r, prompt in enumerate(list(p.cond) + list(p.uncond)):
        image = codes[r % 2].flatten()[None, :L - 1]  # the image codes fed (all but the last)
        embeds = torch.cat([ref.get_input_embeddings()(torch.tensor([prompt])),
                            ref.prepare_embeddings_for_image_generation(image)], 1)
        pre, post = reference_states(lm, lambda e: lm(inputs_embeds=e, use_cache=False).last_hidden_state, embeds)
        P = len(prompt)
        report(f"janus row {r} pre-norm states", states[r], pre[0, P - 1:])
        report(f"janus row {r} image logits", logits[r], ref.model.generation_head(post[0, P - 1:]))


def test_janus_greedy_cfg_image_and_pixels_equal_transformers_generate(janus):
    m, ref, proc = janus
    codes, _ = ar.generate(m, m.prompts(PROMPTS), cfg_scale=5.0, temperature=0)
    assert len(torch.unique(codes)) > 3
    for i, text in enumerate(PROMPTS):
        ids = proc(text=DEEPSEEK_SFT.format(text), generation_mode="image", return_tensors="pt")
        gen = copy.deepcopy(ref.generation_config)
        gen.generation_kwargs = {"boi_token_id": m.boi}  # what generate() reads in image mode (the release's config)
        out = ref.generate(**ids, generation_config=gen, generation_mode="image", do_sample=False, guidance_scale=5.0)
        assert out[0].tolist() == codes[i].flatten().tolist()  # raster order, no row tokens
        pixels = ref.decode_image_tokens(out).permute(0, 3, 1, 2)  # (B, 3, S, S) in [-1, 1]
        report(f"janus image {i} decoded pixels", m.decode(codes[i:i + 1]), ((pixels + 1) / 2).clamp(0, 1))


# ---- Lumina-mGPT (Chameleon) ------------------------------------------------------------------------------------
LUMINA_RES = 16 * SIDE  # 64 pixels: two 32-pixel patches a side


@pytest.fixture(scope="module")
def lumina(tmp_path_factory):
    path = build_tiny("lumina_mgpt", tmp_path_factory.mktemp("lumina"), side=SIDE, sharpen=3.0)
    m = LuminaBackbone(str(path), resolution=LUMINA_RES, vqgan_path=str(path / "vqgan"), device="cpu")
    ref = ChameleonForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    image_ids = torch.tensor([m.tokenizer.convert_tokens_to_ids(
        "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(k)) + "Z") for k in range(32)])  # Chameleon's names
    return m, ref, image_ids, path


def lumina_item(tok, text: str) -> list[int]:
    """Lumina's item processor and conversation template for a generation prompt: the human turn with its separator
    (<reserved08706>) and a BOS, then the image header it generates from (begin-of-image, height and width in
    32-pixel patches as <reserved{8800 + n}>)."""
    n = LUMINA_RES // 32
    turn = f"Generate an image of {LUMINA_RES}x{LUMINA_RES} according to the following prompt:\n{text}<reserved08706>"
    size = tok.convert_tokens_to_ids(f"<reserved{8800 + n:05d}>")
    return tok(turn)["input_ids"] + [tok.convert_tokens_to_ids("<racm3:break>"), size, size]


def test_lumina_prompts_are_its_item_processors(lumina):
    m, _, _, _ = lumina
    p = m.prompts(PROMPTS)
    for text, cond, uncond in zip(PROMPTS, p.cond, p.uncond):
        ids = lumina_item(m.tokenizer, text)
        assert list(cond) == ids
        assert list(uncond) == ids[-3:]  # its CFG processor starts the unconditional branch at begin-of-image


def test_lumina_states_and_logits_equal_the_class_forward(lumina):
    m, ref, image_ids, _ = lumina
    torch.manual_seed(0)
    codes = torch.randint(0, 32, (2, SIDE, SIDE))
    newline, eoi = (m.tokenizer.convert_tokens_to_ids(t) for t in ("<reserved08799>", "<eoss>"))
    seqs = [torch.cat([image_ids[codes[i]], torch.full((SIDE, 1), newline)], 1).flatten().tolist() + [eoi]
            for i in range(2)]  # the item processor's rows: codes then a new-line token, end-of-image last

    def forward(ids):  # transformers' forward masks image logits to -inf: its decoder, then its own lm_head
        pre, post = reference_states(ref.model, lambda x: ref.model(input_ids=x, use_cache=False).last_hidden_state,
                                     ids)
        return pre, ref.lm_head(post)[..., image_ids]
    check_rows_against_reference(m, codes, seqs, forward, "lumina")


@torch.no_grad()
def lumina_greedy(ref, tok, image_ids, text: str, cfg: float) -> list[int]:
    """Greedy decoding as Lumina's inference code runs it: logits mixed as cfg * (cond - uncond) + uncond with the
    unconditional branch from begin-of-image on, a new-line token forced after every row, the end-of-image token
    after the last, image tokens only otherwise (no cache: every step a full forward)."""
    cond = lumina_item(tok, text)
    uncond = cond[-3:]
    newline, eoi = (tok.convert_tokens_to_ids(t) for t in ("<reserved08799>", "<eoss>"))
    out: list[int] = []
    while not out or out[-1] != eoi:
        n = len(out) + 1
        if n % (SIDE + 1) == 0:
            out.append(newline)
            continue
        if n == (SIDE + 1) * SIDE + 1:
            out.append(eoi)
            continue
        last = [ref.lm_head(ref.model(input_ids=torch.tensor([s + out])).last_hidden_state[0, -1])
                for s in (cond, uncond)]
        mixed = cfg * (last[0] - last[1]) + last[1]
        out.append(int(image_ids[mixed[image_ids].argmax()]))
    return out


def test_lumina_greedy_cfg_image_equals_its_inference_loop(lumina):
    m, ref, image_ids, _ = lumina
    codes, _ = ar.generate(m, m.prompts(PROMPTS), cfg_scale=4.0, temperature=0)
    assert len(torch.unique(codes)) > 3
    newline, eoi = (m.tokenizer.convert_tokens_to_ids(t) for t in ("<reserved08799>", "<eoss>"))
    for i, text in enumerate(PROMPTS):
        want = torch.cat([image_ids[codes[i]], torch.full((SIDE, 1), newline)], 1).flatten().tolist() + [eoi]
        assert lumina_greedy(ref, m.tokenizer, image_ids, text, 4.0) == want


def _taming_decode(sd: dict, ddconfig: dict, codes: torch.Tensor) -> torch.Tensor:
    """Taming-transformers' VQGAN decoder (Chameleon's), written from the state-dict layout: codebook, post-quant
    conv, conv_in, mid (resnet, attention, resnet), levels coarsest first (resnets with attention where the level's
    keys have it, nearest x2 + conv), GroupNorm(32), swish, conv_out."""
    def conv(x, name, pad):
        return F.conv2d(x, sd[name + ".weight"], sd[name + ".bias"], padding=pad)

    def norm(x, name):
        return F.group_norm(x, 32, sd[name + ".weight"], sd[name + ".bias"], eps=1e-6)

    def resnet(x, name):
        h = conv(F.silu(norm(x, name + ".norm1")), name + ".conv1", 1)
        h = conv(F.silu(norm(h, name + ".norm2")), name + ".conv2", 1)
        skip = conv(x, name + ".nin_shortcut", 0) if name + ".nin_shortcut.weight" in sd else x
        return skip + h

    def attn(x, name):
        B, C, H, W = x.shape
        h = norm(x, name + ".norm")
        q, k, v = (conv(h, f"{name}.{t}", 0).reshape(B, C, H * W) for t in "qkv")
        w = torch.softmax(torch.einsum("bci,bcj->bij", q, k) * C ** -0.5, dim=2)  # (B, HW queries, HW keys)
        return x + conv(torch.einsum("bcj,bij->bci", v, w).reshape(B, C, H, W), name + ".proj_out", 0)

    z = sd["quantize.embedding.weight"][codes].permute(0, 3, 1, 2)
    h = conv(conv(z, "post_quant_conv", 0), "decoder.conv_in", 1)
    h = resnet(attn(resnet(h, "decoder.mid.block_1"), "decoder.mid.attn_1"), "decoder.mid.block_2")
    levels = len(ddconfig["ch_mult"])
    for level in reversed(range(levels)):
        for b in range(ddconfig["num_res_blocks"] + 1):
            h = resnet(h, f"decoder.up.{level}.block.{b}")
            if f"decoder.up.{level}.attn.{b}.q.weight" in sd:
                h = attn(h, f"decoder.up.{level}.attn.{b}")
        if level:
            h = conv(F.interpolate(h, scale_factor=2.0, mode="nearest"), f"decoder.up.{level}.upsample.conv", 1)
    return conv(F.silu(norm(h, "decoder.norm_out")), "decoder.conv_out", 1)


def test_chameleon_vqgan_pixels_equal_a_reference_forward_of_metas_layout(lumina):
    import yaml

    m, _, _, path = lumina
    state = torch.load(path / "vqgan" / "vqgan.ckpt", weights_only=False)["state_dict"]
    torch.manual_seed(0)
    for key, value in state.items():  # norms away from their unit initialisation: every parameter matters
        if ".norm" in key:
            state[key] = value + 0.3 * torch.randn_like(value)
    torch.save({"state_dict": state}, path / "vqgan" / "vqgan.ckpt")
    dd = yaml.safe_load((path / "vqgan" / "vqgan.yaml").read_text())["model"]["params"]["ddconfig"]
    fresh = LuminaBackbone(str(path), resolution=LUMINA_RES, vqgan_path=str(path / "vqgan"), device="cpu")
    codes = torch.randint(0, 32, (2, SIDE, SIDE))
    with torch.no_grad():
        want = ((_taming_decode(state, dd, codes) + 1) / 2).clamp(0, 1)
    assert want.shape == (2, 3, 16 * SIDE, 16 * SIDE)
    report("chameleon vqgan pixels", fresh.decode(codes), want)


def test_lumina_qk_norms_in_lumina_layout_are_repeated_per_head(tmp_path):
    """Lumina-mGPT's files store q/k norms as (model_parallel_size, head_dim) = (1, head_dim): loaded, each row is
    repeated over the heads, which is what its own forward does (repeat_interleave over the shard's heads)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = build_tiny("lumina_mgpt", tmp_path / "hf_layout", side=SIDE)
    sd = load_file(src / "model.safetensors")
    torch.manual_seed(0)
    lumina_sd = dict(sd)
    for key, value in sd.items():
        if key.endswith(("q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias")):
            row = value[:1] + 0.5 * torch.randn_like(value[:1])  # (1, head_dim): one row for all heads
            lumina_sd[key], sd[key] = row, row.expand_as(value).clone()
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    lum = tmp_path / "lumina_layout"
    shutil.copytree(src, lum)
    save_file(lumina_sd, lum / "model.safetensors", metadata={"format": "pt"})
    a = LuminaBackbone(str(lum), resolution=LUMINA_RES, vqgan_path=str(lum / "vqgan"), device="cpu")
    b = LuminaBackbone(str(src), resolution=LUMINA_RES, vqgan_path=str(src / "vqgan"), device="cpu")
    rows = a.prompts(PROMPTS).rows(True)
    ha = a.forward_embeds(a.embed_tokens(rows.ids), torch.arange(rows.length), a.new_cache(rows))
    hb = b.forward_embeds(b.embed_tokens(rows.ids), torch.arange(rows.length), b.new_cache(rows))
    report("lumina q/k norms (1, head_dim) against (heads, head_dim)", ha, hb)
    assert torch.equal(a.decoder.layers[0].self_attn.q_norm.weight[3], lumina_sd["model.layers.0.self_attn.q_norm.weight"][0])
    key = "model.layers.0.self_attn.q_norm.weight"
    lumina_sd[key] = torch.ones(3, lumina_sd[key].shape[1])  # 3 rows cannot be spread over 4 heads
    save_file(lumina_sd, lum / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_norm.weight: \(3, 16\) in model.safetensors, the config implies \(4, 16\)"):
        LuminaBackbone(str(lum), resolution=LUMINA_RES, vqgan_path=str(lum / "vqgan"), device="cpu")


def test_lumina_vqgan_path_is_checked_at_load(tmp_path):
    path = build_tiny("lumina_mgpt", tmp_path / "lumina", side=SIDE)
    with pytest.raises(FileNotFoundError, match=r"vqgan.yaml and vqgan.ckpt in '.*nowhere'.*generator.vqgan_path"):
        LuminaBackbone(str(path), resolution=LUMINA_RES, vqgan_path=str(tmp_path / "nowhere"), device="cpu")
