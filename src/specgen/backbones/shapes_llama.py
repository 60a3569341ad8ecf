"""The embedded text-to-image backbone: a Llama (transformers) over one vocabulary of prompt words,
special tokens and VQ codes, like the unified models Emu3 and Lumina-mGPT, on a raster token grid.

Vocabulary: [specials | prompt words | visual codes]. Sequence: the prompt slot (prompt words
left-padded to a fixed length, so every image token has a fixed position), BOI, the grid in raster
order (optionally an end-of-row token after each row), EOI. The unconditional prompt (for CFG) is
an all-PAD slot, also seen in training through prompt dropout.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from specgen.backbones.prenorm import split_final_norm
from specgen.backbones.protocol import Prompts, PromptRows, TokenGrid, float_logits
from specgen.backbones.ragged_cache import ATTENTION, RaggedCache
from specgen.world.prompts import WORDS, tokenize_words

SPECIALS = ("<pad>", "<boi>", "<eoi>", "<eol>")
PAD, BOI, EOI, EOL = range(len(SPECIALS))

PRESETS = {  # name -> (layers, width, heads, ffn)
    "tiny": (2, 64, 4, 128),
    "small": (4, 192, 6, 512),
    "base": (6, 256, 8, 704),
}


class ShapesLlama(nn.Module):
    def __init__(self, num_codes: int = 512, grid_size: int = 16, eol: bool = True, max_prompt_len: int = 40,
                 preset: str | None = "base", num_layers: int | None = None, width: int | None = None,
                 num_heads: int | None = None, ffn: int | None = None, rope_theta: float = 10000.0):
        super().__init__()
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)} or null with explicit sizes")
        layers, d, heads, f = PRESETS[preset] if preset else (num_layers, width, num_heads, ffn)
        layers, d, heads, f = num_layers or layers, width or d, num_heads or heads, ffn or f
        self.words = {w: i + len(SPECIALS) for i, w in enumerate(WORDS)}
        self.max_prompt_len = max_prompt_len
        visual_start = len(SPECIALS) + len(WORDS)
        self.grid = TokenGrid(height=grid_size, width=grid_size, prefix_len=max_prompt_len + 1,
                              visual_start=visual_start, num_visual=num_codes,
                              eol_id=EOL if eol else None, eoi_id=EOI)
        self.config = LlamaConfig(
            vocab_size=visual_start + num_codes, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=self.grid.seq_len,
            rope_theta=rope_theta, tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=PAD,
            bos_token_id=BOI, eos_token_id=EOI)
        self.model = LlamaForCausalLM(self.config)
        # Pre-norm hidden states are what SSD's f_phi predicts: the decoder's own final norm is
        # replaced by identity and applied in `head` instead (hidden_states[-1] is post-norm).
        self.final_norm = split_final_norm(self.model.model)
        self.__dict__["tokenizer"] = None  # set by attach_tokenizer; kept out of this module's weights
        self.identity = ""  # '<weights id>-<tokenizer id>', set by the loader (backbones.loading)

    # ---- prompts -------------------------------------------------------------------------------
    def prompt_ids(self, prompts: list[str]) -> torch.Tensor:
        """(B, prefix_len) conditional prompt slots: PAD..PAD words BOI."""
        out = torch.full((len(prompts), self.grid.prefix_len), PAD, dtype=torch.long)
        for b, text in enumerate(prompts):
            ids = [self.words[w] for w in tokenize_words(text)]
            if len(ids) > self.max_prompt_len:
                raise ValueError(f"prompt {text!r} has {len(ids)} words, more than max_prompt_len="
                                 f"{self.max_prompt_len}: shorten it or train a backbone with a longer slot")
            if ids:
                out[b, self.max_prompt_len - len(ids): self.max_prompt_len] = torch.tensor(ids)
        out[:, -1] = BOI
        return out.to(self.device)

    def null_prompt_ids(self, batch: int) -> torch.Tensor:
        """(B, prefix_len) unconditional prompt slots (all PAD, then BOI)."""
        out = torch.full((batch, self.grid.prefix_len), PAD, dtype=torch.long, device=self.device)
        out[:, -1] = BOI
        return out

    def prompts(self, texts: list[str]) -> Prompts:
        """The protocol's prompt object: every prompt fills the fixed slot, so no row is padded (PAD words inside
        the slot are tokens the model was trained to see)."""
        cond = self.prompt_ids(list(texts)).tolist()
        null = self.null_prompt_ids(1)[0].tolist()
        return Prompts(tuple(texts), tuple(map(tuple, cond)), (tuple(null),) * len(cond), PAD, self.device)

    @property
    def device(self) -> torch.device:
        return self.final_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.weight.dtype

    # ---- model ---------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits for training: (B, T) -> (B, T, V)."""
        h = self.model.model(input_ids=ids, use_cache=False).last_hidden_state  # pre-norm (B, T, D)
        return self.head(h)

    def new_cache(self, rows: PromptRows | None = None, static: bool = False) -> DynamicCache | StaticCache:
        """A KV cache (the fixed prompt slot has no padding: `rows` needs no record); `static`: preallocated to the
        whole sequence, about 3x faster per AR step at batch 128 (a DynamicCache concatenates every layer's keys
        and values at every step), but it cannot roll back."""
        if static:
            return StaticCache(config=self.config, max_cache_len=self.grid.seq_len)
        return DynamicCache(config=self.config)

    def new_ragged_cache(self, rows: int, length: int) -> RaggedCache:
        """A cache whose rows hold different lengths and roll back on their own (continuous batching; see
        `backbones.ragged_cache`): `rows` cache rows of `length` slots."""
        return RaggedCache.for_config(self.config, rows, length, self.dtype, self.device)

    def forward_hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache | None = None,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed tokens at explicit positions, appending to `cache`: (B, q) -> pre-norm hidden (B, q, D).

        `positions` is (q,) or (B, q). Without `attn_mask` the new tokens attend causally to the cache
        and to each other; a 4-D additive float mask (B, 1, q, past + q) overrides that.
        """
        if positions.ndim == 1:
            positions = positions.unsqueeze(0).expand(ids.shape[0], -1)
        out = self.model.model(input_ids=ids, position_ids=positions, cache=cache, attention_mask=attn_mask,
                               use_cache=cache is not None)
        return out.last_hidden_state

    def forward_embeds(self, embeds: torch.Tensor, slots: torch.Tensor, cache: DynamicCache | StaticCache,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The protocol's forward: input embeddings (B, q, D) at slots (q,) or (B, q) -> pre-norm hidden (B, q, D).
        Slots are position ids here (the prompt slot is never padded). Several tokens fed after a cached prefix
        without a mask attend causally by cache index, as transformers' own mask has them; that mask is built here in
        three ops (transformers' builds it in about twenty: a speculative decoder feeds such blocks every pass)."""
        q = embeds.shape[1]
        if attn_mask is None and q > 1 and isinstance(cache, DynamicCache) and cache.get_seq_length() > 0:
            past = cache.get_seq_length()
            attn_mask = torch.ones(1, 1, q, past + q, dtype=torch.bool, device=embeds.device).tril(past)
        if slots.ndim == 1:
            slots = slots.unsqueeze(0).expand(embeds.shape[0], -1)
        out = self.model.model(inputs_embeds=embeds, position_ids=slots, cache=cache, attention_mask=attn_mask,
                               use_cache=cache is not None)
        return out.last_hidden_state

    def forward_packed(self, embeds: torch.Tensor, positions: torch.Tensor, cache: RaggedCache,
                       attn_mask: torch.Tensor) -> torch.Tensor:
        """A packed forward over a `RaggedCache` fed with `pack` (`ragged_cache`): the real tokens' embeddings (N, D)
        at positions (N,), the padded grid's mask (R, 1, q, keys) -> pre-norm hidden (N, D). The projections and
        MLPs see only the N tokens; attention is the padded forward's."""
        if cache.pack is None:
            raise ValueError("forward_packed needs a RaggedCache fed with pack= (the tokens' places in the grid)")
        if self.config._attn_implementation != ATTENTION:  # transformers' SDPA where no pack is given
            self.config._attn_implementation = ATTENTION
        out = self.model.model(inputs_embeds=embeds[None], position_ids=positions[None], cache=cache,
                               attention_mask=attn_mask, use_cache=True, ragged_pack=cache.pack)
        return out.last_hidden_state[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token ids: (...,) -> (..., D)."""
        return self.model.model.embed_tokens(ids)

    embed_tokens = embed

    def embed_visual(self, codes: torch.Tensor) -> torch.Tensor:
        """Input embeddings of visual codes: (...,) -> (..., D)."""
        return self.embed(codes + self.grid.visual_start)

    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm states (..., D) -> logits over the visual codes (..., num_visual): the final norm, then only the
        output rows of the visual codes (a contiguous slice of the projection, not the whole vocabulary)."""
        return float_logits(torch.nn.functional.linear(self.final_norm.weight * self._unit_norm(hidden),
                                                       self._visual_rows()))

    def guided_visual_logits(self, hidden: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        """Classifier-free guidance from stacked [cond; uncond] pre-norm states (2B, ..., D) -> guided logits
        (B, ..., num_visual), equal to `guide(visual_logits(hidden), cfg_scale)`: the head is linear after the norm,
        so the two rows are mixed before the projection (half of it; drafting calls this per drafted column)."""
        cond, uncond = self._unit_norm(hidden).chunk(2, dim=0)
        return float_logits(torch.nn.functional.linear(self.final_norm.weight * torch.lerp(uncond, cond, cfg_scale),
                                                       self._visual_rows()))

    def _unit_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMS norm without its weight, in one fused call, in float32, back in the states' dtype."""
        eps = self.final_norm.variance_epsilon
        if hidden.dtype == torch.float32:  # no casts to dispatch (drafting calls this once per drafted column)
            return torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), None, eps)
        return torch.nn.functional.rms_norm(hidden.float(), (hidden.shape[-1],), None, eps).to(hidden.dtype)

    def _visual_rows(self) -> torch.Tensor:
        """The head's rows of the visual codes, a view kept while the weight is the same tensor at the same version
        (drafting reads it once per drafted column: a slice each time is an op to dispatch)."""
        g, w = self.grid, self.model.lm_head.weight
        if w.is_inference():  # weights made under inference mode keep no version counter: a fresh view each time
            return w[g.visual_start: g.visual_start + g.num_visual]
        key = (w.data_ptr(), w._version, w.dtype, w.device, torch.is_inference_mode_enabled(),
               torch.is_grad_enabled())
        cached = self.__dict__.get("_visual_rows_view")
        if cached is None or cached[0] != key:
            cached = (key, w[g.visual_start: g.visual_start + g.num_visual])
            self.__dict__["_visual_rows_view"] = cached
        return cached[1]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + output projection: (..., D) -> (..., V) logits."""
        return self.model.lm_head(self.final_norm(hidden))

    @staticmethod
    def rollback(cache: DynamicCache, length: int) -> None:
        """Drop cached positions >= length."""
        extra = cache.get_seq_length() - length
        if extra < 0:
            raise ValueError(f"cannot roll a cache of length {cache.get_seq_length()} forward to {length}")
        if extra > 0:  # crop(0) empties the cache in some transformers versions: never call it
            cache.crop(-extra)

    # ---- pixels --------------------------------------------------------------------------------
    def attach_tokenizer(self, tokenizer: nn.Module) -> "ShapesLlama":
        """Attach the VQ tokenizer used by `decode` (not registered: it stays out of the state dict)."""
        if tokenizer.num_codes != self.grid.num_visual:
            raise ValueError(f"tokenizer has {tokenizer.num_codes} codes but the backbone expects "
                             f"{self.grid.num_visual}: load the tokenizer the backbone was trained with")
        self.__dict__["tokenizer"] = tokenizer
        return self

    def code_embeddings(self) -> torch.Tensor:
        """The attached tokenizer's codebook (num_visual, d): the latent space of acceptance `Latent`."""
        if self.tokenizer is None:
            raise RuntimeError("no tokenizer attached: call backbone.attach_tokenizer(load_exported(<vq folder>))")
        return self.tokenizer.quantizer.codebook

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Visual codes (B, H, W) -> images (B, 3, S, S) in [0, 1] through the attached tokenizer."""
        if self.tokenizer is None:
            raise RuntimeError("no tokenizer attached: call backbone.attach_tokenizer(load_exported(<vq folder>))")
        return self.tokenizer.decode(codes)
