"""Where the carry window's passes go (`ssd_carry.window.CarryWindow`), per image: tokens judged fresh (proposal q) or
carried (proposal: the last p) and how many of each changed, tokens finalised, passes whose first change fell on a
fresh draft, cascades (passes that finalised only their first token), and change rates by distance from the
window's first token."""
from __future__ import annotations

import torch

KEYS = ("fresh", "fresh_changed", "carried", "carried_changed", "finalised", "first_on_fresh", "changed", "single",
        "after", "after_changed")


class PassStats:
    """Per-image counts of B images on rows of `width` tokens."""

    def __init__(self, B: int, width: int, device):
        self.counts = {k: torch.zeros(B, device=device) for k in KEYS}
        # cascades: tokens judged and changed by their distance from the window's first token (the one after the last
        # pass's first change), fresh [0] and carried [1]; distances from 2W on share the last bin
        self.by_distance = torch.zeros(B, 2, 2, 2 * width, device=device)  # (B, fresh/carried, judged/changed, d)
        self.last_changed = torch.zeros(B, dtype=torch.bool, device=device)  # the image's last pass changed a token
        self.log: dict[int, list[tuple[list[bool], torch.Tensor, int]]] = {}  # passes recorded, not counted yet

    def record(self, b: int, fresh: list[bool], changed: torch.Tensor, first: int) -> None:
        """Add image b's pass: which of its judged tokens (in window order) were fresh (a list) and which changed
        ((1, n)), and the index of the last token the pass finalised (its first change, or its last token). Kept as
        it is and counted when the statistics are read (`flush`): counting per pass cost about 70 small ops a pass."""
        self.log.setdefault(b, []).append((fresh, changed, first))

    def flush(self) -> None:
        """Count the recorded passes, each image's in one go (the same counts as pass by pass, in pass order)."""
        c, W2 = self.counts, self.by_distance.shape[-1]
        for b, passes in self.log.items():
            changed = torch.cat([ch for _, ch, _ in passes], 1).view(-1)  # (1, n) a pass
            fresh = torch.tensor([x for f, _, _ in passes for x in f], dtype=torch.bool, device=changed.device)
            lens = torch.tensor([len(f) for f, _, _ in passes], device=fresh.device)
            starts = lens.cumsum(0) - lens  # each pass's first token in the flat order
            which = torch.repeat_interleave(torch.arange(len(passes), device=fresh.device), lens)
            any_ = torch.zeros(len(passes), device=fresh.device).index_add_(0, which, changed.float()) > 0
            firsts = starts + torch.tensor([first for _, _, first in passes], device=fresh.device)
            before = torch.cat([self.last_changed[b:b + 1], any_[:-1]])  # the image's previous pass changed a token
            c["fresh"][b] += fresh.sum()
            c["fresh_changed"][b] += (changed & fresh).sum()
            c["carried"][b] += (~fresh).sum()
            c["carried_changed"][b] += (changed & ~fresh).sum()
            c["finalised"][b] += sum(first + 1 for _, _, first in passes)
            c["changed"][b] += any_.sum()
            c["first_on_fresh"][b] += (fresh[firsts] & any_).sum()
            c["after"][b] += before.sum()
            c["after_changed"][b] += (changed[starts] & before).sum()
            c["single"][b] += changed[starts].sum()  # passes that finalised only their first token, which changed
            self.last_changed[b] = any_[-1]
            d = (torch.arange(fresh.numel(), device=fresh.device) - starts[which]).clamp_max(W2 - 1)
            kind = (~fresh).long()  # 0 fresh, 1 carried
            self.by_distance[b, :, 0].index_put_((kind, d), torch.ones_like(d, dtype=torch.float), accumulate=True)
            self.by_distance[b, :, 1].index_put_((kind, d), changed.float(), accumulate=True)
        self.log = {}

    def summary(self, passes: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B,) per image, given its passes: change rates of fresh drafts and of carried tokens, tokens finalised per
        pass, the share of passes with a change whose first change (what ends the pass's progress) was a fresh draft;
        cascades: the share of passes that finalised only their first token (it changed; mostly the token after the
        last pass's first change, judged again given its new left neighbour), and how often that token changes after
        a pass with a change; (B, 2, 2, 2W) `change_by_distance`: tokens judged [.., 0, d] and changed [.., 1, d],
        fresh [:, 0] and carried [:, 1], by their distance d from the window's first token (from 2W on, the last
        bin)."""
        self.flush()
        c, div, n = self.counts, lambda a, b: a / b.clamp_min(1), passes.float()  # noqa: E731
        return {"fresh_change_rate": div(c["fresh_changed"], c["fresh"]),
                "carried_change_rate": div(c["carried_changed"], c["carried"]),
                "final_per_pass": div(c["finalised"], n),
                "first_change_fresh": div(c["first_on_fresh"], c["changed"]),
                "single_token_passes": div(c["single"], n),
                "after_change_rate": div(c["after_changed"], c["after"]),
                "change_by_distance": self.by_distance.clone()}
