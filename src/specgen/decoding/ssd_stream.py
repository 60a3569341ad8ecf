"""SSD with carry over a stream of prompts: continuous batching (`ssd.generate(..., slots=S)`).

In a fixed batch every image progresses on its own rows, but the batch's passes are its slowest image's: an image
that is done idles until the last one is. Here the prompts are a queue and at most `slots` images are in flight;
an image that is done hands its slot to the next prompt at once. Each image keeps the state of batch-1 decoding
(its tokens, its verification window, its random stream), and one target pass feeds every image in flight its own
window (the new ones their prompts) through a `RaggedCache`, whose rows hold different lengths and roll back on
their own. So an image's tokens and its pass count are those of batch-1 decoding (up to floating-point differences
of batched matmuls), and the stream's passes approach (sum of the images' passes) / slots.

Accounting: `nfe` counts target forwards over the slots (one forward counts once, however many images and tokens it
feeds, prompts included); `image_passes` (per image) the forwards each image took part in, its prefill included.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts
from specgen.decoding.ssd_rule import CarryRule
from specgen.decoding.ssd_window import CarryWindow
from specgen.decoding.state import SpecState
from specgen.utils.validate import expect_int


class _SlotState(SpecState):
    """A stream image's state: its target passes run in the stream's shared forwards, never alone."""

    def target_pass(self, end: int) -> None:
        raise RuntimeError("a stream image's passes run through the stream (ssd_stream.generate_stream)")


class _Image:
    """One image of the stream: batch-1 SSD with carry, advanced between the shared passes."""

    def __init__(self, index: int, backbone, prompts: Prompts, rng, drafter, rule: CarryRule, vertical: bool,
                 sampling: dict):
        self.index = index
        self.st = _SlotState(backbone, prompts, rngs=None if rng is None else [rng], **sampling)
        self.win = CarryWindow(self.st, rule, drafter)
        self.drafter, self.vertical = drafter, vertical
        self.flush = 0
        self.siblings = None  # the alternatives fed with the image's next pass (`CarryWindow.sibling_inputs`)

    def next_pass(self) -> int | None:
        """Draft the rows that are due and return the slot the image's next pass feeds up to, or None when the image
        is done. A window needing no new states (nothing changed since the last pass) is judged at once."""
        from specgen.decoding.ssd import draft_due  # ssd delegates to this module

        st, win = self.st, self.win
        if st.cached < st.g.prefix_len:
            return st.g.prefix_len  # the prefill
        while True:
            draft_due(st, win, self.drafter, self.vertical)
            if not any(win.live()):
                if not win.unfinished():
                    return None
                continue
            end = win.pass_end()
            if st.cached < end:
                if not win.unfinished():
                    self.flush += 1
                self.siblings = win.sibling_inputs()
                return end
            win.judge()

    def after_pass(self, states: torch.Tensor | None) -> None:
        """Judge the window after a pass; `states` (reps, k, D): the states of the alternatives it fed."""
        if self.win.pos.numel():  # not after the prefill: nothing is drafted yet
            self.win.judge(self.siblings, states)


@torch.no_grad()
def _assemble(running: list, ends: list, feeding: list[int], inputs: list, alts: list, S: int, reps: int, q: int):
    """One pass's inputs over every cache row (an idle slot's rows are padding: no row subsets to gather per layer):
    where each token is written in the cache (-1: nowhere), its position, and its embedding. A slot's rows are s and
    s + S (its CFG row); its window fills the first q columns, its alternatives the columns after them."""
    k = max((a[0].shape[1] for a in alts if a is not None), default=0)
    ref = inputs[0][1]
    at = torch.full((S * reps, q + k), -1, dtype=torch.long, device=ref.device)
    positions = at.clone()
    embeds = ref.new_zeros(S * reps, q + k, ref.shape[-1])
    for s, (_, emb, pos), alt in zip(feeding, inputs, alts):
        at[s::S, :pos.numel()] = positions[s::S, :pos.numel()] = pos
        embeds[s::S, :pos.numel()] = emb
        if alt is not None:  # written past the pass's end (overwritten before any later token sees them)
            n_alt = alt[0].shape[1]
            at[s::S, q:q + n_alt] = ends[s] + torch.arange(n_alt, device=at.device)
            positions[s::S, q:q + n_alt] = alt[0]
            embeds[s::S, q:q + n_alt] = running[s].st.embed(alt[1].repeat(reps, 1))
    return at, positions, embeds


def generate_stream(backbone: DiscreteBackbone, prompts: Prompts, drafter, slots: int, rule: CarryRule,
                    cfg_scale: float, temperature: float, top_k: int | None, rngs, vertical: bool = True):
    """Codes (N, H, W) of the N prompts, at most `slots` in flight, and stats (see the module docstring). Each image
    moves its window by `rule` (its `max_lead` is not read: a stream image has no batch to run ahead of)."""
    expect_int("slots", slots, 1)
    new_cache = getattr(backbone, "new_ragged_cache", None)
    if new_cache is None:
        raise ValueError(f"slots={slots} (continuous batching) needs a backbone with per-row cache lengths "
                         f"(new_ragged_cache); {type(backbone).__name__} has none: set slots=null to decode fixed "
                         f"batches")
    rule = replace(rule, max_lead=None)
    N = len(prompts)
    if rngs is not None and len(rngs) != N:
        raise ValueError(f"{len(rngs)} random streams for {N} prompts: give one per prompt (make_rngs)")
    sampling = dict(cfg_scale=cfg_scale, temperature=temperature, top_k=top_k)
    reps = 2 if cfg_scale != 1.0 else 1
    g = backbone.grid.at(prompts.rows(reps == 2).length)
    S = min(slots, N)
    cache = new_cache(S * reps, g.position(g.height, 0) + rule.siblings)  # alternatives go past a row's pass end
    all_rows = torch.arange(S * reps, device=backbone.device)
    queue = iter(range(N))
    running: list[_Image | None] = [None] * S
    ends: list[int | None] = [None] * S
    done: dict[int, _Image] = {}
    nfe = 0
    while True:
        for s in range(S):  # every slot: its image's next pass, or the next prompt's prefill
            while ends[s] is None:
                if running[s] is not None:
                    done[running[s].index] = running[s]
                    running[s] = None
                i = next(queue, None)
                if i is None:
                    break
                running[s] = _Image(i, backbone, prompts[i:i + 1], None if rngs is None else rngs[i], drafter,
                                    rule, vertical, sampling)
                ends[s] = running[s].next_pass()
        feeding = [s for s in range(S) if ends[s] is not None]
        if not feeding:
            break
        inputs = [running[s].st.pass_inputs(ends[s]) for s in feeding]
        alts = [running[s].siblings if inp[0] >= g.prefix_len else None for s, inp in zip(feeding, inputs)]
        q = max(emb.shape[1] for _, emb, _ in inputs)
        at, positions, embeds = _assemble(running, ends, feeding, inputs, alts, S, reps, q)
        cache.feed(all_rows, at)
        hidden = backbone.forward_embeds(embeds, positions.clamp_min(0), cache,
                                         cache.mask(at, embeds.dtype, positions.clamp_min(0)))
        nfe += 1
        for s, (start, _, pos), alt in zip(feeding, inputs, alts):
            img = running[s]
            img.st.pass_done(start, hidden[s::S, :pos.numel()])
            img.after_pass(None if alt is None else hidden[s::S, q:q + alt[0].shape[1]])
            ends[s] = img.next_pass()
    return _collect([done[i] for i in range(N)], nfe, S)


def _collect(images: list[_Image], nfe: int, slots: int):
    """The stream's codes and stats, per image in prompt order."""
    codes = torch.cat([img.st.codes() for img in images])
    cat = lambda xs: torch.cat(xs) if xs[0].ndim else torch.stack(xs)  # noqa: E731
    per = {k: cat([img.win.pass_stats()[k] for img in images]) for k in images[0].win.pass_stats()}
    passes = torch.tensor([float(img.st.nfe) for img in images], device=codes.device)
    g = images[0].st.g
    accept_map = torch.cat([img.win.accept_map for img in images])
    return codes, {"nfe": nfe, "draft_calls": sum(img.st.draft_calls for img in images),
                   "tokens_per_pass": len(images) * g.num_visual_tokens / nfe,
                   "accept_rate": accept_map.float().mean((1, 2)),
                   "rounds_per_row": torch.cat([img.win.rounds_used for img in images]).float().mean(1),
                   "accept_map": accept_map,
                   "image_passes": passes, "tokens_fed": torch.cat([img.st.fed_per_image() for img in images]),
                   "row_final_pass": torch.cat([img.win.row_final for img in images]),
                   "flush_passes": sum(img.flush for img in images) / len(images),
                   "slot_occupancy": float(passes.sum()) / (nfe * slots),
                   "state_slots": max(img.st.hid.peak_slots for img in images), **per}
