"""A real 2-rank run with every tracker (tensorboard, mlflow's sqlite store, wandb offline): each
tracker reads back every validation metric at every step and the run's hyperparameters; the
reward function gets reward.reward_kwargs and its extra dict keys are logged, global over ranks."""

from __future__ import annotations

import json

import pytest

from rlhf.ops.metrics import read_metrics
from rlhf.ops.trackers import mlflow_name
from tests.e2e.conftest import grpo_args, run_script
from tests.unit.test_loggers import _wandb_run

REWARD = '''
def scored(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    odd = float(len(solution_str) % 2)
    return {"score": odd + bonus, "odd": odd, "bonus_seen": bonus}
'''


def test_trackers_read_back_val_metrics_and_hyperparameters(tiny_assets, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "run"
    r = run_script("train_grpo.py", grpo_args(tiny_assets, out, **{
        "reward.reward_fn": f"{tmp_path / 'reward.py'}:scored", "reward.reward_kwargs": "{bonus: 0.25}",
        "reward.num_workers": 1, "trainer.total_training_steps": 1,
        "trainer.logger": "[console,jsonl,tensorboard,mlflow,wandb]"}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    val = {(row["step"], k): v for row in rows for k, v in row.items() if k.startswith("val/")}
    assert {k for _, k in val} >= {"val/acc", "val/pass@1", "val/synthetic/addition/pass@1", "val/reward/odd",
                                   "val/reward/bonus_seen", "val/synthetic/addition/reward/odd"}
    assert {s for s, _ in val} == {0, 1}
    # reward_kwargs reached the function (in worker processes); its extras are global means.
    train = next(row for row in rows if "actor/loss" in row)
    assert train["reward/bonus_seen"] == 0.25 and val[(1, "val/reward/bonus_seen")] == 0.25
    assert train["reward/mean"] == pytest.approx(train["reward/odd"] + 0.25)

    tb = EventAccumulator(str(out / "tensorboard" / "run"))
    tb.Reload()
    assert {(e.step, k): e.value for _, k in val for e in tb.Scalars(k)} == pytest.approx(val)
    content = tb.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["data.train_batch_size"].number_value == 8 and hparams["reward.reward_kwargs.bonus"].number_value == 0.25

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    got = {(m.step, k): m.value for _, k in val for m in client.get_metric_history(run.info.run_id, mlflow_name(k))}
    assert got == val
    assert run.data.params["actor.lr"] == "0.001" and run.data.params["reward.reward_kwargs.bonus"] == "0.25"

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    wb_run, history = _wandb_run(run_file)
    got = {(h["_step"], k): h[k] for h in history for k in h if k.startswith("val/")}
    assert got == val
    config = {i.key: json.loads(i.value_json) for i in wb_run.config.update}
    assert config["rollout.n"] == 2 and config["trainer.logger"][-1] == "wandb"
