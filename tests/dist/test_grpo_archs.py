"""A GRPO step of Gemma 2, Gemma 3, Phi-3 and the MoE families under tp2 equals the 1-rank step, and the reshard
into a tp2 rollout (Phi-3's fused projections sliced per part, MoE experts whole) samples what 1 rank does;
the MoE families added after Qwen3-MoE (Qwen2-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3 with MLA heads split over
tp; Qwen3-MoE's layouts are in test_expert_parallel.py) also under dp2 x ep2, in the same 2-rank launch.

Per architecture, on 1 rank and on 2 (training tp2, rollout tp2; ep2: rollout tp1): padding-free old
log-probs, one PPO-clip + KL + entropy update (two micro-batches), then the updated weights resharded
into the rollout layout and greedy sampling. The update uses SGD with lr 1, so that the parameter
change IS the gradient: Adam's first step, ``lr * g / (|g| + eps)``, would turn fp32 noise on gradients
near zero into differences of up to ``2 lr``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests._archs import ARCHS, write_tiny_model
from tests.dist._batches import random_rollout_batch
from tests.dist.test_expert_parallel import _rollout_ep
from tests.dist._dist_utils import dist_device, dist_device_type, run_distributed

N_PROMPTS, N_SAMPLES, P, R = 4, 2, 6, 8
PROMPTS = [[2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
EP_ARCHS = ("qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {kind: write_tiny_model(tmp_path_factory.mktemp(kind), kind) for kind in ARCHS}


def _step(path: str, dp: int, tp: int, ep: int) -> tuple:
    import torch.distributed as dist

    from rlhf.models.parallel import ParallelDims
    from rlhf.rollout import Sampler, SamplingParams
    from rlhf.rollout.reshard import RolloutLayout, gather_rollout_weights
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.schema.config import ActorConfig, ModelConfig, ParallelConfig
    from rlhf.train.actor import PolicyWorker

    world = dp * tp
    mesh = ParallelDims.resolve(dp, tp, 1, world, ep=ep).build_mesh(dist_device_type())
    layout = RolloutLayout.build(tp, dist_device_type())
    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=N_PROMPTS, ppo_micro_batch_size_per_gpu=4, use_kl_loss=True,
                      kl_loss_coef=0.1, entropy_coeff=0.01, grad_clip=1e9, weight_decay=0.0)
    worker = PolicyWorker(ModelConfig(path=path, use_remove_padding=True, mixed_precision=False), mesh,
                          dist_device(), actor_cfg=cfg, total_steps=1,
                          parallel_cfg=ParallelConfig(dp=dp, tp=tp, ep=ep))
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=1.0)
    batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, worker.hf_config.vocab_size)
    prompts = minibatch_major_shard(list(range(N_PROMPTS)), mesh["dp"].get_local_rank(), dp, N_PROMPTS)
    rows = [p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]
    local = batch.select(rows).to(dist_device())
    log_probs, _ = worker.compute_log_probs(local, temperature=1.0, micro_batch_size=4)
    metrics = worker.update_policy(local, mini_batch_rows=N_PROMPTS * N_SAMPLES // dp, temperature=1.0,
                                   max_response_length=R)
    lp = torch.zeros(N_PROMPTS * N_SAMPLES, R)
    lp[rows] = (log_probs * local.response_mask).cpu()
    if dp > 1:
        dist.all_reduce(lp)
    params = {n: p.full_tensor().cpu().clone() for n, p in worker.model.named_parameters()}
    weights, _ = gather_rollout_weights(worker.model, tp_rank=layout.tp_rank, tp_size=layout.tp,
                                        tp_group=layout.tp_group)
    sampler = Sampler(worker.hf_config, weights, pad_token_id=0, tp_group=layout.tp_group, device=dist_device())
    gen = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
    del weights, sampler
    # under ep2: the rollout with rollout.ep=2 (each family's experts through the rollout's all-to-all) vs 1
    rollout_ep = {e: _rollout_ep(worker, 1, e)["rows"] for e in (1, 2)} if ep > 1 else None
    return metrics, params, lp, gen.response_ids.cpu(), gen.log_probs.cpu(), rollout_ep


def _worker(rank: int, world: int, dirs: dict, out: str) -> None:
    results = {kind: _step(path, 1, world, 1) for kind, path in dirs.items()}  # tp = world
    if world == 2:
        results.update({f"{kind}/ep2": _step(dirs[kind], 2, 1, 2) for kind in EP_ARCHS})
    if rank == 0:
        torch.save(results, out)


def test_grpo_step_and_rollout_under_tp2_and_ep2_match_one_rank(model_dirs, tmp_path):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run_distributed(_worker, 1, model_dirs, one)
    run_distributed(_worker, 2, model_dirs, two)
    r1, r2 = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    for name in (*ARCHS, *(f"{k}/ep2" for k in EP_ARCHS)):
        kind = name.split("/")[0]
        (m1, p1, lp1, ids1, glp1, _), (m2, p2, lp2, ids2, glp2, rollout_ep) = r1[kind], r2[name]
        torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=0, msg=name)
        assert m1["actor/loss"] == pytest.approx(m2["actor/loss"], rel=1e-5, abs=1e-7), name
        assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-4), name
        if name.endswith("/ep2"):  # every metric, the routing ones (moe/*) included
            keys = [k for k in m1 if k.startswith(("actor/", "moe/")) and isinstance(m1[k], (int, float))]
            assert "moe/load_max_mean" in keys and set(m2) >= set(keys), name
            for k in keys:
                assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), f"{name} {k}: {m2[k]} vs {m1[k]}"
        init = {n: t.detach() for n, t in AutoModelForCausalLM.from_pretrained(model_dirs[kind]).named_parameters()}
        for n in p1:
            assert float((p1[n] - p2[n]).abs().max()) < 1e-5, f"{name} {n}"
        assert max(float((p1[n] - init[n]).abs().max()) for n in p1) > 1e-3, f"{name}: parameters did not move"
        assert torch.equal(ids2, ids1), name
        torch.testing.assert_close(glp2, glp1, atol=1e-4, rtol=0, msg=name)
        for temperature, (ids, lp) in (rollout_ep or {}).get(1, {}).items():  # rollout.ep=2 equals rollout.ep=1
            got_ids, got_lp = rollout_ep[2][temperature]
            assert torch.equal(got_ids, ids), f"{name} rollout.ep=2, temperature {temperature}"
            torch.testing.assert_close(got_lp, lp, atol=1e-5, rtol=0, msg=f"{name} rollout.ep=2 {temperature}")
