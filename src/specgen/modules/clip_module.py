"""LightningModule that trains the small open_clip model used for CLIPScore on shapes-world pairs."""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from specgen.modules.schedules import adamw_warmup_cosine
from specgen.utils.validate import expect_float

# open_clip's (OpenAI) normalisation, so that open_clip's own preprocess matches training
MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)


class ClipModule(L.LightningModule):
    def __init__(self, net, model_name: str = "shapes-clip", lr: float = 1e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 100):
        super().__init__()
        expect_float("module.lr", lr, 0.0)
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        import open_clip  # deferred, as in evaluation.clipscore: seconds to import

        self.tokenizer = open_clip.get_tokenizer(model_name)

    def _logits(self, batch) -> torch.Tensor:
        x = (batch["image"].float() / 255.0 - MEAN.to(self.device)) / STD.to(self.device)
        img = F.normalize(self.net.encode_image(x), dim=-1)
        txt = F.normalize(self.net.encode_text(self.tokenizer(batch["prompt"]).to(self.device)), dim=-1)
        return self.net.logit_scale.exp().clamp_max(100) * img @ txt.t()  # (B, B)

    def _loss(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.arange(logits.shape[0], device=logits.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        return loss, (logits.argmax(1) == labels).float().mean()

    def training_step(self, batch, batch_idx):
        loss, acc = self._loss(self._logits(batch))
        self.log_dict({"train/loss": loss, "train/acc_i2t": acc}, prog_bar=True, batch_size=len(batch["prompt"]))
        return loss

    def validation_step(self, batch, batch_idx):
        loss, acc = self._loss(self._logits(batch))
        self.log_dict({"val/loss": loss, "val/acc_i2t": acc}, prog_bar=True, batch_size=len(batch["prompt"]))

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.net.parameters(), self.hparams.lr,
                                   self.hparams.warmup_steps, self.hparams.weight_decay, (0.9, 0.999))
