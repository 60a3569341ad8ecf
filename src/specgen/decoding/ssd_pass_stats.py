"""Where the carry window's passes go (`ssd_window.CarryWindow`), per image: tokens judged fresh (proposal q) or
carried (proposal: the last p) and how many of each changed, tokens finalised, passes whose first change fell on a
fresh draft, cascades (passes that finalised only their first token), and change rates by distance from the
window's first token."""
from __future__ import annotations

import torch

KEYS = ("fresh", "fresh_changed", "carried", "carried_changed", "finalised", "first_on_fresh", "changed",
        "unchecked", "single", "after", "after_changed", "sibling_hits")


class PassStats:
    """Per-image counts of B images on rows of `width` tokens; `counts[key][b]` may also be added to directly (a
    sibling's judgement, tokens kept by a row cap)."""

    def __init__(self, B: int, width: int, device):
        self.counts = {k: torch.zeros(B, device=device) for k in KEYS}
        # cascades: tokens judged and changed by their distance from the window's first token (the one after the last
        # pass's first change), fresh [0] and carried [1]; distances from 2W on share the last bin
        self.by_distance = torch.zeros(B, 2, 2, 2 * width, device=device)  # (B, fresh/carried, judged/changed, d)
        self.last_changed = torch.zeros(B, dtype=torch.bool, device=device)  # the image's last pass changed a token

    def record(self, b: int, fresh: torch.Tensor, changed: torch.Tensor, first: int) -> None:
        """Add image b's pass: which of its judged tokens (in window order) were fresh and which changed, and the
        index of the last token the pass finalised (its first change, or its last token)."""
        c = self.counts
        c["fresh"][b] += fresh.sum()
        c["fresh_changed"][b] += (changed & fresh).sum()
        c["carried"][b] += (~fresh).sum()
        c["carried_changed"][b] += (changed & ~fresh).sum()
        c["finalised"][b] += first + 1
        if changed.any():
            c["changed"][b] += 1
            c["first_on_fresh"][b] += fresh[first].float()
        if self.last_changed[b]:  # the window's first token follows the last pass's first change
            c["after"][b] += 1
            c["after_changed"][b] += changed[0].float()
        c["single"][b] += changed[0].float()  # the pass finalised only its first token, which changed
        self.last_changed[b] = changed.any()
        d = torch.arange(fresh.numel(), device=fresh.device).clamp_max(self.by_distance.shape[-1] - 1)
        kind = (~fresh).long()  # 0 fresh, 1 carried
        self.by_distance[b, :, 0].index_put_((kind, d), torch.ones_like(d, dtype=torch.float), accumulate=True)
        self.by_distance[b, :, 1].index_put_((kind, d), changed.float(), accumulate=True)

    def summary(self, passes: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B,) per image, given its passes: change rates of fresh drafts and of carried tokens, tokens finalised per
        pass, the share of passes with a change whose first change (what ends the pass's progress) was a fresh draft;
        cascades: the share of passes that finalised only their first token (it changed; mostly the token after the
        last pass's first change, judged again given its new left neighbour), and how often that token changes after
        a pass with a change; (B, 2, 2, 2W) `change_by_distance`: tokens judged [.., 0, d] and changed [.., 1, d],
        fresh [:, 0] and carried [:, 1], by their distance d from the window's first token (from 2W on, the last
        bin)."""
        c, div, n = self.counts, lambda a, b: a / b.clamp_min(1), passes.float()  # noqa: E731
        return {"fresh_change_rate": div(c["fresh_changed"], c["fresh"]),
                "carried_change_rate": div(c["carried_changed"], c["carried"]),
                "final_per_pass": div(c["finalised"], n),
                "first_change_fresh": div(c["first_on_fresh"], c["changed"]),
                "single_token_passes": div(c["single"], n),
                "after_change_rate": div(c["after_changed"], c["after"]),
                "change_by_distance": self.by_distance.clone(),
                "unchecked_tokens": c["unchecked"].clone(),
                "sibling_hits": div(c["sibling_hits"], n)}
