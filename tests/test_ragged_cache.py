"""RaggedCache: rows that feed different slots in one forward, roll back and restart on their own, against a
plain causal forward of each row's whole sequence."""
import pytest
import torch

from specgen.backbones.ragged_cache import RaggedCache
from specgen.backbones.shapes_llama import ShapesLlama


def _feed(bb, cache, chunks, seqs):
    """One forward: chunks [(row, start, end, source row of seqs)], padded to the longest."""
    rows = torch.tensor([r for r, *_ in chunks])
    q = max(b - a for _, a, b, _ in chunks)
    slots = torch.full((len(chunks), q), -1)
    emb = torch.zeros(len(chunks), q, bb.hidden_size)
    for i, (_, a, b, src) in enumerate(chunks):
        slots[i, :b - a] = torch.arange(a, b)
        emb[i, :b - a] = bb.embed(seqs[src, a:b])
    cache.feed(rows, slots)
    return bb.forward_embeds(emb, slots.clamp_min(0), cache, cache.mask(slots, emb.dtype))


def test_ragged_rows_equal_a_causal_forward_of_each_row():
    torch.manual_seed(0)
    bb = ShapesLlama(preset="tiny", grid_size=4).eval()
    T = bb.grid.seq_len
    seqs = torch.randint(0, 100, (4, T))  # rows 0-2: the sequences; row 3: another one row 2 feeds, then drops
    with torch.no_grad():
        ref = bb.forward_hidden(seqs, torch.arange(T))
        cache = bb.new_ragged_cache(3, T)
        got = torch.zeros_like(ref[:3])
        _feed(bb, cache, [(0, 0, 10, 0), (1, 0, 25, 1), (2, 0, 5, 2)], seqs)
        _feed(bb, cache, [(2, 5, 20, 3)], seqs)  # row 2 feeds other tokens at 5..19, later rolled back to 5
        h = _feed(bb, cache, [(0, 10, 30, 0), (2, 5, T, 2)], seqs)
        got[0, 10:30], got[2, 5:] = h[0, :20], h[1, :T - 5]
        h = _feed(bb, cache, [(1, 25, 26, 1), (0, 30, T, 0)], seqs)
        got[1, 25], got[0, 30:] = h[0, 0], h[1, :T - 30]
        got[1, 26:] = _feed(bb, cache, [(1, 26, T, 1)], seqs)[0]
        for row, start in ((0, 10), (1, 25), (2, 5)):
            torch.testing.assert_close(got[row, start:], ref[row, start:], rtol=1e-5, atol=1e-5)
        # a row starts a new sequence at slot 0 while another keeps its entries
        h = _feed(bb, cache, [(0, 0, T, 3), (1, T - 1, T, 1)], seqs)
        torch.testing.assert_close(h[0], ref[3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h[1, 0], ref[1, T - 1], rtol=1e-5, atol=1e-5)


def test_ragged_cache_rejects_bad_feeds():
    bb = ShapesLlama(preset="tiny", grid_size=4)
    cache = bb.new_ragged_cache(2, 10)
    with pytest.raises(ValueError, match="past the cache's 10 slots"):
        cache.feed(torch.tensor([0]), torch.tensor([[9, 10]]))
    with pytest.raises(ValueError, match=r"rows \(R,\) and slots \(R, q\)"):
        cache.feed(torch.tensor([0, 1]), torch.tensor([[1, 2]]))


def test_an_alternative_written_past_its_position_sees_the_slots_below_it_and_itself():
    """mask(slots, positions=...): a token written at slot T' but at position s (an alternative to the token at s)
    gets the state of a causal forward of the row with the alternative at s, and the row's tokens are unchanged."""
    torch.manual_seed(0)
    bb = ShapesLlama(preset="tiny", grid_size=4).eval()
    T = bb.grid.seq_len
    seq = torch.randint(0, 100, (1, T))
    alt = seq.clone()
    alt[0, 12] = (seq[0, 12] + 1) % 100
    with torch.no_grad():
        ref, ref_alt = bb.forward_hidden(seq, torch.arange(T)), bb.forward_hidden(alt, torch.arange(T))
        cache = bb.new_ragged_cache(1, T + 2)
        slots = torch.cat([torch.arange(T), torch.tensor([T + 1])])[None]  # the alternative written at T + 1
        positions = torch.cat([torch.arange(T), torch.tensor([12])])[None]
        emb = bb.embed(torch.cat([seq, alt[:, 12:13]], 1))
        cache.feed(torch.tensor([0]), slots)
        h = bb.forward_embeds(emb, positions, cache, cache.mask(slots, emb.dtype, positions))
    torch.testing.assert_close(h[0, :T], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h[0, T], ref_alt[0, 12], rtol=1e-5, atol=1e-5)


def test_a_packed_forward_gives_the_padded_forwards_states():
    """forward_packed: only the real tokens through the projections and MLPs, attention over the padded grid: the
    states of a padded forward of the same feed (up to the rounding of products of another number of rows), its
    cache entries the same, and a padded forward after it (transformers' own attention) unchanged."""
    torch.manual_seed(0)
    bb = ShapesLlama(preset="tiny", grid_size=4).eval()
    T = bb.grid.seq_len
    seqs = torch.randint(0, 100, (3, T))
    chunks = [(0, 0, 10, 0), (1, 0, 3, 1), (2, 0, 7, 2)]
    with torch.no_grad():
        padded, packed = bb.new_ragged_cache(3, T), bb.new_ragged_cache(3, T)
        ref = _feed(bb, padded, chunks, seqs)
        slots = torch.full((3, 10), -1)
        index, emb, pos = [], [], []
        for r, a, b, src in chunks:
            slots[r, :b - a] = torch.arange(a, b)
            index += range(r * 10, r * 10 + b - a)
            emb.append(bb.embed(seqs[src, a:b]))
            pos += range(a, b)
        packed.feed(torch.arange(3), slots, pack=torch.tensor(index))
        got = bb.forward_packed(torch.cat(emb), torch.tensor(pos), packed, packed.mask(slots, torch.float32))
        off = 0
        for r, a, b, _ in chunks:
            torch.testing.assert_close(got[off:off + b - a], ref[r, :b - a], rtol=1e-5, atol=1e-5)
            off += b - a
        for layer_p, layer_q in zip(padded.layers, packed.layers):
            torch.testing.assert_close(layer_q.buf_k[:, :10], layer_p.buf_k[:, :10], rtol=1e-5, atol=1e-5)
        after_p = _feed(bb, padded, [(0, 10, 12, 0)], seqs)
        after_q = _feed(bb, packed, [(0, 10, 12, 0)], seqs)
        torch.testing.assert_close(after_q, after_p, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pack="):
        bb.forward_packed(torch.cat(emb), torch.tensor(pos), padded, padded.mask(slots, torch.float32))


def test_grouped_attention_gives_the_padded_forwards_states():
    """feed(groups=): attention slot by slot (a slot's rows s and s + S over their own queries and keys, views of the
    cache) gives the states of a padded forward of the same feeds, over two forwards whose slots see different
    numbers of keys; groups without a pack, or over a subset of the rows, are refused."""
    torch.manual_seed(0)
    bb = ShapesLlama(preset="tiny", grid_size=4).eval()
    T, S = bb.grid.seq_len, 2
    seqs = torch.randint(0, 100, (2 * S, T))
    feeds = [[(0, 10), (0, 4)], [(10, 13), (4, 10)]]  # per forward, per slot: the slots [a, b) its two rows feed
    with torch.no_grad():
        padded, grouped = bb.new_ragged_cache(2 * S, T), bb.new_ragged_cache(2 * S, T)
        for feed in feeds:
            chunks = [(s + r * S, a, b, s + r * S) for s, (a, b) in enumerate(feed) for r in range(2)]
            ref = _feed(bb, padded, sorted(chunks), seqs)
            q = max(b - a for a, b in feed)
            slots = torch.full((2 * S, q), -1)
            index, emb, pos = [], [], []
            for s, (a, b) in enumerate(feed):
                for r in range(2):
                    row = s + r * S
                    slots[row, :b - a] = torch.arange(a, b)
                    index += range(row * q, row * q + b - a)
                    emb.append(bb.embed(seqs[row, a:b]))
                    pos += range(a, b)
            groups = (S, [(s, b - a, b) for s, (a, b) in enumerate(feed)])
            grouped.feed(torch.arange(2 * S), slots, pack=torch.tensor(index), groups=groups)
            got = bb.forward_packed(torch.cat(emb), torch.tensor(pos), grouped, grouped.mask(slots, torch.float32))
            off = 0
            for s, (a, b) in enumerate(feed):
                for r in range(2):
                    torch.testing.assert_close(got[off:off + b - a], ref[s + r * S, :b - a], rtol=1e-5, atol=1e-5)
                    off += b - a
    with pytest.raises(ValueError, match="groups="):
        grouped.feed(torch.arange(2 * S), slots, groups=groups)
    with pytest.raises(ValueError, match="groups="):
        grouped.feed(torch.arange(S), slots[:S], pack=torch.tensor([0]), groups=groups)
