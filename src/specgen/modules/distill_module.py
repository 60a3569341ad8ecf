"""LightningModule that distils a drafter (f_phi or 1D multi-token heads) from a frozen backbone.

The drafter predicts the teacher's pre-norm state `offset` positions ahead; the loss is a feature
regression (error relative to the target's RMS) plus `kl_weight` x KL(teacher head || drafted head)
over visual codes, both through the backbone's own final norm and head.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from specgen.backbones.loading import load_shapes_generator, weights_id
from specgen.modules.schedules import adamw_warmup_cosine
from specgen.utils.validate import expect_float


class DistillModule(L.LightningModule):
    def __init__(self, net: nn.Module, backbone_dir: str, tokenizer_dir: str, lr: float = 1e-3,
                 weight_decay: float = 0.0, warmup_steps: int = 100, kl_weight: float = 0.1):
        super().__init__()
        expect_float("module.lr", lr, 0.0)
        expect_float("module.kl_weight", kl_weight, 0.0)
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        # The frozen teacher lives outside the module tree: never trained, never in a checkpoint.
        backbone = load_shapes_generator(backbone_dir, tokenizer_dir)
        if getattr(net, "hidden_size", backbone.hidden_size) != backbone.hidden_size:
            raise ValueError(f"drafter.hidden_size={net.hidden_size} but the backbone at {backbone_dir!r} has width "
                             f"{backbone.hidden_size}: set drafter.hidden_size={backbone.hidden_size}")
        self.__dict__["backbone"] = backbone
        self.backbone_id = weights_id(backbone_dir)

    def setup(self, stage: str | None = None):
        self.backbone.to(self.device).eval()

    def on_fit_start(self):  # Lightning moves the module to its device after setup(): follow it
        self.backbone.to(self.device).eval()

    def tasks(self) -> list[tuple[str, int]]:
        """(prediction name, sequence offset) pairs the drafter is trained on."""
        stride = self.backbone.grid.stride
        return [(name, stride if name == "down" else 1 if name == "right" else int(name.split("_")[-1]))
                for name in self.net.directions]

    def _visual(self, hidden: torch.Tensor) -> torch.Tensor:
        g = self.backbone.grid
        return self.backbone.head(hidden)[..., g.visual_start: g.visual_start + g.num_visual]

    def losses(self, batch) -> dict[str, torch.Tensor]:
        states = batch["states"].flatten(0, 1)  # (2B, L, D): conditional and unconditional rows
        ids = batch["ids"].repeat_interleave(2, 0)  # (2B, L): the token each state predicts
        embeds = self.backbone.embed(ids)
        out, total = {}, 0.0
        for name, off in self.tasks():
            h, e, target = states[:, :-off], embeds[:, :-off], states[:, off:]
            pred = self.net(h, e, name)
            with torch.no_grad():
                t_logits = self._visual(target)
            if getattr(self.net, "predicts", "hidden") == "tokens":  # ablation: code logits, no state to regress
                feat, p_logits = torch.zeros((), device=pred.device), pred
            else:
                rms = target.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
                feat = ((pred - target) / rms).pow(2).mean()
                p_logits = self._visual(pred)
            kl = F.kl_div(F.log_softmax(p_logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                          reduction="none").sum(-1).mean()
            w = 1.0 if getattr(self.net, "predicts", "hidden") == "tokens" else self.hparams.kl_weight
            total = total + feat + w * kl
            out.update({f"loss_feat_{name}": feat, f"loss_kl_{name}": kl,
                        f"top1_{name}": (p_logits.argmax(-1) == t_logits.argmax(-1)).float().mean()})
        out["loss"] = total
        return out

    def training_step(self, batch, batch_idx):
        out = self.losses(batch)
        self.log_dict({f"train/{k}": v for k, v in out.items() if k != "loss"}, batch_size=len(batch["ids"]))
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=len(batch["ids"]))
        return out["loss"]

    def validation_step(self, batch, batch_idx):
        out = self.losses(batch)
        self.log_dict({f"val/{k}": v for k, v in out.items()}, batch_size=len(batch["ids"]))

    def export_extra(self) -> dict:
        return {"backbone_id": self.backbone_id, "backbone_dir": self.hparams.backbone_dir}

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.net.parameters(), self.hparams.lr,
                                   self.hparams.warmup_steps, self.hparams.weight_decay, (0.9, 0.999))
