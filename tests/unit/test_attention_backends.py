"""Every attention backend's path equals the reference on CPU, through the injection seams, and the rule that
picks them (rlhf.models.attention_backend) on fake capabilities.

torch's ``varlen_attn`` runs only on CUDA; here its adapters (rlhf.models.torch_attention) run against
``reference_torch_varlen_attn``, a plain-torch reading of its documented semantics (packed and paged forms, the
window, the ``[H, Tq]`` LSE). FlexAttention runs eagerly on CPU (forward only), and with a dense reference for
the backward.
"""

from __future__ import annotations

import pytest
import torch

import rlhf.models.attention_backend as ab
import rlhf.models.varlen_attention as va
from rlhf.models.arch import LayerAttn
from rlhf.models.packed import packed_forward_log_probs
from rlhf.models.torch_attention import (FlexVarlen, TorchKVCache, TorchVarlen, reference_flex_attention,
                                         reference_torch_varlen_attn)
from rlhf.rollout.cascade_attention import CascadeAttention
from rlhf.rollout.paged_attention import FlashPagedAttention, GatherAttention
from tests.unit.test_cascade_attention import _cache, _mixed_groups
from tests.unit.test_packing import _batch, _tiny, padded_reference

H100 = dict(device_type="cuda", sm=(9, 0), torch_varlen=True, flex=True)


def _cap(**kw) -> ab.Capability:
    base = dict(device_type="cpu", dtype=torch.bfloat16, sm=None, flash_attn=False, torch_varlen=True, flex=True)
    return ab.Capability(**{**base, **kw})


# --- the rule ---------------------------------------------------------------------------------------------------

def test_order_flash_then_torch_varlen_then_flex_then_reference():
    assert ab.choices(_cap(**H100, flash_attn=True)) == {
        "packed": "flash_attn", "prefix_grouped": "flash_attn", "prefill": "sdpa", "cascade_prefix": "flash_attn",
        "decode": "flash_attn"}
    assert ab.choices(_cap(**H100)) == {
        "packed": "torch_varlen", "prefix_grouped": "torch_varlen", "prefill": "sdpa",
        "cascade_prefix": "torch_varlen", "decode": "torch_varlen"}
    # pre-Ampere, or fp32: varlen_attn does not run; training takes compiled flex, decode the gather kernel
    for cap in (_cap(**{**H100, "sm": (7, 5)}), _cap(**H100 | {"dtype": torch.float32})):
        assert ab.choose("packed", cap) == "flex" and ab.choose("decode", cap) == "reference"
    # an older torch without varlen_attn and without triton: today's paths
    assert set(ab.choices(_cap(**{**H100, "torch_varlen": False, "flex": False})).values()) == {"reference", "sdpa"}
    assert set(ab.choices(_cap()).values()) == {"reference", "sdpa"}  # CPU: always the reference


def test_softcap_sinks_and_dropout_go_where_exact():
    cap = _cap(**H100)
    # Gemma 2: varlen_attn has no soft-cap; flex's score_mod has; flash-attn has (>= 2.6)
    assert ab.choose("packed", cap, softcap=True) == "flex"
    assert ab.choose("decode", cap, softcap=True) == "reference"
    assert ab.choose("packed", _cap(**H100, flash_attn=True), softcap=True) == "flash_attn"
    # GPT-OSS: training needs the LSE's gradient (no kernel returns it) -> reference; decode rescales by the LSE
    assert ab.choose("packed", _cap(**H100, flash_attn=True), sinks=True) == "reference"
    assert ab.choose("prefix_grouped", cap, sinks=True) == "reference"
    assert ab.choose("decode", cap, sinks=True) == "torch_varlen"
    assert ab.choose("cascade_prefix", cap, sinks=True) == "torch_varlen"
    # attention dropout: only flash-attn and the reference take it
    assert ab.choose("packed", cap, dropout=True) == "reference"
    assert ab.choose("packed", _cap(**H100, flash_attn=True), dropout=True) == "flash_attn"
    with pytest.raises(ValueError, match="unknown attention call site"):
        ab.choose("sampler", cap)


def test_startup_line_metric_codes_and_cascade_rule(capsys, monkeypatch):
    picked = ab.choices(_cap(**H100))
    line = ab.startup_line(_cap(**H100), picked)
    assert "packed=torch_varlen" in line and "decode=torch_varlen" in line
    assert "sm90" in line and "flash-attn no" in line
    assert ab.backend_metrics(picked) == {"perf/attn_backend": 2.0, "perf/attn_backend_decode": 2.0}
    assert ab.backend_metrics(ab.choices(_cap())) == {"perf/attn_backend": 0.0, "perf/attn_backend_decode": 0.0}
    monkeypatch.setattr(ab, "_LOGGED", set())
    ab.log_choices("cpu", torch.float32)
    ab.log_choices("cpu", torch.float32)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("[rlhf] attention kernels: packed=reference")
    assert ab.cascade_auto("cpu", "gather", False) and not ab.cascade_auto("cpu", "gather", True)
    assert not ab.cascade_auto("cuda", "torch_varlen_paged", False)


def test_call_sites_take_the_chosen_kernel(monkeypatch):
    """What the rule says is what runs: the packed site's flash-convention function and the decode kernel."""
    from rlhf.rollout import paged_attention as pa

    monkeypatch.setattr(ab, "probe", lambda device, dtype=None, flash_attn=None: _cap(**H100, dtype=dtype))
    monkeypatch.setattr(va, "_KERNELS", {})
    cuda = torch.device("cuda")
    assert isinstance(va.varlen_kernel(cuda, torch.bfloat16), TorchVarlen)
    assert isinstance(va.varlen_kernel(cuda, torch.bfloat16, softcap=True), FlexVarlen)
    assert va.varlen_kernel(cuda, torch.bfloat16, dropout=True) is None  # bucketed SDPA
    kernel = pa.decode_attention(cuda, torch.bfloat16)
    assert isinstance(kernel, FlashPagedAttention) and kernel.name == "torch_varlen_paged"
    assert kernel.block_multiple == 256 and kernel.graph_key(64, False) == kernel.graph_key(4096, False)
    with pytest.warns(UserWarning, match="logit soft-cap"):
        assert isinstance(pa.decode_attention(cuda, torch.bfloat16, softcap=True), GatherAttention)
    assert isinstance(pa.decode_attention(torch.device("cpu"), torch.bfloat16), GatherAttention)


# --- packed forward and backward ---------------------------------------------------------------------------------

def _packed_grads(model, ids, mask, R, weights, **kw):
    lp, _ = packed_forward_log_probs(model, ids, mask, response_length=R, **kw)
    resp = mask[:, -R:].float()
    return lp * resp, torch.autograd.grad((lp * weights * resp).sum(), list(model.parameters()))


@pytest.mark.parametrize("family", ["qwen2", "mistral_sw"])
@pytest.mark.parametrize("kernel", ["torch_varlen", "flex"])
def test_packed_forward_and_backward_equal_the_reference(family, kernel, monkeypatch):
    """torch's varlen kernel and flex, each behind flash-attn's convention, drive the packed pass (causal inside
    each sequence, GQA, the sliding window): log-probs and gradients equal the padded model's."""
    model = _tiny(family)
    ids, mask, R = _batch([2, 6, 4, 1], [7, 3, 1, 5])
    weights = torch.randn(ids.shape[0], R)
    lp_pad, _ = padded_reference(model, ids, mask, response_length=R)
    resp = mask[:, -R:].float()
    g_ref = torch.autograd.grad((lp_pad * weights * resp).sum(), list(model.parameters()))
    fn = TorchVarlen(fn=reference_torch_varlen_attn) if kernel == "torch_varlen" else \
        FlexVarlen(fn=reference_flex_attention)
    monkeypatch.setattr(va, "_bucketed_sdpa", lambda *a, **k: pytest.fail("the SDPA path ran"))
    import torch.nn.attention.flex_attention as flex_module

    masks = []
    real_mask = flex_module.create_block_mask
    monkeypatch.setattr(flex_module, "create_block_mask", lambda *a, **k: masks.append(1) or real_mask(*a, **k))
    with va.use_varlen_kernel(fn):
        lp, g = _packed_grads(model, ids, mask, R, weights)
    assert len(masks) == (1 if kernel == "flex" else 0)  # one document mask per forward, shared by the layers
    torch.testing.assert_close(lp, lp_pad * resp, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_real_flex_kernel_and_softcap_forward_on_cpu():
    """torch's own flex_attention (eager on CPU) behind the adapter: the document mask, bottom-right alignment
    (queries shorter than keys, as the prefix-grouped responses), the window and the soft-cap."""
    torch.manual_seed(0)
    cu_q = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 12, 16], dtype=torch.int32)
    q, k, v = torch.randn(9, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    for win, cap in (((-1, -1), None), ((2, 0), 3.0)):
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=7, softmax_scale=0.3,
                  causal=True, window_size=win)
        ref = va.reference_varlen_attention(q, k, v, **kw, softcap=cap or 0.0)
        torch.testing.assert_close(FlexVarlen()(q, k, v, **kw, softcap=cap), ref, atol=1e-5, rtol=1e-5)


def test_prefix_grouped_pass_through_torch_varlen_equals_the_plain_packed_pass():
    model = _tiny("qwen2")
    P = 6
    prompt = torch.randint(5, 60, (2, P))
    ids = torch.cat([prompt.repeat_interleave(3, 0), torch.randint(5, 60, (6, 5))], 1)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[4, 7:] = 0
    weights = torch.randn(6, 5)
    lp_ref, g_ref = _packed_grads(model, ids, mask, 5, weights)
    shapes = []

    def counted(q, k, v, cu_q, cu_k, *a, **kw):  # the responses' call: fewer queries than keys
        shapes.append((q.shape[0], k.shape[0]))
        return reference_torch_varlen_attn(q, k, v, cu_q, cu_k, *a, **kw)

    with va.use_varlen_kernel(TorchVarlen(fn=counted)):
        lp, g = _packed_grads(model, ids, mask, 5, weights, prefix_grouping=True)
    assert any(tq < tk for tq, tk in shapes) and int(mask.sum()) not in [tq for tq, _ in shapes]
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# --- decode over the paged cache, and the cascade's LSE merge ----------------------------------------------------

SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])
LAYERS = [LayerAttn(0.35, None, None, 0), LayerAttn(0.35, None, 7, 0), LayerAttn(0.35, None, None, 0, SINKS)]


@pytest.mark.parametrize("p", LAYERS, ids=["plain", "sliding", "sinks"])
def test_torch_paged_decode_and_cascade_equal_the_gather_reference(p):
    """Decode over the block table through ``varlen_attn(block_table=, seqused_k=)``'s convention, alone and as
    both parts of the cascade (prefix once per group, suffix per slot, merged by the LSE), = the gather kernel."""
    c = _cache()
    pos = _mixed_groups(c)
    b, window = pos.shape[0], int(pos.max()) + 1
    fn = TorchKVCache(fn=reference_torch_varlen_attn)
    q = torch.randn(b, 2, 3, 8)
    ref = GatherAttention().attend(c, 1, q, GatherAttention().plan(c, b, pos, window, torch.float32), p)
    base = FlashPagedAttention(fn=fn)
    out = base.attend(c, 1, q, base.plan(c, b, pos, window, torch.float32), p)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    cascade = CascadeAttention(base, fn=fn, min_saved=8)
    plan = cascade.plan(c, b, pos, window, torch.float32)
    torch.testing.assert_close(cascade.attend(c, 1, q, plan, p), ref, atol=1e-6, rtol=1e-6)


def test_cascade_wraps_the_torch_kernel_with_its_lse():
    from rlhf.rollout.cascade_attention import decode_attention

    fn = TorchKVCache(fn=reference_torch_varlen_attn)
    assert decode_attention("cpu", torch.float32, FlashPagedAttention(fn=fn)).fn is fn


def test_sampler_decodes_the_same_tokens_through_the_torch_paged_kernel():
    from rlhf.rollout import SamplingParams
    from tests.unit.test_sampler import PROMPTS, _sampler

    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4, stop_token_ids=[1, 2, 3, 4, 6])
    ref = _sampler(max_num_seqs=4).generate(PROMPTS, params)
    s = _sampler(max_num_seqs=4, decode_attention=FlashPagedAttention(fn=TorchKVCache(fn=reference_torch_varlen_attn)))
    out = s.generate(PROMPTS, params)
    assert s.block_size == 256
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)


def test_reference_paged_and_packed_forms_agree_and_give_the_lse():
    """The reference itself: a paged cache read through the block table = the same keys packed; its LSE."""
    torch.manual_seed(1)
    lens = [5, 11]
    k, v = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    q = torch.randn(2, 4, 8)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 16], dtype=torch.int32)
    packed, lse = reference_torch_varlen_attn(q, k, v, cu_q, cu_k, 1, 11, return_aux=ab_aux(), window_size=(-1, 0),
                                              enable_gqa=True)
    pages = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    table = torch.tensor([[3, 0, 0], [5, 1, 2]], dtype=torch.int32)
    for x, pool in zip((k, v), pages):
        pool[3, :4], pool[0, :1] = x[0:4], x[4:5]
        pool[5], pool[1], pool[2, :3] = x[5:9], x[9:13], x[13:16]
    paged = reference_torch_varlen_attn(q, *pages, cu_q, cu_k, 1, 12, window_size=(-1, 0), enable_gqa=True,
                                        seqused_k=torch.tensor(lens, dtype=torch.int32), block_table=table)
    torch.testing.assert_close(paged, packed)
    s = torch.einsum("bhd,khd->hbk", q[1:], k[5:].repeat_interleave(2, 1)) * 8 ** -0.5
    torch.testing.assert_close(lse[:, 1], torch.logsumexp(s[:, 0], -1))


def ab_aux():
    from rlhf.models.torch_attention import _aux

    return _aux()
