import pytest
import torch

from specgen.backbones.protocol import DiscreteBackbone
from specgen.backbones.shapes_llama import ShapesLlama
from specgen.decoding import ar
from specgen.decoding.sampling import make_rngs
from helpers import tiny_llama

PROMPTS = ["a photo of a red circle", "a large blue square in the top left , a small pink cross in the center ."]


def tiny(eol: bool, seed: int = 0) -> ShapesLlama:
    return tiny_llama(eol, seed=seed)


@pytest.mark.parametrize("eol", [True, False])
def test_cached_greedy_equals_uncached_greedy(eol):
    m = tiny(eol)
    p = m.prompts(PROMPTS)
    for scale in (1.0, 3.0):
        a, sa = ar.generate(m, p, cfg_scale=scale, temperature=0)
        b, sb = ar.generate(m, p, cfg_scale=scale, temperature=0, use_cache=False)
        assert torch.equal(a, b)
        assert len(torch.unique(a)) > 3  # not a constant image
        assert sa["nfe"] == sb["nfe"] == m.grid.height * m.grid.width


@pytest.mark.parametrize("eol", [True, False])
def test_cached_sampling_equals_uncached_sampling(eol):
    m = tiny(eol)
    p = m.prompts(PROMPTS)
    a, _ = ar.generate(m, p, cfg_scale=2.0, temperature=1.0, top_k=8, rngs=make_rngs([1, 2]))
    b, _ = ar.generate(m, p, cfg_scale=2.0, temperature=1.0, top_k=8, rngs=make_rngs([1, 2]),
                       use_cache=False)
    assert torch.equal(a, b)


def test_cfg_scale_one_equals_conditional_sampling():
    m = tiny(True)
    p = m.prompts(PROMPTS)
    a, _ = ar.generate(m, p, cfg_scale=1.0, temperature=1.0, rngs=make_rngs([5, 6]), cfg_rows=True)
    b, _ = ar.generate(m, p, cfg_scale=1.0, temperature=1.0, rngs=make_rngs([5, 6]), cfg_rows=False)
    assert torch.equal(a, b)
    c, _ = ar.generate(m, p, cfg_scale=4.0, temperature=1.0, rngs=make_rngs([5, 6]))
    assert not torch.equal(a, c)  # guidance does change the samples


def test_images_do_not_depend_on_batch_composition():
    m = tiny(True)
    both, _ = ar.generate(m, m.prompts(PROMPTS), cfg_scale=2.0, rngs=make_rngs([11, 12]))
    alone, _ = ar.generate(m, m.prompts(PROMPTS[1:]), cfg_scale=2.0, rngs=make_rngs([12]))
    assert torch.equal(both[1], alone[0])


@pytest.mark.parametrize("eol", [True, False])
def test_sequence_layout_round_trip(eol):
    m = tiny(eol)
    g = m.grid
    codes = torch.randint(0, g.num_visual, (2, g.height, g.width))
    seq = g.grid_to_sequence(codes)
    assert seq.shape[1] + g.prefix_len == g.seq_len
    assert torch.equal(g.sequence_to_grid(seq), codes)
    full = torch.cat([m.prompt_ids(PROMPTS), seq], 1)
    r, c = 3, 2
    assert full[0, g.position(r, c)] == codes[0, r, c] + g.visual_start
    assert g.row_col(g.position(r, c)) == (r, c)
    if eol:
        assert (full[:, g.position(torch.arange(g.height), g.width)] == g.eol_id).all()


def test_prenorm_hidden_goes_through_the_models_own_norm():
    m = tiny(True)
    ids = torch.cat([m.prompt_ids(PROMPTS[:1]), torch.randint(0, 24, (1, 6)) + m.grid.visual_start], 1)
    h = m.forward_hidden(ids, torch.arange(ids.shape[1]))
    ref = m.model.model.norm  # identity inside the decoder
    assert isinstance(ref, torch.nn.Identity)
    assert torch.allclose(m.head(h), m(ids), atol=1e-5)
    assert not torch.allclose(m.final_norm(h), h)  # the state is really pre-norm


def test_guided_logits_mix_the_normed_rows_before_the_projection():
    """The embedded backbone's guided logits (the two CFG rows mixed before the head's projection) equal guiding the
    logits of its own norm and head, restricted to the visual codes."""
    from specgen.decoding.sampling import guide, guided_logits

    m = tiny_llama(True)
    torch.manual_seed(0)
    torch.nn.init.normal_(m.final_norm.weight)  # a norm weight that matters
    h = torch.randn(4, 3, m.hidden_size) * 5  # [cond; uncond] rows of two images
    g = m.grid
    full = m.head(h)[..., g.visual_start: g.visual_start + g.num_visual]
    for scale in (0.0, 2.0, 3.5):
        assert torch.allclose(guided_logits(m, h, scale), guide(full, scale), atol=1e-4)


def test_rollback_then_refeed_equals_fresh_prefix():
    m = tiny(True)
    ids = torch.cat([m.prompt_ids(PROMPTS[:1]), torch.randint(0, 24, (1, 10)) + m.grid.visual_start], 1)
    n = ids.shape[1]
    cache = m.new_cache()
    m.forward_hidden(ids, torch.arange(n), cache)
    m.rollback(cache, n - 4)
    assert cache.get_seq_length() == n - 4
    h = m.forward_hidden(ids[:, n - 4:], torch.arange(n - 4, n), cache)
    fresh = m.forward_hidden(ids, torch.arange(n))
    assert torch.allclose(h, fresh[:, n - 4:], atol=1e-5)
    m.rollback(cache, n)  # no-op at the current length
    assert cache.get_seq_length() == n


def test_protocol_and_bad_inputs():
    m = tiny(True)
    assert isinstance(m, DiscreteBackbone)
    with pytest.raises(ValueError, match="unknown colour 'black'"):
        m.prompt_ids(["a black circle"])
    with pytest.raises(ValueError, match="more than max_prompt_len"):
        m.prompt_ids([" ".join(["a circle and"] * 20)])
    with pytest.raises(RuntimeError, match="attach_tokenizer"):
        m.decode(torch.zeros(1, 5, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="temperature must be a number, got 'hot'"):
        ar.generate(m, m.prompts(PROMPTS[:1]), temperature="hot")
