"""LightningModule that trains the VQ tokenizer on shapes-world images."""
from __future__ import annotations

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from specgen.evaluation.reconstruction import objects_recovered, psnr
from specgen.modules.schedules import adamw_warmup_cosine
from specgen.tokenizers.vq import VQAutoencoder
from specgen.utils.validate import expect_float, expect_int


class VQModule(L.LightningModule):
    def __init__(self, net: VQAutoencoder, lr: float = 1e-3, commit_weight: float = 0.25,
                 l1_weight: float = 1.0, warmup_steps: int = 100):
        super().__init__()
        expect_float("module.lr", lr, 0.0)
        expect_int("module.warmup_steps", warmup_steps, 0)
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def training_step(self, batch, batch_idx):
        x = batch["image"].float() / 255.0
        rec, codes, commit = self.net(batch["image"])
        target = x * 2 - 1
        loss_mse = F.mse_loss(rec, target)
        loss_l1 = F.l1_loss(rec, target)
        loss = loss_mse + self.hparams.l1_weight * loss_l1 + self.hparams.commit_weight * commit
        used = torch.bincount(codes.view(-1), minlength=self.net.num_codes).float()
        p = used / used.sum()
        perplexity = torch.exp(-(p * torch.log(p.clamp_min(1e-10))).sum())
        self.log_dict({"train/loss": loss, "train/loss_mse": loss_mse, "train/loss_commit": commit,
                       "train/code_perplexity": perplexity}, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x = batch["image"].float() / 255.0
        rec = self.net.decode(self.net.encode(batch["image"]))
        rec_u8 = (rec * 255).round().to(torch.uint8)
        matched, total = objects_recovered(rec_u8, batch["scene"], self.net.image_size)
        self.log("val/psnr", psnr(rec_u8.float() / 255.0, x).mean(), prog_bar=True)
        self.log("val/parser_acc", matched / max(total, 1), prog_bar=True)
        if batch_idx == 0:
            self._log_images(batch["image"][:8], rec_u8[:8])

    def _log_images(self, real: torch.Tensor, rec: torch.Tensor):
        grid = torch.cat([torch.cat(list(real), 2), torch.cat(list(rec), 2)], 1)  # (3, 2S, 8S) uint8
        for logger in self.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image("val/reconstructions", [grid.permute(1, 2, 0).cpu().numpy().astype(np.uint8)],
                                 step=self.global_step)

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.net.parameters(), self.hparams.lr,
                                   self.hparams.warmup_steps, 0.0, (0.9, 0.99))

