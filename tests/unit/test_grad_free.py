"""Zero-advantage rows skip the update's backward (rlhf/train/grad_free.py): same step, same metrics."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.schema.config import ActorConfig
from rlhf.train.grad_free import agreed_chunks, grad_free_rows, reduce_with_splits, skips_grad_free_rows
from tests.dist._batches import random_rollout_batch


def test_grad_free_rows_are_exact_zeros_on_loss_tokens():
    adv = torch.tensor([[0.0, -0.0, 0.0], [0.0, 1e-30, 0.0], [2.0, 0.0, 0.0], [float("nan"), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # row 2's advantage sits on a masked token; a NaN keeps its row
    assert grad_free_rows(adv, mask).tolist() == [True, False, True, False]


def test_skip_only_where_the_rows_gradient_is_zero():
    cfg = ActorConfig()
    assert skips_grad_free_rows(cfg, 0.0, moe=False, pipeline=False)
    assert not skips_grad_free_rows(cfg, 0.01, moe=False, pipeline=False)  # entropy bonus
    assert not skips_grad_free_rows(cfg, 0.0, moe=True, pipeline=False)
    assert not skips_grad_free_rows(cfg, 0.0, moe=False, pipeline=True)
    for changed in (dict(use_kl_loss=True), dict(policy_loss="dro", dro_beta=0.1), dict(policy_loss="kl_cov"),
                    dict(skip_zero_advantage_rows=False)):
        assert not skips_grad_free_rows(ActorConfig(**changed), 0.0, moe=False, pipeline=False), changed


def test_agreed_chunks_match_the_rank_with_most_rows():
    assert [c.tolist() for c in agreed_chunks(3, 2, 5)] == [[0, 1], [2], []]
    assert [c.tolist() for c in agreed_chunks(0, 2, 0)] == [[]]  # a zero-weight pass keeps the step's shape


def test_one_host_read_gives_counts_and_splits(mesh):
    base = torch.tensor([[7.0, 3.0], [5.0, 2.0]], dtype=torch.float64)
    free = [torch.tensor([True, False, True]), torch.tensor([False, False])]
    counts, splits = reduce_with_splits(base, free, None, torch.device("cpu"))
    assert counts == [[7.0, 3.0], [5.0, 2.0]]
    assert splits[0].kept.tolist() == [1] and splits[0].free.tolist() == [0, 2]
    assert (splits[0].kept_max, splits[0].free_max, splits[1].kept_max, splits[1].free_max) == (1, 2, 2, 0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rlhf.models.tiny import write_tiny_model

    return str(write_tiny_model(str(tmp_path_factory.mktemp("m") / "model"), hidden_size=32, num_layers=2,
                                intermediate_size=64))


def _update(mesh, path, skip: bool, batch, *, dynamic: bool):
    from rlhf.schema.config import ModelConfig
    from rlhf.train.actor import PolicyWorker

    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, log_prob_micro_batch_size_per_gpu=2,
                      use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=40, log_prob_max_token_len_per_gpu=40,
                      skip_zero_advantage_rows=skip, clip_ratio=0.05)
    w = PolicyWorker(ModelConfig(path=path, use_remove_padding=True), mesh, torch.device("cpu"), actor_cfg=cfg,
                     total_steps=4)
    batch.old_log_probs, _ = w.compute_log_probs(batch, temperature=1.0, micro_batch_size=4)
    grad_rows = []  # rows of every forward that builds a graph
    forward = w.forward_log_probs

    def spy(input_ids, *args, **kw):
        if torch.is_grad_enabled():
            grad_rows.append(input_ids.shape[0])
        return forward(input_ids, *args, **kw)

    w.forward_log_probs = spy
    metrics = w.update_policy(batch, mini_batch_rows=8, temperature=1.0, max_response_length=batch.response_length,
                              old_log_probs_current=True)
    return metrics, {k: v.detach().clone() for k, v in w.model.state_dict().items()}, grad_rows


@pytest.mark.parametrize("dynamic", [False, True])
def test_update_with_skipped_rows_equals_the_full_update(mesh, model_path, dynamic):
    batch = random_rollout_batch(4, 4, 6, 8, 64, seed=3)  # 16 rows: two mini-batches of 8
    zero = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)  # groups 0 and 3
    batch.advantages = batch.advantages.masked_fill(zero[:, None], 0.0)
    off_metrics, off_params, off_rows = _update(mesh, model_path, False, batch, dynamic=dynamic)
    on_metrics, on_params, on_rows = _update(mesh, model_path, True, batch, dynamic=dynamic)
    assert sum(off_rows) == 16 and sum(on_rows) == 8  # only the rows with an advantage ran a backward
    assert off_metrics.keys() == on_metrics.keys()
    for k, v in off_metrics.items():  # ppo_kl of the second mini-batch included: the skipped rows ran forward-only
        assert math.isclose(v, on_metrics[k], rel_tol=1e-5, abs_tol=1e-7), (k, v, on_metrics[k])
    assert off_metrics["actor/ppo_kl"] != 0.0
    for k, p in off_params.items():
        torch.testing.assert_close(on_params[k], p, rtol=1e-5, atol=1e-6)
