"""LightningModule that trains the KL tokenizer; records the latent scale factor at the end of fit."""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from specgen.evaluation.reconstruction import psnr
from specgen.modules.schedules import adamw_warmup_cosine
from specgen.tokenizers.kl import KLAutoencoder
from specgen.utils.validate import expect_float


class KLModule(L.LightningModule):
    def __init__(self, net: KLAutoencoder, lr: float = 1e-3, kl_weight: float = 1e-6, l1_weight: float = 1.0,
                 warmup_steps: int = 100):
        super().__init__()
        expect_float("module.lr", lr, 0.0)
        expect_float("module.kl_weight", kl_weight, 0.0)
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def training_step(self, batch, batch_idx):
        target = batch["image"].float() / 255.0 * 2 - 1
        rec, kl = self.net(batch["image"])
        loss_mse, loss_l1 = F.mse_loss(rec, target), F.l1_loss(rec, target)
        loss = loss_mse + self.hparams.l1_weight * loss_l1 + self.hparams.kl_weight * kl.mean()
        self.log_dict({"train/loss": loss, "train/loss_mse": loss_mse, "train/kl": kl.mean()}, prog_bar=True,
                      batch_size=len(batch["image"]))
        return loss

    def validation_step(self, batch, batch_idx):
        x = batch["image"].float() / 255.0
        rec = self.net.decode(self.net.encode(batch["image"]))
        self.log("val/psnr", psnr((rec * 255).round() / 255, x).mean(), prog_bar=True, batch_size=len(x))
        mean, _ = self.net.moments(batch["image"])
        self._latent_stds.append(mean.std())
        self.log("val/latent_std", mean.std(), batch_size=len(x))

    def on_validation_epoch_start(self):
        self._latent_stds = []

    def on_validation_epoch_end(self):
        """scale_factor = 1 / std of the posterior means (as in latent diffusion), kept in the exported config."""
        if self._latent_stds and not self.trainer.sanity_checking:
            self.net.scale_factor = float(1.0 / torch.stack(self._latent_stds).mean())
        self.log("val/scale_factor", float(self.net.scale_factor))

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.net.parameters(), self.hparams.lr,
                                   self.hparams.warmup_steps, 0.0, (0.9, 0.99))
