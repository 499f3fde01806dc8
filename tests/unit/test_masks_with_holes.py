"""Every estimator, loss, KL and metric on response masks with holes (multi-turn tool use).

A multi-turn response interleaves generated tokens (``response_mask`` 1) with tool outputs
(``response_mask`` 0, ``attention_mask`` 1: context, not loss) before the padding. The main
property: on the mask, every algorithm gives the numbers of the same responses with the
holes removed ("compacted"), whatever the masked positions hold. Hand-derived cases pin
the semantics (REINFORCE++ / GAE bridge a masked span; the reward goes on the last
generated token; the overlong penalty and ``response_length/*`` count the trajectory).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import transformers

import rlhf.algos  # noqa: F401  (registers every estimator and loss)
from rlhf.algos.advantages import ADV_ESTIMATOR_REGISTRY, get_adv_estimator, sequence_scores
from rlhf.algos.aggregation import LOSS_AGG_MODES, AggNorm, agg_loss
from rlhf.algos.dynamic_sampling import select_informative_groups
from rlhf.algos.entropy_tools import covariance_sums
from rlhf.algos.kl import apply_kl_penalty
from rlhf.algos.masked import mask_end, masked_whiten
from rlhf.algos.policy_loss import POLICY_LOSS_REGISTRY, PolicyLossParams, get_policy_loss
from rlhf.algos.reward_shaping import place_reward_on_last_token
from rlhf.algos.rollout_correction import rollout_is_weights
from rlhf.algos.value_loss import compute_value_loss, explained_variance
from rlhf.data.batching import seq_lens_from_mask
from rlhf.models.packed import packed_forward_log_probs
from rlhf.models.parallel import make_global_whiten
from rlhf.schema.batch import RolloutBatch
from rlhf.train.ppo_trainer import global_value_stats

# Six responses, R = 8, two groups of three. 1 = generated, 0 = tool output or padding;
# TRAJ = response-side tokens in context (generated + tool output), the rest is padding.
HOLES = torch.tensor([
    [1, 1, 0, 0, 1, 1, 0, 0],  # two turns around a 2-token tool output
    [1, 1, 1, 0, 0, 0, 0, 0],  # single turn
    [1, 0, 1, 0, 1, 1, 1, 0],  # three tool outputs of one token
    [1, 1, 0, 0, 0, 1, 0, 0],
    [1, 1, 1, 1, 1, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0],  # ends on a tool output (cut off while the tool answered)
], dtype=torch.float32)
TRAJ = [6, 3, 7, 6, 5, 4]
INDEX = torch.tensor([0, 0, 0, 1, 1, 1])
SCORES = torch.tensor([1.0, 0.0, 2.0, 0.5, -1.0, 0.25])
B, R = HOLES.shape


def compact(x: torch.Tensor, mask: torch.Tensor = HOLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's masked-in entries moved to the front in order, zeros after; and that prefix mask."""
    order = torch.sort((mask == 0).to(torch.int8), dim=-1, stable=True).indices
    prefix = (torch.arange(mask.shape[-1])[None, :] < mask.sum(-1, keepdim=True)).to(mask.dtype)
    return torch.where(prefix.bool(), x.gather(-1, order), torch.zeros_like(x)), prefix


def on_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]  # row-major: the order of the generated tokens is kept


def garbage(x: torch.Tensor, value: float, mask: torch.Tensor = HOLES) -> torch.Tensor:
    """``x`` with ``value`` at every masked-out position (tool outputs and padding)."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def randn(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------- advantages


def test_reinforce_plus_plus_carries_the_return_across_a_tool_output():
    # Generated tokens at 0, 1, 4, 5; tool output at 2, 3; reward 1 on the last token, gamma 0.5.
    # Skipping the masked span: G_5 = 1, G_4 = 0.5, G_1 = 0.25, G_0 = 0.125 (the compacted
    # [1, 1, 1, 1] response's returns). The old scan reset at position 3: G_0 = G_1 = 0.
    mask = HOLES[:1]
    r = torch.zeros(1, R)
    r[0, 5] = 1.0
    _, ret = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=r, response_mask=mask, gamma=0.5,
                                                      whiten=lambda v, m: v)
    torch.testing.assert_close(ret[0], torch.tensor([0.125, 0.25, 0, 0, 0.5, 1.0, 0, 0]))


def test_gae_bridges_a_tool_output_hand_values():
    # Generated tokens 0 and 2, tool output at 1 (its value 9 and reward 5 must be ignored).
    # t=2: delta = 1 - 0.25 = 0.75 = A_2;  t=0: delta = 0.9 * V_2 - V_0 = -0.275,
    # A_0 = -0.275 + 0.9 * 1.0 * A_2 = 0.4; returns A + V = [0.9, -, 1.0]: one discount step.
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    r = torch.tensor([[0.0, 5.0, 1.0]])
    v = torch.tensor([[0.5, 9.0, 0.25]])
    adv, ret = get_adv_estimator("gae")(token_level_rewards=r, response_mask=mask, values=v, gamma=0.9, lam=1.0,
                                        whiten=lambda x, m: x)
    torch.testing.assert_close(on_mask(adv, mask), torch.tensor([0.4, 0.75]))
    torch.testing.assert_close(on_mask(ret, mask), torch.tensor([0.9, 1.0]))


def _estimator_inputs(holes: bool):
    """Estimator kwargs on the holed batch (garbage on every masked position) or its compacted twin."""
    mask = HOLES
    rewards = place_reward_on_last_token(SCORES, mask) - 0.1 * mask * randn(1, B, R).abs()  # outcome + token KL
    values, lp, teacher = randn(2, B, R), -randn(3, B, R).abs(), -randn(5, B, R).abs()
    s2 = torch.rand(B, R, generator=torch.Generator().manual_seed(4))
    if holes:
        rewards, values, lp, s2 = garbage(rewards, 7.0), garbage(values, 100.0), garbage(lp, -3.0), garbage(s2, 0.9)
        teacher = garbage(teacher, -9.0)
    else:
        (rewards, mask), values, lp, s2 = compact(rewards), compact(values)[0], compact(lp)[0], compact(s2)[0]
        teacher = compact(teacher)[0]
    return mask, dict(token_level_rewards=rewards, response_mask=mask, index=INDEX, values=values,
                      reward_baselines=torch.tensor([0.5, 0.5, 0.5, -0.5, -0.5, -0.5]), gamma=0.9, lam=0.8,
                      reward_components=torch.stack([SCORES, (SCORES > 0).float()], -1), old_log_probs=lp,
                      sum_pi_squared=s2, teacher_log_probs=teacher)


# The plain optimal token baseline compares trajectories position by position by definition;
# its tool-integrated variant is the one that aligns generated tokens (tested here).
POSITIONAL = {"optimal_token_baseline"}


@pytest.mark.parametrize("name", sorted(set(ADV_ESTIMATOR_REGISTRY) - POSITIONAL))
def test_every_estimator_gives_the_compacted_numbers_on_the_mask(name):
    m_h, holed = _estimator_inputs(holes=True)
    m_c, packed = _estimator_inputs(holes=False)
    fn = get_adv_estimator(name)
    adv_h, ret_h = fn(**holed)
    adv_c, ret_c = fn(**packed)
    torch.testing.assert_close(on_mask(adv_h, m_h), on_mask(adv_c, m_c))
    torch.testing.assert_close(on_mask(ret_h, m_h), on_mask(ret_c, m_c))
    assert on_mask(adv_h, m_h).abs().sum() > 0  # not vacuous
    if name != "gae":  # gae leaves its whitened pass-through values there, as verl (no loss reads them)
        assert torch.all(adv_h[~m_h.bool()] == 0)


def test_optimal_token_baseline_zero_tail_starts_where_the_runner_up_ends():
    # Row A ends at 6 with a hole (4 tokens), row B ends at 5 (5 tokens): A is the longest
    # trajectory, B's step 4 has a peer (A). The token count made B "longest" and zeroed
    # B's baseline at step 4, where A is still there.
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 0]])
    r = torch.tensor([[0.0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 2, 0]])
    lp = torch.full((2, 6), math.log(0.5))
    s2 = torch.full((2, 6), 0.5)  # step energy 1 - 2 * 0.5 + 0.5 = 0.5
    adv, _ = get_adv_estimator("optimal_token_baseline")(
        token_level_rewards=r, response_mask=mask, index=[0, 0], old_log_probs=lp, sum_pi_squared=s2, epsilon=0.0)
    # step 4: W_A = 1.5, W_B = 2.5, G_A = 1, G_B = 2 -> B_4 = (1.5 + 5) / 4 = 1.625
    assert adv[1, 4].item() == pytest.approx(2.0 - 1.625)
    assert adv[0, 4].item() == pytest.approx(1.0 - 1.625)
    assert adv[0, 5].item() == pytest.approx(1.0)  # A alone past B's end: zero baseline


def test_reward_on_the_last_generated_token_and_mask_end():
    out = place_reward_on_last_token(SCORES, HOLES)
    last = [5, 2, 6, 5, 4, 1]  # not mask.sum() - 1 = [3, 2, 4, 2, 4, 1], nor the trajectory's last token
    expected = torch.zeros(B, R)
    expected[torch.arange(B), torch.tensor(last)] = SCORES
    torch.testing.assert_close(out, expected)
    assert mask_end(HOLES).tolist() == [6, 3, 7, 6, 5, 2]
    assert mask_end(torch.zeros(1, 4)).tolist() == [0]


def test_kl_in_reward_ignores_tool_outputs_and_does_not_leak_into_returns():
    # KL 1 on generated tokens, 4 on the tool output: the reward and the logged KL see only the former,
    # so REINFORCE++'s return at token 0 is the two later penalties and the score (gamma 1).
    mask = torch.tensor([[1.0, 0, 1, 1]])
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -5.0, -2.0, -2.0]])
    scores = place_reward_on_last_token(torch.tensor([3.0]), mask)
    rewards, m = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.5, kl_penalty="kl")
    torch.testing.assert_close(rewards, torch.tensor([[-0.5, 0.0, -0.5, 2.5]]))
    assert m["kl"].item() == pytest.approx(1.0)
    _, ret = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=rewards, response_mask=mask, gamma=1.0,
                                                      whiten=lambda v, mm: v)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 0.0, 2.0, 2.5]]))


def test_whitening_uses_the_generated_tokens_only():
    x = randn(5, B, R)
    xc, mc = compact(x)
    local = masked_whiten(garbage(x, float("inf")), HOLES)
    glob = make_global_whiten(None)(garbage(x, 1e6), HOLES)
    torch.testing.assert_close(on_mask(local, HOLES), on_mask(masked_whiten(xc, mc), mc))
    torch.testing.assert_close(on_mask(glob, HOLES), on_mask(masked_whiten(xc, mc), mc), rtol=1e-5, atol=1e-5)


def test_dynamic_sampling_sees_the_outcome_of_holed_rows():
    # group 0 scores [1, 0, 2] (kept), group 1 all 0.5 (dropped)
    scores = sequence_scores(place_reward_on_last_token(torch.tensor([1.0, 0, 2, 0.5, 0.5, 0.5]), HOLES), HOLES)
    keep, kept, dropped = select_informative_groups(INDEX, scores)
    assert keep.tolist() == [True] * 3 + [False] * 3 and (kept, dropped) == (1, 1)


# ----------------------------------------------------------------------------- losses


def test_aggregation_modes_count_generated_tokens_hand_values():
    loss = torch.ones(B, R)
    gen = HOLES.sum(-1)  # [4, 3, 5, 3, 5, 2], 22 tokens
    norm = AggNorm(global_tokens=22.0, global_seqs=6.0, max_response_len=10)
    expected = {"token-mean": 1.0, "token-sum": 22.0, "seq-mean-token-sum": 22 / 6, "seq-mean-token-mean": 1.0,
                "seq-mean-token-sum-norm": 22 / 6 / 10}
    for mode in LOSS_AGG_MODES:
        assert agg_loss(garbage(loss, float("nan")), HOLES, mode, norm).item() == pytest.approx(expected[mode]), mode
    assert gen.tolist() == [4, 3, 5, 3, 5, 2]


def test_gspo_sequence_ratio_and_sequence_is_weights_use_generated_tokens():
    # log-ratio 0.1 on the 4 generated tokens of row 0, 2.0 on its tool output: s = exp(0.1)
    mask = HOLES[:1]
    old = torch.full((1, R), -1.0, dtype=torch.float64)
    lp = garbage(old + 0.1, 1.0, mask)
    loss, _ = get_policy_loss("gspo")(old, lp, torch.ones(1, R, dtype=torch.float64), mask, clip_ratio_low=0.5,
                                      clip_ratio_high=0.5, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(-math.exp(0.1))
    w = rollout_is_weights(lp, old, mask, "sequence", threshold=10.0)  # exp(sum of 4 x 0.1)
    torch.testing.assert_close(w, torch.full((1, R), math.exp(0.4), dtype=torch.float64))


def _loss_inputs(holes: bool):
    old, lp, roll = -randn(6, B, R, dtype=torch.float64).abs(), -randn(7, B, R, dtype=torch.float64).abs(), \
        -randn(8, B, R, dtype=torch.float64).abs()
    adv, sel = randn(9, B, R, dtype=torch.float64), (randn(10, B, R) > 1.0).to(torch.float64)
    if holes:
        fill = dict(zip(("old", "lp", "roll", "adv", "sel"), (-0.01, -4.0, -0.02, 50.0, 1.0)))
        old, lp, roll, adv, sel = (garbage(t, fill[k]) for k, t in zip(fill, (old, lp, roll, adv, sel)))
        mask = HOLES
    else:
        (old, mask), lp, roll, adv, sel = compact(old), compact(lp)[0], compact(roll)[0], compact(adv)[0], \
            compact(sel)[0]
    return old, lp.clone().requires_grad_(True), roll, adv, sel, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSS_REGISTRY))
def test_every_policy_loss_gives_the_compacted_loss_and_no_gradient_on_tool_outputs(name, mode):
    params = PolicyLossParams(dro_beta=0.5, rollout_is="sequence", loss_type="reinforce")
    norm = AggNorm(global_tokens=float(HOLES.sum()), global_seqs=float(B), max_response_len=R)
    results = []
    for holes in (True, False):
        old, lp, roll, adv, sel, mask = _loss_inputs(holes)
        loss, metrics = get_policy_loss(name)(old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3,
                                             loss_agg_mode=mode, norm=norm, rollout_log_probs=roll,
                                             tis_imp_ratio_cap=1.5, params=params, cov_select=sel)
        loss.backward()
        results.append((loss.detach(), metrics, lp.grad, mask))
    (l_h, m_h, g_h, mask_h), (l_c, m_c, g_c, mask_c) = results
    torch.testing.assert_close(l_h, l_c)
    assert m_h.keys() == m_c.keys()
    for k in m_h:
        torch.testing.assert_close(m_h[k].double(), m_c[k].double(), msg=lambda s, k=k: f"{k}: {s}")
    assert torch.all(g_h[~mask_h.bool()] == 0)  # tool outputs and padding carry no gradient
    torch.testing.assert_close(on_mask(g_h, mask_h), on_mask(g_c, mask_c))
    assert g_h.abs().sum() > 0


def test_value_loss_explained_variance_entropy_and_covariance_use_generated_tokens():
    v_new, v_old, ret, ent = (randn(s, B, R) for s in (11, 12, 13, 14))
    (vn_c, mc), vo_c, r_c, e_c = compact(v_new), compact(v_old)[0], compact(ret)[0], compact(ent)[0]
    vn_h, vo_h, r_h, e_h = garbage(v_new, 30.0), garbage(v_old, -30.0), garbage(ret, 80.0), garbage(ent, 9.0)
    norm = AggNorm(global_tokens=float(HOLES.sum()), global_seqs=float(B), max_response_len=R)
    for mode in LOSS_AGG_MODES:
        got = compute_value_loss(vn_h, vo_h, r_h, HOLES, cliprange_value=0.2, loss_agg_mode=mode, norm=norm)
        want = compute_value_loss(vn_c, vo_c, r_c, mc, cliprange_value=0.2, loss_agg_mode=mode, norm=norm)
        torch.testing.assert_close(torch.stack(got), torch.stack(want))
        torch.testing.assert_close(agg_loss(e_h, HOLES, mode, norm), agg_loss(e_c, mc, mode, norm))
    torch.testing.assert_close(explained_variance(vo_h, r_h, HOLES), explained_variance(vo_c, r_c, mc))
    got, want = global_value_stats(vo_h, r_h, HOLES), global_value_stats(vo_c, r_c, mc)
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k]) for k in got)
    torch.testing.assert_close(covariance_sums(e_h, vo_h, HOLES), covariance_sums(e_c, vo_c, mc))


# ----------------------------------------------------------------------------- trainer bookkeeping


def _rollout_batch(P: int = 3) -> RolloutBatch:
    traj = (torch.arange(R)[None, :] < torch.tensor(TRAJ)[:, None]).long()  # tool outputs are context
    ids = torch.randint(5, 60, (B, P + R), generator=torch.Generator().manual_seed(0))
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), traj], dim=1)
    ids = ids * attn
    return RolloutBatch(input_ids=ids, attention_mask=attn, responses=ids[:, P:], response_mask=HOLES.clone(),
                        index=INDEX.clone(), rollout_log_probs=torch.zeros(B, R),
                        truncated=torch.tensor([False, False, False, False, False, True]))


def test_trajectory_and_generated_lengths_and_token_budgets():
    batch = _rollout_batch(P=3)
    assert batch.trajectory_lengths().tolist() == TRAJ
    assert batch.generated_lengths().tolist() == [4, 3, 5, 3, 5, 2]
    # token-budget micro-batching (actor, critic) sizes a row by its context, tool outputs included
    assert seq_lens_from_mask(batch.attention_mask) == [3 + t for t in TRAJ]


def _trainer_stub(batch: RolloutBatch, **reward):
    from rlhf.rewards.scoring import ScoreResult
    from rlhf.rewards.scoring import FailedStepGuard
    from rlhf.schema.config import Config
    from rlhf.train.trainer import RLTrainer

    cfg = Config()
    cfg.data.max_response_length = R
    for k, v in reward.items():
        setattr(cfg.reward, k, v)
    stub = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), dp_group=None, _streamed=None, reward_model=None,
                           env=SimpleNamespace(is_main=False), timer=lambda name: contextlib.nullcontext(),
                           scorer=SimpleNamespace(score=lambda *a: ScoreResult(scores=SCORES.clone())),
                           reward_guard=FailedStepGuard(0, 1.0))
    stub._global_means = lambda *a, **k: RLTrainer._global_means(stub, *a, **k)
    return stub, RLTrainer


def test_overlong_penalty_counts_the_trajectory_and_reward_sits_on_the_last_generated_token(mesh):
    batch = _rollout_batch()
    stub, trainer = _trainer_stub(batch, overlong_buffer_enable=True, overlong_buffer_len=4)
    trainer.score(stub, batch)
    # L_max 8, buffer 4: free up to 4 tokens. Trajectories [6, 3, 7, 6, 5, 4] -> [-0.5, 0, -0.75, -0.5, -0.25, 0];
    # generated counts [4, 3, 5, 3, 5, 2] would have penalised only rows 2 and 4.
    penalty = torch.tensor([-0.5, 0.0, -0.75, -0.5, -0.25, 0.0])
    torch.testing.assert_close(batch.token_level_scores, place_reward_on_last_token(SCORES + penalty, HOLES))


def test_response_length_metrics_report_trajectory_and_generated_tokens(mesh):
    batch = _rollout_batch()
    batch.token_level_scores = place_reward_on_last_token(SCORES, HOLES)
    batch.acc = (SCORES >= 1).float()
    stub, trainer = _trainer_stub(batch)
    out = trainer.batch_metrics(stub, batch)
    assert out["response_length/mean"] == pytest.approx(sum(TRAJ) / B)
    assert out["response_length/max"] == 7
    assert out["response_length/generated_mean"] == pytest.approx(22 / B)
    assert out["response_length/clip_ratio"] == pytest.approx(1 / B)


# ----------------------------------------------------------------------------- model paths


def _tiny_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model.float()


def _padded_log_probs(model, ids, attn, R_):
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, -R_ - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -R_:, None]).squeeze(-1)


def test_packed_log_probs_keep_tool_outputs_as_context_and_they_carry_no_gradient():
    model = _tiny_model()
    batch = _rollout_batch(P=3)
    ids, attn = batch.input_ids, batch.attention_mask
    lp, _ = packed_forward_log_probs(model, ids, attn, response_length=R)
    ref = _padded_log_probs(model, ids, attn, R)
    torch.testing.assert_close(on_mask(lp, HOLES), on_mask(ref, HOLES), rtol=1e-5, atol=1e-5)
    # Dropping the tool output of row 0 (positions 2, 3) from the context changes its next turn's log-probs.
    cut = attn.clone()
    cut[0, 3 + 2:3 + 4] = 0
    assert not torch.allclose(packed_forward_log_probs(model, ids, cut, response_length=R)[0][0, 4:6], lp[0, 4:6])

    # The PPO loss's parameter gradient does not depend on what sits on tool-output positions.
    def grads(fill: float):
        model.zero_grad()
        lp, _ = packed_forward_log_probs(model, ids, attn, response_length=R)
        old = garbage(lp.detach() - 0.05, fill)
        adv = garbage(randn(15, B, R), 40.0 * fill)
        loss, _ = get_policy_loss("vanilla")(old, lp, adv, HOLES, clip_ratio_low=0.2, clip_ratio_high=0.2)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    g1, g2 = grads(-0.5), grads(-3.0)
    torch.testing.assert_close(g1, g2)
    assert g1.abs().sum() > 0
