"""Distillation teachers on gloo ranks: the same teacher log-probs and ``distill/*`` metrics on every layout.

Two teachers routed by ``data_source`` (a two-task batch, multi-turn masks with holes), one of
them larger than the student's test model, scored by :class:`rlhf.train.distill.Distiller` on
1 rank, on 2 dp ranks, and on 4 ranks with ``parallel.tp=2``: the per-row teacher log-probs and
every global metric (per-teacher splits included) agree to 1e-5 in fp32.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import dist_device, dist_device_type, run_distributed

N_PROMPTS, N_SAMPLES, P, R = 8, 2, 6, 10


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    from rlhf.models.tiny import write_tiny_model

    small = tmp_path_factory.mktemp("teacher_small")
    big = tmp_path_factory.mktemp("teacher_big")
    write_tiny_model(str(small), seed=1, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=64)
    write_tiny_model(str(big), seed=2, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                     intermediate_size=128)
    return str(small), str(big)


def _worker(rank: int, world: int, tp: int, small: str, big: str, out: str) -> None:
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.parallel import ParallelDims
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.schema.config import Config
    from rlhf.schema.distill import TeacherConfig
    from rlhf.train.distill import Distiller

    cfg = Config()
    cfg.model.path, cfg.model.mixed_precision = small, False
    cfg.parallel.tp = tp
    cfg.actor.log_prob_micro_batch_size_per_gpu = 3  # several micro-batches, uneven per rank
    cfg.distill.enabled = True
    cfg.distill.teachers = {"math": TeacherConfig(path=big), "chat": TeacherConfig(path=small)}
    cfg.distill.data_source_teacher = {"task/math": "math", "task/chat": "chat"}
    dims = ParallelDims.resolve(-1, tp, 1, world)
    mesh = dims.build_mesh(dist_device_type())
    d = Distiller(cfg, mesh, dist_device(), load_tokenizer(small), {"task/math", "task/chat"})
    batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, 40, holes=True)
    # uneven routing: prompts 0, 1, 2 and 5 are math
    batch.data_sources = ["task/math" if i // N_SAMPLES in (0, 1, 2, 5) else "task/chat" for i in range(len(batch))]
    prompts = minibatch_major_shard(list(range(N_PROMPTS)), mesh["dp"].get_local_rank(), dims.dp, 4)
    local = batch.select([p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]).to(dist_device())
    metrics = d.score(local, temperature=1.0)
    lp = (local.teacher_log_probs * local.response_mask).cpu()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, (prompts, lp))
    if rank == 0:
        torch.save((metrics, gathered), out)


def _global_lp(gathered) -> torch.Tensor:
    rows = {}
    for prompts, lp in gathered:
        for k, p in enumerate(prompts):
            rows[p] = lp[k * N_SAMPLES:(k + 1) * N_SAMPLES]
    return torch.cat([rows[p] for p in range(N_PROMPTS)])


def test_distill_metrics_equal_on_1_2_and_4_ranks_tp2(teachers, tmp_path):
    small, big = teachers
    results = {}
    for world, tp in ((1, 1), (2, 1), (4, 2)):
        out = str(tmp_path / f"w{world}.pt")
        run_distributed(_worker, world, tp, small, big, out)
        results[(world, tp)] = torch.load(out)
    ref_metrics, ref_gathered = results[(1, 1)]
    ref_lp = _global_lp(ref_gathered)
    assert ref_metrics["distill/math/scored_tokens"] > 0 and ref_metrics["distill/chat/scored_tokens"] > 0
    assert ref_metrics["distill/math/teacher_logprob_mean"] != ref_metrics["distill/chat/teacher_logprob_mean"]
    for key, (metrics, gathered) in results.items():
        assert set(metrics) == set(ref_metrics)
        for k, v in ref_metrics.items():
            assert metrics[k] == pytest.approx(v, abs=1e-5), (key, k)
        torch.testing.assert_close(_global_lp(gathered), ref_lp, atol=1e-5, rtol=0)
