"""LightningModules of the continuous (MAR-style) backbone: training on KL latents, and distilling
a cheaper draft from the frozen target (matching its denoiser outputs on shared masks and noise)."""
from __future__ import annotations

import copy

import lightning as L
import torch
import torch.nn.functional as F

from specgen.backbones.diffusion import gaussian_kl
from specgen.backbones.mar import ShapesMAR
from specgen.modules.schedules import adamw_warmup_cosine
from specgen.utils.validate import expect_float


class _Base(L.LightningModule):
    """Optimiser and an optional exponential moving average of the weights (MAR samples with its EMA).

    With `ema_decay` set, `self.ema` follows `self.net` after every optimiser step (`update_ema`) with decay
    min(ema_decay, (1 + n) / (10 + n)) at update n (short warm-up), starts from the weights `net` has
    when fitting starts (so `init_from` seeds it), is saved in Lightning checkpoints (a resumed run
    continues it), is validated beside the raw weights (`val/...` and `val/..._ema`), and is what
    `export_net` hands to the export callback."""

    def _init_ema(self, ema_decay: float | None):
        if ema_decay is not None:
            expect_float("module.ema_decay", ema_decay, 0.0, 1.0)
            self.ema = copy.deepcopy(self.net).requires_grad_(False)
            self.register_buffer("ema_updates", torch.zeros((), dtype=torch.long))
        else:
            self.ema = None

    @property
    def export_net(self) -> ShapesMAR:
        return self.net if self.ema is None else self.ema

    def validated_nets(self):
        """(metric suffix, network) pairs that validation scores: the raw weights, then the EMA if any."""
        return [("", self.net)] + ([("_ema", self.ema)] if self.ema is not None else [])

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.net.parameters(), self.hparams.lr,
                                   self.hparams.warmup_steps, self.hparams.weight_decay, (0.9, 0.95))

    def on_fit_start(self):
        if self.ema is not None and int(self.ema_updates) == 0:  # fresh (or init_from) run: start at net
            self.ema.load_state_dict(self.net.state_dict())

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.update_ema()  # here, not in on_train_batch_end: checkpoint callbacks run before that hook

    @torch.no_grad()
    def update_ema(self):
        if self.ema is None:
            return
        n = int(self.ema_updates)
        decay = min(self.hparams.ema_decay, (1 + n) / (10 + n))
        for e, p in zip(self.ema.parameters(), self.net.parameters()):
            e.lerp_(p.detach(), 1 - decay)
        for e, b in zip(self.ema.buffers(), self.net.buffers()):
            e.copy_(b)
        self.ema_updates += 1


class MARModule(_Base):
    """Trains a ShapesMAR on (prompt, KL latents) pairs with MAR's masked diffusion loss."""

    def __init__(self, net: ShapesMAR, lr: float = 8e-4, weight_decay: float = 0.02, warmup_steps: int = 500,
                 ema_decay: float | None = None):
        super().__init__()
        expect_float("module.lr", lr, 0.0)
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        self._init_ema(ema_decay)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch["latents"], self.net.condition(batch["prompt"]))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["prompt"]))
        return loss

    def validation_step(self, batch, batch_idx):
        for suffix, net in self.validated_nets():
            net.train(False)
            loss = net(batch["latents"], net.condition(batch["prompt"]))
            self.log("val/loss" + suffix, loss, prog_bar=True, batch_size=len(batch["prompt"]), sync_dist=True)


def transition_kl(diffusion, out_q: torch.Tensor, out_p: torch.Tensor, x_t: torch.Tensor,
                  step: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(q || p) between the Gaussian transitions p(x_{i-1} | x_i) that two denoiser
    outputs give at the same state x_t and sampling step index `step` (N,) (>= 1: step 0 has no variance),
    summed over the token's dimensions."""
    mean_q, var_q = diffusion.step_mean_var(out_q, x_t, step)
    mean_p, var_p = diffusion.step_mean_var(out_p, x_t, step)
    return gaussian_kl(mean_q, var_q.log(), mean_p, var_p.log()).sum(-1).mean()


class MARDraftModule(_Base):
    """Distils a small ShapesMAR draft from a frozen target: on the same masked context and the same
    (x_t, t), the draft's denoiser output regresses onto the target's (epsilon and variance), plus
    `data_weight` x the draft's own diffusion loss on the data.

    `kl_weight` > 0 adds what CSpD's exact density ratio loses. A drafted token's log ratio is the sum over
    the sampler's steps of log p_i(x_{i-1} | x_i) - log q_i(x_{i-1} | x_i) at the draft's own states, whose
    expectation under the draft is minus the sum of KL(q_i || p_i), the per-step KL of the two Gaussian
    transitions (dimensions summed). With `kl_weight` > 0 the timesteps are then drawn from the sampler's
    own (uniform over its steps with non-zero variance, instead of uniform over all training timesteps)
    and `kl_weight` x the mean of that KL is added; the states are the data noised to t, not draft
    trajectories, an approximation. The epsilon MSE over uniform t spends most of its samples between
    the sampler's 100 timesteps and weighs every step alike, while the KL weighs the last steps (small
    variance: the standardised gap grows as 1 / sigma) by what they cost in acceptance. Measured on the
    CPU-sized pair over 398 steps it lowered acceptance (experiments/cspd_ablations), so it is off by default.

    `uncond_prob` > 0 distils both CFG branches: that share of the images is distilled with the null condition
    for draft and target alike. Sampling uses u + s (c - u), so with guidance s the draft's errors on either
    branch reach the token amplified; 0 (the shipped draft) distils the conditional branch only."""

    def __init__(self, net: ShapesMAR, target_dir: str, lr: float = 1e-3, weight_decay: float = 0.0,
                 warmup_steps: int = 200, data_weight: float = 0.5, ema_decay: float | None = None,
                 kl_weight: float = 0.0, uncond_prob: float = 0.0):
        super().__init__()
        from specgen.utils.checkpoints import load_exported

        if not kl_weight >= 0:
            raise ValueError(f"module.kl_weight must be >= 0, got {kl_weight!r} (0 turns the transition KL off)")
        expect_float("module.uncond_prob", uncond_prob, 0.0, 1.0)

        self.save_hyperparameters(ignore=["net"])
        self.net = net
        self._init_ema(ema_decay)
        target = load_exported(target_dir).requires_grad_(False)
        target.check_draft(net)
        self.__dict__["target"] = target  # frozen, outside the module tree: never trained or saved

    def setup(self, stage=None):
        self.target.to(self.device).eval()

    def on_fit_start(self):  # Lightning moves the module to its device after setup(): follow it
        self.target.to(self.device).eval()
        super().on_fit_start()

    def training_step(self, batch, batch_idx):
        latents, prompts = batch["latents"], batch["prompt"]
        x0 = self.net.patchify(latents)
        B, Lq, d = x0.shape
        mask, known = self.net.random_mask(B, x0.device)
        cond_d, cond_t = self.net.condition(prompts), self.target.condition(prompts)
        if self.hparams.uncond_prob > 0:  # the unconditional branch, the same images for both models
            null = (torch.rand(B, 1, 1, device=x0.device) < self.hparams.uncond_prob)
            cond_d = torch.where(null, self.net.null_condition(B), cond_d)
            cond_t = torch.where(null, self.target.null_condition(B), cond_t)
        z_d = self.net.conditions(x0, mask, cond_d, known)
        with torch.no_grad():
            z_t = self.target.conditions(x0, mask, cond_t, known)
        sel = mask.reshape(-1) > 0.5
        diff = self.net.diffusion
        x = x0.reshape(-1, d)[sel]
        if self.hparams.kl_weight > 0:  # the sampler's timesteps, those with a non-degenerate transition
            step = torch.randint(1, diff.sample_steps, (x.shape[0],), device=x.device)
            t = diff.timesteps.to(x.device)[step]
        else:
            t = torch.randint(0, diff.train_steps, (x.shape[0],), device=x.device)
        x_t = diff.q_sample(x, t, torch.randn_like(x))
        out_d = self.net.denoise(x_t, t, z_d.reshape(B * Lq, -1)[sel])
        with torch.no_grad():
            out_t = self.target.denoise(x_t, t, z_t.reshape(B * Lq, -1)[sel])
        distill = F.mse_loss(out_d, out_t)
        data = self.net(latents, self.net.condition(prompts)) if self.hparams.data_weight > 0 else torch.zeros(())
        loss = distill + self.hparams.data_weight * data
        logs = {"train/loss_distill": distill, "train/loss_data": data}
        if self.hparams.kl_weight > 0:
            kl = transition_kl(diff, out_d.float(), out_t.float(), x_t.float(), step)
            loss = loss + self.hparams.kl_weight * kl
            logs["train/loss_kl"] = kl
        self.log_dict({"train/loss": loss, **logs}, prog_bar=True, batch_size=B)
        return loss

    def validation_step(self, batch, batch_idx):
        for suffix, net in self.validated_nets():
            net.train(False)
            self.log("val/loss_data" + suffix, net(batch["latents"], net.condition(batch["prompt"])),
                     batch_size=len(batch["prompt"]), sync_dist=True)  # the mean over the ranks' parts
