"""3-D layouts (pp x dp x tp, and the rollout tp) against the 1-rank run, on 4 gloo ranks.

For each layout, one spawn of 4 ranks (and one of 1 rank for the reference) runs:

* **update**: old log-probs and one actor update (PPO-clip + KL loss + entropy bonus, two
  mini-batches, gradient accumulation / pipeline micro-batches) of a fixed global batch:
  same log-probs, loss, grad norm and updated parameters as on 1 rank (fp32 tolerance);
* **rollout**: greedy responses token-identical to the 1-rank rollout, and seeded
  sampling (keyed by global prompt index) too, with the same sampler log-probs;
* **trainer**: the first ``RLTrainer.train_step`` of one config (tiny model, addition
  prompts, a dense reward file): reward, loss, KL loss and grad norm agree.
"""

from __future__ import annotations

import pytest
import torch

from tests._assets import write_tiny_assets
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import run_distributed

# name -> (pp, dp, tp, rollout tp)
LAYOUTS = {
    "dp4": (1, 4, 1, 1),
    "dp2xtp2": (1, 2, 2, 2),
    "pp2xdp2": (2, 2, 1, 1),
    "pp2xtp2": (2, 1, 2, 2),
    "tp2_to_rollout_tp1": (1, 2, 2, 1),
}
REFERENCE = (1, 1, 1, 1)
# The whole first trainer step (RLTrainer with data, sampler, rewards, update) on the layouts that
# differ in how the step is split: dp, dp x tp, pp x tp. pp2xdp2 and the tp2 -> rollout tp1 reshard
# are checked above it (update and rollouts); each trainer is a full start-up on 4 ranks.
TRAINER_LAYOUTS = ("dp4", "dp2xtp2", "pp2xtp2")
N_PROMPTS, N_SAMPLES, P, R, MINI = 8, 2, 6, 8, 4

REWARD_FILE = '''
def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    """Dense toy reward: the share of digits in the response (varies between samples)."""
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = write_tiny_assets(tmp_path_factory.mktemp("layouts"), num_layers=4, n_train=64, n_val=8, n_sft=8)
    (d / "reward.py").write_text(REWARD_FILE)
    return d


def _global_batch(vocab: int):
    return random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, vocab)


def _prompts(vocab: int):
    from rlhf.schema.batch import PromptBatch

    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(6, vocab, (int(torch.randint(2, P + 1, (1,), generator=g)),), generator=g).tolist()
           for _ in range(N_PROMPTS)]
    keys = [100 + 7 * i for i in range(N_PROMPTS)]
    return PromptBatch(prompt_ids=ids, keys=keys, ground_truths=[""] * N_PROMPTS,
                       data_sources=["toy"] * N_PROMPTS, extra_infos=[{}] * N_PROMPTS)


def _update_and_rollout(layout, workdir, rank: int) -> dict:
    """Rollouts of the initial weights, then log-probs + one update; full params after."""
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.models.loading import load_tokenizer
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.rollout.reshard import RolloutLayout, gather_rollout_weights
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.schema.config import ActorConfig, ModelConfig, ParallelConfig, RolloutConfig
    from rlhf.train.actor import PolicyWorker

    pp, dp, tp, rtp = layout
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
                      kl_loss_coef=0.1, entropy_coeff=0.01, clip_ratio_high=0.28, grad_clip=1.0, weight_decay=0.0)
    worker = PolicyWorker(ModelConfig(path=str(workdir / "model")), mesh, torch.device("cpu"), actor_cfg=cfg,
                          total_steps=1, parallel_cfg=ParallelConfig(pp=pp, tp=tp, dp=dp, pp_microbatches=2))
    vocab = worker.hf_config.vocab_size
    prompts = _prompts(vocab)
    local_prompts = minibatch_major_shard(list(range(N_PROMPTS)), dp_rank, dp, MINI)
    out: dict = {"local_prompts": local_prompts}

    tok = load_tokenizer(str(workdir / "model"))
    engine = RolloutEngine(RolloutConfig(n=N_SAMPLES, tp=rtp, seed=3, max_num_seqs=8), tok, max_prompt_length=P,
                           max_response_length=R, device=torch.device("cpu"),
                           layout=RolloutLayout.build(rtp, "cpu"))
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        batch, stats = engine.generate(worker.model, worker.hf_config, prompts, step=1, n=N_SAMPLES,
                                       temperature=temperature, local_rows=local_prompts, pp_group=worker.pp_group)
        out[name] = (batch.responses.clone(), batch.response_mask.clone(), batch.rollout_log_probs.clone(),
                     batch.index.clone())
        out["reshard_bytes"] = stats["reshard/bytes_received"]

    batch = _global_batch(vocab)
    local = batch.select([p * N_SAMPLES + j for p in local_prompts for j in range(N_SAMPLES)])
    lp, ent = worker.compute_log_probs(local, temperature=0.9, micro_batch_size=2, compute_entropy=True)
    out["log_probs"], out["entropy"], out["mask"] = lp, ent, local.response_mask
    out["metrics"] = worker.update_policy(local, mini_batch_rows=MINI * N_SAMPLES // dp, temperature=1.0,
                                          max_response_length=R)
    full, _ = gather_rollout_weights(worker.model, pp_group=worker.pp_group)
    out["params"] = {n: t.clone() for n, t in full.items()}
    return out


def _trainer_step(layout, workdir, rank: int) -> dict:
    from rlhf.config.load import load_config
    from rlhf.train.trainer import RLTrainer

    pp, dp, tp, rtp = layout
    overrides = [
        f"model.path={workdir / 'model'}", f"data.train_files={workdir / 'data' / 'train.parquet'}",
        "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=8",
        "rollout.n=2", "rollout.temperature=1.0", f"rollout.tp={rtp}", "rollout.seed=11",
        "actor.lr=1e-3", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.log_prob_micro_batch_size_per_gpu=4", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
        "actor.entropy_coeff=0.01", "actor.weight_decay=0.0", "algorithm.adv_estimator=grpo",
        f"reward.reward_fn={workdir / 'reward.py'}:digit_share",
        f"parallel.pp={pp}", f"parallel.tp={tp}", "parallel.dp=-1", "parallel.pp_microbatches=2",
        "trainer.device=cpu", "trainer.logger=[]", "trainer.total_training_steps=1",
        f"trainer.output_dir={workdir / ('run_%d%d%d%d' % layout)}", "checkpoint.export_hf=false",
    ]
    trainer = RLTrainer(load_config(None, overrides))
    return trainer.train_step(1)


def _worker(rank: int, world: int, workdir, layouts: list, out: str) -> None:
    results: dict = {}
    done_training: dict = {}
    for layout in layouts:
        key = layout[:3]
        res = _update_and_rollout(layout, workdir, rank)
        if key in done_training:  # same training layout: the update was checked already
            res.pop("params")
        done_training[key] = True
        if layout == REFERENCE or layout in [LAYOUTS[n] for n in TRAINER_LAYOUTS]:
            res["trainer"] = _trainer_step(layout, workdir, rank)
        results[layout] = res
    torch.save(results, f"{out}.rank{rank}")


@pytest.fixture(scope="module")
def results(workdir):
    run_distributed(_worker, 1, workdir, [REFERENCE], str(workdir / "ref"), timeout_s=300)
    run_distributed(_worker, 4, workdir, list(LAYOUTS.values()), str(workdir / "par"), timeout_s=300)
    ref = torch.load(str(workdir / "ref.rank0"), weights_only=False)[REFERENCE]
    par = [torch.load(str(workdir / f"par.rank{r}"), weights_only=False) for r in range(4)]
    return ref, par


def _rows(prompts: list[int]) -> list[int]:
    return [p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rollouts_match_one_rank(results, name):
    ref, par = results
    for rank in range(4):
        got = par[rank][LAYOUTS[name]]
        rows = _rows(got["local_prompts"])
        for kind in ("greedy", "sampled"):
            r_resp, r_mask, r_lp, r_idx = ref[kind]
            resp, mask, lp, idx = got[kind]
            assert torch.equal(idx, r_idx[rows]), f"{name} rank {rank}: rows are not this rank's prompts"
            assert torch.equal(mask, r_mask[rows]), f"{name} rank {rank} {kind}: lengths differ"
            assert torch.equal(resp * mask.long(), r_resp[rows] * r_mask[rows].long()), \
                f"{name} rank {rank} {kind}: tokens differ"
            torch.testing.assert_close(lp * mask, r_lp[rows] * r_mask[rows], atol=1e-4, rtol=0)
        assert got["reshard_bytes"] > 0


@pytest.mark.parametrize("name", ["dp4", "dp2xtp2", "pp2xdp2", "pp2xtp2"])
def test_update_matches_one_rank(results, name):
    ref, par = results
    for rank in range(4):
        got = par[rank][LAYOUTS[name]]
        rows = _rows(got["local_prompts"])
        mask = got["mask"]
        torch.testing.assert_close(got["log_probs"] * mask, ref["log_probs"][rows] * mask, atol=2e-5, rtol=0)
        torch.testing.assert_close(got["entropy"] * mask, ref["entropy"][rows] * mask, atol=2e-5, rtol=0)
        for key in ("actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/pg_clipfrac"):
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), (name, rank, key)
        expected = set(ref["params"]) | ({"lm_head.weight"} if LAYOUTS[name][0] > 1 else set())
        assert set(got["params"]) == expected
        for pname, value in got["params"].items():
            want = ref["params"]["model.embed_tokens.weight" if pname not in ref["params"] else pname]
            diff = float((value - want).abs().max())
            assert diff < 2e-5, f"{name} rank {rank} {pname}: {diff}"
    assert ref["metrics"]["actor/grad_norm"] > 0


@pytest.mark.parametrize("name", TRAINER_LAYOUTS)
def test_first_trainer_step_metrics_agree(results, name):
    ref, par = results
    for rank in range(4):
        got = par[rank][LAYOUTS[name]]["trainer"]
        # Every logged metric is global, except what measures this rank's own work (time, bytes, sampler).
        own = ("timing/", "perf/", "reshard/", "rollout/")
        keys = [k for k in ref["trainer"] if not k.startswith(own)]
        assert {"reward/score_mean", "reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy"} <= set(keys)
        assert set(keys) == {k for k in got if not k.startswith(own)}, (name, rank)
        for key in keys:
            assert got[key] == pytest.approx(ref["trainer"][key], rel=1e-4, abs=1e-6), (name, rank, key)
        assert got["timing/reshard"] >= 0 and got["reshard/bytes_received"] > 0
    assert ref["trainer"]["reward/std"] > 0  # the reward really varies, so advantages are not all zero


@pytest.mark.parametrize("sizes, kw, message", [
    (dict(tp=2, pp=1), dict(world=6), None),
    (dict(tp=4, pp=1), dict(world=8), "num_key_value_heads=2 is not divisible by parallel.tp=4"),
    (dict(tp=3, pp=1), dict(world=6), "num_attention_heads=4 is not divisible by parallel.tp=3"),
    (dict(tp=2, pp=2), dict(world=6), "world size 6 is not divisible by parallel.tp x parallel.pp = 2 x 2 = 4"),
    (dict(tp=1, pp=3), dict(world=3), "num_hidden_layers=4 is not divisible by the 3 pipeline stages"),
    (dict(tp=1, pp=1), dict(world=4, train_batch_size=6), r"data.train_batch_size \(6\) is not divisible by dp \(4"),
    (dict(tp=1, pp=2), dict(world=4, mini_batch_size=2, n=1), "1 rows is not divisible by parallel.pp_microbatches=2"),
    (dict(tp=1, pp=1), dict(world=4, rollout_tp=3), "rollout.tp=3 does not divide the world size 4"),
    # a rollout wider than the KV heads replicates them (issue 39 item 8); wider than the heads is refused
    (dict(tp=1, pp=1), dict(world=4, rollout_tp=4), None),
    (dict(tp=1, pp=1), dict(world=8, rollout_tp=8), "num_attention_heads=4 is not divisible by rollout.tp=8"),
])
def test_validate_layout_names_the_product(sizes, kw, message):
    from transformers import Qwen2Config

    from rlhf.models.parallelize import validate_layout
    from rlhf.schema.config import ConfigError, ParallelConfig

    hf = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2)
    world = kw.pop("world")
    cfg = ParallelConfig(pp_microbatches=2, **sizes)
    if message is None:
        validate_layout(cfg, hf, world, **kw)
        return
    with pytest.raises(ConfigError, match=message):
        validate_layout(cfg, hf, world, **kw)
