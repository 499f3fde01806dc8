"""Batched KV-cache sampler: prefill once per prompt, continuous-batching decode.

``Sampler`` holds the rollout weights, the paged KV cache (``rlhf.rollout.kv_cache``) and the
decode forward; one ``generate`` call is scheduled by ``rlhf.rollout.scheduler`` (admission
by free blocks, chunked prefill of long prompts, preemption and recompute when the cache
budget runs out, retirement of finished sequences).

With ``use_cuda_graph`` (CUDA only) the decode forward runs on all slots with a fixed
attention window so that its shapes are static, and is captured once as a CUDA graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.models import arch, attention_backend, batch_invariant as invariant, decoder, moe
from rlhf.models.generic import GENERIC, RolloutPath, rollout_path
from rlhf.rollout import cascade_attention as cascade, generic, paged_attention
from rlhf.rollout.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache, kv_bytes_per_token, kv_tokens_for_memory
from rlhf.rollout.sampling import SamplingParams
from rlhf.rollout.scheduler import GenerateRun
from rlhf.rollout.turns import TurnHandler
from rlhf.rollout import vision


@dataclass
class RolloutOutput:
    """Responses of one ``generate`` call; ``N = len(prompts) * n``, ``R = max_new_tokens``.

    Row ``i * n + j`` is sample ``j`` of prompt ``i``. ``log_probs`` are
    ``log_softmax(logits / T)`` of the sampled tokens (T = 1 for greedy), before any
    top-k / top-p / min-p truncation; see ``rlhf.rollout.sampling``. Multi-turn
    (``generate(turns=...)``): a row is a whole trajectory, observation tokens included.
    """

    response_ids: Tensor  # [N, R] long, pad_token_id after the response
    response_mask: Tensor  # [N, R] bool, True on generated tokens (incl. the stop token), False on observations
    log_probs: Tensor  # [N, R] float32, 0 on padding and observation tokens
    response_lengths: Tensor  # [N] long, generated + observation tokens
    truncated: Tensor  # [N] bool: hit max_new_tokens without a stop
    prompt_index: Tensor  # [N] long: index into `prompts`
    stats: dict[str, float] = field(default_factory=dict)
    # [N, W + R, S, k] int16 MoE expert ids of every token the sampler fed (``record_routes``), prompts
    # right-aligned to W columns, -1 where no forward routed the token (rlhf.rollout.routes)
    routes: Tensor | None = None
    # [N] bool: rows of prompt groups aborted by over-sampling (``generate(keep_groups=...)``); None without
    aborted: Tensor | None = None


def graph_blocker(spec: decoder.DecoderSpec, dtype: torch.dtype, device_type: str,
                  capability: tuple[int, int] | None) -> str | None:
    """Why the decode step of this model cannot be captured in a CUDA graph here (None: it can).

    MoE experts run torch's ``grouped_mm``, sync-free only for bf16 on sm90 / sm100
    (``rlhf.models.moe.grouped_mm_mode``); elsewhere it copies the expert offsets to the host,
    which capture forbids, so such a sampler decodes eagerly instead."""
    m = spec.arch.moe
    if m is None:
        return None
    sizes = (spec.hidden_size, 2 * m.intermediate_size, m.intermediate_size)
    if moe.grouped_mm_mode(dtype, device_type, capability, sizes) == "sync_free":
        return None
    return (f"CUDA graphs off for this MoE model: torch grouped_mm is capturable only in bf16 on sm90/sm100 "
            f"(here {dtype}, capability {capability}, sizes {sizes}); decoding eagerly")


def graph_key(kernel: Any, window: int, contiguous: bool) -> tuple:
    """The key of a captured decode step: what the decode kernel reads (``kernel.graph_key``).
    The gather kernel's shapes follow the window and it reads slot regions or the block table
    (contiguous mode); flash-attn's paged kernel takes neither, so one graph serves all windows."""
    fn = getattr(kernel, "graph_key", None)
    return fn(window, contiguous) if fn is not None else (window, contiguous)


def cuda_free_memory(device: torch.device) -> int:
    """Bytes free on a CUDA device for a new allocation. ``mem_get_info`` counts the caching
    allocator's reserved-but-unused blocks as used, so they are handed back first."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


class Sampler:
    """KV-cache generation engine over a plain HF-named weight dict (see module docstring).

    Args:
        model_config: HF config of a causal LM of ``rlhf.models.arch.SUPPORTED_MODEL_TYPES``, or of a
            Qwen2-VL / Qwen2.5-VL / Qwen3-VL (its language model decodes, its vision tower runs at prefill:
            ``rlhf.rollout.vision``; ``generate(multi_modal=...)`` takes the images).
        weights: HF state-dict names -> tensors (``lm_head.weight`` optional when tied).
        pad_token_id: fills ``response_ids`` after each response.
        device, dtype: where / in which precision to run (dtype defaults to the weights').
        max_num_seqs: most sequences decoded at once (cache slots).
        max_seq_len: prompt + response capacity of a slot. ``None``: sized at the first
            ``generate`` call from the longest prompt + ``max_new_tokens`` (rounded up to a
            multiple of 64) and grown only when a later call needs more.
        kv_cache_tokens: token budget of the paged KV cache (``rlhf.rollout.kv_cache``). Sequences
            take blocks of ``block_size`` positions as they grow; when the budget runs out the
            latest admitted ones are preempted and resumed later (same tokens). Default: room
            for ``max_num_seqs`` sequences of ``max_seq_len`` (never preempts).
        kv_cache_bytes: the budget in bytes instead (used when ``kv_cache_tokens`` is None).
        block_size: positions per cache block.
        refill_fraction: admit waiting sequences once this fraction of the slots is free
            (0 = refill after every finish). Batching admissions amortises prefill calls.
        prefill_tokens: token budget of one prefill forward: admissions are split into forwards of
            at most this many tokens, and a longer prompt is prefilled in chunks of this size.
        use_cuda_graph: run decode on all slots with power-of-two attention windows (static
            shapes) and capture each window's step as a CUDA graph (CUDA devices only).
        tp_group: process group of a tensor-parallel rollout. ``weights`` then hold this rank's
            slice: rows of q/k/v and gate/up (column parallel), columns of o_proj / down_proj
            (row parallel, outputs all-reduced over the group), everything else full. Every
            rank computes full-vocab logits and draws the same tokens. None: no TP.
        gpu_memory_utilization: on CUDA without a token / byte budget, cap the cache at this
            fraction of the device memory free when it is allocated (after the weights), so a
            large ``max_num_seqs`` x ``max_seq_len`` shrinks to what fits (preempting when
            needed) instead of running out of memory. None: no cap.
        slot_regions: when the budget holds every slot at ``max_seq_len`` and the decode kernel
            reads a gathered copy of the K/V (CPU, or CUDA without flash-attn), give each slot a
            fixed region of the cache so decode attention reads the K/V in place (compaction copies
            a finished slot's successor instead). Multi-turn calls always page. False: always page.
        prefix_sharing: when paging, the samples of a prompt admitted together share the prompt's
            full KV blocks (ref-counted) instead of holding ``n`` copies.
        decode_attention: decode attention kernel (``rlhf.rollout.paged_attention``); default:
            flash-attn's paged kernel on CUDA (fp16 / bf16) when installed, else the gather reference.
            A kernel's ``block_multiple`` rounds ``block_size`` up.
        reload_in_place: ``load_weights`` copies new weights into this sampler's tensors, layer by
            layer (their addresses kept, what captured CUDA graphs read; no second full copy). The
            sampler then holds copies of its own, never the caller's tensors. Implied by
            ``use_cuda_graph``; for a sampler kept across training steps.
        consume_weights: ``weights`` is a dict handed over to the sampler: its tensors are popped as
            they are fused, so the unfused ones die on the way (peak ~1x + one layer).
        free_memory: ``device -> free bytes`` for ``gpu_memory_utilization`` (default on CUDA: empty
            the caching allocator's cache, then ``torch.cuda.mem_get_info``).
        cascade_attention: with the default kernel and without CUDA graphs, run a group's shared prompt
            prefix once for its samples' decode queries where it pays (``rlhf.rollout.cascade_attention``).
        speculative: ``rollout.speculative`` settings (``enable``, ``num_draft_tokens``, ``ngram_min`` /
            ``ngram_max``, ``sources``): n-gram drafts verified in one forward (``rlhf.rollout.speculative``).
        ep_group: rollout.ep > 1: the rollout ep group (``RolloutLayout.ep_group``); ``weights`` then hold
            this rank's ``E / (ep x tp)`` experts and the sparse layers dispatch over the group
            (``rlhf.rollout.expert_dispatch``). Every generate ends by serving the peers until they finish;
            a replica with nothing to generate calls :meth:`ep_drain` instead.
        record_routes: a MoE model's sampler records each token's top-k expert ids per sparse layer
            (``RolloutOutput.routes``: rollout routing replay, ``actor.router_replay=R3``); ignored for
            a dense model.
        generic_path: run the model's own HF modules (``rlhf.rollout.generic``) even where the fast functional
            decoder has its family (benchmarks and tests that compare the two paths on one model).
    """

    def __init__(
        self,
        model_config: Any,
        weights: Mapping[str, Tensor],
        *,
        pad_token_id: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        max_num_seqs: int = 256,
        max_seq_len: int | None = None,
        kv_cache_tokens: int | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        refill_fraction: float = 0.0,
        prefill_tokens: int = 8192,
        use_cuda_graph: bool = False,
        tp_group: Any = None,
        gpu_memory_utilization: float | None = None,
        slot_regions: bool = True,
        prefix_sharing: bool = True,
        decode_attention: Any = None,
        reload_in_place: bool = False,
        consume_weights: bool = False,
        free_memory: Callable[[torch.device], int] | None = None,
        cascade_attention: bool = True,
        speculative: Any = None,
        record_routes: bool = False,
        ep_group: Any = None,
        generic_path: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        self.device = torch.device(device)
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs a CUDA device, got device={self.device}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        # a Qwen-VL: its language model runs in the decoder, its vision tower at prefill (rlhf.rollout.vision)
        self.vlm_config = model_config if vision.is_vlm(model_config) else None
        self.vision_tower = None
        self.banned_ids: Tensor | None = None
        if self.vlm_config is not None:
            model_config = vision.text_config(model_config)
            weights = self._split_vlm(weights, dtype, consume_weights)
            ids = [getattr(self.vlm_config, k, None) for k in ("image_token_id", "video_token_id")]
            self.banned_ids = torch.tensor([i for i in ids if i is not None], dtype=torch.int64, device=self.device)
        self.config = model_config
        # the seam: the functional decoder (fast families), the model's own HF modules (rlhf.rollout.generic) or,
        # under rollout.batch_invariant, the trainer's row-tiled forward (rlhf.models.batch_invariant); each offers
        # prefill / prefill_chunk / decode with one signature, which the scheduler calls
        self.backend: Any = decoder
        self.path = rollout_path(model_config, max_seq_len) if self.vlm_config is None else None
        if generic_path and self.path is not None:
            self.path = RolloutPath(GENERIC, "generic_path=True")
        if self.path is not None and self.path.path == GENERIC:
            self.backend = generic
            use_cuda_graph, speculative = self._generic_limits(tp_group, ep_group, use_cuda_graph, speculative)
            tp_group = ep_group = None
            self.spec: Any = None
        else:
            self.spec = decoder.DecoderSpec.from_config(model_config)
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        if tp_size > 1:  # weights hold this rank's heads / MLP columns (rlhf.rollout.reshard layout)
            self.spec = self.spec.shard(tp_size)
        else:
            tp_group = None  # a group of one: nothing to all-reduce
        if ep_group is not None and dist.get_world_size(ep_group) > 1:
            use_cuda_graph = self._expert_parallel(ep_group, tp_size, use_cuda_graph)
        self.pad_token_id = int(pad_token_id)
        # rollout.batch_invariant: the forward (and the reported log-probs) of rlhf.models.batch_invariant, which
        # reads the cache positions as columns (paged blocks, no cascade) and needs no CUDA graph
        self.batch_invariant = batch_invariant
        if batch_invariant:
            if self.backend is generic:
                raise ValueError(f"rollout.batch_invariant: {model_config.model_type} runs on the generic path "
                                 f"({self.path.reason}), outside the mode")
            self.backend = invariant.checked(self.spec, tp_size=tp_size, cuda_graph=use_cuda_graph,
                                             speculative=getattr(speculative, "enable", False), ep=self.spec.ep, vlm=self.vlm_config)
            slot_regions = cascade_attention = False
        self.dtype = dtype or next(iter(weights.values())).dtype
        if self.backend is generic:  # the HF module is the weights; its spec comes from a probe forward
            self.weights, self.spec = generic.build(model_config, weights, device=self.device, dtype=self.dtype,
                                                    consume=consume_weights, reason=self.path.reason)
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self.kv_cache_bytes = kv_cache_bytes
        # a generic-path model has no ArchSpec: its config says whether any layer soft-caps
        softcap = (any(p.softcap is not None for p in self.spec.arch.layers) if self.spec.arch is not None
                   else getattr(model_config, "attn_logit_softcapping", None) is not None)
        self.decode_attention = decode_attention or paged_attention.decode_attention(
            self.device, self.dtype, softcap=softcap)
        if use_cuda_graph and self.backend is not generic:
            blocker = graph_blocker(self.spec, self.dtype, "cuda", torch.cuda.get_device_capability(self.device))
            if blocker is not None:
                warnings.warn(blocker, stacklevel=2)
                use_cuda_graph = False
        # On CUDA the cascade runs through the paged kernel's log-sum-exp (flash-attn or torch's varlen_attn);
        # tested against CPU references, off there until measured (attention_backend.cascade_auto)
        if cascade_attention and decode_attention is None and attention_backend.cascade_auto(
                self.device.type, self.decode_attention.name, use_cuda_graph):
            self.decode_attention = cascade.decode_attention(self.device, self.dtype, self.decode_attention)
        mult = self.decode_attention.block_multiple
        self.block_size = -(-block_size // mult) * mult
        self.slot_regions = slot_regions
        self.prefix_sharing = prefix_sharing
        self.gpu_memory_utilization = gpu_memory_utilization
        self.refill_fraction = refill_fraction
        self.prefill_tokens = prefill_tokens
        self.use_cuda_graph = use_cuda_graph
        self.reload_in_place = reload_in_place or use_cuda_graph
        self.free_memory = free_memory or (cuda_free_memory if self.device.type == "cuda" else None)
        # static decode shapes: all slots, bucketed windows (what a CUDA graph needs; also
        # runnable on CPU, which is how the static path is tested without a GPU)
        self.static_shapes = use_cuda_graph
        # Eager decode forwards and sampling run under torch.inference_mode: no version counters and view
        # records per op, ~10% of a small decode step's CPU time (docs/benchmarks.md). Tensors kept across
        # steps are created outside it. False: no_grad only (bench/sampler.py --no-inference-mode).
        self.inference_mode = True
        self.speculative = speculative  # rollout.speculative (rlhf.rollout.speculative); None = off
        self.tp_group = tp_group
        m = self.spec.arch.moe if self.backend is not generic else None
        # (sparse layers, top-k) of the recorded routes; step_routes: the last decode step's [live, S, k]
        self.route_shape = (sum(m.sparse), m.top_k) if record_routes and m is not None else None
        self.step_routes: Tensor | None = None
        self._inv_freq = self._rope_scale = None  # generic: the HF module rotates q / k itself
        if self.backend is not generic:  # the functional decoder's weights (the invariant forward reads the same)
            self._inv_freq, self._rope_scale = decoder.rope_inv_freq(model_config, self.spec.head_dim)
            self.weights = decoder.prepare_weights(self.spec, weights, device=self.device, dtype=self.dtype,
                                                   consume=consume_weights, copy=self.reload_in_place)
        self.cache: PagedKVCache | None = None
        self.max_seq_len = 0
        # graph_key (the kernel's real inputs: the gather kernel's window and cache mode, none of
        # them for flash-attn's block table) -> (CUDAGraph, logits buffer, routes buffers)
        self._graphs: dict[tuple[int, bool], tuple[Any, Tensor, list | None]] = {}
        self._graph_pool: Any = None
        self._fixed_len = max_seq_len is not None
        if max_seq_len is not None:
            self._allocate(max_seq_len)

    # ------------------------------------------------------------------ setup

    def _expert_parallel(self, ep_group: Any, tp_size: int, use_cuda_graph: bool) -> bool:
        from rlhf.rollout.expert_dispatch import RolloutEP

        m, ep = self.spec.arch.moe, dist.get_world_size(ep_group)
        if m is None:
            raise ValueError(f"rollout.ep={ep} needs a mixture-of-experts model; {self.spec.model_type} has none")
        if m.num_experts % (ep * tp_size):
            raise ValueError(f"rollout.ep x rollout.tp = {ep} x {tp_size} must divide num_experts={m.num_experts}")
        if use_cuda_graph:
            warnings.warn("rollout.ep > 1 decodes eagerly: the all-to-all sizes are read on the host", stacklevel=3)
        self.spec = dataclasses.replace(self.spec, ep=RolloutEP(ep_group, m.num_experts, sum(m.sparse), self.device))
        return False

    @staticmethod
    def _generic_limits(tp_group: Any, ep_group: Any, use_cuda_graph: bool, speculative: Any) -> tuple[bool, Any]:
        """What the generic path does not do: tp / ep rollouts refused, CUDA graphs and speculation off."""
        for name, group in (("rollout.tp", tp_group), ("rollout.ep", ep_group)):
            if group is not None and dist.get_world_size(group) > 1:
                raise NotImplementedError(f"{name} > 1 is not supported on the generic rollout path "
                                          f"(rlhf.rollout.generic); set {name}=1 for this model")
        if use_cuda_graph:
            warnings.warn("the generic rollout path decodes eagerly (no CUDA graphs)", stacklevel=3)
        if speculative is not None and getattr(speculative, "enable", False):
            warnings.warn("rollout.speculative is off on the generic rollout path", stacklevel=3)
            speculative = None
        return False, speculative

    def ep_drain(self) -> None:
        """rollout.ep: serve the ep peers' rows until every peer has finished generating (a no-op otherwise)."""
        if self.spec.ep is not None:
            tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
            self.spec.ep.drain(self.weights.layers, lambda u, v: arch.gated_act(self.spec.arch, u, v), tp_rank)

    def load_weights(self, weights: Mapping[str, Tensor], consume: bool = False) -> None:
        """New weights (e.g. after a training step); the KV cache is kept. ``consume``: as
        ``consume_weights``.

        With ``reload_in_place`` (CUDA graphs read the weights at fixed addresses) the new values
        are copied into the old tensors layer by layer and captured graphs (and their memory
        pool) are replayed as they are: no re-capture per training step. Otherwise the old
        weights are dropped before the new ones are prepared.
        """
        kw = dict(device=self.device, dtype=self.dtype, consume=consume)
        if self.vlm_config is not None:
            weights = self._split_vlm(weights, self.dtype, consume)
        if self.backend is generic:  # copied into the HF module's tensors in place
            generic.load(self.weights, weights, consume=consume)
            return
        if self.reload_in_place:
            decoder.prepare_weights(self.spec, weights, into=self.weights, **kw)
            return
        self.weights = None
        self.weights = decoder.prepare_weights(self.spec, weights, **kw)

    def _split_vlm(self, weights: Mapping[str, Tensor], dtype: torch.dtype | None, consume: bool) -> dict:
        """A Qwen-VL's rollout weights -> the language model's (returned); the vision tower is (re)built."""
        taken = weights if consume else dict(weights)
        lm, visual = vision.split_vlm_weights(taken)
        dtype = dtype or next(iter(lm.values())).dtype
        self.vision_tower = vision.build_vision_tower(self.vlm_config, visual, self.device, dtype)
        return lm

    def embed(self, ids: Tensor) -> Tensor:
        """Input embeddings of token ids ``[T]`` -> ``[T, hidden]``."""
        return arch.embed(self.spec.arch, self.weights.embed, ids)

    def _allocate(self, max_seq_len: int) -> None:
        self.spec.check_seq_len(max_seq_len)
        self.cache = None  # free the old buffers first (and count them as free below)
        per_token = kv_bytes_per_token(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, self.dtype)
        bs = self.block_size
        full = self.max_num_seqs * -(-max_seq_len // bs) * bs  # every slot at max_seq_len: never preempts
        budget = self.kv_cache_tokens
        if budget is None and self.kv_cache_bytes is not None:
            budget = self.kv_cache_bytes // per_token
        if budget is None and self.gpu_memory_utilization is not None and self.free_memory is not None:
            budget = kv_tokens_for_memory(self.free_memory(self.device), self.gpu_memory_utilization, per_token)
            if self.tp_group is not None:  # TP peers schedule in lockstep: the same blocks on each
                t = torch.tensor([budget], dtype=torch.int64, device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
                budget = int(t)
        budget = full if budget is None else min(full, budget)
        self.cache = PagedKVCache(self.spec.num_layers, budget // bs, self.max_num_seqs, self.spec.num_kv_heads,
                                  max_seq_len, self.spec.head_dim, block_size=bs, dtype=self.dtype, device=self.device,
                                  attention=self.decode_attention)
        self.max_seq_len = max_seq_len
        self.cos = self.sin = None
        if self._inv_freq is not None:
            self.cos, self.sin = self.backend.rope_tables(self._inv_freq, self._rope_scale, max_seq_len, self.dtype,
                                                          self.device)
        # decode inputs live at fixed addresses (CUDA graphs read them in place)
        self.token_buf = torch.zeros(self.max_num_seqs, dtype=torch.int64, device=self.device)
        self.pos_buf = torch.zeros(self.max_num_seqs, dtype=torch.int64, device=self.device)
        # rotary positions of a VLM's decode step (cache position + rope delta)
        self.rope_buf = torch.zeros(self.max_num_seqs, dtype=torch.int64, device=self.device) \
            if self.vlm_config is not None else None
        self._graphs = {}

    def _ensure_capacity(self, need: int) -> None:
        if need <= self.max_seq_len:
            return
        if self._fixed_len:
            raise ValueError(
                f"longest prompt + max_new_tokens = {need} exceeds max_seq_len={self.max_seq_len}; "
                "raise Sampler(max_seq_len=...) or shorten prompts / max_new_tokens"
            )
        self._allocate(-(-need // 64) * 64)

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        step: int = 0,
        prompt_keys: list[int] | None = None,
        on_finished: Callable[[list[int], list[list[int]]], None] | None = None,
        turns: TurnHandler | None = None,
        multi_modal: list[dict | None] | None = None,
        keep_groups: int | None = None,
        count_group: Any = None,
    ) -> RolloutOutput:
        """Generate ``params.n`` responses per prompt (see ``RolloutOutput`` for the layout).

        ``prompt_keys`` (default ``range(len(prompts))``) are the prompts' global dataset
        indices: with ``params.seed`` and ``step`` they key the random draws, so the same
        prompt key yields the same responses whatever the batch or rank it is generated on.
        ``on_finished(rows, token_ids)`` is called as sequences finish (output rows, their tokens).
        ``turns``: multi-turn handler (``rlhf.rollout.turns``); a sequence whose turn ends may wait
        for an observation that is appended to it, and ``max_new_tokens`` bounds the whole trajectory.
        ``multi_modal``: a VLM's per-prompt images (``{"pixel_values", "image_grid_thw"}`` or None for a
        text prompt), as the data path keeps them (``rlhf.data.multimodal``).
        ``keep_groups``: over-sampling (``rlhf.rollout.abort``): once that many prompts have all ``n``
        samples finished, the rest is aborted; their rows are flagged in ``RolloutOutput.aborted``. ``count_group``:
        the rollout replicas' group (one rank each) over which the finished groups are counted.
        """
        params.validate(self.spec.vocab_size)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: prompts must be a non-empty list of non-empty token lists")
        if prompt_keys is None:
            prompt_keys = list(range(len(prompts)))
        if len(prompt_keys) != len(prompts):
            raise ValueError(f"generate: {len(prompt_keys)} prompt_keys for {len(prompts)} prompts")
        max_new = params.max_new_tokens
        self._ensure_capacity(max(len(p) for p in prompts) + max_new)
        vis = None
        if self.vlm_config is not None:
            vis = vision.VisionPrompts(self, prompts, multi_modal or [None] * len(prompts))
        elif multi_modal and any(m is not None for m in multi_modal):
            raise ValueError(f"generate: images given but model_type {self.config.model_type!r} is a text LM")
        out = RolloutOutput(**GenerateRun(self, prompts, params, step, prompt_keys, on_finished, turns,
                                          vis, keep_groups, count_group).execute())
        self.ep_drain()
        return out

    # ------------------------------------------------------------------ decode forward

    def lean(self) -> Any:
        """The context of decode forwards and sampling (``torch.inference_mode`` unless turned off)."""
        return torch.inference_mode() if self.inference_mode else contextlib.nullcontext()

    def decode_logits(self, live: int, window: int, rope_pos: Tensor | None = None) -> Tensor:
        """Logits ``[live, V]`` of one decode step of slots ``[0, live)`` (inputs in token/pos_buf);
        ``rope_pos`` ``[live]``: a VLM's rotary positions."""
        if rope_pos is not None:
            self.rope_buf[:live].copy_(rope_pos)
        rope = self.rope_buf
        routes = [] if self.route_shape is not None else None
        if not self.static_shapes:
            with self.lean():
                out = self.backend.decode(self.spec, self.weights, self.cache, self.token_buf[:live],
                                          self.pos_buf[:live], window, self.cos, self.sin, self.tp_group,
                                          None if rope is None else rope[:live], routes)
            self._keep_routes(routes, live)
            return out
        window = min(self.max_seq_len, max(64, 1 << (window - 1).bit_length()))
        if not self.use_cuda_graph:
            with self.lean():
                out = self.backend.decode(self.spec, self.weights, self.cache, self.token_buf, self.pos_buf,
                                          window, self.cos, self.sin, self.tp_group, rope, routes)[:live]
            self._keep_routes(routes, live)
            return out
        key = graph_key(self.decode_attention, window, self.cache.contiguous)
        if key not in self._graphs:
            self._capture(window, key)
        graph, logits, routes = self._graphs[key]
        graph.replay()  # rewrites the captured route buffers in place too
        self._keep_routes(routes, live)
        return logits[:live]

    def _keep_routes(self, routes: list | None, live: int) -> None:
        self.step_routes = None if routes is None else torch.stack(routes, dim=1)[:live]

    def _capture(self, window: int, key: tuple) -> None:
        """Capture the all-slot decode step for ``window`` as a CUDA graph (CUDA only).

        The warm-up runs write the K/V of each slot's current token at its current position,
        the same values the replay writes, so capturing in the middle of a run is harmless.
        """
        args = (self.spec, self.weights, self.cache, self.token_buf, self.pos_buf, window, self.cos, self.sin,
                self.tp_group, self.rope_buf)
        routes = [] if self.route_shape is not None else None
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                decoder.decode(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = decoder.decode(*args, routes=routes)
        self._graphs[key] = (graph, logits, routes)
