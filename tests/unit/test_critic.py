"""The critic: value-model loading, value positions, and the clipped value update (rlhf.train.critic)."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhf.schema.batch import RolloutBatch
from rlhf.schema.config import ConfigError, CriticConfig, ModelConfig
from rlhf.train.critic import CriticWorker, load_value_model

P, R = 5, 4


def _qwen_cfg(**kw) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("lm")
    transformers.Qwen2ForCausalLM(_qwen_cfg()).save_pretrained(d)
    return str(d)


def _batch() -> RolloutBatch:
    """Row 0: prompt 3 tokens, response 4; row 1: prompt 5 tokens, response 2 (padded)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (2, P + R), generator=g)
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0, 0]])
    ids = ids * attn
    resp_mask = attn[:, P:].float()
    return RolloutBatch(input_ids=ids, attention_mask=attn, responses=ids[:, P:], response_mask=resp_mask,
                        index=torch.arange(2), rollout_log_probs=torch.zeros(2, R),
                        truncated=torch.zeros(2, dtype=torch.bool))


def _critic(mesh, *, build=None, path="", **cfg_kw) -> CriticWorker:
    cfg = CriticConfig(**{"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 1e9, **cfg_kw})
    return CriticWorker(cfg, ModelConfig(path=path), mesh, torch.device("cpu"), total_steps=10,
                        max_response_length=R, build_model=build)


def _token_cls(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = _qwen_cfg(num_labels=1)
    cfg.classifier_dropout = 0.0
    model = transformers.Qwen2ForTokenClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    return model


def test_value_model_from_actor_has_zero_head_and_actor_backbone(lm_dir):
    lm = transformers.Qwen2ForCausalLM.from_pretrained(lm_dir)
    critic = load_value_model(lm_dir)
    assert isinstance(critic, transformers.Qwen2ForTokenClassification)
    assert critic.score.weight.abs().sum() == 0 and critic.score.bias.abs().sum() == 0
    for name, p in lm.model.named_parameters():
        torch.testing.assert_close(dict(critic.model.named_parameters())[name], p, rtol=0, atol=0)
    assert critic.dropout.p == 0.0  # dropout would make values layout-dependent


def test_value_model_from_reward_model_reuses_score_head(tmp_path):
    torch.manual_seed(3)
    rm = transformers.Qwen2ForSequenceClassification(_qwen_cfg(num_labels=1)).eval()
    rm.save_pretrained(tmp_path)
    critic = load_value_model(str(tmp_path)).eval()
    torch.testing.assert_close(critic.score.weight, rm.score.weight, rtol=0, atol=0)
    assert critic.score.bias.abs().sum() == 0
    ids = torch.tensor([[5, 9, 11, 7]])
    # The critic's value at the last token is the reward model's score of the sequence.
    torch.testing.assert_close(critic(input_ids=ids).logits[0, -1, 0], rm(input_ids=ids).logits[0, 0])


def test_value_model_rejects_multi_label_checkpoint(tmp_path):
    transformers.Qwen2ForSequenceClassification(_qwen_cfg(num_labels=2)).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="num_labels=2"):
        load_value_model(str(tmp_path))


def test_compute_values_at_positions_predicting_response_tokens(mesh):
    batch = _batch()
    worker = _critic(mesh, build=lambda: _token_cls(7))
    values = worker.compute_values(batch, micro_batch_size=1)  # [2, R]
    ref = _token_cls(7).eval()
    for i, (p_len, r_len) in enumerate([(3, 4), (5, 2)]):
        real = batch.input_ids[i][batch.attention_mask[i].bool()]
        logits = ref(input_ids=real[None]).logits[0, :, 0]  # unpadded sequence
        # response token t is predicted from position p_len + t - 1
        expect = torch.zeros(R)
        expect[:r_len] = logits[p_len - 1:p_len - 1 + r_len]
        torch.testing.assert_close(values[i], expect, rtol=1e-5, atol=1e-5)
    assert values[1, 2:].abs().sum() == 0  # zero outside the response mask


def test_update_hand_values_and_micro_batch_invariance(mesh, lm_dir):
    batch = _batch()
    batch.values = torch.zeros(2, R)
    batch.returns = torch.full((2, R), 2.0)
    results = []
    for micro in (1, 2):
        worker = _critic(mesh, path=lm_dir, ppo_micro_batch_size_per_gpu=micro, cliprange_value=100.0)
        assert worker.compute_values(batch, micro_batch_size=2).abs().sum() == 0  # zero head
        m = worker.update_critic(batch, mini_batch_rows=2)
        # V = 0 everywhere: loss = 0.5 * mean((0 - 2)^2) = 2 over the 6 response tokens
        assert m["critic/vf_loss"] == pytest.approx(2.0, abs=1e-6)
        assert m["critic/vf_clipfrac"] == 0.0 and m["critic/vpred_mean"] == pytest.approx(0.0, abs=1e-7)
        assert m["critic/lr"] == pytest.approx(1e-2)
        results.append((m, {n: p.full_tensor().clone() for n, p in worker.model.named_parameters()},
                        worker.compute_values(batch, micro_batch_size=2)))
    (m1, p1, v1), (m2, p2, v2) = results
    assert m1["critic/grad_norm"] == pytest.approx(m2["critic/grad_norm"], rel=1e-5)
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-5, atol=1e-6)
    assert (v1 * batch.response_mask).sum() > 0  # values moved towards the returns


def test_value_clipping_blocks_the_gradient(mesh, lm_dir):
    # Old values 1, new V = 0, returns -1, clip 0.1: V_clip = 0.9, (0.9 + 1)^2 = 3.61 > (0 + 1)^2 = 1,
    # so the clipped (constant) branch wins everywhere: loss 0.5 * 3.61, clipfrac 1, no gradient.
    batch = _batch()
    batch.values = torch.ones(2, R) * batch.response_mask
    batch.returns = -torch.ones(2, R)
    worker = _critic(mesh, path=lm_dir, cliprange_value=0.1)
    before = {n: p.full_tensor().clone() for n, p in worker.model.named_parameters()}
    m = worker.update_critic(batch, mini_batch_rows=2)
    assert m["critic/vf_loss"] == pytest.approx(0.5 * 3.61, abs=1e-5)
    assert m["critic/vf_clipfrac"] == 1.0
    assert m["critic/grad_norm"] == 0.0
    for n, p in worker.model.named_parameters():
        assert torch.equal(p.full_tensor(), before[n]), n


def _batch4() -> RolloutBatch:
    """Four rows of different prompt / response lengths (left-padded prompt, right-padded response)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 40, (4, P + R), generator=g)
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1],    # 3 + 4
                         [1, 1, 1, 1, 1, 1, 1, 0, 0],    # 5 + 2
                         [0, 0, 0, 0, 1, 1, 0, 0, 0],    # 1 + 1
                         [0, 1, 1, 1, 1, 1, 1, 1, 0]])   # 4 + 3
    ids = ids * attn
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, responses=ids[:, P:], response_mask=attn[:, P:].float(),
                         index=torch.arange(4), rollout_log_probs=torch.zeros(4, R),
                         truncated=torch.zeros(4, dtype=torch.bool))
    batch.returns = torch.randn(4, R, generator=g)
    return batch


def _capture_grads(worker: CriticWorker) -> list[dict[str, torch.Tensor]]:
    """Record the (full) gradients at every optimizer step of ``worker``."""
    seen: list[dict[str, torch.Tensor]] = []
    step = worker.optimizer.step

    def recording_step(*a, **kw):
        seen.append({n: p.grad.full_tensor().clone() for n, p in worker.model.named_parameters()
                     if p.grad is not None})
        return step(*a, **kw)

    worker.optimizer.step = recording_step
    return seen


def test_packed_dynamic_batch_values_and_grads_equal_padded_fixed(mesh):
    batch = _batch4()
    ref = _critic(mesh, build=lambda: _token_cls(7), ppo_micro_batch_size_per_gpu=2, cliprange_value=0.2)
    cfg = CriticConfig(lr=1e-2, weight_decay=0.0, grad_clip=1e9, ppo_micro_batch_size_per_gpu=2, cliprange_value=0.2,
                       ppo_max_token_len_per_gpu=9)
    packed = CriticWorker(cfg, ModelConfig(use_remove_padding=True), mesh, torch.device("cpu"), total_steps=10,
                          max_response_length=R, build_model=lambda: _token_cls(7), use_dynamic_bsz=True,
                          forward_max_token_len=8)
    # Token budgets really change the micro-batches: sequence lengths 7, 7, 2, 7 -> 3 (update) / 3 (forward).
    assert [len(r) for r in packed._micro_batches(batch, 2, 9)] != [2, 2]
    assert sorted(torch.cat(packed._micro_batches(batch, 2, 8)).tolist()) == [0, 1, 2, 3]

    v_ref = ref.compute_values(batch, micro_batch_size=2)
    v_pk = packed.compute_values(batch, micro_batch_size=2)
    torch.testing.assert_close(v_pk, v_ref, rtol=0, atol=1e-5)
    assert v_ref.abs().sum() > 0 and (v_pk * (1 - batch.response_mask)).abs().sum() == 0

    # Old values away from the current ones so that the clipped branch is taken on some tokens.
    batch.values = (v_ref + 0.3 * torch.randn(v_ref.shape, generator=torch.Generator().manual_seed(5))) \
        * batch.response_mask
    grads_ref, grads_pk = _capture_grads(ref), _capture_grads(packed)
    m_ref = ref.update_critic(batch, mini_batch_rows=4)
    m_pk = packed.update_critic(batch, mini_batch_rows=4)
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
        assert m_pk[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key
    assert 0 < m_ref["critic/vf_clipfrac"] < 1
    assert m_pk["critic/vf_clipfrac"] == pytest.approx(m_ref["critic/vf_clipfrac"], abs=1e-6)
    assert len(grads_ref) == len(grads_pk) == 1 and set(grads_ref[0]) == set(grads_pk[0])
    for name, g in grads_ref[0].items():
        torch.testing.assert_close(grads_pk[0][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert max(float(g.abs().max()) for g in grads_ref[0].values()) > 1e-3


def test_no_fsdp_view_warning_from_the_critic(mesh):
    """Issue 39 item 13: the packed critic's head output is a view of a 2-D matmul; FSDP2 warned on every
    rank. The output is copied (T scalars), so no warning, and values / the update are unchanged."""
    import warnings

    batch = _batch4()
    cfg = CriticConfig(lr=1e-2, weight_decay=0.0, grad_clip=1e9, ppo_micro_batch_size_per_gpu=2)
    packed = CriticWorker(cfg, ModelConfig(use_remove_padding=True), mesh, torch.device("cpu"), total_steps=10,
                          max_response_length=R, build_model=lambda: _token_cls(7))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        batch.values = packed.compute_values(batch, micro_batch_size=2)
        batch.returns = batch.values + 0.1
        packed.update_critic(batch, mini_batch_rows=4)
    assert not [w for w in seen if "view tensor" in str(w.message)]
