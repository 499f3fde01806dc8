"""torch's own attention kernels (varlen_attn, paged varlen_attn, compiled flex) on a GPU against the plain-torch
references the CPU tests use: the check that the references read torch's semantics right (window alignment,
the LSE layout, the block table)."""

from __future__ import annotations

import pytest
import torch

from rlhf.models import attention_backend
from rlhf.models.torch_attention import (FlexVarlen, TorchKVCache, TorchVarlen, reference_torch_varlen_attn)
from rlhf.models.varlen_attention import reference_varlen_attention
from tests.gpu._gpu import GPU

_SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
pytestmark = GPU + [pytest.mark.skipif(not _SM80, reason="torch's varlen_attn needs sm80+")]

LENS = [37, 5, 300, 64, 1]


def _packed(h=8, hkv=2, d=64, dtype=torch.bfloat16, grad=True):
    torch.manual_seed(0)
    total = sum(LENS)
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, n, d, device="cuda", dtype=dtype, requires_grad=grad) for n in (h, hkv, hkv))
    return q, k, v, cu


@pytest.mark.parametrize("window", [(-1, -1), (31, 0)], ids=["causal", "sliding32"])
@pytest.mark.parametrize("kind", ["torch_varlen", "flex"])
def test_packed_kernels_forward_backward_match_the_reference(kind, window):
    q, k, v, cu = _packed()
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(LENS), max_seqlen_k=max(LENS), softmax_scale=0.125,
              causal=True, window_size=window)
    fn = TorchVarlen() if kind == "torch_varlen" else FlexVarlen()
    out = fn(q, k, v, **kw)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference_varlen_attention(qf, kf, vf, **kw)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(ref)
    (out.float() * g).sum().backward()
    (ref * g).sum().backward()
    for a, b in ((q, qf), (k, kf), (v, vf)):
        torch.testing.assert_close(a.grad.float(), b.grad, atol=5e-2, rtol=5e-2)


def test_flex_softcap_matches_the_reference():
    q, k, v, cu = _packed(grad=False)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(LENS), max_seqlen_k=max(LENS), softmax_scale=0.125,
              causal=True)
    out = FlexVarlen()(q, k, v, softcap=5.0, **kw)
    ref = reference_varlen_attention(q.float(), k.float(), v.float(), softcap=5.0, **kw)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_paged_kernel_and_its_lse_match_the_reference():
    """varlen_attn over a block table of 256-position pages (the sampler's block multiple), decode and a
    multi-query (cascade prefix) call, with the LSE in flash-attn's [B, H, Sq] layout."""
    torch.manual_seed(0)
    b, h, hkv, d, bs = 4, 8, 2, 64, 256
    pool_k = torch.randn(12, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    table = torch.tensor([[3, 7, 0], [1, 0, 0], [5, 2, 9], [11, 4, 0]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([300, 17, 700, 512], dtype=torch.int32, device="cuda")
    fn = TorchKVCache()
    for sq, causal in ((1, True), (3, False)):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        out, lse = fn(q, pool_k, pool_v, cache_seqlens=lens, block_table=table, softmax_scale=0.125, causal=causal,
                      return_softmax_lse=True)
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda")
        ref, ref_lse = reference_torch_varlen_attn(
            q.reshape(b * sq, h, d).float(), pool_k.float(), pool_v.float(), cu_q, None, sq, 768,
            return_aux=type("A", (), {"lse": True})(), scale=0.125, window_size=(-1, 0) if causal else (-1, -1),
            enable_gqa=True, seqused_k=lens, block_table=table)
        torch.testing.assert_close(out.float(), ref.view(b, sq, h, d), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.float(), ref_lse.view(h, b, sq).permute(1, 0, 2), atol=2e-2, rtol=2e-2)


def test_rule_picks_torch_kernels_on_this_gpu():
    cap = attention_backend.probe("cuda", torch.bfloat16, flash_attn=False)
    assert attention_backend.choose("packed", cap) == "torch_varlen"
    assert attention_backend.choose("decode", cap) == "torch_varlen"


@torch.no_grad()
def test_torch_paged_decode_kernel_matches_the_gather_kernel():
    """The sampler's decode kernel without flash-attn (FlashPagedAttention over TorchKVCache) against the gather
    reference on one cache: blocks in random order, uneven lengths, GQA, a sliding window, GPT-OSS sinks."""
    from rlhf.models.arch import LayerAttn
    from rlhf.rollout.kv_cache import PagedKVCache
    from rlhf.rollout.paged_attention import FlashPagedAttention, GatherAttention

    torch.manual_seed(0)
    b, hkv, g, d, blocks = 8, 2, 4, 64, 4
    cache = PagedKVCache(1, 64, b, hkv, blocks * 256, d, block_size=256, dtype=torch.bfloat16,
                         device=torch.device("cuda"))
    cache.start(contiguous=False)
    cache.kv.normal_()
    cache.table.copy_(torch.randperm(64, device="cuda")[: b * blocks].view(b, blocks))
    pos = torch.randint(0, blocks * 256, (b,), device="cuda")
    q = torch.randn(b, hkv, g, d, device="cuda", dtype=torch.bfloat16)
    window = int(pos.max()) + 1
    sinks = torch.randn(hkv * g, device="cuda")
    torch_kernel = FlashPagedAttention(fn=TorchKVCache())
    for layer in (LayerAttn(d**-0.5, None, None, 0), LayerAttn(d**-0.5, None, 100, 0),
                  LayerAttn(d**-0.5, None, None, 0, sinks)):
        out = [k.attend(cache, 0, q, k.plan(cache, b, pos, window, q.dtype), layer)
               for k in (GatherAttention(), torch_kernel)]
        torch.testing.assert_close(out[1].float(), out[0].float(), atol=2e-2, rtol=2e-2)
