"""Training layout -> rollout layout: one pass that turns the actor's shards into rollout weights.

Training layout: every parameter is a DTensor sharded over dp (FSDP2) and possibly tp,
and with pp each rank holds only its stages' parameters. Rollout layout (HybridFlow
style): ``rollout.tp`` consecutive ranks form a rollout TP group, and the model is
replicated over the ``world / rollout.tp`` rollout-dp groups. The rollout weights of a
rank are a plain dict of HF-named tensors:

=====================================  ===============================================
q/k/v_proj, gate/up_proj (weight, bias)  rows of this rank's rollout-TP slice (column parallel)
qkv_proj, gate_up_proj (Phi-3, fused)    the rows of this rank's slice of EACH part (q, k, v /
                                         gate, up), concatenated: the fused layout of the
                                         rank's heads / columns
o_proj, down_proj (weight)               columns of the slice (row parallel; the decoder
                                         all-reduces their outputs)
mlp.experts.gate_up_proj / down_proj     whole experts: ``[E, ...]`` split on dim 0 (MoE
(MoE families; GPT-OSS: + their _bias)   experts over tp, ``rlhf.models.moe``); Qwen2-MoE's
                                         ``mlp.shared_expert.*`` like a dense MLP
self_attn.sinks (GPT-OSS)                the slice's query heads (dim 0)
everything else                          full (embeddings, LM head, norms, o_proj bias, MoE
                                         router ``mlp.gate``): the decoder computes
                                         full-vocab logits on every rank, so sampling needs
                                         no logits gather
=====================================  ===============================================

How the pass works (:func:`gather_rollout_weights`), parameter by parameter, so that at
most one gathered full parameter exists at a time next to the rollout copy:

1. cast the local shard to the rollout dtype (halves the bytes for bf16 rollouts), and
   move it to the mesh's device if it is not there (FSDP2 CPU offload keeps shards in
   host memory, which NCCL cannot read; :func:`rlhf.models.parallel.collective_device`);
2. DTensor ``redistribute``: dp (and tp) dims -> ``Replicate`` (an all-gather). When the
   training TP group *is* the rollout TP group and the parameter is already sharded on
   the rollout's dim, the tp dim is kept ``Shard`` and only dp is gathered;
3. otherwise slice the rollout-TP part of the full tensor (and drop the full tensor);
4. with pp: each stage packs its results into one flat buffer per dtype and broadcasts it
   over the pp group; receivers keep views of it (one broadcast per stage and dtype).

With ``quantization="fp8"`` (rollout.quantization) each linear weight of the decoder layers
(:func:`quantized_name`) leaves the pass as float8_e4m3fn next to its float32 scales under
:func:`rlhf.models.fp8.scale_name` (DeepSeek-V3's ``weight_scale_inv``), quantized right after its
gather (step 3), so one full-precision parameter at a time exists beside the FP8 copy. Embeddings,
norms, the MoE router, biases, the LM head and a VLM's vision tower stay in the rollout dtype.

Nothing is kept after the rollout window: the caller drops the dict after generation.
"""

from __future__ import annotations

import datetime
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlhf.models import fp8
from rlhf.models.parallel import to_mesh_device

# Prefixes/infixes that wrappers add to parameter names; rollout wants plain HF names.
_WRAPPER_PARTS = re.compile(r"(_checkpoint_wrapped_module\.|_orig_mod\.|_fsdp_wrapped_module\.)")
_COLUMN = re.compile(r"\.(self_attn\.([qkv]|qkv|q_b|kv_b)_proj|mlp\.(shared_experts?\.)?(gate|up|gate_up)_proj)"
                     r"\.(weight|bias)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.(shared_experts?\.)?down_proj)\.weight$")
_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")  # GPT-OSS: per-expert biases
_SINKS = re.compile(r"\.self_attn\.sinks$")  # GPT-OSS: one logit per query head, split with the q heads
# DeepSeek-V3's router weight and selection bias stay in the master dtype (HF keeps them in fp32; the
# bias is a buffer, sent too): a bf16 bias would pick other experts than the trainer
_ROUTER = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")
# the decoder layers' linear weights (dense, fused, MLA, shared and routed experts): what FP8 rollout quantizes
_LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(.+_proj\.weight|experts\.(gate_up_proj|down_proj))$")
_FUSED = re.compile(r"\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")


def hf_name(name: str) -> str:
    """Plain HF name: strip activation-checkpoint / compile wrapper parts and PEFT's
    ``base_model.model.`` prefix / ``.base_layer.`` infix (adapter weights keep ``.lora_``)."""
    name = _WRAPPER_PARTS.sub("", name)
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def quantized_name(name: str) -> bool:
    """Whether FP8 rollout quantizes the HF parameter ``name``: a decoder layer's linear weight (not a
    bias, norm, router gate, embedding, LM head, LoRA adapter or vision-tower weight)."""
    return _LINEAR.search(name) is not None and ".visual." not in f".{name}" and ".lora_" not in name


def quantize_rollout_weights(weights: dict[str, torch.Tensor], quantization: Optional[str],
                             quantization_scale: fp8.Scheme = "block") -> dict[str, torch.Tensor]:
    """``weights`` with each :func:`quantized_name` tensor replaced by its FP8 form and scales (in place;
    a no-op without ``quantization``). For rollout weights built outside :func:`gather_rollout_weights`
    (LoRA's merged copy, the pp receivers)."""
    if quantization is None:
        return weights
    for name in [n for n in weights if quantized_name(n) and weights[n].dtype != fp8.FP8]:
        weights[name], weights[fp8.scale_name(name)] = fp8.quantize(weights[name], quantization_scale)
    return weights


def rollout_shard_dim(name: str) -> Optional[int]:
    """Dim an HF parameter is split on in a tensor-parallel rollout (None: replicated).

    A vision-language model's tower (``model.visual.*``, whose MLP names look like a decoder's) is
    replicated: every rank of the rollout TP group runs it whole at prefill, on the same images."""
    if ".visual." in f".{name}":
        return None
    if _COLUMN.search(name) or _EXPERTS.search(name) or _SINKS.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def fused_parts(name: str, rows: int, config=None) -> Optional[list[int]]:
    """Row counts of the parts of a fused projection, each split over the rollout tp on its own
    (Phi-3 ``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up); None for other parameters."""
    if not _FUSED.search(name):
        return None
    if ".mlp." in name:
        return [rows // 2, rows // 2]
    if config is None:
        raise ValueError(f"rollout_slice: {name} is a fused q|k|v projection; pass the model config to split it")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    d = rows // (heads + 2 * kv_heads)  # head dim
    return [heads * d, kv_heads * d, kv_heads * d]


_KV = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")


def kv_replicas(tp_size: int, config=None) -> int:
    """Ranks sharing one KV head: ``tp / num_key_value_heads`` when a tensor-parallel rollout is wider
    than the KV heads (each rank then holds one, replicated, as vLLM does), else 1."""
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    return tp_size // kv if kv and tp_size > kv and tp_size % kv == 0 else 1


def _narrow_heads(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int, replicas: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of ``t`` along ``dim``: a ``1 / tp`` slice, or with ``replicas`` ranks per
    head the head ``tp_rank // replicas`` (of ``tp / replicas``)."""
    parts, index = (tp_size // replicas, tp_rank // replicas) if replicas > 1 else (tp_size, tp_rank)
    size = t.shape[dim] // parts
    return t.narrow(dim, index * size, size)


def rollout_slice(full: torch.Tensor, name: str, tp_rank: int, tp_size: int, config=None,
                  ep_rank: int = 0, ep_size: int = 1) -> torch.Tensor:
    """The rollout-TP rank's part of a full HF parameter (the full tensor when replicated);
    ``config`` (the HF config) is needed for a fused q|k|v projection and for a rollout wider than
    the KV heads (``k_proj`` / ``v_proj`` rows then give each rank its group's KV head whole).
    ``ep_rank`` / ``ep_size`` (rollout.ep): a MoE's experts are split over ``ep x tp``, ep-major."""
    if ep_size > 1 and _EXPERTS.search(name):
        tp_rank, tp_size = ep_rank * tp_size + tp_rank, ep_size * tp_size
    dim = rollout_shard_dim(name)
    if tp_size == 1 or dim is None:
        return full
    reps = kv_replicas(tp_size, config)
    parts = fused_parts(name, full.shape[0], config)
    if parts is not None:
        chunks = [_narrow_heads(p, 0, tp_rank, tp_size, reps if k > 0 and ".self_attn." in name else 1)
                  for k, p in enumerate(full.split(parts))]
        return torch.cat(chunks)
    return _narrow_heads(full, dim, tp_rank, tp_size, reps if _KV.search(name) else 1)


@dataclass
class RolloutLayout:
    """Where a rank sits in the rollout layout.

    Rollout TP groups are blocks of ``tp`` consecutive ranks (the training mesh is
    tp-minor, so they are the training TP groups when the sizes match). ``dp_group``
    joins the ranks with the same rollout-TP rank, one per rollout replica: generated
    rows are exchanged over it.
    """

    tp: int = 1
    tp_rank: int = 0
    tp_group: Optional[dist.ProcessGroup] = None
    dp: int = 1
    dp_rank: int = 0
    dp_group: Optional[dist.ProcessGroup] = None
    group: Optional[dist.ProcessGroup] = None  # all ranks of the layout; None = the world
    # rollout.ep: blocks of ep consecutive replicas share their experts; ep_group joins the ranks of one
    # block at the same tp rank (the training mesh's ep groups when parallel.ep is the same size)
    ep: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None

    @property
    def size(self) -> int:
        return self.tp * self.dp

    @classmethod
    def build(cls, tp: int, device_type: str, ranks: Optional[list[int]] = None,
              exchange_timeout_s: Optional[float] = None, ep: int = 1) -> "RolloutLayout":
        """Create the groups: over the world (a collective: every rank calls it with the same ``tp``),
        or over ``ranks`` (one role of trainer.mode one_step_off; only those ranks call it).

        ``exchange_timeout_s``: the timeout of ``dp_group`` (None: the default). Rollout replicas
        that finish early wait in its row exchange for the slowest one, a wait as long as the
        difference in generation time rather than a stuck collective (trainer.exchange_timeout_s).
        ``device_type`` is kept for the callers; groups take the default backend.
        """
        timeout = datetime.timedelta(seconds=exchange_timeout_s) if exchange_timeout_s else None
        if ranks is not None:
            return cls._with_ep(cls._over(tp, ranks, timeout), ep, ranks)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if tp < 1 or world % tp:
            raise ValueError(f"rollout.tp={tp} does not divide the world size {world}")
        if world == 1:
            return cls._with_ep(cls(), ep, [0])
        rank, dp = dist.get_rank(), world // tp
        # Every rank creates every group (a world collective), tp-minor like the training mesh.
        tp_group = dist.new_subgroups_by_enumeration([list(range(k * tp, k * tp + tp)) for k in range(dp)])[0] \
            if tp > 1 else None
        dp_group = dist.new_subgroups_by_enumeration([list(range(j, world, tp)) for j in range(tp)],
                                                     timeout=timeout)[0] if dp > 1 else None
        return cls._with_ep(cls(tp=tp, tp_rank=rank % tp, tp_group=tp_group, dp=dp, dp_rank=rank // tp,
                                dp_group=dp_group), ep, list(range(world)))

    @staticmethod
    def _with_ep(lay: "RolloutLayout", ep: int, ranks: list[int]) -> "RolloutLayout":
        """Add the ep groups: every rank of ``ranks`` calls it (each creates every group, in order)."""
        if ep < 1 or lay.dp % ep:
            raise ValueError(f"rollout.ep={ep} must divide the {lay.dp} rollout replicas (ranks / rollout.tp)")
        lay.ep, lay.ep_rank = ep, lay.dp_rank % ep
        if ep > 1:
            me = dist.get_rank()
            for block in range(lay.dp // ep):
                for j in range(lay.tp):
                    members = [ranks[(block * ep + i) * lay.tp + j] for i in range(ep)]
                    g = dist.new_group(members, use_local_synchronization=True)
                    if me in members:
                        lay.ep_group = g
        return lay

    @classmethod
    def _over(cls, tp: int, ranks: list[int], timeout: Optional[datetime.timedelta] = None) -> "RolloutLayout":
        """Blocks of ``tp`` consecutive entries of ``ranks``; groups synchronise among their members only."""
        if tp < 1 or len(ranks) % tp:
            raise ValueError(f"rollout.tp={tp} does not divide the {len(ranks)} ranks of the layout")
        me = ranks.index(dist.get_rank())
        dp = len(ranks) // tp

        def group(members: list[int], timeout=None) -> Optional[dist.ProcessGroup]:
            return dist.new_group(members, use_local_synchronization=True, timeout=timeout) \
                if len(members) > 1 else None

        return cls(tp=tp, tp_rank=me % tp, tp_group=group(ranks[me - me % tp: me - me % tp + tp]),
                   dp=dp, dp_rank=me // tp, dp_group=group(ranks[me % tp::tp], timeout), group=group(ranks))


@dataclass
class ReshardStats:
    seconds: float
    bytes_received: int  # bytes this rank received from others (all-gathers + pp broadcasts)
    numel: int  # elements of the rollout weights this rank holds


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _redistribute_local(t: DTensor, shards: dict[int, int]) -> tuple[torch.Tensor, int]:
    """``t`` gathered on every mesh dim except ``shards`` (mesh dim -> tensor dim kept ``Shard``); returns
    (this rank's local tensor, bytes received)."""
    target = [Shard(shards[i]) if i in shards else Replicate() for i in range(t.device_mesh.ndim)]
    local_bytes = _nbytes(t.to_local())
    out = t.redistribute(t.device_mesh, target).to_local()
    return out, _nbytes(out) - local_bytes


def gather_full_tensor(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """DTensor -> full local tensor via redistribute to Replicate; returns (tensor, bytes received)."""
    if not isinstance(t, DTensor):
        return t.detach(), 0
    return _redistribute_local(to_mesh_device(t), {})


def _tp_dim_matches(t: DTensor, dim: int, tp_group: Optional[dist.ProcessGroup], tp_size: int) -> Optional[int]:
    """Mesh dim of ``t`` that is the rollout TP group with placement Shard(dim), else None."""
    names = t.device_mesh.mesh_dim_names or ()
    if tp_group is None or "tp" not in names:
        return None
    i = names.index("tp")
    if t.device_mesh.size(i) != tp_size or t.placements[i] != Shard(dim):
        return None
    if dist.get_process_group_ranks(t.device_mesh.get_group(i)) != dist.get_process_group_ranks(tp_group):
        return None
    return i


def _ep_shard(t: DTensor, tp_rank: int, tp_size: int, tp_group: Optional[dist.ProcessGroup],
              ep_group: Optional[dist.ProcessGroup]) -> Optional[tuple[torch.Tensor, int]]:
    """Experts that training already shards over the rollout's ep group (parallel.ep == rollout.ep): gather
    only the other mesh dims (FSDP's efsdp, and tp unless it is the rollout tp), keep ep's ``Shard(0)``."""
    names = t.device_mesh.mesh_dim_names or ()
    if ep_group is None or "ep" not in names:
        return None
    i = names.index("ep")
    if t.placements[i] != Shard(0) or \
            dist.get_process_group_ranks(t.device_mesh.get_group(i)) != dist.get_process_group_ranks(ep_group):
        return None
    j = _tp_dim_matches(t, 0, tp_group, tp_size)
    out, received = _redistribute_local(t, {i: 0} if j is None else {i: 0, j: 0})
    if tp_size > 1 and j is None:
        out = _narrow_heads(out, 0, tp_rank, tp_size, 1).clone()
    return out, received


def _rollout_tensor(p: torch.Tensor, name: str, *, tp_rank: int, tp_size: int,
                    tp_group: Optional[dist.ProcessGroup], dtype: Optional[torch.dtype], do_slice: bool,
                    config=None, ep_rank: int = 0, ep_size: int = 1,
                    ep_group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, int]:
    """One parameter in the rollout layout (steps 1-3 of the module docstring)."""
    t = p if isinstance(p, DTensor) else p.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = to_mesh_device(t)  # after the cast: fewer bytes leave the host under param_offload
    split_experts = ep_size > 1 and _EXPERTS.search(name) is not None
    dim = rollout_shard_dim(name) if do_slice and (tp_size > 1 or split_experts) else None
    if split_experts and dim is not None and isinstance(t, DTensor):
        kept = _ep_shard(t, tp_rank, tp_size, tp_group, ep_group)
        if kept is not None:
            return kept
    if isinstance(t, DTensor) and dim is not None and not split_experts and not _FUSED.search(name) \
            and not (_KV.search(name) and kv_replicas(tp_size, config) > 1):  # a fused one is sliced per part
        keep = _tp_dim_matches(t, dim, tp_group, tp_size)
        if keep is not None:  # training TP shard == rollout TP shard: gather dp only
            return _redistribute_local(t, {keep: dim})
    full, received = gather_full_tensor(t)
    if dim is None:
        return full, received
    return rollout_slice(full, name, tp_rank, tp_size, config, ep_rank, ep_size).clone(), received


def _pp_exchange(local: dict[str, torch.Tensor], pp_group: dist.ProcessGroup, device: torch.device,
                 ) -> tuple[dict[str, torch.Tensor], int]:
    """Every pp rank gets every stage's tensors: one flat broadcast per stage and dtype."""
    meta = [(n, tuple(t.shape), t.dtype) for n, t in local.items()]
    all_meta: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(all_meta, meta, group=pp_group)
    me = dist.get_rank(pp_group)
    out: dict[str, torch.Tensor] = {}
    received = 0
    for src, entries in enumerate(all_meta):
        for dtype in sorted({e[2] for e in entries}, key=str):
            group_entries = [e for e in entries if e[2] == dtype]
            numel = sum(int(torch.Size(s).numel()) for _, s, _ in group_entries)
            if src == me:
                flat = torch.cat([local.pop(n).reshape(-1) for n, _, _ in group_entries])
            else:
                flat = torch.empty(numel, dtype=dtype, device=device)
                received += _nbytes(flat)
            dist.broadcast(flat, src=dist.get_global_rank(pp_group, src), group=pp_group)
            offset = 0
            for n, shape, _ in group_entries:
                size = int(torch.Size(shape).numel())
                out[n] = flat[offset:offset + size].view(shape)
                offset += size
    return out, received


def gather_rollout_weights(model: torch.nn.Module, *, dtype: Optional[torch.dtype] = None,
                           name_filter: Optional[Callable[[str], bool]] = None,
                           pp_group: Optional[dist.ProcessGroup] = None, tp_rank: int = 0, tp_size: int = 1,
                           tp_group: Optional[dist.ProcessGroup] = None, ep_rank: int = 0, ep_size: int = 1,
                           ep_group: Optional[dist.ProcessGroup] = None, quantization: Optional[str] = None,
                           quantization_scale: fp8.Scheme = "block",
                           ) -> tuple[dict[str, torch.Tensor], ReshardStats]:
    """This rank's rollout weights, keyed by HF name (see module docstring).

    Args:
        model: the training-layout module (FSDP root or pipeline stage(s)) with HF names.
        dtype: rollout dtype (None: keep the master dtype).
        name_filter: keep only names for which it returns True.
        pp_group: the pipeline group when the model is split into stages (None: no pp).
        tp_rank, tp_size, tp_group: this rank's place in its rollout TP group
            (:class:`RolloutLayout`); ``tp_size == 1`` gives full tensors.
        ep_rank, ep_size: this rank's place in its rollout ep group (rollout.ep): a MoE's experts
            ``[E, ...]`` are cut into ``ep x tp`` blocks of whole experts, block ``ep_rank x tp + tp_rank``.
            ``ep_group`` (the rollout's): where the training experts are already ``Shard(0)`` over the same
            ranks (``parallel.ep == rollout.ep``), only their FSDP shards are gathered, never all experts.
        quantization: "fp8" (rollout.quantization): linear weights as FP8 + scales (module docstring),
            with ``quantization_scale`` "block" (128 x 128 tiles) or "channel"; None keeps ``dtype``.

    Returns:
        ``(weights, stats)``; ``weights`` holds full tensors, or rollout-TP slices of the
        column / row parallel projections.
    """
    t0 = time.perf_counter()
    device = None
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    # Slice before the pp broadcast only if every pp peer wants the same slice.
    do_slice = True
    if pp > 1 and (tp_size > 1 or ep_size > 1):  # pp peers are whole replicas apart: other ep ranks
        do_slice = ep_size == 1 and len({r % tp_size for r in dist.get_process_group_ranks(pp_group)}) == 1
    weights: dict[str, torch.Tensor] = {}
    received = 0
    config = next((m.config for m in model.modules() if hasattr(getattr(m, "config", None), "model_type")), None)
    fp32_router = getattr(config, "model_type", None) == "deepseek_v3"
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = hf_name(name)
            if name_filter is not None and not name_filter(name):
                continue
            t, nbytes = _rollout_tensor(p, name, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                                        dtype=None if fp32_router and _ROUTER.search(name) else dtype,
                                        do_slice=do_slice, config=config, ep_rank=ep_rank, ep_size=ep_size,
                                        ep_group=ep_group)
            device = t.device
            weights[name] = t
            if quantization is not None and pp == 1 and quantized_name(name):
                weights[name], weights[fp8.scale_name(name)] = fp8.quantize(t, quantization_scale)
            received += nbytes
        for name, b in model.named_buffers():
            name = hf_name(name)
            if _ROUTER.search(name) and (name_filter is None or name_filter(name)):
                weights[name] = b.detach().clone()
        if pp > 1:
            weights, nbytes = _pp_exchange(weights, pp_group, device or torch.device("cpu"))
            received += nbytes
            if not do_slice:
                weights = {n: rollout_slice(t, n, tp_rank, tp_size, config, ep_rank, ep_size).clone()
                           if rollout_shard_dim(n) is not None
                           else t for n, t in weights.items()}
            quantize_rollout_weights(weights, quantization, quantization_scale)
    numel = sum(t.numel() for t in weights.values())
    return weights, ReshardStats(time.perf_counter() - t0, received, numel)
