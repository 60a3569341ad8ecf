"""Intervals the benchmarks report."""
from __future__ import annotations

import numpy as np


def mean_ci95(values, axis: int | None = None):
    """Half-width of the 95% interval of the mean (normal approximation: 1.96 x sample std / sqrt(n)) of `values`,
    over `axis` (None: all of them); 0 where there are fewer than two values."""
    x = np.asarray(values, dtype=float)
    n = x.size if axis is None else x.shape[axis]
    if n < 2:
        return 0.0 if axis is None else np.zeros(np.delete(x.shape, axis))
    half = 1.96 * x.std(axis=axis, ddof=1) / np.sqrt(n)
    return float(half) if axis is None else half
