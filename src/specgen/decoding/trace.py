"""A decoder's public hook for measuring where its time and ops go: `Trace.region` marks each target forward and each
drafter call. Decoders take `trace=` (None: no tracing, no cost); analysis tools subclass `Trace` to time or count
inside the regions instead of patching the decoders' functions."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class Trace:
    """Receives the regions of a decode. Kinds: "target" (one target forward; info: `positions` fed, `rows` of the
    batch, `prefill`: it fed the prompt) and "draft" (one drafting step; info: `what`, e.g. "right", "down",
    "redraft", "reweight"). Override `enter` and `exit` (or `region`); the base class does nothing."""

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
