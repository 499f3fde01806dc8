"""Zero-advantage rows skipped on 2 FSDP ranks with uneven counts (rlhf/train/grad_free.py): one rank with
no row to backward in a mini-batch runs a zero-weight pass, and the step and metrics equal the full update."""

from __future__ import annotations

import math

import torch

from rlhf.schema.config import ActorConfig, ModelConfig
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import dist_device, dist_device_type, run_distributed

N_PROMPTS, N_SAMPLES, P, R = 4, 4, 6, 8


def _worker(rank: int, world: int, model_dir: str) -> None:
    from rlhf.models.parallel import ParallelDims
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.train.actor import PolicyWorker

    mesh = ParallelDims.resolve(-1, 1, 1, world).build_mesh(dist_device_type())
    batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, 64, seed=5)
    # Mini-batch 1 = prompts 0, 1 (rank 0 gets prompt 0: every row grad-free); mini-batch 2 = prompts 2, 3
    # (rank 1 gets prompt 3: two of its rows grad-free).
    batch.advantages[:N_SAMPLES] = 0.0
    batch.advantages[3 * N_SAMPLES:3 * N_SAMPLES + 2] = 0.0
    prompts = minibatch_major_shard(list(range(N_PROMPTS)), rank, world, 2)
    for dynamic in (False, True):
        out = {}
        for skip in (False, True):
            torch.manual_seed(0)
            cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                              log_prob_micro_batch_size_per_gpu=2, use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=24,
                              log_prob_max_token_len_per_gpu=24, clip_ratio=0.05, skip_zero_advantage_rows=skip)
            worker = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=True, mixed_precision=False), mesh,
                                  dist_device(), actor_cfg=cfg, total_steps=1)
            local = batch.select([p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]).to(dist_device())
            local.old_log_probs, _ = worker.compute_log_probs(local, temperature=1.0, micro_batch_size=4)
            rows, forward = [], worker.forward_log_probs
            worker.forward_log_probs = lambda ids, *a, **kw: (rows.append(ids.shape[0] * torch.is_grad_enabled()),
                                                              forward(ids, *a, **kw))[1]
            metrics = worker.update_policy(local, mini_batch_rows=2 * N_SAMPLES // world, temperature=1.0,
                                           max_response_length=R, old_log_probs_current=True)
            out[skip] = sum(rows), metrics, {n: p.full_tensor().cpu().clone() for n, p in worker.model.named_parameters()}
        (rows_off, m_off, p_off), (rows_on, m_on, p_on) = out[False], out[True]
        # rows through a backward; zero-weight passes (1 row each) keep the micro-batch counts in step
        assert rows_off == 8 and rows_on < rows_off, (dynamic, rows_off, rows_on)
        for k, v in m_off.items():
            assert math.isclose(v, m_on[k], rel_tol=1e-5, abs_tol=1e-7), (dynamic, k, v, m_on[k])
        assert m_off["actor/ppo_kl"] != 0.0
        for n, p in p_off.items():
            torch.testing.assert_close(p_on[n], p, rtol=1e-5, atol=1e-6, msg=f"{dynamic} {n}")


def test_skipped_rows_on_two_ranks_equal_the_full_update(tmp_path):
    from rlhf.models.tiny import write_tiny_model

    write_tiny_model(str(tmp_path), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    run_distributed(_worker, 2, str(tmp_path))
