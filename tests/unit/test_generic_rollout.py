"""The generic rollout path (rlhf.rollout.generic): families outside the fast list run their own HF modules
over the paged KV cache; greedy tokens equal HF ``generate`` and log-probs equal HF's forward (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhf.rollout.sampler import Sampler
from rlhf.rollout.sampling import SamplingParams

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
             bos_token_id=None)
# what makes each family different is kept: Granite's multipliers, EXAONE 4's and OLMo 3's sliding layers
# (a 4-token window, so it bites), Seed-OSS's biases, SmolLM3's NoPE layers, and the two below
FAMILIES = {
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    "exaone4": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "seed_oss": dict(attention_bias=True, attention_out_bias=True),
    "olmo3": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "smollm3": dict(no_rope_layers=[1, 0]),
    # Gemma 4: per-layer inputs, global layers twice as wide as the sliding ones (the cache pads to the widest)
    "gemma4_text": dict(global_head_dim=32, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                        vocab_size_per_layer_input=64, hidden_size_per_layer_input=16),
    # DeepSeek-V2: MLA (K 24 wide, V 12: padded in the cache) and routed experts after a dense layer
    "deepseek_v2": dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


def tiny_model(kind: str, seed: int = 0, **overrides) -> tuple[transformers.PretrainedConfig, torch.nn.Module]:
    """A random fp32 model of ``kind`` (weights and biases std 0.1, norm scales in [0.5, 1.5], so the tokens vary)."""
    config = transformers.AutoConfig.for_model(kind, **{**SMALL, **FAMILIES.get(kind, {}), **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name or "ln" in name else p.normal_(0, 0.1)
    return config, model


def sampler(config, model, **kw) -> Sampler:
    kw = {"pad_token_id": 0, "max_num_seqs": 4, "dtype": torch.float32, **kw}
    return Sampler(config, {k: v.clone() for k, v in model.state_dict().items()}, **kw)


def hf_logprobs(model, prompt: list[int], response: torch.Tensor) -> torch.Tensor:
    ids = torch.cat([torch.tensor(prompt), response])[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return lp[len(prompt) - 1:-1].gather(1, response[:, None])[:, 0]


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_greedy_tokens_and_logprobs_equal_hf(kind):
    config, model = tiny_model(kind)
    s = sampler(config, model)
    assert s.backend.__name__ == "rlhf.rollout.generic" and s.path.path == "generic"
    out = s.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_new_tokens=10, stop_token_ids=[]))
    distinct = set()
    for i, p in enumerate(PROMPTS):
        ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):]
        for j in (2 * i, 2 * i + 1):
            assert out.response_ids[j].tolist() == ref.tolist()
            torch.testing.assert_close(out.log_probs[j], hf_logprobs(model, p, ref), atol=1e-5, rtol=0)
        distinct |= set(ref.tolist())
    assert len(distinct) >= 3  # the weights make varied tokens (the check above can fail)


def test_preemption_chunked_prefill_and_prefix_sharing_same_tokens():
    """Paging pressure (preempt + recompute), chunked prefill of long prompts and shared prompt blocks on the
    generic path give the unconstrained run's tokens and log-probs."""
    config, model = tiny_model("granite")
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, stop_token_ids=[], seed=3)
    free = sampler(config, model).generate(PROMPTS, params)
    tight = sampler(config, model, kv_cache_tokens=96, prefill_tokens=4, block_size=4, slot_regions=False)
    out = tight.generate(PROMPTS, params)
    assert out.stats["preemptions"] > 0 and out.stats["kv_shared_blocks"] > 0
    assert torch.equal(out.response_ids, free.response_ids)
    torch.testing.assert_close(out.log_probs, free.log_probs, atol=1e-5, rtol=0)


def test_generic_path_equals_fast_path_on_a_fast_family():
    """The same qwen2 on both paths: sampled tokens and log-probs agree (the seam's two backends)."""
    config, model = tiny_model("qwen2")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, stop_token_ids=[], seed=1)
    fast = sampler(config, model).generate(PROMPTS, params)
    gen_s = sampler(config, model, generic_path=True)
    assert gen_s.backend.__name__ == "rlhf.rollout.generic"
    gen = gen_s.generate(PROMPTS, params)
    assert torch.equal(gen.response_ids, fast.response_ids)
    torch.testing.assert_close(gen.log_probs, fast.log_probs, atol=1e-5, rtol=0)


def test_load_weights_in_place_matches_a_fresh_sampler():
    config, model = tiny_model("seed_oss")
    _, other = tiny_model("seed_oss", seed=1)
    s = sampler(config, model, reload_in_place=True)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=6, stop_token_ids=[])
    before = s.generate(PROMPTS, params)
    s.load_weights({k: v.clone() for k, v in other.state_dict().items()})
    after = s.generate(PROMPTS, params)
    fresh = sampler(config, other).generate(PROMPTS, params)
    assert torch.equal(after.response_ids, fresh.response_ids) and not torch.equal(after.response_ids,
                                                                                     before.response_ids)


def test_multi_turn_generic_equals_fast():
    """Tool turns: an observation is prefilled onto a parked sequence's cached K/V (chunk mode) and decoding
    resumes; the generic path gives the fast path's trajectories, masks and log-probs."""
    from tests.unit.test_sampler import _model
    from tests.unit.test_sampler_turns import PARAMS, PROMPTS as TURN_PROMPTS, FakeTool

    m = _model()
    fast = Sampler(m.config, m.state_dict(), pad_token_id=0).generate(TURN_PROMPTS, PARAMS, turns=FakeTool())
    gen = Sampler(m.config, m.state_dict(), pad_token_id=0, generic_path=True).generate(TURN_PROMPTS, PARAMS,
                                                                                         turns=FakeTool())
    assert gen.stats["turns"] >= 4
    for f in ("response_ids", "response_mask", "response_lengths", "truncated"):
        assert torch.equal(getattr(gen, f), getattr(fast, f)), f
    torch.testing.assert_close(gen.log_probs, fast.log_probs, atol=1e-5, rtol=0)
