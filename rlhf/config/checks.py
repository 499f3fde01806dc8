"""Value checks of a loaded RL config (``rlhf.config`` builds and type-checks it; these checks
need only the config, not the world size or the data: those are in rlhf/models/parallel.py and the trainer)."""

from __future__ import annotations

import os

from rlhf.algos.optimal_token_baseline import TOKEN_BASELINE_ESTIMATORS
from rlhf.algos.rollout_corr import LEGACY_RS_OPTIONS, parse_rollout_rs, parse_rs_thresholds
from rlhf.config.low_precision import check_low_precision, resolve_low_precision
from rlhf.schema.config import ActorConfig, Config, ConfigError


def validate(cfg: Config) -> None:
    """Checks that do not need the world size or the data (those are in parallel.py / trainer)."""

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"config key '{key}': {msg}")

    need(bool(cfg.model.path), "model.path", "is required (a local HF model directory)")
    need(cfg.model.load_ranks_per_node >= 0, "model.load_ranks_per_node", "must be >= 0 (0 = auto)")
    need(bool(cfg.data.train_files), "data.train_files", "is required (parquet or jsonl prompt files)")
    need(cfg.data.train_batch_size > 0, "data.train_batch_size", "must be > 0")
    need(cfg.data.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")
    need(cfg.data.max_response_length > 0, "data.max_response_length", "must be > 0")
    need(cfg.rollout.n >= 1, "rollout.n", "must be >= 1")
    d = cfg.distill
    need(cfg.algorithm.adv_estimator != "opd" or d.enabled, "algorithm.adv_estimator",
         "opd scores tokens with a teacher: set distill.enabled=true and distill.teachers.<name>.path")
    need(not d.enabled or bool(d.teachers), "distill.teachers", "distill.enabled needs a teacher: "
         "distill.teachers.<name>.path=DIR")
    for name, t in d.teachers.items():
        need(bool(t.path), f"distill.teachers.{name}.path", "is required (the teacher's HF model directory)")
    need(cfg.rollout.temperature >= 0, "rollout.temperature", "must be >= 0")
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    need(0 <= cfg.rollout.over_sample_rate < 1, "rollout.over_sample_rate", "must be in [0, 1) (verl: 0 = off)")
    need(cfg.rollout.over_sample_rate == 0 or cfg.rollout.ep == 1, "rollout.over_sample_rate",
         "needs rollout.ep = 1 (a replica waiting for the others' count cannot serve their experts)")
    need(cfg.rollout.top_k == -1 or cfg.rollout.top_k > 0, "rollout.top_k", "must be -1 (off) or > 0")
    need(cfg.rollout.tp >= 1, "rollout.tp", "must be >= 1")
    need(cfg.rollout.ep >= 1, "rollout.ep", f"must be >= 1, got {cfg.rollout.ep}")
    need(cfg.rollout.ep == 1 or cfg.trainer.mode == "colocated", "rollout.ep",
         f"> 1 is built for trainer.mode colocated only, got {cfg.trainer.mode} (set rollout.ep=1)")
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
    sp = cfg.rollout.speculative
    need(sp.num_draft_tokens >= 1, "rollout.speculative.num_draft_tokens", f"must be >= 1, got {sp.num_draft_tokens}")
    need(1 <= sp.ngram_min <= sp.ngram_max, "rollout.speculative.ngram_min",
         f"must be in [1, ngram_max={sp.ngram_max}], got {sp.ngram_min}")
    need(bool(sp.sources) and set(sp.sources) <= {"siblings", "self"}, "rollout.speculative.sources",
         f"must be a non-empty list of 'siblings', 'self', got {sp.sources}")
    _check_batch_invariant(cfg, need)
    need(0 < cfg.rollout.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
    need(cfg.actor.ppo_mini_batch_size > 0, "actor.ppo_mini_batch_size", "must be > 0")
    need(cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size",
         f"must divide data.train_batch_size ({cfg.data.train_batch_size}), got {cfg.actor.ppo_mini_batch_size}")
    need(cfg.actor.ppo_micro_batch_size_per_gpu > 0, "actor.ppo_micro_batch_size_per_gpu", "must be > 0")
    for key in ("actor.log_prob_micro_batch_size_per_gpu", "actor.ppo_max_token_len_per_gpu",
                "actor.log_prob_max_token_len_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                "critic.ppo_max_token_len_per_gpu", "reward.reward_model.micro_batch_size_per_gpu"):
        v = _get(cfg, key)
        need(v > 0, key, f"must be > 0, got {v}")
    need(cfg.trainer.total_training_steps == -1 or cfg.trainer.total_training_steps >= 1,
         "trainer.total_training_steps", f"must be >= 1 or -1 (total_epochs x steps per epoch), got "
         f"{cfg.trainer.total_training_steps}")
    need(cfg.trainer.max_nan_steps >= 0, "trainer.max_nan_steps",
         f"must be >= 0 (skipped non-finite steps in a row before the run stops), got {cfg.trainer.max_nan_steps}")
    need(cfg.trainer.stop_after_steps >= -1, "trainer.stop_after_steps",
         f"must be >= 0 or -1 (off), got {cfg.trainer.stop_after_steps}")
    need(cfg.actor.ppo_epochs >= 1, "actor.ppo_epochs", "must be >= 1")
    need(cfg.actor.router_aux_loss_coef >= 0, "actor.router_aux_loss_coef", "must be >= 0 (0 = off)")
    a = cfg.actor
    need(a.policy_loss != "dro" or a.dro_beta > 0, "actor.dro_beta",
         "actor.policy_loss 'dro' needs actor.dro_beta > 0 (verl actor.policy_loss.dro_beta); it has no default")
    need(a.policy_loss != "clip_cov" or (a.clip_cov_ratio > 0 and a.clip_cov_lb < a.clip_cov_ub), "actor.clip_cov_ratio",
         "clip_cov needs actor.clip_cov_ratio > 0 and actor.clip_cov_lb < actor.clip_cov_ub")
    need(a.policy_loss != "kl_cov" or a.kl_cov_ratio > 0, "actor.kl_cov_ratio", "kl_cov needs actor.kl_cov_ratio > 0")
    need(a.policy_loss != "sapo" or (a.tau_pos > 0 and a.tau_neg > 0), "actor.tau_pos",
         "sapo needs actor.tau_pos > 0 and actor.tau_neg > 0")
    need(a.rollout_is_threshold > 0, "actor.rollout_is_threshold", "must be > 0")
    for note in resolve_low_precision(cfg):  # FP8 rollout turns its correction on before it is checked
        if os.environ.get("RANK", "0") == "0":
            print(note)
    check_low_precision(cfg)
    _check_rollout_correction(a, need)
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
    need(cfg.reward.max_failed_steps >= 0, "reward.max_failed_steps",
         f"must be >= 0 (0 = never stop), got {cfg.reward.max_failed_steps}")
    need(cfg.model.prefix_grouping is not True or cfg.model.use_remove_padding, "model.prefix_grouping",
         "true needs model.use_remove_padding=true (it regroups the padding-free row); set it to auto or false")
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


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_logger(backends: list, key: str = "trainer.logger") -> None:
    """Unknown backends and missing tracker packages fail at load time, not at the first logged step."""
    from rlhf.ops.metrics import check_backends

    try:
        check_backends(backends)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"config key '{key}': {e}") from None


def named(key: str, lookup, name):
    """Registry lookup whose unknown-name error names the config key (and lists valid names)."""
    try:
        return lookup(name)
    except (ValueError, KeyError, AttributeError, TypeError, ImportError, SyntaxError, OSError) as e:
        raise ConfigError(f"{key}: {e}") from None


def check_startup(cfg: Config) -> None:
    """Checks that need neither a process group nor the data: names resolved in registries, the reward
    function loaded (custom_reward_function.path / name), LoRA's rollout layout. The trainer makes
    them at start-up and a one-process ``--dry-run`` makes them too, so both forms check the same."""
    import torch

    from rlhf.algos.advantages import get_adv_estimator
    from rlhf.algos.aggregation import agg_loss
    from rlhf.algos.kl import get_kl_controller, kl_penalty
    from rlhf.algos.optimal_token_baseline import TOKEN_BASELINE_ESTIMATORS
    from rlhf.algos.policy_loss import get_policy_loss
    from rlhf.rewards.registry import get_reward_fn

    if cfg.model.lora_rank > 0 and cfg.rollout.tp > 1 and cfg.trainer.mode == "one_step_off":
        raise ConfigError(f"config key 'model.lora_rank': LoRA under trainer.mode one_step_off needs rollout.tp = 1 "
                          f"(got {cfg.rollout.tp}; verl's actor_rollout_ref.rollout.tensor_model_parallel_size); the "
                          "colocated mode supports a tensor-parallel rollout with LoRA")
    c = cfg
    named("algorithm.adv_estimator", get_adv_estimator, c.algorithm.adv_estimator)
    named("actor.policy_loss", get_policy_loss, c.actor.policy_loss)
    named("actor.loss_agg_mode", lambda m: agg_loss(torch.zeros(1, 1), torch.ones(1, 1), m), c.actor.loss_agg_mode)
    for key, name in (("actor.kl_loss_type", c.actor.kl_loss_type), ("algorithm.kl_penalty", c.algorithm.kl_penalty)):
        named(key, lambda n: kl_penalty(torch.zeros(1), torch.zeros(1), n), name)
    k = c.algorithm.kl_ctrl
    named("algorithm.kl_ctrl.type", lambda t: get_kl_controller(t, k.kl_coef, k.target_kl, k.horizon), k.type)
    alg = c.algorithm
    if alg.adv_estimator in TOKEN_BASELINE_ESTIMATORS and (c.parallel.tp > 1 or c.parallel.pp > 1):
        raise ConfigError(f"algorithm.adv_estimator {alg.adv_estimator!r} needs sum_v pi(v)^2 of full-vocab "
                          "logits, computed on data-parallel ranks only; set parallel.tp: 1 and parallel.pp: 1")
    if alg.gdpo_reward_weights is not None and len(alg.gdpo_reward_weights) != max(1, len(alg.gdpo_reward_keys)):
        raise ConfigError(f"algorithm.gdpo_reward_weights has {len(alg.gdpo_reward_weights)} entries for "
                          f"{len(alg.gdpo_reward_keys)} algorithm.gdpo_reward_keys")
    key = "reward.reward_fn" + (" (verl: custom_reward_function.path / name)" if ".py" in c.reward.reward_fn else "")
    named(key, lambda fn: get_reward_fn(fn, c.reward.reward_kwargs), c.reward.reward_fn)


def _check_rollout_correction(a: ActorConfig, need) -> None:
    """Decoupled rollout correction (rlhf/algos/rollout_corr.py): options parse, combinations are meaningful."""
    bypass = a.policy_loss == "bypass_mode"
    need(not a.rollout_is_decoupled or a.rollout_is in ("token", "sequence"), "actor.rollout_is",
         f"actor.rollout_is_decoupled needs actor.rollout_is token or sequence, got {a.rollout_is!r}")
    need(not a.rollout_is_batch_normalize or a.rollout_is_decoupled, "actor.rollout_is_batch_normalize",
         "normalises the decoupled IS weights: set actor.rollout_is_decoupled=true")
    try:
        opts = parse_rollout_rs(a.rollout_rs)
        if opts and not (opts[0] in LEGACY_RS_OPTIONS):
            parse_rs_thresholds(opts, a.rollout_rs_threshold)
        elif opts:
            need(float(a.rollout_rs_threshold) > 0, "actor.rollout_rs_threshold",
                 f"rollout_rs={opts[0]} takes one upper ratio bound > 0, got {a.rollout_rs_threshold!r}")
    except ValueError as exc:
        key, _, msg = str(exc).partition(": ")  # the pure parsers say "actor.key: message"
        raise ConfigError(f"config key '{key}': {msg}") from None
    for key, on in (("actor.rollout_is_decoupled", a.rollout_is_decoupled), ("actor.rollout_rs", bool(opts)),
                    ("actor.rollout_token_veto_threshold", a.rollout_token_veto_threshold > 0),
                    ("actor.use_decoupled_loss", a.use_decoupled_loss)):
        need(not (on and bypass), key, "is not supported with actor.policy_loss=bypass_mode (there the old "
             "policy is the rollout policy); use another policy_loss")
    need(a.rollout_token_veto_threshold == -1 or a.rollout_token_veto_threshold > 0,
         "actor.rollout_token_veto_threshold", f"must be > 0 or -1 (off), got {a.rollout_token_veto_threshold}")
    need(a.behav_imp_weight_cap == -1 or (a.behav_imp_weight_cap > 1 and a.use_decoupled_loss),
         "actor.behav_imp_weight_cap", f"must be > 1 with actor.use_decoupled_loss=true, or -1, got "
         f"{a.behav_imp_weight_cap}")
    need(not (a.use_decoupled_loss and (a.rollout_is_decoupled or a.tis_imp_ratio_cap > 0)), "actor.use_decoupled_loss",
         "already weights by pi_old / pi_rollout: turn off actor.rollout_is_decoupled and actor.tis_imp_ratio_cap")
    need(not (a.rollout_is_decoupled and a.tis_imp_ratio_cap > 0), "actor.rollout_is_decoupled",
         "and actor.tis_imp_ratio_cap both weight by pi_old / pi_rollout: keep one")


def _check_batch_invariant(cfg: Config, need) -> None:
    """The layouts and features ``rollout.batch_invariant`` holds for (rlhf.models.batch_invariant); the rest
    is refused in one line. The model family is checked when the actor is built."""
    if not cfg.rollout.batch_invariant:
        need(not cfg.actor.use_rollout_log_probs, "actor.use_rollout_log_probs",
             "needs rollout.batch_invariant=true (the sampler's log-probs are the trainer's only then); under "
             "trainer.mode fully_async use async_training.use_rollout_log_probs")
        return
    key, p, r = "rollout.batch_invariant", cfg.parallel, cfg.rollout
    need(p.tp == 1 and r.tp == 1, key, f"needs parallel.tp = rollout.tp = 1 in this version (got {p.tp} / {r.tp}): "
         "the tensor-parallel partial sums are not in the invariant forward")
    need(p.pp == 1 and p.sp == 1 and r.ep == 1, key, f"needs parallel.pp = parallel.sp = rollout.ep = 1 (got "
         f"{p.pp} / {p.sp} / {r.ep})")
    need(cfg.trainer.mode == "colocated", key, f"needs trainer.mode colocated (got {cfg.trainer.mode})")
    need(not r.speculative.enable and not r.compile and not r.multi_turn.enable, key,
         "is not built for rollout.speculative, rollout.compile (CUDA graphs) or rollout.multi_turn")
    need(cfg.model.lora_rank == 0, key, "needs full fine-tuning (model.lora_rank = 0)")
    need(cfg.actor.router_replay == "none", key, "routes are recomputed bit for bit: set actor.router_replay=none")
    need(cfg.algorithm.adv_estimator not in TOKEN_BASELINE_ESTIMATORS, key, f"has no full-vocabulary forward for "
         f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} (its sum of pi^2 pass)")
    need(r.dtype in ("auto", cfg.model.dtype), key, f"needs rollout.dtype auto or model.dtype ({cfg.model.dtype}), "
         f"got {r.dtype}")
    need(not r.quantization, key, f"needs the trainer's weights in the rollout: rollout.quantization="
         f"{r.quantization} rounds them (set rollout.quantization='')")
