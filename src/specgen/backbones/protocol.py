"""What decoding algorithms may see of a backbone. Discrete (here): the token-grid layout, a per-batch prompt
object and a small protocol; continuous (MAR, xAR, Harmon): `backbones.continuous`, re-exported at the end.

Discrete decoders never see vocabulary ids of visual codes: they hold codes, and ask the backbone to embed them
(`embed_visual`) and to score them (`visual_logits`), so one decoder serves a model with one shared vocabulary
(Emu3, Lumina-mGPT, the embedded Llama) and one with a separate generation head and embedding (Janus-Pro).

Sequence slots: [prompt (P slots, per batch, left-padded)] then H rows of W visual slots, each row followed by a
forced end-of-row token when the grid has one (row stride W + 1). Inside decoders the image part is a tensor of
*image tokens*: a visual code in [0, num_visual), or a forced token spelt `num_visual + k` for the k-th entry of
`grid.forced_ids` (`embed_image` maps both to input embeddings).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class TokenGrid:
    """Where image tokens sit in the sequence.

    `prefix_len` is the prompt's length: fixed for the embedded model (its prompt slot), set per batch for models
    with variable-length prompts (`Prompts.grid`). `visual_start` is the embedded model's vocabulary offset of
    code 0, used only by sequence builders of a one-vocabulary model (`grid_to_sequence`), never by decoders.
    """

    height: int
    width: int
    prefix_len: int               # slots before the first visual token (prompt, its image header included)
    visual_start: int             # the embedded model's vocabulary id of code 0 (0 where there is none)
    num_visual: int               # visual codes are [0, num_visual)
    eol_id: int | None = None     # end-of-row token (an input id), forced after each row
    eoi_id: int | None = None     # end-of-image token, forced after the last row (never fed by decoders)

    @property
    def stride(self) -> int:
        """Sequence distance between vertically adjacent visual tokens."""
        return self.width + (1 if self.eol_id is not None else 0)

    @property
    def num_visual_tokens(self) -> int:
        return self.height * self.width

    @property
    def seq_len(self) -> int:
        """Whole sequence length, end-of-image included."""
        return self.prefix_len + self.height * self.stride + (1 if self.eoi_id is not None else 0)

    @property
    def forced_ids(self) -> tuple[int, ...]:
        """Input ids of the forced tokens; image token `num_visual + k` stands for `forced_ids[k]`."""
        return tuple(i for i in (self.eol_id, self.eoi_id) if i is not None)

    @property
    def eol_token(self) -> int:
        """The end-of-row token in image-token space."""
        return self.num_visual

    def at(self, prefix_len: int) -> "TokenGrid":
        """The same layout after a prompt of `prefix_len` slots."""
        return self if prefix_len == self.prefix_len else dataclasses.replace(self, prefix_len=prefix_len)

    def position(self, row: int | torch.Tensor, col: int | torch.Tensor):
        """Flat sequence position of visual token (row, col)."""
        return self.prefix_len + row * self.stride + col

    def row_col(self, position: int | torch.Tensor):
        """Inverse of `position` for visual positions."""
        off = position - self.prefix_len
        return off // self.stride, off % self.stride

    def image_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        """Visual codes (B, H, W) -> the image part in image-token space (B, H*stride): end-of-row tokens in place."""
        if self.eol_id is not None:
            codes = torch.cat([codes, torch.full_like(codes[:, :, :1], self.eol_token)], dim=2)
        return codes.flatten(1)

    def grid_to_sequence(self, codes: torch.Tensor) -> torch.Tensor:
        """Visual codes (B, H, W) in [0, num_visual) -> image part of the sequence (B, H*stride [+1]) of vocab ids
        (a one-vocabulary model: codes at `visual_start`)."""
        ids = codes + self.visual_start
        if self.eol_id is not None:
            eol = torch.full_like(ids[:, :, :1], self.eol_id)
            ids = torch.cat([ids, eol], dim=2)
        ids = ids.flatten(1)
        if self.eoi_id is not None:
            ids = torch.cat([ids, torch.full_like(ids[:, :1], self.eoi_id)], dim=1)
        return ids

    def sequence_to_grid(self, image_ids: torch.Tensor) -> torch.Tensor:
        """Inverse of `grid_to_sequence`: (B, >= H*stride) vocab ids -> codes (B, H, W)."""
        rows = image_ids[:, : self.height * self.stride].view(-1, self.height, self.stride)
        return rows[:, :, : self.width] - self.visual_start


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The prompts of one batch as a backbone feeds them: per image the conditional prompt and the model's own
    unconditional prompt (for CFG), as input ids ending with the image header (begin-of-image, size tokens).

    `rows(guided)` pads them jointly on the left into one tensor: rows [0, B) conditional, then [B, 2B)
    unconditional when `guided`. Padding is masked out of attention and position ids count real tokens only, so
    an image does not depend on the other prompts of its batch."""

    texts: tuple[str, ...]
    cond: tuple[tuple[int, ...], ...]
    uncond: tuple[tuple[int, ...], ...]
    pad_id: int
    device: torch.device = torch.device("cpu")

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: slice) -> "Prompts":
        """A sub-batch (a slice of the prompts)."""
        if not isinstance(index, slice):
            raise TypeError(f"Prompts take a slice (prompts[i:i + 1]), got {index!r}")
        return dataclasses.replace(self, texts=self.texts[index], cond=self.cond[index], uncond=self.uncond[index])

    def __post_init__(self):
        if not (len(self.texts) == len(self.cond) == len(self.uncond)):
            raise ValueError(f"{len(self.texts)} prompts but {len(self.cond)} conditional and {len(self.uncond)} "
                             f"unconditional id lists: give one of each per prompt")
        empty = [t for t, c in zip(self.texts, self.cond) if not c]
        if empty:
            raise ValueError(f"prompts {empty!r} encode to no tokens: a prompt needs at least its image header")

    def rows(self, guided: bool) -> "PromptRows":
        """Left-padded (B', P) ids with their padding mask and position ids."""
        seqs = list(self.cond) + (list(self.uncond) if guided else [])
        P = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), P, dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, P - len(s):] = True
        return PromptRows(ids.to(self.device), mask.to(self.device), len(self.texts))


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """Padded prompt rows: ids and mask (B', P), `batch` images (B' = batch or 2 x batch with CFG rows)."""

    ids: torch.Tensor
    mask: torch.Tensor
    batch: int

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @property
    def reps(self) -> int:
        return self.ids.shape[0] // self.batch

    @property
    def pad(self) -> torch.Tensor:
        """(B',) left-padding slots of each row: a slot's position id is `slot - pad`."""
        return (~self.mask).sum(1)

    @property
    def padded(self) -> bool:
        return bool((~self.mask).any())

    def positions(self, slots: torch.Tensor) -> torch.Tensor:
        """Position ids (B', q) of slots (q,) or (B', q)."""
        slots = slots.expand(self.ids.shape[0], -1) if slots.ndim == 1 else slots
        return (slots - self.pad[:, None]).clamp_min(0)


@runtime_checkable
class DiscreteBackbone(Protocol):
    """A frozen discrete-token AR image model, as decoding algorithms see it.

    `forward_embeds` appends to `cache` (made by `new_cache` for a batch of prompt rows, which carries their padding)
    and returns the last layer's hidden state BEFORE the final norm; `visual_logits` applies the final norm and the
    output projection restricted to visual codes (a backbone whose head is linear may also offer
    `guided_visual_logits(hidden, cfg_scale)`, used through `sampling.guided_logits`). Slots are explicit so that non-contiguous sets can be fed (with a
    4-D additive mask (B', 1, q, cached + q) over the cache's entries, where needed). `identity` names the weights
    (`<weights id>` or `<weights id>-<tokenizer id>`): a drafter records the part before the first '-'.
    """

    grid: TokenGrid
    hidden_size: int
    identity: str

    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...

    def prompts(self, texts: list[str]) -> Prompts: ...
    def new_cache(self, rows: PromptRows, static: bool = False): ...
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor: ...        # (...,) input ids -> (..., D)
    def embed_visual(self, codes: torch.Tensor) -> torch.Tensor: ...      # (...,) codes -> (..., D)
    def forward_embeds(self, embeds: torch.Tensor, slots: torch.Tensor, cache,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor: ...  # (B', q, D) -> (B', q, D)
    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...    # (..., D) pre-norm -> float32 (..., num_visual)
    def rollback(self, cache, length: int) -> None: ...
    def decode(self, codes: torch.Tensor) -> torch.Tensor: ...            # (B, H, W) -> (B, 3, S, S) in [0, 1]


def float_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 whatever the backbone's precision: the decoders' distributions, acceptance ratios and
    residuals are computed from them, and bf16 keeps only about 3 significant digits of a probability (no op when the
    head already ran in float32)."""
    return logits if logits.dtype == torch.float32 else logits.float()


def weights_part(identity: str) -> str:
    """The weights part of a backbone identity (what a drafter records as its `backbone_id`)."""
    return identity.split("-")[0]


def embed_image(backbone: DiscreteBackbone, tokens: torch.Tensor) -> torch.Tensor:
    """Input embeddings of image tokens (...,): visual codes through `embed_visual`, forced tokens through
    `embed_tokens` of their input ids -> (..., D)."""
    g = backbone.grid
    visual = tokens < g.num_visual
    if bool(visual.all()):
        return backbone.embed_visual(tokens)
    forced = torch.tensor(g.forced_ids, dtype=torch.long, device=tokens.device)
    out = backbone.embed_visual(tokens.clamp_max(g.num_visual - 1))
    special = backbone.embed_tokens(forced[(tokens - g.num_visual).clamp(0, len(forced) - 1)])
    return torch.where(visual[..., None], out, special.to(out.dtype))


def image_states(backbone: DiscreteBackbone, rows: PromptRows, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced pre-norm states of whole images in one forward, and the image tokens they predict.

    codes (B, H, W) under prompt rows (B' = B x reps) -> (states (B', L, D), tokens (B', L)): states[:, i] sits at
    slot P - 1 + i (the last prompt slot first) and predicts tokens[:, i], the image token at slot P + i; L runs to
    the last visual token (its state is not needed)."""
    g = backbone.grid.at(rows.length)
    tokens = g.image_tokens(codes).repeat(rows.reps, 1)  # (B', H*stride)
    n = g.position(g.height - 1, g.width - 1) - g.prefix_len  # image tokens fed: all before the last visual one
    embeds = torch.cat([backbone.embed_tokens(rows.ids), embed_image(backbone, tokens[:, :n])], 1)  # (B', P + n, D)
    hidden = backbone.forward_embeds(embeds, torch.arange(embeds.shape[1], device=embeds.device),
                                     backbone.new_cache(rows))
    return hidden[:, g.prefix_len - 1:], tokens[:, :n + 1]


# ---- continuous backbones (MAR, xAR, Harmon): defined in backbones.continuous -------------------------------
from specgen.backbones.continuous import ContinuousBackbone  # noqa: E402,F401  (one import path for both families)
