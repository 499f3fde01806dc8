"""Decoupled rollout correction (rlhf/algos/rollout_corr.py) on hand-computed cases with holes.

Every expected value below is worked out by hand from verl's definitions
(``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask`` and its earlier token/sequence/geometric + veto form,
``compute_offpolicy_metrics``) and AReaL's ``ppo_actor_loss_fn`` (decoupled loss).

The batch: log ratios ``lr = log pi_old - log pi_rollout``; holes carry garbage (5.0, -9.0) that
must never count; row 2 is empty.
"""

import math

import pytest
import torch

from rlhf.algos.policy_loss import compute_policy_loss_vanilla
from rlhf.algos.rollout_corr import (decoupled_behav_weights, is_weights, mismatch_metrics, parse_rs_thresholds,
                                     rejection_mask, token_veto_mask)
from rlhf.schema.batch import RolloutBatch
from rlhf.schema.config import ActorConfig
from rlhf.train.rollout_corr import apply_rollout_correction

L15, L4, L3 = math.log(1.5), math.log(4.0), math.log(3.0)
LR = torch.tensor([[L15, 5.0, -L4], [L3, 0.1, -9.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float64)
E01 = math.exp(0.1)


def _close(a, b):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=1e-7, atol=1e-7)


def test_token_is_weights_truncated_zero_on_holes_and_batch_normalised():
    w, f = is_weights(LR, MASK, "token", 2.5)
    _close(w, [[1.5, 0, 0.25], [2.5, E01, 0], [0, 0, 0]])  # exp(ln 3) = 3 truncated at 2.5
    _close(f, 1.0)
    wn, f = is_weights(LR, MASK, "token", 2.5, batch_normalize=True)
    mean = (1.5 + 0.25 + 2.5 + E01) / 4  # over the 4 valid tokens only
    _close(f, mean)
    _close(wn, w / mean)


def test_sequence_is_weights_and_batch_norm_over_sequences():
    w, _ = is_weights(LR, MASK, "sequence", 2.5)
    # row 0: exp(ln 1.5 - ln 4) = 0.375; row 1: exp(ln 3 + 0.1) = 3.32 -> 2.5; empty row 0
    _close(w, [[0.375, 0, 0.375], [2.5, 2.5, 0], [0, 0, 0]])
    wn, f = is_weights(LR, MASK, "sequence", 2.5, batch_normalize=True)
    _close(f, (0.375 + 2.5) / 2)  # mean over the 2 sequences with tokens, not over tokens
    _close(wn, w / f)
    # rows of unequal length: the sequence mean (1.5 + 2.5) / 2, not the token mean 6.5 / 3
    short = MASK.clone()
    short[0, 2] = 0
    _, f = is_weights(LR, short, "sequence", 2.5, batch_normalize=True)
    _close(f, 2.0)


def test_batch_norm_is_global_over_ranks():
    """Rows split over two 'ranks' with a summing global_sum give the one-rank weights."""
    full, _ = is_weights(LR, MASK, "token", 2.5, batch_normalize=True)
    seen = []
    is_weights(LR[1:], MASK[1:], "token", 2.5, batch_normalize=True, global_sum=lambda t: seen.append(t) or t)
    part, _ = is_weights(LR[:1], MASK[:1], "token", 2.5, batch_normalize=True, global_sum=lambda t: t + seen[0])
    _close(part, full[:1])


@pytest.mark.parametrize("rs, thr, lower, kept", [
    # verl's k1/k2/k3 options; k1 bounds -lr by [log lower, log upper]
    ("token_k1", "0.5_2.0", None, [[1, 0, 0], [0, 1, 0]]),
    ("token_k1", 2.0, None, [[1, 0, 0], [0, 1, 0]]),  # one number u = "1/u_u"
    ("token_k2", "0.5", None, [[1, 0, 0], [0, 1, 0]]),  # lr^2/2: .082 .961 | .603 .005
    ("token_k3", "0.5", None, [[1, 0, 0], [0, 1, 0]]),  # e^lr-1-lr: .095 .636 | .901 .005
    ("seq_sum_k1", "0.5_3.0", None, [[1, 0, 1], [0, 0, 0]]),  # -sum lr: .981 | -1.199
    ("seq_sum_k2", "1.0", None, [[0, 0, 0], [1, 1, 0]]),  # 1.043 | .608
    ("seq_sum_k3", "0.8", None, [[1, 0, 1], [0, 0, 0]]),  # .731 | .906
    ("seq_mean_k1", "0.6_2.0", None, [[1, 0, 1], [0, 0, 0]]),  # geometric filter: .490 | -.599 < log .6
    ("seq_mean_k2", "0.5", None, [[0, 0, 0], [1, 1, 0]]),  # .522 | .304
    ("seq_mean_k3", "0.4", None, [[1, 0, 1], [0, 0, 0]]),  # .365 | .453
    ("seq_max_k2", "0.7", None, [[0, 0, 0], [1, 1, 0]]),  # .961 | .603 (holes: 12.5, 40.5 ignored)
    ("seq_max_k3", "0.7", None, [[1, 0, 1], [0, 0, 0]]),  # .636 | .901
    ("token_k1,seq_max_k2", "0.5_2.0,0.7", None, [[0, 0, 0], [0, 1, 0]]),  # every option must pass
    # verl's earlier modes: rho (token), exp(sum lr) (sequence), exp(mean lr) (geometric) in [lower, upper]
    ("token", "2.0", None, [[1, 0, 0], [0, 1, 0]]),
    ("sequence", "3.0", None, [[1, 0, 1], [0, 0, 0]]),  # .375 >= 1/3 | 3.32 > 3
    ("geometric", "1.7", None, [[1, 0, 1], [0, 0, 0]]),  # .612 >= 1/1.7 | 1.82 > 1.7
    ("geometric", "1.7", 0.65, [[0, 0, 0], [0, 0, 0]]),  # explicit lower bound .65 > .612
    # IcePop (drop tokens with rho outside [0.5, 5]) in both spellings
    ("token", "5.0", 0.5, [[1, 0, 0], [1, 1, 0]]),
    ("token_k1", "0.2_2.0", None, [[1, 0, 0], [1, 1, 0]]),
])
def test_rejection_options(rs, thr, lower, kept):
    out = rejection_mask(LR, MASK, rs, thr, lower)
    _close(out, kept + [[0, 0, 0]])  # the empty row stays empty


def test_token_veto_rejects_whole_sequences_ignoring_holes():
    # row 0 holds rho = 0.25 < 0.3; row 1's hole (lr = -9) must not veto it
    _close(token_veto_mask(LR, MASK, 0.3), [[0, 0, 0], [1, 1, 0], [0, 0, 0]])


@pytest.mark.parametrize("rs, thr, msg", [
    ("token_k9", "1", "unknown option 'token_k9'"),
    ("token,seq_max_k2", "1", "cannot be combined"),
    ("token_k1,token_k2", "1,2,3", "expected 1 or 2"),
    ("token_k2", "0.5_2.0", "one upper bound, no '_'"),
    ("token_k1", "-1_2", "must be positive"),
])
def test_bad_rejection_options_name_the_key(rs, thr, msg):
    with pytest.raises(ValueError, match=msg):
        rejection_mask(LR, MASK, rs, thr)


def test_threshold_parsing_matches_verl():
    got = parse_rs_thresholds(["token_k1", "seq_max_k3"], "0.5_2.0,0.1")
    assert got == {"token_k1": (0.5, 2.0), "seq_max_k3": (None, 0.1)}
    assert parse_rs_thresholds(["seq_mean_k1"], 4.0) == {"seq_mean_k1": (0.25, 4.0)}


def test_mismatch_metrics_by_hand_and_global():
    roll = torch.full_like(LR, -1.0)
    old = roll + LR
    w, _ = is_weights(LR, MASK, "token", 2.5)
    kept = rejection_mask(LR, MASK, "token_k1", "0.5_2.0")
    m = mismatch_metrics(old, roll, MASK, weights=w, kept=kept)
    valid = [L15, -L4, L3, 0.1]
    _close(m["mismatch/kl"], -sum(valid) / 4)
    _close(m["mismatch/k3_kl"], sum(math.exp(x) - x - 1 for x in valid) / 4)
    r0, r1 = (L15 - L4) / 2, (L3 + 0.1) / 2  # per-sequence mean log ratio
    _close(m["mismatch/ppl_ratio"], (math.exp(-r0) + math.exp(-r1)) / 2)
    _close(m["mismatch/training_ppl"], (math.exp(1 - r0) + math.exp(1 - r1)) / 2)
    _close(m["mismatch/rollout_ppl"], math.e)
    _close(m["mismatch/chi2_token"], sum(math.exp(2 * x) for x in valid) / 4 - 1)
    _close(m["mismatch/is_weight_mean"], (1.5 + 0.25 + 2.5 + E01) / 4)
    _close(m["mismatch/is_weight_max"], 2.5)
    _close(m["mismatch/is_weight_min"], 0.25)
    _close(m["mismatch/rejected_frac"], 2 / 4)
    _close(m["mismatch/rejected_seq_frac"], 2 / 2)
    # two 'ranks' (rows 0 | rows 1-2) with summing / max-ing reductions give the same figures
    seen = {}
    mismatch_metrics(old[1:], roll[1:], MASK[1:], weights=w[1:], kept=kept[1:],
                     global_sum=lambda t: seen.setdefault("s", t), global_max=lambda t: seen.setdefault("m", t))
    part = mismatch_metrics(old[:1], roll[:1], MASK[:1], weights=w[:1], kept=kept[:1],
                            global_sum=lambda t: t + seen["s"], global_max=lambda t: torch.maximum(t, seen["m"]))
    for k, v in m.items():
        _close(part[k], v)


def _ppo(old, logp, adv, mask, weights=None):
    return compute_policy_loss_vanilla(old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                       clip_ratio_c=3.0, rollout_is_weights=weights)


def test_decoupled_ppo_equals_areal_by_hand():
    """AReaL: L = sum_t max(-A r, -A clip(r)) * w_t / n_valid, r = pi/pi_prox, w = pi_prox/pi_behav,
    w = 0 where w > cap (the token stays in the normaliser)."""
    prox = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64).log_softmax(-1)  # log 1/4
    behav = prox + torch.tensor([[0.0, -math.log(2.0), -math.log(5.0), 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    w = decoupled_behav_weights(prox, behav, mask, cap=3.0)
    _close(w, [[1.0, 2.0, 0.0, 0.0]])  # 5 > cap -> 0; hole -> 0
    _close(decoupled_behav_weights(prox, behav, mask, cap=None), [[1.0, 2.0, 5.0, 0.0]])
    logp = (prox + torch.tensor([[0.1, 0.3, 0.0, 0.0]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    loss, _ = _ppo(prox, logp, adv, mask, w)
    # token 0: r = e^.1 = 1.105 (inside 1.2) -> -1.105 * 1; token 1: r = e^.3 = 1.35 clipped -> -1.2 * 2
    _close(loss, (-E01 * 1.0 - 1.2 * 2.0 + 0.0) / 3)


def test_decoupled_ppo_with_behaviour_equal_proximal_is_plain_ppo_exactly():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 6, generator=g, dtype=torch.float64) - 2
    logp0 = old + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) > 0.3).double()
    w = decoupled_behav_weights(old, old.clone(), mask, cap=5.0)
    assert torch.equal(w, mask)
    a, b = logp0.clone().requires_grad_(), logp0.clone().requires_grad_()
    la, ma = _ppo(old, a, adv, mask, w)
    lb, mb = _ppo(old, b, adv, mask)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad)
    assert all(torch.equal(ma[k], mb[k]) for k in mb)


def test_step_phase_masks_weights_and_reports():
    """rlhf/train/rollout_corr.py on one rank: rejection shrinks the mask, weights land on the batch."""
    n, r = LR.shape
    roll = torch.full_like(LR, -1.0)
    batch = RolloutBatch(input_ids=torch.zeros(n, 2 + r, dtype=torch.long), attention_mask=torch.ones(n, 2 + r),
                         responses=torch.zeros(n, r, dtype=torch.long), response_mask=MASK.clone(),
                         index=torch.arange(n), rollout_log_probs=roll, truncated=torch.zeros(n, dtype=torch.bool),
                         old_log_probs=roll + LR)
    cfg = ActorConfig(rollout_is_decoupled=True, rollout_is="token", rollout_is_threshold=2.5,
                      rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0", rollout_token_veto_threshold=0.3)
    m = apply_rollout_correction(batch, cfg, None)
    _close(batch.response_mask, [[0, 0, 0], [0, 1, 0], [0, 0, 0]])  # row 0 vetoed, ln 3 rejected
    _close(batch.rollout_is_weights, is_weights(LR, MASK, "token", 2.5)[0])
    assert m["mismatch/rejected_frac"] == pytest.approx(3 / 4)
    batch.response_mask = MASK.clone()
    apply_rollout_correction(batch, ActorConfig(use_decoupled_loss=True, behav_imp_weight_cap=2.0), None)
    _close(batch.rollout_is_weights, [[1.5, 0, 0.25], [0, E01, 0], [0, 0, 0]])  # rho 3 > cap 2 -> 0
    _close(batch.response_mask, MASK)
