"""Memory planner: bytes per rank of a run, from the model's config.json and the run config alone.

No weights are read and no process group is needed, so a user can plan Qwen2.5-7B on 8
GPUs before owning them (``configs/models/<name>/config.json`` hold the published shapes):

    python -m rlhf.planner --config configs/x.yaml --world-size 8 --device cuda --device-memory 80GiB
    python train_grpo.py --config configs/x.yaml --dry-run --device-memory 80GiB   # same table first

What is counted, per rank (the rank that holds the largest pipeline stage):

* parameters: this rank's FSDP2 shard of its stage (``/tp /dp``) in ``model.dtype``. These
  are the master weights: under mixed precision FSDP2 computes in bf16 on transient
  all-gathered copies (``fsdp unsharded``), so no separate fp32 master copy exists;
* gradients and AdamW state (``exp_avg`` + ``exp_avg_sq``) in the parameter dtype, for the
  trainable parameters only (LoRA: adapters; the frozen base has neither);
* ``unsharded gradients``: with ``model.unsharded_grad_accumulation`` (and always with
  pp > 1, where the pipeline schedule accumulates without sync) each rank holds the
  unsharded gradients of its stage between micro-batches (fp32 under mixed precision);
* ``fsdp unsharded``: the all-gathered root (embeddings, LM head) and two decoder blocks
  (current + prefetched), in the compute dtype; in the update also their gradients (the
  whole stage under ``model.fsdp_unit: model``, auto for models up to 64 MiB);
* ``load``: the model is built on the meta device, TP / FSDP2 shard it there, and each
  rank reads only its slice of each weight from the safetensors files, in the checkpoint's
  dtype, upcasting it as it is placed (rlhf/models/shard_init.py): the host holds the
  largest weight's slice (checkpoint + master bytes) at a time; with LoRA the whole stage in
  the master dtype. On CUDA it is listed as host memory; on a CPU plan the host is the device;
* reference (``actor.use_kl_loss`` without LoRA) and critic (``adv_estimator: gae``) copies;
* rollout copy: the full model over ``rollout.tp`` in ``rollout.dtype`` (auto: bf16 on
  CUDA, else ``model.dtype``); with LoRA the base copy is cached between steps (counted in
  every phase); while the sampler fuses q|k|v and gate|up, one layer's fused tensors next
  to the unfused ones (all layers' with pp, whose exchange hands out views of one buffer);
  with ``rollout.compile`` on CUDA the sampler's weights and KV cache for the whole run;
* trainer.mode one_step_off / fully_async: the training layout on half the world (fully_async: on
  the ranks parallel.rollout_ranks leaves); the rollout ranks' own phase; on training ranks the
  partner's gathered rollout weights and the send buffer;
* KV cache ``[layers, slots, 2, kv_heads / rollout.tp, prompt + response, head_dim]``;
  slots = min(rollout.max_num_seqs, budget, sequences this rollout replica generates);
* decode without flash-attn on CUDA (not installed, or an fp32 rollout): the gather kernel's
  per-layer window copy and scores (in the CUDA-graph pool for the whole run under compile);
* host memory per node at load: ``model.load_ranks_per_node`` ranks' load slices at once plus
  what offload keeps on the host for every rank (warned against the machine's memory by
  ``plan_from_config``);
* activations of one training micro-batch, with and without activation checkpointing
  (which one enters the update total follows ``model.enable_gradient_checkpointing``);
* logits: ``[rows, response, vocab / tp]`` in fp32 for log-probs, with the temporaries of
  log-softmax / entropy (forward-only pass) and the gradient (update).

The per-token activation counts are analytic (which tensors autograd saves in an HF
Llama/Qwen2 block); `bench/memory_plan.py` checks the totals against measured peak RSS
on CPU (docs/memory.md). Peaks within a phase are sums of what is alive together, so the
estimate is an upper bound of what a perfect allocator needs; fragmentation, the CUDA
context and communication buffers are what ``headroom`` (default 10%) is for.
"""

from rlhf.planner.plan import (MemoryPlan, activation_elems_per_token_layer, decode_gather_bytes,
                               flash_attn_installed, fmt_bytes, format_plan, machine_memory, main, parse_bytes,
                               plan_from_config, plan_memory)
from rlhf.planner.shape import DTYPE_BYTES, GIB, RANKS_PER_NODE, SUPPORTED_ARCHITECTURES, ModelShape

__all__ = ["DTYPE_BYTES", "GIB", "RANKS_PER_NODE", "SUPPORTED_ARCHITECTURES", "MemoryPlan", "ModelShape",
           "activation_elems_per_token_layer", "decode_gather_bytes", "flash_attn_installed", "fmt_bytes",
           "format_plan", "machine_memory", "main", "parse_bytes", "plan_from_config", "plan_memory"]
