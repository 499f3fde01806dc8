"""One PPO step (critic values, GAE with global whitening, KL in reward, critic and actor
updates) on 2 gloo ranks equals the 1-rank result for the same global batch.

The batch is built deterministically (uneven prompt and response lengths) and dealt to
ranks mini-batch-major as the trainer deals prompts; two mini-batches per update, several
micro-batches, two critic epochs (so value clipping engages).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._assets import write_tiny_assets
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import run_distributed

N_PROMPTS, N_SAMPLES, MINI, P, R = 4, 2, 2, 6, 8
COMPARED = ["critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean",
            "critic/explained_variance", "critic/values/mean", "critic/returns/mean", "actor/loss",
            "actor/grad_norm", "actor/pg_clipfrac", "kl_penalty/kl", "advantage/mean"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_tiny_assets(tmp_path_factory.mktemp("ppo"), n_train=16, n_val=0)


def _config(root, world: int):
    from rlhf.config.load import load_config

    return load_config(None, [
        f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.max_prompt_length=16", f"data.max_response_length={R}", f"data.train_batch_size={N_PROMPTS}",
        f"rollout.n={N_SAMPLES}", "actor.lr=1e-3", f"actor.ppo_mini_batch_size={MINI}",
        "actor.ppo_micro_batch_size_per_gpu=1", "actor.log_prob_micro_batch_size_per_gpu=3", "actor.weight_decay=0.0",
        "critic.lr=1e-3", f"critic.ppo_mini_batch_size={MINI}", "critic.ppo_micro_batch_size_per_gpu=1",
        "critic.ppo_epochs=2", "critic.cliprange_value=0.01", "critic.weight_decay=0.0",
        "algorithm.adv_estimator=gae", "algorithm.lam=0.9", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.1", "trainer.device=cpu", f"trainer.output_dir={root / f'out{world}'}",
        "trainer.logger=[jsonl]", "checkpoint.resume=disable"])


def _global_batch(vocab: int):
    from rlhf.algos.reward_shaping import place_reward_on_last_token

    batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, vocab, holes=True)  # multi-turn masks
    g = torch.Generator().manual_seed(1)
    batch.token_level_scores = place_reward_on_last_token(torch.rand(len(batch), generator=g), batch.response_mask)
    return batch


def _ppo_worker(rank: int, world: int, root, out: str) -> None:
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.train.ppo_trainer import PPOTrainer

    trainer = PPOTrainer(_config(root, world))
    batch = _global_batch(trainer.actor.hf_config.vocab_size)
    prompts = minibatch_major_shard(list(range(N_PROMPTS)), rank, world, MINI)
    rows = [p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]
    local = batch.select(rows)
    metrics = {}
    metrics.update(trainer.compute_log_probs(local))
    metrics.update(trainer.compute_values(local))
    metrics.update(trainer.compute_advantages(local))
    metrics.update(trainer.update_critic(local, 1))
    metrics.update(trainer.update_actor(local))
    tensors = {}
    for name in ("values", "returns", "advantages", "token_level_rewards", "response_mask"):
        full = torch.zeros(len(batch), R)
        full[rows] = getattr(local, name)
        dist.all_reduce(full)
        tensors[name] = full
    params = {f"actor.{n}": p.full_tensor().clone() for n, p in trainer.actor.model.named_parameters()}
    params.update({f"critic.{n}": p.full_tensor().clone() for n, p in trainer.critic.model.named_parameters()})
    if rank == 0:
        torch.save({"metrics": metrics, "tensors": tensors, "params": params}, out)


def test_ppo_step_same_on_1_and_2_ranks(root, tmp_path):
    torch.set_num_threads(1)
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run_distributed(_ppo_worker, 1, root, one)
    run_distributed(_ppo_worker, 2, root, two)
    r1, r2 = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    for key in COMPARED:
        assert r1["metrics"][key] == pytest.approx(r2["metrics"][key], rel=1e-4, abs=1e-6), key
    assert r1["metrics"]["critic/vf_clipfrac"] > 0  # the second critic epoch clips
    for name, t in r1["tensors"].items():
        torch.testing.assert_close(r2["tensors"][name], t, rtol=1e-5, atol=1e-6, msg=name)
    # advantages are whitened over the global batch: zero mean, unit variance on valid tokens
    mask = r1["tensors"]["response_mask"].bool()
    adv = r1["tensors"]["advantages"][mask]
    assert abs(float(adv.mean())) < 1e-5 and float(adv.var()) == pytest.approx(1.0, abs=1e-4)
    for name, p in r1["params"].items():
        diff = float((p - r2["params"][name]).abs().max())
        assert diff < 1e-5, f"{name}: {diff}"
    # Both models really moved (so equality is not trivial).
    from transformers import AutoModelForCausalLM

    init = dict(AutoModelForCausalLM.from_pretrained(root / "model").named_parameters())
    actor_moved = max(float((r1["params"][f"actor.{n}"] - p).abs().max()) for n, p in init.items())
    head_moved = max(float(p.abs().max()) for n, p in r1["params"].items() if n.startswith("critic.score"))
    assert actor_moved > 1e-4 and head_moved > 1e-4, (actor_moved, head_moved)  # the head starts at 0
