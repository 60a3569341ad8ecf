"""Shared state of speculative decoders: image tokens, the target states drafters need, cache bookkeeping."""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts, PromptRows, embed_image
from specgen.decoding.sampling import guide, guided_logits, probs
from specgen.decoding.trace import Trace, or_silent
from specgen.utils.validate import expect_float


class StateWindow:
    """The target's latest pre-norm states over a sliding range of slots, not the whole sequence: decoders read
    the states their drafters and verifiers need (the row above, the current window) and `release` the rest.
    Indexed like a (B', T, D) tensor by slot; reading a released slot raises, one not computed yet reads zeros."""

    def __init__(self, rows: int, width: int, device, dtype):
        self.buf = torch.zeros(rows, 0, width, device=device, dtype=dtype)  # (B', n, D) slots [base, base + n)
        self.base = self.floor = 0
        self.peak_slots = 0  # the most slots held at once (a memory bound tests check)

    def release(self, slot: int) -> None:
        """States below `slot` are no longer needed."""
        self.floor = max(self.floor, int(slot))

    def write(self, start: int, hidden: torch.Tensor) -> None:
        end = start + hidden.shape[1]
        if start < self.base:
            raise RuntimeError(f"states from slot {start} are written but slots below {self.base} were released")
        if end > self.base + self.buf.shape[1]:
            keep = min(max(self.floor, self.base), start)
            if keep > self.base:  # drop the released slots first
                self.buf = self.buf[:, keep - self.base:]
                self.base = keep
            grow = end - self.base - self.buf.shape[1]
            if grow > 0:  # grow by at least the current size: amortised appends
                extra = max(grow, self.buf.shape[1])
                self.buf = torch.cat([self.buf, self.buf.new_zeros(self.buf.shape[0], extra, self.buf.shape[2])], 1)
        self.buf.narrow(1, start - self.base, end - start).copy_(hidden)
        self.peak_slots = max(self.peak_slots, self.buf.shape[1])

    def read(self, rows, slots: torch.Tensor, low: int, high: int) -> torch.Tensor:
        """`self[rows, slots]` where the caller knows the slots' smallest and largest values (`low`, `high`): the
        checks are made on those ints, so a read is two ops (a decoder reads the window's states every pass)."""
        if low < self.base:
            raise RuntimeError(f"the state at slot {low} was released (states are kept from slot {self.base}): "
                               f"the decoder released too early")
        if high - self.base >= self.buf.shape[1]:
            return self[rows, slots]  # a slot not computed yet: the general read
        return self.buf[rows, slots - self.base]

    def __getitem__(self, key):
        rows, slots = key
        if isinstance(slots, int) and self.base <= slots < self.base + self.buf.shape[1]:
            return self.buf[rows, slots - self.base]
        low = int(slots.min()) if torch.is_tensor(slots) else int(slots)
        if low < self.base:
            raise RuntimeError(f"the state at slot {low} was released (states are kept from slot {self.base}): "
                               f"the decoder released too early")
        idx = torch.as_tensor(slots, device=self.buf.device) - self.base
        n = self.buf.shape[1]
        if n and bool((idx < n).all()):
            return self.buf[rows, idx]
        # a slot not computed yet reads as zeros, as it did in the dense buffer (1D-MTP drafts the token after a
        # fully accepted run from it; the draft is verified like any other)
        if not n:
            raise RuntimeError("no target state was computed yet: run the prefill pass first")
        out = self.buf[rows, idx.clamp_max(n - 1)]
        return torch.where((idx < n)[..., None] if idx.ndim else idx < n, out, 0)


EMBED_TABLE_MAX = 1 << 20  # values in a generation's table of image-token embeddings (`SpecState.embed`)


class SpecState:
    """Buffers of one batched generation: image tokens, latest target states, cache bookkeeping.

    `seq` (B', T) holds image tokens at image slots (visual codes, forced tokens as `num_visual + k`), -1 at prompt
    slots (the prompt is fed from its rows). Forced end-of-row tokens are in place from the start, so every decoder
    feeds them without knowing they exist."""

    def __init__(self, backbone: DiscreteBackbone, prompts: Prompts, cfg_scale: float,
                 temperature: float, top_k: int | None, rngs, trace: Trace | None = None):
        expect_float("cfg_scale", cfg_scale, 0.0)  # 0 = unconditional, 1 = conditional, > 1 guided
        self.bb = backbone
        self.cfg_scale, self.temperature, self.top_k, self.rngs = cfg_scale, temperature, top_k, rngs
        self.rows: PromptRows = prompt_rows(prompts, cfg_scale != 1.0)
        self.B, self.reps = self.rows.batch, self.rows.reps
        self.g = backbone.grid.at(self.rows.length)
        dev, g = self.rows.ids.device, self.g
        self.seq = torch.full((self.rows.ids.shape[0], g.position(g.height, 0)), -1, dtype=torch.long, device=dev)
        self.seq[:, g.prefix_len:] = 0
        if g.eol_id is not None:
            self.seq[:, g.position(torch.arange(g.height, device=dev), g.width)] = g.eol_token
        self.hid = StateWindow(self.seq.shape[0], backbone.hidden_size, dev, backbone.dtype)
        self.cache = backbone.new_cache(self.rows)
        self.cached = 0  # cache positions [0, cached) hold the current tokens
        self.nfe = self.draft_calls = 0
        self.fed = 0  # image positions fed to the target after the prefill (each pass feeds them to every image)
        self.trace = or_silent(trace)  # where target forwards and drafter calls are reported (`decoding.trace`)
        self._embed_table: torch.Tensor | None = None  # every image token's embedding, once per generation (`embed`)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings of image tokens (any shape). Where every image token's embedding fits in a small table
        (at most `EMBED_TABLE_MAX` values: the embedded world's 514 x 256), they are computed once per generation and
        looked up: a window with an end-of-row token would otherwise embed visual and forced tokens apart and merge
        them, a dozen small ops each pass. A real backbone's codebook (16k-33k codes at width 2k-4k) is embedded per
        call."""
        if self._embed_table is None:
            g = self.g
            n = g.num_visual + len(g.forced_ids)
            if n * self.bb.hidden_size > EMBED_TABLE_MAX:
                return embed_image(self.bb, tokens)
            self._embed_table = embed_image(self.bb, torch.arange(n, device=self.seq.device))
        return self._embed_table[tokens]

    def target_pass(self, end: int) -> None:
        """Roll back to the last valid cache entry and feed the current tokens up to `end` (exclusive); no pass when
        the cache already holds them."""
        if self.cached >= end:  # nothing changed that a later state depends on: no pass needed
            return
        self.bb.rollback(self.cache, self.cached)
        start, embeds, pos = self.pass_inputs(end)
        with self.trace.region("target", positions=pos.numel(), rows=embeds.shape[0], prefill=start == 0):
            hidden = self.bb.forward_embeds(embeds, pos, self.cache)
        self.pass_done(start, hidden)

    def pass_inputs(self, end: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """What a pass up to `end` feeds: (first slot, embeddings (B', n, D), slots (n,)), from the last valid cache
        entry on; the prompt rows on the first pass."""
        P = self.g.prefix_len
        if self.cached < P:  # prefill: the prompt rows (a decoder's first pass ends at the prompt's end)
            if end != P or self.cached:
                raise RuntimeError(f"the first target pass must cover the prompt exactly (slots [0, {P})), "
                                   f"not [{self.cached}, {end})")
            embeds = self.bb.embed_tokens(self.rows.ids)
        else:
            embeds = self.embed(self.seq[:, self.cached:end])
        return self.cached, embeds, torch.arange(self.cached, end, device=self.seq.device)

    def pass_done(self, start: int, hidden: torch.Tensor) -> None:
        """Record a pass's states (B', n, D) from slot `start` on: the cache now holds the tokens up to its end."""
        self.hid.write(start, hidden)
        self.cached = start + hidden.shape[1]
        self.nfe += 1
        if start >= self.g.prefix_len:
            self.fed += hidden.shape[1]

    def fed_per_image(self) -> torch.Tensor:
        """(B,) image positions fed to the target after the prefill, per image: on a CPU a pass costs about a fixed
        overhead plus a share per position fed, so passes and positions fed together set the wall clock."""
        return torch.full((self.B,), float(self.fed), device=self.seq.device)

    def dist(self, hidden: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """(B', ..., D) pre-norm states -> (B, ..., Vv) sampling distributions over visual codes.
        `temperature` overrides the decoding temperature (drafts may be drawn colder than the target)."""
        return self._warp(self.logits(hidden), temperature)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B', ..., D) pre-norm states -> (B, ..., Vv) guided logits over visual codes (not warped)."""
        if self.reps == 2:  # mixed before the head's projection where the backbone can (`guided_logits`)
            return guided_logits(self.bb, hidden, self.cfg_scale)
        return self.bb.visual_logits(hidden)

    def dist_logits(self, logits: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """(B', ..., Vv) visual-code logits -> (B, ..., Vv) sampling distributions (guided, warped)."""
        return self._warp(guide(logits, self.cfg_scale) if self.reps == 2 else logits, temperature)

    def _warp(self, logits: torch.Tensor, temperature: float | None) -> torch.Tensor:
        return probs(logits, self.temperature if temperature is None else temperature, self.top_k)

    def set_tokens(self, positions: torch.Tensor, codes: torch.Tensor, images: torch.Tensor | None = None) -> None:
        """Write visual codes (S, n) at positions (n,) or per image (S, n) of images (S,) (default: every image),
        invalidating the cache from the first change."""
        if images is None and positions.ndim == 1:  # every image at the same positions: no row index to build
            new = codes.repeat(self.reps, 1) if self.reps > 1 else codes
            changed = (self.seq[:, positions] != new).any(0).tolist()
            if True in changed:
                self.cached = min(self.cached, min(q for q, c in zip(positions.tolist(), changed) if c))
                self.seq[:, positions] = new
            return
        images = torch.arange(self.B, device=codes.device) if images is None else images
        rows = torch.cat([images + k * self.B for k in range(self.reps)])[:, None]  # (S', 1): with the CFG rows
        pos = positions.expand(len(images), -1) if positions.ndim == 1 else positions
        pos = pos.repeat(self.reps, 1)  # (S', n)
        new = codes.repeat(self.reps, 1)
        changed = self.seq[rows, pos] != new
        if changed.any():
            self.cached = min(self.cached, int(pos[changed].min()))
        self.seq[rows, pos] = new

    def write_tokens(self, positions: torch.Tensor, codes: torch.Tensor, first: int | None) -> None:
        """Write visual codes (B, n) at positions (n,) for every image, where the caller knows the first position
        whose token changed (`first`; None: none changed, nothing to write): `set_tokens` without comparing."""
        if first is None:
            return
        self.cached = min(self.cached, first)
        self.seq[:, positions] = codes.repeat(self.reps, 1) if self.reps > 1 else codes

    def image_gens(self, images) -> list[torch.Generator] | None:
        """The random streams of a subset of the images."""
        return None if self.rngs is None else [self.rngs[int(b)] for b in images]

    def visual(self, positions: torch.Tensor) -> torch.Tensor:
        return self.seq[: self.B, positions]

    def visual_positions(self) -> torch.Tensor:
        """(H*W,) sequence positions of the visual tokens in raster order."""
        g = self.g
        dev = self.seq.device
        return g.position(torch.arange(g.height, device=dev)[:, None], torch.arange(g.width, device=dev)[None]).flatten()

    def codes(self) -> torch.Tensor:
        """The current visual codes (B, H, W)."""
        return self.visual(self.visual_positions()).view(self.B, self.g.height, self.g.width)


def prompt_rows(prompts: Prompts, guided: bool) -> PromptRows:
    """The padded rows of a decoder's prompts, with a clear error for a tensor of ids (the old call shape)."""
    if not isinstance(prompts, Prompts):
        raise TypeError(f"decoders take the backbone's prompt object, got {type(prompts).__name__}: call "
                        f"decode(backbone, backbone.prompts(texts), ...)")
    return prompts.rows(guided)
