"""Shared state of speculative decoders: token values, latest target states, cache bookkeeping."""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone
from specgen.decoding.sampling import guide, probs
from specgen.utils.validate import expect_float


def check_drafter(backbone: DiscreteBackbone, drafter, needs: tuple[str, ...] = ()) -> None:
    """A drafter must fit the backbone it serves: same width, distilled from the same weights (hence the
    same token layout and row stride), and it must predict the offsets the decoder asks for. Errors name the
    drafter's kind and the experiment that distils the right one."""
    have = getattr(drafter, "directions", None)
    if have and all(d.startswith("ahead_") for d in have):
        kind, experiment = "an MTP checkpoint (1D multi-token heads)", "mtp_shapes"
    elif getattr(drafter, "predicts", "hidden") == "tokens":
        kind, experiment = "a token-id drafter (the f_phi ablation)", "fphi_tokens_shapes"
    else:
        kind, experiment = "an f_phi (SSD) drafter", "fphi_shapes"
    retrain = f"python -m specgen.train experiment={experiment} data.backbone_dir=<backbone folder>"
    width = getattr(drafter, "hidden_size", None)
    if width is not None and width != backbone.hidden_size:
        raise ValueError(f"the drafter ({kind}) works on hidden states of width {width} but the backbone's are "
                         f"{backbone.hidden_size}: distil one for this backbone ({retrain})")
    trained_on, using = getattr(drafter, "backbone_id", ""), getattr(backbone, "identity", "")
    if trained_on and using and not using.startswith(trained_on):
        raise ValueError(f"the drafter ({kind}) was distilled from backbone weights {trained_on!r} but the backbone "
                         f"in use is {using.split('-')[0]!r} (another model, or another row layout): distil it again "
                         f"on this backbone ({retrain})")
    missing = [d for d in needs if have is not None and d not in have]
    if not missing:
        return
    if experiment == "mtp_shapes":  # 1D heads where SSD's right/down drafter belongs
        raise ValueError(f"the drafter is {kind}, predicting {list(have)}, not an SSD drafter: decode with it "
                         f"as decoding=mtp1d, or give this decoder an f_phi folder (checkpoints/fphi_shapes; "
                         f"python -m specgen.train experiment=fphi_shapes)")
    if all(d.startswith("ahead_") for d in needs):  # an SSD drafter where multi-token heads belong
        raise ValueError(f"the drafter is {kind}, predicting {list(have)}, not multi-token heads: decode with it "
                         f"as decoding=ssd, or give decoding=mtp1d an MTP folder (checkpoints/mtp_shapes; "
                         f"python -m specgen.train experiment=mtp_shapes)")
    raise ValueError(f"this decoder drafts {list(needs)} but the drafter predicts only {list(have)}: "
                     f"use a drafter with directions {list(needs)} or the horizontal-only mode (vertical=false)")


class SpecState:
    """Buffers of one batched generation: token values, latest target states, cache bookkeeping."""

    def __init__(self, backbone: DiscreteBackbone, prompt_ids: torch.Tensor, cfg_scale: float,
                 temperature: float, top_k: int | None, rngs):
        expect_float("cfg_scale", cfg_scale, 0.0)  # 0 = unconditional, 1 = conditional, > 1 guided
        self.bb, self.g = backbone, backbone.grid
        self.cfg_scale, self.temperature, self.top_k, self.rngs = cfg_scale, temperature, top_k, rngs
        self.B = prompt_ids.shape[0]
        ids = prompt_ids if cfg_scale == 1.0 else torch.cat([prompt_ids, backbone.null_prompt_ids(self.B)])
        self.reps = ids.shape[0] // self.B
        dev = ids.device
        T = self.g.seq_len
        self.seq = torch.zeros(ids.shape[0], T, dtype=torch.long, device=dev)  # (B', T) current tokens
        self.seq[:, : ids.shape[1]] = ids
        if self.g.eol_id is not None:
            self.seq[:, self.g.position(torch.arange(self.g.height, device=dev), self.g.width)] = self.g.eol_id
        self.hid = torch.zeros(ids.shape[0], T, backbone.hidden_size, device=dev)  # latest pre-norm states
        self.cache = backbone.new_cache()
        self.cached = 0  # cache positions [0, cached) hold the current tokens
        self.nfe = self.draft_calls = 0

    def target_pass(self, end: int) -> None:
        """Roll back to the last valid cache entry and feed the current tokens up to `end` (exclusive)."""
        if self.cached >= end:  # nothing changed that a later state depends on: no pass needed
            return
        self.bb.rollback(self.cache, self.cached)
        pos = torch.arange(self.cached, end, device=self.seq.device)
        self.hid[:, self.cached:end] = self.bb.forward_hidden(self.seq[:, self.cached:end], pos, self.cache)
        self.cached = end
        self.nfe += 1

    def dist(self, hidden: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """(B', ..., D) pre-norm states -> (B, ..., Vv) sampling distributions over visual codes.
        `temperature` overrides the decoding temperature (drafts may be drawn colder than the target)."""
        g = self.g
        return self.dist_logits(self.bb.head(hidden)[..., g.visual_start: g.visual_start + g.num_visual], temperature)

    def dist_logits(self, logits: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """(B', ..., Vv) visual-code logits -> (B, ..., Vv) sampling distributions (guided, warped)."""
        if self.reps == 2:
            logits = guide(logits, self.cfg_scale)
        return probs(logits.float(), self.temperature if temperature is None else temperature, self.top_k)

    def set_tokens(self, positions: torch.Tensor, codes: torch.Tensor, images: torch.Tensor | None = None) -> None:
        """Write visual codes (S, n) at positions (n,) or per image (S, n) of images (S,) (default: every image),
        invalidating the cache from the first change."""
        images = torch.arange(self.B, device=codes.device) if images is None else images
        rows = torch.cat([images + k * self.B for k in range(self.reps)])[:, None]  # (S', 1): with the CFG rows
        pos = positions.expand(len(images), -1) if positions.ndim == 1 else positions
        pos = pos.repeat(self.reps, 1)  # (S', n)
        new = (codes + self.g.visual_start).repeat(self.reps, 1)
        changed = self.seq[rows, pos] != new
        if changed.any():
            self.cached = min(self.cached, int(pos[changed].min()))
        self.seq[rows, pos] = new

    def image_gens(self, images) -> list[torch.Generator] | None:
        """The random streams of a subset of the images."""
        return None if self.rngs is None else [self.rngs[int(b)] for b in images]

    def visual(self, positions: torch.Tensor) -> torch.Tensor:
        return self.seq[: self.B, positions] - self.g.visual_start

    def visual_positions(self) -> torch.Tensor:
        """(H*W,) sequence positions of the visual tokens in raster order."""
        g = self.g
        dev = self.seq.device
        return g.position(torch.arange(g.height, device=dev)[:, None], torch.arange(g.width, device=dev)[None]).flatten()

    def codes(self) -> torch.Tensor:
        """The current visual codes (B, H, W)."""
        return self.visual(self.visual_positions()).view(self.B, self.g.height, self.g.width)

