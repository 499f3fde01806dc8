"""The PPO critic: an HF backbone with a scalar value head, FSDP2-sharded like the actor.

The model is ``AutoModelForTokenClassification`` with ``num_labels=1`` (verl's choice): the
decoder backbone plus ``score = nn.Linear(hidden, 1)`` applied at every position. Where
its weights come from depends on ``critic.model_path`` (empty = the actor's model):

* a causal-LM checkpoint (the actor, or any LM): the backbone is loaded, the value head
  is missing from the checkpoint and starts at zero, so the first values are 0 and the
  first advantages are plain whitened returns;
* a reward-model checkpoint (``*ForSequenceClassification``, ``num_labels=1``): its
  ``score`` head is the same shape and is reused, so values start at the RM's scores.

``compute_values`` returns ``V [N, R]`` at the positions that predict each response token
(hidden state at ``P + t - 1`` for response token ``t``, the log-prob positions), masked by
``response_mask`` as verl does. ``update_critic`` runs epochs over mini-batches with
gradient accumulation over micro-batches, normalised by global (all-dp) token/sequence
counts, so the update does not depend on the dp size or the micro-batch size.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from rlhf.actor import MetricSums, NonFiniteError
from rlhf.algos.aggregation import AggNorm
from rlhf.algos.value_loss import compute_value_loss
from rlhf.batch import RolloutBatch, split_rows
from rlhf.config import ConfigError, CriticConfig, ModelConfig
from rlhf.models.fsdp import apply_fsdp, grad_scale
from rlhf.models.loading import DTYPES, check_model_dir
from rlhf.models.logprobs import position_ids_from_mask
from rlhf.optim import build_optimizer, build_scheduler, clip_grad_norm
from rlhf.parallel import all_reduce_sum

_HEAD_NAMES = ("score", "classifier")
_RM_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification")


def value_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The ``Linear(hidden, 1)`` head of a token/sequence-classification model."""
    for name in _HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise ConfigError(f"{type(model).__name__} has no linear value head (looked for {', '.join(_HEAD_NAMES)})")


def load_value_model(path: str, *, dtype: str = "float32", attn_implementation: str = "sdpa",
                     trust_remote_code: bool = False, key: str = "critic.model_path") -> PreTrainedModel:
    """Backbone + scalar head from a causal-LM or a reward-model checkpoint (see module doc)."""
    p = check_model_dir(path, key)
    config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    is_rm = any(a.endswith(_RM_SUFFIXES) for a in (config.architectures or []))
    if is_rm and config.num_labels != 1:
        raise ConfigError(f"{key}: {path} is a classification model with num_labels={config.num_labels}; "
                          "a critic (or reward model) needs num_labels=1")
    config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code, num_labels=1)
    # Dropout in the head would make values depend on the RNG stream, hence on the dp layout.
    config.classifier_dropout = 0.0
    config.use_cache = False
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            str(p), config=config, dtype=DTYPES[dtype], attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code, output_loading_info=True)
    except ValueError as e:  # transformers: "Unrecognized configuration class ..."
        raise ConfigError(f"{key}: {config.model_type} has no token-classification model in transformers, "
                          f"so it cannot be a critic backbone ({e})") from None
    head = value_head(model)
    head_name = next(n for n in _HEAD_NAMES if getattr(model, n, None) is head)
    missing = set(info["missing_keys"])
    with torch.no_grad():
        # A fresh head starts at V = 0 instead of random values: deterministic, and the
        # first advantages are then the whitened returns (a REINFORCE baseline).
        if f"{head_name}.weight" in missing:
            head.weight.zero_()
        if head.bias is not None and f"{head_name}.bias" in missing:
            head.bias.zero_()
    return model


class CriticWorker:
    """Value model in the training layout with its own optimizer and LR schedule."""

    def __init__(self, critic_cfg: CriticConfig, model_cfg: ModelConfig, mesh: DeviceMesh, device: torch.device, *,
                 total_steps: int, max_response_length: int,
                 build_model: Optional[Callable[[], torch.nn.Module]] = None):
        self.cfg = critic_cfg
        self.device = device
        self.dp_group = mesh["dp"].get_group()
        self.max_response_length = max_response_length
        model = build_model() if build_model else load_value_model(
            critic_cfg.model_path or model_cfg.path, dtype=model_cfg.dtype,
            attn_implementation=model_cfg.attn_implementation, trust_remote_code=model_cfg.trust_remote_code,
            key="critic.model_path" if critic_cfg.model_path else "model.path")
        self.hf_config = model.config
        self.model = apply_fsdp(model, mesh["dp"], device=device, mixed_precision=model_cfg.mixed_precision,
                                param_offload=model_cfg.param_offload)
        self.grad_scale = grad_scale(mesh["dp"])
        self.optimizer = build_optimizer(self.model.parameters(), lr=critic_cfg.lr,
                                         weight_decay=critic_cfg.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, total_steps=total_steps,
                                         warmup_steps=critic_cfg.lr_warmup_steps,
                                         warmup_ratio=critic_cfg.lr_warmup_steps_ratio,
                                         style=critic_cfg.warmup_style)
        self.nan_steps = 0
        self.skipped_steps = 0
        self.max_nan_steps = 3

    # ------------------------------------------------------------------ forward

    def _values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
        """[B, P+R] -> values [B, R] (fp32) from the positions that predict each response token."""
        R = response_length
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        return out.logits[:, -R - 1:-1, 0].float()

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch, *, micro_batch_size: int) -> torch.Tensor:
        """Values [N, R] of the batch, zero outside ``response_mask`` (eval mode, no grad)."""
        self.model.eval()
        parts = [self._values(batch.input_ids[rows], batch.attention_mask[rows], batch.response_length)
                 for rows in split_rows(len(batch), micro_batch_size)]
        values = torch.cat(parts) if parts else batch.response_mask.new_zeros(0, batch.response_length)
        return values * batch.response_mask

    # ------------------------------------------------------------------ update

    def update_critic(self, batch: RolloutBatch, *, mini_batch_rows: int) -> dict[str, float]:
        """Epochs over mini-batches of ``mini_batch_rows`` local rows; one optimizer step each.

        Requires batch.values (old values) and batch.returns. Loss: clipped value loss
        ``0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2)`` aggregated by
        ``critic.loss_agg_mode`` with the mini-batch's global counts.
        """
        cfg = self.cfg
        metrics = MetricSums.new(self.device)
        self.model.train()
        n_rows = len(batch)
        for _ in range(cfg.ppo_epochs):
            for mini_rows in split_rows(n_rows, mini_batch_rows):
                mini = batch.select(mini_rows)
                mask = mini.response_mask
                counts = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum()]).double()
                all_reduce_sum(counts, self.dp_group)
                norm = AggNorm(global_tokens=counts[0].item(), global_seqs=counts[1].item(),
                               max_response_len=self.max_response_length)
                self.optimizer.zero_grad(set_to_none=True)
                micro_list = list(split_rows(len(mini), cfg.ppo_micro_batch_size_per_gpu))
                step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
                for k, rows in enumerate(micro_list):
                    mb = mini.select(rows)
                    self._grad_sync(k == len(micro_list) - 1)
                    vpreds = self._values(mb.input_ids, mb.attention_mask, mb.response_length)  # [b, R]
                    loss, clipfrac = compute_value_loss(vpreds, mb.values, mb.returns, mb.response_mask,
                                                        cliprange_value=cfg.cliprange_value,
                                                        loss_agg_mode=cfg.loss_agg_mode, norm=norm)
                    (loss * self.grad_scale).backward()
                    step_loss += loss.detach().double()
                    w = float(mb.response_mask.sum())
                    metrics.add("critic/vf_clipfrac", clipfrac, w)
                    vsum = (vpreds.detach() * mb.response_mask).sum()
                    metrics.add("critic/vpred_mean", vsum / max(w, 1.0), w)
                all_reduce_sum(step_loss, self.dp_group)
                grad_norm = clip_grad_norm(self.model.parameters(), cfg.grad_clip)
                if not (math.isfinite(step_loss.item()) and math.isfinite(float(grad_norm))):
                    self._skip_nonfinite(step_loss.item(), float(grad_norm))
                    continue
                self.nan_steps = 0
                self.optimizer.step()
                metrics.add("critic/vf_loss", step_loss.item())
                metrics.add("critic/grad_norm", float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        out = metrics.reduce(self.dp_group)
        out["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        out["critic/skipped_nonfinite_steps"] = float(self.skipped_steps)
        self.scheduler.step()
        return out

    def _grad_sync(self, last: bool) -> None:
        # Reduce-scatter gradients only on the last micro-batch of a mini-batch.
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)

    def _skip_nonfinite(self, loss: float, grad_norm: float) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.nan_steps += 1
        self.skipped_steps += 1
        if dist.get_rank() == 0:
            print(f"[rlhf] critic: non-finite loss/grad norm (loss={loss}, grad_norm={grad_norm}); "
                  f"optimizer step skipped ({self.nan_steps} in a row)", flush=True)
        if self.nan_steps > self.max_nan_steps:
            raise NonFiniteError(f"critic: {self.nan_steps} consecutive non-finite optimizer steps "
                                 f"(last loss={loss}, grad_norm={grad_norm}); lower critic.lr or check the rewards")
