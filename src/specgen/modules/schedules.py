"""Learning-rate schedules shared by the LightningModules."""
import math

import torch


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Multiplier: linear warmup to 1, then cosine decay to `floor` at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    t = min((step - warmup) / max(total - warmup, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def adamw_warmup_cosine(module, params, lr: float, warmup_steps: int, weight_decay: float = 0.0,
                        betas=(0.9, 0.999)) -> dict:
    """configure_optimizers() result: AdamW with a per-step warmup-cosine schedule over the whole fit."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))
    fallback = max(module.trainer.estimated_stepping_batches, 1)

    def total() -> int:  # read at every step: a TimeBudget callback may shorten the fit after it started
        steps = module.trainer.max_steps
        return steps if steps and steps > 0 else fallback

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, warmup_steps, total()))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
