"""How the carry window judges its tokens (`acceptance:` of `ssd_carry.generate`), one class per rule, each with its
own parameters. `bind(st)` gives the judgement of one generation: (tokens (1, n), p (1, n, V), q (1, n, V), fresh
(1, n), generators) -> (tokens, accepted), (1, n) each; `fresh` marks drafts not judged before, the rest are tokens
carried from an earlier pass (their proposal: that pass's p); a rule with `reads_fresh` false is given None."""
from __future__ import annotations

from typing import Callable

import torch

from specgen.decoding.sampling import (accept_or_resample, accept_or_resample_drawn, code_neighbours, relaxed_accept,
                                       typical_accept, uniform)
from specgen.decoding.state import SpecState
from specgen.utils.validate import expect_float, expect_int

Judge = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class Speculative:
    """The paper's test: keep t ~ q with probability min(1, p(t)/q(t)), else draw from norm(max(0, p - q))."""

    reads_fresh = False  # fresh drafts and carried tokens are judged alike (`fresh` may be None)

    def bind(self, st: SpecState) -> Judge:
        return lambda tokens, p, q, fresh, gens: accept_or_resample(tokens, p, q, gens)

    @staticmethod
    def together(items: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The judgements of several images' windows in one call: `items` are the judgement's arguments (tokens
        (1, n), p, q (1, n, V), fresh, generators), one generator each; each image's draws are its own, made as its
        judgement alone makes them, so every token equals its judgement alone. None where an item has no generator
        of its own (draws from the global stream: their order would change)."""
        if any(gens is None or len(gens) != 1 for *_, gens in items):
            return None
        dev, sizes = items[0][0].device, [tokens.shape[1] for tokens, *_ in items]
        keep = [uniform((1, n), gens, dev) for n, (*_, gens) in zip(sizes, items)]
        redraw = [uniform((1, n, 1), gens, dev) for n, (*_, gens) in zip(sizes, items)]
        cat = lambda i: torch.cat([item[i] for item in items], 1)  # noqa: E731
        tokens, accepted = accept_or_resample_drawn(cat(0), cat(1), cat(2), torch.cat(keep, 1), torch.cat(redraw, 1))
        return list(zip(tokens.split(sizes, 1), accepted.split(sizes, 1)))


class _Relaxed:
    """A rule that is not the speculative test; `carried_only`: fresh drafts keep the speculative test and only
    carried tokens are judged by this rule."""

    def __init__(self, carried_only: bool = False):
        self.carried_only = carried_only
        self.reads_fresh = carried_only

    def _judge(self, st: SpecState) -> Judge:
        raise NotImplementedError

    def bind(self, st: SpecState) -> Judge:
        judge = self._judge(st)
        if not self.carried_only:
            return judge

        def mixed(tokens, p, q, fresh, gens):
            out = judge(tokens, p, q, fresh, gens)  # drawn first: the carried tokens' rule
            spec = accept_or_resample(tokens, p, q, gens)
            return torch.where(fresh, spec[0], out[0]), torch.where(fresh, spec[1], out[1])
        return mixed


class Typical(_Relaxed):
    """Medusa's typical acceptance (a baseline beyond the paper; not lossless): keep t when
    p(t) > min(epsilon, delta * exp(-H(p))), else draw from p. Medusa's defaults: epsilon 0.09, delta 0.3."""

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3, carried_only: bool = False):
        super().__init__(carried_only)
        self.epsilon, self.delta = expect_float("epsilon", epsilon, 0.0), expect_float("delta", delta, 0.0)

    def _judge(self, st: SpecState) -> Judge:
        return lambda tokens, p, q, fresh, gens: typical_accept(tokens, p, self.epsilon, self.delta, gens)


class Latent(_Relaxed):
    """LANTERN's relaxed test (Jang et al. 2025; a baseline beyond the paper, not lossless): p(t) in the speculative
    test gains the mass p gives t's `k` nearest codes in the tokenizer's latent space, nearest first, at most
    `delta` (each judgement moves at most delta of p's mass; LANTERN: 0.1-0.4)."""

    def __init__(self, k: int = 16, delta: float = 0.1, carried_only: bool = False):
        super().__init__(carried_only)
        self.k, self.delta = expect_int("k", k, 1), expect_float("delta", delta, 0.0)
        if delta >= 1:
            raise ValueError(f"delta={delta} would let a judgement move all of p's mass; use 0 <= delta < 1 "
                             f"(LANTERN's 0.1-0.4)")

    def _judge(self, st: SpecState) -> Judge:
        embeddings = getattr(st.bb, "code_embeddings", None)  # optional part of a backbone: the tokenizer's codebook
        if embeddings is None:
            raise ValueError(f"acceptance Latent needs the tokenizer's codebook, and {type(st.bb).__name__} has no "
                             f"code_embeddings(); use acceptance Speculative")
        neighbours = code_neighbours(embeddings(), self.k).to(st.seq.device)  # (V, k), once per generation
        return lambda tokens, p, q, fresh, gens: relaxed_accept(tokens, p, q, neighbours, self.delta, gens)
