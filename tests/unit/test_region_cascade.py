"""Aligned slot regions and the shared-prompt decode attention of GRPO calls (rlhf.rollout.region_cascade):
the sampler's tokens equal the unaligned cache's, log-probs to fp32 rounding, in every path (runs of
samples, the step's one column, compacted slots, refills, sliding-window / soft-capped layers)."""

from __future__ import annotations

import pytest
import torch

from rlhf.rollout import SamplingParams
from rlhf.rollout.kv_cache import PagedKVCache
from rlhf.rollout import region_cascade
from rlhf.rollout.region_cascade import RegionCascade, group_members
from tests.unit.test_cascade_attention import MIXED
from tests.unit.test_sampler import _sampler


def _counting(monkeypatch) -> dict:
    calls = {"attend": 0, "masked": 0, "gathered": 0}
    run = RegionCascade.attend

    def counted(cache, layer, q, plan, p):
        calls["attend"] += 1
        calls["masked"] += plan.suffix_mask.numel() > 1  # response columns hidden for some slot
        calls["gathered"] += not plan.uniform  # groups that are not runs of consecutive slots
        return run(cache, layer, q, plan, p)

    monkeypatch.setattr(RegionCascade, "attend", staticmethod(counted))
    return calls


def _pair(kind: str, **kw):
    """Aligned and unaligned samplers on the torch ops (the fused CPU kernel: tests/unit/test_cpu_attention.py)."""
    on, off = _sampler(kind, **kw), _sampler(kind, **kw)
    off.decode_attention.aligns = False
    for s in (on, off):
        s.decode_attention.base.fused = False
    return on, off


@pytest.mark.parametrize("case", ["grpo", "stops", "refill", "no_prefix_copy"])
def test_same_tokens_as_the_unaligned_cache(case, monkeypatch):
    """grpo: every slot in a run of its prompt's samples, one column per step; stops: finished samples
    compacted away (groups no longer runs: gathered query rows); refill: 7 slots for 20 samples
    (groups of unequal size, slots at different columns: masked response columns)."""
    stop = [15] if case in ("stops", "refill") else []
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=stop)
    on, off = _pair("qwen2", **({"max_num_seqs": 7} if case == "refill" else {}))
    calls = _counting(monkeypatch)
    if case == "no_prefix_copy":  # the groups' prompt K/V gathered per layer instead of copied once
        monkeypatch.setattr(region_cascade, "PREFIX_COPY_BYTES", 0)
    a, b = on.generate(MIXED, params), off.generate(MIXED, params)
    assert on.cache.prefix_cols == max(map(len, MIXED)) and off.cache.prefix_cols == 0
    assert on.cache.contiguous and off.cache.contiguous
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_lengths, b.response_lengths)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
    assert calls["attend"] > 0
    if case in ("stops", "refill"):
        assert (a.response_lengths < 12).any() and a.stats["compaction_moves"] > 0 and calls["gathered"] > 0
    if case == "refill":
        assert calls["masked"] > 0
    # the next call (no alignment: n = 1) reuses the cache with positions as columns
    single = SamplingParams(temperature=0.0, max_new_tokens=6)
    x, y = on.generate(MIXED, single), off.generate(MIXED, single)
    assert on.cache.prefix_cols == 0 and torch.equal(x.response_ids, y.response_ids)


def test_sliding_window_and_softcap_layers_run_the_base_kernel(monkeypatch):
    on, off = _pair("gemma2")
    calls = _counting(monkeypatch)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    a, b = on.generate(MIXED[:3], params), off.generate(MIXED[:3], params)
    assert on.cache.prefix_cols > 0 and calls["attend"] == 0  # every Gemma 2 layer soft-caps
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)


def test_group_members():
    assert group_members([3, 3, 7, 7, 1, 1]) == ([1, 3, 7], [[4, 5], [0, 1], [2, 3]])
    assert group_members([0, 1, 0, 2, 1, 0]) == ([0, 1, 2], [[0, 2, 5], [1, 4], [3]])
    assert group_members([0, 1, 2]) is None  # no group of two
    assert group_members([0, 0, 0, 0, 1, 2, 3]) is None  # 4 groups x 4 rows > 2 x 7
    assert group_members([0, -1]) is None


def test_aligned_cache_columns_and_moves():
    c = PagedKVCache(1, 64, 4, 1, 16, 2, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    c.start(contiguous=True, prefix_cols=6)
    c.grow([0, 1], [4, 7])
    c.align([0, 1], [3, 6], [0, 1])
    assert c.shift.tolist()[:2] == [3, 0]
    rows = c.rows(torch.tensor([0, 1]), torch.tensor([[0, 2], [0, 5]]))  # [2, 2Hkv, T]
    assert (rows[0, 0] % 16).tolist() == [3, 5] and (rows[1, 0] % 16).tolist() == [0, 5]
    c.write(0, rows.reshape(-1), torch.arange(16.0).view(8, 2))
    c.step_column = 6
    assert c.decode_index(torch.tensor([3, 6])) == 6
    c.write(0, 6, torch.full((2, 2, 2), 9.0))
    c.move([1], [2])
    assert c.shift_host[2] == 0 and c.group[2] == 1 and c.group[1] == -1 and c.shift[2] == 0
    c.align([3], [9], [5])  # longer than prefix_cols: positions as columns, in no group
    assert c.shift_host[3] == 0 and c.group[3] == -1
    regions = c.regions()[0]  # [2, S, Hkv, T, D]
    assert regions[0, 2, 0, 5].tolist() == [10.0, 11.0] and regions[0, 2, 0, 6].tolist() == [9.0, 9.0]


@pytest.mark.parametrize("order", ["runs", "mixed"])
def test_kernel_equals_the_gather_kernel_on_aligned_regions(order):
    """Four groups of two slots (prompts 5, 9, 2, 7 tokens, ``Pm`` = 9), slots at different columns (masked
    response columns), as consecutive runs or interleaved: attention equal to the gather kernel to 1e-6."""
    from rlhf.models.arch import LayerAttn
    from rlhf.rollout.paged_attention import GatherAttention

    torch.manual_seed(0)
    c = PagedKVCache(2, 200, 8, 2, 32, 8, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    c.start(contiguous=True, prefix_cols=9)
    groups = [0, 0, 1, 1, 2, 2, 3, 3] if order == "runs" else [0, 1, 2, 3, 0, 2, 1, 3]
    lens = {0: 5, 1: 9, 2: 2, 3: 7}
    c.align(list(range(8)), [lens[g] for g in groups], groups)
    regions = c.regions()  # [L, 2, S, Hkv, T, D]
    regions.normal_()
    for g in range(4):  # the samples of a prompt hold identical prompt columns
        members = [s for s in range(8) if groups[s] == g]
        regions[:, :, members, :, :9] = regions[:, :, members[:1], :, :9]
    pos = torch.tensor([lens[g] for g in groups]) + torch.tensor([6, 4, 6, 1, 6, 3, 6, 0])
    cols = pos + c.shift[:8]
    window = int(cols.max()) + 1
    rc = RegionCascade()
    plan = rc.plan(c, 8, pos, window, torch.float32, lambda: None)
    assert plan.uniform == (order == "runs") and plan.suffix_mask.numel() > 1
    ref_plan = GatherAttention().plan(c, 8, pos, window, torch.float32)
    p = LayerAttn(0.35, None, None, 0)
    for layer in range(2):
        q = torch.randn(8, 2, 3, 8)
        torch.testing.assert_close(RegionCascade.attend(c, layer, q, plan, p),
                                   GatherAttention().attend(c, layer, q, ref_plan, p), atol=1e-6, rtol=1e-6)


def test_bf16_and_single_sample_calls_keep_positions_as_columns():
    s = _sampler("qwen2", dtype=torch.bfloat16)  # split prompt / response sums would add a bf16 rounding
    s.generate(MIXED[:2], SamplingParams(n=2, temperature=0.0, max_new_tokens=2))
    assert s.cache.contiguous and s.cache.prefix_cols == 0
    s = _sampler("qwen2")
    s.generate(MIXED[:2], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert s.cache.contiguous and s.cache.prefix_cols == 0
