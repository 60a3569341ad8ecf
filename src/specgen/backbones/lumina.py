"""Lumina-mGPT (Chameleon-format checkpoints, transformers' `ChameleonForConditionalGeneration`, e.g.
Alpha-VLLM/Lumina-mGPT-7B-768) behind the discrete protocol.

Layout: `<bos>Generate an image of SxS according to the following prompt:\\n<prompt><reserved08706>` then the image
header `<racm3:break>` (begin-of-image) and two size tokens `<reserved{8800 + n}>` (n = height and width in 32-pixel
patches), then S/16 rows of S/16 visual tokens each followed by `<reserved08799>` (new line, stride W + 1), then
`<eoss>` (end of image). Visual codes 0..8191 are the vocabulary's `IMGIMG...` entries. The unconditional branch
sees the image header alone (Lumina's CFG processor starts it at begin-of-image). Chameleon's `forward` sets image
logits to -inf (it is a text model there): the head is applied here to the decoder's own output. Pixels come from
Chameleon's VQGAN decoder (`chameleon_vqgan`, a user path in Meta's release format).

Settings of Lumina-mGPT's inference code (`lumina_mgpt/inference_solver.py`, the README's generation example):
768 x 768 pixels (48 x 48 codes), CFG 4.0, image top-k 2000, temperature 1.0.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, ChameleonConfig, ChameleonForConditionalGeneration

from specgen.backbones.chameleon_vqgan import ChameleonVQGANDecoder
from specgen.backbones.hf import (HFDiscreteBackbone, check_folder, folder_identity, recorded_side,
                                 resolve_device_dtype)
from specgen.backbones.protocol import Prompts, TokenGrid

TEMPLATE = "Generate an image of {size}x{size} according to the following prompt:\n{prompt}"
SEP, BOI, EOI, NEWLINE = "<reserved08706>", "<racm3:break>", "<eoss>", "<reserved08799>"
PATCH = 32  # pixels per size-token unit (two 16-pixel codes)
log = logging.getLogger(__name__)


def size_token(n_patches: int) -> str:
    return f"<reserved{8800 + n_patches:05d}>"


def _qk_norm_fixes(path: Path, config) -> dict[str, torch.Tensor]:
    """q/k-norm parameters stored in Lumina-mGPT's own layout, (model_parallel_size, head_dim) (its vendored
    `ChameleonLayerNorm` repeats each row over the heads of its shard: (1, 128) in the 7B releases), as transformers'
    (heads, head_dim) layout: each row repeated over its heads. Reads the files' headers and these small tensors only;
    any other shape mismatch is an error that names the key."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in ChameleonForConditionalGeneration(config).state_dict().items()}
    fixes, bad = {}, []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                shape = tuple(f.get_slice(key).get_shape())
                want = expected.get(key)
                if want is None or shape == want:
                    continue
                is_norm = key.endswith(("q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias"))
                if is_norm and len(shape) == 2 and shape[1] == want[1] and want[0] % shape[0] == 0:
                    fixes[key] = f.get_tensor(key).repeat_interleave(want[0] // shape[0], dim=0)
                else:
                    bad.append(f"{key}: {shape} in {file.name}, the config implies {want}")
    if bad:
        raise ValueError(f"the weights at {str(path)!r} do not fit its config.json ({len(bad)} tensors; first: "
                         f"{bad[0]}): a Chameleon-format checkpoint of another size, or a damaged download")
    return fixes


def load_chameleon(path: Path, dtype: torch.dtype) -> ChameleonForConditionalGeneration:
    """transformers' Chameleon class from a folder, q/k norms in Lumina-mGPT's layout repeated on load."""
    fixes = _qk_norm_fixes(path, ChameleonConfig.from_pretrained(path))
    model = ChameleonForConditionalGeneration.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                              ignore_mismatched_sizes=bool(fixes))
    if fixes:  # the only mismatches (checked above): written back in transformers' layout
        log.info("%s: %d q/k-norm tensors in Lumina-mGPT's (model_parallel_size, head_dim) layout, repeated per head",
                 path, len(fixes))
        with torch.no_grad():
            for key, value in fixes.items():
                model.get_parameter(key).copy_(value)
    return model


class LuminaBackbone(HFDiscreteBackbone):
    size_key = "generator.resolution"  # what shrinks the grid (the teacher stage's estimate names it)

    def __init__(self, weights_path: str, resolution: int | None = None, vqgan_path: str | None = None,
                 device: str = "auto", dtype: str = "auto", template: str = TEMPLATE,
                 cfg_scale: float = 4.0, top_k: int | None = 2000, temperature: float = 1.0):
        path = check_folder(weights_path, "Lumina-mGPT (Chameleon format)")
        resolution = resolution or 16 * (recorded_side(path) or 48)  # 48 x 48 codes: the 7B-768 release
        if resolution % PATCH:
            raise ValueError(f"generator.resolution={resolution}: Lumina-mGPT sizes images in {PATCH}-pixel patches")
        dev, dt = resolve_device_dtype(device, dtype)
        model = load_chameleon(path, dt).to(dev)
        self.__dict__["tokenizer"] = tok = AutoTokenizer.from_pretrained(path)
        vocab = tok.get_vocab()
        n = resolution // PATCH
        need = [SEP, BOI, EOI, NEWLINE, size_token(n)]
        missing = [t for t in need if t not in vocab]
        if missing:
            raise ValueError(f"the tokenizer at {str(path)!r} lacks {missing}: not a Lumina-mGPT checkpoint")
        self.specials = {t: vocab[t] for t in need}
        mapping = model.model.vocabulary_mapping
        V = len(mapping.image_tokens)
        side = resolution // 16
        grid = TokenGrid(height=side, width=side, prefix_len=0, visual_start=0, num_visual=V,
                         eol_id=vocab[NEWLINE], eoi_id=vocab[EOI])
        super().__init__(model, model.model, model.config, grid, folder_identity(path),
                         max_positions=model.config.max_position_embeddings)
        # the model's own generation recipe, read by decoding configs as ${generator.cfg_scale} etc.
        self.recipe = {"cfg_scale": cfg_scale, "top_k": top_k, "temperature": temperature}
        self.set_visual_ids(torch.tensor([mapping.img2bpe[k] for k in range(V)]), model.lm_head.weight)
        self.header = (vocab[BOI], vocab[size_token(n)], vocab[size_token(n)])
        self.resolution, self.template, self.vqgan_path = resolution, template, vqgan_path
        self.__dict__["vqgan"] = None  # a user path, kept out of this module's weights
        if vqgan_path:  # checked and loaded now: a wrong path fails here, not after the first batch of samples
            self._load_vqgan("decoding Lumina-mGPT codes to pixels")
        else:
            log.warning("generator.vqgan_path is not set: Lumina-mGPT codes cannot be decoded to pixels (give the "
                        "folder with Chameleon's vqgan.yaml and vqgan.ckpt)")

    def prompts(self, texts: list[str]) -> Prompts:
        tok = self.tokenizer
        cond = tuple((*tok.encode(self.template.format(size=self.resolution, prompt=t)), self.specials[SEP],
                      *self.header) for t in texts)
        pad = tok.pad_token_id if tok.pad_token_id is not None else self.model.config.pad_token_id
        return Prompts(tuple(texts), cond, (self.header,) * len(texts), pad if pad is not None else 1, self.device)

    def _load_vqgan(self, purpose: str) -> ChameleonVQGANDecoder:
        if self.vqgan is None:
            if not self.vqgan_path:
                raise ValueError(f"{purpose} needs Chameleon's VQGAN: set generator.vqgan_path=<folder with "
                                 f"vqgan.yaml and vqgan.ckpt> (Meta's release, tokenizer/)")
            self.__dict__["vqgan"] = ChameleonVQGANDecoder.from_release(self.vqgan_path, self.device)
        return self.vqgan

    def code_embeddings(self) -> torch.Tensor:
        """Chameleon's VQGAN codebook (num_visual, d): the latent space of `acceptance=latent`."""
        return self._load_vqgan("acceptance=latent (code neighbours)").quantize.embedding.weight

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes (B, H, W) -> images (B, 3, 16H, 16W) in [0, 1] through Chameleon's VQGAN decoder."""
        images = self._load_vqgan("decoding Lumina-mGPT codes to pixels")(codes.to(self.device))  # [-1, 1]
        return ((images.float() + 1) / 2).clamp(0, 1)
