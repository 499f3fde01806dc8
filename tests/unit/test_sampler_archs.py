"""The sampler on Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE against HF transformers (fp32, tiny random models);
greedy decoding against HF ``generate`` is in test_sampler.py."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from rlhf.rollout import Sampler, SamplingParams
from tests._archs import ARCHS, tiny_model
from tests.unit.test_sampler import _model, _sampler, _teacher_forced

PAD = 0
# longer than the 4- and 6-token sliding windows of the tiny configs
PROMPTS = [[2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [5],
           [33, 34, 35, 36, 40, 41, 42, 43, 44, 45, 46]]


@pytest.mark.parametrize("kind", ARCHS)
def test_sampled_chunked_and_static_decode_match_teacher_forced(kind):
    """Sampling with chunked prefill (4-token chunks cross the sliding windows), few slots
    (continuous batching) and the static all-slot decode shapes of the CUDA-graph path."""
    model = _model(kind)
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=3)
    s = _sampler(kind, max_num_seqs=3, prefill_tokens=4)
    s.static_shapes = True
    out = s.generate(PROMPTS, params)
    assert out.stats["prefill_calls"] > len(PROMPTS)
    for row in range(out.response_ids.shape[0]):
        r = out.response_ids[row, : int(out.response_lengths[row])].tolist()
        ref = _teacher_forced(model, PROMPTS[row // 2], r, 0.8)
        torch.testing.assert_close(out.log_probs[row, : len(r)], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ARCHS)
def test_paged_cache_with_preemption_gives_the_same_tokens(kind):
    """The block-table (paged) decode path, with a budget small enough to preempt, reads sliding
    windows and soft-caps like the contiguous one: same tokens and log-probs."""
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=3)
    free = _sampler(kind, max_num_seqs=4).generate(PROMPTS, params)
    tight = _sampler(kind, max_num_seqs=4, kv_cache_tokens=64, block_size=8).generate(PROMPTS, params)
    assert tight.stats["preemptions"] > 0
    assert torch.equal(tight.response_ids, free.response_ids)
    torch.testing.assert_close(tight.log_probs, free.log_probs, atol=1e-5, rtol=0)


def _longrope_phi3() -> torch.nn.Module:
    half = 4  # rotary dim 8 (partial_rotary_factor 0.5 of head dim 16) -> 4 frequencies
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0][:half],
            "long_factor": [2.0, 4.0, 8.0, 16.0][:half]}
    return tiny_model("phi3", rope_scaling=rope, max_position_embeddings=256, original_max_position_embeddings=64)


def test_phi3_longrope_short_factors_match_hf_and_long_runs_generic():
    model = _longrope_phi3()
    out = Sampler(model.config, model.state_dict(), pad_token_id=PAD).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    for i, p in enumerate(PROMPTS):
        r = out.response_ids[i].tolist()
        torch.testing.assert_close(out.log_probs[i], _teacher_forced(model, p, r, 1.0), atol=1e-4, rtol=0)
    # past the short factors the fast decoder refuses; the HF module (generic path) applies the long ones
    s = Sampler(model.config, model.state_dict(), pad_token_id=PAD, max_seq_len=128)
    assert s.path.path == "generic"
    assert re.search("longrope.*original_max_position_embeddings=64.*max_seq_len=128", s.path.reason)


def test_multimodal_gemma3_is_not_fast():
    """Gemma 3's multimodal config is outside the fast families (their text model is gemma3_text): the generic
    path runs it (rlhf.models.generic)."""
    from rlhf.models.generic import rollout_path

    cfg = transformers.Gemma3Config(text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                     intermediate_size=64))
    where = rollout_path(cfg)
    assert where.path == "generic" and "not one of the hand-ported fast families" in where.reason


@pytest.mark.parametrize("slot_regions", [False, True])
def test_static_decode_with_a_vacated_slot_past_the_window(slot_regions):
    """The all-slot decode of the CUDA-graph path, window-4 model (Gemma 3): a slot vacated at a position
    (78) past the next steps' key window (64) saw no key at all, wrote NaN K/V into the scratch block
    and poisoned the live slot reading it. Vacated slots are reset (rlhf.rollout.scheduler._compact)."""
    long = [(3 * i) % 50 + 2 for i in range(68)]
    prompts = [[5, 6, 7], long, [9, 10, 11]]  # slot 0 short, slot 1 long: both end together, the last
    params = SamplingParams(temperature=0.0, max_new_tokens=10)  # short one then runs next to an idle slot 1
    ref = _sampler("gemma3", max_num_seqs=2, slot_regions=slot_regions, block_size=16).generate(prompts, params)
    s = _sampler("gemma3", max_num_seqs=2, slot_regions=slot_regions, block_size=16)
    s.static_shapes = True
    out = s.generate(prompts, params)
    assert out.log_probs.isfinite().all()
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
    assert int(s.pos_buf[1]) == 0  # the idle slot sits at position 0 (one key: flash-attn's shortest row)
