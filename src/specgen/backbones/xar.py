"""xAR (Ren et al. 2025, "Beyond Next-Token: Next-X Prediction", OliverRensu/xAR): class-conditional next-cell
flow matching over KL-16 latents, behind the continuous protocol, with the release's parameter names.

The model: a 16x16 latent grid (16 channels, MAR's KL-16) split into cells of 8x8 tokens (4 cells, raster
order; tokens inside a cell in raster order). The transformer itself is the flow network: an encoder and a
decoder of adaLN blocks (RMSNorm without weights, attention with 2-D RoPE, timm's SwiGLU module built with its
block's default GELU, i.e. a GELU-gated MLP of width 8/3 D; per-token modulation from class embedding + time
embedding of the token's cell) under a block-causal mask (a cell sees itself and the cells before it), and a
linear head that predicts the velocity v = noise - x0 of the linear path x_t = (1 - t) x0 + t noise. Training
noises every cell at its own time ("noisy context learning"); sampling generates one cell after the other with
the earlier cells clean (time 0) as context, class 1000 (`num_classes`) as the unconditional branch.

Behind the protocol a "token" is a whole cell (the next-X unit): `seq_len` = cells, `token_dim` = 8 x 8 x 16,
`plan` = cells in raster order, one per generation step (`num_iter` must equal the cell count).
`step_conditions` does no network work: a cell's condition is (class id, cell index, whether every earlier
cell is known, the known earlier cells), and `transition` runs the transformer on context + noisy cell at every
flow step (so `*_head_evals` count xAR's network evaluations). The release instead caches the context's keys
and values across the flow steps of a cell; the numbers are the same, the context is recomputed here.

Sampler (the release's `sample_tokens` -> `euler_maruyama_sampler`, models/sampler.py): the reverse SDE
dx = [v - w(t)/2 s(x, t)] dt + sqrt(w(t)) dW with diffusion coefficient w(t) = 2t, the score from the
velocity s = -((1 - t) v + x) / t, so the drift is (2 - t) v + x. Times: K = `sample_steps` points evenly from
1 to 0.04, then 0; K - 1 Euler-Maruyama steps, each the Gaussian N(x + dt drift, 2 t |dt|) (dt < 0), then one
deterministic step to 0 (the mean). The network sees int(1000 t) (the release truncates). CFG is applied to the
velocity (the drift is affine in v, so this equals the release's guidance of the drift). `sampler="ode"` is
the release's other sampler (`euler_sampler`, not the one it evaluates with): K Euler steps of dx = v dt on
an even grid from 1 to 0, all deterministic. The release's CFG scale rises over the cells, 1 at the first and
the full scale at the last: decoding's `cfg_schedule="linear_steps"`.

Sizes (models/xar.py, README "Evaluation"): xAR-B 768 x (8 + 8) 12 heads (172M), 40 flow steps, CFG 2.7;
xAR-L 1024 x (16 + 16) 16 heads, 50 steps, CFG 2.3; xAR-H 1280 x (20 + 20) 16 heads, 50 steps, CFG 2.2.
The release's file is a plain state dict (its eval.py loads it with `load_state_dict`), RoPE tables and the
attention mask included as buffers.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from specgen.backbones.continuous import attach_decoder, class_ids
from specgen.backbones.diffusion import TimestepEmbedder
from specgen.backbones.loading import file_id
from specgen.backbones.mar_release import check_state_dict, read_checkpoint
from specgen.tokenizers.kl16 import load_kl16

PRESETS = {"base": (768, 8, 8, 12), "large": (1024, 16, 16, 16), "huge": (1280, 20, 20, 16)}  # D, enc, dec, heads
PAPER = {"base": (40, 2.7), "large": (50, 2.3), "huge": (50, 2.2)}  # flow steps, CFG (xAR's README)
SAMPLERS = ("sde", "ode")
T_LAST = 0.04  # the SDE's last stochastic time (the release's grid ends at 0.04, then one deterministic step)


class RMSNorm(nn.Module):
    """x / rms(x) in float32 (times a weight when `weight`), as the release's."""

    def __init__(self, dim: int, weight: bool = False, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x):
        out = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return out if self.weight is None else out * self.weight


def rope_tables(head_dim: int, grid: int, unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(base frequencies, cos, sin (L, head_dim)): the first half of a head rotates by the token's row, the second
    by its column, in adjacent pairs; rows of the tables in cell order (cells raster, then tokens in a cell)."""
    quarter = head_dim // 4
    base = 1.0 / 10000 ** (torch.arange(0, head_dim // 2, 2)[:quarter].float() / (head_dim // 2))  # (hd/4,)
    pos = torch.arange(grid) / grid * grid  # the release's expression (exact for its grid of 16)
    ang = (pos[:, None] * base[None]).repeat_interleave(2, dim=-1)  # (G, hd/2)
    full = torch.cat([ang[:, None].expand(grid, grid, -1), ang[None].expand(grid, grid, -1)], -1)  # (G, G, hd)
    n = grid // unit
    full = full.reshape(n, unit, n, unit, head_dim).permute(0, 2, 1, 3, 4).reshape(grid * grid, head_dim)
    return base, full.cos(), full.sin()


def _rotate_pairs(x):
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    x = x.unflatten(-1, (-1, 2))
    return torch.stack([-x[..., 1], x[..., 0]], -1).flatten(-2)


class Rope(nn.Module):
    def __init__(self, head_dim: int, grid: int, unit: int):
        super().__init__()
        base, cos, sin = rope_tables(head_dim, grid, unit)
        self.register_buffer("freqs", base)  # the release's buffer names: they are in its state dict
        self.register_buffer("freqs_cos", cos)
        self.register_buffer("freqs_sin", sin)

    def forward(self, x):  # (n, heads, N, hd), positions 0..N-1 in cell order
        N = x.shape[2]
        return x * self.freqs_cos[:N] + _rotate_pairs(x) * self.freqs_sin[:N]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, grid: int, unit: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.rope = Rope(dim // heads, grid, unit)

    def forward(self, x, mask):
        n, N, C = x.shape
        q, k, v = self.qkv(x).reshape(n, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, attn_mask=mask)  # (n, heads, N, hd)
        return self.proj(out.transpose(1, 2).reshape(n, N, C))


class GatedMLP(nn.Module):
    """timm's SwiGLU module (names fc1_g, fc1_x, fc2) with the GELU the release's Block passes it."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1_g, self.fc1_x, self.fc2 = nn.Linear(dim, hidden), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1_g(x)) * self.fc1_x(x))


class XARBlock(nn.Module):
    def __init__(self, dim: int, heads: int, grid: int, unit: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, grid, unit)
        self.mlp = GatedMLP(dim, int(dim * mlp_ratio * 2 / 3))
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, cond, mask, unit_tokens: int):
        """x (n, m*T, D), cond (n, m, D): one condition per cell, spread over its T tokens."""
        mod = self.ada_lin(cond).repeat_interleave(unit_tokens, dim=1)  # (n, m*T, 6D)
        gamma1, gamma2, scale1, scale2, shift1, shift2 = mod.chunk(6, dim=-1)  # the release's order
        x = x + self.attn(self.norm1(x) * (1 + scale1) + shift1, mask) * gamma1
        return x + self.mlp(self.norm2(x) * (1 + scale2) + shift2) * gamma2


class XAR(nn.Module):
    def __init__(self, sizes: tuple[int, int, int, int] = PRESETS["large"], grid_size: int = 16, unit_size: int = 8,
                 token_dim: int = 16, num_classes: int = 1000, sample_steps: int = 50, sampler: str = "sde",
                 label_drop_prob: float = 0.1):
        super().__init__()
        D, enc, dec, heads = sizes
        if unit_size < 1 or grid_size % unit_size:
            raise ValueError(f"unit_size={unit_size} must divide grid_size={grid_size} (the release: 8 of 16, 4 cells)")
        if D % heads or (D // heads) % 4:
            raise ValueError(f"width {D} over {heads} heads must give a head dim divisible by 4 (2-D RoPE in pairs)")
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown xAR sampler {sampler!r}: expected one of {SAMPLERS} ('sde' is the release's)")
        if sample_steps < (2 if sampler == "sde" else 1):
            raise ValueError(f"sample_steps={sample_steps}: the SDE sampler needs at least 2 (one stochastic step)")
        self.latent_grid, self.latent_dim, self.unit_size = grid_size, token_dim, unit_size
        self.unit_tokens = unit_size ** 2
        self.seq_len = (grid_size // unit_size) ** 2  # protocol tokens: cells
        self.token_dim = self.unit_tokens * token_dim
        self.num_classes, self.label_drop_prob = num_classes, label_drop_prob
        self.num_steps, self.sampler = sample_steps, sampler
        L = grid_size ** 2
        self.class_emb = nn.Embedding(num_classes + 1, D)  # + the unconditional class
        self.time_embed = TimestepEmbedder(D)
        self.z_proj, self.z_proj_ln = nn.Linear(token_dim, D), RMSNorm(D, weight=True)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L, D))
        self.encoder_blocks = nn.ModuleList([XARBlock(D, heads, grid_size, unit_size) for _ in range(enc)])
        self.encoder_norm = RMSNorm(D, weight=True)
        self.decoder_embed = nn.Linear(D, D)
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L, D))
        self.decoder_blocks = nn.ModuleList([XARBlock(D, heads, grid_size, unit_size) for _ in range(dec)])
        self.decoder_norm = RMSNorm(D, weight=True)
        self.pred = nn.Linear(D, token_dim)
        cell = torch.arange(L) // self.unit_tokens
        self.register_buffer("mask", torch.zeros(1, 1, L, L).masked_fill(cell[None, :] > cell[:, None], -math.inf))
        grid = torch.linspace(1.0, T_LAST, sample_steps, dtype=torch.float64) if sampler == "sde" else \
            torch.linspace(1.0, 0.0, sample_steps + 1, dtype=torch.float64)[:-1]
        self._times = torch.cat([grid, torch.zeros(1, dtype=torch.float64)])  # t_K-1 ... t_0, then 0
        self._init_weights()

    def _init_weights(self):
        for p in (self.class_emb.weight, self.encoder_pos_embed_learned, self.decoder_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    # ---- the flow network ------------------------------------------------------------------------
    def flow(self, cells: torch.Tensor, times: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Velocities of cells 0..m-1 under the block-causal mask: cells (n, m, T*c), times (n, m) in [0, 1],
        labels (n,) (num_classes = unconditional) -> (n, m, T*c)."""
        n, m, _ = cells.shape
        T, N = self.unit_tokens, m * self.unit_tokens
        t_int = (times.float() * 1000).long()  # the release embeds int(1000 t), truncated
        cond = self.class_emb(labels)[:, None] + self.time_embed(t_int.flatten()).view(n, m, -1)  # (n, m, D)
        mask = self.mask[..., :N, :N]
        x = self.z_proj_ln(self.z_proj(cells.reshape(n, N, self.latent_dim)) + self.encoder_pos_embed_learned[:, :N])
        for blk in self.encoder_blocks:
            x = blk(x, cond, mask, T)
        x = self.decoder_embed(self.encoder_norm(x)) + self.decoder_pos_embed_learned[:, :N]
        for blk in self.decoder_blocks:
            x = blk(x, cond, mask, T)
        return self.pred(self.decoder_norm(x)).reshape(n, m, -1)

    def forward(self, latents: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Flow-matching loss (velocity MSE), every cell noised at its own logit-normal time, labels dropped to
        the unconditional class with `label_drop_prob`: latents (B, G*G, c) raster, labels (B,)."""
        x0 = self.cells(latents)  # (B, n, T*c)
        B, n, _ = x0.shape
        if self.training and self.label_drop_prob > 0:
            drop = torch.rand(B, device=x0.device) < self.label_drop_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        t = torch.sigmoid(torch.randn(B, n, device=x0.device))  # (B, n)
        noise = torch.randn_like(x0)
        x_t = (1 - t[..., None]) * x0 + t[..., None] * noise
        return (self.flow(x_t, t, labels) - (noise - x0)).pow(2).mean()

    def cells(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, G*G, c) in raster order -> cells (B, n_cells, T*c) (cells raster, tokens raster in a cell)."""
        G, S, c = self.latent_grid, self.unit_size, self.latent_dim
        if latents.shape[1:] != (G * G, c):
            raise ValueError(f"expected latents of shape (B, {G * G}, {c}), got {tuple(latents.shape)}")
        x = latents.reshape(-1, G // S, S, G // S, S, c).permute(0, 1, 3, 2, 4, 5)  # (B, hc, wc, p, q, c)
        return x.reshape(-1, self.seq_len, self.token_dim)

    def latents(self, cells: torch.Tensor) -> torch.Tensor:
        """Inverse of `cells`: (B, n_cells, T*c) -> (B, G*G, c) raster."""
        G, S, c = self.latent_grid, self.unit_size, self.latent_dim
        x = cells.reshape(-1, G // S, G // S, S, S, c).permute(0, 1, 3, 2, 4, 5)  # (B, hc, p, wc, q, c)
        return x.reshape(-1, G * G, c)

    # ---- the continuous protocol (backbones.continuous) -------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.pred.weight.device

    def prompts(self, prompts: list) -> list[int]:
        return class_ids(prompts, self.num_classes)

    def conditioning(self, prompts: list, guided: bool):
        """(class ids (B,), the unconditional class (B,) when guided, else None)."""
        y = torch.as_tensor(class_ids(prompts, self.num_classes), device=self.device)
        return y, (torch.full_like(y, self.num_classes) if guided else None)

    def plan(self, rngs, num_iter: int) -> tuple[torch.Tensor, list[int]]:
        """Cells in raster order, one per generation step (the same for every image)."""
        if num_iter != self.seq_len:
            raise ValueError(f"num_iter={num_iter}: xAR generates one cell per step, {self.seq_len} cells here; set "
                             f"num_iter={self.seq_len} (experiment=eval/real_continuous: mar_pair=xar_b_l sets it)")
        rank = torch.arange(self.seq_len, device=self.device).expand(len(rngs), -1)
        return rank, list(range(1, self.seq_len + 1))

    def step_conditions(self, tokens, unknown, conditioning, image=None):
        """(N, L, 3 + L*d) per cell j: [class, j, 1 if cells < j are all known, the known cells < j (others 0)]."""
        y, null = conditioning
        if image is not None:
            y, null = y[image], (None if null is None else null[image])
        N, L, d = tokens.shape
        known = unknown < 0.5  # (N, L)
        before = torch.ones(L, L, device=tokens.device).tril(-1).bool()  # before[j, k]: k < j
        ctx = tokens[:, None] * (before[None] & known[:, None])[..., None]  # (N, L, L, d): cell j's context
        complete = ~(before[None] & ~known[:, None]).any(-1)  # (N, L)
        idx = torch.arange(L, device=tokens.device, dtype=tokens.dtype).expand(N, L)
        tail = torch.cat([idx[..., None], complete[..., None].to(tokens.dtype), ctx.flatten(2)], -1)
        z = lambda labels: torch.cat([labels[:, None, None].to(tokens.dtype).expand(N, L, 1), tail], -1)
        return z(y), (None if null is None else z(null))

    def velocity(self, x: torch.Tensor, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """v for noisy cells x (N, d) at times t (N,) with conditions z (N, 3 + L*d): rows grouped by cell index."""
        if bool((z[:, 2] < 0.5).any()):
            raise ValueError("xAR's cell j needs every earlier cell known as its context, and a condition lacks one: "
                             "CSpD's verify='joint' conditions later drafted cells without the earlier drafted ones; "
                             "use verify='stepwise' (strategies.cspd.fn.verify=stepwise; mar_pair=xar_b_l sets it)")
        labels, unit = z[:, 0].long(), z[:, 1].long()
        ctx = z[:, 3:].view(len(z), self.seq_len, self.token_dim)
        out = torch.empty_like(x)
        for j in torch.unique(unit).tolist():
            rows = (unit == j).nonzero(as_tuple=True)[0]
            cells = torch.cat([ctx[rows, :j], x[rows, None]], dim=1)  # (n, j + 1, d): clean context, then x
            times = F.pad(t[rows, None], (j, 0))  # the context at time 0
            out[rows] = self.flow(cells, times, labels[rows])[:, -1].to(out.dtype)
        return out

    def transition(self, x, i, z_cond, z_uncond, scale, tail: int = 0):
        """One guided flow step from t_cur to t_next (module docstring): (mean, var), var 0 on the last step,
        on the ODE sampler and on steps 1..`tail` (made Euler steps of the probability-flow ODE)."""
        N = x.shape[0]
        i = torch.as_tensor(i, device=x.device).expand(N) if not isinstance(i, torch.Tensor) else i.to(x.device)
        k = self.num_steps - 1 - i  # position on the time grid
        times = self._times.to(x.device)
        t_cur, t_next = times[k], times[k + 1]  # float64 (N,)
        t = t_cur.to(x.dtype)
        if z_uncond is None or (not isinstance(scale, torch.Tensor) and scale == 1.0):
            v = self.velocity(x, t, z_cond)
        else:
            c, u = self.velocity(torch.cat([x, x]), torch.cat([t, t]), torch.cat([z_cond, z_uncond])).chunk(2)
            s = scale[:, None] if isinstance(scale, torch.Tensor) else scale
            v = u + s * (c - u)
        dt = (t_next - t_cur).to(x.dtype)[:, None]
        if self.sampler == "ode":
            return x + dt * v, torch.zeros_like(x)
        sde = (i >= 1) & (i > tail)  # stochastic steps
        drift = torch.where(sde[:, None] | (i == 0)[:, None], (2 - t[:, None]) * v + x, v)  # the tail: ODE steps
        var = (2 * t[:, None] * dt.abs()) * sde[:, None].to(x.dtype)
        return x + dt * drift, var.expand_as(x).contiguous()

    def final_std(self) -> float:
        """The std of the last stochastic step (t from the grid's second-to-last point to 0.04)."""
        t = self._times[max(self.num_steps - 2, 0)]
        return float((2 * t * (t - self._times[self.num_steps - 1]).abs()).sqrt())

    def check_draft(self, draft) -> None:
        """A draft must be an xAR over the same cells (grid, cell size, latent channels)."""
        mine = (self.latent_grid, self.unit_size, self.latent_dim)
        its = (getattr(draft, "latent_grid", None), getattr(draft, "unit_size", None), getattr(draft, "latent_dim", None))
        if not isinstance(draft, XAR) or its != mine:
            raise ValueError(f"the draft ({type(draft).__name__}, grid/cell/channels {its}) is not an xAR over the "
                             f"target's cells {mine}: pair xARs of the same layout (mar_pair=xar_b_l)")

    def attach_tokenizer(self, tokenizer: nn.Module) -> "XAR":
        """Attach the KL-16 decoder used by `decode` (kept out of the state dict)."""
        return attach_decoder(self, tokenizer, "give the VAE sizes of the checkpoint (generator.vae)")

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cells (B, n_cells, T*c) -> images (B, 3, S, S) in [0, 1]."""
        if self.__dict__.get("tokenizer") is None:
            raise RuntimeError("no VAE attached: load xAR with vae_path=<kl16.ckpt> (generator.vae_path)")
        return self.tokenizer.decode(self.latents(tokens))


def _check_sizes(sizes, grid_size: int, num_classes: int, sd: dict, source: str, hint: str) -> None:
    """Widths and depths against the file before building the model (an xAR-H takes a while on CPU)."""
    D, enc, dec, _ = sizes
    expect = {"class_emb.weight": (num_classes + 1, D), "encoder_pos_embed_learned": (1, grid_size ** 2, D),
              f"encoder_blocks.{enc - 1}.attn.qkv.weight": (3 * D, D),
              f"decoder_blocks.{dec - 1}.attn.qkv.weight": (3 * D, D)}
    for key, shape in expect.items():
        if key not in sd:
            raise ValueError(f"{source}: no {key!r} in the checkpoint: {hint}")
        if tuple(sd[key].shape) != shape:
            raise ValueError(f"{source}: {key!r} has shape {tuple(sd[key].shape)} in the checkpoint, the configured "
                             f"model has {shape}: {hint}")
    for part, depth in (("encoder_blocks", enc), ("decoder_blocks", dec)):
        if f"{part}.{depth}.attn.qkv.weight" in sd:
            raise ValueError(f"{source}: the checkpoint has more than {depth} {part}: {hint}")


def _check_tables(model: XAR, sd: dict, source: str) -> None:
    """The file's mask and RoPE tables against this layout's: their shapes do not show the cell size."""
    for key, ref in model.state_dict().items():
        if key == "mask" or ".rope." in key:
            if not torch.allclose(sd[key].float(), ref, atol=1e-4):
                raise ValueError(f"{source}: {key!r} in the checkpoint is not the one of cells of {model.unit_size}x"
                                 f"{model.unit_size} tokens on a {model.latent_grid}x{model.latent_grid} grid: set "
                                 f"generator.unit_size and grid_size as the file was trained (the release: 8 and 16)")


def load_xar(weights_path: str, size: str = "large", vae_path: str | None = None, sizes=None,
             sample_steps: int = 50, sampler: str = "sde", grid_size: int = 16, unit_size: int = 8,
             token_dim: int = 16, num_classes: int = 1000, key: str | None = None, allow_pickle: bool = False,
             device: str = "cpu", vae: dict | None = None) -> XAR:
    """A released xAR (a plain state dict, or the one under `key`) with the KL-16 decoder attached when
    `vae_path` is given, frozen, float32. Read with weights_only=True unless `allow_pickle` (trusted files only)."""
    if sizes is None and size not in PRESETS:
        raise ValueError(f"unknown xAR size {size!r}: expected one of {sorted(PRESETS)} (or explicit sizes)")
    sd = read_checkpoint(weights_path, key, allow_pickle)
    if key is None and "class_emb.weight" not in sd and any(k in sd for k in ("model", "model_ema", "state_dict")):
        raise ValueError(f"{weights_path} holds {sorted(sd)[:4]}, not the weights themselves: set generator.key to "
                         f"the entry with them (e.g. model_ema)")
    sizes = tuple(sizes) if sizes is not None else PRESETS[size]
    what = f"sizes={sizes}" if sizes != PRESETS.get(size) else f"size={size!r}"
    hint = (f"the file is not an xAR of {what} (grid {grid_size}, cell {unit_size}, channels {token_dim}, "
            f"{num_classes} classes): set generator.size to base, large or huge as the file is")
    _check_sizes(sizes, grid_size, num_classes, sd, str(weights_path), hint)
    model = XAR(sizes, grid_size, unit_size, token_dim, num_classes, sample_steps, sampler)
    check_state_dict(model, sd, str(weights_path), hint)
    _check_tables(model, sd, str(weights_path))
    model.load_state_dict(sd)
    model = model.to(device).requires_grad_(False).eval()
    ids = [file_id(weights_path)]
    if vae_path is not None:
        model.attach_tokenizer(load_kl16(vae_path, device, **{"image_size": 16 * grid_size, **(vae or {})}))
        ids.append(file_id(Path(vae_path)))
    model.identity = "-".join(ids)
    return model
