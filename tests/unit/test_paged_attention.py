"""Decode attention kernels over the paged KV cache (rlhf.rollout.paged_attention), on CPU."""

from __future__ import annotations

import pytest
import torch

from rlhf.rollout import SamplingParams
from rlhf.rollout.paged_attention import FlashPagedAttention, GatherAttention, decode_attention
from tests.unit.test_sampler import PROMPTS, _sampler

PARAMS = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=4, stop_token_ids=[1, 2, 3, 4, 6])


def flash_with_kvcache_reference(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal):
    """flash-attn's ``flash_attn_with_kvcache`` for a paged cache, as its docstring defines it,
    written plainly; it also checks what flash-attn 2 checks about its arguments.

    q ``[B, Sq, H, D]``; k_cache / v_cache ``[num_blocks, block_size, Hkv, D]``; block_table
    ``[B, max_blocks]`` int32; cache_seqlens ``[B]`` int32 (positions of each sequence in the
    cache); query head ``h`` reads kv head ``h // (H / Hkv)``; with ``causal`` query ``i`` sees
    the keys up to ``cache_seqlens - Sq + i``.
    """
    assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_table.stride(-1) == 1
    assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    b, sq, h, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(cache_seqlens[i])
        blocks = block_table[i, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, dim=1)  # [n, H, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[i], k) * softmax_scale
        if causal:
            s = s.masked_fill(torch.arange(n)[None, :] > (n - sq + torch.arange(sq))[:, None], float("-inf"))
        out[i] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def test_flash_paged_kernel_convention_matches_the_gather_reference():
    """The flash-attn kernel's call (layout views, int32 table, seqlens, head order, block size
    rounded to 256) fed to a reference of flash-attn's convention gives the reference's tokens."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=4, stop_token_ids=[1, 2, 3, 4, 6])
    ref = _sampler(max_num_seqs=4).generate(PROMPTS, params)
    kernel = FlashPagedAttention(fn=flash_with_kvcache_reference)
    s = _sampler(max_num_seqs=4, decode_attention=kernel)
    assert s.block_size == 256
    out = s.generate(PROMPTS, params)
    assert out.stats["compaction_moves"] > 0
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
    # blocks from the free list, not in slot order: a budget of 2 blocks for 4 slots
    tight = _sampler(max_num_seqs=4, decode_attention=kernel, kv_cache_tokens=512)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4)
    out = tight.generate(PROMPTS[:3], params)
    full = _sampler(max_num_seqs=4).generate(PROMPTS[:3], params)
    assert out.stats["kv_cache_tokens"] == 512
    assert torch.equal(out.response_ids, full.response_ids)


def test_contiguous_slot_regions_match_paged_blocks():
    """Fixed slot regions (decode reads views, compaction copies K/V) = paged blocks (gather)."""
    regions = _sampler(max_num_seqs=5)
    paged = _sampler(max_num_seqs=5, slot_regions=False)
    a, b = regions.generate(PROMPTS, PARAMS), paged.generate(PROMPTS, PARAMS)
    assert regions.cache.contiguous and not paged.cache.contiguous
    assert a.stats["compaction_moves"] > 0
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
    assert regions.cache.num_free == regions.cache.num_blocks  # every block returned
    # a budget below every slot at full length pages even with slot_regions
    small = _sampler(max_num_seqs=5, kv_cache_tokens=4 * 64)
    assert torch.equal(small.generate(PROMPTS, PARAMS).response_ids, a.response_ids)
    assert not small.cache.contiguous


def test_default_kernel_per_device():
    assert isinstance(decode_attention(torch.device("cpu"), torch.bfloat16), GatherAttention)
    assert isinstance(decode_attention(torch.device("cpu"), torch.float32), GatherAttention)


# --------------------------------------------------------------------------- prefix sharing

LONG = [[(7 * i + 3 * k) % 60 + 2 for i in range(n)] for k, n in enumerate((37, 16, 5, 50))]


@pytest.mark.parametrize("kw", [{}, {"max_num_seqs": 5}, {"kv_cache_tokens": 200}, {"prefill_tokens": 16}])
def test_prefix_sharing_same_tokens_fewer_blocks_all_freed(kw):
    """The n samples share their prompt's full blocks: same tokens and log-probs as unshared
    blocks, fewer blocks at the peak, every block free (refcounts 0) afterwards; also under
    few slots and under preemption."""
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=40, seed=9, stop_token_ids=[5])
    out = {}
    for share in (True, False):
        s = _sampler(slot_regions=False, prefix_sharing=share, block_size=8, **kw)
        out[share] = s.generate(LONG, params)
        assert s.cache.num_free == s.cache.num_blocks and not any(s.cache.refs)
    on, off = out[True], out[False]
    assert torch.equal(on.response_ids, off.response_ids)
    torch.testing.assert_close(on.log_probs, off.log_probs, atol=1e-5, rtol=0)
    assert on.stats["kv_shared_blocks"] > 0 and off.stats["kv_shared_blocks"] == 0
    if not kw or "prefill_tokens" in kw:  # all admitted at once: 3 of 4 samples share each prompt's full blocks
        assert on.stats["kv_shared_blocks"] == 3 * sum(len(p) // 8 for p in LONG)
        assert off.stats["kv_peak_tokens"] - on.stats["kv_peak_tokens"] >= 8 * on.stats["kv_shared_blocks"] * 0.5
    if "kv_cache_tokens" in kw:
        assert on.stats["preemptions"] > 0


def test_prefix_sharing_with_parked_sequences():
    from tests.unit.test_sampler_turns import PARAMS as TURN_PARAMS, FakeTool

    ref = _sampler(slot_regions=False, prefix_sharing=False, block_size=8).generate(LONG, TURN_PARAMS, turns=FakeTool())
    for kw in ({}, {"kv_cache_tokens": 5 * 96}):
        s = _sampler(block_size=8, **kw)
        out = s.generate(LONG, TURN_PARAMS, turns=FakeTool(delay=3))
        assert out.stats["kv_shared_blocks"] > 0 and out.stats["turns"] > 0
        assert torch.equal(out.response_ids, ref.response_ids) and torch.equal(out.response_mask, ref.response_mask)
        assert s.cache.num_free == s.cache.num_blocks and not any(s.cache.refs)


class _ReplayGraph:
    """Stands in for a CUDA graph on CPU: replay re-runs the step with the arguments it was
    captured with (the window included), into the same logits buffer."""

    def __init__(self, s, window):
        from rlhf.models import decoder

        self.args = (s.spec, s.weights, s.cache, s.token_buf, s.pos_buf, window, s.cos, s.sin, s.tp_group)
        self.decode = decoder.decode
        self.logits = self.decode(*self.args)

    def replay(self):
        self.logits.copy_(self.decode(*self.args))


@pytest.mark.parametrize("flash", [True, False])
def test_cuda_graphs_are_keyed_by_the_kernels_real_inputs(flash, monkeypatch):
    """flash-attn's paged kernel ignores the window: one graph for the run (it was one per window,
    each with its logits buffer); the gather kernel's shapes follow the window: one per window."""
    from rlhf.rollout.sampler import graph_key

    kernel = FlashPagedAttention(fn=flash_with_kvcache_reference) if flash else GatherAttention()
    prompts = [[(5 * i) % 60 + 2 for i in range(50)], [7, 8, 9], [3, 4]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=90, seed=4)  # windows 64, 128 and 256
    ref = _sampler(max_num_seqs=4, decode_attention=kernel, slot_regions=False).generate(prompts, params)
    s = _sampler(max_num_seqs=4, decode_attention=kernel, slot_regions=False)
    s.static_shapes = s.use_cuda_graph = True
    captured = []

    def capture(window, key):
        captured.append(window)
        g = _ReplayGraph(s, window)
        s._graphs[key] = (g, g.logits, None)  # (graph, logits, route buffers)

    monkeypatch.setattr(s, "_capture", capture)
    out = s.generate(prompts, params)
    assert len(captured) == (1 if flash else 3), captured
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
    assert graph_key(kernel, 64, False) == graph_key(kernel, 4096, False) if flash else \
        graph_key(kernel, 64, True) != graph_key(kernel, 64, False)


def test_cuda_without_flash_attn_decodes_with_the_gather_kernel_and_says_so_once(monkeypatch):
    from rlhf.rollout import paged_attention as pa

    assert pa.gather_on_cuda_reason("cuda", torch.bfloat16, True) is None
    assert "float32" in pa.gather_on_cuda_reason("cuda", torch.float32, True)
    assert "not installed" in pa.gather_on_cuda_reason("cuda", torch.bfloat16, False)
    assert pa.gather_on_cuda_reason("cpu", torch.float32, False) is None
    monkeypatch.setitem(pa._FLASH, "fn", None)  # the wheel is missing
    monkeypatch.setattr(pa, "_WARNED", set())
    with pytest.warns(UserWarning, match="without flash-attn .flash-attn is not installed"):
        assert isinstance(decode_attention(torch.device("cuda"), torch.bfloat16), GatherAttention)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode_attention(torch.device("cuda"), torch.bfloat16)  # once per process, not per sampler
        decode_attention(torch.device("cpu"), torch.float32)
