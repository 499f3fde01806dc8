"""The PPO critic: an HF backbone with a scalar value head, in the same training layout as the actor.

The model is ``AutoModelForTokenClassification`` with ``num_labels=1`` (verl's choice): the
decoder backbone plus ``score = nn.Linear(hidden, 1)`` applied at every position. Where
its weights come from depends on ``critic.model_path`` (empty = the actor's model):

* a causal-LM checkpoint (the actor, or any LM): the backbone is loaded, the value head
  is missing from the checkpoint and starts at zero, so the first values are 0 and the
  first advantages are plain whitened returns;
* a reward-model checkpoint (``*ForSequenceClassification``, ``num_labels=1``): its
  ``score`` head is the same shape and is reused, so values start at the RM's scores.

Layout. :func:`rlhf.models.parallelize.parallelize_model` puts the critic on the
("pp", "dp", "tp") mesh exactly as the actor: pipeline stages whose last stage returns
values (``pp_output="values"``), Megatron TP of the backbone with the tiny score head
replicated, FSDP2 over dp. The gradient norm is global over all pp x dp x tp ranks.

``compute_values`` returns ``V [N, R]`` at the positions that predict each response token
(hidden state at ``P + t - 1`` for response token ``t``, the log-prob positions), masked by
``response_mask`` as verl does. ``update_critic`` runs epochs over mini-batches with
gradient accumulation over micro-batches (or one pipelined forward-backward per
mini-batch), normalised by global (all-dp) token/sequence counts, so the update does not
depend on the layout or the micro-batch size. With ``model.use_remove_padding`` (tp = pp
= 1) the passes are padding-free (:func:`packed_forward_values`); with
``actor.use_dynamic_bsz`` micro-batches are cut by a token budget
(``critic.ppo_max_token_len_per_gpu`` for the update, ``actor.log_prob_max_token_len_per_gpu``
for forward-only passes), with the same count on every dp rank.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from rlhf.algos.aggregation import AggNorm
from rlhf.algos.value_loss import compute_value_loss
from rlhf.data.batching import micro_batches_for_rank
from rlhf.models.loading import DTYPES, check_model_dir, training_attn_implementation
from rlhf.models.logprobs import position_ids_from_mask
from rlhf.models.moe_archs import num_experts
from rlhf.models.packed import packed_forward_values
from rlhf.models.parallelize import ParallelModel, parallelize_model
from rlhf.models.prefix_grouping import resolve_mode
from rlhf.models.value_head import _HEAD_NAMES, value_head
from rlhf.schema.batch import RolloutBatch, split_rows
from rlhf.schema.config import ConfigError, CriticConfig, ModelConfig, ParallelConfig
from rlhf.train.actor import MetricSums, adopt_layout, check_features, run_ppo_epochs, set_grad_sync, sp_size
from rlhf.train.optim import NonFiniteGuard, build_optimizer, build_scheduler

_RM_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification")


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
            str(p), config=config, dtype=DTYPES[dtype],
            attn_implementation=training_attn_implementation(config, attn_implementation),
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


def _head_output_not_a_view(module, args, out):
    """``Linear(H, 1)`` on a ``[1, T, H]`` input (the packed row) computes a 2-D matmul and returns its
    ``[1, T, 1]`` reshape: a view. FSDP2 warns for every root output that is a view, since an in-place op
    on it would skip the pre-backward hook; the critic only reads it out of place (no wrong gradients),
    and the copy of ``T`` scalars removes the warning."""
    return out.clone() if out._base is not None else out


class CriticWorker:
    """Value model in the training layout of ``mesh`` with its own optimizer and LR schedule.

    ``parallel_cfg`` supplies the pipeline schedule / micro-batch count (sizes come from the
    mesh; ``None`` keeps :class:`rlhf.schema.config.ParallelConfig` defaults). ``use_dynamic_bsz``
    (verl's ``actor.use_dynamic_bsz``) cuts micro-batches by token budget:
    ``critic.ppo_max_token_len_per_gpu`` in the update and ``forward_max_token_len`` in
    ``compute_values``. ``self.model`` holds this rank's parameters under HF names (the
    FSDP root, or the pipeline stage(s)); ``self.pipeline`` is set when pp > 1.
    """

    def __init__(self, critic_cfg: CriticConfig, model_cfg: ModelConfig, mesh: DeviceMesh, device: torch.device, *,
                 total_steps: int, max_response_length: int,
                 build_model: Optional[Callable[[], torch.nn.Module]] = None,
                 parallel_cfg: Optional[ParallelConfig] = None, use_dynamic_bsz: bool = False,
                 forward_max_token_len: Optional[int] = None):
        self.cfg = critic_cfg
        self.model_cfg = model_cfg
        self.device = device
        self.mesh = mesh
        self.dp_group = mesh["dp"].get_group()
        self.max_response_length = max_response_length
        self.use_dynamic_bsz = use_dynamic_bsz
        self.forward_max_token_len = forward_max_token_len or critic_cfg.ppo_max_token_len_per_gpu
        check_features(model_cfg, mesh, lora=False)
        if use_dynamic_bsz and min(critic_cfg.ppo_max_token_len_per_gpu, self.forward_max_token_len) <= 0:
            raise ConfigError("config keys 'critic.ppo_max_token_len_per_gpu' and "
                              "'actor.log_prob_max_token_len_per_gpu' must be > 0 with actor.use_dynamic_bsz")
        model = build_model() if build_model else load_value_model(
            critic_cfg.model_path or model_cfg.path, dtype=model_cfg.dtype,
            attn_implementation=model_cfg.attn_implementation, trust_remote_code=model_cfg.trust_remote_code,
            key="critic.model_path" if critic_cfg.model_path else "model.path")
        self.hf_config = model.config
        self.prefix_grouping = resolve_mode(
            model_cfg.prefix_grouping, use_remove_padding=model_cfg.use_remove_padding,
            sp=mesh["sp"].size() if "sp" in (mesh.mesh_dim_names or ()) else 1,
            tp=mesh["tp"].size(), pp=mesh["pp"].size(), moe=bool(num_experts(model.config)))
        value_head(model).register_forward_hook(_head_output_not_a_view)
        self.parallel: ParallelModel = parallelize_model(
            model, mesh, parallel_cfg or ParallelConfig(), device, mixed_precision=model_cfg.mixed_precision,
            param_offload=model_cfg.param_offload, activation_checkpointing=model_cfg.enable_gradient_checkpointing,
            pp_output="values", fsdp_unit=model_cfg.fsdp_unit)
        del model  # with pp, the other stages' layers are freed here
        adopt_layout(self, self.parallel, mesh)
        self.optimizer = build_optimizer(self.model.parameters(), lr=critic_cfg.lr,
                                         weight_decay=critic_cfg.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, total_steps=total_steps,
                                         warmup_steps=critic_cfg.lr_warmup_steps,
                                         warmup_ratio=critic_cfg.lr_warmup_steps_ratio,
                                         style=critic_cfg.warmup_style)
        self.nonfinite = NonFiniteGuard("critic", "lower critic.lr or check the rewards")

    # ------------------------------------------------------------------ forward

    def _values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
        """[B, P+R] -> values [B, R] (fp32) from the positions that predict each response token (no pipeline)."""
        R = response_length
        if self.model_cfg.use_remove_padding:
            return packed_forward_values(self.model, input_ids, attention_mask, response_length=R,
                                         sp_group=self.sp_group, prefix_grouping=self.prefix_grouping)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        logits = out.logits  # [B, L, 1]; the replicated head gives a full tensor under TP
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits[:, -R - 1:-1, 0].float()

    def _pp_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
        """Pipelined forward of B rows -> values [B, R]; pads B up to a multiple of the micro-batch count."""
        rows, k = input_ids.shape[0], self.pipeline.n_microbatches
        pad = (-rows) % k
        if pad:  # repeat the last row; its outputs are dropped
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(pad, -1)])
            attention_mask = torch.cat([attention_mask, attention_mask[-1:].expand(pad, -1)])
        R = response_length
        return self.pipeline.forward(input_ids, attention_mask)[:rows, -R - 1:-1]  # [B, L] -> [B, R]

    def _micro_batches(self, batch: RolloutBatch, size: int, token_budget: int) -> list[torch.Tensor]:
        """Row indices per micro-batch: fixed ``size`` rows, or (use_dynamic_bsz) at most
        ``token_budget`` real tokens each, with the same micro-batch count on every dp rank
        (a rank with fewer rows gets empty micro-batches)."""
        if not self.use_dynamic_bsz:
            return list(split_rows(len(batch), size))
        seq_lens = batch.attention_mask.sum(-1).tolist()
        token_budget *= sp_size(self.sp_group)  # per-GPU budget x sp = one sp group's micro-batch
        groups = micro_batches_for_rank(seq_lens, token_budget, group=self.dp_group, device=self.device)
        return [torch.tensor(sorted(g), dtype=torch.long) for g in groups]

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch, *, micro_batch_size: int) -> torch.Tensor:
        """Values [N, R] of the batch, zero outside ``response_mask`` (eval mode, no grad).

        Without pp: micro-batches of ``micro_batch_size`` rows (or token-budgeted). With
        pp: pipelined calls of ``micro_batch_size x pp_microbatches`` rows.
        """
        self.parallel.eval()
        R = batch.response_length
        if self.pipeline is not None:
            chunks = list(split_rows(len(batch), micro_batch_size * self.pipeline.n_microbatches))
            fwd = self._pp_values
        else:
            chunks = self._micro_batches(batch, micro_batch_size, self.forward_max_token_len)
            fwd = self._values
        parts = []
        for rows in chunks:
            if len(rows) == 0:  # a rank with fewer rows: still run the FSDP collectives
                fwd(batch.input_ids[:1], batch.attention_mask[:1], R)
                continue
            parts.append(fwd(batch.input_ids[rows], batch.attention_mask[rows], R))
        if not parts:
            return batch.response_mask.new_zeros(0, R)
        order = torch.cat([torch.as_tensor(r, dtype=torch.long) for r in chunks])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        values = torch.cat(parts)[inverse.to(self.device)]
        return values * batch.response_mask

    # ------------------------------------------------------------------ update

    def update_critic(self, batch: RolloutBatch, *, mini_batch_rows: int) -> dict[str, float]:
        """Epochs over mini-batches of ``mini_batch_rows`` local rows; one optimizer step each.

        Requires batch.values (old values) and batch.returns. Loss: clipped value loss
        ``0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2)`` aggregated by
        ``critic.loss_agg_mode`` with the mini-batch's global counts.
        """
        cfg = self.cfg
        self.parallel.train()
        return run_ppo_epochs(self, batch, mini_batch_rows=mini_batch_rows, epochs=cfg.ppo_epochs, shuffle=False,
                              max_response_len=self.max_response_length, grad_clip=cfg.grad_clip, prefix="critic",
                              loss_name="vf_loss",
                              mini_step=self._pp_mini_step if self.pipeline is not None else self._mini_step)

    def _loss(self, vpreds: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
              norm: AggNorm) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Value loss of one micro-batch (``[b, R]`` tensors) and its metric terms with their weight
        (device tensors: no host sync per micro-batch)."""
        loss, clipfrac = compute_value_loss(vpreds, old_values, returns, mask, cliprange_value=self.cfg.cliprange_value,
                                            loss_agg_mode=self.cfg.loss_agg_mode, norm=norm)
        w = mask.sum()
        vsum = (vpreds.detach() * mask).sum()
        return loss, {"critic/vf_clipfrac": clipfrac.detach(), "critic/vpred_mean": vsum / w.clamp(min=1.0)}, w

    def _mini_step(self, mini: RolloutBatch, norm: AggNorm, metrics: MetricSums) -> torch.Tensor:
        """Gradient accumulation over micro-batches; returns this rank's loss sum (float64)."""
        cfg = self.cfg
        micro_list = self._micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu)
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, rows in enumerate(micro_list):
            set_grad_sync(self.model, self.model_cfg, last=k == len(micro_list) - 1)
            if len(rows) == 0:
                # Fewer rows than the agreed micro-batch count: a zero-weight pass keeps this
                # rank's FSDP collectives in step with the other dp ranks.
                (self._values(mini.input_ids[:1], mini.attention_mask[:1], mini.response_length).sum() * 0.0).backward()
                continue
            mb = mini.select(rows)
            vpreds = self._values(mb.input_ids, mb.attention_mask, mb.response_length)  # [b, R]
            loss, parts, w = self._loss(vpreds, mb.values, mb.returns, mb.response_mask, norm)
            (loss * self.grad_scale).backward()
            step_loss += loss.detach().double()
            for name, value in parts.items():
                metrics.add(name, value, w)
        return step_loss

    def _pp_mini_step(self, mini: RolloutBatch, norm: AggNorm, metrics: MetricSums) -> torch.Tensor:
        """One pipelined forward-backward over the mini-batch; the value loss runs on the last stage."""
        R = mini.response_length
        calls: list[tuple[dict, float]] = []

        def stage_loss(values, *, response_mask, old_values, returns):
            # values [b, L] aligned with input_ids; position P+t-1 predicts response token t.
            loss, parts, w = self._loss(values[:, -R - 1:-1], old_values, returns, response_mask, norm)
            calls.append((parts, w))
            return loss * self.grad_scale

        inputs = {"response_mask": mini.response_mask, "old_values": mini.values, "returns": mini.returns}
        total = self.pipeline.forward_backward(mini.input_ids, mini.attention_mask, stage_loss, inputs)
        # The schedule's shape inference calls the loss once more on placeholder data before
        # the real micro-batches; only the last n_microbatches calls are real.
        for parts, w in calls[len(calls) - self.pipeline.n_microbatches:] if calls else []:
            for name, value in parts.items():
                metrics.add(name, value, w)
        return total.double() / self.grad_scale
