"""A GRPO step of Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE under tp2 equals the 1-rank step, and the reshard
into a tp2 rollout (Phi-3's fused projections sliced per part, MoE experts whole) samples what 1 rank does.

Per architecture, on 1 rank and on 2 (training tp2, rollout tp2): padding-free old log-probs, one
PPO-clip + KL + entropy update (two micro-batches), then the updated weights resharded into the
rollout layout and greedy sampling. The update uses SGD with lr 1, so that the parameter change
IS the gradient: Adam's first step, ``lr * g / (|g| + eps)``, would turn fp32 noise on gradients
near zero into differences of up to ``2 lr``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests._archs import ARCHS, write_tiny_model
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import dist_device, dist_device_type, run_distributed

N_PROMPTS, N_SAMPLES, P, R = 4, 2, 6, 8
PROMPTS = [[2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {kind: write_tiny_model(tmp_path_factory.mktemp(kind), kind) for kind in ARCHS}


def _worker(rank: int, world: int, dirs: dict, out: str) -> None:
    from rlhf.models.parallel import ParallelDims
    from rlhf.rollout import Sampler, SamplingParams
    from rlhf.rollout.reshard import RolloutLayout, gather_rollout_weights
    from rlhf.schema.config import ActorConfig, ModelConfig, ParallelConfig
    from rlhf.train.actor import PolicyWorker

    mesh = ParallelDims.resolve(-1, world, 1, world).build_mesh(dist_device_type())  # tp = world, dp = 1
    layout = RolloutLayout.build(world, dist_device_type())
    results = {}
    for kind, path in dirs.items():
        torch.manual_seed(0)
        cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=N_PROMPTS, ppo_micro_batch_size_per_gpu=4, use_kl_loss=True,
                          kl_loss_coef=0.1, entropy_coeff=0.01, grad_clip=1e9, weight_decay=0.0)
        worker = PolicyWorker(ModelConfig(path=path, use_remove_padding=True, mixed_precision=False), mesh,
                              dist_device(), actor_cfg=cfg, total_steps=1, parallel_cfg=ParallelConfig(tp=world))
        worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=1.0)
        batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, worker.hf_config.vocab_size).to(dist_device())
        log_probs, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=4)
        metrics = worker.update_policy(batch, mini_batch_rows=N_PROMPTS * N_SAMPLES, temperature=1.0,
                                       max_response_length=R)
        params = {n: p.full_tensor().cpu().clone() for n, p in worker.model.named_parameters()}
        weights, _ = gather_rollout_weights(worker.model, tp_rank=layout.tp_rank, tp_size=layout.tp,
                                            tp_group=layout.tp_group)
        sampler = Sampler(worker.hf_config, weights, pad_token_id=0, tp_group=layout.tp_group, device=dist_device())
        gen = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
        results[kind] = (metrics, params, (log_probs * batch.response_mask).cpu(), gen.response_ids.cpu(),
                         gen.log_probs.cpu())
    if rank == 0:
        torch.save(results, out)


def test_grpo_step_and_rollout_under_tp2_match_one_rank(model_dirs, tmp_path):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run_distributed(_worker, 1, model_dirs, one)
    run_distributed(_worker, 2, model_dirs, two)
    r1, r2 = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    for kind in ARCHS:
        (m1, p1, lp1, ids1, glp1), (m2, p2, lp2, ids2, glp2) = r1[kind], r2[kind]
        torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=0, msg=kind)
        assert m1["actor/loss"] == pytest.approx(m2["actor/loss"], rel=1e-5, abs=1e-7), kind
        assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-4), kind
        init = {n: t.detach() for n, t in AutoModelForCausalLM.from_pretrained(model_dirs[kind]).named_parameters()}
        for name in p1:
            assert float((p1[name] - p2[name]).abs().max()) < 1e-5, f"{kind} {name}"
        assert max(float((p1[n] - init[n]).abs().max()) for n in p1) > 1e-3, f"{kind}: parameters did not move"
        assert torch.equal(ids2, ids1), kind
        torch.testing.assert_close(glp2, glp1, atol=1e-4, rtol=0, msg=kind)
