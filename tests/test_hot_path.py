"""The SSD hot path's shortcuts give exactly what the general code gives: draws made in their final shape, state reads
checked on ints, one row of every image drafted without index tensors, token writes at shared positions, the
backbone's own causal mask, the head's cached visual rows. (The whole decoders are pinned token for token by
tests/test_ssd_reference.py; these tests name the piece that broke.)"""
import pytest
import torch

from specgen.decoding.sampling import inverse_cdf, make_rngs, sample_probs, uniform
from specgen.decoding.ssd_drafting import Drafting
from specgen.decoding.state import SpecState, StateWindow
from specgen.decoding.trace import OpCount
from decoder_helpers import PROMPTS, noisy_drafter, tiny


def test_draws_in_their_final_shape_are_the_same_values():
    p = torch.softmax(torch.randn(3, 7, 11) * 3, -1)
    u = torch.rand(3, 7)
    assert torch.equal(inverse_cdf(p, u), inverse_cdf(p, u[..., None]))
    one = uniform((1, 5), make_rngs([3]), "cpu")
    assert torch.equal(one, torch.rand(5, generator=make_rngs([3])[0])[None])
    assert torch.equal(uniform((1, 5, 1), make_rngs([3]), "cpu").flatten(), one.flatten())
    # sample_probs draws (..., 1) from each generator: the ids of drawing (...) and inverting by hand
    ids = sample_probs(p, make_rngs([0, 1, 2]))
    assert torch.equal(ids, inverse_cdf(p, uniform((3, 7), make_rngs([0, 1, 2]), "cpu")))


def test_state_reads_on_ints_equal_the_checked_reads():
    win = StateWindow(2, 4, "cpu", torch.float32)
    win.write(0, torch.randn(2, 10, 4))
    slots = torch.tensor([3, 4, 6])
    assert torch.equal(win.read(slice(None), slots, 3, 6), win[:, slots])
    assert torch.equal(win[:, 5], win.buf[:, 5])
    win.release(4)
    win.write(10, torch.randn(2, 30, 4))  # grows: the released slots go
    with pytest.raises(RuntimeError, match="released"):
        win.read(slice(None), slots, 3, 6)
    beyond = torch.tensor([38, 39, 45])  # not computed yet: zeros, as the general read gives
    assert torch.equal(win.read(slice(None), beyond, 38, 45), win[:, beyond])


@pytest.mark.parametrize("left", [False, True])
def test_one_row_of_every_image_drafts_as_the_indexed_rows(left):
    torch.manual_seed(0)
    m, prompts = tiny(eol=True), PROMPTS[:2]
    drafter = noisy_drafter(m, left=left)
    st = SpecState(m, m.prompts(prompts), 2.0, 1.0, None, make_rngs([0, 1]))
    vis = st.visual_positions()
    st.seq[:, vis] = torch.randint(0, st.g.num_visual, (st.seq.shape[0], vis.numel()))  # forced tokens stay
    st.target_pass(st.g.prefix_len)      # the prefill ...
    st.target_pass(st.g.position(2, 0))  # ... and the states through row 1
    by_int = Drafting(st, drafter, 0.5, keep_down_rows=True)
    st.rngs = make_rngs([5, 6])
    codes, q = by_int.down(2)
    by_index = Drafting(st, drafter, 0.5, keep_down_rows=True)
    st.rngs = make_rngs([5, 6])
    codes_i, q_i = by_index.down(torch.tensor([2, 2]), torch.tensor([0, 1]))
    assert torch.equal(codes, codes_i) and torch.equal(q, q_i)
    if left:
        assert by_int.down_rows.keys() == by_index.down_rows.keys() == {(0, 2), (1, 2)}
        for key, (trunk, hidden) in by_int.down_rows.items():
            assert torch.equal(trunk, by_index.down_rows[key][0]) and torch.equal(hidden, by_index.down_rows[key][1])


def test_token_writes_at_shared_positions_equal_the_per_image_path():
    m = tiny(eol=True)
    states = [SpecState(m, m.prompts(PROMPTS[:2]), 2.0, 1.0, None, None) for _ in range(2)]
    for st in states:
        st.cached = st.seq.shape[1]
    g = states[0].g
    pos = torch.arange(g.position(1, 0), g.position(1, g.width))
    codes = torch.zeros(2, g.width, dtype=torch.long)
    codes[1, 3] = 5  # image 1's column 3 changes
    states[0].set_tokens(pos, codes)
    states[1].set_tokens(pos[None].expand(2, -1), codes, torch.tensor([0, 1]))
    assert torch.equal(states[0].seq, states[1].seq)
    assert states[0].cached == states[1].cached == g.position(1, 3)


def test_the_backbones_causal_block_mask_is_transformers_own():
    """Several tokens fed after a cached prefix: the mask built in forward_embeds gives the states of transformers'
    own causal mask (the model called without one), bit for bit, in three ops instead of about twenty."""
    m = tiny(eol=True)
    rows = m.prompts(PROMPTS[:2]).rows(True)
    P = rows.ids.shape[1]
    embeds = torch.randn(rows.ids.shape[0], 6, m.hidden_size)
    out = []
    for own in (True, False):
        cache = m.new_cache(rows)
        with torch.inference_mode():
            m.forward_embeds(m.embed_tokens(rows.ids), torch.arange(P), cache)
            slots = torch.arange(P, P + 6)[None].expand(embeds.shape[0], -1)
            if own:
                with OpCount() as ops:
                    out.append(m.forward_embeds(embeds, torch.arange(P, P + 6), cache))
            else:  # transformers builds its mask
                with OpCount() as theirs:
                    out.append(m.model.model(inputs_embeds=embeds, position_ids=slots, cache=cache,
                                             use_cache=True).last_hidden_state)
    assert torch.equal(out[0], out[1])
    assert ops.other < theirs.other


def test_the_heads_visual_rows_follow_the_weight():
    m = tiny(eol=False)
    h = torch.randn(2, 3, m.hidden_size)
    before = m.visual_logits(h)
    assert m._visual_rows() is m._visual_rows()  # one view, kept
    with torch.no_grad():
        m.model.lm_head.weight.mul_(2)  # an in-place update (an optimiser step, a load): the view is taken again
    assert torch.allclose(m.visual_logits(h), 2 * before, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # weights made under inference mode (no version counter): read, not cached
        made = tiny(eol=False)
        assert torch.equal(made.visual_logits(h), made.visual_logits(h))
