"""Memory and CUDA-path defects of the sampler (issue 27), driven on CPU through their seams."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from rlhf.models import decoder
from rlhf.rollout import Sampler, SamplingParams
from rlhf.rollout import sampler as sampler_mod
from rlhf.rollout.kv_cache import kv_bytes_per_token
from tests.unit.test_sampler import PROMPTS, _model, _sampler

_DEEP: list = []


def _deep_model() -> torch.nn.Module:
    """6 layers, so that one layer's fused weights are a small share of all of them."""
    if not _DEEP:
        torch.manual_seed(0)
        cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=6,
                                       num_attention_heads=4, num_key_value_heads=2)
        _DEEP.append(transformers.Qwen2ForCausalLM(cfg).eval())
    return _DEEP[0]


def _handed_over() -> dict[str, torch.Tensor]:
    """A weight dict whose tensors nothing else references (what the engine hands over)."""
    return {k: v.clone() for k, v in _deep_model().state_dict().items()}


def _peak_new_bytes(make, fn) -> int:
    """Peak growth of live CPU-allocator bytes while ``fn(make())`` runs, over the bytes live when
    ``fn`` starts. ``make`` runs under the profiler too, so the frees of its tensors are recorded
    (as ``[memory]`` events: a ``record_function`` range would lump them together, so the start is
    marked by an ``aten::eye`` call instead)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        arg = make()
        torch.eye(1)
        fn(arg)
        del arg
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    start = next(e.time_range.start for e in events if e.name == "aten::eye")
    live, base, peak = 0, None, 0
    for e in events:
        if base is None and e.time_range.start >= start:
            base = peak = live
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak - base


def _fused_bytes(spec) -> tuple[int, int]:
    """(one layer's, all layers') bytes of fused qkv + gate_up weights (fp32)."""
    h, d = spec.hidden_size, spec.head_dim
    layer = ((spec.num_heads + 2 * spec.num_kv_heads) * d * h + 2 * spec.intermediate_size * h) * 4
    return layer, layer * spec.num_layers


# --------------------------------------------------------------------------- KV budget from free memory


def test_cuda_free_memory_counts_the_allocators_cached_blocks_as_free(monkeypatch):
    """mem_get_info reports the caching allocator's reserved-but-unused blocks as used: they must
    be handed back before measuring (3 GiB cached + 1 GiB free = 4 GiB free for the cache)."""
    state = {"cached": 3 << 30, "free": 1 << 30}

    def empty_cache():
        state["free"] += state.pop("cached", 0)

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 << 30))
    assert sampler_mod.cuda_free_memory(torch.device("cuda", 0)) == 4 << 30


def test_kv_budget_from_injected_free_memory():
    m = _model()
    per = kv_bytes_per_token(2, 2, 16, torch.float32)  # 512 bytes per token
    s = Sampler(m.config, m.state_dict(), pad_token_id=0, max_num_seqs=8, max_seq_len=64,
                gpu_memory_utilization=0.5, free_memory=lambda device: 4 * 64 * per)
    assert s.cache.capacity_tokens == 2 * 64  # half of the room for 4 sequences, of the 8 requested
    out = s.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=1))
    ref = _sampler(max_num_seqs=8).generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=1))
    assert out.stats["preemptions"] > 0 and torch.equal(out.response_ids, ref.response_ids)


# --------------------------------------------------------------------------- weight copies


def test_prepare_weights_frees_the_unfused_tensors_as_it_fuses():
    spec = decoder.DecoderSpec.from_config(_deep_model().config)
    layer, every = _fused_bytes(spec)
    kw = dict(device=torch.device("cpu"), dtype=torch.float32)
    out = []
    kept = _peak_new_bytes(_handed_over, lambda w: out.append(decoder.prepare_weights(spec, w, **kw)))
    assert kept >= every  # the caller keeps its dict: every fused copy is extra
    peak = _peak_new_bytes(_handed_over, lambda w: out.append(decoder.prepare_weights(spec, w, consume=True, **kw)))
    assert peak <= 1.5 * layer < every / 3
    assert torch.equal(out[0].layers[5].gate_up_w, out[1].layers[5].gate_up_w)


def test_load_weights_in_place_copies_layer_by_layer():
    m = _deep_model()
    s = Sampler(m.config, _handed_over(), pad_token_id=0, reload_in_place=True)
    layer, every = _fused_bytes(s.spec)

    def new():
        return {k: v + 0.5 for k, v in _handed_over().items()}

    peak = _peak_new_bytes(new, lambda w: s.load_weights(w, consume=True))
    assert peak <= 1.5 * layer < every / 3
    ref = decoder.prepare_weights(s.spec, new(), device=s.device, dtype=s.dtype)
    assert torch.equal(s.weights.layers[3].qkv_w, ref.layers[3].qkv_w)
    assert torch.equal(s.weights.embed, ref.embed)


# --------------------------------------------------------------------------- chunked prefill kernel


def test_chunked_prefill_folds_query_groups_instead_of_enable_gqa(monkeypatch):
    """SDPA with a mask and enable_gqa falls back to the math kernel; chunked prefill folds the
    query groups into query rows and must give the unfolded result."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        calls.append((attn_mask is not None, kw.get("enable_gqa", False), q.shape[1] == k.shape[1]))
        return sdpa(q, k, v, attn_mask, *a, **kw)

    long_prompts = [[(7 * i + 3) % 60 + 2 for i in range(70)], [9, 8]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    whole = _sampler(prefill_tokens=8192).generate(long_prompts, params)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    chunked = _sampler(prefill_tokens=16).generate(long_prompts, params)
    masked = [c for c in calls if c[0]]
    assert masked and not any(gqa for _, gqa, _ in masked)
    assert all(same_heads for _, _, same_heads in masked)  # q heads = kv heads after folding
    assert torch.equal(chunked.response_ids, whole.response_ids)
    torch.testing.assert_close(chunked.log_probs, whole.log_probs, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- kept sampler


def test_kept_sampler_reloads_weights_in_place_and_reuses_its_cache():
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.schema.batch import PromptBatch
    from rlhf.schema.config import RolloutConfig

    m = _model()
    prompts = PromptBatch(prompt_ids=PROMPTS, keys=list(range(5)), ground_truths=[""] * 5, data_sources=["x"] * 5,
                          extra_infos=[{}] * 5)

    def engine(free: bool) -> RolloutEngine:
        return RolloutEngine(RolloutConfig(n=2, seed=3, free_cache_engine=free, max_num_seqs=4), build_char_tokenizer(),
                             max_prompt_length=8, max_response_length=12, device=torch.device("cpu"))

    def weights(shift: float) -> dict[str, torch.Tensor]:
        return {k: v + shift for k, v in m.state_dict().items()}

    kept = engine(free=False)
    kept.sample(weights(0.0), m.config, prompts, step=1, n=2, temperature=1.0, consume_weights=True)
    s = kept._kept
    ptrs, cache = (s.weights.layers[0].qkv_w.data_ptr(), s.weights.embed.data_ptr()), s.cache
    second, _ = kept.sample(weights(0.05), m.config, prompts, step=2, n=2, temperature=1.0, consume_weights=True)
    assert kept._kept is s and s.cache is cache
    assert (s.weights.layers[0].qkv_w.data_ptr(), s.weights.embed.data_ptr()) == ptrs
    fresh, _ = engine(free=True).sample(weights(0.05), m.config, prompts, step=2, n=2, temperature=1.0)
    assert torch.equal(second.responses, fresh.responses)
    torch.testing.assert_close(second.rollout_log_probs, fresh.rollout_log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("free", [True])
def test_fresh_sampler_per_step_by_default(free):
    from rlhf.schema.config import RolloutConfig

    assert RolloutConfig().free_cache_engine is free


def test_prefill_mlp_over_row_chunks_matches_one_pass(monkeypatch):
    """The MLP over row chunks (bounded temporaries in long prefills, ``decoder._MLP_ROWS``) gives
    the tokens and log-probs of one pass over all rows."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    whole = _sampler().generate(PROMPTS, params)
    rows: list[int] = []
    mlp = decoder._mlp

    def spy(spec, lw, x, tp_group, *rest):
        rows.append(x.shape[0])
        return mlp(spec, lw, x, tp_group, *rest)

    monkeypatch.setattr(decoder, "_mlp", spy)
    monkeypatch.setattr(decoder, "_MLP_ROWS", 4)  # the 20-token prefill in 5 chunks, 10-slot decode steps in 3
    chunked = _sampler().generate(PROMPTS, params)
    assert max(rows) > 4 and 4 in rows
    assert torch.equal(chunked.response_ids, whole.response_ids)
    torch.testing.assert_close(chunked.log_probs, whole.log_probs, atol=1e-5, rtol=0)
