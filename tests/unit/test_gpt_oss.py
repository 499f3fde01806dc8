"""GPT-OSS (rlhf/models/gpt_oss.py): every decode kernel applies the attention sinks exactly (gather, flash-attn's
paged convention, both cascade paths, against a plain reference); the routed experts (transposed, interleaved,
biased, clamped SwiGLU) equal HF's forward and gradients also split over simulated tp ranks; and the sinks, the
clamp and the biases each change HF's logits by far more than the arch tests' tolerances, so those tests
(test_sampler_archs / test_trainer_archs / test_sampler, parametrised on tests/_archs.py) would catch any of
them dropped. Checkpoint load / export: test_moe_archs.py; tp2 / ep2 GRPO steps: tests/dist/test_grpo_archs.py."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.arch import LayerAttn
from rlhf.rollout.cascade_attention import CascadeAttention
from rlhf.rollout.paged_attention import FlashPagedAttention, GatherAttention
from tests._archs import tiny_model
from tests.unit.test_cascade_attention import _cache, _mixed_groups, flash_lse_reference


def _reference(c, layer, q, pos, p):
    """Plain per-slot sink attention: softmax over [q k * scale (masked), sink_h], the sink column dropped."""
    b, hkv, g, d = q.shape
    k, v = c.view(layer, torch.arange(b), int(pos.max()) + 1)  # [B, Hkv, W, D]
    s = torch.einsum("bkgd,bkwd->bkgw", q, k) * p.scale
    keys = torch.arange(k.shape[2])
    hidden = keys[None, :] > pos[:, None]
    if p.window is not None:
        hidden |= keys[None, :] <= pos[:, None] - p.window
    s = s.masked_fill(hidden[:, None, None, :], float("-inf"))
    sink = p.sinks.view(1, hkv, g, 1).expand(b, hkv, g, 1)
    probs = torch.cat((s, sink), -1).softmax(-1)[..., :-1]
    return torch.einsum("bkgw,bkwd->bkgd", probs, v)


@pytest.mark.parametrize("window", [None, 7], ids=["full", "sliding7"])
def test_every_decode_kernel_applies_the_sinks_exactly(window):
    torch.manual_seed(1)
    c = _cache()
    pos = _mixed_groups(c)
    b, w = pos.shape[0], int(pos.max()) + 1
    p = LayerAttn(0.35, None, window, 0, sinks=torch.randn(6) * 2)
    q = torch.randn(b, 2, 3, 8)
    ref = _reference(c, 1, q, pos, p)
    plain = _reference(c, 1, q, pos, LayerAttn(0.35, None, window, 0, sinks=torch.full((6,), -1e4)))
    assert (ref - plain).abs().max() > 0.05  # the sinks matter at these sizes
    flash = FlashPagedAttention(fn=flash_lse_reference)
    kernels = {"gather": GatherAttention(), "flash_paged": flash, "cascade_torch": CascadeAttention(min_saved=8),
               "cascade_flash": CascadeAttention(flash, fn=flash_lse_reference, min_saved=8)}
    for name, kernel in kernels.items():
        out = kernel.attend(c, 1, q, kernel.plan(c, b, pos, w, torch.float32), p)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6, msg=name)


def test_experts_equal_hf_forward_and_gradients_over_simulated_tp_ranks():
    from rlhf.models.gpt_oss import clamped_swiglu, experts_args
    from rlhf.models.moe import MoESpec, experts, route

    model = tiny_model("gpt_oss")
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 10, 64)
    want, _ = mlp(x)
    want.square().sum().backward()
    hf_grads = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad()
    spec = MoESpec.from_config(model.config)
    top_w, top_i = route(spec, x[0], mlp.router.weight, mlp.router.bias)
    _, hf_w, hf_i = mlp.router(x[0])
    assert torch.equal(top_i, hf_i) and torch.allclose(top_w, hf_w, atol=1e-6)
    e = mlp.experts
    got = experts(x[0], top_i, top_w, **experts_args(e, e.gate_up_proj, e.down_proj))  # one rank, all experts
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    for n, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[n], atol=1e-5, rtol=1e-4, msg=n)
    parts = []  # 2 tp ranks of 4 whole experts each (their biases with them): the partial sums add up
    with torch.no_grad():
        for r in range(2):
            sl = slice(4 * r, 4 * r + 4)
            parts.append(experts(x[0], top_i, top_w, e.gate_up_proj[sl].transpose(1, 2), e.down_proj[sl].transpose(1, 2),
                                 lambda g, u: clamped_swiglu(g, u, e.alpha, e.limit), 4 * r,
                                 gate_up_b=e.gate_up_proj_bias[sl], down_b=e.down_proj_bias[sl], interleaved=True))
    torch.testing.assert_close(parts[0] + parts[1], want[0].detach(), atol=1e-5, rtol=1e-5)


def test_sinks_clamp_and_biases_each_change_hf_logits():
    ids = torch.randint(2, 64, (2, 12))
    m = tiny_model("gpt_oss")
    with torch.no_grad():
        base = m(ids).logits
        for layer in m.model.layers:
            layer.mlp.experts.limit = 50.0
        changed = {"limit": m(ids).logits}
        for layer in m.model.layers:
            layer.mlp.experts.limit = m.config.swiglu_limit
        for what in ("sinks", "gate_up_proj_bias", "down_proj_bias", "router.bias", "o_proj.bias"):
            saved = {n: p.clone() for n, p in m.named_parameters() if n.endswith(what)}
            for n, p in m.named_parameters():
                if n in saved:
                    p.fill_(-1e4 if what == "sinks" else 0.0)
            changed[what] = m(ids).logits
            for n, p in m.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
    for what, logits in changed.items():
        assert (logits - base).abs().max() > 1e-3, what  # the arch tests compare at 1e-4 / 1e-5


class _LargestAlloc(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any op returns (elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("mask", ["causal", "sliding", "padded-bool", "additive"])
def test_sink_sdpa_equals_the_explicit_sink_attention_without_its_scores(mask):
    """The trainer's sink attention (one more SDPA key per head) equals the explicit softmax over
    [scores, sink] in output and in the gradients of q, k, v and the sinks, on GQA heads; and it never
    holds a [B, H, T, T] score tensor (the explicit path's, ~GiBs per layer at GPT-OSS's lengths)."""
    from rlhf.models.softcap_attention import attention, sink_sdpa

    torch.manual_seed(0)
    B, H, Hkv, T, D = 2, 8, 2, 192, 16
    q, k, v = (torch.randn(B, h, T, D, requires_grad=True) for h in (H, Hkv, Hkv))
    sinks = torch.randn(H, requires_grad=True)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ref_mask, mask_arg = causal, None
    if mask == "sliding":
        ref_mask = mask_arg = causal & ~torch.ones(T, T, dtype=torch.bool).tril(-7)
    elif mask == "padded-bool":  # row 0 left-padded by 5 (a pad query attends itself)
        ref_mask = causal.expand(B, 1, T, T).clone()
        ref_mask[0, :, :, :5] = False
        ref_mask[0, :, :5, :] = torch.eye(5, T, dtype=torch.bool)
        mask_arg = ref_mask
    elif mask == "additive":
        ref_mask = mask_arg = torch.zeros(B, 1, T, T).masked_fill(~causal, torch.finfo(torch.float32).min)
    want = attention(q, k, v, ref_mask, scale=D ** -0.5, softcap=None, sinks=sinks)
    with _LargestAlloc() as seen:
        got = sink_sdpa(q, k, v, mask_arg, scale=D ** -0.5, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v, sinks)),
                    torch.autograd.grad(want.square().sum(), (q, k, v, sinks))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert seen.largest < B * H * T * T // 4, seen.largest
