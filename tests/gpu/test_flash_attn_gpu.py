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
