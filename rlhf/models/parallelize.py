"""The training layout of one model on the ("pp", "dp", "tp") mesh, torchtitan-style.

:func:`parallelize_model` applies the parallelisms in one fixed order, each a small
function that is tested alone:

    1. pipeline split   (pp > 1)  rlhf.models.pipeline.PipelineModel -> this rank's stage(s)
    2. apply_tp         (tp > 1)  rlhf.models.tensor_parallel.apply_tp on mesh["tp"], per stage
       apply_ep         (ep > 1)  rlhf.models.expert_parallel.apply_ep: experts over mesh["ep"] (x tp)
    3. apply_ac         (opt-in)  activation checkpointing per decoder block
    4. apply_fsdp                 FSDP2 on mesh["dp"] per decoder block and per stage root

TP and FSDP2 are applied on the meta device; only this rank's shards are then copied
from the host model to the device (:mod:`rlhf.models.shard_init`).

The result is a :class:`ParallelModel`: ``module`` is an ``nn.Module`` whose parameter
names are the HF names of the parameters this rank holds (the FSDP root without pp; the
stage - or a union of the stages of an interleaved schedule - with pp), so the optimizer,
DCP checkpoints and the rollout reshard see HF names in every layout. ``pipeline`` runs
pipelined forward / forward-backward when pp > 1.

:func:`validate_layout` checks every size of a run before any model is built and names
the product that does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rlhf.models.activation_checkpointing import apply_ac
from rlhf.models.expert_parallel import apply_ep
from rlhf.models.fsdp import apply_fsdp, resolve_fsdp_unit
from rlhf.models.loading import decoder_layers
from rlhf.models.moe_archs import num_experts
from rlhf.models.parallel import ParallelDims, expert_fsdp_mesh, fsdp_mesh
from rlhf.models.pipeline import SCHEDULES, PipelineModel, PipelineStageModule
from rlhf.models.shard_init import params_to_meta
from rlhf.models.tensor_parallel import apply_tp, moe_sizes
from rlhf.models.ulysses import check_sp
from rlhf.schema.config import ConfigError


@dataclass
class ParallelModel:
    """One model in the training layout.

    Attributes:
        module: HF-named parameters of this rank (FSDP2 / TP DTensors); call it directly
            only when ``pipeline is None``.
        pipeline: the pipeline runner when pp > 1, else None.
        pp_group: the pipeline process group (None when pp == 1).
        tied_lm_head: with pp > 1 and tied embeddings, the last stage's ``lm_head.weight``
            is a copy of ``model.embed_tokens.weight`` (grads summed by the pipeline); the
            grad norm must count it once, so it is named here.
    """

    module: nn.Module
    pipeline: Optional[PipelineModel]
    pp_group: Optional[dist.ProcessGroup]
    tied_lm_head: Optional[nn.Parameter] = None
    fsdp_unit: str = "block"  # as applied (rlhf.models.fsdp.resolve_fsdp_unit)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def norm_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients enter the global grad norm (tied copies once)."""
        skip = self.tied_lm_head
        return [p for p in self.module.parameters() if p is not skip]

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.train(False)


class StageUnion(nn.Module):
    """The stages an interleaved schedule puts on one rank, under their HF names.

    Holds references (no copies) to the stages' modules: ``model.embed_tokens`` (if the
    first stage is here), ``model.layers.<i>`` of every local stage, ``model.norm`` and
    ``lm_head`` / ``score`` (if the last stage is here).
    """

    def __init__(self, stages: list[PipelineStageModule]) -> None:
        super().__init__()
        self.config = stages[0].config
        inner = nn.Module()
        inner.layers = nn.ModuleDict()
        for stage in stages:
            for key, layer in stage.model.layers.items():
                inner.layers[key] = layer
        first = next((s for s in stages if s.is_first), None)
        last = next((s for s in stages if s.is_last), None)
        inner.embed_tokens = first.model.embed_tokens if first is not None else None
        inner.norm = last.model.norm if last is not None else None
        self.model = inner
        self.lm_head = last.lm_head if last is not None else None
        self.score = last.score if last is not None else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never called
        raise RuntimeError("StageUnion only names parameters; run the PipelineModel instead")


def parallelize_model(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg: Any,
    device: torch.device,
    *,
    mixed_precision: bool = True,
    param_offload: bool = False,
    activation_checkpointing: bool = False,
    pp_output: str = "logprobs",
    loss_parallel: bool = True,
    load_ranks_per_node: int = 0,
    fsdp_unit: str = "block",
) -> ParallelModel:
    """Put ``model`` into the training layout of ``mesh`` (see module docstring).

    Args:
        model: an HF ``*ForCausalLM`` (or ``*ForTokenClassification`` critic with
            ``pp_output="values"``) on CPU in its master dtype; the caller should drop its
            reference afterwards (with pp, the other ranks' layers are then freed).
        mesh: the ("pp", "dp", "tp") mesh of :class:`rlhf.models.parallel.ParallelDims`.
        cfg: a :class:`rlhf.schema.config.ParallelConfig` (reads ``pp_schedule`` and
            ``pp_microbatches``; sizes come from the mesh).
        device: this rank's device.
        activation_checkpointing: recompute each decoder block in the backward.
        pp_output: what the last pipeline stage returns (``"logprobs"`` / ``"values"``).
        loss_parallel: keep LM-head logits vocab-sharded under TP (never gathered).
        load_ranks_per_node: local ranks that read and place their shards at once
            (``model.load_ranks_per_node``; 0 = auto).
        fsdp_unit: ``model.fsdp_unit`` (auto / block / model), resolved per pipeline stage
            from its parameter bytes (:func:`rlhf.models.fsdp.resolve_fsdp_unit`).

    Returns:
        A :class:`ParallelModel`.
    """
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    expert_mesh = expert_fsdp_mesh(mesh)
    if expert_mesh is not None and not num_experts(model.config):
        raise ConfigError(f"parallel.ep={mesh['ep'].size()} needs a mixture-of-experts model; "
                          f"{model.config.model_type} has no experts (set parallel.ep=1)")
    pipeline: Optional[PipelineModel] = None
    tied_lm_head = None
    if pp > 1:
        pipeline = PipelineModel(model, mesh["pp"], n_microbatches=cfg.pp_microbatches,
                                 schedule=cfg.pp_schedule, device=device, output=pp_output, place_stages=False)
        parts: list[nn.Module] = list(pipeline.stages)
    else:
        parts = [model]
    units = []
    for part in parts:
        units.append(resolve_fsdp_unit(fsdp_unit, sum(p.numel() * p.element_size() for p in part.parameters())))
        host = params_to_meta(part)  # TP and FSDP2 shard on meta; only this rank's shards reach the device
        if tp > 1:
            apply_tp(part, mesh["tp"], loss_parallel=loss_parallel, experts=expert_mesh is None)
        if expert_mesh is not None:
            apply_ep(part, mesh)
        if activation_checkpointing:
            apply_ac(part, blocks=decoder_layers(part))
        apply_fsdp(part, fsdp_mesh(mesh), device=device, mixed_precision=mixed_precision, param_offload=param_offload,
                   host=host, expert_mesh=expert_mesh, load_ranks_per_node=load_ranks_per_node, unit=units[-1])
    if pipeline is None:
        module: nn.Module = model
    else:
        module = pipeline.stages[0] if len(pipeline.stages) == 1 else StageUnion(pipeline.stages)
        if pipeline.tied_across_ranks and module.lm_head is not None:
            tied_lm_head = module.lm_head.weight
        # Lets the rollout reshard find the stage group from the module alone.
        module.pp_group = mesh["pp"].get_group()
    return ParallelModel(module=module, pipeline=pipeline, pp_group=mesh["pp"].get_group() if pp > 1 else None,
                         tied_lm_head=tied_lm_head, fsdp_unit="model" if set(units) == {"model"} else "block")


# ---------------------------------------------------------------------- grad norm


def _replication(p: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks of one pipeline stage hold this same local shard of ``p``."""
    if not isinstance(p, DTensor):
        return stage_ranks
    shards = 1
    for size, placement in zip(p.device_mesh.shape, p.placements):  # no tensor op (fake mode: rlhf.simulate)
        if placement.is_partial():
            raise ValueError("grad norm: a gradient is still Partial (unreduced); reduce it before clipping")
        if not placement.is_replicate():  # Shard or FSDP2's _StridedShard (not a Shard subclass)
            shards *= int(size)
    return stage_ranks // shards


@torch.no_grad()
def global_grad_norm(params: list[nn.Parameter], *, stage_ranks: int, group: Optional[dist.ProcessGroup] = None,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """L2 norm of all gradients of the model over every rank of ``group`` (default: world).

    Works for any mix of DTensor meshes (FSDP-only ``[dp]`` and FSDP x TP ``[dp, tp]``
    parameters) and pipeline stages: each rank sums the squares of its local shards,
    divided by the number of ranks of its stage that hold the same shard (``stage_ranks
    = dp x tp`` over the Shard placements), and one all-reduce over ``group`` (all pp x dp
    x tp ranks) adds the stages. Returns a float32 scalar, identical on every rank.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    # local shards (on the host under param_offload) grouped by what one _foreach_norm can take
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        groups.setdefault((local.device, local.dtype, _replication(g, stage_ranks)), []).append(local)
    for (_, _, rep), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        total += (torch.stack(norms).double().pow(2).sum() / rep).to(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt().float()


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, *, stage_ranks: int,
                    group: Optional[dist.ProcessGroup] = None,
                    norm_params: Optional[list[nn.Parameter]] = None,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """Scale gradients so that their global L2 norm is at most ``max_norm``; returns the norm.

    ``coef = min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``.
    ``params`` are all parameters to scale (tied copies included); ``norm_params`` (default
    ``params``) the de-duplicated ones the norm is computed over.
    """
    norm = global_grad_norm(params if norm_params is None else norm_params, stage_ranks=stage_ranks, group=group,
                            device=device)
    # On the device, applied to every gradient (x1 when under the bound): no host sync. One
    # multi-tensor multiply per device on the local shards, not a DTensor op (and its dispatch)
    # per parameter; elementwise the same product, so the same bits.
    coef = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # a view: scaled in place
            by_device.setdefault(local.device, []).append(local)  # CPU under param_offload
    for dev, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(dev))
    return norm


# ---------------------------------------------------------------------- validation


def validate_layout(parallel: Any, hf_config: Any, world_size: int, *, rollout_tp: int = 1,
                    train_batch_size: Optional[int] = None, mini_batch_size: Optional[int] = None,
                    n: int = 1, micro_batch_size: Optional[int] = None, use_remove_padding: bool = True) -> None:
    """Raise ``ConfigError`` naming the first size of the layout that does not divide.

    Checks, in order: world size by ``tp x pp``; ``num_attention_heads`` /
    ``num_key_value_heads`` / ``intermediate_size`` / ``vocab_size`` by ``parallel.tp``;
    ``num_hidden_layers`` by ``parallel.pp``; the prompt batches by dp; pipeline
    micro-batches; ``rollout.tp`` dividing the world and the heads.
    """
    tp, pp, sp = parallel.tp, parallel.pp, getattr(parallel, "sp", 1)
    # World size, dp and sp sizes; sp x (tp, pp, padding-free, heads) combinations.
    ep = getattr(parallel, "ep", 1)
    dp = ParallelDims.resolve(parallel.dp, tp, pp, world_size, sp=sp, ep=ep).dp
    if ep > 1:
        experts = num_experts(hf_config)
        if not experts:
            raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model; "
                              f"{hf_config.model_type} has no experts (set parallel.ep=1)")
        if experts % (ep * tp):
            raise ConfigError(f"impossible parallel layout: model num_experts={experts} is not divisible by "
                              f"parallel.ep x tp = {ep} x {tp}")
    check_sp(sp, hf_config, tp=tp, pp=pp, use_remove_padding=use_remove_padding)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "intermediate_size": hf_config.intermediate_size, "vocab_size": hf_config.vocab_size,
             **moe_sizes(hf_config)}
    for key, value in sizes.items():
        if value % tp:
            raise ConfigError(f"impossible parallel layout: model {key}={value} is not divisible by "
                              f"parallel.tp={tp}; choose a tp that divides {value}")
    if pp > 1:
        if parallel.pp_schedule not in SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule: unknown schedule {parallel.pp_schedule!r}; "
                              f"valid: {', '.join(SCHEDULES)}")
        stages = pp * (2 if parallel.pp_schedule == "Interleaved1F1B" else 1)
        if hf_config.num_hidden_layers % stages:
            raise ConfigError(f"impossible parallel layout: model num_hidden_layers={hf_config.num_hidden_layers} "
                              f"is not divisible by the {stages} pipeline stages (parallel.pp={pp}"
                              f"{' x 2 virtual stages' if stages != pp else ''})")
    for key, value in (("data.train_batch_size", train_batch_size), ("actor.ppo_mini_batch_size", mini_batch_size)):
        if value is not None and value % dp:
            raise ConfigError(f"impossible parallel layout: {key} ({value}) is not divisible by dp ({dp} = "
                              f"world {world_size} / (tp {tp} x pp {pp}))")
    if pp > 1 and mini_batch_size is not None:
        rows = mini_batch_size * n // dp
        if rows % parallel.pp_microbatches:
            raise ConfigError(f"impossible parallel layout: the local mini-batch of actor.ppo_mini_batch_size x "
                              f"rollout.n / dp = {mini_batch_size} x {n} / {dp} = {rows} rows is not divisible by "
                              f"parallel.pp_microbatches={parallel.pp_microbatches}")
    if rollout_tp < 1 or world_size % rollout_tp:
        raise ConfigError(f"impossible rollout layout: rollout.tp={rollout_tp} does not divide the world size "
                          f"{world_size} (= parallel.dp x tp x pp = {dp} x {tp} x {pp})")
    for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                       ("intermediate_size", hf_config.intermediate_size), *moe_sizes(hf_config).items()):
        if key == "num_key_value_heads" and rollout_tp > value and rollout_tp % value == 0:
            continue  # a rollout wider than the KV heads replicates them (as vLLM)
        if value % rollout_tp:
            raise ConfigError(f"impossible rollout layout: model {key}={value} is not divisible by "
                              f"rollout.tp={rollout_tp}")
