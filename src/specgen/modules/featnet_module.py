"""LightningModule that trains the shapes feature net (FID/IS/KID features) on rendered scenes."""
from __future__ import annotations

import json

import lightning as L
import torch
import torch.nn.functional as F

from specgen.evaluation.feature_net import NUM_CLASSES, ShapesFeatureNet, class_index
from specgen.modules.schedules import adamw_warmup_cosine
from specgen.utils.validate import expect_float


def targets(scenes: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest object's class (B,), present classes multi-hot (B, C)) from scene JSON strings."""
    main, present = [], torch.zeros(len(scenes), NUM_CLASSES, device=device)
    for b, text in enumerate(scenes):
        objs = json.loads(text)["objects"]
        big = max(objs, key=lambda o: (o["size"] == "large", -objs.index(o)))
        main.append(class_index(big["shape"], big["color"]))
        for o in objs:
            present[b, class_index(o["shape"], o["color"])] = 1.0
    return torch.tensor(main, device=device), present


class FeatNetModule(L.LightningModule):
    def __init__(self, net: ShapesFeatureNet, lr: float = 2e-3, warmup_steps: int = 50):
        super().__init__()
        expect_float("module.lr", lr, 0.0)
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def _step(self, batch, stage: str):
        main, present = targets(batch["scene"], self.device)
        _, main_logits, present_logits = self.net(batch["image"])
        loss_main = F.cross_entropy(main_logits, main)
        loss_present = F.binary_cross_entropy_with_logits(present_logits, present)
        n = len(batch["scene"])
        self.log_dict({f"{stage}/loss_main": loss_main, f"{stage}/loss_present": loss_present,
                       f"{stage}/acc_main": (main_logits.argmax(1) == main).float().mean(),
                       f"{stage}/acc_present": ((present_logits > 0) == (present > 0.5)).all(1).float().mean()},
                      batch_size=n, prog_bar=stage == "val")
        return loss_main + loss_present

    def training_step(self, batch, batch_idx):
        loss = self._step(batch, "train")
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["scene"]))
        return loss

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.net.parameters(), self.hparams.lr,
                                   self.hparams.warmup_steps, 0.01, (0.9, 0.999))
