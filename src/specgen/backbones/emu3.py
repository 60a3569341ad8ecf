"""Emu3-Gen (transformers' `Emu3ForConditionalGeneration`, e.g. BAAI/Emu3-Gen-hf) behind the discrete protocol.

Layout: `<bos> prompt + positive suffix <|image start|> H*W <|image token|>`, then H rows of W visual tokens each
followed by an end-of-line token (`<|extra_200|>`, row stride W + 1), then end-of-frame (`<|extra_201|>`),
`<|image end|>` and end-of-sequence. The whole sequence must fit the model's 9216 positions (90 x 91 image slots
plus the prompt). Visual codes 0..32767 are the vocabulary's `<|visual token NNNNNN|>` entries (the model's
vocabulary map). CFG runs the negative prompt as the unconditional branch.

Settings of Emu3's own generation example (baaivision/Emu3, `image_generation.py`, and transformers' Emu3 docs):
720 x 720 pixels (image_area 518400, 8x downsampling: 90 x 90 codes), CFG 3.0, top-k 2048, temperature 1.0,
the positive suffix and the negative prompt below.
"""
from __future__ import annotations

import torch
from transformers import AutoTokenizer, Emu3ForConditionalGeneration

from specgen.backbones.hf import (HFDiscreteBackbone, check_folder, folder_identity, recorded_side,
                                 resolve_device_dtype)
from specgen.backbones.protocol import Prompts, TokenGrid

POSITIVE_PROMPT = " masterpiece, film grained, best quality."  # appended to every prompt in Emu3's example
NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, "
                   "worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, username, "
                   "blurry.")  # the unconditional branch of Emu3's example
SPECIALS = {"boi": "<|image start|>", "image": "<|image token|>", "eol": "<|extra_200|>", "eof": "<|extra_201|>",
            "eoi": "<|image end|>"}


class Emu3Backbone(HFDiscreteBackbone):
    size_key = "generator.tokens_per_side"  # what shrinks the grid (the teacher stage's estimate names it)

    def __init__(self, weights_path: str, tokens_per_side: int | None = None, positive_prompt: str = POSITIVE_PROMPT,
                 negative_prompt: str = NEGATIVE_PROMPT, device: str = "auto", dtype: str = "auto",
                 cfg_scale: float = 3.0, top_k: int | None = 2048, temperature: float = 1.0):
        path = check_folder(weights_path, "Emu3-Gen")
        tokens_per_side = tokens_per_side or recorded_side(path) or 90  # 90: 720 px, Emu3's example
        dev, dt = resolve_device_dtype(device, dtype)
        model = Emu3ForConditionalGeneration.from_pretrained(path, dtype=dt, attn_implementation="sdpa").to(dev)
        self.__dict__["tokenizer"] = AutoTokenizer.from_pretrained(path)
        vocab = model.config.vocabulary_map
        missing = [t for t in SPECIALS.values() if t not in vocab]
        if missing:
            raise ValueError(f"the vocabulary map of {str(path)!r} lacks {missing}: not an Emu3-Gen checkpoint")
        mapping = model.model.vocabulary_mapping
        V = model.config.vq_config.codebook_size
        self.specials = {k: vocab[t] for k, t in SPECIALS.items()}
        grid = TokenGrid(height=tokens_per_side, width=tokens_per_side, prefix_len=0, visual_start=0, num_visual=V,
                         eol_id=self.specials["eol"], eoi_id=self.specials["eof"])
        text = model.model.text_model
        super().__init__(model, text, model.config.text_config, grid, folder_identity(path),
                         max_positions=model.config.text_config.max_position_embeddings)
        # the model's own generation recipe, read by decoding configs as ${generator.cfg_scale} etc.
        self.recipe = {"cfg_scale": cfg_scale, "top_k": top_k, "temperature": temperature}
        self.set_visual_ids(torch.tensor([mapping.img2bpe[k] for k in range(V)]), model.lm_head.weight)
        self.positive_prompt, self.negative_prompt = positive_prompt, negative_prompt
        self.tail = (self.specials["eof"], self.specials["eoi"], model.config.text_config.eos_token_id)

    def _encode(self, text: str) -> tuple[int, ...]:
        g, tok = self.grid, self.tokenizer
        bos = tok.bos_token_id if tok.bos_token_id is not None else self.model.config.text_config.bos_token_id
        size = tok.encode(f"{g.height}*{g.width}", add_special_tokens=False)
        return (bos, *tok.encode(text, add_special_tokens=False), self.specials["boi"], *size, self.specials["image"])

    def prompts(self, texts: list[str]) -> Prompts:
        """Each prompt with the positive suffix; the negative prompt as its unconditional branch."""
        cond = tuple(self._encode(t + self.positive_prompt) for t in texts)
        uncond = (self._encode(self.negative_prompt),) * len(texts)
        pad = self.tokenizer.pad_token_id
        pad = self.model.config.text_config.pad_token_id if pad is None else pad
        return Prompts(tuple(texts), cond, uncond, pad, self.device)

    def image_sequence(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes (B, H, W) -> the image part as Emu3 writes it (B, H*(W+1) + 3): rows with end-of-line, then
        end-of-frame, end-of-image and end-of-sequence."""
        ids = self.visual_ids[codes]
        ids = torch.cat([ids, torch.full_like(ids[:, :, :1], self.specials["eol"])], 2).flatten(1)
        return torch.cat([ids, torch.tensor(self.tail, device=ids.device).expand(len(ids), -1)], 1)

    def code_embeddings(self) -> torch.Tensor:
        """Emu3's VQ codebook (num_visual, d): the latent space of `acceptance=latent`."""
        return self.model.model.vqmodel.quantize.embedding.weight

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes (B, H, W) -> images (B, 3, 8H, 8W) in [0, 1] through Emu3's VQ decoder."""
        images = self.model.model.vqmodel.decode(codes)  # [-1, 1]
        return ((images.float() + 1) / 2).clamp(0, 1)
