"""Every discrete decoder on a backbone that has nothing but `backbones.protocol.DiscreteBackbone`: a one-layer
attention model written here in plain torch (no transformers, no nn.Module), so a decoder that reaches past the
protocol fails. Lossless decoders must equal greedy AR token for token; the lossy ones must fill a valid grid."""
import hashlib

import pytest
import torch

from specgen.backbones.protocol import DiscreteBackbone, TokenGrid
from specgen.decoding import ar, mtp1d, sjd, specdec, ssd, zipar
from specgen.decoding.sampling import make_rngs
from specgen.drafters.fphi import FPhi
from specgen.drafters.mtp import MTPHeads

PROMPTS = ["a red circle", "two blue squares", "a cross left of a diamond"]


class FakeCache:
    """Keys, values and positions of every fed token, in feeding order."""

    def __init__(self):
        self.k = self.v = self.pos = None


class FakeBackbone:
    """One attention layer + MLP over absolute position embeddings; only the protocol's members are public."""

    def __init__(self, eol: bool, seed: int = 0, grid: int = 4, codes: int = 12, prompt_len: int = 4, width: int = 32):
        g = torch.Generator().manual_seed(seed)
        self.grid = TokenGrid(height=grid, width=grid, prefix_len=prompt_len + 1, visual_start=3, num_visual=codes,
                              eol_id=1 if eol else None, eoi_id=2)
        self.hidden_size = width
        vocab, T = 3 + codes + 40, self.grid.seq_len  # pad/BOI, end-of-row, end-of-image, codes, 40 prompt words
        self._words = 40

        def w(*shape, scale=1.0):
            return torch.randn(*shape, generator=g) * scale

        self._p = {"tok": w(vocab, width), "pos": w(T, width), "q": w(width, width, scale=width ** -0.5),
                   "k": w(width, width, scale=width ** -0.5), "v": w(width, width, scale=width ** -0.5),
                   "mlp1": w(width, 2 * width, scale=width ** -0.5), "mlp2": w(2 * width, width, scale=0.1),
                   "out": w(width, vocab, scale=20 * width ** -0.5)}  # sharp head: greedy codes vary by position

    def prompt_ids(self, prompts: list[str]) -> torch.Tensor:
        g = self.grid
        out = torch.zeros(len(prompts), g.prefix_len, dtype=torch.long)  # 0: padding
        for b, text in enumerate(prompts):
            ids = [3 + g.num_visual + int(hashlib.sha1(t.encode()).hexdigest(), 16) % self._words
                   for t in text.split()][-(g.prefix_len - 1):]
            out[b, g.prefix_len - 1 - len(ids): g.prefix_len - 1] = torch.tensor(ids)
        out[:, -1] = 0  # begin-of-image shares the padding id here
        return out

    def null_prompt_ids(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.grid.prefix_len, dtype=torch.long)

    def new_cache(self):
        return FakeCache()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._p["tok"][ids]

    def forward_hidden(self, ids, positions, cache=None, attn_mask=None):
        p = self._p
        pos = positions.unsqueeze(0).expand(ids.shape[0], -1) if positions.ndim == 1 else positions  # (B, q)
        x = self.embed(ids) + p["pos"][pos]  # (B, q, D)
        k, v = x @ p["k"], x @ p["v"]
        if cache is not None and cache.k is not None:
            k, v, kpos = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1), torch.cat([cache.pos, pos], 1)
        else:
            kpos = pos
        if cache is not None:
            cache.k, cache.v, cache.pos = k, v, kpos
        scores = (x @ p["q"]) @ k.transpose(1, 2) / self.hidden_size ** 0.5  # (B, q, S)
        if attn_mask is None:  # causal by position: a token sees every fed token at a position <= its own
            scores = scores.masked_fill(kpos[:, None, :] > pos[:, :, None], float("-inf"))
        else:
            scores = scores + attn_mask[:, 0]
        h = x + torch.softmax(scores, -1) @ v
        return h + torch.relu(h @ p["mlp1"]) @ p["mlp2"]  # pre-norm state (B, q, D)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(hidden, (self.hidden_size,)) @ self._p["out"]

    def rollback(self, cache: FakeCache, length: int) -> None:
        if cache.k is not None:
            cache.k, cache.v, cache.pos = cache.k[:, :length], cache.v[:, :length], cache.pos[:, :length]

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
    """Decoders that must reproduce greedy AR exactly, as (prompt_ids, **sampling) -> (codes, stats)."""
    def fphi():
        return noisy(lambda: FPhi(m.hidden_size, "xs"), 1)

    return {
        "ssd_exact": lambda p, **kw: ssd.generate(m, p, fphi(), exact=True, **kw),
        "ssd_rounds": lambda p, **kw: ssd.generate(m, p, fphi(), rounds=m.grid.width, **kw),  # a round per column
        "ssd_carry": lambda p, **kw: ssd.generate(m, p, fphi(), rounds=0, carry=True, **kw),
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
    assert public == {"grid", "hidden_size", "prompt_ids", "null_prompt_ids", "new_cache", "forward_hidden", "head",
                      "embed", "rollback", "decode"}
    p = m.prompt_ids(PROMPTS)
    ref, _ = ar.generate(m, p, temperature=0, use_cache=False)
    cached, st = ar.generate(m, p, temperature=0)
    assert torch.equal(ref, cached) and st["nfe"] == m.grid.num_visual_tokens
    assert len(torch.unique(ref)) > 4  # the greedy image is not one repeated code


@pytest.mark.parametrize("eol", [True, False])
@pytest.mark.parametrize("decoder", ["ssd_exact", "ssd_rounds", "ssd_carry", "sjd", "sjd_vertical", "zipar_w",
                                     "mtp1d", "specdec"])
def test_lossless_decoders_equal_greedy_ar_on_the_protocol_alone(decoder, eol):
    m = FakeBackbone(eol)
    p = m.prompt_ids(PROMPTS)
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
    p = m.prompt_ids(PROMPTS)
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
