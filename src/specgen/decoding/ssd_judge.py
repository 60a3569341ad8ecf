"""How SSD's carry window judges its tokens (`CarryRule.acceptance`, documented there): the paper's speculative test,
or beyond it a rule for every window token ("typical", "latent") or for carried tokens only, fresh drafts keeping the
speculative test ("typical_carried", "latent_carried")."""
from __future__ import annotations

import torch

from specgen.decoding.sampling import accept_or_resample, code_neighbours, relaxed_accept, typical_accept
from specgen.decoding.state import SpecState

RULES = ("speculative", "typical", "typical_carried", "latent", "latent_carried")
_CARRIED_ONLY = {"typical_carried": "typical", "latent_carried": "latent"}


def judge(st: SpecState, rule, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, fresh: torch.Tensor | None,
          gens) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge window tokens (1, n) against the pass's p (1, n, V), each drawn from its proposal q (1, n, V); `fresh`
    (1, n) marks drafts not judged before (None: every token is carried). Returns (tokens, accepted), (1, n) each."""
    name = rule.acceptance
    if name == "speculative":
        return accept_or_resample(tokens, p, q, gens)
    base = _CARRIED_ONLY.get(name, name)
    if base == "typical":
        out = typical_accept(tokens, p, rule.typical_epsilon, rule.typical_delta, gens)
    else:
        out = relaxed_accept(tokens, p, q, neighbours(st, rule.latent_k), rule.latent_delta, gens)
    if base == name or fresh is None:
        return out
    spec = accept_or_resample(tokens, p, q, gens)  # fresh drafts keep the speculative test
    return torch.where(fresh, spec[0], out[0]), torch.where(fresh, spec[1], out[1])


def neighbours(st: SpecState, k: int) -> torch.Tensor:
    """The relaxed test's neighbours: each code's k nearest codes in the tokenizer's latent space (V, k), from the
    backbone's `code_embeddings()`, once per generation."""
    if "code_neighbours" not in st.memo:
        embeddings = getattr(st.bb, "code_embeddings", None)
        if embeddings is None:
            raise ValueError(f"acceptance=latent needs the tokenizer's codebook, and {type(st.bb).__name__} has no "
                             f"code_embeddings(); use acceptance=speculative")
        st.memo["code_neighbours"] = code_neighbours(embeddings(), k).to(st.seq.device)
    return st.memo["code_neighbours"]
