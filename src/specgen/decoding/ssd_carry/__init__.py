"""SSD with a carry window: the repo's default discrete strategy, beyond the paper.

It drafts and verifies as the paper's SSD does (`decoding.ssd`: f_phi right/down drafts, the speculative test with
residual correction), but leaves no token unverified. After a pass, a column is final when no column to its left
changed in that pass (it was judged with its final left context); the first changed column is final too (drawn
from p given that context). The columns after it stay in the verification window: the next row's passes re-verify
them together with the new row's drafts (no extra pass), and after the last row, passes go on until every token is
final. A carried token is checked with the previous pass's p as its proposal, as Jacobi-style decoders (SJD) do:
approximately lossless, exact under greedy decoding. Each image moves on by itself (`window.Schedule`).

The variants are objects: `tails` (`tails.Redraft`, `tails.Reweight`: new proposals for the tokens after a change)
and `acceptance` (`acceptance.Speculative`, the paper's test; `Typical`, `Latent`: the baselines' relaxed tests).
`slots` turns a batch into a stream of prompts (continuous batching, `stream`).
"""
from __future__ import annotations

import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts
from specgen.decoding.ssd_carry.acceptance import Speculative
from specgen.decoding.ssd_carry.window import CarryWindow, Schedule
from specgen.decoding.ssd_drafting import Drafting
from specgen.decoding.state import SpecState
from specgen.decoding.trace import Trace
from specgen.drafters.protocol import Drafter, check_drafter, fit_drafter
from specgen.utils.validate import expect_float, expect_int


@torch.no_grad()
def generate(backbone: DiscreteBackbone, prompts: Prompts, drafter: Drafter, cfg_scale: float = 3.0,
             temperature: float = 1.0, top_k: int | None = None, rngs: list[torch.Generator] | None = None,
             rounds: int = 0, vertical: bool = True, draft_temperature: float | None = None,
             max_window_rows: int | None = None, max_lead: int | None = 2, second_row_wait: int | None = None,
             tails: list | tuple = (), acceptance=None, slots: int | None = None, batch_drafts: bool = True,
             batch_judge: bool = True, packed: bool = True, per_image_attention: bool = False,
             drafting: type = Drafting, trace: Trace | None = None) -> tuple[torch.Tensor, dict]:
    """SSD with carry: visual codes (B, H, W) and stats.

    rounds, max_window_rows, max_lead, second_row_wait: when an image drafts its next row (`window.Schedule`);
    vertical, draft_temperature: as in `ssd.generate`; tails: tail proposals (`tails.Redraft`, `tails.Reweight`; the
    first that serves a row proposes), none by default; acceptance: the test (default `acceptance.Speculative()`);
    slots: continuous batching, the prompts a queue with at most `slots` images in flight (None: one fixed batch);
    batch_drafts: in a stream, the down rows its images draft between two passes are drafted in one drafter call
    (False: one call per image; the same tokens up to the rounding of batched products); batch_judge: in a stream,
    the windows of its images are judged after a pass in one call (False: one after another; the same tokens);
    packed: in a stream, a forward feeds only its images' own tokens through the backbone's projections and MLPs
    (False: every slot padded to the longest window; the same states up to rounding); per_image_attention (with
    packed): attention image by image over its own queries and keys, not the padded grid (a call per image and layer);
    drafting: the class that drafts rows (`ssd_drafting.Drafting`; analysis tools pass an oracle); trace: told of
    every target forward and drafter call.
    stats: "nfe" target passes (one forward of the batch counts once), "image_passes" (B,) the passes each image
    took part in (prefill included), "row_final_pass" (B, H) its passes when each row was final, "accept_rate" and
    "accept_map" at each token's first judgement, "tokens_fed", "flush_passes" (passes after the last row was
    drafted), and where the passes went (`stats.PassStats.summary`)."""
    schedule = _schedule(rounds, max_window_rows, max_lead, second_row_wait)
    expect_float("temperature", temperature, 0.0)
    if draft_temperature is not None:
        expect_float("draft_temperature", draft_temperature, 0.0)
    acceptance = Speculative() if acceptance is None else acceptance
    check_drafter(backbone, drafter, ("right", "down") if vertical else ("right",))
    for tail in tails:
        tail.check(drafter)
    drafter = fit_drafter(backbone, drafter)
    make = lambda st: CarryWindow(st, schedule, drafting(st, drafter, draft_temperature,  # noqa: E731
                                                         any(t.keeps_down_rows for t in tails)), tails, acceptance)
    if slots is not None:
        from specgen.decoding.ssd_carry.stream import generate_stream  # the stream builds on this module's parts
        return generate_stream(backbone, prompts, make, slots, cfg_scale, temperature, top_k, rngs, vertical, trace,
                               batch_drafts, batch_judge, packed, per_image_attention)
    st = SpecState(backbone, prompts, cfg_scale, temperature, top_k, rngs, trace)
    st.target_pass(st.g.prefix_len)  # prefill: prompt slot and begin-of-image
    win = make(st)
    flush = 0
    while True:
        win.draft_due(vertical)
        if not any(win.live()):
            if not win.unfinished():
                break
            continue
        if not win.unfinished():
            flush += 1
        win.step()
    accept_map, g = win.accept_map, st.g
    return st.codes(), {"nfe": st.nfe, "draft_calls": st.draft_calls, "tokens_per_pass": g.num_visual_tokens / st.nfe,
                        "accept_rate": accept_map.float().mean((1, 2)),
                        "rounds_per_row": win.rounds_used.float().mean(1), "accept_map": accept_map,
                        "image_passes": win.image_passes(), "row_final_pass": win.row_final,
                        "flush_passes": flush, "state_slots": st.hid.peak_slots, "tokens_fed": st.fed_per_image(),
                        **win.pass_stats()}


def _schedule(rounds, max_window_rows, max_lead, second_row_wait) -> Schedule:
    """The checked `Schedule` of the options."""
    expect_int("rounds", rounds, 0)
    for name, value, least in (("max_window_rows", max_window_rows, 1), ("max_lead", max_lead, 0),
                               ("second_row_wait", second_row_wait, 0)):
        if value is not None:
            expect_int(name, value, least)
    return Schedule(rounds, max_lead, max_window_rows, second_row_wait)
