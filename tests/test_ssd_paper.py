"""The paper's SSD (`decoding.ssd`): its pass budget, what its last round leaves unverified, and when each row is
done. Its outputs against AR and the exact joint are in test_decoders.py, its pinned codes in
test_ssd_reference.py."""
import pytest
import torch

from decoder_helpers import PROMPTS, noisy_drafter, tiny
from specgen.decoding import ssd, ssd_carry
from specgen.decoding.sampling import make_rngs


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_nfe_is_bounded_by_rows_times_rounds_plus_one(rounds):
    m = tiny(True)
    _, st = ssd.generate(m, m.prompts(PROMPTS), noisy_drafter(m), cfg_scale=3.0, rounds=rounds,
                         rngs=make_rngs([0, 1, 2]))
    assert st["nfe"] <= m.grid.height * (rounds + 1) + 1
    assert st["accept_map"].shape == (3, m.grid.height, m.grid.width)
    assert (st["rounds_per_row"] <= rounds + 1).all()


def test_unchecked_tokens_count_what_the_last_round_left_unverified():
    """Auto-correct reports the tokens never judged with their final left context: some at r = 0 with a
    poor drafter, none once every row has converged (greedy, r = W); the carry window leaves none."""
    m = tiny(True)
    p = m.prompts(PROMPTS)
    _, st0 = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rounds=0, rngs=make_rngs([0, 1, 2]))
    assert st0["unchecked_tokens"].sum() > 0
    assert (st0["unchecked_tokens"] <= m.grid.num_visual_tokens).all()
    _, stw = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, temperature=0, rounds=m.grid.width)
    assert (stw["unchecked_tokens"] == 0).all()
    _, stc = ssd_carry.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rngs=make_rngs([0, 1, 2]))
    assert "unchecked_tokens" not in stc  # every carried token is judged until final
    assert torch.allclose(stc["final_per_pass"] * (stc["image_passes"] - 1),
                          torch.full((3,), float(m.grid.num_visual_tokens)))


def test_row_final_pass_records_when_each_row_is_done():
    """The paper's rule spends at most rounds + 1 passes per row (the first after the prefill); the last row's entry
    is the decode's passes."""
    m = tiny(True, grid=6)
    _, st = ssd.generate(m, m.prompts(PROMPTS), noisy_drafter(m), cfg_scale=3.0, rngs=make_rngs(range(3)), rounds=2)
    steps = torch.diff(torch.cat([torch.ones(3, 1, dtype=torch.long), st["row_final_pass"]], 1), dim=1)
    assert bool((steps >= 1).all()) and bool((steps <= 3).all()) and int(st["row_final_pass"][0, -1]) == st["nfe"]


def test_exact_mode_completes_every_row_left_to_right():
    """exact=True: each pass accepts a prefix of the row's columns and corrects the first rejection, so a row takes
    between 1 and W passes and every token's first judgement is recorded."""
    m = tiny(True, grid=6)
    _, st = ssd.generate(m, m.prompts(PROMPTS), noisy_drafter(m), cfg_scale=3.0, rngs=make_rngs(range(3)), exact=True)
    steps = torch.diff(torch.cat([torch.ones(3, 1, dtype=torch.long), st["row_final_pass"]], 1), dim=1)
    assert bool((steps >= 1).all()) and bool((steps <= m.grid.width).all())
    assert int(st["row_final_pass"][0, -1]) == st["nfe"] and 0 < float(st["accept_rate"].mean()) < 1
