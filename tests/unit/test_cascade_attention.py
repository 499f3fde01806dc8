"""Shared-prefix (cascade) decode attention (rlhf.rollout.cascade_attention), on CPU: the kernel equals
the gather reference to fp32 rounding, and the sampler's tokens are the same with it on and off."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.arch import LayerAttn
from rlhf.rollout import SamplingParams
from rlhf.rollout.cascade_attention import CascadeAttention, cascade_pays, merge_lse, merge_partials
from rlhf.rollout.kv_cache import PagedKVCache
from rlhf.rollout.paged_attention import GatherAttention
from tests.unit.test_paged_attention import LONG
from tests.unit.test_sampler import _sampler


def _cache(num_slots=8, hkv=2, d=8, bs=4, max_len=64) -> PagedKVCache:
    torch.manual_seed(0)
    c = PagedKVCache(2, 120, num_slots, hkv, max_len, d, block_size=bs, dtype=torch.float32,
                     device=torch.device("cpu"))
    c.start(contiguous=False)
    c.kv.normal_()
    return c


def _mixed_groups(c: PagedKVCache) -> torch.Tensor:
    """Slots 0-2 share a 24-position prompt (6 blocks), slots 3-4 a 9-position one (2 full blocks),
    slot 5 is a group of one, slot 6 a sibling of slot 5 that holds its own copy (a recomputed one)."""
    lens = {0: 24, 3: 9, 5: 13, 6: 13}
    c.grow([0, 3, 5, 6], [lens[s] + 1 for s in (0, 3, 5, 6)])
    c.share(0, [1, 2], 6)
    c.share(3, [4], 2)
    c.grow([1, 2, 4], [25 + 7, 25 + 3, 10 + 11])  # own suffix blocks of different lengths
    c.grow([0, 3], [24 + 20, 9 + 4])
    return torch.tensor([24 + 19, 24 + 6, 24 + 2, 9 + 3, 10 + 10, 13, 12])  # [B] current positions


@pytest.mark.parametrize("p", [LayerAttn(0.35, None, None, 0), LayerAttn(0.35, None, 7, 0),
                               LayerAttn(0.35, None, 30, 0), LayerAttn(0.35, 2.0, None, 0)],
                         ids=["plain", "sliding7", "sliding30", "softcap"])
def test_kernel_equals_gather_reference_on_mixed_groups(p):
    c = _cache()
    pos = _mixed_groups(c)
    b, window = pos.shape[0], int(pos.max()) + 1
    kernel = CascadeAttention(min_saved=8)
    plan = kernel.plan(c, b, pos, window, torch.float32)
    assert plan.groups == 2 and plan.pre_len.tolist() == [24, 8]  # slot 5 alone, slot 6 not sharing
    ref_plan = GatherAttention().plan(c, b, pos, window, torch.float32)
    for layer in range(2):
        q = torch.randn(b, 2, 3, 8)
        ref = GatherAttention().attend(c, layer, q, ref_plan, p)
        out = kernel.attend(c, layer, q, plan, p)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_rule_and_fallback_to_the_base_kernel():
    assert cascade_pays([2, 1, 8, 8, 4], [1536, 4096, 128, 256, 256]) == [True, False, False, True, False]
    c = _cache()
    pos = _mixed_groups(c)
    assert not hasattr(CascadeAttention().plan(c, 7, pos, 44, torch.float32), "groups")  # 2 x 24 saved positions
    assert CascadeAttention(min_saved=8).plan(c, 7, pos, 44, torch.float32).groups == 2  # 2 x 24 and 1 x 8
    assert CascadeAttention(min_saved=12).plan(c, 7, pos, 44, torch.float32).groups == 1
    assert CascadeAttention().prefers_paged([300, 20], 8, 16) and not CascadeAttention().prefers_paged([3000], 1, 16)
    assert not CascadeAttention().prefers_paged([200], 8, 16) and not CascadeAttention().prefers_paged([1000], 2, 16)


def test_merges_are_softmax_over_the_union():
    torch.manual_seed(1)
    s, v = torch.randn(5, 12), torch.randn(12, 3)
    ref = s.softmax(-1) @ v
    parts = []
    for sl in (slice(0, 7), slice(7, 12)):
        m = s[:, sl].amax(-1, keepdim=True)
        e = torch.exp(s[:, sl] - m)
        parts.append((m, e.sum(-1, keepdim=True), e @ v[sl]))
    torch.testing.assert_close(merge_partials(*parts[0], *parts[1]), ref, atol=1e-6, rtol=1e-6)
    lse = [torch.logsumexp(s[:, sl], -1, keepdim=True) for sl in (slice(0, 7), slice(7, 12))]
    o = [s[:, sl].softmax(-1) @ v[sl] for sl in (slice(0, 7), slice(7, 12))]
    torch.testing.assert_close(merge_lse(o[0], lse[0], o[1], lse[1]), ref, atol=1e-6, rtol=1e-6)


def _counting(kernel: CascadeAttention) -> dict:
    calls = {"cascade": 0}
    run = kernel._attend_torch

    def counted(*a):
        calls["cascade"] += 1
        return run(*a)

    kernel._attend_torch = counted
    return calls


MIXED = LONG + [[9, 8, 7, 6, 5, 4, 3, 2, 11, 12, 13, 14, 15, 16, 17, 18, 19]]  # prompt lengths 37, 16, 5, 50, 17


@pytest.mark.parametrize("kw", [{}, {"max_num_seqs": 7, "kv_cache_tokens": 160}], ids=["all_admitted", "preemption"])
def test_sampler_same_tokens_with_cascade_on_and_off(kw):
    """Mixed groups (prompt lengths 5-50, prompts with no full block), samples that stop early
    (stop token), under few slots and under preemption: same tokens, log-probs to fp32 rounding."""
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=9, stop_token_ids=[5])
    off = _sampler(block_size=8, cascade_attention=False, slot_regions=False, **kw).generate(MIXED, params)
    kernel = CascadeAttention(min_saved=16)
    calls = _counting(kernel)
    s = _sampler(block_size=8, decode_attention=kernel, **kw)
    on = s.generate(MIXED, params)
    assert not s.cache.contiguous and calls["cascade"] > 0  # paged for sharing, and cascade steps ran
    assert torch.equal(on.response_ids, off.response_ids) and torch.equal(on.response_lengths, off.response_lengths)
    torch.testing.assert_close(on.log_probs, off.log_probs, atol=1e-5, rtol=0)
    assert (on.response_lengths < 24).any()
    if "kv_cache_tokens" in kw:
        assert on.stats["preemptions"] > 0
    assert s.cache.num_free == s.cache.num_blocks and not any(s.cache.refs)


def test_sampler_same_tokens_with_parked_multi_turn_sequences():
    from tests.unit.test_sampler_turns import PARAMS as TURN_PARAMS, FakeTool

    ref = _sampler(block_size=8, cascade_attention=False).generate(LONG, TURN_PARAMS, turns=FakeTool(delay=3))
    for kw in ({}, {"kv_cache_tokens": 5 * 96}):
        kernel = CascadeAttention(min_saved=16)
        calls = _counting(kernel)
        out = _sampler(block_size=8, decode_attention=kernel, **kw).generate(LONG, TURN_PARAMS,
                                                                              turns=FakeTool(delay=3))
        assert calls["cascade"] > 0 and out.stats["turns"] > 0
        assert torch.equal(out.response_ids, ref.response_ids) and torch.equal(out.response_mask, ref.response_mask)
        torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)


def test_default_sampler_kernel_and_short_prompts_keep_slot_regions():
    s = _sampler()
    assert isinstance(s.decode_attention, CascadeAttention)
    s.generate(LONG, SamplingParams(n=4, temperature=1.0, max_new_tokens=4, seed=1))
    assert s.cache.contiguous  # (n - 1) x shared positions below the rule's 1536: today's layout and kernel
    assert isinstance(_sampler(cascade_attention=False).decode_attention, GatherAttention)


def flash_lse_reference(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal,
                        return_softmax_lse=False, softcap=0.0, window_size=(-1, -1)):
    """flash-attn's ``flash_attn_with_kvcache`` on a paged cache, written plainly, with its
    ``return_softmax_lse`` (``[B, H, Sq]`` fp32), ``softcap`` and left ``window_size``."""
    assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
    b, sq, h, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out, lse = torch.empty_like(q), torch.empty(b, h, sq)
    for i in range(b):
        n = int(cache_seqlens[i])
        blocks = block_table[i, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, dim=1)  # [n, H, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[i], k) * softmax_scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        qpos = (n - sq + torch.arange(sq))[:, None]
        keys = torch.arange(n)[None, :]
        if causal:
            s = s.masked_fill(keys > qpos, float("-inf"))
        if window_size[0] >= 0:
            s = s.masked_fill(keys < qpos - window_size[0], float("-inf"))
        lse[i] = torch.logsumexp(s, -1)
        out[i] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return (out, lse) if return_softmax_lse else out


@pytest.mark.parametrize("p", [LayerAttn(0.35, None, None, 0), LayerAttn(0.35, 2.0, None, 0),
                               LayerAttn(0.35, None, 7, 0)], ids=["plain", "softcap", "sliding_falls_back"])
def test_flash_path_calling_convention_equals_gather_reference(p):
    """Both parts through a reference of flash-attn's convention (prefix: the group's queries as
    query rows of the lead's block table, non-causal; suffix: each slot's own blocks; LSE merge)."""
    from rlhf.rollout.paged_attention import FlashPagedAttention

    c = _cache()
    pos = _mixed_groups(c)
    b, window = pos.shape[0], int(pos.max()) + 1
    kernel = CascadeAttention(FlashPagedAttention(fn=flash_lse_reference), fn=flash_lse_reference, min_saved=8)
    plan = kernel.plan(c, b, pos, window, torch.float32)
    ref_plan = GatherAttention().plan(c, b, pos, window, torch.float32)
    q = torch.randn(b, 2, 3, 8)
    torch.testing.assert_close(kernel.attend(c, 1, q, plan, p), GatherAttention().attend(c, 1, q, ref_plan, p),
                               atol=1e-6, rtol=1e-6)


def test_flash_base_without_lse_runs_cascade_steps_with_torch_ops():
    from rlhf.rollout.cascade_attention import decode_attention
    from rlhf.rollout.paged_attention import FlashPagedAttention
    from tests.unit.test_paged_attention import flash_with_kvcache_reference

    assert decode_attention("cpu", torch.float32, FlashPagedAttention(fn=flash_lse_reference)).fn is flash_lse_reference
    assert decode_attention("cpu", torch.float32, FlashPagedAttention(fn=flash_with_kvcache_reference)).fn is None
