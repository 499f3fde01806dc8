"""The rollout sampler in the simulation (``python -m rlhf.simulate``): its real code on fake tensors.

After the reshard (``gather_rollout_weights``), the simulated rank builds the sampler the way the
trainer's ``RolloutEngine`` does (``RolloutEngine._sampler``: the same ``Sampler`` arguments) and runs
one ``generate`` call's memory-heavy work through the scheduler's own methods
(``rlhf.rollout.scheduler.GenerateRun``):

* ``Sampler.__init__``: ``prepare_weights`` (fused q|k|v and gate|up copies, taken from the handed-over
  dict; under pp the stage exchange's received tensors are views of one flat buffer, so nothing dies
  while every layer's fused copy is made), the paged KV cache at the engine's budget, rope tables;
* ``GenerateRun.__init__``: the output buffers ``[N, R]`` and per-slot state;
* one admission (``_fitting`` / ``_admit``): the replica's prompts, all ``max_prompt_length`` long,
  prefilled in the scheduler's ``prefill_tokens`` chunks through ``rlhf.models.decoder.prefill`` (or
  ``prefill_chunk``), then the first tokens sampled (``rlhf.rollout.sampling.sample_next``);
* one decode step (``_reserve_next_positions`` / ``_decode_step``) at the last response position, the
  widest attention window (the CPU gather buffer, the masks), with its logits and sampling.

What is left out, because it depends on values that fake tensors do not have: which token is drawn,
stops and retirement (``GenerateRun._retire_done``: the slots stay live), preemption and refill decisions
past the first admission, top-p's host check (``top_p_nucleus`` takes its full-sort path, the larger
one), speculative decoding (its drafts come from token values; the plain decode step runs). The
prefill's packing indices (``rlhf.rollout.scheduler.prefill_layout``) are computed on the host.
On a simulated ``cuda`` device the decode runs flash-attn's paged kernel (shapes only; bf16 / fp16
rollouts, as the planner assumes flash-attn installed; ``flash_attn=False``, ``python -m rlhf.simulate
--no-flash-attn``: the gather kernel, its block size and buffers) and, without ``rollout.kv_cache_tokens`` /
``kv_cache_memory``, the real sampler sizes its cache at ``gpu_memory_utilization`` of the GPU's free
memory, capped at every slot full (``max_num_seqs`` x ``max_prompt_length + max_response_length``): a
property of the card, so the simulation gives it the slots' need, as the planner plans it (one slot per
sequence of the replica, at most ``max_num_seqs``, in whole blocks). On a card with memory to spare the
real cache is larger (on an H200 it took the cap); set ``rollout.kv_cache_tokens`` to simulate a budget.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from rlhf.ops.sim_packed import on_host


class _NoTokenizer:
    """What ``RolloutEngine`` reads off a tokenizer: the pad and stop ids; a stop string's tokens only size
    the stop window (one token per character, an upper bound)."""

    def __init__(self, hf: Any) -> None:
        self.pad_token_id = getattr(hf, "pad_token_id", None) or 0
        self.eos_token_id = getattr(hf, "eos_token_id", None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text)


def _flash_decode_shapes(q, k, v, *, return_softmax_lse=False, **_):
    """What ``flash_attn_with_kvcache`` allocates: its output ``[B, 1, H, D]`` (and fp32 lse ``[B, H, 1]``)."""
    out = torch.empty_like(q)
    if return_softmax_lse:
        return out, torch.empty(q.shape[0], q.shape[2], 1, dtype=torch.float32, device=q.device)
    return out


def _cuda_decode_kernel(device: Any, dtype: torch.dtype, flash_attn: bool = True) -> Any:
    """The decode kernel of a CUDA sampler: flash-attn's paged one (fp16 / bf16, ``flash_attn`` installed),
    else the gather kernel, as on a GPU."""
    from rlhf.rollout.paged_attention import FlashPagedAttention, GatherAttention

    if flash_attn and dtype in (torch.float16, torch.bfloat16):
        return FlashPagedAttention(fn=_flash_decode_shapes)
    return GatherAttention()


@contextmanager
def value_free_scheduler(counter: Any, device: str = "cpu", flash_attn: bool = True) -> Iterator[None]:
    """Inside: the scheduler's value-dependent steps are skipped or run on the host (module docstring),
    and the sampler's KV cache (``Sampler._allocate``) is counted as ``kv cache``. ``device="cuda"``: the
    sampler (built on the host, where the fake group's tensors live) decodes as on a GPU with flash-attn:
    the paged kernel's allocations, its block size, no cascade (CPU only); its MoE route record is host
    memory, as a CUDA sampler keeps it."""
    from rlhf.ops.sim_memory import HOST_ROUTES
    from rlhf.rollout import cascade_attention, paged_attention, sampler as _sampler, sampling, scheduler
    from rlhf.rollout.routes import RouteBook

    real_layout, real_retire = scheduler.prefill_layout, scheduler.GenerateRun._retire_done
    real_nucleus, real_alloc = sampling.top_p_nucleus, _sampler.Sampler._allocate
    real_kernel, real_cascade = paged_attention.decode_attention, cascade_attention.decode_attention

    class HostRouteBook(RouteBook):
        """A CUDA sampler keeps its route record in host memory (``RouteBook``'s staged mode)."""

        def __init__(self, *args, **kwargs) -> None:
            with counter.category(HOST_ROUTES):
                super().__init__(*args, **{**kwargs, "on_host": True})

    def nucleus(logp, top_p, prefilter=0):
        return real_nucleus(logp, top_p, prefilter=sys.maxsize)  # the full sort: no host check

    def allocate(self, max_seq_len):
        with counter.category("kv cache"):
            real_alloc(self, max_seq_len)

    scheduler.prefill_layout = on_host(real_layout)
    scheduler.GenerateRun._retire_done = lambda self, *a: None
    sampling.top_p_nucleus = nucleus
    _sampler.Sampler._allocate = allocate
    if device == "cuda":
        paged_attention.decode_attention = lambda dev, dtype, **kw: _cuda_decode_kernel(dev, dtype, flash_attn)
        cascade_attention.decode_attention = lambda device, dtype, base=None: base
        scheduler.RouteBook = HostRouteBook
    try:
        yield
    finally:
        scheduler.prefill_layout, scheduler.GenerateRun._retire_done = real_layout, real_retire
        sampling.top_p_nucleus, _sampler.Sampler._allocate = real_nucleus, real_alloc
        paged_attention.decode_attention, cascade_attention.decode_attention = real_kernel, real_cascade
        scheduler.RouteBook = RouteBook


def replica_sequences(cfg: Any, world: int, rollout_tp: int) -> tuple[int, int]:
    """(prompts, sequences) one rollout replica generates in a step: its share of the generation batch."""
    d = cfg.data
    gen_bs = d.gen_batch_size if cfg.algorithm.filter_groups.enable and d.gen_batch_size > 0 else d.train_batch_size
    prompts = math.ceil(gen_bs / (world // rollout_tp))
    return prompts, prompts * cfg.rollout.n


@contextmanager
def _fp8_decode(device: str, r: Any) -> Iterator[None]:
    """rollout.quantization fp8 on a simulated cuda device: the sampler keeps the dense projections in FP8 for
    the ``_scaled_mm`` decode, as on an sm89+ GPU (the fake tensors live on the host, where it would not)."""
    from rlhf.models import fp8

    key = ("cpu", 0, r.quantization_scale)
    if device != "cuda" or r.quantization != "fp8":
        yield
        return
    before = fp8._KERNEL_OK.get(key)
    fp8._KERNEL_OK[key] = True
    try:
        yield
    finally:
        if before is None:
            fp8._KERNEL_OK.pop(key, None)
        else:
            fp8._KERNEL_OK[key] = before


def simulate_sampler(cfg: Any, hf: Any, weights: dict, layout: Any, dtype: torch.dtype, counter: Any, *,
                     world: int, device: str, flash_attn: bool = True) -> Any:
    """Build this rank's sampler from the rollout ``weights`` (handed over: emptied) and run one
    admission's prefill and one decode step of its replica's prompts (module docstring); returns the
    sampler (the caller drops it, as the engine does after ``generate``, or keeps it)."""
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.rollout.kv_cache import DEFAULT_BLOCK_SIZE
    from rlhf.rollout.scheduler import GenerateRun

    r, d = cfg.rollout, cfg.data
    P, R = d.max_prompt_length, d.max_response_length
    prompts, seqs = replica_sequences(cfg, world, layout.tp)
    if device == "cuda" and not r.kv_cache_tokens and not r.kv_cache_memory:  # see the module docstring
        mult = _cuda_decode_kernel(None, dtype, flash_attn).block_multiple  # the sampler rounds its block size up to it
        block = -(-DEFAULT_BLOCK_SIZE // mult) * mult
        r = dataclasses.replace(r, kv_cache_tokens=min(r.max_num_seqs, seqs) * -(-(P + R) // block) * block)
    engine = RolloutEngine(r, _NoTokenizer(hf), max_prompt_length=P, max_response_length=R,
                           device=torch.device("cpu"), dtype=dtype, layout=layout,
                           record_routes=cfg.actor.router_replay != "R2")  # as the trainer's engine
    with value_free_scheduler(counter, device, flash_attn), _fp8_decode(device, r):
        with counter.category("rollout weights"):
            sampler = engine._sampler(hf, weights, consume=True)
        params = engine.sampling_params(n=r.n, temperature=r.temperature, seed=r.seed)
        run = GenerateRun(sampler, [[0] * P for _ in range(prompts)], params, 0, list(range(prompts)))
        run.spec = None  # speculation drafts from token values: the plain decode step runs instead
        run._admit(run._fitting(run.S))
        if run.live:
            run.stats["decode_steps"] = R - 1  # the last step: the widest window
            run._reserve_next_positions()  # (a budget short of it preempts, as the scheduler would)
        if run.live:
            run._decode_step()
        del run
    return sampler


def decoder_weight_bytes(weights: Any) -> int:
    """Bytes of the tensors a decode step reads (``DecoderWeights``: each layer's and the embedding / head,
    a tied head once), whatever buffers they are views of."""
    tensors = {id(t): t for t in (weights.embed, weights.norm, weights.lm_head)}
    for lw in weights.layers:
        tensors.update({id(t): t for t in vars(lw).values() if isinstance(t, torch.Tensor)})
        # FP8 rollout (rlhf.models.fp8.Fp8Weight): the e4m3 data and its scales
        tensors.update({id(t): t for w in vars(lw).values() if hasattr(w, "scale") for t in (w.data, w.scale)})
    return sum(t.numel() * t.element_size() for t in tensors.values())

