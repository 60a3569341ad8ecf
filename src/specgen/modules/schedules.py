"""Learning-rate schedules shared by the LightningModules."""
import math


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Multiplier: linear warmup to 1, then cosine decay to `floor` at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    t = min((step - warmup) / max(total - warmup, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
