"""DeepSeek-V3 specifics (rlhf/models/deepseek_v3.py, rlhf/models/mla.py) on the tiny config of tests/_archs.py.

The router equals HF's (ids and weights) and its selection bias changes which experts are chosen but never
their weights (replayed weights come from the live router, with gradients); R3 replays the sampler's routes,
selection bias included: a rollout whose bias differs from the trainer's flips routes, and replay makes the
trainer's log-probs the sampler's again; a bf16 rollout keeps the router and its bias in fp32. The other MLA
layout (no q low rank, no interleave, ``v_head_dim > qk_head_dim``) matches HF in the sampler.
Sampler / trainer log-probs against HF for the main config are in test_sampler_archs.py /
test_trainer_archs.py, checkpoint round trips in test_moe_archs.py, tp2 / ep2 in tests/dist/test_grpo_archs.py.
"""

from __future__ import annotations

import pytest
import torch

from tests._archs import tiny_config, tiny_model, write_tiny_model


def test_router_equals_hf_and_the_bias_only_selects():
    from rlhf.models import deepseek_v3
    from rlhf.models.moe import MoESpec, route

    model = tiny_model("deepseek_v3")
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    _, hf_w, hf_i = gate(x)
    spec = MoESpec.from_config(model.config)
    assert spec.sparse == (False, True, True) and spec.shared_intermediate_size == 16  # first_k_dense_replace=1
    w, i = route(spec, x, gate.weight, select_bias=gate.e_score_correction_bias)
    order, hf_order = i.sort(-1), hf_i.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), hf_w.gather(1, hf_order.indices), atol=0, rtol=0)
    _, unbiased = route(spec, x, gate.weight, None)
    assert (unbiased.sort(-1).values != order.values).any(-1).float().mean() > 0.2  # the bias selects
    # replay through the live router: the recorded ids, weights from the sigmoid scores (bias-free)
    with torch.no_grad():
        gate.e_score_correction_bias.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    logits, rw, used, live = deepseek_v3.replay_route(gate, x, hf_i)
    assert torch.equal(used, hf_i) and (live.sort(-1).values != hf_order.values).any()
    torch.testing.assert_close(rw, hf_w, atol=1e-7, rtol=0)
    rw[:, 0].sum().backward()
    assert gate.weight.grad.abs().sum() > 0  # the router learns through the replayed weights


def test_an_expert_shard_with_no_tokens_returns_no_rows():
    from rlhf.models.moe import experts

    x = torch.zeros(0, 8)
    out = experts(x, torch.zeros(0, 1, dtype=torch.long), torch.ones(0, 1), torch.randn(2, 8, 8), torch.randn(2, 8, 4),
                  lambda g, u: g * u)
    assert out.shape == (0, 8)


def test_flops_count_mla_projections():
    from rlhf.ops.flops import matmul_params

    c = tiny_config("deepseek_v3")
    h, heads = 64, 4
    attn = h * 32 + 32 * heads * 24 + h * (16 + 8) + 16 * heads * (16 + 12) + heads * 12 * h  # q_a q_b kv_a kv_b o
    dense, routed = 3 * h * 128, 3 * h * 16 * 2 + h * 8 + 3 * h * 16  # top-2 experts + router + shared expert
    assert matmul_params(c)["layers"] == 3 * attn + dense + 2 * routed


def test_mla_without_q_lora_interleave_and_with_a_wider_value_matches_hf():
    from rlhf.rollout import Sampler, SamplingParams
    from tests.unit.test_sampler import _teacher_forced

    model = tiny_model("deepseek_v3", q_lora_rank=None, rope_interleave=False, v_head_dim=32,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    prompts = [[2, 3, 4, 5, 6, 7], [9, 10]]
    out = Sampler(model.config, model.state_dict(), pad_token_id=0).generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=5, seed=0))
    for row, p in enumerate(prompts):
        r = out.response_ids[row, : int(out.response_lengths[row])].tolist()
        torch.testing.assert_close(out.log_probs[row, : len(r)], _teacher_forced(model, p, r, 1.0), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("deepseek_r3"), "deepseek_v3")


def test_r3_replays_the_rollouts_biased_selection(mesh, model_dir):
    """The rollout's selection bias differs from the trainer's (as after a bias update the sampler has not
    seen): routes flip, but the weights do not depend on the bias, so R3 gives the sampler's log-probs."""
    from tests.unit import test_rollout_routes as rr

    worker = rr._worker(mesh, model_dir, "R3")
    batch, _ = rr._rollout(worker)  # same bias: the sampler's routes are the trainer's
    replay = worker.router_replay
    replay.replay = False
    lp, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=3, record_routes=True)
    assert replay.mismatch(torch.device("cpu"))["moe/routing_mismatch"] == 0.0
    biases = [b for n, b in worker.model.named_buffers() if n.endswith("e_score_correction_bias")]
    with torch.no_grad():
        for b in biases:
            b.add_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    mask, runs = batch.response_mask, {}
    for mode in ("none", "R3"):
        replay.replay = mode == "R3"
        lp, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=3, record_routes=True)
        runs[mode] = dict(gap=float(((lp - batch.rollout_log_probs).abs() * mask).max()),
                          **replay.mismatch(torch.device("cpu")))
    print("R3 figures (deepseek_v3, trainer bias moved):", runs)
    assert runs["none"]["moe/routing_mismatch"] >= 0.05, runs
    assert runs["R3"]["moe/routing_mismatch"] == 0.0 and runs["R3"]["gap"] < 1e-4, runs
    assert runs["R3"]["gap"] * 10 <= runs["none"]["gap"], runs
    # (the update replays through the same router patch; its gradient reaches the router: the test above)


def test_packed_mla_through_a_flash_kernel_that_wants_one_head_dim():
    """flash-attn 2 takes q, k and v of one head dim; MLA's v is narrower (12 vs 24): it is zero-padded for
    the kernel and the output sliced back, so the packed log-probs equal the padded ones."""
    import rlhf.models.varlen_attention as va
    from rlhf.models.logprobs import forward_log_probs
    from rlhf.models.packed import packed_forward_log_probs
    from tests.unit.test_trainer_archs import R, _batch

    model = tiny_model("deepseek_v3")
    ids, mask = _batch()
    dims = []

    def kernel(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], (q.shape, v.shape)
        dims.append(v.shape[-1])
        return va.reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)

    with torch.no_grad():
        padded, _ = forward_log_probs(model, ids, mask, response_length=R, temperature=1.0)
        with va.use_varlen_kernel(kernel):
            packed, _ = packed_forward_log_probs(model, ids, mask, response_length=R, temperature=1.0)
    assert dims == [24] * 3
    resp = mask[:, -R:].bool()
    torch.testing.assert_close(packed[resp], padded[resp], atol=1e-5, rtol=0)


def test_a_bf16_rollout_keeps_the_router_and_its_bias_in_fp32():
    """HF keeps DeepSeek's router weight and selection bias in fp32; a bf16 bias would choose other experts
    than the trainer. The reshard sends them in the master dtype (the bias, a buffer, too)."""
    from rlhf.models.decoder import DecoderSpec, prepare_weights
    from rlhf.rollout.reshard import gather_rollout_weights

    model = tiny_model("deepseek_v3")
    weights, _ = gather_rollout_weights(model, dtype=torch.bfloat16)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert weights[bias].dtype == weights["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert weights["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    lw = prepare_weights(DecoderSpec.from_config(model.config), weights, device=torch.device("cpu"),
                         dtype=torch.bfloat16).layers[1]
    assert lw.router_w.dtype == lw.select_bias.dtype == torch.float32 and lw.mla_q_w.dtype == torch.bfloat16
    assert torch.equal(lw.select_bias, model.model.layers[1].mlp.gate.e_score_correction_bias)
