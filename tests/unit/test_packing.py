"""Padding-free forward: unpad/repad, varlen attention, packed log-probs == padded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from rlhf.data.packing import repad, unpad
from rlhf.models.packed import packed_forward_hidden, packed_forward_log_probs
from rlhf.models.varlen_attention import (
    VARLEN_ATTN_IMPLEMENTATION,
    build_varlen_plan,
    register_varlen_attention,
    varlen_attention_enabled,
    varlen_attention_forward,
)

V = 64


def _tiny(family: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = dict(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "mistral_sw":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **common))
    else:
        raise ValueError(family)
    model.set_attn_implementation("sdpa")
    return model.float()


def _batch(prompt_lens, resp_lens, P=6, R=7, seed=1):
    """Left-padded prompts of length P, right-padded responses of length R."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    ids = torch.randint(1, V, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        mask[b, P - p : P + r] = 1
    ids = ids * mask  # pad id 0
    return ids, mask, R


def padded_reference(model, input_ids, attention_mask, *, response_length, temperature=1.0, compute_entropy=False):
    """The padded semantics the packed path must reproduce (written from the spec)."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False).logits
    R = response_length
    logits = logits[:, -R - 1 : -1].float() / temperature  # [B, R, V], position P+t-1
    logp = F.log_softmax(logits, -1).gather(-1, input_ids[:, -R:, None]).squeeze(-1)
    ent = None
    if compute_entropy:
        p = logits.softmax(-1)
        ent = -(p * F.log_softmax(logits, -1)).sum(-1)
    return logp, ent


def test_unpad_hand_example_and_round_trip():
    ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 1, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    p = unpad(ids, mask)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 1]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert p.cu_seqlens.tolist() == [0, 3, 6] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 3
    assert p.indices.tolist() == [1, 2, 3, 5, 6, 7]
    back = repad(p.input_ids[0], p, 2, 5)
    assert torch.equal(back, ids * mask)
    vals = torch.randn(6, 3)
    rp = repad(vals, p, 2, 5)
    assert rp.shape == (2, 5, 3) and torch.equal(rp.view(-1, 3)[p.indices], vals)
    assert torch.count_nonzero(rp[0, 0]) == 0


def test_varlen_attention_matches_per_sequence_sdpa_and_grad():
    torch.manual_seed(0)
    lens = [5, 1, 9, 8, 3]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T, H, Hkv, D = sum(lens), 4, 2, 8
    q = torch.randn(1, H, T, D, requires_grad=True)
    k = torch.randn(1, Hkv, T, D, requires_grad=True)
    v = torch.randn(1, Hkv, T, D, requires_grad=True)
    out, _ = varlen_attention_forward(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    ref = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kr = k[:, :, s:e].repeat_interleave(H // Hkv, dim=1)
        vr = v[:, :, s:e].repeat_interleave(H // Hkv, dim=1)
        ref.append(F.scaled_dot_product_attention(q[:, :, s:e], kr, vr, is_causal=True, scale=0.3))
    ref = torch.cat(ref, dim=2).transpose(1, 2)  # [1, T, H, D]
    assert out.shape == (1, T, H, D)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    w = torch.randn_like(out)
    g1 = torch.autograd.grad((out * w).sum(), (q, k, v))
    g2 = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_varlen_attention_never_builds_total_by_total(monkeypatch):
    """Every SDPA call sees at most the longest bucket, never the packed length."""
    lens = [40, 38, 35, 9, 8, 2]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = sum(lens)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        seen.append((q.shape[-2], k.shape[-2]))
        assert kw.get("attn_mask") is None or kw["attn_mask"].shape[-1] < T
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q = torch.randn(1, 2, T, 4)
    varlen_attention_forward(None, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert seen and max(max(s) for s in seen) == max(lens) < T
    plan = build_varlen_plan(cu, bucket_ratio=0.75)
    assert plan.shape == [(3, 40), (2, 9), (1, 2)]  # hand-derived buckets


def test_model_builds_no_mask_under_varlen(monkeypatch):
    """With our implementation the HF mask builder returns None (no [total, total] mask)."""
    model = _tiny("qwen2")
    seen_masks = []
    from transformers import AttentionInterface

    def spy(module, q, k, v, attention_mask, **kw):
        seen_masks.append(attention_mask)
        return varlen_attention_forward(module, q, k, v, attention_mask, **kw)

    register_varlen_attention()
    monkeypatch.setitem(AttentionInterface._global_mapping, VARLEN_ATTN_IMPLEMENTATION, spy)
    ids, mask, R = _batch([3, 6], [7, 2])
    packed_forward_log_probs(model, ids, mask, response_length=R)
    assert len(seen_masks) == 2 and all(m is None for m in seen_masks)
    # stays switched on, so a checkpointed backward recomputes with the same attention
    assert model.config._attn_implementation == VARLEN_ATTN_IMPLEMENTATION


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral_sw"])
def test_packed_log_probs_and_grads_equal_padded(family):
    model = _tiny(family)
    ids, mask, R = _batch([2, 6, 4, 1], [7, 3, 1, 5])
    weights = torch.randn(ids.shape[0], R)
    resp_mask = mask[:, -R:].float()

    lp_ref, ent_ref = padded_reference(model, ids, mask, response_length=R, temperature=0.7, compute_entropy=True)
    loss_ref = (lp_ref * weights * resp_mask).sum() + (ent_ref * resp_mask).sum()
    g_ref = torch.autograd.grad(loss_ref, list(model.parameters()))

    lp, ent = packed_forward_log_probs(model, ids, mask, response_length=R, temperature=0.7, compute_entropy=True)
    assert lp.shape == (4, R) and ent.shape == (4, R)
    torch.testing.assert_close(lp * resp_mask, lp_ref * resp_mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent * resp_mask, ent_ref * resp_mask, atol=1e-5, rtol=1e-5)
    assert torch.all(lp[resp_mask == 0] == 0)
    loss = (lp * weights * resp_mask).sum() + (ent * resp_mask).sum()
    g = torch.autograd.grad(loss, list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_packed_hidden_matches_padded_hidden():
    model = _tiny("qwen2")
    ids, mask, R = _batch([2, 5, 3], [7, 1, 4])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    h_ref = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[:, -R - 1 : -1]
    h = packed_forward_hidden(model, ids, mask, response_length=R)
    resp_mask = mask[:, -R:, None].float()
    assert h.shape == (3, R, 64)
    torch.testing.assert_close(h * resp_mask, h_ref * resp_mask, atol=1e-5, rtol=1e-5)
    h2 = packed_forward_hidden(model.model, ids, mask, response_length=R)  # bare backbone works too
    torch.testing.assert_close(h2, h)


@pytest.mark.parametrize("family", ["llama", "mistral_sw"])
def test_regular_calls_under_varlen_equal_sdpa(family):
    """Padded batches and KV-cache decoding behave exactly as sdpa under our implementation."""
    model = _tiny(family).eval()
    ids, mask, _ = _batch([2, 6, 4], [7, 3, 5])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    full = torch.randint(1, V, (2, 12))
    want_full = model(input_ids=full).logits  # unpadded, longer than the sliding window
    cache = model(input_ids=full[:, :11], use_cache=True).past_key_values
    want_step = model(input_ids=full[:, 11:], past_key_values=cache).logits
    with varlen_attention_enabled(model):
        assert model.config._attn_implementation == VARLEN_ATTN_IMPLEMENTATION
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        m = mask.bool()
        torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(input_ids=full).logits, want_full, atol=1e-5, rtol=1e-5)
        cache = model(input_ids=full[:, :11], use_cache=True).past_key_values
        step = model(input_ids=full[:, 11:], past_key_values=cache).logits
        torch.testing.assert_close(step, want_step, atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # restored


def test_packed_matches_project_padded_forward_log_probs():
    """Cross-check against the trainer's padded path (rlhf.models.logprobs) when present."""
    logprobs = pytest.importorskip("rlhf.models.logprobs")
    model = _tiny("qwen2")
    ids, mask, R = _batch([1, 6, 3], [7, 2, 5])
    want, want_ent = logprobs.forward_log_probs(model, ids, mask, response_length=R, temperature=1.3,
                                                compute_entropy=True)
    got, ent = packed_forward_log_probs(model, ids, mask, response_length=R, temperature=1.3, compute_entropy=True)
    m = mask[:, -R:].bool()
    torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[m], want_ent[m], atol=1e-5, rtol=1e-5)
