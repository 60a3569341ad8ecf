"""The discrete protocol over a transformers decoder, shared by the real adapters (Emu3, Lumina-mGPT, Janus-Pro).

An adapter gives the decoder (any transformers base model with a final RMSNorm, taking `inputs_embeds`), how visual
codes are embedded and scored, its token grid and its prompts; this class does the rest once: the final norm split
off (pre-norm states), padding-aware caches (left-padded prompt rows: padding masked out of every query's keys,
position ids counting real tokens only), explicit slots with the decoders' own 4-D masks, rollback.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn as nn
from transformers import DynamicCache

from specgen.backbones.prenorm import split_final_norm
from specgen.backbones.protocol import PromptRows, TokenGrid, float_logits


def folder_identity(path: str | Path) -> str:
    """Identity of a transformers folder: a hash of its config and of its weights (the files' bytes when they are
    small, else the weight index and the files' sizes: hashing 16 GB at every start would take minutes)."""
    path = Path(path)
    h = hashlib.sha1((path / "config.json").read_bytes())
    files = sorted(path.glob("*.safetensors"))
    if sum(f.stat().st_size for f in files) <= 256 * 2 ** 20:
        for f in files:
            h.update(f.read_bytes())
    else:
        for f in sorted(path.glob("*.safetensors.index.json")):
            h.update(f.read_bytes())
        h.update(json.dumps([(f.name, f.stat().st_size) for f in files]).encode())
    return h.hexdigest()[:16]


def recorded_side(path: Path) -> int | None:
    """Codes per image side that a folder records for itself: the tiny random folders of `random_models` write it
    (specgen_tiny.json), so that their default grid is theirs, not the release's; None for a downloaded model."""
    marker = Path(path) / "specgen_tiny.json"
    return int(json.loads(marker.read_text())["side"]) if marker.is_file() else None


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """'auto': a GPU when there is one, bf16 on a GPU and fp32 on CPU."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in names:
        raise ValueError(f"generator.dtype={dtype!r}: expected 'auto' or one of {sorted(names)}")
    return dev, names[dtype]


def check_folder(path: str | Path, what: str) -> Path:
    """A local model folder, or an error that names it and says what belongs there."""
    if path in (None, "", "???"):
        raise ValueError(f"generator.weights_path is not set: give the local folder of the {what} weights "
                         f"(e.g. generator.weights_path=/data/weights/<model>)")
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"no {what} checkpoint at {str(p)!r} (no config.json there): download the "
                                f"transformers-format weights to that folder, or fix generator.weights_path")
    return p


class PaddedCache:
    """A transformers DynamicCache for one batch of prompt rows (their padding travels with it)."""

    def __init__(self, rows: PromptRows, config):
        self.rows, self.kv = rows, DynamicCache(config=config)

    def get_seq_length(self) -> int:
        return self.kv.get_seq_length()


class HFDiscreteBackbone(nn.Module):
    """A frozen transformers decoder behind the discrete protocol; subclasses set the grid, prompts and heads."""

    def __init__(self, model: nn.Module, decoder: nn.Module, text_config, grid: TokenGrid, identity: str,
                 max_positions: int | None = None):
        super().__init__()
        self.model, self.text_config, self.grid, self.identity = model, text_config, grid, identity
        self.__dict__["decoder"] = decoder  # a submodule of `model`: registered once, under it
        self.final_norm = split_final_norm(decoder)
        self.hidden_size = text_config.hidden_size
        self.max_positions = max_positions
        self.requires_grad_(False)
        self.eval()  # attention dropout is 0.1 in some released configs (Emu3): keep the frozen model in eval()

    @property
    def device(self) -> torch.device:
        return self.final_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.weight.dtype

    def check_length(self, prompt_len: int) -> None:
        """The whole sequence (prompt, grid, end tokens) must fit the model's positions."""
        need = self.grid.at(prompt_len).seq_len
        if self.max_positions is not None and need > self.max_positions:
            raise ValueError(f"a prompt of {prompt_len} tokens and a {self.grid.height}x{self.grid.width} grid need "
                             f"{need} positions but the model has {self.max_positions}: shorten the prompt or "
                             f"lower the resolution (generator.tokens_per_side)")

    def new_cache(self, rows: PromptRows, static: bool = False) -> PaddedCache:
        """A cache for these prompt rows (`static` is ignored: a DynamicCache serves every decoder)."""
        self.check_length(rows.length)
        return PaddedCache(rows, self.text_config)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(ids)

    def forward_embeds(self, embeds: torch.Tensor, slots: torch.Tensor, cache: PaddedCache,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings (B', q, D) at slots (q,) or (B', q), appended to `cache` -> pre-norm states (B', q, D).
        Without `attn_mask` the tokens attend causally in cache order; padding slots are never attended to."""
        rows, past = cache.rows, cache.get_seq_length()
        B, q = embeds.shape[:2]
        if rows.padded or attn_mask is not None:
            if attn_mask is None:  # causal in feeding order (every decoder but ZipAR feeds slots in order)
                allowed = torch.arange(past + q, device=embeds.device)[None, :] <= \
                    past + torch.arange(q, device=embeds.device)[:, None]  # (q, past + q)
                attn_mask = torch.zeros(q, past + q, dtype=self.dtype, device=embeds.device)
                attn_mask = attn_mask.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None].expand(B, 1, -1, -1)
            P = min(rows.length, past + q)  # the prompt is always the first entries of the cache
            pad = torch.zeros(B, 1, 1, past + q, dtype=torch.bool, device=embeds.device)
            pad[:, 0, 0, :P] = ~rows.mask[:, :P]
            attn_mask = attn_mask.to(self.dtype).masked_fill(pad, torch.finfo(self.dtype).min)
        out = self.decoder(inputs_embeds=embeds.to(self.dtype), position_ids=rows.positions(slots),
                           attention_mask=attn_mask, cache=cache.kv, use_cache=True)
        return out.last_hidden_state

    @staticmethod
    def rollback(cache: PaddedCache, length: int) -> None:
        """Drop cached positions >= length."""
        extra = cache.get_seq_length() - length
        if extra < 0:
            raise ValueError(f"cannot roll a cache of length {cache.get_seq_length()} forward to {length}")
        if extra > 0:  # crop(0) empties the cache in some transformers versions: never call it
            cache.kv.crop(-extra)

    def set_visual_ids(self, ids: torch.Tensor, head_weight: torch.Tensor) -> None:
        """Record the vocabulary ids of visual codes 0..V-1 (a buffer: it follows the module's device) and the output
        projection whose rows at those ids score them (a slice when the ids are contiguous: no copy)."""
        self.register_buffer("visual_ids", ids.to(head_weight.device), persistent=False)
        contiguous = bool((ids[1:] - ids[:-1] == 1).all())
        self.__dict__["_head_span"] = (int(ids[0]), len(ids)) if contiguous else None
        self.__dict__["_head_weight"] = head_weight

    @property
    def visual_head(self) -> torch.Tensor:
        """(V, D) rows of the output projection that score the visual codes."""
        w = self._head_weight
        return w[self._head_span[0]: self._head_span[0] + self._head_span[1]] if self._head_span else w[self.visual_ids]

    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, then the output rows of the visual codes only (not the whole vocabulary)."""
        return float_logits(torch.nn.functional.linear(self.final_norm(hidden.to(self.dtype)), self.visual_head))

    def guided_visual_logits(self, hidden: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        """Guided logits from stacked [cond; uncond] states (2B, ..., D), mixed after the final norm and before the
        (linear) projection: `guide(visual_logits(hidden), cfg_scale)` with half the projection. A subclass whose
        visual head is not one linear map sets this to None (`protocol.guided_logits` then guides the logits)."""
        cond, uncond = self.final_norm(hidden.to(self.dtype)).float().chunk(2, dim=0)
        return float_logits(torch.nn.functional.linear(torch.lerp(uncond, cond, cfg_scale).to(self.dtype),
                                                       self.visual_head))

    def embed_visual(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(self.visual_ids[codes])
