"""The plan: bytes per rank and phase of a run (:func:`plan_memory`), its table, and the command line.
What is counted is listed in :mod:`rlhf.planner`."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

from rlhf.planner.shape import DTYPE_BYTES, GIB, RANKS_PER_NODE, ModelShape
from rlhf.schema.config import Config, ConfigError


def parse_bytes(text: str) -> int:
    """'80GiB' / '80GB' / '141 GiB' / '2048MiB' / plain bytes -> int bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"--device-memory: cannot read {text!r}; write e.g. 80GiB, 141GB or 24576MiB")
    unit = m.group(2).upper().rstrip("B")
    power = "KMGT".index(unit[0]) + 1 if unit else 0
    base = 1024 if unit.endswith("I") or not unit else 1000
    return int(float(m.group(1)) * base ** power)


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


@dataclass
class MemoryPlan:
    """Bytes per rank by component, and the totals of each phase of a step."""

    shape: ModelShape
    layout: dict  # world, dp, tp, pp, rollout_tp, device
    components: dict[str, float]  # name -> bytes per rank
    phases: dict[str, dict[str, float]]  # phase -> {component: bytes} alive together
    host: dict[str, float] = field(default_factory=dict)  # bytes kept in host memory (loading, param_offload)
    notes: list[str] = field(default_factory=list)
    host_per_node: float = 0.0  # host bytes of one node's ranks at load (all load at once)

    def total(self, phase: str) -> float:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> float:
        return self.total(self.peak_phase)

    def fits(self, device_memory: int, headroom: float = 0.10) -> bool:
        return self.peak <= device_memory * (1.0 - headroom)


def _stage_params(s: ModelShape, pp: int) -> int:
    """Parameters of the largest pipeline stage (first: embeddings; last: head, tied copy too)."""
    if pp == 1:
        return s.num_params()
    layers = s.num_layers // pp * s.layer_params()
    return max(s.embed_params() + layers, layers + s.hidden_size + s.embed_params())


def activation_elems_per_token_layer(s: ModelShape, tp: int, compute_bytes: int) -> float:
    """Elements autograd keeps per token per decoder block (HF block, sdpa attention).

    RMSNorm keeps its fp32 input and the normalised output (x2); attention keeps q, k, v,
    the output and o_proj's input; the SwiGLU MLP keeps gate, up, silu(gate) and the product.
    Head / MLP tensors are split over tp; the residual stream is not.
    """
    fp32_ratio = 4 / compute_bytes
    norms = s.norms_per_layer * (s.hidden_size * fp32_ratio + s.hidden_size)
    attn = (3 * s.q_dim + 2 * s.kv_dim) / tp
    mlp = 4 * s.mlp_width / tp + s.num_experts  # (MoE: router logits)
    return norms + attn + mlp + s.hidden_size  # + the block input (the residual)


def decode_gather_bytes(s: ModelShape, *, slots: int, seq_len: int, rollout_tp: int, rb: int, paged: bool) -> float:
    """Per-layer buffers of the reference (gather) decode kernel, what a CUDA run uses without
    flash-attn (wheel missing, or an fp32 rollout): in paged mode the window's K/V copied out of
    the blocks ``[2 Hkv, slots, window, D]``; always the scores, their fp32 softmax and its cast
    ``[slots, H, window]``. Freed layer by layer, but kept in the graph pool under CUDA graphs."""
    heads, kv = s.num_heads / rollout_tp, s.kv_dim / rollout_tp
    window = slots * seq_len * (2 * kv * rb if paged else 0)
    return window + slots * heads * seq_len * (2 * rb + 4)


def flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def in_place_decode_kernel() -> bool:
    """Whether a bf16 CUDA rollout decodes in place (no gather buffers): flash-attn installed, or torch's paged
    ``varlen_attn`` (torch >= 2.10) on an sm80+ GPU (assumed when none is visible: planning on a login node)."""
    import torch

    from rlhf.models import attention_backend

    if flash_attn_installed():
        return True
    cap = attention_backend.probe("cuda", torch.bfloat16, flash_attn=False)
    return cap.torch_varlen and (cap.sm is None or tuple(cap.sm) >= (8, 0))


def plan_memory(shape: ModelShape, cfg: Config, *, world_size: int, device: str = "cuda",
                flash_attn: bool = True, host_memory: Optional[int] = None,
                teacher_shapes: Optional[dict] = None) -> MemoryPlan:
    """The memory plan of `cfg` for `shape` on `world_size` ranks of `device` ("cuda" or "cpu").

    ``flash_attn``: whether the CUDA decode kernel in fp16 / bf16 reads the cache in place (flash-attn, or
    torch's paged ``varlen_attn``: :func:`in_place_decode_kernel`); else the gather kernel and its buffers are
    counted. ``host_memory``: the machine's memory, to warn when
    the per-node host total at load exceeds it. ``teacher_shapes``: ``{name: ModelShape}`` of the
    ``distill.teachers`` (frozen, sharded like the reference: their parameters are held throughout)."""
    from rlhf.models.fsdp import resolve_fsdp_unit
    from rlhf.models.parallel import ParallelDims
    from rlhf.models.parallelize import validate_layout
    from rlhf.rollout.engine import rollout_dtype
    from rlhf.train.async_rl.transfer import SEND_BUCKET_BYTES

    s, m, d, r, a = shape, cfg.model, cfg.data, cfg.rollout, cfg.actor
    # trainer.mode one_step_off: half the world trains, the other half generates; fully_async: the
    # split of parallel.rollout_ranks. Either way training ranks send weights, rollout ranks only sample.
    one_step_off = cfg.trainer.mode in ("one_step_off", "fully_async")
    role_world = world_size
    if cfg.trainer.mode == "one_step_off":
        from rlhf.train.async_rl.roles import check_one_step_off

        role_world = check_one_step_off(cfg, world_size)  # the split's own errors, before sizing half a world
    elif cfg.trainer.mode == "fully_async":
        from rlhf.train.async_rl.split import check_fully_async

        role_world = check_fully_async(cfg, world_size)[0]
    dims = ParallelDims.resolve(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, role_world, sp=cfg.parallel.sp,
                                ep=cfg.parallel.ep)
    validate_layout(cfg.parallel, _HFLike(s), role_world, rollout_tp=r.tp, train_batch_size=d.train_batch_size,
                    mini_batch_size=a.ppo_mini_batch_size, n=r.n)
    dp, tp, pp = dims.dp, dims.tp, dims.pp
    cuda = device == "cuda"
    mb = DTYPE_BYTES[m.dtype]  # master (parameter / grad / optimizer) bytes
    cb = 2 if cuda and m.mixed_precision else mb  # compute bytes
    rb = DTYPE_BYTES[str(rollout_dtype(r.dtype, device, m.dtype)).removeprefix("torch.")]  # rollout bytes
    notes: list[str] = []

    stage = _stage_params(s, pp)
    fsdp = dp * dims.sp  # FSDP2 shards over the flattened dp x sp mesh (rlhf/models/ulysses.py)
    params_rank = stage / tp / fsdp
    lora = m.lora_rank > 0
    adapters = s.num_layers // pp * s.lora_params_per_layer(m.lora_rank, m.target_modules) if lora else 0
    trainable_rank = (adapters if lora else stage) / tp / fsdp
    comp: dict[str, float] = {}
    comp["parameters"] = (params_rank + adapters / tp / fsdp) * mb
    comp["gradients"] = trainable_rank * mb
    # No-sync accumulation keeps the stage's unsharded gradients (fp32 reduce dtype under mixed
    # precision) from the first micro-batch to the last: opt-in, or always inside a pipeline schedule.
    no_sync = m.unsharded_grad_accumulation or pp > 1
    grad_bytes = 4 if cuda and m.mixed_precision else mb
    comp["unsharded grads (no-sync accumulation)"] = (trainable_rank * fsdp) * grad_bytes if no_sync else 0.0
    comp["optimizer (AdamW m+v)"] = 2 * trainable_rank * mb
    need_ref = (a.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not lora
    comp["reference"] = params_rank * mb if need_ref else 0.0
    teachers = cfg.distill.teachers if cfg.distill.enabled and teacher_shapes else {}
    teacher_rank = {n: _stage_params(teacher_shapes[n], pp) / tp / fsdp * DTYPE_BYTES[t.dtype or m.dtype]
                    for n, t in teachers.items()}
    comp["distill teachers"] = sum(b for n, b in teacher_rank.items() if not teachers[n].param_offload)
    critic = cfg.algorithm.adv_estimator == "gae"
    critic_params = (stage - (0 if s.tie_word_embeddings or pp > 1 else s.embed_params())) / tp / fsdp if critic else 0
    comp["critic (params+grads+adam)"] = 4 * critic_params * mb
    # FSDP2 all-gathers the root (embeddings / head: kept for the whole forward+backward) and two blocks.
    root = (s.embed_params() + s.head_params()) / tp if pp == 1 else (s.embed_params() + s.hidden_size) / tp
    # Expert parallelism: a block's experts are Shard(0) over ep before FSDP2, so a block unshards only
    # its ep rank's experts (the per-rank shard, experts / (dp x tp), is the same with or without ep).
    ep = dims.ep
    block_experts = s.routed_expert_params() if s.sparse_layers else 0
    block = (s.layer_params() - block_experts * (1 - 1 / ep)) / tp
    unsharded_frozen = (root + 2 * block) * cb
    unsharded_update = unsharded_frozen + (0 if lora else (root + block) * cb)
    if resolve_fsdp_unit(m.fsdp_unit, (stage + adapters) * mb) == "model":
        # One FSDP2 unit: the whole stage is gathered, and in the update its gradients join it.
        unsharded_frozen = (stage / tp) * cb
        unsharded_update = unsharded_frozen + (0 if lora else unsharded_frozen)
        notes.append("model.fsdp_unit: the whole model is one FSDP2 unit (all of it unsharded in a pass)")
    comp["fsdp unsharded"] = unsharded_frozen
    host: dict[str, float] = {}
    on_host = cuda or m.param_offload
    if lora:  # peft wraps the loaded model: loaded whole, in the master dtype
        load_rank = stage * mb
    else:  # one weight's slice at a time, read in the checkpoint dtype and upcast (rlhf/models/shard_init.py)
        load_rank = s.largest_param() / (tp * dp) * (s.checkpoint_bytes + mb)
    comp["load (host slice being placed)"] = 0.0 if on_host else load_rank
    if on_host:
        host["load (slice being placed)"] = load_rank
    if any(t.param_offload for t in teachers.values()):
        host["distill teachers (offloaded)"] = sum(b for n, b in teacher_rank.items() if teachers[n].param_offload)
    if m.param_offload:
        for k in ("parameters", "gradients", "optimizer (AdamW m+v)", "reference"):
            host[k] = comp[k]
            comp[k] = 0.0
        notes.append("model.param_offload: parameters, gradients and optimizer state live in host memory")

    # Rollout: full weights over rollout.tp; KV-cache slots for this replica's sequences.
    # the reshard splits the attention / MLP projections over rollout.tp; embedding and head stay whole
    ends = s.embed_params() + s.head_params()
    # rollout.ep: a replica holds 1 / ep of the routed experts (rlhf.rollout.expert_dispatch)
    routed = s.sparse_layers * s.routed_expert_params() * (1 - 1 / r.ep)
    rollout_copy = ((s.num_params() - ends - routed) / r.tp + ends) * rb
    comp["rollout weights"] = rollout_copy
    seq_len = d.max_prompt_length + d.max_response_length
    replicas = role_world // r.tp
    gen_bs = d.gen_batch_size if cfg.algorithm.filter_groups.enable and d.gen_batch_size > 0 else d.train_batch_size
    seqs = math.ceil(gen_bs / replicas) * r.n
    slots = min(r.max_num_seqs, seqs)
    kv_per_token = s.num_layers * 2 * s.kv_dim / min(r.tp, s.num_kv_heads) * rb  # KV heads replicated past tp
    kv_tokens = r.kv_cache_tokens or (int(r.kv_cache_memory * 2**30 // kv_per_token) if r.kv_cache_memory else 0)
    if kv_tokens:  # paged: the cache is the budget; sequences beyond it are preempted, not allocated
        slots = min(slots, max(1, kv_tokens // seq_len))
    comp["kv cache"] = kv_per_token * (min(kv_tokens, r.max_num_seqs * seq_len) if kv_tokens else slots * seq_len)
    if cuda and not kv_tokens:
        notes.append(f"rollout.kv_cache_tokens is 0: the sampler caps the KV cache at rollout.gpu_memory_utilization="
                     f"{r.gpu_memory_utilization} of the memory free after the weights (fewer slots than planned "
                     "here when it does not fit); set kv_cache_tokens to plan a fixed budget")
    # The sampler fuses q|k|v and gate|up: one layer's fused copy exists next to its unfused
    # tensors (freed as they are fused), all layers' when pp hands them out as views of one
    # flat buffer per stage, which no single fusion can free.
    fused_layer = (s.q_dim + 2 * s.kv_dim + 2 * s.intermediate_size) * s.hidden_size / r.tp * rb
    if r.quantization == "fp8" and cuda:  # the dense projections stay e4m3 + float32 scales (rlhf.models.fp8)
        per = 1 + 4 / (128 * 128 if r.quantization_scale == "block" else s.hidden_size)
        comp["rollout weights"] = rollout_copy = rollout_copy - s.fp8_kernel_params() / r.tp * (rb - per)
        fused_layer *= per / rb
        notes.append("rollout.quantization fp8: the dense projections are held in e4m3 for the FP8 decode "
                     "(sm89+); experts, MLA projections, embeddings, norms and the LM head in rollout.dtype")
    elif r.quantization == "fp8":
        notes.append("rollout.quantization fp8 on cpu: the sampler holds the quantized weights dequantized")
    comp["rollout fusing (q|k|v, gate|up)"] = fused_layer * (s.num_layers if pp > 1 and not one_step_off else 1)
    # rollout.compile on CUDA: the sampler (its weights and KV cache) lives for the whole run.
    kept = cuda and r.compile
    # one_step_off: each training rank gathers its partner's rollout weights and sends them
    # through one reusable buffer.
    comp["send buffer"] = float(SEND_BUCKET_BYTES) if one_step_off else 0.0
    prefill_tokens = min(r.prefill_tokens, seqs // r.n * d.max_prompt_length)
    # Decode without flash-attn (not installed, or an fp32 rollout): the gather kernel's per-layer
    # buffers (all max_num_seqs slots under CUDA graphs); it reads slot regions in place only when
    # the KV budget holds every slot at full length and no turn parks.
    gather = cuda and (rb == 4 or not flash_attn)
    regions = not cfg.rollout.multi_turn.enable and kv_tokens >= r.max_num_seqs * seq_len
    comp["decode gather buffers (no flash-attn)"] = decode_gather_bytes(
        s, slots=r.max_num_seqs if kept else slots, seq_len=seq_len, rollout_tp=r.tp, rb=rb,
        paged=not regions) if gather else 0.0
    if gather:
        why = "rollout.dtype float32" if rb == 4 else "flash-attn is not installed and torch has no paged varlen_attn"
        notes.append(f"decode attention without flash-attn ({why}): every slot's window is gathered per layer "
                     f"({fmt_bytes(comp['decode gather buffers (no flash-attn)']).strip()} per layer step"
                     + (", kept in the CUDA-graph pool" if kept else "") + ")"
                     + ("" if regions else f"; rollout.kv_cache_tokens >= max_num_seqs x seq_len "
                        f"= {r.max_num_seqs * seq_len} reads slot regions in place instead"))
    comp["rollout activations"] = (prefill_tokens * (s.hidden_size * 3 + (s.q_dim + 2 * s.kv_dim
                                   + 2 * s.mlp_width) / r.tp) * rb
                                   + 4 * (slots + seqs // r.n) * s.vocab_size * 4)  # fp32 logits, softmax, cdf
    # MoE: the sampler's route record (an int16 expert id per token, sparse layer and choice; rlhf.rollout.routes)
    # for every sequence of the call, whenever routes are recorded (router_replay other than R2); host memory on a GPU
    book = seqs * seq_len * s.sparse_layers * s.experts_per_tok * 2 if a.router_replay != "R2" else 0
    comp["rollout route record"] = 0.0 if cuda else float(book)
    if cuda and book:
        host["rollout route record"] = float(book)

    # Training micro-batch: padded rows of prompt + response tokens.
    R = d.max_response_length
    if a.use_dynamic_bsz:
        train_tokens, lp_tokens = a.ppo_max_token_len_per_gpu, a.log_prob_max_token_len_per_gpu
    else:
        train_tokens, lp_tokens = a.ppo_micro_batch_size_per_gpu * seq_len, a.log_prob_micro_batch_size_per_gpu * seq_len
    depth = 1  # micro-batches whose activations a rank holds at once
    buffers_lp = buffers_update = 0.0  # the pp schedule's receive buffers (none without pp)
    positions = R + 1  # logits positions per row: the response's, or every one on the last pp stage
    if pp > 1:  # one pipelined call per mini-batch, pp_microbatches micro-batches; 1F1B's first stage
        # holds min(k, pp) in flight (GPipe: all k), and the schedule keeps the stage unsharded from the
        # first backward to the last (rlhf/ops/sim_pipeline.py)
        k = cfg.parallel.pp_microbatches
        train_tokens = a.ppo_mini_batch_size * r.n / dp / k * seq_len
        lp_tokens = a.log_prob_micro_batch_size_per_gpu * seq_len
        depth = k if cfg.parallel.pp_schedule == "GPipe" else min(k, pp)
        unsharded_update = stage / tp * cb
        # torch's schedule allocates one [rows, L, hidden] receive buffer per micro-batch and keeps them
        # all: activations on every stage but the first, and in the update their gradients on every stage
        # but the last (a middle stage has both); the last stage scores every position of its rows
        buffers_lp = k * lp_tokens * s.hidden_size * cb
        buffers_update = (2 if pp > 2 else 1) * train_tokens * k * s.hidden_size * cb
        positions = seq_len - 1
    layers_rank = s.num_layers // pp
    per_tok = activation_elems_per_token_layer(s, tp, cb)
    full_acts = train_tokens * per_tok * layers_rank * cb * depth
    # With checkpointing: the block inputs, plus one block recomputed during its backward.
    ckpt_acts = train_tokens * (s.hidden_size * layers_rank * depth + per_tok) * cb
    # ep > 1: one sparse layer's dispatched and returned token rows (send + receive, each [tokens x k, hidden]).
    comp["all-to-all buffers (ep)"] = 4 * train_tokens * s.experts_per_tok * s.hidden_size * cb if ep > 1 else 0.0
    comp["activations (no checkpointing)"] = full_acts
    comp["activations (checkpointing)"] = ckpt_acts
    # A block's backward holds gradients of its activations next to the saved ones.
    act_work = train_tokens * per_tok * cb
    rows_train = train_tokens / seq_len
    rows_lp = lp_tokens / seq_len
    V = s.vocab_size / tp
    # fp32 [tokens, V/tp] tensors alive at once next to the compute-dtype logits, as the simulation's
    # live-storage count of rlhf.models.vocab_parallel.log_probs_from_logits measures them (docs/memory.md):
    # forward-only with entropy: z = logits/T, exp(z - lse), softmax x z (the fp32 cast and logsumexp's
    # exp are freed before), one more under tp (the vocab-parallel softmax); update: the backward of
    # logsumexp and the gather next to the saved z, one less under tp without entropy (its custom backward)
    n_lp = 3 + (tp > 1)
    n_train = 4.5 - (tp > 1 and a.entropy_coeff == 0)
    comp["logits (update)"] = rows_train * positions * V * 4 * ((cb / 4) + n_train)
    comp["logits (log-prob pass)"] = rows_lp * positions * V * 4 * ((cb / 4) + n_lp)
    comp["pipeline receive buffers"] = buffers_update
    comp["forward activations (log-prob pass)"] = lp_tokens * per_tok * cb

    acts = ckpt_acts if m.enable_gradient_checkpointing else full_acts
    training_state = {k: comp[k] for k in ("parameters", "optimizer (AdamW m+v)", "reference",
                                           "critic (params+grads+adam)", "distill teachers")}
    # What generation holds next to the training state.
    rollout_state = {"rollout weights": 0.0 if lora else rollout_copy,
                     "lora merged weights": _lora_merged(s, m, r.tp, rb) if lora else 0.0,
                     "rollout fusing (q|k|v, gate|up)": comp["rollout fusing (q|k|v, gate|up)"],
                     "kv cache": comp["kv cache"], "rollout activations": comp["rollout activations"],
                     "decode gather buffers (no flash-attn)": comp["decode gather buffers (no flash-attn)"],
                     "rollout route record": comp["rollout route record"]}
    carried = {}  # rollout state that stays allocated through the training phases (colocated)
    if lora:  # the base is resharded once and cached
        rollout_state["lora base rollout cache"] = carried["lora base rollout cache"] = rollout_copy
    if kept:  # the kept sampler's weights and KV cache, and the new weights while they are copied in
        rollout_state["sampler kept for CUDA graphs (weights)"] = rollout_copy
        carried["sampler kept for CUDA graphs (weights + kv cache)"] = rollout_copy + comp["kv cache"]
        if comp["decode gather buffers (no flash-attn)"]:
            carried["cuda-graph pool (decode gather buffers)"] = comp["decode gather buffers (no flash-attn)"]
    persistent = {**training_state, **({} if one_step_off else carried)}
    lp_fwd, lp_logits = comp["forward activations (log-prob pass)"], comp["logits (log-prob pass)"]
    # The log-probs are taken from the logits after the model's forward returns, and their backward
    # runs before the gradient reaches the model: every FSDP2 unit (the root too) is resharded then,
    # and no all-to-all is in flight. So a pass holds the larger of two moments (the simulation's
    # peaks, docs/memory.md): a block's work with its units unsharded, or the logits. With
    # checkpointing the block inputs are kept and one block is recomputed; without it every
    # activation is saved.
    up_logits = comp["logits (update)"]
    saved, work = acts, act_work
    if m.enable_gradient_checkpointing:
        saved, work = acts - train_tokens * per_tok * cb, act_work + train_tokens * per_tok * cb
    in_block = work + unsharded_update + comp["all-to-all buffers (ep)"] > up_logits
    lp_in_block = lp_fwd + unsharded_frozen > lp_logits
    phases = {
        "load": {"load (host slice being placed)": comp["load (host slice being placed)"],
                 "parameters": comp["parameters"]},
        "rollout": {**training_state, **rollout_state},
        # forward-only: the last layer's activations are freed before the head runs, so the larger of
        # the two is what the pass adds (the simulation's live-storage peak, docs/memory.md)
        "log-probs": {**persistent, "pipeline receive buffers": buffers_lp,
                      "fsdp unsharded": unsharded_frozen if lp_in_block else 0.0,
                      "forward activations (log-prob pass)": lp_fwd if lp_in_block else 0.0,
                      "logits (log-prob pass)": 0.0 if lp_in_block else lp_logits},
        # under no-sync accumulation the sharded gradients only appear as the last backward reduce-scatters
        # (and frees) the unsharded ones: never both whole at once
        "update": {**persistent, "gradients": 0.0 if no_sync else comp["gradients"],
                   "pipeline receive buffers": buffers_update,
                   "unsharded grads (no-sync accumulation)": comp["unsharded grads (no-sync accumulation)"],
                   "fsdp unsharded (+grads)": unsharded_update if in_block else 0.0,
                   "activations": saved + (work if in_block else 0.0), "logits (update)": 0.0 if in_block else up_logits,
                   "all-to-all buffers (ep)": comp["all-to-all buffers (ep)"] if in_block else 0.0},
    }
    if one_step_off:  # rollout ranks hold only the rollout state; training ranks send weights instead
        del phases["rollout"]
        phases["rollout (rollout ranks)"] = rollout_state
        phases["weight send"] = {**persistent, "rollout weights (for the partner)": rollout_copy,
                                 "send buffer": comp["send buffer"]}
    if m.param_offload:
        del phases["load"]
    # A node's ranks read and place their shards model.load_ranks_per_node at a time (0: all), next to
    # what offload keeps on the host for every rank.
    local = min(world_size, RANKS_PER_NODE)
    at_once = min(local, m.load_ranks_per_node or local)
    load_host = host.get("load (slice being placed)", 0.0)
    host_node = local * (sum(host.values()) - load_host) + at_once * load_host
    if host_memory and host_node > 0.9 * host_memory:
        notes.append(f"host memory at load: {fmt_bytes(host_node).strip()} per node ({local} ranks, {at_once} "
                     f"loading at once) exceeds 90% of this machine's {fmt_bytes(host_memory).strip()}: the kernel "
                     "kills a rank without a traceback; lower model.load_ranks_per_node, use more nodes, or fewer "
                     "ranks per node")
    layout = {"world": world_size, "dp": dp, "tp": tp, "pp": pp, "ep": ep, "rollout_tp": r.tp, "device": device,
              "slots": slots, "seq_len": seq_len, "mode": cfg.trainer.mode, "ranks_per_node": local}
    return MemoryPlan(shape=s, layout=layout, components=comp, phases=phases, host=host, notes=notes,
                      host_per_node=host_node)


def _lora_merged(s: ModelShape, m, rollout_tp: int, rb: int) -> float:
    """Merged W + (alpha/r) B A tensors of the adapted linears (new tensors each step)."""
    linears = s.linears(dense_mlp=not s.sparse_layers)
    names = list(linears) if m.target_modules == "all-linear" else [str(t) for t in m.target_modules]
    per_layer = sum(i * o for n, (i, o) in linears.items() if n in names)
    return s.num_layers * per_layer / rollout_tp * rb


class _HFLike:
    """The attributes validate_layout reads from an HF config."""

    def __init__(self, s: ModelShape):
        self.num_attention_heads, self.num_key_value_heads = s.num_heads, s.num_kv_heads
        self.intermediate_size, self.vocab_size, self.num_hidden_layers = s.intermediate_size, s.vocab_size, s.num_layers
        self.model_type = "qwen3_moe" if s.num_experts else s.architecture
        self.num_experts = s.num_experts


def format_plan(plan: MemoryPlan, device_memory: Optional[int] = None, headroom: float = 0.10) -> str:
    s, lay = plan.shape, plan.layout
    active = f", {s.num_active_params() / 1e9:.3f}B active per token ({s.experts_per_tok} of {s.num_experts} " \
        f"experts; experts split over {'ep x tp' if lay.get('ep', 1) > 1 else 'tp'})" if s.num_experts else ""
    lines = [f"[plan] {s.architecture}: {s.num_params() / 1e9:.3f}B parameters{active} ({s.num_layers} layers, hidden "
             f"{s.hidden_size}, vocab {s.vocab_size}, heads {s.num_heads}/{s.num_kv_heads} kv)",
             f"[plan] layout: world {lay['world']} = dp {lay['dp']} x tp {lay['tp']} x pp {lay['pp']}"
             f"{f' (ep {ep} from dp)' if (ep := lay.get('ep', 1)) > 1 else ''}, "
             f"rollout.tp {lay['rollout_tp']}, device {lay['device']}; kv-cache slots {lay['slots']} x "
             f"{lay['seq_len']} tokens", "[plan] per rank, by component:"]
    for k, v in plan.components.items():
        lines.append(f"[plan]   {k:40s}{fmt_bytes(v)}")
    for k, v in plan.host.items():
        lines.append(f"[plan]   host: {k:34s}{fmt_bytes(v)}")
    if plan.host_per_node:
        lines.append(f"[plan]   host per node at load ({lay['ranks_per_node']} ranks){'':6s}{fmt_bytes(plan.host_per_node)}")
    lines.append("[plan] per rank, by phase (what is alive together):")
    for ph in plan.phases:
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan.phases[ph].items() if v)
        mark = "  <- peak" if ph == plan.peak_phase else ""
        lines.append(f"[plan]   {ph:10s}{fmt_bytes(plan.total(ph))}{mark}   ({parts})")
    lines += [f"[plan] note: {n}" for n in plan.notes]
    if device_memory is not None:
        verdict = "fits" if plan.fits(device_memory, headroom) else "does NOT fit"
        lines.append(f"[plan] {verdict}: peak {plan.peak / GIB:.2f} GiB ({plan.peak_phase}) vs device memory "
                     f"{device_memory / GIB:.2f} GiB less {headroom:.0%} headroom = "
                     f"{device_memory * (1 - headroom) / GIB:.2f} GiB")
    return "\n".join(lines)


def machine_memory() -> Optional[int]:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def plan_from_config(cfg: Config, *, world_size: int, device: str) -> MemoryPlan:
    """The plan on this machine: the decode kernel as installed here, host memory as this machine's."""
    teachers = {n: ModelShape.from_model_dir(t.path, key=f"distill.teachers.{n}.path")
                for n, t in cfg.distill.teachers.items()} if cfg.distill.enabled else None
    return plan_memory(ModelShape.from_model_dir(cfg.model.path), cfg, world_size=world_size, device=device,
                       flash_attn=in_place_decode_kernel(), host_memory=machine_memory(), teacher_shapes=teachers)


def main(argv=None) -> None:
    from rlhf.config.load import load_config

    ap = argparse.ArgumentParser(description="Plan per-rank memory of a run from config.json (no weights).")
    ap.add_argument("--config", help="yaml config file")
    ap.add_argument("--world-size", type=int, default=1, help="ranks to plan for (default 1)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--device-memory", help="e.g. 80GiB: say whether the peak fits")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        plan = plan_from_config(cfg, world_size=args.world_size, device=args.device)
        mem = parse_bytes(args.device_memory) if args.device_memory else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps({"peak_phase": plan.peak_phase, "peak_bytes": plan.peak, "layout": plan.layout,
                          "components": plan.components, "phases": {p: plan.total(p) for p in plan.phases},
                          "fits": plan.fits(mem) if mem else None}))
    else:
        print(format_plan(plan, mem))
    if mem is not None and not plan.fits(mem):
        sys.exit(3)
