"""Multi-turn (tool-using) GRPO steps are layout-invariant: the first trainer step on 1 rank, on dp2
and on tp2 with a tp2 rollout (tools run on the TP group's first rank, results broadcast) log the
same metrics, tool-use metrics included."""

from __future__ import annotations

import pytest
import torch

from tests.dist._dist_utils import run_distributed

# name -> (training tp, rollout tp)
LAYOUTS = {"dp2": (1, 1), "tp2": (2, 2)}
REWARD_FILE = '''
def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))
'''


@pytest.fixture(scope="module")
def workdir(tool_assets):
    (tool_assets / "reward.py").write_text(REWARD_FILE)
    return tool_assets


def _step(rank: int, world: int, workdir, layouts: list, out: str) -> None:
    from rlhf.config.load import load_config
    from rlhf.train.trainer import RLTrainer

    results = {}
    for tp, rtp in layouts:
        overrides = [
            f"model.path={workdir / 'tool_model'}", f"data.train_files={workdir / 'data' / 'train.parquet'}",
            "data.max_prompt_length=16", "data.max_response_length=128", "data.train_batch_size=8",
            "rollout.n=2", "rollout.temperature=1.0", f"rollout.tp={rtp}", "rollout.seed=5",
            "rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={workdir / 'tools.yaml'}",
            "rollout.multi_turn.num_workers=0", "actor.lr=1e-3", "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=4", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
            "actor.entropy_coeff=0.01", f"reward.reward_fn={workdir / 'reward.py'}:digit_share",
            f"parallel.tp={tp}", "trainer.device=cpu", "trainer.logger=[]", "trainer.total_training_steps=1",
            f"trainer.output_dir={workdir / f'run_{world}_{tp}_{rtp}'}", "checkpoint.export_hf=false",
        ]
        trainer = RLTrainer(load_config(None, overrides))
        results[(tp, rtp)] = trainer.train_step(1)
        trainer.close()
    torch.save(results, f"{out}.rank{rank}")


def test_multi_turn_step_metrics_agree_across_layouts(workdir):
    run_distributed(_step, 1, workdir, [(1, 1)], str(workdir / "ref"), timeout_s=300)
    run_distributed(_step, 2, workdir, list(LAYOUTS.values()), str(workdir / "par"), timeout_s=300)
    ref = torch.load(str(workdir / "ref.rank0"), weights_only=False)[(1, 1)]
    own = ("timing/", "perf/", "reshard/", "rollout/")  # this rank's own work
    keys = [k for k in ref if not k.startswith(own)]
    assert ref["agent/tool_calls_per_traj"] > 0.5 and ref["agent/observation_tokens_per_traj"] > 0
    assert ref["agent/tool_errors/parse"] > 0  # the fixture model also writes broken calls
    for rank in range(2):
        par = torch.load(str(workdir / f"par.rank{rank}"), weights_only=False)
        for name, layout in LAYOUTS.items():
            got = par[layout]
            assert {k for k in got if not k.startswith(own)} == set(keys), (name, rank)
            for key in keys:
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, rank, key)
