"""The fused CPU decode attention (rlhf.rollout.cpu_attention) equals the torch-ops kernels to fp32 rounding:
on plain and aligned slot regions, with the groups' prompt read from their lead, sliding windows, GPT-OSS sinks,
head sizes on and off the compiled list, G from 1 to 7 and two threads; through the sampler the tokens are the
torch-ops kernels' (GRPO groups, stops and refills, Gemma 2's soft-capped fallback, GPT-OSS); without a compiler
the sampler falls back to the torch ops and says so."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.arch import LayerAttn
from rlhf.rollout import SamplingParams, cpu_attention
from rlhf.rollout.cascade_attention import CascadeAttention
from rlhf.rollout.kv_cache import PagedKVCache
from rlhf.rollout.paged_attention import GatherAttention, decode_attention
from rlhf.rollout.region_cascade import FusedRegionPlan
from tests.unit.test_cascade_attention import MIXED
from tests.unit.test_sampler import _sampler

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler: the fused kernel is not built")


def _counting(monkeypatch) -> dict:
    calls = {"plain": 0, "shared": 0, "paged": 0}
    run, run_paged = cpu_attention.region_decode_attention, cpu_attention.paged_decode_attention

    def counted(q, k, v, lead, first, last, pm, *a, **kw):
        calls["shared" if pm else "plain"] += 1
        return run(q, k, v, lead, first, last, pm, *a, **kw)

    def counted_paged(*a, **kw):
        calls["paged"] += 1
        return run_paged(*a, **kw)

    monkeypatch.setattr(cpu_attention, "region_decode_attention", counted)
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", counted_paged)
    return calls


def _regions_cache(d: int, slots: int = 6, prefix_cols: int = 0) -> PagedKVCache:
    c = PagedKVCache(2, 400, slots, 2, 40, d, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    c.start(contiguous=True, prefix_cols=prefix_cols)
    return c


@pytest.mark.parametrize("d", [8, 16, 24, 64])
@pytest.mark.parametrize("g", [1, 2, 3, 7])
@pytest.mark.parametrize("extra", ["plain", "sliding5", "sinks", "threads2"])
def test_kernel_equals_the_torch_ops_on_slot_regions(d, g, extra, monkeypatch):
    """Six slots at columns 0 to 37 (one column, a block edge, past 8- and 32-column tiles); d = 24 runs the
    generic (not compiled-in) head size. Against a float64 evaluation of the torch ops the fused kernel's error
    is fp32 rounding (max 8e-7 here, 4e-6 allowed: another CPU's MKL sums in another order), and it is within
    5e-6 of the fp32 torch ops (unit-normal inputs: 64-term dot products put the two up to ~2e-6 apart)."""
    torch.manual_seed(d * 10 + g)
    c = _regions_cache(d)
    c.regions().normal_()
    pos = torch.tensor([0, 3, 7, 8, 21, 37])
    w = int(pos.max()) + 1
    sinks = torch.randn(2 * g) * 2 if extra == "sinks" else None
    p = LayerAttn(0.3, None, 5 if extra == "sliding5" else None, 0, sinks=sinks)
    if extra == "threads2":
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the kernel's OpenMP split
    c64 = PagedKVCache(2, 400, 6, 2, 40, d, block_size=4, dtype=torch.float64, device=torch.device("cpu"))
    c64.start(contiguous=True)
    c64.regions().copy_(c.regions())
    p64 = LayerAttn(0.3, None, p.window, 0, sinks=None if sinks is None else sinks.double())
    ref_kernel, fused = GatherAttention(), GatherAttention(fused=True)
    calls = _counting(monkeypatch)
    for layer in range(2):
        q = torch.randn(6, 2, g, d)
        exact = ref_kernel.attend(c64, layer, q.double(), ref_kernel.plan(c64, 6, pos, w, torch.float64), p64)
        ref = ref_kernel.attend(c, layer, q, ref_kernel.plan(c, 6, pos, w, torch.float32), p)
        out = fused.attend(c, layer, q, fused.plan(c, 6, pos, w, torch.float32), p)
        torch.testing.assert_close(out, ref, atol=5e-6, rtol=1e-5)
        torch.testing.assert_close(out.double(), exact, atol=4e-6, rtol=0)  # ~30 ulp at |out| ~ 1: rounding only
    assert calls["plain"] == 2


@pytest.mark.parametrize("order", ["runs", "mixed"])
def test_kernel_reads_each_groups_prompt_from_its_lead(order):
    """Aligned regions (prompts 5, 9, 2, 7 tokens, Pm = 9, left-padded prompts hidden), groups as runs or
    interleaved, slots at different columns: equal to the gather kernel over each slot's own region. The
    members' own prompt columns are then overwritten: the kernel must not read them."""
    torch.manual_seed(0)
    c = _regions_cache(16, slots=8, prefix_cols=9)
    groups = [0, 0, 1, 1, 2, 2, 3, 3] if order == "runs" else [0, 1, 2, 3, 0, 2, 1, 3]
    lens = {0: 5, 1: 9, 2: 2, 3: 7}
    c.align(list(range(8)), [lens[g] for g in groups], groups)
    regions = c.regions()
    regions.normal_()
    leads = {}
    for g in range(4):
        members = [s for s in range(8) if groups[s] == g]
        leads[g] = members[0]
        regions[:, :, members, :, :9] = regions[:, :, members[:1], :, :9]
    pos = torch.tensor([lens[g] for g in groups]) + torch.tensor([6, 4, 6, 1, 6, 3, 6, 0])
    window = int((pos + c.shift[:8]).max()) + 1
    ref_kernel, kernel = GatherAttention(), CascadeAttention(GatherAttention(fused=True))
    plan = kernel.plan(c, 8, pos, window, torch.float32)
    assert isinstance(plan, FusedRegionPlan) and plan.lead.tolist() == [leads[g] for g in groups]
    p = LayerAttn(0.35, None, None, 0)
    q = torch.randn(8, 2, 3, 16)
    refs = [ref_kernel.attend(c, layer, q, ref_kernel.plan(c, 8, pos, window, torch.float32), p) for layer in range(2)]
    followers = [s for s in range(8) if s not in leads.values()]
    regions[:, :, followers, :, :9] = float("nan")
    for layer in range(2):
        torch.testing.assert_close(kernel.attend(c, layer, q, plan, p), refs[layer], atol=1e-6, rtol=1e-6)


def _pair(kind: str, **kw):
    """Samplers on the same weights: the default kernel (fused) and the torch ops."""
    on, off = _sampler(kind, **kw), _sampler(kind, **kw)
    off.decode_attention.base.fused = False
    assert on.decode_attention.base.fused
    return on, off


@pytest.mark.parametrize("case", ["grpo", "stops_refill", "single"])
def test_sampler_tokens_equal_the_torch_ops(case, monkeypatch):
    n = 1 if case == "single" else 4
    stop = [15] if case == "stops_refill" else []
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=stop)
    on, off = _pair("qwen2", **({"max_num_seqs": 7} if case == "stops_refill" else {}))
    calls = _counting(monkeypatch)
    a, b = on.generate(MIXED, params), off.generate(MIXED, params)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_lengths, b.response_lengths)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
    if case == "single":
        assert calls["plain"] > 0 and calls["shared"] == 0
    else:
        assert calls["shared"] > 0
    if case == "stops_refill":
        assert (a.response_lengths < 12).any() and a.stats["compaction_moves"] > 0


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_sampler_soft_capped_and_sink_layers(kind, monkeypatch):
    """Gemma 2 soft-caps every layer: the torch ops run them (no kernel call). GPT-OSS's sinks and sliding layers
    run in the kernel."""
    on, off = _pair(kind)
    calls = _counting(monkeypatch)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    a, b = on.generate(MIXED[:3], params), off.generate(MIXED[:3], params)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
    assert (calls["plain"] + calls["shared"] == 0) == (kind == "gemma2")


def test_without_a_compiler_the_sampler_keeps_the_torch_ops(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_attention, "_STATE", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("RLHF_KERNEL_CACHE", str(tmp_path / "kernels"))
    with pytest.warns(UserWarning, match="fused CPU decode attention is unavailable"):
        assert not cpu_attention.available()
    assert "no-such-compiler" in cpu_attention.unavailable_reason()
    assert decode_attention(torch.device("cpu"), torch.float32).fused is False
    s = _sampler("qwen2")
    assert s.decode_attention.base.fused is False
    out = s.generate(MIXED[:2], SamplingParams(n=2, temperature=0.0, max_new_tokens=4))
    assert out.response_lengths.tolist() == [4] * 4


def test_an_unwritable_cache_dir_builds_in_the_temporary_directory(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setattr(cpu_attention, "_STATE", {})
    monkeypatch.setenv("RLHF_KERNEL_CACHE", str(blocker / "kernels"))
    assert cpu_attention.available() and cpu_attention.unavailable_reason() is None


def test_env_switch_and_dtype_rule(monkeypatch):
    assert decode_attention(torch.device("cpu"), torch.float32).fused
    assert not decode_attention(torch.device("cpu"), torch.bfloat16).fused  # the kernel is fp32 only
    monkeypatch.setenv("RLHF_FUSED_CPU_ATTENTION", "0")
    assert not decode_attention(torch.device("cpu"), torch.float32).fused
    assert cpu_attention.unavailable_reason() == "RLHF_FUSED_CPU_ATTENTION=0"
    assert not cpu_attention.supports(torch.zeros(1, 1, 1, 12)) and cpu_attention.supports(torch.zeros(1, 1, 1, 24))


@pytest.mark.parametrize("budget", [False, True], ids=["every_slot_fits", "kv_budget"])
def test_long_prompts_stay_in_aligned_regions_where_the_kernel_runs(budget, monkeypatch):
    """Prompts long enough for the paged cascade (min_saved 16 here): with the fused kernel the call keeps the
    aligned slot regions (faster per generate at every length measured); under a KV budget that cannot hold every
    slot, and with the kernel off, it pages and shares the prompt blocks as before."""
    from tests.unit.test_cascade_attention import MIXED as LONG_MIXED

    kw = {"kv_cache_tokens": 160, "max_num_seqs": 7} if budget else {}
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=9)
    s = _sampler(block_size=8, decode_attention=CascadeAttention(GatherAttention(fused=True), min_saved=16), **kw)
    ref = _sampler(block_size=8, decode_attention=CascadeAttention(min_saved=16), **kw)
    calls = _counting(monkeypatch)
    a, b = s.generate(LONG_MIXED, params), ref.generate(LONG_MIXED, params)
    assert not ref.cache.contiguous  # the torch ops page for the cascade
    assert s.cache.contiguous == (not budget) and (calls["shared"] > 0) == (not budget)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 7], ids=["full", "sliding7"])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_paged_kernel_follows_the_block_table(window, sinks, monkeypatch):
    """Paged cache with shared prompt blocks (mixed groups, blocks of 4, a slot at its first column, runs that
    start and end inside blocks): the fused kernel through the block table equals the gather kernel; a
    CascadeAttention over it runs no separate prefix pass."""
    from tests.unit.test_cascade_attention import _cache, _mixed_groups

    c = _cache()
    pos = _mixed_groups(c)
    b, w = pos.shape[0], int(pos.max()) + 1
    p = LayerAttn(0.35, None, window, 0, sinks=torch.randn(6) if sinks else None)
    calls = _counting(monkeypatch)
    ref_kernel, fused = GatherAttention(), CascadeAttention(GatherAttention(fused=True), min_saved=8)
    plan = fused.plan(c, b, pos, w, torch.float32)
    assert not hasattr(plan, "groups")  # the base kernel's plan: no cascade step
    for layer in range(2):
        q = torch.randn(b, 2, 3, 8)
        ref = ref_kernel.attend(c, layer, q, ref_kernel.plan(c, b, pos, w, torch.float32), p)
        torch.testing.assert_close(fused.attend(c, layer, q, plan, p), ref, atol=1e-6, rtol=1e-6)
    assert calls["paged"] == 2


@pytest.mark.parametrize("case", ["kv_budget", "multi_turn"])
def test_sampler_paged_runs_equal_the_torch_ops(case, monkeypatch):
    """Paged calls through the kernel: a KV budget that preempts, and tool turns (parked sequences)."""
    from tests.unit.test_cascade_attention import LONG
    from tests.unit.test_sampler_turns import PARAMS as TURN_PARAMS, FakeTool

    kw = {"max_num_seqs": 7, "kv_cache_tokens": 160} if case == "kv_budget" else {}
    on, off = _pair("qwen2", block_size=8, **kw)
    calls = _counting(monkeypatch)
    if case == "kv_budget":
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=9, stop_token_ids=[5])
        a, b = on.generate(MIXED, params), off.generate(MIXED, params)
        assert a.stats["preemptions"] > 0
    else:
        a = on.generate(LONG, TURN_PARAMS, turns=FakeTool(delay=3))
        b = off.generate(LONG, TURN_PARAMS, turns=FakeTool(delay=3))
        assert a.stats["turns"] > 0
    assert not on.cache.contiguous and calls["paged"] > 0
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_lengths, b.response_lengths)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
