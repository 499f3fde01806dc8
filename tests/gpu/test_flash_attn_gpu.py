"""flash-attn varlen (the padding-free path on GPU) against per-sequence SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf.models.varlen_attention import flash_attn_available, varlen_attention_forward
from tests.gpu._gpu import GPU

pytestmark = GPU + [pytest.mark.skipif(not flash_attn_available(), reason="flash-attn not installed")]


def test_flash_varlen_forward_backward_matches_sdpa():
    torch.manual_seed(0)
    H, Hkv, D = 8, 2, 64
    lens = [37, 5, 128, 64, 1]
    total = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(1, H, total, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, Hkv, total, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, Hkv, total, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, _ = varlen_attention_forward(None, q, k, v, None, scaling=D ** -0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                      max_length_q=max(lens), max_length_k=max(lens))
    # reference: fp32 SDPA per sequence, GQA heads repeated
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kk = kf[:, :, s:e].repeat_interleave(H // Hkv, 1)
        vv = vf[:, :, s:e].repeat_interleave(H // Hkv, 1)
        ref.append(F.scaled_dot_product_attention(qf[:, :, s:e], kk, vv, is_causal=True).transpose(1, 2))
    ref = torch.cat(ref, 1)  # [1, total, H, D]
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(ref)
    (out.float() * g).sum().backward()
    (ref * g).sum().backward()
    for a, b in ((q, qf), (k, kf), (v, vf)):
        torch.testing.assert_close(a.grad.float(), b.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("window", [(-1, -1), (7, 0)])
def test_cpu_reference_kernel_has_flash_attn_semantics(window):
    """The CPU tests drive the flash-attn code path with reference_varlen_attention
    (tests/unit/test_varlen_kernel.py); here it must agree with the real kernel."""
    from flash_attn import flash_attn_varlen_func

    from rlhf.models.varlen_attention import reference_varlen_attention

    torch.manual_seed(1)
    lens = [9, 1, 33, 16]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True,
              window_size=window, softmax_scale=64 ** -0.5)
    ref = reference_varlen_attention(q.float(), k.float(), v.float(), **kw)
    torch.testing.assert_close(flash_attn_varlen_func(q, k, v, **kw).float(), ref, atol=2e-2, rtol=2e-2)
