"""verl's key names: mapped to ours with a printed line each, harmless ones noted, the rest refused
in one line; hub names resolved from a local HF cache; the verl table of docs/howto/from-verl.md matches the rules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhf.config.hub import resolve_model_path
from rlhf.config.load import load_config
from rlhf.config.verl import check_launch_world, translate
from rlhf.config.verl_keys import RULES
from rlhf.schema.config import ConfigError

REQ = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"]
ROOT = Path(__file__).resolve().parents[2]


def test_verl_keys_map_to_native_and_print_once(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(None, REQ + [
        "actor_rollout_ref.actor.optim.lr=3e-6", "actor_rollout_ref.rollout.n=5", "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True", "actor_rollout_ref.actor.optim.clip_grad=0.5",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7", "critic.optim.lr=2e-5", "critic.model.path=/c",
        "trainer.save_freq=7", "trainer.default_local_dir=/out", "trainer.logger=console", "trainer.critic_warmup=3",
        "custom_reward_function.path=/r.py", "custom_reward_function.name=score", "trainer.n_gpus_per_node=8",
        "trainer.nnodes=2", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.use_remove_padding=True",
    ])
    assert (cfg.model.path, cfg.actor.lr, cfg.rollout.n, cfg.data.train_batch_size) == ("/m", 3e-6, 5, 64)
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.grad_clip) == (16, 2, 0.5)
    assert cfg.model.param_offload and cfg.model.use_remove_padding
    assert (cfg.rollout.tp, cfg.parallel.sp, cfg.rollout.gpu_memory_utilization) == (2, 2, 0.7)
    assert (cfg.critic.lr, cfg.critic.model_path) == (2e-5, "/c")
    assert (cfg.checkpoint.save_freq, cfg.trainer.output_dir, cfg.trainer.logger) == (7, "/out", ["console"])
    assert cfg.algorithm.critic_warmup == 3 and cfg.reward.reward_fn == "/r.py:score"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 8)
    out = capsys.readouterr().out
    assert "[verl] actor_rollout_ref.actor.optim.lr=3e-06 -> actor.lr=3e-06" in out
    assert "[verl] trainer.save_freq=7 -> checkpoint.save_freq=7" in out
    assert "[verl] actor_rollout_ref.rollout.name='vllm': accepted, no effect here" in out
    assert "[verl] trainer.logger='console' -> trainer.logger=['console']" in out
    assert out.count("actor.lr") == 1
    monkeypatch.setenv("RANK", "1")
    load_config(None, REQ + ["actor_rollout_ref.actor.optim.lr=3e-6"])
    assert capsys.readouterr().out == ""  # rank 0 only


def test_hydra_plus_list_syntax_and_null():
    # As bash passes them: trainer.logger=['console','wandb'] arrives without the quotes.
    cfg = load_config(None, REQ + ["+actor_rollout_ref.actor.optim.lr=2e-6", "++trainer.total_epochs=3",
                                   "trainer.logger=[console,wandb]", "trainer.default_hdfs_dir=null",
                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                                   "trainer.total_training_steps=null"])
    assert cfg.actor.lr == 2e-6 and cfg.trainer.total_epochs == 3 and cfg.trainer.logger == ["console", "wandb"]
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 8 and cfg.trainer.total_training_steps == -1  # defaults kept
    assert load_config(None, REQ + ['trainer.logger=["console","jsonl"]']).trainer.logger == ["console", "jsonl"]
    assert load_config(None, REQ + ["custom_reward_function.path=/r.py"]).reward.reward_fn == "/r.py:compute_score"


def test_verl_defaults_only_for_a_verl_only_config():
    verl = load_config(None, REQ + ["actor_rollout_ref.actor.ppo_mini_batch_size=64", "data.train_batch_size=256",
                                    "trainer.project_name=p", "trainer.experiment_name=e", "trainer.save_freq=10"])
    assert verl.algorithm.adv_estimator == "gae" and verl.trainer.total_epochs == 30
    assert verl.critic.ppo_mini_batch_size == 64  # verl: ${actor_rollout_ref.actor.ppo_mini_batch_size}
    assert verl.trainer.output_dir == "checkpoints/p/e" and verl.checkpoint.max_to_keep == 0
    assert verl.checkpoint.save_final and not verl.data.filter_overlong_prompts
    mixed = load_config(None, REQ + ["actor_rollout_ref.actor.ppo_mini_batch_size=64", "data.train_batch_size=256",
                                     "rollout.n=2"])
    assert mixed.algorithm.adv_estimator == "grpo" and mixed.critic.ppo_mini_batch_size == 256  # native defaults
    native = load_config(None, ["model.path=/m", "data.train_files=/d.parquet"])
    assert native.trainer.total_epochs == 1


@pytest.mark.parametrize("override, msg", [
    ("actor_rollout_ref.rollout.multi_turn.interaction_config_path=i.yaml",
     "verl key 'actor_rollout_ref.rollout.multi_turn.interaction_config_path='i.yaml'' is not supported here: "
     "interaction agents"),
    ("actor_rollout_ref.actor.strategy=megatron", "'actor_rollout_ref.actor.strategy='megatron'' is not supported"),
    ("actor_rollout_ref.model.custom_chat_template=x", "custom chat templates are not supported"),
    ("trainer.default_hdfs_dir=hdfs://x", "copying checkpoints to HDFS is not supported"),
    ("actor_rollout_ref.actor.no_such_key=1", "verl key 'actor_rollout_ref.actor.no_such_key' has no equivalent here"),
    ("custom_reward_function.eta=1.0", "verl key 'custom_reward_function.eta' has no equivalent here"),
])
def test_unsupported_values_refused_in_one_line(override, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)) as e:
        load_config(None, REQ + [override])
    assert "\n" not in str(e.value)


def test_multi_turn_and_rollout_keys_map_to_ours():
    cfg = load_config(None, REQ + ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                   "actor_rollout_ref.rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml",
                                   "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                                   "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=64",
                                   "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
                                   "actor_rollout_ref.rollout.dtype=bfloat16",
                                   "actor_rollout_ref.rollout.free_cache_engine=false"])
    mt = cfg.rollout.multi_turn
    assert mt.enable and mt.max_assistant_turns == 3 and mt.max_tool_response_length == 64
    assert mt.tool_response_truncate_side == "left"
    assert cfg.rollout.dtype == "bfloat16" and cfg.rollout.free_cache_engine is False


def test_conflicting_spellings_refused():
    with pytest.raises(ConfigError, match=r"'actor.lr' \(1e-05\) and its verl spelling "
                                          r"'actor_rollout_ref.actor.optim.lr' \(1e-06\) disagree"):
        load_config(None, REQ + ["actor.lr=1e-5", "actor_rollout_ref.actor.optim.lr=1e-6"])
    with pytest.raises(ConfigError, match="both set actor.log_prob_micro_batch_size_per_gpu"):
        load_config(None, REQ + ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                                 "actor_rollout_ref.rollout.log_prob_micro_batch_size=64"])
    # the same value twice is fine, and the reference's setting follows the rollout's
    cfg = load_config(None, REQ + ["actor.lr=1e-6", "actor_rollout_ref.actor.optim.lr=1e-6",
                                   "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"])
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 4


def test_global_micro_batch_divided_by_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = load_config(None, REQ + ["actor_rollout_ref.actor.ppo_micro_batch_size=64", "critic.ppo_micro_batch_size=16"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 8 and cfg.critic.ppo_micro_batch_size_per_gpu == 2


def test_verl_yaml_file(tmp_path):
    f = tmp_path / "verl.yaml"
    f.write_text("actor_rollout_ref:\n  model: {path: /m}\n  actor:\n    optim: {lr: 1e-6, _target_: x.Y}\n"
                 "    fsdp_config: {model_dtype: bf16}\n  rollout: {n: 4, do_sample: false}\n"
                 "data: {train_files: /d.parquet}\n")
    cfg = load_config(str(f))
    assert cfg.actor.lr == 1e-6 and cfg.model.dtype == "bfloat16" and cfg.rollout.n == 4
    assert cfg.rollout.temperature == 0.0


def test_keys_a_script_lacks_are_refused():
    import dataclasses

    from rlhf.schema.config import Config

    bare = dataclasses.make_dataclass("Bare", [("data", dict, dataclasses.field(default_factory=dict))])
    with pytest.raises(ConfigError, match="maps to 'reward.reward_fn', which this script has no setting for"):
        translate({"custom_reward_function": {"path": "/r.py"}}, cls=bare)
    assert translate({"trainer": {"logger": "console"}}, cls=Config, verbose=False) == {"trainer": {"logger": ["console"]}}


def test_launch_world(monkeypatch):
    cfg = load_config(None, REQ + ["trainer.n_gpus_per_node=8", "trainer.nnodes=1"])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert check_launch_world(cfg, 1, dry_run=True) == 8  # one python process plans for verl's layout
    with pytest.raises(ConfigError, match=r"= 1 x 8 = 8 ranks, but 1 were launched; run it with torchrun "
                                          r"--nnodes=1 --nproc_per_node=8"):
        check_launch_world(cfg, 1, dry_run=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="but 2 were launched"):
        check_launch_world(cfg, 2, dry_run=True)
    assert check_launch_world(load_config(None, REQ), 2, dry_run=False) == 2  # unset: anything goes


def _fake_cache(root: Path, name: str, ref: bool = True) -> Path:
    repo = root / ("models--" + name.replace("/", "--"))
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd\n")
    return snap


def test_hub_names_resolve_from_the_cache(tmp_path, monkeypatch, capsys):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    snap = _fake_cache(tmp_path / "home" / ".cache" / "huggingface" / "hub", "Qwen/Qwen2.5-0.5B-Instruct")
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == str(snap)  # the default location
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    with pytest.raises(ConfigError, match=r"model.path: 'Qwen/Qwen2.5-0.5B-Instruct' is neither a local directory nor "
                                          r"in the Hugging Face cache \(.*hfhome/hub\).*huggingface-cli download "
                                          r"Qwen/Qwen2.5-0.5B-Instruct$"):
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")
    other = _fake_cache(tmp_path / "hfhome" / "hub", "Qwen/Qwen2.5-0.5B-Instruct", ref=False)  # one snapshot, no ref
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == str(other)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = _fake_cache(tmp_path / "hub", "org/critic")
    cfg = load_config(None, ["model.path=org/critic", "critic.model_path=org/critic", "data.train_files=/d.parquet"])
    assert cfg.model.path == cfg.critic.model_path == str(snap)
    assert f"[rlhf] model.path: org/critic -> {snap} (Hugging Face cache)" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert resolve_model_path("org/local") == "org/local"  # an existing directory wins
    assert resolve_model_path("/abs/missing") == "/abs/missing"  # not a hub name: check_model_dir reports it


def test_readme_verl_table_matches_the_rules():
    """The docs page "Coming from verl" (linked from README) maps every verl key as the translation does."""
    assert "docs/howto/from-verl.md" in (ROOT / "README.md").read_text()
    section = (ROOT / "docs" / "howto" / "from-verl.md").read_text()
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 20
    for row in rows:
        verl, native = row.split(" | ")[0:2]
        keys = re.findall(r"`([a-z_.]+)`", verl)
        target = re.match(r"\s*`([a-z_.]+)`", native)
        for key in keys:
            if key.startswith(("data.", "algorithm.", "trainer.nnodes", "trainer.n_gpus", "trainer.{")):
                continue  # native names
            assert key in RULES, key
            if target and RULES[key].native:
                assert RULES[key].native == target.group(1), (key, RULES[key].native)


@pytest.mark.parametrize("block, want", [
    # decoupled mode: IS weights of the recomputed old policy vs the sampler (rlhf/algos/rollout_corr.py)
    ({"rollout_is": "token", "rollout_is_threshold": 3.0},
     {"rollout_is_decoupled": True, "rollout_is": "token", "rollout_is_threshold": 3.0, "policy_loss": "vanilla",
      "tis_imp_ratio_cap": -1.0}),
    ({"rollout_is": "sequence", "rollout_is_batch_normalize": True},
     {"rollout_is_decoupled": True, "rollout_is": "sequence", "rollout_is_threshold": 2.0,
      "rollout_is_batch_normalize": True}),
    # rejection sampling: verl's current options, its earlier modes, the token veto
    ({"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,1.0"},
     {"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,1.0", "rollout_is_decoupled": False}),
    ({"rollout_rs": "geometric", "rollout_rs_threshold": 1.001, "rollout_rs_threshold_lower": 0.999,
      "rollout_token_veto_threshold": 1e-4},
     {"rollout_rs": "geometric", "rollout_rs_threshold": "1.001", "rollout_rs_threshold_lower": 0.999,
      "rollout_token_veto_threshold": 1e-4}),
    # verl's defaults (metrics only) change nothing
    ({"rollout_is": None, "rollout_rs": None, "bypass_mode": False, "rollout_is_batch_normalize": False},
     {"tis_imp_ratio_cap": -1.0, "policy_loss": "vanilla"}),
    ({"bypass_mode": True}, {"policy_loss": "bypass_mode", "rollout_correction_loss_type": "ppo_clip"}),
    ({"bypass_mode": True, "use_policy_gradient": True, "rollout_is": "sequence", "rollout_is_threshold": 5.0},
     {"policy_loss": "bypass_mode", "rollout_correction_loss_type": "reinforce", "rollout_is": "sequence",
      "rollout_is_threshold": 5.0}),
    ({"bypass_mode": True, "loss_type": "reinforce"},
     {"rollout_correction_loss_type": "reinforce", "rollout_is": "", "tis_imp_ratio_cap": -1.0}),
])
def test_rollout_correction_block_maps_to_ours(block, want):
    overrides = [f"algorithm.rollout_correction.{k}={'null' if v is None else v}" for k, v in block.items()]
    actor = load_config(None, REQ + overrides).actor
    assert {k: getattr(actor, k) for k in want} == want


@pytest.mark.parametrize("override, msg", [
    ("rollout_rs=token", "'algorithm.rollout_correction.rollout_rs=token' needs rollout_rs_threshold"),
    ("bypass_mode=true algorithm.rollout_correction.rollout_token_veto_threshold=1e-4",
     "rollout_token_veto_threshold=0.0001' with bypass_mode=True is not supported here"),
    ("bypass_mode=true algorithm.rollout_correction.rollout_is_batch_normalize=true",
     "rollout_is_batch_normalize=True' with bypass_mode=True is not supported here"),
    ("rollout_rs=token_k7 algorithm.rollout_correction.rollout_rs_threshold=2.0",
     "config key 'actor.rollout_rs': unknown option 'token_k7'"),
    ("rollout_rs=token_k2 algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'",
     "config key 'actor.rollout_rs_threshold': '0.5_2.0' for token_k2: one upper bound, no '_'"),
    ("use_policy_gradient=true", "use_policy_gradient=True' is supported with bypass_mode=True only"),
    ("no_such=1", "verl key 'algorithm.rollout_correction.no_such' has no equivalent here"),
])
def test_rollout_correction_refusals(override, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)) as e:
        load_config(None, REQ + ("algorithm.rollout_correction." + override).split(" "))
    assert "\n" not in str(e.value)
