"""Randomly initialised models of the real backbones' transformers classes, saved like a downloaded checkpoint.

`tiny` folders (a few layers, a small vocabulary and grid, a word-level tokenizer holding every special token the
adapters look up) let the adapters, the decoders and the two real-backbone commands run on CPU without weights;
`text_config(kind, "7b")` gives the released 7B/8B decoders' shapes for timing on a GPU (no weights needed).

    python -m specgen.backbones.random_models emu3 runs/emu3_tiny   # also lumina_mgpt, janus_pro
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import (ChameleonConfig, ChameleonForConditionalGeneration, Emu3Config, Emu3ForConditionalGeneration,
                          JanusConfig, JanusForConditionalGeneration, PreTrainedTokenizerFast)

from specgen.backbones.chameleon_vqgan import ChameleonVQGANDecoder
from specgen.world.prompts import WORDS

KINDS = ("emu3", "lumina_mgpt", "janus_pro")
# the released decoders' shapes (config.json of BAAI/Emu3-Gen-hf, Alpha-VLLM/Lumina-mGPT-7B-768 and
# deepseek-community/Janus-Pro-7B): width, layers, heads, kv heads, ffn, vocabulary
SHAPES_7B = {"emu3": (4096, 32, 32, 8, 14336, 184622), "lumina_mgpt": (4096, 32, 32, 32, 11008, 65536),
             "janus_pro": (4096, 30, 32, 32, 11008, 102400)}
PROMPT_WORDS = ("generate an image of according to the following prompt masterpiece film grained best quality lowres "
                "bad anatomy hands text error missing fingers extra digit fewer digits cropped worst low normal jpeg artifacts "
                "signature watermark username blurry")  # words of the adapters' templates and of Emu3's negative prompt
BASE = ["<pad>", "<s>", "</s>", "<unk>"] + [str(i) for i in range(100)] + ["*", ",", ".", ":", "x", "\n"]


def _tokenizer(specials: list[str], extra_vocab: dict[str, int] | None = None, named: dict[str, str] | None = None,
               bos: bool = True) -> tuple[PreTrainedTokenizerFast, dict]:
    """A word-level tokenizer: base tokens, the world's words and `specials` (kept whole), ids in that order, then
    `extra_vocab` at given ids (visual tokens the model's vocabulary map names). `named`: special tokens the model's
    transformers processor reads as tokenizer attributes (`boi_token`, `image_token`, ...); `bos`: whether encoding
    adds a BOS (Janus' and Chameleon's tokenizers do, Emu3's does not: its processor adds it)."""
    vocab = {}
    words = set(WORDS) | set(PROMPT_WORDS.split())
    for t in BASE + sorted(words - set(BASE)):
        vocab.setdefault(t, len(vocab))
    for t in specials:
        vocab.setdefault(t, len(vocab))
    for t, i in (extra_vocab or {}).items():
        vocab[t] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=specials,
                                   extra_special_tokens=named or {})
    fast.add_special_tokens({"additional_special_tokens": specials})
    return fast, vocab


def _emu3(out: Path, side: int):
    specials = ["<|image start|>", "<|image token|>", "<|extra_200|>", "<|extra_201|>", "<|image end|>", "<image>"]
    V = 32
    first = 400  # visual tokens after the text vocabulary
    visual = {"<|visual token %06d|>" % k: first + k for k in range(V)}
    named = {"image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
             "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"}  # what Emu3Processor reads
    tok, vocab = _tokenizer(specials, visual, named, bos=False)
    cfg = Emu3Config(
        vq_config=dict(codebook_size=V, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1, 1],
                       num_res_blocks=1, attn_resolutions=[], hidden_size=32, num_attention_heads=1),
        text_config=dict(vocab_size=first + V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                         pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"]),
        vocabulary_map=vocab)
    return Emu3ForConditionalGeneration(cfg), tok


def _lumina(out: Path, side: int):
    n = side // 2  # size tokens count 32-pixel patches: two codes each
    specials = ["<reserved08706>", "<racm3:break>", "<eoss>", "<reserved08799>", f"<reserved{8800 + n:05d}>", "<image>"]
    V = 32
    first = 400
    visual = {"IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(k)) + "Z": first + k for k in range(V)}
    tok, vocab = _tokenizer(specials, visual)
    cfg = ChameleonConfig(vocab_size=first + V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.2,
                          pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"],
                          vq_config=dict(embed_dim=8, num_embeddings=V, latent_channels=8, base_channels=32,
                                         channel_multiplier=[1, 1], num_res_blocks=1, resolution=16,
                                         attn_resolutions=[]),
                          vocabulary_map=vocab)
    write_tiny_vqgan(out / "vqgan", V)
    return ChameleonForConditionalGeneration(cfg), tok


def write_tiny_vqgan(folder: Path, codes: int = 32, seed: int = 0) -> ChameleonVQGANDecoder:
    """A random Chameleon VQGAN in Meta's release format (vqgan.yaml + a Lightning-style vqgan.ckpt with encoder and
    loss weights beside the decoder's): 16x upsampling as released, at 32 base channels."""
    folder.mkdir(parents=True, exist_ok=True)
    dd = {"double_z": False, "z_channels": 16, "resolution": 64, "in_channels": 3, "out_ch": 3, "ch": 32,
          "ch_mult": [1, 1, 1, 1, 2], "num_res_blocks": 1, "attn_resolutions": [8], "dropout": 0.0}
    params = {"embed_dim": 8, "n_embed": codes, "ddconfig": dd}
    (folder / "vqgan.yaml").write_text(yaml.safe_dump({"model": {"target": "taming.models.vqgan.VQModel",
                                                                 "params": params}}))
    torch.manual_seed(seed)
    net = ChameleonVQGANDecoder(**params)
    state = {**net.state_dict(), "encoder.conv_in.weight": torch.zeros(1), "quant_conv.weight": torch.zeros(1),
             "loss.discriminator.main.0.weight": torch.zeros(1)}
    torch.save({"state_dict": state, "global_step": 0}, folder / "vqgan.ckpt")
    return net


def _janus(out: Path, side: int):
    specials = ["<|User|>", "<|Assistant|>", "<begin_of_image>", "<end_of_image>", "<image_placeholder>"]
    named = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"}
    tok, vocab = _tokenizer(specials, named=named)  # the names JanusProcessor reads
    D, V = 64, 32
    cfg = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=len(vocab), hidden_size=D, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.2,
                         pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"]),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16 * side, patch_size=16,
                           projection_dim=D, num_image_tokens=side * side),  # generate() makes this many codes
        vq_config=dict(embed_dim=8, num_embeddings=V, latent_channels=16, base_channels=32, channel_multiplier=[1, 1],
                       num_res_blocks=1, num_patches=side, projection_dim=D, image_token_embed_dim=D),
        image_token_id=vocab["<image_placeholder>"])
    return JanusForConditionalGeneration(cfg), tok


BUILDERS = {"emu3": _emu3, "lumina_mgpt": _lumina, "janus_pro": _janus}


def build_tiny(kind: str, out: str | Path, side: int = 4, seed: int = 0, sharpen: float = 1.0) -> Path:
    """Save a tiny random `kind` model (and tokenizer; Lumina: a VQGAN under vqgan/) to `out`; a `side` x `side` grid.
    `sharpen` scales the image head, so that greedy images of a random model vary across positions (tests)."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown model kind {kind!r}: expected one of {KINDS}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model, tok = BUILDERS[kind](out, side)
    head = model.model.generation_head.vision_head if kind == "janus_pro" else model.lm_head
    with torch.no_grad():
        head.weight.mul_(sharpen)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "specgen_tiny.json").write_text(json.dumps({"kind": kind, "side": side, "seed": seed}) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Save a tiny random model of a real backbone's class to a folder.")
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("out")
    ap.add_argument("--side", type=int, default=4, help="codes per image side")
    ap.add_argument("--sharpen", type=float, default=3.0, help="scale of the image head (varied greedy images)")
    args = ap.parse_args(argv)
    print(build_tiny(args.kind, args.out, args.side, sharpen=args.sharpen))


if __name__ == "__main__":
    main()
