"""trainer.mode fully_async pieces without a process group: the split's checks, AReaL's admission
bound, the staleness metrics."""

from __future__ import annotations

import pytest
import torch

from rlhf.config.load import load_config
from rlhf.schema.config import ConfigError
from rlhf.train.async_rl.split import check_fully_async
from rlhf.train.async_rl.staleness import admission_bound, idle_share, staleness_metrics


def _cfg(**over):
    base = {"model.path": "m", "data.train_files": "t.parquet", "trainer.mode": "fully_async",
            "data.train_batch_size": 8, "actor.ppo_mini_batch_size": 4, "async_training.require_batches": 2}
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()], check=lambda c: None)


@pytest.mark.parametrize("world,over,msg", [
    (1, {}, "must leave 1 to 0 of the 1 ranks"),
    (4, {"parallel.rollout_ranks": 4}, "must leave 1 to 3"),
    (4, {"async_training.require_batches": 1}, "must equal data.train_batch_size (8)"),
    (4, {"async_training.staleness_threshold": 0.5}, "set actor.tis_imp_ratio_cap"),
    (4, {"rollout.tp": 2}, "does not support rollout.tp > 1"),
])
def test_split_errors_name_the_key(world, over, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        check_fully_async(_cfg(**over), world)


def test_unequal_splits():
    assert check_fully_async(_cfg(**{"parallel.rollout_ranks": 3}), 4) == (1, 3)
    assert check_fully_async(_cfg(**{"rollout.nnodes": 1, "rollout.n_gpus_per_node": 2}), 3) == (1, 2)
    assert check_fully_async(_cfg(), 4) == (2, 2)  # default: half


def test_admission_bound_hand_values():
    # eta 0, trigger 1: batch v+1 only, once theta_v is held (the synchronous schedule)
    assert [admission_bound(v, 8, 1, 0.0) for v in (0, 1, 2)] == [8, 16, 24]
    # eta 0.5: half a window ahead; trigger 2: two updates' prompts per push
    assert admission_bound(0, 8, 1, 0.5) == 12 and admission_bound(2, 8, 2, 0.0) == 32
    assert admission_bound(2, 8, 2, 1.0) == 16 + 32
    with pytest.raises(ValueError):
        admission_bound(0, 8, 0, 0.0)


def test_staleness_metrics_over_masked_tokens():
    versions = torch.tensor([[3, 3, 4, 0], [2, 4, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.float32)  # a hole at [1, 0]
    m = staleness_metrics(versions, mask, trained_version=4)
    assert m == {"async/staleness_mean": pytest.approx((1 + 1 + 0 + 0) / 4), "async/staleness_max": 1.0}
    assert idle_share(1.0, 4.0) == 0.25 and idle_share(1.0, 0.0) == 0.0


def test_planner_sizes_the_training_ranks_of_the_split():
    from pathlib import Path

    from rlhf.planner import ModelShape, plan_memory

    s = ModelShape.from_model_dir(str(Path(__file__).resolve().parents[2] / "configs" / "models" / "Qwen2.5-7B"))
    cfg = load_config(None, ["model.path=x", "data.train_files=x", "data.train_batch_size=8",
                             "actor.ppo_mini_batch_size=8", "trainer.mode=fully_async", "parallel.rollout_ranks=6"])
    plan = plan_memory(s, cfg, world_size=8, device="cuda")
    assert plan.layout["dp"] == 2 and "rollout" not in plan.phases and "weight send" in plan.phases


def test_quickstart_config_is_a_valid_split_of_four():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "quickstart_fully_async.yaml"
    cfg = load_config(str(path), [], check=lambda c: None)
    assert cfg.trainer.mode == "fully_async" and check_fully_async(cfg, 4) == (2, 2)


def test_tools_quickstart_and_lora_are_valid_fully_async_splits():
    """Multi-turn tools and LoRA are no longer refused: the tools quickstart as 2 + 2 (the command in
    docs/concepts/modes.md)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "quickstart_tools.yaml"
    over = ["trainer.mode=fully_async", "parallel.rollout_ranks=2", "async_training.require_batches=2"]
    cfg = load_config(str(path), over, check=lambda c: None)
    assert cfg.rollout.multi_turn.enable and check_fully_async(cfg, 4) == (2, 2)
    assert check_fully_async(_cfg(**{"model.lora_rank": 8}), 4) == (2, 2)


def test_verl_fully_async_keys_map_to_the_same_names():
    from rlhf.config.verl import translate

    out = translate({"actor_rollout_ref": {"model": {"path": "x"}},
                     "async_training": {"staleness_threshold": 0.5, "trigger_parameter_sync_step": 2,
                                        "require_batches": 2, "partial_rollout": False, "use_rollout_log_probs": True},
                     "rollout": {"nnodes": 1, "n_gpus_per_node": 3}}, verbose=False)
    assert out["async_training"] == {"staleness_threshold": 0.5, "trigger_parameter_sync_step": 2,
                                     "require_batches": 2, "partial_rollout": False, "use_rollout_log_probs": True}
    assert out["rollout"] == {"nnodes": 1, "n_gpus_per_node": 3}


def test_use_rollout_log_probs_skips_the_old_log_prob_forward(monkeypatch):
    """async_training.use_rollout_log_probs: the trainer takes the sampler's log-probs as the old ones
    without its forward pass (the fully_async bottleneck), except for a MoE actor whose pass records
    the routes; off (or another mode), the pass runs."""
    from types import SimpleNamespace

    from rlhf.train import trainer
    from rlhf.train.trainer import RLTrainer

    monkeypatch.setattr(trainer.dist, "get_world_size", lambda group=None: 1)  # one dp rank, no process group
    calls = []

    def forward(batch, **kw):
        calls.append(kw)
        return batch.rollout_log_probs + 0.5, torch.ones_like(batch.rollout_log_probs)

    def run(cfg, router_replay=None):
        calls.clear()
        lp = torch.tensor([[-1.0, -2.0]])
        batch = SimpleNamespace(rollout_log_probs=lp, response_mask=torch.ones(1, 2), old_log_probs=None)
        me = SimpleNamespace(cfg=cfg, need_ref=False, dp_group=None, distill=None,
                             actor=SimpleNamespace(compute_log_probs=forward, router_replay=router_replay),
                             _global_masked_mean=lambda x, m: float((x * m).sum() / m.sum()))
        metrics = RLTrainer.compute_log_probs(me, batch)
        return batch.old_log_probs - lp, metrics, len(calls)

    on = _cfg(**{"async_training.use_rollout_log_probs": True})
    diff, metrics, n = run(on)
    assert n == 0 and float(diff.abs().max()) == 0.0 and "actor/entropy" not in metrics
    diff, metrics, n = run(on, router_replay=object())  # MoE: the pass runs for its routes
    assert n == 1 and float(diff.abs().max()) == 0.0 and metrics["actor/entropy"] == 1.0
    diff, metrics, n = run(_cfg())
    assert n == 1 and torch.allclose(diff, torch.full((1, 2), 0.5)) and metrics["rollout/logprob_diff_max"] == 0.5


def test_idle_shares_are_shares_of_the_role_s_own_cycle():
    """one_step_off's rollout idle share (bench/async.py): per cycle of the rollout rank (generate, hand
    over, wait for weights), never above 1, and the rows waiting on warm-up steps are left out. The old
    figure, idle seconds over the trainer's step time, read 600%+ from a slow first step."""
    import importlib

    from rlhf.train.async_rl.staleness import IdleClock

    clock = IdleClock(now=10.0)
    clock.wait(1.0)
    clock.wait(0.5)
    assert clock.lap(now=16.0) == (0.25, 1.5)  # 1.5 s of a 6 s cycle
    assert clock.lap(now=17.0) == (0.0, 0.0)  # a new cycle, nothing booked
    clock.wait(9.0)
    assert clock.lap(now=20.0)[0] == 1.0  # clamped (a clock step)
    bench = importlib.import_module("bench.async")
    # row 1 (first timed) waited 12 s on a slow warm-up step while later steps take 1 s
    rows = [{"async/rollout_idle_s": 12.0, "async/rollout_idle_share": 0.92, "timing/step": 1.0},
            {"async/rollout_idle_s": 0.4, "async/rollout_idle_share": 0.3, "timing/step": 1.0},
            {"async/rollout_idle_s": 0.2, "async/rollout_idle_share": 0.2, "timing/step": 1.0},
            {"async/rollout_idle_s": 0.4, "async/rollout_idle_share": 0.4, "timing/step": 1.0}]
    assert bench.mean(rows, "async/rollout_idle_s") / bench.mean(rows, "timing/step") > 3  # the old 300%+
    assert bench.one_step_off_rollout_idle_share(rows) == pytest.approx(0.3)
