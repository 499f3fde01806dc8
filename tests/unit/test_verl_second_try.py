"""Issue 39 (a verl user's second try): the one-process dry run makes the trainer's start-up checks,
refusals come all at once, the printed native command pastes into a shell, resume and KL semantics
follow verl."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from rlhf.config.load import load_config, parse_override
from rlhf.schema.config import ConfigError
from tests._assets import write_tiny_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return write_tiny_assets(tmp_path_factory.mktemp("assets"), n_train=32, n_val=8)


def _cfg(assets: Path, *overrides: str):
    return load_config(None, [f"model.path={assets / 'model'}", f"data.train_files={assets / 'data' / 'train.parquet'}",
                              "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "data.max_prompt_length=32",
                              "data.max_response_length=16", *overrides])


def _dry_checks(cfg) -> str:
    from rlhf.cli import check_tokenizer_and_data

    check_tokenizer_and_data(cfg)


def test_batch_larger_than_dataset_is_one_line_at_dry_run(assets):
    """Item 1: a batch larger than the data fails the dry run, naming the key (not drop_last)."""
    with pytest.raises(ConfigError, match=r"data.train_batch_size \(64\) is larger than the 32 training prompts"):
        _dry_checks(_cfg(assets, "data.train_batch_size=64", "actor.ppo_mini_batch_size=64"))
    from rlhf.train.prompts import make_loader

    with pytest.raises(ConfigError, match="lower data.train_batch_size to at most 32"):
        make_loader(_cfg(assets, "data.train_batch_size=64", "actor.ppo_mini_batch_size=64"), 32)


@pytest.mark.parametrize("overrides, msg", [
    (("model.lora_rank=8", "rollout.tp=2", "trainer.mode=one_step_off"), "one_step_off needs rollout.tp = 1"),
    (("reward.reward_fn=/no/such/reward.py:compute_score",), "reward.reward_fn .verl: custom_reward_function"),
    (("algorithm.adv_estimator=grpoo",), "algorithm.adv_estimator"),
])
def test_one_process_dry_run_makes_the_startup_checks(assets, overrides, msg):
    """Item 2: the checks the trainer makes at start-up run in the one-process dry run too."""
    with pytest.raises(ConfigError, match=msg):
        _dry_checks(_cfg(assets, *overrides))


def test_wrong_reward_function_name_at_dry_run(assets, tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    _dry_checks(_cfg(assets, f"custom_reward_function.path={f}"))
    with pytest.raises(ConfigError, match="'score' not found"):
        _dry_checks(_cfg(assets, f"custom_reward_function.path={f}", "custom_reward_function.name=score"))


REQ = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"]


def test_every_refused_key_at_once():
    """Item 6: one error line listing every refused key (and unknown native keys), not one per attempt."""
    with pytest.raises(ConfigError) as e:
        load_config(None, REQ + ["actor_rollout_ref.model.custom_chat_template=x", "reward_model.sandbox_fusion.url=u",
                                 "actor_rollout_ref.actor.loss_mode=kl_cov", "trainer.val_only=True",
                                 "data.no_such_key=1"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("5 settings cannot be used here: ")
    for key in ("custom_chat_template", "sandbox_fusion.url", "actor_rollout_ref.actor.loss_mode", "trainer.val_only",
                "unknown config key 'data.no_such_key'"):
        assert key in msg
    assert "set actor_rollout_ref.actor.policy_loss.loss_mode" in msg  # a hint where one exists
    with pytest.raises(ConfigError, match="^verl key 'trainer.val_only=True' is not supported here"):
        load_config(None, REQ + ["trainer.val_only=True"])  # a single refusal reads as before


def test_dapo_recipe_spellings():
    """Item 7: the DAPO recipe's custom_reward_function.overlong_buffer.* and use_token_level_loss map."""
    cfg = load_config(None, REQ + ["custom_reward_function.overlong_buffer.enable=True",
                                   "custom_reward_function.overlong_buffer.len=128",
                                   "custom_reward_function.overlong_buffer.penalty_factor=0.5",
                                   "custom_reward_function.overlong_buffer.log=False",
                                   "actor_rollout_ref.actor.use_token_level_loss=True"])
    assert (cfg.reward.overlong_buffer_enable, cfg.reward.overlong_buffer_len) == (True, 128)
    assert cfg.reward.overlong_penalty_factor == 0.5 and cfg.reward.reward_fn == "default"
    assert cfg.actor.loss_agg_mode == "token-mean"
    cfg = load_config(None, REQ + ["actor_rollout_ref.actor.use_token_level_loss=False"])
    assert cfg.actor.loss_agg_mode == "seq-mean-token-mean"


def test_printed_native_command_pastes_into_a_shell(capsys, monkeypatch):
    """Item 11: `python -m rlhf.verl_compat` prints a command whose words, split as a shell splits them,
    load to the same config; a yaml error in an override is one line."""
    from rlhf.verl_compat.__main__ import main

    monkeypatch.setenv("RANK", "0")
    verl = REQ + ["trainer.logger=['console','wandb']", "trainer.project_name=my proj", "data.truncation='error'",
                  "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
                  "trainer.default_hdfs_dir=null", "algorithm.kl_ctrl.kl_coef=0.001"]
    main(verl)
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and "[verl]" in out.err  # stdout is the command alone
    words = shlex.split(out.out)
    assert words[:2] == ["python", "train_ppo.py"] and "trainer.logger=[console, wandb]" in words
    native = load_config(None, words[2:]).to_dict()
    assert native == load_config(None, verl).to_dict()
    with pytest.raises(ConfigError, match=r"^override 'trainer.logger=\[console, wandb': the value .* is not valid yaml"):
        parse_override("trainer.logger=[console, wandb")


def test_resume_mode_follows_verl():
    """Item 12: resume_path without a path is refused in one line (not silently auto); auto and disable
    ignore resume_from_path as verl does; resume_path with a path resumes from it."""
    with pytest.raises(ConfigError, match=r"^verl key 'trainer.resume_mode=resume_path' needs trainer.resume_from_path"):
        load_config(None, REQ + ["trainer.resume_mode=resume_path"])
    with pytest.raises(ConfigError, match="global_step_N"):
        load_config(None, REQ + ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/last"])
    cfg = load_config(None, REQ + ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/c/global_step_5"])
    assert cfg.checkpoint.resume == "/c/global_step_5"
    assert load_config(None, REQ + ["trainer.resume_mode=disable",
                                    "trainer.resume_from_path=/c/global_step_5"]).checkpoint.resume == "disable"
    assert load_config(None, REQ + ["trainer.resume_from_path=/c/global_step_5"]).checkpoint.resume == "auto"
    with pytest.raises(ConfigError, match="expected auto, disable or resume_path"):
        load_config(None, REQ + ["trainer.resume_mode=latest"])


def test_adaptive_kl_counts_sequences():
    """Item 14: the adaptive KL controller steps by prompts x n sequences, as verl (not by prompts)."""
    from rlhf.algos.kl import AdaptiveKLController, update_kl_controller

    ours, verl = AdaptiveKLController(0.1, 6.0, 10000), AdaptiveKLController(0.1, 6.0, 10000)
    update_kl_controller(ours, 9.0, prompts=64, n=8)
    verl.update(9.0, n_steps=64 * 8)  # verl: n_steps = batch.batch_size[0], the repeated batch
    assert ours.value == pytest.approx(verl.value) and ours.value == pytest.approx(0.1 * (1 + 0.2 * 512 / 10000))
    src = (Path(__file__).resolve().parents[2] / "rlhf" / "train" / "trainer.py").read_text()
    assert "update_kl_controller(self.kl_ctrl" in src and "n_steps=self.cfg.data.train_batch_size" not in src


BATCHED = '''
def compute_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    return [{"score": float(s == g) + bonus, "acc": float(s == g)} for s, g in zip(solution_strs, ground_truths)]
'''


def test_batch_reward_manager(tmp_path):
    """Item 10: reward_manager=batch calls the batched function once per batch (verl's BatchRewardManager);
    unknown managers are refused; naive/prime/dapo stay per sample."""
    from rlhf.rewards.pool import make_scorer

    f = tmp_path / "batched.py"
    f.write_text(BATCHED)
    cfg = load_config(None, REQ + ["reward_model.reward_manager=batch", f"custom_reward_function.path={f}",
                                   "+custom_reward_function.reward_kwargs.bonus=0.5"])
    assert cfg.reward.reward_manager == "batch"
    scorer = make_scorer(cfg.reward.reward_fn, num_workers=2, timeout_s=5, reward_kwargs=cfg.reward.reward_kwargs,
                         manager=cfg.reward.reward_manager)
    res = scorer.score(["3", "4", "5"], ["3", "5", "5"], ["t"] * 3, [{}] * 3)
    assert res.scores.tolist() == [1.5, 0.5, 1.5] and res.n_errors == 0 and res.extra_metrics["acc"] == [1, 0, 1]
    naive = make_scorer(cfg.reward.reward_fn, num_workers=0, timeout_s=5, reward_kwargs=cfg.reward.reward_kwargs)
    assert naive.score(["3"], ["3"], ["t"]).n_errors == 1  # the per-sample call of the same function fails
    assert load_config(None, REQ + ["reward_model.reward_manager=dapo"]).reward.reward_manager == "dapo"
    assert load_config(None, REQ + ["reward.reward_manager=prime"]).reward.reward_manager == "prime"
    with pytest.raises(ConfigError, match="reward_manager=my_manager': expected naive, prime, dapo or batch"):
        load_config(None, REQ + ["reward_model.reward_manager=my_manager"])


def test_global_micro_batch_over_the_planned_world(monkeypatch, capsys):
    """Item 4: the deprecated global micro-batch sizes are divided by nnodes x n_gpus_per_node (what the
    run is checked against), over sp as verl does, the same in `python -m rlhf.verl_compat` and at load;
    rounding down is said; a size below the rank count is refused."""
    from rlhf.verl_compat.__main__ import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "0")
    args = REQ + ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ppo_micro_batch_size=64",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size=40", "critic.ppo_micro_batch_size=32"]
    cfg = load_config(None, args)
    assert (cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.log_prob_micro_batch_size_per_gpu,
            cfg.critic.ppo_micro_batch_size_per_gpu) == (4, 2, 2)
    out = capsys.readouterr().out
    assert "global 40 // 16 data-parallel ranks (trainer.nnodes x n_gpus_per_node); 40 does not divide by 16, " \
           "rounded down as verl does" in out
    main(args)
    words = shlex.split(capsys.readouterr().out)
    assert "actor.ppo_micro_batch_size_per_gpu=4" in words and "critic.ppo_micro_batch_size_per_gpu=2" in words
    sp = load_config(None, args + ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert sp.actor.ppo_micro_batch_size_per_gpu == 8  # verl: // (world // sp)
    with pytest.raises(ConfigError, match=r"critic.ppo_micro_batch_size=8' is a global micro-batch size .* 16 "):
        load_config(None, args[:-1] + ["critic.ppo_micro_batch_size=8"])


def test_smaller_verl_settings(assets, tmp_path, monkeypatch, capsys):
    """Item 15: truncation=middle, the file logger, TENSORBOARD_DIR, metrics.jsonl always, rollout_data_dir,
    and prompt + response beyond max_position_embeddings refused in one line."""
    import json

    from rlhf.data.dataset import load_prompt_dataset
    from rlhf.ops.metrics import MetricsLogger
    from rlhf.models.loading import check_rollout_support, load_tokenizer

    tok = load_tokenizer(str(assets / "model"))
    full = load_prompt_dataset(assets / "data" / "train.parquet", tok, max_prompt_length=10_000).examples[0].prompt_ids
    ds = load_prompt_dataset(assets / "data" / "train.parquet", tok, max_prompt_length=5, truncation="middle",
                             filter_overlong_prompts=False)
    assert ds.examples[0].prompt_ids == full[:2] + full[-3:]  # verl: the first max//2, the last max - max//2
    assert load_config(None, REQ + ["data.truncation=middle"]).data.truncation == "middle"

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "verl" / "m.jsonl"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    with MetricsLogger(tmp_path / "run", backends=("console", "file"), total_steps=1, project="p",
                       experiment="e", stream=open("/dev/null", "w")) as logger:
        logger.log(1, {"reward/mean": 0.5})
    assert json.loads((tmp_path / "verl" / "m.jsonl").read_text()) == {"step": 1, "data": {"reward/mean": 0.5}}
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["reward/mean"] == 0.5  # always written
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path / "run2", backends=("tensorboard",), total_steps=1) as logger:
        logger.log(1, {"a": 1.0})
    assert any((tmp_path / "tb").iterdir()) and not (tmp_path / "run2" / "tensorboard").exists()

    assert load_config(None, REQ + ["trainer.rollout_data_dir=/r"]).trainer.rollout_data_dir == "/r"
    with pytest.raises(ConfigError, match=r"1024 tokens exceeds the model's max_position_embeddings \(256"):
        check_rollout_support(str(assets / "model"), max_seq_len=1024)


def test_rollout_rows_like_verl_dump():
    import torch

    from rlhf.train.evaluation import rollout_rows

    class B:
        index = torch.tensor([1, 0])
        response_texts = ["r1", "r0"]
        ground_truths = ["g1", 7]

    class E:
        def __init__(self, t):
            self.prompt_text = t

    rows = rollout_rows(B(), [1.0, 0.0], {"acc": [1.0, float("nan")]}, [E("p0"), E("p1")], step=3)
    assert rows == [{"input": "p1", "output": "r1", "gts": "g1", "score": 1.0, "step": 3, "acc": 1.0},
                    {"input": "p0", "output": "r0", "gts": "7", "score": 0.0, "step": 3}]


GSM8K_MULTITURN_GRPO = """hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""


def test_hydra_config_path_and_name(tmp_path, monkeypatch):
    """Item 5: verl's --config-path/--config-name and its yaml shape (hydra: ignored, defaults: resolved)."""
    from rlhf.cli import config_file, parse_args

    (tmp_path / "gsm8k_multiturn_grpo.yaml").write_text(GSM8K_MULTITURN_GRPO)
    (tmp_path / "tool.yaml").write_text("tools:\n  - class_name: calculator\n")
    args = parse_args("x", [f"--config-path={tmp_path}", "--config-name=gsm8k_multiturn_grpo", "--dry-run",
                            "algorithm.adv_estimator=grpo", *REQ,
                            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tool.yaml'}"])
    cfg = load_config(config_file(args), args.overrides)
    assert (cfg.data.max_prompt_length, cfg.data.train_batch_size, cfg.rollout.multi_turn.enable) == (1024, 256, True)
    assert cfg.rollout.multi_turn.max_assistant_turns == 5 and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.total_epochs == 30  # a verl-only configuration: verl's defaults (ppo_trainer)
    # the same file as --config; a defaults entry naming a yaml beside it is merged under the file's keys
    (tmp_path / "base.yaml").write_text("data:\n  max_prompt_length: 64\n  max_response_length: 32\n")
    (tmp_path / "child.yaml").write_text("defaults:\n  - base\n  - _self_\ndata:\n  max_response_length: 16\n")
    cfg = load_config(str(tmp_path / "child.yaml"), REQ)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (64, 16)
    (tmp_path / "bad.yaml").write_text("defaults:\n  - nowhere\n")
    with pytest.raises(ConfigError, match="defaults entry 'nowhere' is neither"):
        load_config(str(tmp_path / "bad.yaml"), REQ)
    with pytest.raises(ConfigError, match="--config-name missing: no file"):
        config_file(parse_args("x", [f"--config-path={tmp_path}", "--config-name", "missing"]))
    monkeypatch.chdir(tmp_path)
    assert config_file(parse_args("x", ["--config-name=ppo_trainer"])) is None  # verl's own defaults


def _gsm8k_tool_specs(tmp_path):
    from rlhf.agent.tools import read_tool_config

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    text = (fixtures / "verl_gsm8k_multiturn" / "gsm8k_tool_config.yaml").read_text()
    (tmp_path / "tools.yaml").write_text(text.replace("$FIXTURES", str(fixtures)))
    return read_tool_config(str(tmp_path / "tools.yaml"))


@pytest.mark.parametrize("workers", [0, 1])
def test_per_sample_tool_kwargs_and_step_rewards(tmp_path, workers):
    """Item 9: each trajectory's extra_info.tools_kwargs[<tool>].create_kwargs reach the tool (verl's
    Gsm8kTool, ported, needs its ground truth); the tool's step rewards are kept per (prompt, sample)
    and given to the reward function's extra_info (rollout_reward_scores, tool_rewards)."""
    import torch

    from rlhf.agent.format import ObservationFormat
    from rlhf.agent.loop import AgentLoop
    from rlhf.agent.rollout import ToolAgent
    from rlhf.agent.runner import make_tool_runner
    from rlhf.data.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    specs = _gsm8k_tool_specs(tmp_path)
    runner = make_tool_runner(specs, num_workers=workers, timeout_s=30, label="t")
    loop = AgentLoop(tok, runner, ObservationFormat(tok, max_tool_response_length=64),
                     {s[2]["function"]["name"]: s[2] for s in specs})
    kw = lambda gt: {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": gt}}}}  # noqa: E731
    loop.set_prompts([10, 11], [kw("3"), kw("5")], n=2)
    call = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "3"}}</tool_call>'
    ids = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    for row in range(4):  # rows 0, 1: prompt 10 (truth 3); rows 2, 3: prompt 11 (truth 5)
        assert loop.turn_ended(row, list(ids))
    got = {}
    while len(got) < 4:
        got.update(dict(loop.poll(wait=True)))
    assert "reward=1.0" in tok.decode(got[0]) and "reward=0.0" in tok.decode(got[2])
    assert loop.step_rewards == {(10, 0): {"calc_gsm8k_reward": [1.0]}, (10, 1): {"calc_gsm8k_reward": [1.0]},
                                 (11, 0): {"calc_gsm8k_reward": [0.0]}, (11, 1): {"calc_gsm8k_reward": [0.0]}}
    runner.close()

    class Batch:  # the trainer's batch of one rank: prompts 11 then 10, n = 2 each
        index = torch.tensor([11, 11, 10, 10])
        extra_infos = [kw("5"), kw("5"), kw("3"), kw("3")]

    b = Batch()
    ToolAgent.attach_step_rewards(None, b, loop, n=2)
    assert [x["tool_rewards"] for x in b.extra_infos] == [[0.0], [0.0], [1.0], [1.0]]
    assert b.extra_infos[2]["rollout_reward_scores"] == {"calc_gsm8k_reward": [1.0]}
    assert b.extra_infos[2]["tools_kwargs"] == kw("3")["tools_kwargs"]


def test_lora_merge_under_a_tensor_parallel_rollout():
    """Item 3: with rollout.tp > 1 each rank merges B @ A cut like its slice of the base weight, which
    equals the slice of the fully merged weight (column- and row-parallel projections)."""
    import torch

    from rlhf.models.lora import merged_weights_for_rollout
    from rlhf.rollout.reshard import rollout_slice

    g = torch.Generator().manual_seed(0)
    names = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")
    base = {f"{n}.weight": torch.randn(8, 6, generator=g) for n in names}
    adapters = {}
    for n in names:
        adapters[f"base_model.model.{n}.lora_A.default.weight"] = torch.randn(2, 6, generator=g)
        adapters[f"base_model.model.{n}.lora_B.default.weight"] = torch.randn(8, 2, generator=g)
    full = merged_weights_for_rollout(base, adapters, 16, 2)
    for rank in range(2):
        sliced_base = {k: rollout_slice(w, k, rank, 2) for k, w in base.items()}
        mine = merged_weights_for_rollout(sliced_base, adapters, 16, 2,
                                          slice_delta=lambda d, k: rollout_slice(d, k, rank, 2))
        for k in base:
            torch.testing.assert_close(mine[k], rollout_slice(full[k], k, rank, 2))
    assert mine["model.layers.0.self_attn.q_proj.weight"].shape == (4, 6)
    assert mine["model.layers.0.mlp.down_proj.weight"].shape == (8, 3)
