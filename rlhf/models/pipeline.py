"""Pipeline parallelism for HF decoder-only LMs with ``torch.distributed.pipelining``.

The model is cut by decoder layers into ``pp * virtual_stages`` stages of equal size:
the token embedding goes with the first stage, the final norm and head (``lm_head`` or
a critic's ``score``) with the last. Every stage is a :class:`PipelineStageModule`, an
ordinary ``nn.Module`` whose parameter names are the HF names (``model.layers.5.mlp...``),
so ``apply_tp`` and ``fully_shard`` apply to it unchanged and a full HF state dict is the
union of the stages' state dicts.

How RL losses get their per-micro-batch tensors
-----------------------------------------------
``torch.distributed.pipelining`` calls ``loss_fn(output, target)`` with the micro-batch
slice of one ``target`` tensor. :class:`PipelineModel` passes ``target = arange(B)``, so
each call receives the *row indices* of its micro-batch, and slices every tensor of
``loss_inputs`` (old log-probs, advantages, masks, ...) with them before calling the
user's ``loss_fn(log_probs, **slices)``. The slicing is therefore correct for any
schedule order. Attention masks, position ids and labels reach every stage through the
schedule's per-stage keyword arguments (all pp ranks of a dp replica hold the same
batch, as in SPMD training), so only hidden states travel between stages.

The last stage computes token log-probs itself (``output="logprobs"``; vocab-parallel
without gathering logits when the head is tensor-parallel), so stage boundaries and
the loss see ``[b, L]`` instead of ``[b, L, V]``. Convention, aligned with
``input_ids``: ``log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` and
``log_probs[:, 0] = 0``; entropy likewise (of the distribution that produced token t).

Loss scaling: gradients are the *sum* over micro-batches (``scale_grads=False``), so
``loss_fn`` must normalise by global counts (e.g. tokens in the whole mini-batch); the
returned loss is the sum of the micro-batch losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from rlhf.models.vocab_parallel import log_probs_from_logits

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
OUTPUTS = ("logprobs", "logits", "values")
_SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

OutputKind = Literal["logprobs", "logits", "values"]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` position ids counting only real tokens (verl's
    ``compute_position_id_with_mask``): left padding gets position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def split_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Layer indices of each stage, contiguous and equal-sized.

    Raises ``ValueError`` when ``num_stages`` does not divide ``num_layers``.
    """
    if num_stages < 1 or num_layers % num_stages != 0:
        raise ValueError(
            f"num_hidden_layers={num_layers} is not divisible by the number of pipeline "
            f"stages {num_stages} (parallel.pp x virtual stages); choose pp dividing {num_layers}"
        )
    per = num_layers // num_stages
    return [list(range(s * per, (s + 1) * per)) for s in range(num_stages)]


def _check_pp_supported(model: nn.Module) -> None:
    inner = getattr(model, "model", None)
    ok = (
        getattr(getattr(model, "config", None), "model_type", None) in _SUPPORTED_MODEL_TYPES
        and inner is not None
        and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
        and (hasattr(model, "lm_head") or hasattr(model, "score"))
    )
    if not ok:
        raise ValueError(
            f"pipeline parallel cannot split {type(model).__name__}; supported: Llama, Qwen2, "
            "Qwen3, Mistral *ForCausalLM / *ForTokenClassification"
        )


class PipelineStageModule(nn.Module):
    """Stage ``stage_index`` of ``num_stages`` cut from an HF causal LM (or critic).

    Holds references to the source model's modules (no copy) under the HF names:
    ``model.embed_tokens`` (first stage), ``model.layers.<i>`` for its layers ``i``,
    ``model.rotary_emb`` (every stage, buffers only), ``model.norm`` and ``lm_head`` /
    ``score`` (last stage). Apply FSDP per block on ``self.model.layers.values()``.

    A critic's ``score`` head is applied without the classifier dropout of HF's
    ``*ForTokenClassification`` (values are deterministic, as with dropout disabled).

    Forward: ``x`` is ``input_ids [b, L]`` on the first stage and hidden states
    ``[b, L, H]`` elsewhere; non-last stages return hidden states ``[b, L, H]``, the last
    returns ``self.output`` (see :class:`PipelineModel`).
    """

    def __init__(
        self, model: nn.Module, layer_ids: list[int], *, stage_index: int, num_stages: int
    ) -> None:
        super().__init__()
        self.config = model.config
        self.source_class_name = type(model).__name__
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        # Set by PipelineModel; plain attributes so they are not parameters.
        self.output: OutputKind = "logprobs"
        self.temperature = 1.0
        self.compute_entropy = False

        src = model.model
        inner = nn.Module()
        inner.embed_tokens = src.embed_tokens if self.is_first else None
        inner.layers = nn.ModuleDict({str(i): src.layers[i] for i in layer_ids})
        inner.norm = src.norm if self.is_last else None
        inner.rotary_emb = src.rotary_emb
        self.model = inner
        self.lm_head = getattr(model, "lm_head", None) if self.is_last else None
        self.score = getattr(model, "score", None) if self.is_last else None

    def hf_param_names(self) -> dict[str, str]:
        """Stage parameter name -> HF name (identical by construction; kept explicit so
        callers need not rely on it). FSDP2 keeps names, so this holds after sharding."""
        return {name: name for name, _ in self.named_parameters(remove_duplicate=False)}

    def _layer_masks(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[str, torch.Tensor | None]:
        # Same mask builders as the HF model forward, so padding behaves identically.
        kw = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        cfg = self.config
        if cfg.model_type == "mistral":
            fn = create_causal_mask if cfg.sliding_window is None else create_sliding_window_causal_mask
            mask = fn(**kw)
            return {"full_attention": mask, "sliding_attention": mask}
        masks: dict[str, torch.Tensor | None] = {"full_attention": create_causal_mask(**kw)}
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        return masks

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See class docstring. ``attention_mask [b, L]`` (1 = token, 0 = padding, left or
        right), ``position_ids [b, L]`` (default from the mask), ``labels [b, L]`` (the
        input ids; needed by the last stage for ``output="logprobs"``)."""
        hidden = self.model.embed_tokens(x) if self.is_first else x
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)
        masks = self._layer_masks(hidden, attention_mask, position_ids)
        position_embeddings = self.model.rotary_emb(hidden, position_ids)
        layer_types = getattr(self.config, "layer_types", None)
        for idx, layer in self.model.layers.items():
            kind = layer_types[int(idx)] if layer_types else "full_attention"
            hidden = layer(
                hidden,
                attention_mask=masks[kind],
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
            if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
                hidden = hidden[0]
        if not self.is_last:
            return hidden
        hidden = self.model.norm(hidden)
        return self._head(hidden, labels)

    def _head(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if self.output == "values":
            if self.score is None:
                raise ValueError("output='values' needs a model with a `score` head")
            values = self.score(hidden)  # [b, L, 1]
            if isinstance(values, DTensor):
                values = values.full_tensor()
            return values.squeeze(-1).float()
        if self.lm_head is None:
            raise ValueError(f"output={self.output!r} needs a model with an `lm_head`")
        logits = self.lm_head(hidden)  # [b, L, V] (vocab-sharded DTensor under loss-parallel TP)
        if self.output == "logits":
            return (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()
        if labels is None:
            raise ValueError("output='logprobs' needs `labels` on the last stage")
        # logits[:, t] predicts labels[:, t + 1]; output aligned with the labels.
        lp, ent = log_probs_from_logits(
            logits[:, :-1],
            labels[:, 1:],
            temperature=self.temperature,
            compute_entropy=self.compute_entropy,
        )
        lp = nn.functional.pad(lp, (1, 0))  # [b, L], position 0 has no prediction
        if ent is None:
            return lp
        return torch.stack([lp, nn.functional.pad(ent, (1, 0))], dim=-1)  # [b, L, 2]


def tied_grad_sum(grads: list[torch.Tensor], shape: tuple, device: torch.device) -> torch.Tensor:
    """fp32 sum on ``device`` of the local tensors of the tied embedding / lm_head gradients (on the
    host under ``model.param_offload``: each is moved to ``device`` before it is added)."""
    total = torch.zeros(shape, device=device, dtype=torch.float32)
    for g in grads:
        total += (g.to_local() if isinstance(g, DTensor) else g).float().to(device)
    return total


class PipelineModel:
    """Runs a causal LM split into pipeline stages over ``pp_mesh``.

    Args:
        model: an HF ``*ForCausalLM`` (or ``*ForTokenClassification`` critic with
            ``output="values"``) of a supported family; after construction only this
            rank's stages should be kept alive (drop the caller's reference to save memory).
        pp_mesh: ``mesh["pp"]``.
        n_microbatches: micro-batches per call; must divide the batch size.
        schedule: one of ``SCHEDULES``; ``"Interleaved1F1B"`` puts ``virtual_stages``
            (default 2) stages on each rank, looped.
        device: the device of this rank.
        output: what the last stage produces: ``"logprobs"`` (``[B, L]``, see module
            docstring), ``"logits"`` (``[B, L, V]`` float32, gathered) or ``"values"``
            (``[B, L]`` from a ``score`` head).
        temperature / compute_entropy: for ``output="logprobs"``.
        place_stages: move the stages to ``device`` here; ``parallelize_model`` passes False
            and places only this rank's shards after TP / FSDP2.

    Attributes:
        stages: this rank's :class:`PipelineStageModule` s (one unless interleaved); apply
            ``apply_tp`` then ``fully_shard`` to each (per block, then the stage root)
            before the first call.
    """

    def __init__(
        self,
        model: nn.Module,
        pp_mesh: DeviceMesh,
        *,
        n_microbatches: int,
        schedule: str = "1F1B",
        device: torch.device | str,
        output: OutputKind = "logprobs",
        temperature: float = 1.0,
        compute_entropy: bool = False,
        virtual_stages: int | None = None,
        place_stages: bool = True,
    ) -> None:
        _check_pp_supported(model)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        if output not in OUTPUTS:
            raise ValueError(f"unknown pipeline output {output!r}; valid: {', '.join(OUTPUTS)}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self.pp_mesh = pp_mesh
        self.pp_group = pp_mesh.get_group()
        self.pp = pp_mesh.size()
        self.pp_rank = pp_mesh.get_local_rank()
        self.n_microbatches = n_microbatches
        self.schedule_name = schedule
        self.device = torch.device(device)
        self.output: OutputKind = output
        self.compute_entropy = compute_entropy
        interleaved = schedule == "Interleaved1F1B"
        self.virtual_stages = (virtual_stages or 2) if interleaved else 1
        if interleaved and n_microbatches % self.pp != 0:
            raise ValueError(
                f"Interleaved1F1B needs n_microbatches={n_microbatches} divisible by pp={self.pp}"
            )
        num_stages = self.pp * self.virtual_stages
        layer_split = split_layers(model.config.num_hidden_layers, num_stages)
        # Looped placement: rank r holds stages r, r + pp, ...; the last stage is on rank pp-1.
        self.stages: list[PipelineStageModule] = []
        for stage_index in range(self.pp_rank, num_stages, self.pp):
            stage = PipelineStageModule(
                model, layer_split[stage_index], stage_index=stage_index, num_stages=num_stages
            )
            stage.output, stage.temperature, stage.compute_entropy = output, temperature, compute_entropy
            self.stages.append(stage.to(self.device) if place_stages else stage)
        self.num_stages = num_stages
        self._last_rank_global = dist.get_global_rank(self.pp_group, self.pp - 1)
        # Tied embedding split across ranks: first and last stage hold separate copies
        # whose gradients are summed after backward (Megatron's embedding group).
        self.tied_across_ranks = bool(getattr(model.config, "tie_word_embeddings", False)) and (
            getattr(model, "lm_head", None) is not None and self.pp > 1
        )
        if self.tied_across_ranks:
            for stage in self.stages:
                if stage.is_last and stage.lm_head.weight is model.model.embed_tokens.weight:
                    tied = stage.lm_head.weight
                    stage.lm_head.weight = nn.Parameter(tied.detach().clone())
                    for attr in ("_rlhf_source", "_rlhf_where"):  # a deferred load's reader (shard_init)
                        if hasattr(tied, attr):
                            setattr(stage.lm_head.weight, attr, getattr(tied, attr))

    # ------------------------------------------------------------------ helpers
    @property
    def has_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def parameters(self):
        """This rank's trainable parameters (for the optimizer)."""
        for stage in self.stages:
            yield from stage.parameters()

    def named_hf_parameters(self) -> dict[str, nn.Parameter]:
        """HF parameter name -> this rank's parameter (DTensor when sharded)."""
        out: dict[str, nn.Parameter] = {}
        for stage in self.stages:
            params = dict(stage.named_parameters(remove_duplicate=False))
            for name, hf_name in stage.hf_param_names().items():
                out[hf_name] = params[name]
        return out

    def _build_schedule(self, loss_fn: Callable | None):
        stages = [
            PipelineStage(s, s.stage_index, self.num_stages, self.device, group=self.pp_group)
            for s in self.stages
        ]
        if self.schedule_name == "Interleaved1F1B":
            return ScheduleInterleaved1F1B(
                stages, self.n_microbatches, loss_fn=loss_fn, scale_grads=False
            )
        cls = ScheduleGPipe if self.schedule_name == "GPipe" else Schedule1F1B
        return cls(stages[0], self.n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def _check_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"expected input_ids and attention_mask [B, L], got {tuple(input_ids.shape)} "
                f"and {tuple(attention_mask.shape)}"
            )
        if input_ids.shape[0] % self.n_microbatches != 0:
            raise ValueError(
                f"batch size {input_ids.shape[0]} is not divisible by "
                f"n_microbatches={self.n_microbatches}"
            )

    def _step_args(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        kwargs = {
            "attention_mask": attention_mask,
            "position_ids": positions_from_mask(attention_mask),
        }
        if any(s.is_last for s in self.stages) and self.output == "logprobs":
            kwargs["labels"] = input_ids
        args = (input_ids,) if self.pp_rank == 0 else ()
        return args, kwargs

    def _broadcast_from_last(self, tensor: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        if not self.has_last_stage:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=self._last_rank_global, group=self.pp_group)
        return tensor

    def _sync_tied_grads(self) -> None:
        first = self.stages[0].model.embed_tokens if self.stages[0].is_first else None
        last = next((s.lm_head for s in self.stages if s.is_last), None)
        ref = first.weight if first is not None else (last.weight if last is not None else None)
        # Every pp rank joins the all-reduce; ranks without either end add zeros.
        shape = None if ref is None else (ref.to_local() if isinstance(ref, DTensor) else ref).shape
        shape_t = torch.tensor(list(shape) if shape is not None else [0, 0], device=self.device)
        dist.all_reduce(shape_t, op=dist.ReduceOp.MAX, group=self.pp_group)
        grads = [mod.weight.grad for mod in (first, last) if mod is not None and mod.weight.grad is not None]
        total = tied_grad_sum(grads, tuple(shape_t.tolist()), self.device)
        dist.all_reduce(total, group=self.pp_group)
        for mod in (first, last):
            if mod is not None and mod.weight.grad is not None:
                g = mod.weight.grad
                (g.to_local() if isinstance(g, DTensor) else g).copy_(total)

    # ------------------------------------------------------------------ public
    def forward_backward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_fn: Callable[..., torch.Tensor],
        loss_inputs: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """One pipelined forward + backward over ``n_microbatches`` micro-batches.

        Args:
            input_ids, attention_mask: ``[B, L]``, the same on every pp rank.
            loss_fn: ``loss_fn(output [b, ...], **slices) -> scalar`` where ``output`` is
                the last stage's output for a micro-batch of ``b = B / n_microbatches``
                rows and ``slices`` are the matching rows of ``loss_inputs``; with
                ``compute_entropy`` it is called as ``loss_fn(log_probs, entropy=...,
                **slices)``. Normalise by global counts: gradients are summed over
                micro-batches.
            loss_inputs: ``name -> [B, ...]`` tensors (old log-probs, advantages, masks).

        Returns:
            The sum of the micro-batch losses (detached), on every pp rank. Gradients are
            accumulated into this rank's stage parameters.
        """
        self._check_batch(input_ids, attention_mask)
        batch = input_ids.shape[0]
        for name, value in loss_inputs.items():
            if value.shape[0] != batch:
                raise ValueError(f"loss_inputs[{name!r}] has {value.shape[0]} rows, batch has {batch}")
        loss_inputs = {k: v.to(self.device) for k, v in loss_inputs.items()}
        split_entropy = self.output == "logprobs" and self.compute_entropy

        def _loss(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            slices = {k: v.index_select(0, rows) for k, v in loss_inputs.items()}
            if split_entropy:
                return loss_fn(output[..., 0], entropy=output[..., 1], **slices)
            return loss_fn(output, **slices)

        schedule = self._build_schedule(_loss)
        args, kwargs = self._step_args(input_ids, attention_mask)
        rows = torch.arange(batch, device=self.device)
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=rows, losses=losses, return_outputs=False, **kwargs)
        if self.tied_across_ranks:
            self._sync_tied_grads()
        total = torch.stack([l.detach().float() for l in losses]).sum() if self.has_last_stage else None
        return self._broadcast_from_last(total, (), torch.float32)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Pipelined forward without grad; the last stage's output, broadcast to all pp
        ranks: ``[B, L]`` log-probs or values, ``[B, L, 2]`` (log-prob, entropy) with
        ``compute_entropy``, or ``[B, L, V]`` logits."""
        self._check_batch(input_ids, attention_mask)
        schedule = self._build_schedule(None)
        args, kwargs = self._step_args(input_ids, attention_mask)
        out = schedule.step(*args, **kwargs)
        batch, length = input_ids.shape
        if self.output == "logits":
            shape: tuple[int, ...] = (batch, length, self.stages[0].config.vocab_size)
        elif self.output == "logprobs" and self.compute_entropy:
            shape = (batch, length, 2)
        else:
            shape = (batch, length)
        return self._broadcast_from_last(
            out.float() if self.has_last_stage else None, shape, torch.float32
        )
