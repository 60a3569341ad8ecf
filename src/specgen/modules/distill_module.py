"""LightningModule that distils a drafter (f_phi or 1D multi-token heads) from a frozen backbone.

The drafter predicts the teacher's pre-norm state `offset` positions ahead; the loss is a feature
regression (error relative to the target's RMS) plus `kl_weight` x KL(teacher head || drafted head)
over visual codes on each CFG branch, both through the backbone's own final norm and head (the
default, as the shipped drafter was trained).

Acceptance is decided by the guided distributions: SSD keeps a draft t ~ q with probability
min(1, p(t) / q(t)), p and q the CFG-guided target and draft distributions, so a draft's expected
acceptance is sum_v min(p_v, q_v) = 1 - TV(p, q). `guided_weight` adds a term on exactly those
distributions, `guided_loss="kl"` (KL(p || q), smooth; zero iff q = p) or `"tv"` (1 - sum min(p, q),
the acceptance itself). Validation reports both per direction: `accept_<d>` (sum min(p, q), drafts
sampled from q) and `accept_argmax_<d>` (p at the argmax of q: drafts taken greedily).

Two training-time fixes for how SSD uses the drafter: `rollout=k` chains the right direction k steps
on its own predictions (the first row is drafted as such a chain; a one-step-trained drafter never sees
its own outputs as inputs), and `input_noise` adds Gaussian noise (relative to the state's RMS) to
the input states. The down direction is trained on whole rows (the row above -> the row), so a
drafter with row context (`FPhi(context_kernel=k)`) sees what SSD gives it; with left context, each down draft
also gets the teacher's tokens before it (`FPhi(left_tokens=k)`: the k nearest). `directions` trains a subset of the
drafter's directions (the others are neither scored nor in the optimiser: a drafter grown for one direction keeps
the other as it was). `drafted_left=True` trains (and validates) the down direction on its own drafted left context:
each row is drafted column by column, the tokens before a column being the row's drafts at `draft_temperature`, as
SSD drafts it (teacher-forced left tokens overstate acceptance when decoding: experiments/ssd_ablations).
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from specgen.backbones.loading import load_shapes_generator, weights_id
from specgen.backbones.protocol import embed_image, image_states, weights_part
from specgen.decoding.sampling import guide
from specgen.modules.schedules import adamw_warmup_cosine
from specgen.utils.checkpoints import build
from specgen.utils.validate import expect_float, expect_int

GUIDED_LOSSES = ("kl", "tv")


def guided_terms(t_logits: torch.Tensor, d_logits: torch.Tensor, cfg_scale: float) -> dict[str, torch.Tensor]:
    """Per-position terms of the CFG-guided target p and draft q, from [cond; uncond] logits stacked as
    (2B, ..., V) with branch-major order: kl = KL(p || q), accept = sum min(p, q), accept_argmax = p(argmax q)."""
    log_p = F.log_softmax(guide(t_logits, cfg_scale), -1)
    log_q = F.log_softmax(guide(d_logits, cfg_scale), -1)
    p, q = log_p.exp(), log_q.exp()
    return {"kl": (p * (log_p - log_q)).sum(-1), "accept": torch.minimum(p, q).sum(-1),
            "accept_argmax": p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1)}


class DistillModule(L.LightningModule):
    def __init__(self, net: nn.Module, backbone_dir: str | None, tokenizer_dir: str | None, lr: float = 1e-3,
                 weight_decay: float = 0.0, warmup_steps: int = 100, kl_weight: float = 0.1,
                 guided_weight: float = 0.0, guided_loss: str = "kl", cfg_scale: float = 2.0,
                 rollout: int = 1, input_noise: float = 0.0, generator: dict | None = None, state_batch: int = 1,
                 directions: list[str] | None = None, drafted_left: bool = False, draft_temperature: float = 0.5):
        super().__init__()
        expect_int("module.state_batch", state_batch, 1)
        expect_float("module.lr", lr, 0.0)
        expect_float("module.kl_weight", kl_weight, 0.0)
        expect_float("module.guided_weight", guided_weight, 0.0)
        expect_float("module.cfg_scale", cfg_scale, 0.0)
        expect_float("module.input_noise", input_noise, 0.0)
        expect_int("module.rollout", rollout, 1)
        if guided_loss not in GUIDED_LOSSES:
            raise ValueError(f"module.guided_loss={guided_loss!r}: expected one of {GUIDED_LOSSES}")
        if OmegaConf.is_config(generator):
            generator = OmegaConf.to_container(generator, resolve=True)
        # The frozen teacher lives outside the module tree: never trained, never in a checkpoint.
        backbone = build(generator) if generator else load_shapes_generator(backbone_dir, tokenizer_dir)
        where = generator["weights_path"] if generator else backbone_dir
        self.net_overrides = {}  # constructor values resolved here, written into the export's config
        if OmegaConf.is_config(net) or isinstance(net, dict):  # a config left unbuilt (module._recursive_=false)
            net = dict(OmegaConf.to_container(net, resolve=True) if OmegaConf.is_config(net) else net)
            if net.get("hidden_size") == "auto":  # drafter.hidden_size=auto: the backbone's width
                net["hidden_size"] = self.net_overrides["hidden_size"] = backbone.hidden_size
            net = build(net)
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        have = list(getattr(net, "directions", ()))
        if directions is not None and (not directions or set(directions) - set(have)):
            raise ValueError(f"module.directions={list(directions)}: expected a non-empty subset of the drafter's "
                             f"{have} (or null: train them all)")
        if getattr(net, "hidden_size", backbone.hidden_size) != backbone.hidden_size:
            raise ValueError(f"drafter.hidden_size={net.hidden_size} but the backbone at {where!r} has width "
                             f"{backbone.hidden_size}: set drafter.hidden_size={backbone.hidden_size} (or auto)")
        self.__dict__["backbone"] = backbone
        self.backbone_id = weights_part(backbone.identity) if generator else weights_id(backbone_dir)

    def setup(self, stage: str | None = None):
        self.backbone.to(self.device).eval()

    def on_fit_start(self):  # Lightning moves the module to its device after setup(): follow it
        self.backbone.to(self.device).eval()

    def tasks(self) -> list[tuple[str, int]]:
        """(prediction name, sequence offset) pairs the drafter is trained on."""
        stride = self.backbone.grid.stride
        train = self.hparams.get("directions") or self.net.directions  # the others stay as they are
        return [(name, stride if name == "down" else 1 if name == "right" else int(name.split("_")[-1]))
                for name in self.net.directions if name in train]

    def _visual(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backbone.visual_logits(hidden).float()

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """(N, L, ...) teacher-layout tensor -> (N, H - 1, W, ...): at [r, c] the index of the state that
        predicts visual token (r, c), rows 0..H-2 (the inputs of the down direction; +stride: its targets)."""
        g = self.backbone.grid
        r = torch.arange(g.height - 1, device=x.device)[:, None]
        c = torch.arange(g.width, device=x.device)[None, :]
        return x[:, r * g.stride + c]

    def _noisy(self, h: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.hparams.input_noise > 0):
            return h
        rms = h.pow(2).mean(-1, keepdim=True).sqrt()
        return h + self.hparams.input_noise * rms * torch.randn_like(h)

    def _pairs(self, name: str, off: int, states, embeds):
        """[(drafted, target)] for one direction: states in the layout the decoder feeds (rows for down),
        `rollout` chained steps for right."""
        if name == "down":
            h, e = self._rows(states), self._rows(embeds)
            if getattr(self.net, "left_context", False) and self.hparams.get("drafted_left"):
                return [(self.down_drafted_left(states, embeds, self.hparams.draft_temperature),
                         self._rows(states[:, off:]))]
            if getattr(self.net, "left_context", False):  # the tokens before each drafted one (teacher-forced)
                left = [self._rows(embeds[:, off - j:]) for j in range(1, getattr(self.net, "left_tokens", 1) + 1)]
                return [(self.net.down(self._noisy(h), e, left if len(left) > 1 else left[0]),
                         self._rows(states[:, off:]))]
            return [(self.net(self._noisy(h), e, name), self._rows(states[:, off:]))]
        pairs, h = [], self._noisy(states[:, :-off])
        steps = self.hparams.rollout if name == "right" else 1
        for k in range(1, steps + 1):  # step k: drafted from step k - 1's drafts, teacher tokens as inputs
            h = self.net(h, embeds[:, (k - 1) * off: embeds.shape[1] - off], name)
            pairs.append((h, states[:, k * off:]))
            h = h[:, :-off]
        return pairs

    def down_drafted_left(self, states: torch.Tensor, embeds: torch.Tensor, draft_temperature: float,
                          gen: torch.Generator | None = None) -> torch.Tensor:
        """Down drafts (2B, H - 1, W, D) of every row, column by column as SSD drafts a row: each column's left tokens
        are the row's own drafts before it (drawn from the guided q at `draft_temperature`, no gradient through the
        draw; the teacher's tokens before column 0). States and embeddings stacked [cond; uncond] (CFG)."""
        net, bb = self.net, self.backbone
        off, width = bb.grid.stride, bb.grid.width
        h, e = self._rows(self._noisy(states)), self._rows(embeds)
        trunk = net.down_trunk(h, e)
        teacher_left = [self._rows(embeds[:, off - j:]) for j in range(1, net.left_tokens + 1)]
        drafted, cols = [], []
        for c in range(width):
            left = [drafted[c - j] if c - j >= 0 else teacher_left[j - 1][:, :, c] for j in range(1, net.left_tokens + 1)]
            state = net.down_step(trunk[:, :, c], h[:, :, c], sum(m(x) for m, x in zip(net.left_maps(), left)))
            with torch.no_grad():
                q = (guide(self._visual(state), self.hparams.cfg_scale) / draft_temperature).softmax(-1)  # (B, H-1, V)
                tok = torch.multinomial(q.flatten(0, -2), 1, generator=gen).view(q.shape[:-1])
                drafted.append(embed_image(bb, tok).float().repeat(len(states) // len(q), 1, 1))  # both CFG branches
            cols.append(state)
        return torch.stack(cols, 2)

    @torch.no_grad()
    def batch_states(self, batch) -> torch.Tensor:
        """(2B, L, D) teacher states of a batch, B conditional rows then B unconditional: read from cached shards, or
        recomputed by the frozen backbone from the sampled codes and prompts (a streamed data module),
        `state_batch` images per teacher call."""
        if "states" in batch:
            return batch["states"].transpose(0, 1).flatten(0, 1)
        cond, uncond = [], []
        n = self.hparams.state_batch  # 1 at Emu3's size: a whole sequence's KV cache is about 1 GB a row in bf16
        texts = list(batch["prompt"])
        for i in range(0, len(texts), n):
            k = len(texts[i:i + n])
            states, _ = image_states(self.backbone, self.backbone.prompts(texts[i:i + n]).rows(True),
                                     batch["codes"][i:i + k])
            cond.append(states[:k])
            uncond.append(states[k:])
        return torch.cat(cond + uncond).float()

    def losses(self, batch) -> dict[str, torch.Tensor]:
        states = self.batch_states(batch)  # (2B, L, D): B conditional rows, then B unconditional
        ids = batch["ids"].repeat(2, 1)  # (2B, L): the image token each state predicts
        embeds = embed_image(self.backbone, ids).float()  # a real teacher runs in bf16; the drafter trains in fp32
        tokens_out = getattr(self.net, "predicts", "hidden") == "tokens"
        out, total = {}, 0.0
        for name, off in self.tasks():
            for k, (pred, target) in enumerate(self._pairs(name, off, states, embeds)):
                with torch.no_grad():
                    t_logits = self._visual(target)
                if tokens_out:  # ablation: code logits, no state to regress
                    feat, p_logits = torch.zeros((), device=pred.device), pred
                else:
                    rms = target.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
                    feat = ((pred - target) / rms).pow(2).mean()
                    p_logits = self._visual(pred)
                kl = F.kl_div(F.log_softmax(p_logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                              reduction="none").sum(-1).mean()
                g = {key: v.mean() for key, v in guided_terms(t_logits, p_logits, self.hparams.cfg_scale).items()}
                guided = g["kl"] if self.hparams.guided_loss == "kl" else 1.0 - g["accept"]
                w = 1.0 if tokens_out else self.hparams.kl_weight
                total = total + feat + w * kl + self.hparams.guided_weight * guided
                tag = name if k == 0 else f"{name}_chain{k + 1}"
                out.update({f"loss_feat_{tag}": feat, f"loss_kl_{tag}": kl, f"loss_guided_kl_{tag}": g["kl"],
                            f"top1_{tag}": (p_logits.argmax(-1) == t_logits.argmax(-1)).float().mean(),
                            f"accept_{tag}": g["accept"], f"accept_argmax_{tag}": g["accept_argmax"]})
        out["loss"] = total
        return out

    def training_step(self, batch, batch_idx):
        out = self.losses(batch)
        self.log_dict({f"train/{k}": v for k, v in out.items() if k != "loss"}, batch_size=len(batch["ids"]))
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=len(batch["ids"]))
        return out["loss"]

    def validation_step(self, batch, batch_idx):
        out = self.losses(batch)
        # sync_dist: under DDP each rank scores a part of the validation shards; the logged value is their mean
        self.log_dict({f"val/{k}": v for k, v in out.items()}, batch_size=len(batch["ids"]), sync_dist=True)

    def export_extra(self) -> dict:
        if self.hparams.get("generator"):
            return {"backbone_id": self.backbone_id, "weights_path": self.hparams.generator["weights_path"]}
        return {"backbone_id": self.backbone_id, "backbone_dir": self.hparams.backbone_dir}

    def configure_optimizers(self):
        train = self.hparams.get("directions")
        params = self.net.parameters() if not train else [p for n, p in self.net.named_parameters()
                                                          if not any(n.startswith(f"nets.{d}.") for d in
                                                                     set(self.net.directions) - set(train))]
        return adamw_warmup_cosine(self, params, self.hparams.lr,
                                   self.hparams.warmup_steps, self.hparams.weight_decay, (0.9, 0.999))
