"""LightningModules of the continuous (MAR-style) backbone: training on KL latents, and distilling
a cheaper draft from the frozen target (matching its denoiser outputs on shared masks and noise)."""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from specgen.backbones.mar import ShapesMAR
from specgen.modules.schedules import adamw_warmup_cosine
from specgen.utils.validate import expect_float


class _Base(L.LightningModule):
    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.net.parameters(), self.hparams.lr,
                                   self.hparams.warmup_steps, self.hparams.weight_decay, (0.9, 0.95))


class MARModule(_Base):
    """Trains a ShapesMAR on (prompt, KL latents) pairs with MAR's masked diffusion loss."""

    def __init__(self, net: ShapesMAR, lr: float = 8e-4, weight_decay: float = 0.02, warmup_steps: int = 500):
        super().__init__()
        expect_float("module.lr", lr, 0.0)
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def training_step(self, batch, batch_idx):
        loss = self.net(batch["latents"], self.net.condition(batch["prompt"]))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["prompt"]))
        return loss

    def validation_step(self, batch, batch_idx):
        self.net.train(False)
        loss = self.net(batch["latents"], self.net.condition(batch["prompt"]))
        self.log("val/loss", loss, prog_bar=True, batch_size=len(batch["prompt"]))


class MARDraftModule(_Base):
    """Distils a small ShapesMAR draft from a frozen target: on the same masked context and the same
    (x_t, t), the draft's denoiser output regresses onto the target's (epsilon and variance), plus
    `data_weight` x the draft's own diffusion loss on the data."""

    def __init__(self, net: ShapesMAR, target_dir: str, lr: float = 1e-3, weight_decay: float = 0.0,
                 warmup_steps: int = 200, data_weight: float = 0.5):
        super().__init__()
        from specgen.utils.checkpoints import load_exported

        self.save_hyperparameters(ignore=["net"])
        self.net = net
        target = load_exported(target_dir).requires_grad_(False)
        target.check_draft(net)
        self.__dict__["target"] = target  # frozen, outside the module tree: never trained or saved

    def setup(self, stage=None):
        self.target.to(self.device).eval()

    def on_fit_start(self):  # Lightning moves the module to its device after setup(): follow it
        self.target.to(self.device).eval()

    def training_step(self, batch, batch_idx):
        latents, prompts = batch["latents"], batch["prompt"]
        x0 = self.net.patchify(latents)
        B, Lq, d = x0.shape
        mask, known = self.net.random_mask(B, x0.device)
        z_d = self.net.conditions(x0, mask, self.net.condition(prompts), known)
        with torch.no_grad():
            z_t = self.target.conditions(x0, mask, self.target.condition(prompts), known)
        sel = mask.reshape(-1) > 0.5
        diff = self.net.diffusion
        x = x0.reshape(-1, d)[sel]
        t = torch.randint(0, diff.train_steps, (x.shape[0],), device=x.device)
        x_t = diff.q_sample(x, t, torch.randn_like(x))
        out_d = self.net.denoise(x_t, t, z_d.reshape(B * Lq, -1)[sel])
        with torch.no_grad():
            out_t = self.target.denoise(x_t, t, z_t.reshape(B * Lq, -1)[sel])
        distill = F.mse_loss(out_d, out_t)
        data = self.net(latents, self.net.condition(prompts)) if self.hparams.data_weight > 0 else torch.zeros(())
        loss = distill + self.hparams.data_weight * data
        self.log_dict({"train/loss": loss, "train/loss_distill": distill, "train/loss_data": data}, prog_bar=True,
                      batch_size=B)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss_data", self.net(batch["latents"], self.net.condition(batch["prompt"])), batch_size=len(batch["prompt"]))
