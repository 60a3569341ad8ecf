"""SSD with carry over a stream of prompts: continuous batching (`ssd_carry.generate(..., slots=S)`).

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

from typing import Callable

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts
from specgen.decoding.ssd_carry.window import CarryWindow, judge_together
from specgen.decoding.ssd_drafting import down_together
from specgen.decoding.state import SpecState
from specgen.decoding.trace import Trace, or_silent
from specgen.utils.validate import expect_int


class _SlotState(SpecState):
    """A stream image's state: its target passes run in the stream's shared forwards, never alone."""

    def target_pass(self, end: int) -> None:
        raise RuntimeError("a stream image's passes run through the stream (ssd_carry.stream.generate_stream)")


class _Image:
    """One image of the stream: batch-1 SSD with carry, advanced between the shared passes."""

    def __init__(self, index: int, backbone, prompts: Prompts, rng, window: Callable[[SpecState], CarryWindow],
                 vertical: bool, sampling: dict):
        self.index = index
        self.st = _SlotState(backbone, prompts, rngs=None if rng is None else [rng], **sampling)
        self.win = window(self.st)
        self.vertical = vertical
        self.flush = 0

    def next_pass(self, together: bool = False):
        """A generator: draft the rows that are due and return the slot the image's next pass feeds up to, or None
        when the image is done. A window needing no new states (nothing changed since the last pass) is judged at
        once. together: a down row is not drafted here but yielded (its row number) for the stream to draft with
        other images' rows (`ssd_drafting.down_together`), which sends back its (draft, q)."""
        st, win = self.st, self.win
        if st.cached < st.g.prefix_len:
            return st.g.prefix_len  # the prefill
        while True:
            due = win.due(self.vertical)
            if due is not None:
                images, rows = due
                if together and self.vertical and rows[0] > 0:
                    draft, q = yield rows[0]
                else:
                    draft, q = win.draft(images, rows, self.vertical)
                win.place(images, rows, draft, q)
            if not any(win.live()):
                if not win.unfinished():
                    return None
                continue
            end = win.slots[-1]
            if st.cached < end:
                if not win.unfinished():
                    self.flush += 1
                return end
            win.judge()


def _assemble(feeding: list[int], inputs: list, S: int, reps: int, q: int):
    """One pass's inputs over every cache row (an idle slot's rows are padding: no row subsets to gather per layer):
    where each token is written in the cache (R, q; -1: nowhere), the flat places of the real tokens in that grid
    (N,), their positions (N,) and embeddings (N, D), in slot order, each slot's rows s and s + S (its CFG row) one
    after the other. A slot's window fills its rows' first columns. Built in a fixed number of ops whatever the
    slots (the slots from Python ints)."""
    ref = inputs[0][1]
    at = [[-1] * q for _ in range(S * reps)]
    where, positions = [], []
    for s, (start, emb, _) in zip(feeding, inputs):
        n = emb.shape[1]
        for r in range(reps):
            at[s + r * S][:n] = range(start, start + n)
            where.extend(range((s + r * S) * q, (s + r * S) * q + n))
            positions.extend(range(start, start + n))
    fed = torch.cat([emb.flatten(0, 1) for _, emb, _ in inputs])  # (N, D)
    tensor = lambda x: torch.tensor(x, dtype=torch.long, device=ref.device)  # noqa: E731
    return tensor(at), tensor(where), tensor(positions), fed


def _forward(backbone, cache, feeding: list[int], inputs: list, S: int, reps: int, packed: bool, trace,
             per_image_attention: bool = False) -> list:
    """One target forward of the slots `feeding` through the ragged cache: each slot's states (reps, n, D). Packed:
    only the real tokens through the projections and MLPs (`forward_packed`); otherwise every row padded to the
    longest window. per_image_attention (packed only): attention slot by slot over its own queries and keys."""
    q = max(emb.shape[1] for _, emb, _ in inputs)
    at, where, positions, fed = _assemble(feeding, inputs, S, reps, q)
    groups = (S, [(s, emb.shape[1], start + emb.shape[1]) for s, (start, emb, _) in zip(feeding, inputs)]) \
        if packed and per_image_attention else None
    cache.feed(torch.arange(S * reps, device=at.device), at, pack=where if packed else None, groups=groups)
    grid = at.clamp_min(0)
    mask = cache.mask(at, fed.dtype, grid)
    with trace.region("target", positions=q, rows=S * reps, prefill=all(i[0] == 0 for i in inputs),
                      tokens=fed.shape[0] if packed else S * reps * q):
        if packed:
            hidden = backbone.forward_packed(fed, positions, cache, mask)
        else:
            embeds = fed.new_zeros(S * reps * q, fed.shape[-1]).index_copy_(0, where, fed)
            hidden = backbone.forward_embeds(embeds.view(S * reps, q, -1), grid, cache, mask)
    if not packed:
        return [hidden[s::S, :emb.shape[1]] for s, (_, emb, _) in zip(feeding, inputs)]
    sizes = [emb.shape[0] * emb.shape[1] for _, emb, _ in inputs]
    return [h.view(reps, -1, h.shape[-1]) for h in hidden.split(sizes)]


def generate_stream(backbone: DiscreteBackbone, prompts: Prompts, window: Callable[[SpecState], CarryWindow],
                    slots: int, cfg_scale: float, temperature: float, top_k: int | None, rngs, vertical: bool = True,
                    trace: Trace | None = None, batch_drafts: bool = True, batch_judge: bool = True,
                    packed: bool = True, per_image_attention: bool = False):
    """Codes (N, H, W) of the N prompts, at most `slots` in flight, and stats (see the module docstring). `window`
    makes each image's carry window from its state (a stream image has no batch to run ahead of: max_lead is not
    read). batch_drafts, batch_judge: the down rows drafted between two passes in one drafter call, the windows
    judged after a pass in one call (`window.judge_together`; the same tokens either way); packed: a forward feeds
    only the images' own tokens through the projections and MLPs, where the backbone can (`forward_packed`; the
    same states up to the rounding of products of another number of rows); per_image_attention (with packed):
    attention image by image over its own queries and keys, not the padded grid (the same states up to rounding)."""
    expect_int("slots", slots, 1)
    new_cache = getattr(backbone, "new_ragged_cache", None)
    if new_cache is None:
        raise ValueError(f"slots={slots} (continuous batching) needs a backbone with per-row cache lengths "
                         f"(new_ragged_cache); {type(backbone).__name__} has none: set slots=null to decode fixed "
                         f"batches")
    trace = or_silent(trace)
    N = len(prompts)
    if rngs is not None and len(rngs) != N:
        raise ValueError(f"{len(rngs)} random streams for {N} prompts: give one per prompt (make_rngs)")
    sampling = dict(cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, trace=trace)
    reps = 2 if cfg_scale != 1.0 else 1
    g = backbone.grid.at(prompts.rows(reps == 2).length)
    S = min(slots, N)
    cache = new_cache(S * reps, g.position(g.height, 0))
    packed = packed and hasattr(backbone, "forward_packed")
    queue = iter(range(N))
    running: list[_Image | None] = [None] * S
    ends: list[int | None] = [None] * S
    done: dict[int, _Image] = {}
    nfe = 0

    def admit(s: int):
        """Slot s's next prompt, as the generator of its first pass (None: the queue is empty)."""
        i = next(queue, None)
        if i is None:
            return None
        running[s] = _Image(i, backbone, prompts[i:i + 1], None if rngs is None else rngs[i], window, vertical,
                            sampling)
        return running[s].next_pass(batch_drafts)

    while True:
        _plan(running, ends, done, admit, batch_drafts)
        feeding = [s for s in range(S) if ends[s] is not None]
        if not feeding:
            break
        inputs = [running[s].st.pass_inputs(ends[s]) for s in feeding]
        states = _forward(backbone, cache, feeding, inputs, S, reps, packed, trace, per_image_attention)
        nfe += 1
        for s, (start, _, _), h in zip(feeding, inputs, states):
            running[s].st.pass_done(start, h)
            ends[s] = None  # planned at the top of the loop
        judged = [running[s].win for s in feeding if running[s].win.pos.numel()]  # not after a prefill
        if batch_judge:
            judge_together(judged)
        else:
            for win in judged:
                win.judge()
    return _collect([done[i] for i in range(N)], nfe, S)


def _plan(running: list, ends: list, done: dict, admit: Callable, together: bool) -> None:
    """Every slot without a pass to feed (ends[s] None): its image's next pass, written in `ends` (a finished image
    goes to `done` and hands its slot to the next prompt, `admit`, whose next pass is its prefill). The down rows due
    meanwhile are drafted together (`ssd_drafting.down_together`) where `together`."""
    plans = {}
    for s, end in enumerate(ends):
        if end is None:
            plan = running[s].next_pass(together) if running[s] is not None else admit(s)
            if plan is not None:
                plans[s] = plan
    replies = dict.fromkeys(plans)
    while plans:
        asks = []
        for s in list(plans):
            try:
                asks.append((s, plans[s].send(replies[s])))
            except StopIteration as stop:
                del plans[s]
                if stop.value is not None:
                    ends[s] = stop.value
                    continue
                done[running[s].index] = running[s]
                running[s] = None
                plan = admit(s)
                if plan is not None:
                    plans[s] = plan
        replies = dict.fromkeys(plans)
        if asks:
            drafted = down_together([running[s].win.drafting for s, _ in asks], [row for _, row in asks])
            replies.update({s: d for (s, _), d in zip(asks, drafted)})


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
