"""The policy (actor) and the frozen reference: FSDP2-sharded HF models and their passes.

`PolicyWorker` owns a model in the training layout and, when trainable, its optimizer and
LR schedule. Its two passes are the two the RL loop needs: forward-only log-probs over
micro-batches, and the PPO-style update over mini-batches with gradient accumulation.
Every loss is normalised by *global* token/sequence counts of the mini-batch (all-reduced
over dp), and FSDP2 sums gradients over dp, so the update is independent of the dp size
and of the number of micro-batches.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlhf.algos.aggregation import AggNorm, agg_loss
from rlhf.algos.kl import kl_penalty
from rlhf.algos.policy_loss import get_policy_loss
from rlhf.batch import RolloutBatch, split_rows
from rlhf.config import ActorConfig, ModelConfig
from rlhf.models.fsdp import apply_fsdp, grad_scale
from rlhf.models.loading import load_causal_lm
from rlhf.models.logprobs import forward_log_probs
from rlhf.optim import build_optimizer, build_scheduler, clip_grad_norm
from rlhf.parallel import all_reduce_sum


class NonFiniteError(RuntimeError):
    """Raised when too many consecutive optimizer steps had a non-finite loss or grad norm."""


@dataclass
class MetricSums:
    """Sums of (value x weight) and weights, reduced over dp before averaging."""

    sums: dict
    device: torch.device

    @classmethod
    def new(cls, device):
        return cls({}, device)

    def add(self, name: str, value: torch.Tensor | float, weight: float = 1.0) -> None:
        v = float(value) * weight
        s, w = self.sums.get(name, (0.0, 0.0))
        self.sums[name] = (s + v, w + weight)

    def reduce(self, group=None) -> dict[str, float]:
        if not self.sums:
            return {}
        names = sorted(self.sums)
        t = torch.tensor([[self.sums[n][0], self.sums[n][1]] for n in names], dtype=torch.float64,
                         device=self.device)
        all_reduce_sum(t, group)
        return {n: (t[i, 0] / t[i, 1]).item() if t[i, 1] > 0 else 0.0 for i, n in enumerate(names)}


class PolicyWorker:
    """An HF causal LM sharded with FSDP2 on the dp mesh; trainable or frozen."""

    def __init__(self, model_cfg: ModelConfig, mesh: DeviceMesh, device: torch.device, *,
                 path: Optional[str] = None, trainable: bool = True,
                 actor_cfg: Optional[ActorConfig] = None, total_steps: int = 1,
                 build_model: Optional[Callable[[], torch.nn.Module]] = None):
        self.cfg = model_cfg
        self.actor_cfg = actor_cfg
        self.mesh = mesh
        self.device = device
        self.dp_group = mesh["dp"].get_group()
        model = build_model() if build_model else load_causal_lm(
            path or model_cfg.path, dtype=model_cfg.dtype, attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=model_cfg.trust_remote_code)
        if not trainable:
            model.requires_grad_(False)
        self.hf_config = model.config
        self.model = apply_fsdp(model, mesh["dp"], device=device, mixed_precision=model_cfg.mixed_precision,
                                param_offload=model_cfg.param_offload)
        self.grad_scale = grad_scale(mesh["dp"])
        self.optimizer = self.scheduler = None
        self.nan_steps = 0
        self.skipped_steps = 0
        self.max_nan_steps = 3
        if trainable:
            assert actor_cfg is not None
            self.optimizer = build_optimizer(self.model.parameters(), lr=actor_cfg.lr,
                                             weight_decay=actor_cfg.weight_decay, betas=actor_cfg.betas)
            self.scheduler = build_scheduler(self.optimizer, total_steps=total_steps,
                                             warmup_steps=actor_cfg.lr_warmup_steps,
                                             warmup_ratio=actor_cfg.lr_warmup_steps_ratio,
                                             style=actor_cfg.warmup_style, min_lr_ratio=actor_cfg.min_lr_ratio)

    # ------------------------------------------------------------------ forward-only

    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int,
                          compute_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs [N, R] (and entropy [N, R]) of the batch's responses, in eval mode."""
        self.model.eval()
        lps, ents = [], []
        for rows in split_rows(len(batch), micro_batch_size):
            lp, ent = forward_log_probs(self.model, batch.input_ids[rows], batch.attention_mask[rows],
                                        response_length=batch.response_length, temperature=temperature,
                                        compute_entropy=compute_entropy)
            lps.append(lp)
            ents.append(ent)
        log_probs = torch.cat(lps) if lps else batch.rollout_log_probs.new_zeros(0, batch.response_length)
        entropy = torch.cat(ents) if compute_entropy and ents else None
        return log_probs, entropy

    # ------------------------------------------------------------------ update

    def update_policy(self, batch: RolloutBatch, *, mini_batch_rows: int, temperature: float,
                      max_response_length: int) -> dict[str, float]:
        """PPO epochs over mini-batches of `mini_batch_rows` local rows; one optimizer step each.

        Requires batch.old_log_probs, batch.advantages (and ref_log_probs when use_kl_loss).
        """
        cfg = self.actor_cfg
        assert cfg is not None and self.optimizer is not None
        loss_fn = get_policy_loss(cfg.policy_loss)
        low = cfg.clip_ratio_low if cfg.clip_ratio_low >= 0 else cfg.clip_ratio
        high = cfg.clip_ratio_high if cfg.clip_ratio_high >= 0 else cfg.clip_ratio
        mode = cfg.loss_agg_mode
        metrics = MetricSums.new(self.device)
        self.model.train()
        n_rows = len(batch)
        gen = torch.Generator().manual_seed(1234)
        for epoch in range(cfg.ppo_epochs):
            order = torch.randperm(n_rows, generator=gen) if cfg.shuffle else torch.arange(n_rows)
            for mini_rows in split_rows(n_rows, mini_batch_rows):
                mini = batch.select(order[mini_rows])
                mask = mini.response_mask
                counts = torch.tensor([float(mask.sum()), float(len(mini))], dtype=torch.float64, device=self.device)
                all_reduce_sum(counts, self.dp_group)
                norm = AggNorm(global_tokens=counts[0].item(), global_seqs=counts[1].item(),
                               max_response_len=max_response_length)
                self.optimizer.zero_grad(set_to_none=True)
                micro_list = list(split_rows(len(mini), cfg.ppo_micro_batch_size_per_gpu))
                step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
                for k, rows in enumerate(micro_list):
                    mb = mini.select(rows)
                    sync = self._grad_sync(k == len(micro_list) - 1)
                    with sync:
                        loss, parts = self._micro_loss(mb, loss_fn, low, high, mode, norm, temperature)
                        (loss * self.grad_scale).backward()
                    step_loss += loss.detach().double()
                    w = float(mb.response_mask.sum())
                    for name, value in parts.items():
                        metrics.add(name, value, w)
                all_reduce_sum(step_loss, self.dp_group)
                grad_norm = clip_grad_norm(self.model.parameters(), cfg.grad_clip)
                if not (math.isfinite(step_loss.item()) and math.isfinite(float(grad_norm))):
                    self._skip_nonfinite(step_loss.item(), float(grad_norm))
                    continue
                self.nan_steps = 0
                self.optimizer.step()
                metrics.add("actor/loss", step_loss.item())
                metrics.add("actor/grad_norm", float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        out = metrics.reduce(self.dp_group)
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        out["actor/skipped_nonfinite_steps"] = float(self.skipped_steps)
        self.scheduler.step()
        return out

    def _micro_loss(self, mb: RolloutBatch, loss_fn, low: float, high: float, mode: str, norm: AggNorm,
                    temperature: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.actor_cfg
        need_entropy = cfg.entropy_coeff != 0
        log_probs, entropy = forward_log_probs(self.model, mb.input_ids, mb.attention_mask,
                                               response_length=mb.response_length, temperature=temperature,
                                               compute_entropy=need_entropy)
        mask = mb.response_mask
        pg_loss, pg_metrics = loss_fn(mb.old_log_probs, log_probs, mb.advantages, mask,
                                      clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cfg.clip_ratio_c,
                                      loss_agg_mode=mode, norm=norm, rollout_log_probs=mb.rollout_log_probs,
                                      tis_imp_ratio_cap=cfg.tis_imp_ratio_cap)
        loss = pg_loss
        parts = {f"actor/{k}": v for k, v in pg_metrics.items()}
        if need_entropy:
            ent_loss = agg_loss(entropy, mask, mode, norm)
            loss = loss - cfg.entropy_coeff * ent_loss
        if cfg.use_kl_loss:
            kl = kl_penalty(log_probs, mb.ref_log_probs, cfg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, mode, norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            parts["actor/kl_loss"] = _masked_mean(kl.detach(), mask)
        return loss, parts

    def _grad_sync(self, last: bool):
        # Reduce-scatter gradients only on the last micro-batch of a mini-batch.
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _skip_nonfinite(self, loss: float, grad_norm: float) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.nan_steps += 1
        self.skipped_steps += 1
        if dist.get_rank() == 0:
            print(f"[rlhf] non-finite loss/grad norm (loss={loss}, grad_norm={grad_norm}); "
                  f"optimizer step skipped ({self.nan_steps} in a row)", flush=True)
        if self.nan_steps > self.max_nan_steps:
            raise NonFiniteError(f"{self.nan_steps} consecutive non-finite optimizer steps "
                                 f"(last loss={loss}, grad_norm={grad_norm}); lower actor.lr or check the data")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)
