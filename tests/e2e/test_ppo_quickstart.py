"""train_ppo.py end to end on 2 gloo ranks: critic metrics logged, critic warm-up, a reward model
with its own tokenizer added to the rule-based reward, checkpoint + resume."""

from __future__ import annotations

import json
import math

import pytest

from rlhf.ops.metrics import DEFAULT_CONSOLE_KEYS, read_metrics
from tests.e2e.conftest import grpo_args, run_script

CRITIC_KEYS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/explained_variance",
               "critic/vf_explained_var", "critic/grad_norm", "critic/lr", "critic/values/mean", "critic/returns/mean"]


def ppo_args(assets, out, **over) -> list[str]:
    base = {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
            "algorithm.critic_warmup": 1, "critic.lr": 1e-3, "critic.ppo_mini_batch_size": 4,
            "critic.ppo_micro_batch_size_per_gpu": 4, "checkpoint.save_freq": 2, "checkpoint.export_hf": True,
            "trainer.total_training_steps": 3, "trainer.test_freq": -1}
    base.update(over)
    return grpo_args(assets, out, **base)


def _reward_model(path) -> None:
    """A tiny random sequence-classification RM whose character tokenizer orders ids differently."""
    import torch
    import transformers

    from rlhf.data.char_tokenizer import DEFAULT_CHARS, build_char_tokenizer

    tok = build_char_tokenizer(DEFAULT_CHARS[::-1])
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                                   pad_token_id=tok.pad_token_id)
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def test_ppo_runs_logs_critic_metrics_and_resumes(tiny_assets, tmp_path):
    out = tmp_path / "ppo"
    _reward_model(tmp_path / "rm")
    rm = {"reward.reward_model.enable": True, "reward.reward_model.path": tmp_path / "rm",
          "reward.reward_model.combine": "add"}
    r = run_script("train_ppo.py", ppo_args(tiny_assets, out, **rm), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["step"]: row for row in read_metrics(out / "metrics.jsonl") if "critic/vf_loss" in row}
    assert sorted(rows) == [1, 2, 3]
    # The console line shows loss and KL: every console key is a metric this run logged.
    logged = {k for row in read_metrics(out / "metrics.jsonl") for k in row}
    assert set(DEFAULT_CONSOLE_KEYS) <= logged, set(DEFAULT_CONSOLE_KEYS) - logged
    line = next(x for x in r.stdout.splitlines() if x.startswith("step 3/3"))
    assert all(f"| {k} " in line for k in ("actor/loss", "actor/kl_to_ref", "critic/vf_loss")), line
    for step, row in rows.items():
        missing = [k for k in CRITIC_KEYS if k not in row]
        assert not missing, (step, missing)
        assert math.isfinite(row["critic/vf_loss"]) and row["critic/lr"] == 1e-3
    # critic_warmup = 1: step 1 trains only the critic
    assert "actor/loss" not in rows[1] and "actor/loss" in rows[2] and "actor/loss" in rows[3]
    assert rows[1]["critic/values/mean"] == 0.0  # zero-initialised value head
    assert rows[1]["reward/rm_score_mean"] != 0.0 and rows[1]["critic/vf_loss"] > 0
    assert rows[2]["critic/values/mean"] != 0.0  # the critic learnt from step 1
    assert "kl_penalty/kl" in rows[2] and "summary/val_acc_final" in read_metrics(out / "metrics.jsonl")[-1]
    state = json.loads((out / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    assert "critic_scheduler" in state
    # The exported critic reloads as a critic (value head kept, not re-initialised).
    from rlhf.train.critic import load_value_model

    critic = load_value_model(str(out / "critic_hf_export"))
    assert critic.config.num_labels == 1 and float(critic.score.weight.abs().sum()) > 0

    # A longer run in the same directory resumes from global_step_2 (actor + critic + optimizers).
    r = run_script("train_ppo.py", ppo_args(tiny_assets, out, **rm, **{"trainer.total_training_steps": 4}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 2" in r.stdout


def test_critic_free_estimator_runs_without_critic_and_grpo_script_rejects_gae(tiny_assets, tmp_path):
    # As verl's main_ppo: train_ppo.py trains a critic only for gae; grpo runs as train_grpo.py does.
    args = ppo_args(tiny_assets, tmp_path, **{"algorithm.adv_estimator": "grpo"}) + ["--dry-run"]
    r = run_script("train_ppo.py", args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "algorithm.adv_estimator='grpo' needs no critic: training without one" in r.stdout
    r = run_script("train_grpo.py", ppo_args(tiny_assets, tmp_path) + ["--dry-run"])
    assert r.returncode == 2 and "error: algorithm.adv_estimator 'gae' trains a critic: run train_ppo.py" in r.stderr


def test_ppo_pipeline_and_padding_free_layouts_train_and_export(tiny_assets, tmp_path):
    """PPO on 2 ranks as pp2 (pipelined actor and critic; both exported from stages) and as dp2
    with padding-free passes and token-budget micro-batches."""
    from transformers import AutoModelForCausalLM

    from rlhf.train.critic import load_value_model

    layouts = {"pp2": {"parallel.pp": 2, "parallel.pp_microbatches": 2},
               "dp2_packed": {"model.use_remove_padding": True, "actor.use_dynamic_bsz": True,
                              "actor.ppo_max_token_len_per_gpu": 40, "actor.log_prob_max_token_len_per_gpu": 40,
                              "critic.ppo_max_token_len_per_gpu": 40}}
    # A dense reward, so that the untrained model's returns (and the critic's update) are not all 0.
    (tmp_path / "reward.py").write_text(
        "def digit_share(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n")
    first = {}
    for name, over in layouts.items():
        out = tmp_path / name
        args = ppo_args(tiny_assets, out, **{"algorithm.critic_warmup": 0, "trainer.total_training_steps": 2,
                                             "checkpoint.save_freq": -1, "data.val_files": "",
                                             "reward.reward_fn": f"{tmp_path / 'reward.py'}:digit_share", **over})
        r = run_script("train_ppo.py", args, nproc=2)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        rows = {row["step"]: row for row in read_metrics(out / "metrics.jsonl") if "critic/vf_loss" in row}
        assert sorted(rows) == [1, 2], name
        assert rows[1]["critic/values/mean"] == 0.0 and rows[2]["critic/values/mean"] != 0.0, name
        assert all(math.isfinite(rows[s][k]) for s in rows for k in ("critic/vf_loss", "actor/loss")), name
        actor = AutoModelForCausalLM.from_pretrained(out / "hf_export")
        init = AutoModelForCausalLM.from_pretrained(tiny_assets / "model")
        assert max(float((p - q).abs().max()) for p, q in zip(actor.parameters(), init.parameters())) > 0, name
        critic = load_value_model(str(out / "critic_hf_export"))
        assert float(critic.score.weight.abs().sum()) > 0, name
        first[name] = rows[1]
    # Same seeded rollouts from the same weights: the first step's losses do not depend on the layout.
    for key in ("reward/mean", "critic/vf_loss", "critic/grad_norm", "actor/loss", "actor/grad_norm"):
        assert first["pp2"][key] == pytest.approx(first["dp2_packed"][key], rel=1e-4, abs=1e-7), key
