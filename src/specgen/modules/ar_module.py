"""LightningModule that trains the embedded AR backbone (next-token loss on visual tokens, prompt dropout).
Sampled GenEval scores during training come from a callback (`specgen.modules.callbacks.ValGenEval`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import lightning as L

from specgen.backbones.shapes_llama import ShapesLlama
from specgen.modules.schedules import adamw_warmup_cosine
from specgen.utils.validate import expect_float, expect_int


class ARModule(L.LightningModule):
    def __init__(self, net: ShapesLlama, lr: float = 1e-3, weight_decay: float = 0.05, warmup_steps: int = 500,
                 prompt_dropout: float = 0.1, betas: tuple[float, float] = (0.9, 0.95)):
        super().__init__()
        expect_float("module.lr", lr, 0.0)
        expect_float("module.prompt_dropout", prompt_dropout, 0.0, 1.0)
        expect_int("module.warmup_steps", warmup_steps, 0)
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def sequences(self, batch, drop: float = 0.0) -> torch.Tensor:
        """Whole training sequences (B, T): prompt slot (dropped to the null prompt w.p. `drop`) + image."""
        grid = self.net.grid
        prompt = self.net.prompt_ids(batch["prompt"])
        if drop > 0:
            null = self.net.null_prompt_ids(prompt.shape[0])
            mask = torch.rand(prompt.shape[0], 1, device=prompt.device) < drop
            prompt = torch.where(mask, null, prompt)
        return torch.cat([prompt, grid.grid_to_sequence(batch["codes"].to(prompt.device))], dim=1)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the visual tokens given everything before them."""
        grid = self.net.grid
        logits = self.net(ids[:, :-1])  # (B, T-1, V)
        target = ids[:, 1:]
        is_visual = (target >= grid.visual_start) & (target < grid.visual_start + grid.num_visual)
        return F.cross_entropy(logits[is_visual], target[is_visual])

    def training_step(self, batch, batch_idx):
        loss = self.loss(self.sequences(batch, self.hparams.prompt_dropout))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["prompt"]))
        return loss

    def validation_step(self, batch, batch_idx):
        n = len(batch["prompt"])
        self.log("val/loss", self.loss(self.sequences(batch)), prog_bar=True, batch_size=n)
        self.log("val/loss_uncond", self.loss(self.sequences(batch, drop=1.0)), batch_size=n)

    def configure_optimizers(self):
        decay = [p for p in self.net.parameters() if p.ndim >= 2]  # no weight decay on norms and biases
        no_decay = [p for p in self.net.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return adamw_warmup_cosine(self, groups, self.hparams.lr, self.hparams.warmup_steps, betas=self.hparams.betas)
