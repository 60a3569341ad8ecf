"""Every discrete decoder on a backbone that has nothing but `backbones.protocol.DiscreteBackbone`: a one-layer
attention model written here in plain torch (no transformers, no nn.Module), so a decoder that reaches past the
protocol fails. Like the real models, its prompts vary in length (left-padded per batch, with its own shorter
unconditional prompt) and its visual codes have their own embedding and head (no shared vocabulary). Lossless
decoders must equal greedy AR token for token; the lossy ones must fill a valid grid."""
import hashlib

import pytest
import torch

from specgen.backbones.protocol import DiscreteBackbone, Prompts, TokenGrid
from specgen.decoding import ar, mtp1d, sjd, specdec, ssd, ssd_carry, zipar
from specgen.decoding.sampling import make_rngs
from specgen.drafters.fphi import FPhi
from specgen.drafters.mtp import MTPHeads

PROMPTS = ["a red circle", "two blue squares", "a cross left of a diamond"]
PAD, BOI, EOL, WORDS = 0, 1, 2, 40


class FakeCache:
    """Keys, values, slots, position ids and key validity of every fed token, in feeding order."""

    def __init__(self, rows):
        self.rows = rows
        self.k = self.v = self.slot = self.valid = None


class FakeBackbone:
    """One attention layer + MLP over absolute position embeddings; only the protocol's members are public."""

    def __init__(self, eol: bool, seed: int = 0, height: int = 4, width: int = 4, codes: int = 12, hidden: int = 32):
        g = torch.Generator().manual_seed(seed)
        self.grid = TokenGrid(height=height, width=width, prefix_len=0, visual_start=0, num_visual=codes,
                              eol_id=EOL if eol else None)
        self.hidden_size, self.identity = hidden, f"fake{seed}"
        positions = 16 + height * (width + 1)

        def w(*shape, scale=1.0):
            return torch.randn(*shape, generator=g) * scale

        d = hidden
        self._p = {"tok": w(3 + WORDS, d), "vis": w(codes, d), "pos": w(positions, d), "q": w(d, d, scale=d ** -0.5),
                   "k": w(d, d, scale=d ** -0.5), "v": w(d, d, scale=d ** -0.5), "mlp1": w(d, 2 * d, scale=d ** -0.5),
                   "mlp2": w(2 * d, d, scale=0.1), "out": w(d, codes, scale=20 * d ** -0.5)}  # sharp head

    @property
    def device(self):
        return torch.device("cpu")

    @property
    def dtype(self):
        return torch.float32

    def prompts(self, texts: list[str]) -> Prompts:
        words = [[3 + int(hashlib.sha1(t.encode()).hexdigest(), 16) % WORDS for t in text.split()][-12:]
                 for text in texts]
        return Prompts(tuple(texts), tuple(tuple(ids) + (BOI,) for ids in words), ((BOI,),) * len(texts), PAD)

    def new_cache(self, rows, static: bool = False):
        return FakeCache(rows)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self._p["tok"][ids]

    def embed_visual(self, codes: torch.Tensor) -> torch.Tensor:
        return self._p["vis"][codes]

    def forward_embeds(self, embeds, slots, cache, attn_mask=None):
        p, rows = self._p, cache.rows
        slots = slots.expand(embeds.shape[0], -1) if slots.ndim == 1 else slots  # (B, q)
        valid = torch.where(slots < rows.length, rows.mask.gather(1, slots.clamp_max(rows.length - 1)), True)
        x = embeds + p["pos"][rows.positions(slots)]  # (B, q, D)
        k, v = x @ p["k"], x @ p["v"]
        if cache.k is not None:
            k, v = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
            kslot, kvalid = torch.cat([cache.slot, slots], 1), torch.cat([cache.valid, valid], 1)
        else:
            kslot, kvalid = slots, valid
        cache.k, cache.v, cache.slot, cache.valid = k, v, kslot, kvalid
        scores = (x @ p["q"]) @ k.transpose(1, 2) / self.hidden_size ** 0.5  # (B, q, S)
        if attn_mask is None:  # causal by slot: a token sees every fed token at a slot <= its own
            scores = scores.masked_fill(kslot[:, None, :] > slots[:, :, None], float("-inf"))
        else:
            scores = scores + attn_mask[:, 0]
        scores = scores.masked_fill(~kvalid[:, None, :], float("-inf"))  # padding is never seen
        h = x + torch.softmax(scores, -1) @ v
        return h + torch.relu(h @ p["mlp1"]) @ p["mlp2"]  # pre-norm state (B, q, D)

    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(hidden, (self.hidden_size,)) @ self._p["out"]

    def rollback(self, cache: FakeCache, length: int) -> None:
        if cache.k is not None:
            cache.k, cache.v = cache.k[:, :length], cache.v[:, :length]
            cache.slot, cache.valid = cache.slot[:, :length], cache.valid[:, :length]

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        img = (codes.float() / (self.grid.num_visual - 1))[:, None].expand(-1, 3, -1, -1)  # (B, 3, H, W)
        return img.repeat_interleave(4, 2).repeat_interleave(4, 3)


def noisy(make, seed: int):
    """A drafter `make()` with random last layers (an imperfect drafter: many rejections), the same for a seed."""
    torch.manual_seed(seed)
    module = make()
    for net in module.nets.values():
        torch.nn.init.normal_(net[-1].weight, std=0.05)
    return module


def lossless(m: FakeBackbone) -> dict:
    """Decoders that must reproduce greedy AR exactly, as (prompts, **sampling) -> (codes, stats)."""
    def fphi():
        return noisy(lambda: FPhi(m.hidden_size, "xs"), 1)

    return {
        "ssd_exact": lambda p, **kw: ssd.generate(m, p, fphi(), exact=True, **kw),
        "ssd_rounds": lambda p, **kw: ssd.generate(m, p, fphi(), rounds=m.grid.width, **kw),  # a round per column
        "ssd_carry": lambda p, **kw: ssd_carry.generate(m, p, fphi(), **kw),
        "ssd_carry_window": lambda p, **kw: ssd_carry.generate(m, p, fphi(), rounds=1, max_window_rows=2, **kw),
        "sjd": lambda p, **kw: sjd.generate(m, p, window=5, **kw),
        "sjd_vertical": lambda p, **kw: sjd.generate(m, p, window=5, init="vertical", **kw),
        "zipar_w": lambda p, **kw: zipar.generate(m, p, window=m.grid.width, **kw),
        "mtp1d": lambda p, **kw: mtp1d.generate(m, p, noisy(lambda: MTPHeads(m.hidden_size, 3), 2), **kw),
        "specdec": lambda p, **kw: specdec.generate(m, p, FakeBackbone(m.grid.eol_id is not None, seed=7), window=3,
                                                    **kw),
    }


def test_the_fake_is_a_discrete_backbone_and_nothing_more():
    m = FakeBackbone(eol=True)
    assert isinstance(m, DiscreteBackbone)
    public = {n for n in dir(m) if not n.startswith("_")}
    assert public == {"grid", "hidden_size", "identity", "device", "dtype", "prompts", "new_cache", "embed_tokens",
                      "embed_visual", "forward_embeds", "visual_logits", "rollback", "decode"}
    p = m.prompts(PROMPTS)
    rows = p.rows(True)
    assert rows.ids.shape == (6, 7) and rows.padded  # prompts of 4, 4 and 7 tokens; unconditional ones of 1
    ref, _ = ar.generate(m, p, temperature=0, use_cache=False)
    cached, st = ar.generate(m, p, temperature=0)
    assert torch.equal(ref, cached) and st["nfe"] == m.grid.num_visual_tokens
    assert len(torch.unique(ref)) > 4  # the greedy image is not one repeated code


def test_padding_is_invisible_an_image_does_not_depend_on_its_batch():
    m = FakeBackbone(eol=True)
    both, _ = ar.generate(m, m.prompts(PROMPTS), cfg_scale=3.0, temperature=0)
    for i, text in enumerate(PROMPTS):
        alone, _ = ar.generate(m, m.prompts([text]), cfg_scale=3.0, temperature=0)
        assert torch.equal(alone[0], both[i]), text
    with pytest.raises(TypeError, match=r"backbone.prompts\(texts\)"):
        ar.generate(m, torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("eol", [True, False])
@pytest.mark.parametrize("decoder", ["ssd_exact", "ssd_rounds", "ssd_carry", "ssd_carry_window", "sjd", "sjd_vertical",
                                     "zipar_w", "mtp1d", "specdec"])
def test_lossless_decoders_equal_greedy_ar_on_the_protocol_alone(decoder, eol):
    m = FakeBackbone(eol)
    p = m.prompts(PROMPTS)
    for scale in (1.0, 3.0):
        ref, st_ar = ar.generate(m, p, cfg_scale=scale, temperature=0)
        out, st = lossless(m)[decoder](p, cfg_scale=scale, temperature=0)
        assert torch.equal(out, ref), (decoder, scale)
        assert st["nfe"] <= st_ar["nfe"] + 1  # at least one token per pass (an unrelated draft may add one)


@pytest.mark.parametrize("eol", [True, False])
def test_lossy_decoders_fill_a_valid_grid_in_fewer_passes(eol):
    """SSD at the paper's r = 2 and ZipAR with a short window are not lossless: they must still fill every
    token with a valid code, sampled reproducibly, in fewer target passes than AR."""
    m = FakeBackbone(eol)
    p = m.prompts(PROMPTS)
    _, st_ar = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    fphi = noisy(lambda: FPhi(m.hidden_size, "xs"), 1)
    runs = {"ssd": lambda rngs: ssd.generate(m, p, fphi, cfg_scale=3.0, rounds=2, rngs=rngs),
            "zipar": lambda rngs: zipar.generate(m, p, cfg_scale=3.0, window=2, rngs=rngs)}
    for name, run in runs.items():
        codes, st = run(make_rngs([0, 1, 2]))
        again, _ = run(make_rngs([0, 1, 2]))
        assert codes.shape == (3, 4, 4) and codes.min() >= 0 and codes.max() < m.grid.num_visual, name
        assert torch.equal(codes, again), name
        assert st["nfe"] < st_ar["nfe"], name
    decoded = m.decode(codes)
    assert decoded.shape == (3, 3, 16, 16) and 0 <= float(decoded.min()) and float(decoded.max()) <= 1


def test_target_states_are_kept_for_a_few_rows_on_emu3s_layout():
    """Emu3's grid (90 x 90 codes, an end-of-line token per row: 8190 image slots) at a tiny width: the decoder state
    holds the target's states for the rows drafts and checks read, not the whole sequence."""
    m = FakeBackbone(eol=True, height=90, width=90, codes=16, hidden=8)
    p = m.prompts(PROMPTS[:1])
    fphi = noisy(lambda: FPhi(m.hidden_size, "xs"), 1)
    stride = m.grid.stride
    for decode, kw in ((ssd_carry.generate, {"rounds": 1, "max_window_rows": 2}), (ssd.generate, {"rounds": 2})):
        codes, st = decode(m, p, fphi, cfg_scale=3.0, rngs=make_rngs([0]), **kw)
        assert codes.shape == (1, 90, 90) and int(codes.max()) < 16
        dense = m.grid.height * stride
        assert st["state_slots"] <= 4 * stride, (kw, st["state_slots"], dense)  # a few rows of 91 slots, not 8190


def test_sjd_keeps_target_distributions_for_its_window_on_emu3s_layout():
    """Emu3's grid (90 x 90 codes + end-of-line) at a tiny width: SJD holds the target distributions of its Jacobi
    window (at most twice window + 1 indices: the buffer grows by doubling), not (B, 8100, V); at Emu3's 32768 codes
    that is 4.5 MB instead of 1.06 GB per image."""
    m = FakeBackbone(eol=True, height=90, width=90, codes=16, hidden=8)
    window = 16  # SJD's default
    codes, st = sjd.generate(m, m.prompts(PROMPTS[:1]), cfg_scale=3.0, rngs=make_rngs([0]), window=window,
                             init="vertical")
    assert codes.shape == (1, 90, 90) and int(codes.max()) < 16
    assert window + 1 <= st["dist_slots"] <= 2 * (window + 1), st["dist_slots"]  # of 8100 indices
    assert st["state_slots"] <= 4 * m.grid.stride, st["state_slots"]
