"""Expert parallelism: a GRPO step of a tiny Qwen3-MoE (8 experts, top-2, one dense layer) under
dp4 x ep2 (experts FSDP-sharded over the 2 remaining ranks), dp4 x ep4 and dp2 x tp2 x ep2 equals the
1-rank step, and the updated experts reshard into the rollout like every other weight.

One 4-rank launch runs the three layouts one after the other (one 1-rank launch is the reference);
dp2 x tp2 x ep2 also checkpoints activations (the all-to-alls run again in the recompute).
Per layout: padding-free old log-probs, one PPO-clip + KL + entropy update over two mini-batches
(masks with tool-output holes) with its metrics (``actor/*`` and the global ``moe/*`` routing
metrics), full parameters after, then greedy sampling from the resharded weights. SGD with lr 1
makes the parameter change the gradient itself (see test_grpo_archs). Last, dp4 x ep2 under bf16
mixed precision: the router computes in fp32, the experts in bf16 through the all-to-alls.

rollout.ep: the updated dp4 x ep2 model samples under rollout ep 1, ep 2 (its training ep groups: the
expert shards stay put) and ep 4, the dp2 x tp2 x ep2 one under rollout tp 2 x ep 1 and tp 2 x ep 2;
greedy and sampled tokens equal, log-probs within 1e-5, with a replica that has no prompt of its own.
"""

from __future__ import annotations

import pytest
import torch

from tests._archs import write_tiny_model
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import dist_device, dist_device_type, run_distributed

N_PROMPTS, N_SAMPLES, P, R, MINI = 8, 2, 6, 8, 4
PROMPTS = [[2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
# name -> (dp, tp, ep, activation checkpointing: the all-to-alls run again in the recompute)
LAYOUTS = {"dp4xep2": (4, 1, 2, False), "dp4xep4": (4, 1, 4, False), "dp2xtp2xep2": (2, 2, 2, True)}
# training (dp, tp, ep) -> the rollout (tp, ep) layouts sampled from it (rollout.ep, the first one the reference)
ROLLOUT_EP = {(4, 1, 2): ((1, 1), (1, 2), (1, 4)), (2, 2, 2): ((2, 1), (2, 2))}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def _run(path: str, dp: int, tp: int, ep: int, checkpointing: bool = False) -> dict:
    import torch.distributed as dist

    from rlhf.models.parallel import ParallelDims
    from rlhf.rollout import Sampler, SamplingParams
    from rlhf.rollout.reshard import RolloutLayout, gather_rollout_weights
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.schema.config import ActorConfig, ModelConfig, ParallelConfig
    from rlhf.train.actor import PolicyWorker

    world = dp * tp
    mesh = ParallelDims.resolve(dp, tp, 1, world, ep=ep).build_mesh(dist_device_type())
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
                      kl_loss_coef=0.1, entropy_coeff=0.01, grad_clip=1e9, weight_decay=0.0)
    worker = PolicyWorker(ModelConfig(path=path, use_remove_padding=True, mixed_precision=False,
                                      enable_gradient_checkpointing=checkpointing), mesh, dist_device(),
                          actor_cfg=cfg, total_steps=1, parallel_cfg=ParallelConfig(dp=dp, tp=tp, ep=ep))
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=1.0)
    prompts = minibatch_major_shard(list(range(N_PROMPTS)), dp_rank, dp, MINI)
    rows = [p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]
    batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, worker.hf_config.vocab_size, holes=True)
    local = batch.select(rows).to(dist_device())
    log_probs, _ = worker.compute_log_probs(local, temperature=1.0, micro_batch_size=2)
    metrics = worker.update_policy(local, mini_batch_rows=MINI * N_SAMPLES // dp, temperature=1.0,
                                   max_response_length=R)
    lp = torch.zeros(N_PROMPTS * N_SAMPLES, R)
    lp[rows] = (log_probs * local.response_mask).cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(lp)
        lp /= tp  # tp ranks of one dp rank hold the same rows
    params = {n: p.full_tensor().cpu().clone() for n, p in worker.model.named_parameters()}
    layout = RolloutLayout.build(tp, dist_device_type())
    weights, _ = gather_rollout_weights(worker.model, tp_rank=layout.tp_rank, tp_size=layout.tp,
                                        tp_group=layout.tp_group)
    sampler = Sampler(worker.hf_config, weights, pad_token_id=0, tp_group=layout.tp_group, device=dist_device())
    gen = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
    del weights, sampler
    from rlhf.rewards.pool import model_parallel_group  # the trainer's scorer group: dp is (efsdp, ep) here

    peers = model_parallel_group(mesh)
    return {"scorer_group": None if peers is None else dist.get_process_group_ranks(peers[0]), "metrics": metrics,
            "params": params, "log_probs": lp, "ids": gen.response_ids.cpu(), "gen_log_probs": gen.log_probs.cpu(),
            "rollout_ep": {(rtp, rep): _rollout_ep(worker, rtp, rep) for rtp, rep in ROLLOUT_EP.get((dp, tp, ep), ())}}


class _Tok:
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def _rollout_ep(worker, tp: int, ep: int) -> dict:
    """rollout.tp x rollout.ep sampling of the updated model through the rollout engine (reshard from its
    training layout, sample, exchange rows): the replicas take contiguous chunks of PROMPTS (some replica
    has none: it only serves its experts); greedy and sampled (draws keyed by prompt key and position);
    every rank asks for the rows of every prompt."""
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.rollout.reshard import RolloutLayout
    from rlhf.schema.batch import PromptBatch
    from rlhf.schema.config import RolloutConfig

    lay = RolloutLayout.build(tp, dist_device_type(), ep=ep)
    engine = RolloutEngine(RolloutConfig(tp=tp, ep=ep, seed=3), _Tok(), max_prompt_length=8, max_response_length=6,
                           device=dist_device(), layout=lay)
    k = len(PROMPTS)
    prompts = PromptBatch(prompt_ids=PROMPTS, keys=list(range(k)), ground_truths=[""] * k, data_sources=[""] * k,
                          extra_infos=[{}] * k)
    out = {}
    for temperature in (0.0, 1.0):
        batch, stats = engine.generate(worker.model, worker.hf_config, prompts, step=0, n=2, temperature=temperature,
                                       local_rows=list(range(k)))
        out[temperature] = (batch.input_ids.cpu(), batch.rollout_log_probs.cpu())
    return {"rows": out, "bytes": stats["reshard/bytes_received"], "params": stats["reshard/params"]}


def _bf16(path: str) -> dict:
    """dp4 x ep2 under FSDP2 mixed precision (driven over gloo as tests/dist/test_mixed_precision.py):
    the router computes in fp32 (its own FSDP unit), the experts in bf16 through the all-to-alls."""
    import rlhf.models.fsdp as fsdp
    from rlhf.models.parallel import ParallelDims
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.schema.config import ActorConfig, ModelConfig, ParallelConfig
    from rlhf.train.actor import PolicyWorker

    fsdp.MIXED_PRECISION_DEVICES.add("cpu")
    try:
        mesh = ParallelDims.resolve(4, 1, 1, 4, ep=2).build_mesh("cpu")
        cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9)
        worker = PolicyWorker(ModelConfig(path=path, mixed_precision=True), mesh, torch.device("cpu"), actor_cfg=cfg,
                              total_steps=1, parallel_cfg=ParallelConfig(dp=4, ep=2))
    finally:
        fsdp.MIXED_PRECISION_DEVICES.discard("cpu")
    seen = set()
    mlp = worker.model.model.layers[0].mlp
    mlp.gate.register_forward_hook(lambda m, a, o: seen.add(("router", m.weight.dtype, o[0].dtype, o[1].dtype)))
    mlp.experts.register_forward_pre_hook(lambda m, a: seen.add(("experts", m.gate_up_proj.dtype, a[0].dtype)))
    prompts = minibatch_major_shard(list(range(N_PROMPTS)), mesh["dp"].get_local_rank(), 4, MINI)
    batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, worker.hf_config.vocab_size)
    local = batch.select([p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)])
    metrics = worker.update_policy(local, mini_batch_rows=MINI * N_SAMPLES // 4, temperature=1.0,
                                   max_response_length=R)
    return {"seen": seen, "metrics": metrics, "param_dtypes": {p.dtype for p in worker.model.parameters()}}


def _worker(rank: int, world: int, path: str, out: str) -> None:
    layouts = {"one": (1, 1, 1, False)} if world == 1 else LAYOUTS
    results = {name: _run(path, *layout) for name, layout in layouts.items()}
    if world == 4 and dist_device_type() == "cpu":
        results["bf16"] = _bf16(path)
    if rank == 0:
        torch.save(results, out)


def test_grpo_step_under_expert_parallel_matches_one_rank(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    one, four = str(tmp_path / "one.pt"), str(tmp_path / "four.pt")
    run_distributed(_worker, 1, model_dir, one)
    run_distributed(_worker, 4, model_dir, four)
    ref = torch.load(one, weights_only=False)["one"]
    res = torch.load(four, weights_only=False)
    init = {n: t.detach() for n, t in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    assert max(float((ref["params"][n] - init[n]).abs().max()) for n in init) > 1e-3, "parameters did not move"
    moved = [n for n in init if "experts" in n and float((ref["params"][n] - init[n]).abs().max()) > 1e-4]
    assert moved, "experts got no gradient"
    for name in LAYOUTS:
        got = res[name]
        torch.testing.assert_close(got["log_probs"], ref["log_probs"], atol=1e-5, rtol=0, msg=name)
        m1, m2 = ref["metrics"], got["metrics"]
        keys = [k for k in m1 if k.startswith(("actor/", "moe/")) and isinstance(m1[k], (int, float))]
        assert {"actor/loss", "actor/grad_norm", "moe/load_max_mean", "moe/router_entropy/layer2"} <= set(keys)
        assert set(m2) >= set(keys), name
        for k in keys:
            assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), f"{name} {k}: {m2[k]} vs {m1[k]}"
        for n in init:
            assert float((got["params"][n] - ref["params"][n]).abs().max()) < 1e-5, f"{name} {n}"
        assert torch.equal(got["ids"], ref["ids"]), name
        torch.testing.assert_close(got["gen_log_probs"], ref["gen_log_probs"], atol=1e-4, rtol=0, msg=name)
    assert [res[name]["scorer_group"] for name in LAYOUTS] == [None, None, [0, 1]]  # rank 0's tp peers
    rollouts = {(name, key): r for name in LAYOUTS for key, r in res[name]["rollout_ep"].items()}
    ref_rows = rollouts[("dp4xep2", (1, 1))]["rows"]
    greedy, sampled = ref_rows[0.0][0], ref_rows[1.0][0]
    assert greedy.shape == (2 * len(PROMPTS), 8 + 6) and not torch.equal(greedy, sampled)
    for (name, (rtp, rep)), r in rollouts.items():
        for temperature, (ids, lp) in ref_rows.items():
            got_ids, got_lp = r["rows"][temperature]
            assert torch.equal(got_ids, ids), f"rollout tp{rtp} ep{rep} from {name}, temperature {temperature}"
            torch.testing.assert_close(got_lp, lp, atol=1e-5, rtol=0, msg=f"rollout tp{rtp} ep{rep} {temperature}")
    experts = sum(t.numel() for n, t in init.items() if ".experts." in n)
    for (name, (rtp, rep)), r in rollouts.items():  # a rank's rollout copy holds 1 / (ep x tp) of the experts
        assert rollouts[(name, (rtp, 1))]["params"] - r["params"] == experts // rtp - experts // (rtp * rep), name
    for name, (rtp, rep) in ((n, k) for n, k in rollouts if k[1] > 1):  # experts kept Shard(0) over ep
        same_ep = rep == LAYOUTS[name][2]
        assert (rollouts[(name, (rtp, rep))]["bytes"] < rollouts[(name, (rtp, 1))]["bytes"]) == same_ep, (name, rep)
    if "bf16" in res:
        bf16 = res["bf16"]
        assert bf16["seen"] == {("router", torch.float32, torch.float32, torch.float32),
                                ("experts", torch.bfloat16, torch.bfloat16)}, bf16["seen"]
        assert bf16["param_dtypes"] == {torch.float32}
        assert abs(bf16["metrics"]["actor/loss"]) < 10 and bf16["metrics"]["actor/grad_norm"] > 0
