"""Value checks of a loaded RL config (``rlhf.config`` builds and type-checks it; these checks
need only the config, not the world size or the data: those are in rlhf/models/parallel.py and the trainer)."""

from __future__ import annotations

from rlhf.schema.config import Config, ConfigError


def validate(cfg: Config) -> None:
    """Checks that do not need the world size or the data (those are in parallel.py / trainer)."""

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"config key '{key}': {msg}")

    need(bool(cfg.model.path), "model.path", "is required (a local HF model directory)")
    need(bool(cfg.data.train_files), "data.train_files", "is required (parquet or jsonl prompt files)")
    need(cfg.data.train_batch_size > 0, "data.train_batch_size", "must be > 0")
    need(cfg.data.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")
    need(cfg.data.max_response_length > 0, "data.max_response_length", "must be > 0")
    need(cfg.rollout.n >= 1, "rollout.n", "must be >= 1")
    need(cfg.rollout.temperature >= 0, "rollout.temperature", "must be >= 0")
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    need(cfg.rollout.top_k == -1 or cfg.rollout.top_k > 0, "rollout.top_k", "must be -1 (off) or > 0")
    need(cfg.rollout.tp >= 1, "rollout.tp", "must be >= 1")
    mt = cfg.rollout.multi_turn
    if mt.enable:
        need(bool(mt.tool_config_path), "rollout.multi_turn.tool_config_path", "is required when multi_turn.enable")
        for key in ("max_assistant_turns", "max_user_turns"):
            v = getattr(mt, key)
            need(v is None or v >= 1, f"rollout.multi_turn.{key}", f"must be >= 1 or null, got {v}")
        need(mt.max_parallel_calls >= 1, "rollout.multi_turn.max_parallel_calls", "must be >= 1")
        need(mt.max_tool_response_length >= 1, "rollout.multi_turn.max_tool_response_length", "must be >= 1")
        need(mt.num_workers >= 0, "rollout.multi_turn.num_workers", "must be >= 0 (0 = in-process)")
        need(mt.tool_timeout_s > 0, "rollout.multi_turn.tool_timeout_s", "must be > 0 seconds")
    need(0 < cfg.rollout.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
    need(cfg.actor.ppo_mini_batch_size > 0, "actor.ppo_mini_batch_size", "must be > 0")
    need(cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size",
         f"must divide data.train_batch_size ({cfg.data.train_batch_size}), got {cfg.actor.ppo_mini_batch_size}")
    need(cfg.actor.ppo_micro_batch_size_per_gpu > 0, "actor.ppo_micro_batch_size_per_gpu", "must be > 0")
    need(cfg.actor.ppo_epochs >= 1, "actor.ppo_epochs", "must be >= 1")
    a = cfg.actor
    need(a.policy_loss != "dro" or a.dro_beta > 0, "actor.dro_beta",
         "actor.policy_loss 'dro' needs actor.dro_beta > 0 (verl actor.policy_loss.dro_beta); it has no default")
    need(a.policy_loss != "clip_cov" or (a.clip_cov_ratio > 0 and a.clip_cov_lb < a.clip_cov_ub), "actor.clip_cov_ratio",
         "clip_cov needs actor.clip_cov_ratio > 0 and actor.clip_cov_lb < actor.clip_cov_ub")
    need(a.policy_loss != "kl_cov" or a.kl_cov_ratio > 0, "actor.kl_cov_ratio", "kl_cov needs actor.kl_cov_ratio > 0")
    need(a.policy_loss != "sapo" or (a.tau_pos > 0 and a.tau_neg > 0), "actor.tau_pos",
         "sapo needs actor.tau_pos > 0 and actor.tau_neg > 0")
    need(a.rollout_is_threshold > 0, "actor.rollout_is_threshold", "must be > 0")
    need(cfg.actor.lr >= 0, "actor.lr", "must be >= 0")
    need(cfg.actor.clip_ratio > 0, "actor.clip_ratio", "must be > 0")
    need(cfg.actor.grad_clip > 0, "actor.grad_clip", "must be > 0")
    need(len(cfg.actor.betas) == 2, "actor.betas", "must be a list of two floats")
    for name in ("dp", "tp", "pp", "sp"):
        v = getattr(cfg.parallel, name)
        need(v >= 1 or (name == "dp" and v == -1), f"parallel.{name}",
             "must be >= 1" + (" or -1 (infer)" if name == "dp" else ""))
    need(cfg.checkpoint.save_freq == -1 or cfg.checkpoint.save_freq > 0, "checkpoint.save_freq", "must be -1 or > 0")
    need(cfg.trainer.total_epochs >= 1, "trainer.total_epochs", "must be >= 1")
    need(cfg.trainer.collective_timeout_s > 0, "trainer.collective_timeout_s",
         f"must be > 0 seconds, got {cfg.trainer.collective_timeout_s}")
    need(cfg.trainer.exchange_timeout_s > 0, "trainer.exchange_timeout_s",
         f"must be > 0 seconds, got {cfg.trainer.exchange_timeout_s}")
    need(cfg.trainer.heartbeat_timeout_s >= 0, "trainer.heartbeat_timeout_s",
         f"must be >= 0 seconds (0 disables the watchdog), got {cfg.trainer.heartbeat_timeout_s}")
    need(all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in cfg.trainer.profile_steps),
         "trainer.profile_steps", f"must be a list of step numbers >= 1, got {cfg.trainer.profile_steps}")
    need(cfg.trainer.log_val_generations >= 0, "trainer.log_val_generations", "must be >= 0")
    check_logger(cfg.trainer.logger)
    from rlhf.ops.alerts import check_alerts_config

    try:
        check_alerts_config(cfg.trainer.alerts)
    except ValueError as e:
        raise ConfigError(f"config key 'trainer.alerts': {e}") from None
    need(cfg.trainer.max_oom_retries >= 0, "trainer.max_oom_retries", f"must be >= 0, got {cfg.trainer.max_oom_retries}")
    need(cfg.reward.num_workers >= 0, "reward.num_workers", f"must be >= 0 (0 = in-process), got {cfg.reward.num_workers}")
    need(cfg.reward.timeout_s > 0, "reward.timeout_s", f"must be > 0 seconds, got {cfg.reward.timeout_s}")
    if cfg.model.lora_rank < 0:
        raise ConfigError("config key 'model.lora_rank': must be >= 0")
    vk = cfg.trainer.val_kwargs
    need(vk.n >= 1, "trainer.val_kwargs.n", "must be >= 1")
    need(not (vk.do_sample and cfg.rollout.val_temperature > 0), "rollout.val_temperature",
         "set either rollout.val_temperature (legacy) or trainer.val_kwargs.do_sample/temperature, not both")
    sampling = vk.do_sample or cfg.rollout.val_temperature > 0
    need(vk.n == 1 or sampling, "trainer.val_kwargs.n",
         f"is {vk.n} but validation is greedy (identical samples); set trainer.val_kwargs.do_sample=true")
    need(not vk.do_sample or vk.temperature > 0, "trainer.val_kwargs.temperature", "must be > 0 when do_sample")
    need(0 < vk.top_p <= 1, "trainer.val_kwargs.top_p", "must be in (0, 1]")
    need(vk.top_k == -1 or vk.top_k > 0, "trainer.val_kwargs.top_k", "must be -1 (off) or > 0")


def check_logger(backends: list, key: str = "trainer.logger") -> None:
    """Unknown backends and missing tracker packages fail at load time, not at the first logged step."""
    from rlhf.ops.metrics import check_backends

    try:
        check_backends(backends)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"config key '{key}': {e}") from None
