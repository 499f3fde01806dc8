"""Routed experts (rlhf.models.moe) against a per-token loop: grouped matmul, the per-expert fallback,
and experts split over tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf.models import moe


def _swiglu(g, u):
    return F.silu(g) * u


def _naive(x, top_i, top_w, gate_up, down):
    """sum_j w[m, j] * down_e(silu(gate_e x) * up_e x), token by token."""
    out = torch.zeros_like(x)
    i = gate_up.shape[1] // 2
    for m in range(x.shape[0]):
        for j in range(top_i.shape[1]):
            e = int(top_i[m, j])
            h = gate_up[e] @ x[m]
            out[m] += top_w[m, j] * (down[e] @ _swiglu(h[:i], h[i:]))
    return out


@pytest.mark.parametrize("hidden", [16, 10])  # 10 fp32 columns are not 16-byte aligned: per-expert fallback
def test_experts_equal_the_per_token_loop_and_sum_over_tp_ranks(hidden):
    g = torch.Generator().manual_seed(0)
    E, I, M, k = 6, 8, 9, 2
    x = torch.randn(M, hidden, generator=g)
    gate_up, down = torch.randn(E, 2 * I, hidden, generator=g), torch.randn(E, hidden, I, generator=g)
    spec = moe.MoESpec(num_experts=E, top_k=k, norm_topk_prob=True, intermediate_size=I, sparse=(True,))
    top_w, top_i = moe.route(spec, x, torch.randn(E, hidden, generator=g))
    torch.testing.assert_close(top_w.sum(-1), torch.ones(M))  # norm_topk_prob
    assert moe._grouped_mm_ok(x, gate_up) == (hidden == 16)
    ref = _naive(x, top_i, top_w, gate_up, down)
    torch.testing.assert_close(moe.experts(x, top_i, top_w, gate_up, down, _swiglu), ref, atol=1e-4, rtol=1e-5)
    # 3 "ranks" of 2 experts each: every assignment counted by exactly one rank
    parts = [moe.experts(x, top_i, top_w, gate_up[r * 2:(r + 1) * 2], down[r * 2:(r + 1) * 2], _swiglu,
                         expert_offset=2 * r) for r in range(3)]
    torch.testing.assert_close(sum(parts), ref, atol=1e-4, rtol=1e-5)
    assert all(p.isfinite().all() for p in parts)  # skipped rows never leak undefined values


def test_experts_gradients_equal_the_per_token_loop():
    g = torch.Generator().manual_seed(1)
    E, I, H, M, k = 4, 8, 16, 5, 2
    leaves = [torch.randn(M, H, generator=g), torch.rand(M, k, generator=g),
              torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)]
    top_i = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    grads = []
    for fn in (lambda x, w, gu, d: moe.experts(x, top_i, w, gu[2:], d[2:], _swiglu, expert_offset=2)
               + moe.experts(x, top_i, w, gu[:2], d[:2], _swiglu),
               lambda x, w, gu, d: _naive(x, top_i, w, gu, d)):
        ts = [t.clone().requires_grad_(True) for t in leaves]
        (fn(*ts) ** 2).sum().backward()
        grads.append([t.grad for t in ts])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype, device, cap, sizes, mode", [
    (torch.bfloat16, "cuda", (9, 0), (64, 128), "sync_free"),    # H100: the CUTLASS kernel
    (torch.bfloat16, "cuda", (10, 0), (64, 128), "sync_free"),   # B200
    (torch.float32, "cuda", (9, 0), (64, 128), "host_sync"),     # fp32 on H100: offsets copied to the host
    (torch.float16, "cuda", (9, 0), (64, 128), "host_sync"),
    (torch.bfloat16, "cuda", (8, 0), (64, 128), "host_sync"),    # A100: the fallback
    (torch.bfloat16, "cuda", (8, 9), (64, 128), "host_sync"),
    (torch.bfloat16, "cuda", (12, 0), (64, 128), "host_sync"),
    (torch.bfloat16, "cuda", (7, 5), (64, 128), "none"),         # below sm80: refused
    (torch.bfloat16, "cuda", (9, 0), (64, 12), "none"),          # 12 * 2 bytes: unaligned
    (torch.float32, "cpu", None, (16, 8), "sync_free"),
    (torch.float32, "cpu", None, (10, 8), "none"),
])
def test_grouped_mm_mode_is_a_pure_function_of_dtype_device_capability_sizes(dtype, device, cap, sizes, mode):
    assert moe.grouped_mm_mode(dtype, device, cap, sizes) == mode
    assert moe.grouped_mm_mode(dtype, device, cap, sizes, has_grouped_mm=False) == "none"


def test_experts_capturable_only_in_bf16_on_sm90_or_sm100():
    assert moe.experts_capturable(torch.bfloat16, "cuda", 64, 32, capability=(9, 0))
    assert not moe.experts_capturable(torch.float32, "cuda", 64, 32, capability=(9, 0))
    assert not moe.experts_capturable(torch.bfloat16, "cuda", 64, 32, capability=(8, 0))
    assert not moe.experts_capturable(torch.bfloat16, "cuda", 64, 4, capability=(9, 0))  # 2 * 4 bytes rows


def test_sampler_decodes_a_moe_model_eagerly_where_grouped_mm_is_not_capturable():
    from rlhf.models import decoder
    from rlhf.rollout.sampler import graph_blocker
    from tests._archs import tiny_model

    spec = decoder.DecoderSpec.from_config(tiny_model("qwen3_moe").config)
    assert graph_blocker(spec, torch.bfloat16, "cuda", (9, 0)) is None
    assert "bf16" in graph_blocker(spec, torch.float32, "cuda", (9, 0))
    assert graph_blocker(spec, torch.bfloat16, "cuda", (8, 0)) is not None
    dense = decoder.DecoderSpec.from_config(tiny_model("gemma2").config)
    assert graph_blocker(dense, torch.float32, "cuda", (8, 0)) is None
