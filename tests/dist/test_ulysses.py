"""Ulysses sequence parallelism (``parallel.sp``) against the 1-rank run, on 2 and 4 gloo ranks.

One spawn of 1 rank (padding-free reference), one of 2 ranks (sp=2; and tp=2, padding-free
under TP) and one of 4 ranks (sp=2 x dp=2 with activation checkpointing; sp=4, whose 2 KV
heads are replicated to 4; sp=2 x tp=2) run, on a fixed global batch:

* **actor**: log-probs and entropy of the batch, then one update (PPO-clip + KL loss +
  entropy bonus, two mini-batches, token-budget micro-batches): same log-probs, loss, grad
  norm and updated parameters as on 1 rank (fp32 tolerance);
* **critic**: values and one critic update, same checks;
* **trainer** (sp=2 x dp=2 and sp=2 x tp=2; and sp=2 with LoRA): the first GRPO
  ``RLTrainer.train_step`` gives the same metrics as the 1-rank (dp-only) run.
"""

from __future__ import annotations

import pytest
import torch

from tests._assets import write_tiny_assets
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import run_distributed

# name -> (dp, sp, tp, activation checkpointing); every layout runs padding-free.
LAYOUTS_2 = {"sp2": (1, 2, 1, False), "tp2": (1, 1, 2, False)}
LAYOUTS_4 = {"dp2xsp2_ac": (2, 2, 1, True), "sp4_gqa": (1, 4, 1, False), "sp2xtp2": (1, 2, 2, False)}
REFERENCE = (1, 1, 1, False)
TRAINER_LAYOUTS = {k: LAYOUTS_4[k] for k in ("dp2xsp2_ac", "sp2xtp2")}
N_PROMPTS, N_SAMPLES, P, R, MINI = 4, 2, 6, 10, 2
ACTOR_METRICS = ("actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/pg_clipfrac")
CRITIC_METRICS = ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean")
TRAINER_METRICS = ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm", "actor/kl_loss",
                   "actor/pg_clipfrac", "actor/entropy")

REWARD_FILE = '''
def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = write_tiny_assets(tmp_path_factory.mktemp("ulysses"), num_layers=2, n_train=32, n_val=4)
    (d / "reward.py").write_text(REWARD_FILE)
    return d


def _critic_model(path: str) -> torch.nn.Module:
    from rlhf.train.critic import load_value_model

    model = load_value_model(path, dtype="float32", attn_implementation="sdpa", trust_remote_code=False, key="x")
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a zero head would leave the backbone untested
    return model


def _run_layout(layout, workdir) -> dict:
    from rlhf.models.parallel import ParallelDims
    from rlhf.rollout.reshard import gather_rollout_weights
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.schema.config import ActorConfig, CriticConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker
    from rlhf.train.critic import CriticWorker

    dp, sp, tp, ac = layout
    mesh = ParallelDims(dp=dp, tp=tp, pp=1, world_size=dp * sp * tp, sp=sp).build_mesh("cpu")
    dp_rank = mesh["dp"].get_local_rank()
    model_cfg = ModelConfig(path=str(workdir / "model"), use_remove_padding=True, enable_gradient_checkpointing=ac)
    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
                      kl_loss_coef=0.1, entropy_coeff=0.01, clip_ratio_high=0.28, grad_clip=1.0, weight_decay=0.0,
                      use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20, log_prob_max_token_len_per_gpu=20)
    actor = PolicyWorker(model_cfg, mesh, torch.device("cpu"), actor_cfg=cfg, total_steps=1)
    batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, actor.hf_config.vocab_size, holes=True)
    batch.values = 0.3 * torch.randn(len(batch), R, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    batch.returns = torch.randn(len(batch), R, generator=torch.Generator().manual_seed(2)) * batch.response_mask
    prompts = minibatch_major_shard(list(range(N_PROMPTS)), dp_rank, dp, MINI)
    rows = [p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]
    local = batch.select(rows)
    out: dict = {"rows": rows, "mask": local.response_mask,
                 "sp": torch.distributed.get_world_size(actor.sp_group) if actor.sp_group is not None else 1}
    out["log_probs"], out["entropy"] = actor.compute_log_probs(local, temperature=0.9, micro_batch_size=2,
                                                               compute_entropy=True)
    out["actor"] = actor.update_policy(local, mini_batch_rows=MINI * N_SAMPLES // dp, temperature=1.0,
                                       max_response_length=R)
    full, _ = gather_rollout_weights(actor.model, pp_group=None)
    out["actor_params"] = {n: t.clone() for n, t in full.items()}

    critic = CriticWorker(CriticConfig(lr=1e-3, weight_decay=0.0, cliprange_value=0.1, ppo_micro_batch_size_per_gpu=2,
                                       ppo_max_token_len_per_gpu=20),
                          model_cfg, mesh, torch.device("cpu"), total_steps=1, max_response_length=R,
                          use_dynamic_bsz=True, forward_max_token_len=20,
                          build_model=lambda: _critic_model(str(workdir / "model")))
    out["values"] = critic.compute_values(local, micro_batch_size=2)
    out["critic"] = critic.update_critic(local, mini_batch_rows=MINI * N_SAMPLES // dp)
    full, _ = gather_rollout_weights(critic.model, pp_group=None)
    out["critic_params"] = {n: t.clone() for n, t in full.items()}
    return out


def _trainer_step(layout, workdir, lora: bool = False) -> dict:
    from rlhf.config.load import load_config
    from rlhf.train.trainer import RLTrainer

    dp, sp, tp, ac = layout
    overrides = [
        f"model.path={workdir / 'model'}", f"data.train_files={workdir / 'data' / 'train.parquet'}",
        "model.use_remove_padding=true", f"model.enable_gradient_checkpointing={str(ac).lower()}",
        "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=4",
        "rollout.n=2", "rollout.temperature=1.0", "rollout.seed=11",
        "actor.lr=1e-3", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.log_prob_micro_batch_size_per_gpu=4", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
        "actor.entropy_coeff=0.01", "actor.weight_decay=0.0", "algorithm.adv_estimator=grpo",
        f"reward.reward_fn={workdir / 'reward.py'}:digit_share",
        f"parallel.sp={sp}", f"parallel.tp={tp}", "parallel.dp=-1",
        "trainer.device=cpu", "trainer.logger=[]", "trainer.total_training_steps=1",
        f"trainer.output_dir={workdir / ('run_%d%d%d%s' % (dp, sp, tp, '_lora' if lora else ''))}",
        "checkpoint.export_hf=false",
    ] + (["model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2"] if lora else [])
    return RLTrainer(load_config(None, overrides)).train_step(1)


def _worker(rank: int, world: int, workdir, layouts: list, trainer: bool, out: str) -> None:
    results = {}
    for layout in layouts:
        res = _run_layout(layout, workdir)
        if trainer and layout in (REFERENCE, *TRAINER_LAYOUTS.values()):
            res["trainer"] = _trainer_step(layout, workdir)
        if layout in (REFERENCE, LAYOUTS_2["sp2"]):
            res["trainer_lora"] = _trainer_step(layout, workdir, lora=True)
        results[layout] = res
    torch.save(results, f"{out}.rank{rank}")


@pytest.fixture(scope="module")
def results(workdir):
    run_distributed(_worker, 1, workdir, [REFERENCE], True, str(workdir / "ref"), timeout_s=300)
    run_distributed(_worker, 2, workdir, list(LAYOUTS_2.values()), False, str(workdir / "two"), timeout_s=300)
    run_distributed(_worker, 4, workdir, list(LAYOUTS_4.values()), True, str(workdir / "four"), timeout_s=300)
    ref = torch.load(str(workdir / "ref.rank0"), weights_only=False)[REFERENCE]
    par = {name: [torch.load(str(workdir / f"two.rank{r}"), weights_only=False)[lay] for r in range(2)]
           for name, lay in LAYOUTS_2.items()}
    par.update({name: [torch.load(str(workdir / f"four.rank{r}"), weights_only=False)[lay] for r in range(4)]
                for name, lay in LAYOUTS_4.items()})
    return ref, par


def _close_params(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for name, value in got.items():
        diff = float((value - want[name]).abs().max())
        assert diff < 2e-5, f"{what} {name}: {diff}"


@pytest.mark.parametrize("name", [*LAYOUTS_2, *LAYOUTS_4])
def test_sp_actor_and_critic_match_one_rank(results, name):
    ref, par = results
    assert ref["actor"]["actor/grad_norm"] > 0 and ref["critic"]["critic/grad_norm"] > 0
    for rank, got in enumerate(par[name]):
        assert got["sp"] == ({**LAYOUTS_2, **LAYOUTS_4}[name][1])  # the Ulysses path really ran
        rows, mask = got["rows"], got["mask"]
        torch.testing.assert_close(got["log_probs"] * mask, ref["log_probs"][rows] * mask, atol=2e-5, rtol=0)
        torch.testing.assert_close(got["entropy"] * mask, ref["entropy"][rows] * mask, atol=2e-5, rtol=0)
        torch.testing.assert_close(got["values"], ref["values"][rows], atol=2e-5, rtol=0)
        for key in ACTOR_METRICS:
            assert got["actor"][key] == pytest.approx(ref["actor"][key], rel=1e-4, abs=1e-6), (name, rank, key)
        for key in CRITIC_METRICS:
            assert got["critic"][key] == pytest.approx(ref["critic"][key], rel=1e-4, abs=1e-6), (name, rank, key)
        _close_params(got["actor_params"], ref["actor_params"], f"{name} rank {rank} actor")
        _close_params(got["critic_params"], ref["critic_params"], f"{name} rank {rank} critic")


@pytest.mark.parametrize("name", TRAINER_LAYOUTS)
def test_sp_grpo_step_metrics_match_dp_only(results, name):
    ref, par = results
    for rank, got in enumerate(par[name]):
        for key in TRAINER_METRICS:
            assert got["trainer"][key] == pytest.approx(ref["trainer"][key], rel=1e-4, abs=1e-6), (rank, key)


def test_sp_lora_grpo_step_matches_one_rank(results):
    ref, par = results
    assert ref["trainer_lora"]["actor/grad_norm"] > 0
    for rank, got in enumerate(par["sp2"]):
        for key in TRAINER_METRICS:
            assert got["trainer_lora"][key] == pytest.approx(ref["trainer_lora"][key], rel=1e-4, abs=1e-6), (rank, key)
