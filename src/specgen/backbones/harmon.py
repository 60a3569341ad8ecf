"""Harmon (Wu et al. 2025, wusize/Harmon): a Qwen2.5 language model between the encoder and the decoder of a
MAR, text-to-image, behind the continuous protocol.

One generation step (Harmon's `forward_mae_encoder` + MAR's decoder): the MAR encoder runs on the known
tokens with `fake_latent` in every buffer slot; its output goes through `proj_in` (MLP) into the language
model after the prompt's tokens (image tokens first, the buffer moved to the end; position ids count the
attended tokens only); the last hidden states of those positions come back through `proj_out` and are added
to the encoder output (a residual), which the MAR decoder turns into per-token conditions of the DiffLoss
head (MAR's: 100 DDPM steps, epsilon guidance). The unconditional branch is the prompt
"Generate an image." in the same chat template; a prompt p is asked as "Generate an image: p.".

Parameter names are the release's: `llm.model.*` / `llm.lm_head.*` (transformers' Qwen2ForCausalLM),
`mar.*` (MAR's layout), `proj_in.{0,2}.*`, `proj_out.{0,2}.*`. Sizes: Harmon-0.5B = Qwen2.5-0.5B-Instruct
+ MAR-B (DiffLoss 1024 x 6), Harmon-1.5B = Qwen2.5-1.5B-Instruct + MAR-H (1536 x 12). Sampling (Harmon's
script): 64 generation steps, CFG 3.0 constant, temperature 1.0, 512-pixel images (32x32 tokens, MAR's
position embeddings resized bilinearly from 16x16 as Harmon does). The language model runs on the whole
prompt at every step (no KV cache across steps: rows of several known sets share one call).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from specgen.backbones.loading import file_id
from specgen.backbones.mar_release import PRESETS, build_mar_release, check_state_dict, read_checkpoint
from specgen.tokenizers.kl16 import load_kl16

QWEN_CHAT = "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"
SIZES = {"0.5b": "base", "1.5b": "huge"}  # Harmon size -> its MAR


def _mlp(d_in: int, width: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, width), nn.SiLU(), nn.Linear(width, d_out))


class Harmon(nn.Module):
    def __init__(self, llm_config: Qwen2Config, mar_sizes: tuple[int, ...], tokenizer, grid_size: int = 16,
                 token_dim: int = 16, buffer_size: int = 64, sample_steps: int = 100, num_classes: int = 1000,
                 template: str = QWEN_CHAT, prompt_format: str = "Generate an image: {}.",
                 cfg_prompt: str = "Generate an image."):
        super().__init__()
        self.llm = Qwen2ForCausalLM(llm_config)
        self.mar = build_mar_release(sizes=mar_sizes, num_classes=num_classes, buffer_size=buffer_size,
                                     grid_size=grid_size, token_dim=token_dim, sample_steps=sample_steps)
        H, D = llm_config.hidden_size, mar_sizes[0]
        self.proj_in, self.proj_out = _mlp(D, H, H), _mlp(H, H, D)
        self.tokenizer, self.template = tokenizer, template
        self.prompt_format, self.cfg_prompt = prompt_format, cfg_prompt
        self.seq_len, self.token_dim = self.mar.seq_len, self.mar.token_dim

    # ---- the continuous protocol (backbones.continuous) -------------------------------------------
    @property
    def num_steps(self) -> int:
        return self.mar.num_steps

    @property
    def device(self) -> torch.device:
        return self.mar.device

    def prompts(self, prompts: list[str]) -> list[str]:
        bad = [p for p in prompts if not isinstance(p, str) or not p.strip()]
        if bad:
            raise ValueError(f"Harmon takes text prompts, got {bad[0]!r}")
        return list(prompts)

    def _tokens(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer([self.template.format(input=t) for t in texts], padding=True, return_tensors="pt")
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device).bool()  # right-padded

    def conditioning(self, prompts: list[str], guided: bool) -> dict:
        cond = self._tokens([self.prompt_format.format(p.strip()) for p in prompts])
        return {"cond": cond, "null": self._tokens([self.cfg_prompt] * len(prompts)) if guided else None}

    def plan(self, rngs, num_iter: int):
        return self.mar.plan(rngs, num_iter)

    def step_conditions(self, tokens, unknown, conditioning, image=None):
        """Per-token conditions (N, L, D): one MAR encoder/decoder pass per branch with the language model between."""
        def branch(ids, amask):
            if image is not None:
                ids, amask = ids[image], amask[image]
            emb = self.llm.get_input_embeddings()(ids)  # (N, P, H)
            null = self.mar.null_condition(tokens.shape[0])  # fake_latent in every buffer slot
            return self.mar.conditions(tokens, unknown, null, between=lambda x, valid: self._residual(x, valid, emb,
                                                                                                    amask))
        null = conditioning["null"]
        return branch(*conditioning["cond"]), (None if null is None else branch(*null))

    def _residual(self, x: torch.Tensor, valid, emb: torch.Tensor, amask: torch.Tensor) -> torch.Tensor:
        """x (N, n, D) MAR encoder output (buffer first) -> x + proj_out(LLM(prompt, proj_in(x)))."""
        b, n = self.mar.buffer_size, x.shape[1]
        z = self.proj_in(x)
        z = torch.cat([z[:, b:], z[:, :b]], dim=1)  # Harmon: image tokens first, the buffer at the end
        v = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if valid is None else valid
        v = torch.cat([v[:, b:], v[:, :b]], dim=1)
        mask = torch.cat([amask, v], dim=1)  # (N, P + n): prompt padding and padded rows are not attended
        pos = (mask.long().cumsum(1) - 1).clamp_min(0)
        h = self.llm.model(inputs_embeds=torch.cat([emb, z.to(emb.dtype)], 1), attention_mask=mask.long(),
                           position_ids=pos).last_hidden_state[:, -n:]
        h = torch.cat([h[:, -b:], h[:, :-b]], dim=1)  # the buffer back in front
        return x + self.proj_out(h).to(x.dtype)

    def transition(self, x, i, z_cond, z_uncond, scale, tail: int = 0):
        return self.mar.transition(x, i, z_cond, z_uncond, scale, tail)

    def final_std(self) -> float:
        return self.mar.final_std()

    def check_draft(self, draft) -> None:
        if (draft.seq_len, draft.token_dim) != (self.seq_len, self.token_dim):
            raise ValueError(f"draft tokens ({draft.seq_len} of dim {draft.token_dim}) differ from the target's "
                             f"({self.seq_len} of dim {self.token_dim}): give both the same grid_size")

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mar.decode(tokens)


def _resize_positions(sd: dict, buffer: int, grid: int) -> dict:
    """MAR's learned position embeddings (16x16 in the release) resized bilinearly to grid x grid, as Harmon
    does for other image sizes; the buffer's embeddings are kept."""
    out = dict(sd)
    for key, has_buffer in (("mar.encoder_pos_embed_learned", True), ("mar.decoder_pos_embed_learned", True),
                            ("mar.diffusion_pos_embed_learned", False)):
        if key not in sd:
            continue
        pe = sd[key]
        head, image = (pe[:, :buffer], pe[:, buffer:]) if has_buffer else (pe[:, :0], pe)
        g = int(round(image.shape[1] ** 0.5))
        if g == grid:
            continue
        img = image.reshape(1, g, g, -1).permute(0, 3, 1, 2)  # (1, D, g, g)
        img = F.interpolate(img.float(), size=(grid, grid), mode="bilinear").permute(0, 2, 3, 1).reshape(1, grid * grid,
                                                                                                       -1)
        out[key] = torch.cat([head, img.to(pe.dtype)], dim=1)
    return out


def load_harmon(folder: str, weights: str | None = None, size: str = "1.5b", mar_sizes: tuple[int, ...] | None = None,
                vae_path: str | None = None, grid_size: int = 32, sample_steps: int = 100, buffer_size: int = 64,
                token_dim: int = 16, num_classes: int = 1000, allow_pickle: bool = False, device: str = "cpu",
                vae: dict | None = None) -> Harmon:
    """Harmon from a local folder: the Qwen2.5 config and tokenizer files, and the release's weights file
    (`weights`, a name in the folder or a path; None: the release's name for `size`, harmon_0.5b.pth or
    harmon_1.5b.pth); the KL-16 decoder attached when `vae_path` is given."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no Qwen2 config.json in {str(folder)!r}: give a local folder with the language "
                                f"model's config and tokenizer (e.g. Qwen2.5-1.5B-Instruct's) and Harmon's weights")
    if mar_sizes is None and size not in SIZES:
        raise ValueError(f"unknown Harmon size {size!r}: expected one of {sorted(SIZES)} (or explicit mar_sizes)")
    config = Qwen2Config.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, padding_side="right")
    model = Harmon(config, tuple(mar_sizes) if mar_sizes is not None else PRESETS[SIZES[size]], tokenizer, grid_size,
                   token_dim, buffer_size, sample_steps, num_classes)
    weights = weights or f"harmon_{size}.pth"  # wusize/harmon's file names
    path = Path(weights) if Path(weights).is_absolute() else folder / weights
    if not path.is_file():
        found = sorted(p.name for p in folder.glob("*.pth")) or "no .pth file"
        raise FileNotFoundError(f"no Harmon weights at {str(path)!r} (in the folder: {found}): put the release's "
                                f"harmon_{size}.pth there, or name the file with generator.weights (the draft's: "
                                f"mar_pair.draft.weights)")
    sd = read_checkpoint(path, None, allow_pickle)
    sd = _resize_positions(sd.get("state_dict", sd), buffer_size, grid_size)
    tied = getattr(config, "tie_word_embeddings", False)
    if tied and "llm.lm_head.weight" not in sd and "llm.model.embed_tokens.weight" in sd:
        sd["llm.lm_head.weight"] = sd["llm.model.embed_tokens.weight"]  # tied: the release may store it once
    what = f"mar_sizes={tuple(mar_sizes)}" if mar_sizes is not None else f"size={size!r}"
    check_state_dict(model, sd, str(path), f"the file is not a Harmon of {what} with the folder's Qwen2 config: "
                     f"set generator.size to 0.5b or 1.5b and use the matching Qwen2.5 folder")
    model.load_state_dict(sd)  # the MAR's head samples as MAR's (x0 not clipped: build_mar_release)
    model = model.to(device).eval().requires_grad_(False)
    ids = [file_id(path)]
    if vae_path is not None:
        model.mar.attach_tokenizer(load_kl16(vae_path, device, **{"image_size": 16 * grid_size, **(vae or {})}))
        ids.append(file_id(vae_path))
    model.identity = "-".join(ids)
    return model
