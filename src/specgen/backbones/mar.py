"""MAR-style continuous backbone: a bidirectional MAE encoder/decoder (timm `Block`) over latent
tokens in a random generation order, conditioned on the prompt (or a class), with a per-token
diffusion head. Module names follow MAR's release so that its `model_ema` weights load by name.

forward (training): patchify -> order -> mask (truncated-normal ratio, min 0.7) -> encode the
visible tokens with the condition buffer -> decode with mask tokens -> diffusion loss on masked tokens.
Sampling is `specgen.decoding.mar`'s job; the model implements `backbones.continuous.ContinuousBackbone`
(`conditioning`, `plan`: random order and cosine schedule, `step_conditions`: one masked-AR step's per-token
diffusion conditions, `transition`: the head's guided DDPM step) over `condition`, `conditions` and `denoise`.
"""
from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch
import torch.nn as nn
from scipy import stats
from timm.models.vision_transformer import Block

from specgen.backbones.continuous import attach_decoder, class_ids, cosine_schedule, random_ranks
from specgen.backbones.diffusion import DenoiserMLP, GaussianDiffusion

PRESETS = {  # name -> (width, encoder depth, decoder depth, heads, head width, head depth)
    "tiny": (64, 1, 1, 4, 64, 2),
    "small": (192, 3, 3, 6, 192, 3),
    "base": (256, 4, 4, 8, 256, 3),
    "quarter": (96, 2, 2, 4, 128, 3),  # a CSpD draft at about 1/4 of "small" (0.84M vs 3.5M with 2x2 patches)
}


class ShapesMAR(nn.Module):
    def __init__(self, grid_size: int = 16, token_dim: int = 4, preset: str = "base", cond: str = "prompt",
                 num_classes: int = 1000, buffer_size: int = 40, mlp_ratio: float = 4.0, mask_ratio_min: float = 0.7,
                 label_drop_prob: float = 0.1, diffusion_batch_mul: int = 4, train_steps: int = 1000,
                 sample_steps: int = 100, variance: str = "learned_range", attn_dropout: float = 0.0,
                 proj_dropout: float = 0.0, sizes: tuple[int, int, int, int, int, int] | None = None,
                 patch_size: int = 1, mask_ratio_dist: str = "truncnorm", min_snr_gamma: float | None = None,
                 x0_clip: float | None = 10.0):
        super().__init__()
        if patch_size < 1 or grid_size % patch_size:
            raise ValueError(f"patch_size={patch_size} must be >= 1 and divide grid_size={grid_size} "
                             f"(e.g. patch_size=1 or 2 for a {grid_size}x{grid_size} latent)")
        if sizes is None and preset not in PRESETS:
            raise ValueError(f"unknown MAR preset {preset!r}: expected one of {sorted(PRESETS)}")
        if mask_ratio_dist not in ("truncnorm", "cosine"):
            raise ValueError(f"mask_ratio_dist must be 'truncnorm' (MAR) or 'cosine' (MaskGIT), got {mask_ratio_dist!r}")
        if min_snr_gamma is not None and not min_snr_gamma > 0:
            raise ValueError(f"min_snr_gamma must be a positive number (5 in Min-SNR) or null for MAR's unweighted "
                             f"loss, got {min_snr_gamma!r}")
        if not 0.0 <= mask_ratio_min <= 1.0:
            raise ValueError(f"mask_ratio_min must lie in [0, 1], got {mask_ratio_min}")
        if cond not in ("prompt", "class"):
            raise ValueError(f"cond must be 'prompt' or 'class', got {cond!r}")
        D, enc, dec, heads, hw, hd = sizes or PRESETS[preset]  # width, depths, heads, head width/depth
        # the tokenizer's latent layout, and the model's tokens: p x p latent patches (MAR's patchify)
        self.latent_grid, self.latent_dim, self.patch_size = grid_size, token_dim, patch_size
        self.grid_size, self.token_dim = grid_size // patch_size, token_dim * patch_size ** 2
        self.seq_len = self.grid_size ** 2
        token_dim = self.token_dim
        self.cond, self.buffer_size, self.label_drop_prob = cond, buffer_size, label_drop_prob
        self.diffusion_batch_mul = diffusion_batch_mul
        self.mask_ratio_min, self.mask_ratio_dist = mask_ratio_min, mask_ratio_dist
        self.min_snr_gamma = min_snr_gamma
        self.mask_ratio_generator = stats.truncnorm((mask_ratio_min - 1.0) / 0.25, 0, loc=1.0, scale=0.25)
        if cond == "prompt":
            from specgen.world.prompts import WORDS

            self.words = {w: i + 1 for i, w in enumerate(WORDS)}  # 0 = padding
            self.class_emb = nn.Embedding(len(WORDS) + 1, D)  # prompt words fill the buffer, one per slot
        else:
            self.class_emb = nn.Embedding(num_classes, D)  # MAR: one class embedding in every buffer slot
        self.fake_latent = nn.Parameter(torch.zeros(1, D))  # the unconditional condition (CFG)
        norm = partial(nn.LayerNorm, eps=1e-6)
        self.z_proj = nn.Linear(token_dim, D)
        self.z_proj_ln = nn.LayerNorm(D, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + buffer_size, D))
        self.encoder_blocks = nn.ModuleList([Block(D, heads, mlp_ratio, qkv_bias=True, norm_layer=norm,
                                                   proj_drop=proj_dropout, attn_drop=attn_dropout) for _ in range(enc)])
        self.encoder_norm = norm(D)
        self.decoder_embed = nn.Linear(D, D)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, D))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + buffer_size, D))
        self.decoder_blocks = nn.ModuleList([Block(D, heads, mlp_ratio, qkv_bias=True, norm_layer=norm,
                                                   proj_drop=proj_dropout, attn_drop=attn_dropout) for _ in range(dec)])
        self.decoder_norm = norm(D)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len, D))
        self._init_weights()
        self.diffloss = nn.Module()
        self.diffloss.net = DenoiserMLP(token_dim, D, hw, hd, learn_sigma=variance == "learned_range")
        self.diffusion = GaussianDiffusion(train_steps, sample_steps, "cosine", variance, x0_clip)  # None: MAR's

    def _init_weights(self):
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    # ---- the generator interface of the evaluation runner ---------------------------------------
    @property
    def device(self) -> torch.device:
        return self.fake_latent.device

    @property
    def num_steps(self) -> int:
        return self.diffusion.sample_steps

    def prompts(self, prompts: list[str]) -> list:
        """Continuous decoders take the prompts themselves (validated here, conditioned later); class
        prompts are class ids ('207' or 207)."""
        if self.cond == "class":
            return class_ids(prompts, self.class_emb.num_embeddings)
        self.condition(prompts)
        return list(prompts)

    def attach_tokenizer(self, tokenizer: nn.Module) -> "ShapesMAR":
        """Attach the KL tokenizer used by `decode` (kept out of the state dict)."""
        return attach_decoder(self, tokenizer, "load the tokenizer the backbone was trained with")

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Latent tokens (B, L, d) -> images (B, 3, S, S) in [0, 1]."""
        if self.__dict__.get("tokenizer") is None:
            raise RuntimeError("no tokenizer attached: call backbone.attach_tokenizer(load_exported(<kl folder>))")
        return self.tokenizer.decode(self.unpatchify(tokens))

    def check_draft(self, draft: "ShapesMAR") -> None:
        """A draft must work on this model's tokens: same count, dimension and latent patching."""
        mine, its = (self.seq_len, self.token_dim, self.patch_size), (draft.seq_len, draft.token_dim, draft.patch_size)
        if mine != its:
            raise ValueError(f"draft tokens ({its[0]} tokens of dim {its[1]}, patch {its[2]}) differ from the "
                             f"target's ({mine[0]} of dim {mine[1]}, patch {mine[2]}): train the draft on the "
                             f"target's tokenizer and backbone.patch_size")

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """Tokenizer latents (B, G*G, d), raster order -> model tokens (B, (G/p)^2, d*p*p), raster order."""
        p, G, d = self.patch_size, self.latent_grid, self.latent_dim
        if latents.shape[1:] != (G * G, d):
            raise ValueError(f"expected latents of shape (B, {G * G}, {d}), got {tuple(latents.shape)}")
        if p == 1:
            return latents
        g = G // p
        x = latents.reshape(-1, g, p, g, p, d).permute(0, 1, 3, 5, 2, 4)  # (B, g, g, d, p, p) as MAR
        return x.reshape(-1, g * g, d * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Inverse of `patchify`: model tokens (B, L, d*p*p) -> latents (B, G*G, d)."""
        p, g, d = self.patch_size, self.grid_size, self.latent_dim
        if p == 1:
            return tokens
        x = tokens.reshape(-1, g, g, d, p, p).permute(0, 1, 4, 2, 5, 3)  # (B, g, p, g, p, d)
        return x.reshape(-1, g * p * g * p, d)

    # ---- conditions ----------------------------------------------------------------------------
    def condition(self, prompts: list[str] | torch.Tensor) -> torch.Tensor:
        """Buffer embeddings (B, buffer, D): prompt words left-padded into the slots, or a class label."""
        if self.cond == "class":
            if not isinstance(prompts, torch.Tensor):
                prompts = class_ids(prompts, self.class_emb.num_embeddings)
            return self.class_emb(torch.as_tensor(prompts, device=self.fake_latent.device))[:, None].expand(
                -1, self.buffer_size, -1)
        from specgen.world.prompts import tokenize_words

        ids = torch.zeros(len(prompts), self.buffer_size, dtype=torch.long, device=self.fake_latent.device)
        for b, text in enumerate(prompts):
            w = [self.words[x] for x in tokenize_words(text)]
            if len(w) > self.buffer_size:
                raise ValueError(f"prompt {text!r} has {len(w)} words, more than buffer_size={self.buffer_size}")
            if w:
                ids[b, self.buffer_size - len(w):] = torch.tensor(w)
        return self.class_emb(ids)

    def null_condition(self, batch: int) -> torch.Tensor:
        return self.fake_latent[None].expand(batch, self.buffer_size, -1)

    # ---- one masked step: per-token conditions -------------------------------------------------
    def conditions(self, tokens: torch.Tensor, mask: torch.Tensor, cond: torch.Tensor,
                   num_known: int | None = None, between=None) -> torch.Tensor:
        """tokens (B, L, d), mask (B, L) with 1 = unknown, cond (B, buffer, D) -> diffusion conditions (B, L, D).

        The encoder sees the buffer and the known tokens only (MAR drops the others). Rows may know different
        numbers of tokens: they are then padded to the longest row and the padding is hidden from attention,
        so one call serves several masked steps at once (CSpD's verification). `num_known` (known tokens per
        row, all rows alike), when the caller knows it, spares a device-to-host sync. `between(x, valid)` maps the
        encoder's output (B, n, D) (valid (B, n) bool, or None when no row is padded) before the decoder
        (Harmon: plus the language model's residual)."""
        B, L, _ = tokens.shape
        x = torch.cat([cond, self.z_proj(tokens)], dim=1) + self.encoder_pos_embed_learned  # (B, buffer+L, D)
        x = self.z_proj_ln(x)
        keep = torch.cat([torch.ones(B, self.buffer_size, device=x.device, dtype=torch.bool), mask < 0.5], dim=1)
        attn_mask = valid = None
        if num_known is None:
            counts = keep.sum(1)
            if bool((counts == counts[0]).all()):
                num_known = int(counts[0]) - self.buffer_size
        if num_known is not None:
            x = x[keep].view(B, self.buffer_size + num_known, -1)
        else:  # ragged rows: gather each row's kept slots to the front, pad, mask the padding out
            n = int(counts.max())
            slot = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :n]  # kept slots first, in order
            valid = torch.arange(n, device=x.device)[None] < counts[:, None]
            x = torch.gather(x, 1, slot[..., None].expand(-1, -1, x.shape[-1]))
            attn_mask = valid[:, None, None, :]  # (B, 1, 1, n): every query sees the valid keys only
        for blk in self.encoder_blocks:
            x = blk(x, attn_mask=attn_mask)
        x = self.encoder_norm(x)
        if between is not None:
            x = between(x, valid)
        x = self.decoder_embed(x)
        full = self.mask_token.expand(B, self.buffer_size + L, -1).clone()
        if attn_mask is None:
            full[keep] = x.reshape(-1, x.shape[-1]).to(full.dtype)  # autocast may have run the encoder in bf16
        else:
            full[keep] = x[valid].to(full.dtype)  # row-major order of `valid` matches that of `keep`
        x = full + self.decoder_pos_embed_learned
        for blk in self.decoder_blocks:
            x = blk(x)
        return self.decoder_norm(x)[:, self.buffer_size:] + self.diffusion_pos_embed_learned

    def denoise(self, x_t: torch.Tensor, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The diffusion head: (N, d), (N,), (N, D) -> epsilon [and v] (N, d or 2d)."""
        return self.diffloss.net(x_t, t, z)

    # ---- the continuous protocol (backbones.continuous) -------------------------------------------
    def conditioning(self, prompts: list, guided: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(condition buffer (B, buffer, D), the null buffer when guided, else None)."""
        return self.condition(prompts), (self.null_condition(len(prompts)) if guided else None)

    def plan(self, rngs, num_iter: int) -> tuple[torch.Tensor, list[int]]:
        """MAR's: a random order per image (from its generator) and the cosine schedule."""
        return random_ranks(rngs, self.seq_len, self.device), cosine_schedule(self.seq_len, num_iter)

    def step_conditions(self, tokens: torch.Tensor, unknown: torch.Tensor, conditioning,
                        image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token conditions (N, L, D) of both branches from one encoder/decoder call (rows stacked)."""
        cond, null = conditioning
        if image is not None:
            cond, null = cond[image], (None if null is None else null[image])
        if null is None:
            return self.conditions(tokens, unknown, cond), None
        z = self.conditions(torch.cat([tokens, tokens]), torch.cat([unknown, unknown]), torch.cat([cond, null]))
        return z.chunk(2)

    def transition(self, x: torch.Tensor, i, z_cond: torch.Tensor, z_uncond: torch.Tensor | None, scale,
                   tail: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's guided DDPM step: CFG on epsilon (MAR's), the variance channel of the conditional row."""
        diff, d = self.diffusion, self.token_dim
        if isinstance(i, torch.Tensor):
            t = diff.timesteps.to(x.device)[i.to(x.device)]
        else:
            t = torch.full((x.shape[0],), int(diff.timesteps[i]), device=x.device)
        if z_uncond is None or (not isinstance(scale, torch.Tensor) and scale == 1.0):
            out = self.denoise(x, t, z_cond)
        else:
            both = self.denoise(torch.cat([x, x]), torch.cat([t, t]), torch.cat([z_cond, z_uncond]))
            c, u = both.chunk(2)  # (N, d or 2d) each
            s = scale[:, None] if isinstance(scale, torch.Tensor) else scale
            out = torch.cat([u[:, :d] + s * (c[:, :d] - u[:, :d]), c[:, d:]], dim=-1)
        return diff.step_mean_var(out, x, i, tail)

    def final_std(self) -> float:
        return self.diffusion.final_std()

    # ---- training --------------------------------------------------------------------------------
    def mask_ratio(self) -> float:
        """One training mask ratio in [mask_ratio_min, 1]: MAR's truncated normal (mean about 0.86 for the
        default minimum 0.7), or MaskGIT's cos(pi/2 u), u ~ U(0, 1), clipped below at the minimum (mean 0.64
        for minimum 0), which trains on the well-known contexts of the late sampling steps as often."""
        if self.mask_ratio_dist == "cosine":
            return max(self.mask_ratio_min, math.cos(math.pi / 2 * float(np.random.uniform())))
        return float(self.mask_ratio_generator.rvs(1)[0])

    def random_mask(self, B: int, device) -> tuple[torch.Tensor, int]:
        """(B, L) masks of a random order each (1 = unknown), one shared mask ratio (`mask_ratio`), and the
        number of known tokens per row (for `conditions`). At least one token is masked."""
        n = min(self.seq_len, max(1, int(np.ceil(self.seq_len * self.mask_ratio()))))
        order = torch.argsort(torch.rand(B, self.seq_len, device=device), dim=1)
        mask = torch.zeros(B, self.seq_len, device=device).scatter(1, order[:, :n], 1.0)
        return mask, self.seq_len - n

    def forward(self, latents: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Diffusion loss on masked tokens: tokenizer latents (B, G*G, d) (patchified here), cond (B, buffer, D)."""
        tokens = self.patchify(latents)
        B = tokens.shape[0]
        if self.training and self.label_drop_prob > 0:
            drop = (torch.rand(B, 1, 1, device=tokens.device) < self.label_drop_prob).to(cond.dtype)
            cond = drop * self.null_condition(B) + (1 - drop) * cond
        mask, known = self.random_mask(B, tokens.device)
        z = self.conditions(tokens, mask, cond, known)
        m = self.diffusion_batch_mul
        target = tokens.reshape(B * self.seq_len, -1).repeat(m, 1)
        z = z.reshape(B * self.seq_len, -1).repeat(m, 1)
        w = mask.reshape(-1).repeat(m)
        loss = self.diffusion_loss(target, z)
        return (loss * w).sum() / w.sum()

    def diffusion_loss(self, x0: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Per-token epsilon MSE, plus the variational bound on the learned variance (mean detached).

        With `min_snr_gamma` the MSE of timestep t is weighted by min(SNR_t, gamma) / SNR_t (Min-SNR,
        Hang et al. 2023). An epsilon error is sqrt(SNR_t) times the x0 error it implies, so MAR's unweighted
        loss is SNR_t times an x0 loss: the nearly clean timesteps (SNR in the thousands at t < 10, where
        epsilon is all but unpredictable) dominate its gradient, and the noisy timesteps where layout, shape
        and colour are decided hardly count. The weighting caps that at gamma times the x0 loss. Sampling and
        the Gaussian transitions CSpD scores are unchanged: only what training emphasises moves."""
        diff = self.diffusion
        t = torch.randint(0, diff.train_steps, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        x_t = diff.q_sample(x0, t, noise)
        out = self.denoise(x_t, t, z)
        d = x0.shape[-1]
        loss = (out[:, :d] - noise).pow(2).mean(-1)
        if self.min_snr_gamma is not None:
            loss = loss * self.min_snr_weight(t)
        if out.shape[-1] == 2 * d:
            loss = loss + diff.vlb_term(out[:, :d].detach(), out[:, d:], x0, x_t, t)
        return loss

    def min_snr_weight(self, t: torch.Tensor) -> torch.Tensor:
        """min(SNR_t, gamma) / SNR_t per timestep (float32, on t's device); SNR_t = a_t / (1 - a_t)."""
        snr = self.diffusion.snr(t)
        return (snr.clamp(max=self.min_snr_gamma) / snr).float()

