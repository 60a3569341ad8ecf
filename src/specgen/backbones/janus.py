"""Janus-Pro (transformers' `JanusForConditionalGeneration`, e.g. deepseek-community/Janus-Pro-7B) behind the
discrete protocol.

Layout: `<bos><|User|>: prompt\\n\\n<|Assistant|>:<begin_of_image>`, then 24 x 24 visual codes in raster order with
no row tokens (stride W). Image codes have their own embedding (`generation_embeddings` + `generation_aligner`) and
head (`generation_head`, on the decoder's normed state), apart from the text vocabulary. The unconditional prompt is
the conditional one with every token but the first and the last (begin-of-image) replaced by padding, so both
branches have the same length.

Settings of Janus-Pro's own generation example (deepseek-ai/Janus, `generation_inference.py`) and of transformers'
`JanusForConditionalGeneration.generate`: 384 x 384 pixels (16x downsampling: 24 x 24 = 576 codes), CFG 5,
temperature 1, no top-k. The grid is the config's: vision_config.image_size / patch_size codes a side (transformers
sizes the VQ decoder's grid, vq_config.num_patches, from them), checked against vision_config.num_image_tokens (the
codes its generate() makes); `tokens_per_side` overrides it (a smaller grid for a smoke run; the VQ decoder is
convolutional and decodes any grid, but the release was trained at 24 x 24 only).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, JanusForConditionalGeneration

from specgen.backbones.hf import HFDiscreteBackbone, check_folder, folder_identity, resolve_device_dtype
from specgen.backbones.protocol import Prompts, TokenGrid, float_logits
from specgen.utils.validate import expect_int

TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"  # the 'deepseek' SFT format with an empty system prompt
BOI = "<begin_of_image>"


def grid_side(config, path, tokens_per_side: int | None = None) -> int:
    """Codes per image side: the override, else the config's image_size / patch_size, which must give the
    vision_config.num_image_tokens codes that transformers' generate() makes."""
    vision = config.vision_config
    if tokens_per_side is not None:
        expect_int("generator.tokens_per_side", tokens_per_side, 1)
        return tokens_per_side
    side, n_gen = vision.image_size // vision.patch_size, vision.num_image_tokens
    if side * side != n_gen:
        raise ValueError(f"the Janus config at {str(path)!r} is inconsistent: vision_config.image_size / patch_size "
                         f"= {vision.image_size} / {vision.patch_size} gives a {side}x{side} = {side * side} codes "
                         f"grid (the VQ decoder's) but vision_config.num_image_tokens is {n_gen} (the codes its "
                         f"generate() makes): fix one of them in config.json (Janus-Pro: 384 / 16 = 24, 576 codes), "
                         f"or choose the grid with generator.tokens_per_side=<codes a side>")
    return side


class JanusBackbone(HFDiscreteBackbone):
    size_key = "generator.tokens_per_side"  # what shrinks the grid (the teacher stage's estimate names it)

    def __init__(self, weights_path: str, tokens_per_side: int | None = None, device: str = "auto",
                 dtype: str = "auto", template: str = TEMPLATE, cfg_scale: float = 5.0, top_k: int | None = None,
                 temperature: float = 1.0):
        path = check_folder(weights_path, "Janus-Pro")
        dev, dt = resolve_device_dtype(device, dtype)
        model = JanusForConditionalGeneration.from_pretrained(path, dtype=dt, attn_implementation="sdpa").to(dev)
        self.__dict__["tokenizer"] = tok = AutoTokenizer.from_pretrained(path)
        boi = tok.convert_tokens_to_ids(BOI)
        if boi is None or boi == tok.unk_token_id:
            raise ValueError(f"the tokenizer at {str(path)!r} has no {BOI!r} token: not a Janus checkpoint")
        side = grid_side(model.config, path, tokens_per_side)
        grid = TokenGrid(height=side, width=side, prefix_len=0, visual_start=0,
                         num_visual=model.config.vq_config.num_embeddings)
        text = model.model.language_model
        super().__init__(model, text, model.config.text_config, grid, folder_identity(path),
                         max_positions=model.config.text_config.max_position_embeddings)
        # the model's own generation recipe, read by decoding configs as ${generator.cfg_scale} etc.
        self.recipe = {"cfg_scale": cfg_scale, "top_k": top_k, "temperature": temperature}
        self.boi, self.template = boi, template

    def prompts(self, texts: list[str]) -> Prompts:
        tok = self.tokenizer
        cond = tuple((*tok.encode(self.template.format(prompt=t)), self.boi) for t in texts)
        pad = tok.pad_token_id if tok.pad_token_id is not None else self.model.config.text_config.pad_token_id
        uncond = tuple((c[0], *([pad] * (len(c) - 2)), c[-1]) for c in cond)  # padded, the same length
        return Prompts(tuple(texts), cond, uncond, pad, self.device)

    def embed_visual(self, codes: torch.Tensor) -> torch.Tensor:
        m = self.model.model
        return m.generation_aligner(m.generation_embeddings(codes))

    guided_visual_logits = None  # its generation head is not linear: guidance mixes its logits

    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, then the separate generation head."""
        return float_logits(self.model.model.generation_head(self.final_norm(hidden.to(self.dtype))))

    def code_embeddings(self) -> torch.Tensor:
        """Janus's VQ codebook (num_visual, d): the latent space of `acceptance=latent`."""
        return self.model.model.vqmodel.quantize.embedding.weight

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes (B, 24, 24) -> images (B, 3, 384, 384) in [0, 1] through Janus's VQ decoder (`decode` at the
        config's grid; at another grid the same steps: l2-normed code vectors, post-quant conv, decoder)."""
        vq = self.model.model.vqmodel
        if tuple(codes.shape[1:]) == tuple(vq.quantize.quant_state_dims):
            images = vq.decode(codes.flatten(1))  # [-1, 1]
        else:
            latent = F.normalize(vq.quantize.embedding(codes), p=2, dim=-1).permute(0, 3, 1, 2).contiguous()
            images = vq.decoder(vq.post_quant_conv(latent))
        return ((images.float() + 1) / 2).clamp(0, 1)
