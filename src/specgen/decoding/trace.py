"""A decoder's public hook for measuring where its time and ops go: `Trace.region` marks each target forward and each
drafter call. Decoders take `trace=` (None: no tracing, no cost); analysis tools subclass `Trace` to time or count
inside the regions instead of patching the decoders' functions. `OpCount` is such a trace: it counts the aten ops a
decode dispatches, per target forward and per drafted token."""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from torch.utils._python_dispatch import TorchDispatchMode


class Trace:
    """Receives the regions of a decode. Kinds: "target" (one target forward; info: `positions` fed, `rows` of the
    batch, `prefill`: it fed the prompt; optional `tokens`: the token positions it computed where fewer than rows x
    positions, a packed forward) and "draft" (one drafting step; info: `what`, e.g. "right", "down",
    "redraft", "reweight"; `tokens`: the image tokens it drafts). Override `enter` and `exit` (or `region`); the
    base class does nothing."""

    def enter(self, kind: str, info: dict) -> None:
        """Called as a region starts."""

    def exit(self, kind: str, info: dict) -> None:
        """Called as a region ends (also when it raised)."""

    @contextmanager
    def region(self, kind: str, **info) -> Iterator[None]:
        self.enter(kind, info)
        try:
            yield
        finally:
            self.exit(kind, info)


class _Silent(Trace):
    """The default trace: nothing happens in a region."""

    @contextmanager
    def region(self, kind: str, **info) -> Iterator[None]:
        yield


SILENT = _Silent()


def or_silent(trace: Trace | None) -> Trace:
    """`trace`, or the silent default for None."""
    return SILENT if trace is None else trace


class _Dispatch(TorchDispatchMode):
    """Hands every aten op dispatched to `count`."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count()
        return func(*args, **(kwargs or {}))


class OpCount(Trace):
    """A trace that counts the aten ops dispatched while it is entered (`with OpCount() as ops: decode(...,
    trace=ops)`), by the innermost open region: `forwards` the ops of each target forward in order (with its
    `prefills` flags), `draft` the ops of drafting by `what`, `drafted` the tokens those regions drafted, `other`
    the ops outside every region (verification, bookkeeping, sampling). Counting is exact and does not depend on the
    device; it slows the decode (a Python call per op), so time and count in different decodes. A decoder that
    takes no trace can still be counted: its ops are all `other`."""

    def __init__(self):
        self.forwards: list[int] = []
        self.prefills: list[bool] = []
        self.draft: Counter = Counter()
        self.drafted: Counter = Counter()
        self.other = 0
        self._open: list[list] = []  # [kind, info, ops so far] of each open region, innermost last
        self._mode = _Dispatch(self._count)

    def _count(self) -> None:
        if self._open:
            self._open[-1][2] += 1
        else:
            self.other += 1

    def __enter__(self) -> "OpCount":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def enter(self, kind: str, info: dict) -> None:
        self._open.append([kind, info, 0])

    def exit(self, kind: str, info: dict) -> None:
        _, _, ops = self._open.pop()
        if kind == "target":
            self.forwards.append(ops)
            self.prefills.append(bool(info.get("prefill")))
        elif kind == "draft":
            self.draft[info.get("what", "draft")] += ops
            self.drafted[info.get("what", "draft")] += int(info.get("tokens", 0))
        elif self._open:  # an unknown kind's ops go to the region around it
            self._open[-1][2] += ops
        else:
            self.other += ops

    def summary(self, passes: int) -> dict[str, float]:
        """The counts of a decode of `passes` target passes: ops in target forwards, drafting and the rest, their
        total and per pass, the mean ops of a target forward after the prefill, and drafting's ops per drafted
        token (0 where nothing was drafted)."""
        target, draft = sum(self.forwards), sum(self.draft.values())
        total = target + draft + self.other
        steps = [n for n, pre in zip(self.forwards, self.prefills) if not pre]
        tokens = sum(self.drafted.values())
        return {"ops": total, "ops_target": target, "ops_draft": draft, "ops_other": self.other,
                "ops_per_pass": total / max(passes, 1),
                "ops_per_forward": sum(steps) / len(steps) if steps else float("nan"),
                "ops_draft_per_pass": draft / max(passes, 1), "ops_other_per_pass": self.other / max(passes, 1),
                "ops_per_drafted_token": draft / tokens if tokens else 0.0, "drafted_tokens": tokens}
