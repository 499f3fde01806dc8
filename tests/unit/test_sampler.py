"""Tests of the rollout sampler against HF transformers (fp32, tiny random models)."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhf.rollout import RolloutOutput, Sampler, SamplingParams
from rlhf.rollout.sampling import mix32, sample_next, sequence_keys, uniforms, position_keys
from tests._archs import ARCHS, tiny_model

PAD = 0
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [5], [33, 34, 35, 36]]


def _config(kind: str) -> transformers.PretrainedConfig:
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "llama3_rope":
        return transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16)
    if kind == "qwen2_tied":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    raise KeyError(kind)


_MODELS: dict[str, torch.nn.Module] = {}


def _model(kind: str = "qwen2") -> torch.nn.Module:
    if kind not in _MODELS and kind in ARCHS:  # Gemma 2 / Gemma 3 / Phi-3 / Qwen3-MoE (tests/_archs.py)
        _MODELS[kind] = tiny_model(kind)
    if kind not in _MODELS:
        torch.manual_seed(1234)
        cfg = _config(kind)
        cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen2_tied": transformers.Qwen2ForCausalLM,
               "qwen3": transformers.Qwen3ForCausalLM}.get(kind, transformers.LlamaForCausalLM)
        _MODELS[kind] = cls(cfg).eval()
    return _MODELS[kind]


def _sampler(kind: str = "qwen2", **kw) -> Sampler:
    m = _model(kind)
    return Sampler(m.config, m.state_dict(), pad_token_id=PAD, **kw)


def _responses(out: RolloutOutput) -> list[list[int]]:
    return [r[: int(n)].tolist() for r, n in zip(out.response_ids, out.response_lengths)]


@torch.no_grad()
def _teacher_forced(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``response`` tokens under a teacher-forced HF forward: ``[len(response)]``."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None]).squeeze(1)


# --------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "llama3_rope", "qwen2_tied", *ARCHS])
def test_greedy_matches_hf_generate(kind):
    model = _model(kind)
    out = _sampler(kind).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    for i, p in enumerate(PROMPTS):
        ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None)[0, len(p):].tolist()
        assert out.response_ids[i].tolist() == ref, f"prompt {i}"
        torch.testing.assert_close(out.log_probs[i], _teacher_forced(model, p, ref, 1.0), atol=1e-4, rtol=0)
    assert out.response_mask.all() and out.truncated.all()


def test_greedy_equals_teacher_forced_argmax_and_logprobs():
    model = _model()
    out = _sampler().generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    for i, (p, r) in enumerate(zip(PROMPTS, _responses(out))):
        logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
        assert logits.argmax(-1).tolist() == r
        torch.testing.assert_close(out.log_probs[i], _teacher_forced(model, p, r, 1.0), atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_k,top_p,min_p", [(-1, 1.0, 0.0), (5, 0.9, 0.0), (-1, 0.8, 0.05)])
def test_sampled_logprobs_match_teacher_forced(top_k, top_p, min_p):
    model = _model()
    params = SamplingParams(n=2, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, max_new_tokens=12, seed=3)
    out = _sampler().generate(PROMPTS, params)
    for row, r in enumerate(_responses(out)):
        p = PROMPTS[int(out.prompt_index[row])]
        ref = _teacher_forced(model, p, r, 0.7)
        torch.testing.assert_close(out.log_probs[row, : len(r)], ref, atol=1e-4, rtol=0)
        if top_k > 0:  # every sampled token is among the top-k of the teacher-forced logits
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
            ranks = (logits > logits.gather(1, torch.tensor(r)[:, None])).sum(-1)
            assert (ranks < top_k).all()


# --------------------------------------------------------------------------- n > 1, seeding, batching


def test_n_samples_share_prefill():
    s = _sampler()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=7)
    out = s.generate(PROMPTS, params)
    assert out.response_ids.shape == (15, 10)
    assert out.prompt_index.tolist() == [i for i in range(5) for _ in range(3)]
    assert out.stats["prefill_tokens"] == sum(map(len, PROMPTS))  # one prefill per prompt, not per sample
    one = s.generate(PROMPTS, SamplingParams(n=1, temperature=1.0, max_new_tokens=10, seed=7))
    # sample j=0 of each prompt has the same key as the n=1 run
    assert torch.equal(out.response_ids[0::3], one.response_ids)
    # the samples of a prompt differ, and each one's log-probs are those of its own prompt
    assert any(out.response_ids[3 * i].tolist() != out.response_ids[3 * i + 1].tolist() for i in range(5))
    model = _model()
    for row, r in enumerate(_responses(out)):
        ref = _teacher_forced(model, PROMPTS[row // 3], r, 1.0)
        torch.testing.assert_close(out.log_probs[row, : len(r)], ref, atol=1e-4, rtol=0)


def test_seeded_sampling_independent_of_batching():
    params = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_new_tokens=12, seed=11, stop_token_ids=[3])
    keys = [100, 101, 102, 103, 104]
    ref = _sampler().generate(PROMPTS, params, step=5, prompt_keys=keys)
    rows = {k: ref.response_ids[2 * i : 2 * i + 2] for i, k in enumerate(keys)}
    # reversed order, split in two calls, few slots
    s = _sampler(max_num_seqs=3)
    for idx in ([4, 2, 0], [3, 1]):
        out = s.generate([PROMPTS[i] for i in idx], params, step=5, prompt_keys=[keys[i] for i in idx])
        for j, i in enumerate(idx):
            assert torch.equal(out.response_ids[2 * j : 2 * j + 2], rows[keys[i]])
    # a different step or seed changes the draws
    other = _sampler().generate(PROMPTS, params, step=6, prompt_keys=keys)
    assert not torch.equal(other.response_ids, ref.response_ids)


def test_continuous_batching_matches_large_batch():
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=2, stop_token_ids=[5, 9, 17])
    big = _sampler(max_num_seqs=64).generate(PROMPTS, params)
    small_sampler = _sampler(max_num_seqs=3)
    small = small_sampler.generate(PROMPTS, params)
    lens = big.response_lengths
    assert lens.min() < lens.max(), "want uneven lengths for this test"
    assert small.stats["num_slots"] == 3 and small.stats["prefill_calls"] > 1
    assert small.stats["slot_utilisation"] > 0.5
    for f in ("response_ids", "response_mask", "response_lengths", "truncated"):
        assert torch.equal(getattr(small, f), getattr(big, f)), f
    torch.testing.assert_close(small.log_probs, big.log_probs, atol=1e-5, rtol=0)
    # with refill_fraction and a paged cache of 128 tokens (8 blocks) for 20 sequences of up to 23
    tight = _sampler(max_num_seqs=64, kv_cache_tokens=2 * 64, max_seq_len=64, refill_fraction=0.5)
    out = tight.generate(PROMPTS, params)
    assert out.stats["kv_cache_tokens"] == 128 and out.stats["kv_peak_tokens"] <= 128
    assert out.stats["preemptions"] > 0  # sequences outgrew the blocks they were admitted with
    assert torch.equal(out.response_ids, big.response_ids)
    torch.testing.assert_close(out.log_probs, big.log_probs, atol=1e-5, rtol=0)


def test_kv_budget_below_request_preempts_and_matches_unconstrained():
    """Long responses, a KV budget of 2 full-length sequences for 12 requested: sequences are
    paused, requeued and recomputed, and every token and log-prob equals the unconstrained run."""
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=48, seed=7, stop_token_ids=[3])
    free = _sampler(max_num_seqs=16).generate(PROMPTS[:4], params)
    assert free.stats["preemptions"] == 0
    for tokens in (2 * 64, 64):
        tight = _sampler(max_num_seqs=16, kv_cache_tokens=tokens).generate(PROMPTS[:4], params)
        assert tight.stats["preemptions"] > 0 and tight.stats["recomputed_tokens"] > 0
        assert tight.stats["kv_peak_tokens"] <= tokens < free.stats["kv_peak_tokens"]
        for f in ("response_ids", "response_lengths", "truncated"):
            assert torch.equal(getattr(tight, f), getattr(free, f)), (tokens, f)
        torch.testing.assert_close(tight.log_probs, free.log_probs, atol=1e-5, rtol=0)
    # a budget given in bytes: 2 layers x 2 KV heads x 16 dims x K,V x 4 bytes = 512 bytes per token
    by_bytes = _sampler(max_num_seqs=16, kv_cache_bytes=64 * 512).generate(PROMPTS[:4], params)
    assert by_bytes.stats["kv_cache_tokens"] == 64
    assert torch.equal(by_bytes.response_ids, free.response_ids)


def test_kv_budget_smaller_than_one_sequence_is_a_clear_error():
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=48, seed=7)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_seq_len=64"):
        _sampler(kv_cache_tokens=32).generate(PROMPTS[:1], params)


def test_chunked_prefill_of_long_prompts_matches_one_pass():
    """Prompts longer than prefill_tokens are prefilled in chunks attending to the cached ones."""
    long_prompts = [[(7 * i + 3) % 60 + 2 for i in range(70)], [(5 * i + 1) % 60 + 2 for i in range(41)], [9, 8]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3)
    whole = _sampler(prefill_tokens=8192).generate(long_prompts, params)
    chunked = _sampler(prefill_tokens=16).generate(long_prompts, params)
    assert chunked.stats["prefill_calls"] >= 5 + 3 + 1 and whole.stats["prefill_calls"] == 1
    assert torch.equal(chunked.response_ids, whole.response_ids)
    torch.testing.assert_close(chunked.log_probs, whole.log_probs, atol=1e-5, rtol=0)
    model = _model()
    for row, r in enumerate(_responses(chunked)):  # and both equal HF's teacher-forced log-probs
        ref = _teacher_forced(model, long_prompts[row // 2], r, 1.0)
        torch.testing.assert_close(chunked.log_probs[row, : len(r)], ref, atol=1e-4, rtol=0)


def test_static_shape_decode_path_matches_dynamic():
    """The all-slot, bucketed-window decode (the CUDA-graph shapes) gives the same responses."""
    params = SamplingParams(n=2, temperature=1.0, top_k=20, max_new_tokens=12, seed=5, stop_token_ids=[4, 8])
    dynamic = _sampler(max_num_seqs=4).generate(PROMPTS, params)
    s = _sampler(max_num_seqs=4)
    s.static_shapes = True
    static = s.generate(PROMPTS, params)
    assert torch.equal(static.response_ids, dynamic.response_ids)
    torch.testing.assert_close(static.log_probs, dynamic.log_probs, atol=1e-5, rtol=0)


def test_compaction_keeps_sequences_intact():
    """Uneven stops inside one batch: retired slots are filled by moving live ones."""
    model = _model()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=20, seed=4, stop_token_ids=[1, 2, 3, 4, 6])
    out = _sampler().generate(PROMPTS, params)
    assert out.stats["compaction_moves"] > 0
    for row, r in enumerate(_responses(out)):
        ref = _teacher_forced(model, PROMPTS[row // 3], r, 1.0)
        torch.testing.assert_close(out.log_probs[row, : len(r)], ref, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- stops and masks


def test_stop_tokens_and_sequences():
    s = _sampler()
    free = s.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    r0 = free.response_ids[0].tolist()
    stop_tok = r0[3]
    out = s.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop_tok]))
    for i, r in enumerate(free.response_ids.tolist()):
        n = r.index(stop_tok) + 1 if stop_tok in r else 10
        assert out.response_lengths[i] == n
        assert out.response_ids[i, :n].tolist() == r[:n]
        assert (out.response_ids[i, n:] == PAD).all()
        assert out.response_mask[i].tolist() == [True] * n + [False] * (10 - n)
        assert (out.log_probs[i, n:] == 0).all() and (out.log_probs[i, :n] < 0).all()
        assert bool(out.truncated[i]) == (stop_tok not in r)
    assert out.response_lengths[0] <= 4

    seq = r0[2:4]  # a two-token stop sequence; it stays in the response
    out = s.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10, stop_sequences=[[63, 62, 61], seq]))
    for i, r in enumerate(free.response_ids.tolist()):
        ends = [t + 2 for t in range(len(r) - 1) if r[t : t + 2] == seq]
        n = ends[0] if ends else 10
        assert out.response_lengths[i] == n and out.response_ids[i, :n].tolist() == r[:n]
        assert bool(out.truncated[i]) == (not ends)
    assert out.response_lengths[0] <= 4


def test_stop_sequence_does_not_match_prompt_tokens():
    s = _sampler()
    free = s.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=6))
    first = int(free.response_ids[0, 0])
    # [last prompt token, first response token] spans the boundary: must not stop
    out = s.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=6, stop_sequences=[[5, first]]))
    assert out.response_lengths[0] == 6


def test_top_k_one_equals_greedy():
    s = _sampler()
    greedy = s.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    topk1 = s.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10, seed=9))
    assert torch.equal(greedy.response_ids, topk1.response_ids)
    torch.testing.assert_close(greedy.log_probs, topk1.log_probs, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- sampling unit tests


def test_inverse_cdf_and_truncation_hand_values():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    p = SamplingParams(temperature=1.0)
    for u, want in ((0.1, 0), (0.19, 0), (0.21, 1), (0.69, 1), (0.71, 2), (0.999, 2)):
        tok, logp = sample_next(logits, p, torch.tensor([u], dtype=torch.float32))
        assert tok.item() == want
        torch.testing.assert_close(logp, logits[0, want : want + 1])
    # top_p=0.6: sorted [0.5, 0.3, 0.2]; mass before 0.3 is 0.5 < 0.6 -> kept; before 0.2 is 0.8 -> dropped.
    # kept {1: 0.5, 2: 0.3} renormalised; u=0.7 -> 0.7*0.8=0.56 > 0.5 -> token 2
    p = SamplingParams(temperature=1.0, top_p=0.6)
    assert sample_next(logits, p, torch.tensor([0.7], dtype=torch.float32))[0].item() == 2
    assert sample_next(logits, p, torch.tensor([0.999], dtype=torch.float32))[0].item() == 2
    # min_p=0.5: threshold 0.25 keeps {1, 2}; natural order cdf [0, 0.5, 0.8]
    p = SamplingParams(temperature=1.0, min_p=0.5)
    assert sample_next(logits, p, torch.tensor([0.01], dtype=torch.float32))[0].item() == 1
    assert sample_next(logits, p, torch.tensor([0.7], dtype=torch.float32))[0].item() == 2
    # top_k=1 picks the argmax whatever u; log-prob is of the untruncated distribution at T
    p = SamplingParams(temperature=2.0, top_k=1)
    tok, logp = sample_next(logits, p, torch.tensor([0.99], dtype=torch.float32))
    assert tok.item() == 1
    torch.testing.assert_close(logp, torch.log_softmax(logits / 2.0, -1)[0, 1:2])


def test_hash_uniforms_are_bounded_deterministic_and_spread():
    keys = torch.tensor([0, 1, 2**40, -5], dtype=torch.int64)
    h = mix32(keys)
    assert ((h >= 0) & (h < 2**32)).all()
    k1 = sequence_keys(-3, 2**33, torch.arange(4000), torch.zeros(4000, dtype=torch.int64))
    k2 = sequence_keys(-3, 2**33, torch.arange(4000), torch.zeros(4000, dtype=torch.int64))
    assert torch.equal(k1, k2) and k1.unique().numel() == 4000
    u = uniforms(k1, position_keys(1, k1.device).expand(4000))
    assert ((u > 0) & (u < 1)).all()
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    assert (hist > 300).all() and (hist < 500).all()  # ~400 per bin


def test_sampling_frequencies_follow_probabilities():
    probs = torch.tensor([0.1, 0.6, 0.3])
    logits = probs.log().expand(20000, 3).contiguous()
    keys = sequence_keys(0, 0, torch.arange(20000), torch.zeros(20000, dtype=torch.int64))
    u = uniforms(keys, torch.zeros(20000, dtype=torch.int64))
    tok, _ = sample_next(logits, SamplingParams(temperature=1.0), u)
    freq = torch.bincount(tok, minlength=3).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


# --------------------------------------------------------------------------- errors and capacity


def test_errors_name_the_problem():
    cfg = transformers.MambaConfig(num_hidden_layers=1, hidden_size=32, vocab_size=64)  # gpt2: the generic path
    with pytest.raises(NotImplementedError, match="mamba's layers keep convolution / recurrent state"):
        Sampler(cfg, {}, pad_token_id=0)
    m = _model()
    with pytest.raises(KeyError, match="model.norm.weight"):
        Sampler(m.config, {k: v for k, v in m.state_dict().items() if k != "model.norm.weight"}, pad_token_id=0)
    s = _sampler(max_seq_len=12)
    with pytest.raises(ValueError, match="max_seq_len"):
        s.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="top_p"):
        s.generate(PROMPTS[:1], SamplingParams(top_p=0.0, max_new_tokens=2))


def test_cache_grows_when_not_fixed():
    s = _sampler(max_num_seqs=4)
    s.generate([[1, 2]], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert s.max_seq_len == 64 and s.cache.num_slots == 4 and s.cache.capacity_tokens == 4 * 64
    out = s.generate([list(range(1, 60))], SamplingParams(temperature=0.0, max_new_tokens=10))
    assert s.max_seq_len == 128 and out.response_lengths.item() == 10


def test_kv_cache_budget_from_free_memory():
    from rlhf.rollout.kv_cache import kv_bytes_per_token, kv_tokens_for_memory

    # Qwen2.5-0.5B in bf16: 24 layers x (K, V) x 2 kv heads x 64 dims x 2 bytes = 12 KiB per token
    per = kv_bytes_per_token(24, 2, 64, torch.bfloat16)
    assert per == 24 * 2 * 2 * 64 * 2 == 12288
    tokens = kv_tokens_for_memory(10 * 2**30, 0.5, per)  # half of 10 GiB free
    assert tokens == 5 * 2**30 // 12288 == 436906
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_tokens_for_memory(2**30, 0.0, per)


def test_load_weights_in_place_keeps_addresses():
    """reload_in_place (CUDA graphs, a kept sampler): new weights are copied into the old storage,
    which is the sampler's own (never the caller's tensors); otherwise the weights are swapped."""
    from rlhf.models import decoder

    m = _model()
    sd = m.state_dict()
    new_sd = {k: v + 0.01 for k, v in sd.items()}
    s = _sampler(reload_in_place=True)
    assert s.weights.layers[0].o_w.data_ptr() != sd["model.layers.0.self_attn.o_proj.weight"].data_ptr()
    before = [s.weights.layers[0].qkv_w.data_ptr(), s.weights.layers[1].o_w.data_ptr(), s.weights.embed.data_ptr()]
    s.load_weights(new_sd)
    assert [s.weights.layers[0].qkv_w.data_ptr(), s.weights.layers[1].o_w.data_ptr(), s.weights.embed.data_ptr()] \
        == before
    fresh = decoder.prepare_weights(s.spec, new_sd, device=s.device, dtype=s.dtype)
    assert torch.equal(s.weights.layers[0].qkv_w, fresh.layers[0].qkv_w)
    assert torch.equal(s.weights.layers[1].o_w, fresh.layers[1].o_w)
    assert torch.equal(s.weights.lm_head, fresh.lm_head)
    assert torch.equal(sd["model.layers.1.self_attn.o_proj.weight"], m.state_dict()["model.layers.1.self_attn.o_proj.weight"])
    swap = _sampler()
    swap.load_weights(new_sd)  # plain swap: unfused tensors on the device in the dtype are used as given
    assert swap.weights.layers[1].o_w.data_ptr() == new_sd["model.layers.1.self_attn.o_proj.weight"].data_ptr()


def test_inverse_cdf_never_picks_a_zero_probability_token_under_a_gpu_like_scan(monkeypatch):
    """A GPU cumsum (parallel scan) can step up at a zero-probability entry; searchsorted then picked
    that token (log-prob -inf). Seam: rlhf.rollout.sampling._cumsum replaced by such a scan."""
    from rlhf.rollout import sampling

    probs = torch.tensor([[0.3, 0.0, 0.0, 0.7], [0.6, 0.4, 0.0, 0.0]])

    def gpu_like(p, dim):  # +1e-6 at each zero entry: a rounding of the prefix, not of the mass
        return torch.cumsum(p, dim) + torch.cumsum((p == 0).float() * 1e-6, dim)

    monkeypatch.setattr(sampling, "_cumsum", gpu_like)
    u = torch.tensor([0.3 / 1.0 + 5e-7, 1.0])  # thresholds just past the first row's 0.3, at the second's end
    pick = sampling.inverse_cdf(probs, u).squeeze(1)
    assert probs.gather(1, pick[:, None]).gt(0).all(), pick
    assert pick.tolist() == [3, 1]  # the next positive token; none follows in row 2: the last before
    monkeypatch.undo()
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 50, generator=g), -1).masked_fill(torch.rand(64, 50, generator=g) < 0.5, 0.0)
    u = torch.rand(64, generator=g).clamp_min(1e-6)
    plain = torch.searchsorted(p.cumsum(-1), (u * p.cumsum(-1)[:, -1])[:, None])
    assert torch.equal(sampling.inverse_cdf(p, u), plain)  # on a sequential scan: the same picks as before
