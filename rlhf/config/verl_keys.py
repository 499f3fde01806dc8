"""verl's configuration keys and what each becomes here: the table :mod:`rlhf.verl_compat` applies.

One entry per verl key (dotted, as in verl's ``ppo_trainer.yaml``; see its "Config Explanation"
page, docs/examples/config.rst): mapped to a native key (``to``), following a native key that
another setting fills (``follows``), accepted with a note because it does not change the
results here (``ignored``), or accepted only for harmless values and refused otherwise
(``only``). An entry for a subtree covers every key under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from rlhf.schema.config import ConfigError

# Sections that only the native spelling has; their presence turns verl's defaults off.
NATIVE_ONLY_SECTIONS = ("model", "actor", "rollout", "parallel", "checkpoint")


@dataclass(frozen=True)
class Rule:
    """What happens to one verl key (or, for a subtree rule, to everything under it)."""

    native: str = ""                       # the native dotted key the value goes to
    convert: Optional[Callable[[Any], dict]] = None  # value -> {native key: value} (several or none)
    note: str = ""                         # printed: why accepted without a native key / what differs
    ok: Optional[tuple] = None             # values accepted (with `note`); others refused with `why`
    why: str = ""                          # refusal reason
    fallback: bool = False                 # set `native` only when nothing else sets it


def to(native: str, note: str = "", convert=None) -> Rule:
    return Rule(native=native, note=note, convert=convert)


def follows(native: str, note: str = "") -> Rule:
    return Rule(native=native, note=note, fallback=True)


def ignored(note: str) -> Rule:
    return Rule(note=note)


def only(ok: tuple, note: str, why: str) -> Rule:
    return Rule(ok=ok, note=note, why=why)


def _per_gpu(native: str) -> Callable[[Any, int], dict]:
    """verl's deprecated global micro-batch sizes, divided over the data-parallel ranks as verl does
    (``//= world // ulysses_sequence_parallel_size``); ``dp``: that divisor, from
    ``trainer.nnodes x n_gpus_per_node`` when set, else the launched ``WORLD_SIZE``."""
    def convert(v: Any, dp: int) -> dict:
        if v is None:
            return {}
        if int(v) < dp:
            raise ConfigError(f"is a global micro-batch size (deprecated in verl) smaller than the {dp} "
                              f"data-parallel ranks it is divided over; set its *_per_gpu key instead")
        return {native: int(v) // dp}
    convert.needs_dp = True
    return convert


def _dtype(v: Any) -> dict:
    names = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
             "fp16": "float16", "float16": "float16"}
    if v not in names:
        raise ConfigError(f"verl key 'fsdp_config.model_dtype={v}': expected fp32, bf16 or fp16")
    return {"model.dtype": names[v]}


def _override_config(v: Any) -> dict:
    """verl's ``model.override_config``: dropout probabilities of 0 (the DAPO recipe's ``attention_dropout``,
    ``embd_pdrop``, ``resid_pdrop``) are what runs here (no dropout); any other override is refused."""
    if not v:
        return {}
    other = sorted(k for k, x in (v.items() if isinstance(v, dict) else [])
                   if not (str(k).endswith(("dropout", "pdrop")) and x in (0, 0.0)))
    if not isinstance(v, dict) or other:
        raise ConfigError(f"verl key 'actor_rollout_ref.model.override_config' ({other or v}) is not supported here: "
                          "overriding the model config is not (dropout settings of 0 are accepted)")
    return {}


def _reward_manager(v: Any) -> dict:
    """verl's registered reward managers; a custom manager class has no equivalent here."""
    if v is None:
        return {}
    if v not in ("naive", "prime", "dapo", "batch"):
        raise ConfigError(f"verl key 'reward_model.reward_manager={v}': expected naive, prime, dapo or batch "
                          "(custom reward manager classes are not supported)")
    return {"reward.reward_manager": v}


def _quantization(v: Any) -> dict:
    """verl's ``rollout.quantization``: null or fp8 (its vLLM / SGLang FP8 rollout; int8 / fp4 are not built here)."""
    if v in (None, "", False):
        return {}
    if v != "fp8":
        raise ConfigError(f"verl key 'actor_rollout_ref.rollout.quantization={v}': only fp8 (or null) is supported")
    return {"rollout.quantization": "fp8"}


# verl's algorithm.rollout_correction (docs/algo/rollout_corr.md), its older loss_type included.
_ROLLOUT_CORRECTION_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                            "rollout_rs_threshold", "rollout_rs_threshold_lower", "rollout_token_veto_threshold",
                            "bypass_mode", "use_policy_gradient", "loss_type")


def _rollout_correction(v: Any) -> dict:
    """verl's ``algorithm.rollout_correction`` block as native keys (rlhf/algos/rollout_corr.py).

    Decoupled mode (``bypass_mode: false``): ``rollout_is`` token / sequence weights the loss by
    the truncated IS weights of the recomputed old policy against the sampler
    (``actor.rollout_is_decoupled``), optionally batch-normalised; rejection sampling
    (``rollout_rs`` with its thresholds, verl's current k1/k2/k3 options and its earlier
    token / sequence / geometric modes) and the token veto drop tokens or sequences. Bypass mode
    is ``actor.policy_loss: bypass_mode``, with the PPO loss (the ratio against the rollout policy
    is the weight) or, ``use_policy_gradient`` / ``loss_type: reinforce``, REINFORCE with
    truncated token- or sequence-level weights; there rejection, the veto and batch-normalised
    weights are refused (verl tests them against the current policy inside the loss).
    """
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"verl key 'algorithm.rollout_correction={v}': expected a mapping of its settings")
    key = "verl key 'algorithm.rollout_correction."
    unknown = sorted(set(v) - set(_ROLLOUT_CORRECTION_KEYS))
    if unknown:
        raise ConfigError(f"{key}{unknown[0]}' has no equivalent here (README: 'Coming from verl')")
    level = v.get("rollout_is")
    if level not in (None, "token", "sequence"):
        raise ConfigError(f"{key}rollout_is={level}': expected token, sequence or null")
    loss_type = v.get("loss_type")
    if loss_type not in (None, "ppo_clip", "reinforce"):
        raise ConfigError(f"{key}loss_type={loss_type}': expected ppo_clip or reinforce")
    threshold = 2.0 if v.get("rollout_is_threshold") is None else float(v["rollout_is_threshold"])
    reinforce = bool(v.get("use_policy_gradient")) or loss_type == "reinforce"
    rejection: dict = {}
    if v.get("rollout_rs") is not None:
        if v.get("rollout_rs_threshold") is None:
            raise ConfigError(f"{key}rollout_rs={v['rollout_rs']}' needs rollout_rs_threshold")
        rejection = {"actor.rollout_rs": str(v["rollout_rs"]), "actor.rollout_rs_threshold": str(v["rollout_rs_threshold"])}
        if v.get("rollout_rs_threshold_lower") is not None:
            rejection["actor.rollout_rs_threshold_lower"] = float(v["rollout_rs_threshold_lower"])
    if v.get("rollout_token_veto_threshold") is not None:
        rejection["actor.rollout_token_veto_threshold"] = float(v["rollout_token_veto_threshold"])
    if not v.get("bypass_mode"):
        if reinforce:
            raise ConfigError(f"{key}use_policy_gradient=True' is supported with bypass_mode=True only")
        out = dict(rejection)
        if level is not None:
            out.update({"actor.rollout_is_decoupled": True, "actor.rollout_is": level,
                        "actor.rollout_is_threshold": threshold,
                        "actor.rollout_is_batch_normalize": bool(v.get("rollout_is_batch_normalize"))})
        return out
    for name in ("rollout_rs", "rollout_token_veto_threshold"):
        if v.get(name) is not None:
            raise ConfigError(f"{key}{name}={v[name]}' with bypass_mode=True is not supported here: rejection "
                              "runs in decoupled mode (bypass_mode=False) only")
    if v.get("rollout_is_batch_normalize"):
        raise ConfigError(f"{key}rollout_is_batch_normalize=True' with bypass_mode=True is not supported here: "
                          "batch-normalised weights run in decoupled mode (bypass_mode=False) only")
    if not reinforce:
        if level is not None:
            raise ConfigError(f"{key}rollout_is={level}' with bypass_mode and the PPO loss is not supported "
                              "here: its ratio to the rollout policy is the weight; set rollout_is=null, or "
                              "use_policy_gradient=True for weighted REINFORCE")
        return {"actor.policy_loss": "bypass_mode", "actor.rollout_correction_loss_type": "ppo_clip"}
    return {"actor.policy_loss": "bypass_mode", "actor.rollout_correction_loss_type": "reinforce",
            "actor.rollout_is": level or "", "actor.rollout_is_threshold": threshold}


_OFFLOAD = "model.param_offload moves parameters, gradients and optimizer state together"
_PERF = "a performance switch of verl's engines; no effect on the results here"
_SAMPLER = "the built-in KV-cache sampler generates (no inference engine)"
_ONE_SETTING = ("the actor, reference and rollout share one log-prob micro-batch here: "
                "actor.log_prob_micro_batch_size_per_gpu")

_AR, _A, _R = "actor_rollout_ref.", "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
_OVERLONG_BUFFER = ("reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg",
                    "reward.reward_kwargs.overlong_buffer_cfg", "custom_reward_function.overlong_buffer")

RULES: dict[str, Rule] = {
    # ---------------------------------------------------------------- actor_rollout_ref.model
    **{_AR + "model." + k: to("model." + k) for k in (
        "path", "tokenizer_path", "trust_remote_code", "attn_implementation", "enable_gradient_checkpointing",
        "use_remove_padding", "lora_rank", "lora_alpha", "target_modules")},
    _AR + "model.hf_config_path": only((None,), "the config comes from model.path",
                                       "a config other than the checkpoint's is not supported"),
    _AR + "model.custom_chat_template": only((None,), "the tokenizer's chat template is used",
                                             "custom chat templates are not supported; put it in the tokenizer"),
    _AR + "model.external_lib": only((None,), "nothing to import", "external model libraries are not imported"),
    _AR + "model.override_config": to("model.path", "dropout settings of 0: no dropout is used here", convert=lambda v:
                                      _override_config(v)),
    _AR + "model.exclude_modules": only((None,), "no LoRA exclusions", "LoRA exclude_modules is not supported"),
    _AR + "model.use_shm": ignored(_PERF),
    _AR + "model.enable_activation_offload": ignored(_PERF),
    _AR + "model.use_liger": ignored(_PERF),
    _AR + "model.use_fused_kernels": ignored(_PERF),
    _AR + "model.fused_kernel_options": ignored(_PERF),
    _AR + "hybrid_engine": only((True,), "always a hybrid engine: the actor's ranks generate",
                                "only the hybrid engine (colocated actor and rollout) exists here"),
    _AR + "nccl_timeout": to("trainer.collective_timeout_s", convert=lambda v: {"trainer.collective_timeout_s": float(v)}),
    # ---------------------------------------------------------------- actor_rollout_ref.actor
    **{_A + k: to("actor." + k) for k in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "shuffle", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
        "loss_agg_mode", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "tis_imp_ratio_cap",
        "grad_clip")},
    _A + "use_token_level_loss": to("actor.loss_agg_mode", "verl's older switch: true is token-mean, false "
                                    "seq-mean-token-mean", convert=lambda v: {} if v is None else
                                    {"actor.loss_agg_mode": "token-mean" if v else "seq-mean-token-mean"}),
    _A + "ppo_micro_batch_size": to("actor.ppo_micro_batch_size_per_gpu", "global size / world size (deprecated in verl)",
                                    convert=_per_gpu("actor.ppo_micro_batch_size_per_gpu")),
    _A + "ulysses_sequence_parallel_size": to("parallel.sp"),
    _A + "use_remove_padding": to("model.use_remove_padding"),
    _A + "router_replay.mode": to("actor.router_replay", "disabled is none", convert=lambda v: {
        "actor.router_replay": "none" if v in (None, "disabled", "none") else v}),
    _A + "megatron.expert_model_parallel_size": to("parallel.ep", "experts over ep ranks taken from dp (FSDP2 "
                                                   "shards them over the rest)"),
    _A + "strategy": only(("fsdp", "fsdp2"), "FSDP2 is the training engine", "only FSDP (FSDP2) training exists here"),
    _A + "policy_loss.loss_mode": to("actor.policy_loss"),
    **{_A + "policy_loss." + k: to("actor." + k) for k in (
        "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
    **{_A + "optim." + k: to("actor." + k) for k in (
        "lr", "weight_decay", "betas", "lr_warmup_steps", "lr_warmup_steps_ratio", "warmup_style", "min_lr_ratio")},
    _A + "optim.lr_scheduler_type": to("actor.warmup_style"),
    _A + "optim.clip_grad": to("actor.grad_clip"),
    _A + "optim.num_cycles": only((0.5,), "half a cosine cycle, as here", "only num_cycles=0.5 (one half cosine)"),
    _A + "optim.total_training_steps": ignored("set by the trainer (trainer.total_training_steps)"),
    _A + "optim.optimizer": only(("AdamW",), "AdamW", "only AdamW is implemented"),
    _A + "optim.optimizer_impl": only(("torch.optim",), "torch.optim.AdamW", "only torch.optim.AdamW is implemented"),
    _A + "fsdp_config.param_offload": to("model.param_offload", _OFFLOAD),
    _A + "fsdp_config.optimizer_offload": ignored(_OFFLOAD),
    _A + "fsdp_config.grad_offload": ignored(_OFFLOAD),
    _A + "fsdp_config.offload_policy": ignored(_OFFLOAD),
    _A + "fsdp_config.model_dtype": to("model.dtype", convert=_dtype),
    _A + "fsdp_config.ulysses_sequence_parallel_size": to("parallel.sp"),
    _A + "fsdp_config.fsdp_size": ignored("FSDP shards over all data-parallel ranks (no HSDP)"),
    **{_A + "fsdp_config." + k: ignored(_PERF) for k in (
        "wrap_policy", "reshard_after_forward", "forward_prefetch", "use_orig_params", "mixed_precision",
        "entropy_from_logits_with_chunking", "use_torch_compile", "entropy_checkpointing", "forward_only",
        "strategy", "dtype")},
    **{_A + k: ignored(_PERF) for k in (
        "use_torch_compile", "entropy_from_logits_with_chunking", "entropy_checkpointing", "use_fused_kernels")},
    _A + "checkpoint": ignored("a checkpoint always holds model, optimizer and trainer state"),
    _A + "profiler": ignored("profile with trainer.profile_steps"),
    _A + "data_loader_seed": ignored("the data order is seeded by data.seed"),
    _A + "freeze_vision_tower": to("model.freeze_vision_tower"),
    # ---------------------------------------------------------------- actor_rollout_ref.ref
    _AR + "ref.log_prob_micro_batch_size_per_gpu": follows("actor.log_prob_micro_batch_size_per_gpu", _ONE_SETTING),
    _AR + "ref.log_prob_micro_batch_size": ignored(_ONE_SETTING),
    _AR + "ref.log_prob_max_token_len_per_gpu": follows("actor.log_prob_max_token_len_per_gpu", _ONE_SETTING),
    _AR + "ref.log_prob_use_dynamic_bsz": ignored("follows actor.use_dynamic_bsz"),
    _AR + "ref.ulysses_sequence_parallel_size": follows("parallel.sp", "one sp size for actor and reference"),
    _AR + "ref.fsdp_config": ignored("the reference shares the actor's layout (" + _OFFLOAD + ")"),
    **{_AR + "ref." + k: ignored(_PERF) for k in (
        "strategy", "use_torch_compile", "entropy_from_logits_with_chunking", "entropy_checkpointing", "profiler",
        "model")},
    # ---------------------------------------------------------------- actor_rollout_ref.rollout
    _R + "n": to("rollout.n"),
    _R + "temperature": to("rollout.temperature"),
    _R + "top_k": to("rollout.top_k"),
    _R + "top_p": to("rollout.top_p"),
    _R + "do_sample": to("rollout.temperature", "do_sample=false is greedy: rollout.temperature=0",
                         convert=lambda v: {} if v else {"rollout.temperature": 0.0}),
    _R + "tensor_model_parallel_size": to("rollout.tp"),
    _R + "expert_parallel_size": to("rollout.ep"),
    _R + "gpu_memory_utilization": to("rollout.gpu_memory_utilization"),
    _R + "max_num_seqs": to("rollout.max_num_seqs"),
    _R + "max_num_batched_tokens": to("rollout.prefill_tokens", "tokens per prefill forward"),
    _R + "enforce_eager": to("rollout.compile", "CUDA graphs: rollout.compile",
                             convert=lambda v: {"rollout.compile": False} if v else {}),
    _R + "log_prob_micro_batch_size_per_gpu": to("actor.log_prob_micro_batch_size_per_gpu", _ONE_SETTING),
    _R + "log_prob_micro_batch_size": to("actor.log_prob_micro_batch_size_per_gpu", _ONE_SETTING,
                                         convert=_per_gpu("actor.log_prob_micro_batch_size_per_gpu")),
    _R + "log_prob_max_token_len_per_gpu": to("actor.log_prob_max_token_len_per_gpu", _ONE_SETTING),
    _R + "log_prob_use_dynamic_bsz": ignored("follows actor.use_dynamic_bsz"),
    _R + "prompt_length": follows("data.max_prompt_length"),
    _R + "response_length": follows("data.max_response_length"),
    **{_R + "val_kwargs." + k: to("trainer.val_kwargs." + k) for k in ("n", "do_sample", "temperature", "top_p", "top_k")},
    _R + "name": ignored(_SAMPLER),
    _R + "mode": ignored(_SAMPLER),
    _R + "dtype": to("rollout.dtype"),
    _R + "quantization": to("rollout.quantization", "FP8 rollout (128 x 128 block scales, as verl's)",
                            convert=lambda v: _quantization(v)),
    _R + "free_cache_engine": to("rollout.free_cache_engine"),
    _R + "load_format": ignored("rollout weights come from the actor's shards every step"),
    _R + "layered_summon": ignored("rollout weights come from the actor's shards every step"),
    _R + "update_weights_bucket_megabytes": ignored("rollout weights come from the actor's shards every step"),
    **{_R + k: ignored(_PERF) for k in (
        "cudagraph_capture_sizes", "enable_chunked_prefill", "enable_prefix_caching",
        "disable_log_stats", "engine_kwargs", "max_model_len", "skip_tokenizer_init", "multi_stage_wake_up",
        "calculate_log_probs", "profiler", "trace", "data_parallel_size",
        "pipeline_model_parallel_size", "agent")},
    _R + "ignore_eos": only((False,), "responses stop at EOS", "ignore_eos=true is not supported"),
    _R + "over_sample_rate": to("rollout.over_sample_rate"),
    _R + "skip_rollout": only((False,), "rollouts are generated", "skip_rollout (replaying dumps) is not supported"),
    _R + "skip_dump_dir": ignored("no rollout dumps"),
    **{_R + "multi_turn." + k: to("rollout.multi_turn." + k) for k in (
        "enable", "tool_config_path", "max_assistant_turns", "max_user_turns", "max_parallel_calls",
        "max_tool_response_length", "tool_response_truncate_side", "format")},
    _R + "multi_turn.max_turns": to("rollout.multi_turn.max_assistant_turns", "verl's older name"),
    _R + "multi_turn.interaction_config_path": only((None, ""), "no simulated user",
                                                     "interaction agents (a simulated user turn) are not supported"),
    **{_R + "multi_turn." + k: ignored("token-in / token-out: turns extend the exact token ids, never re-rendered")
       for k in ("use_inference_chat_template", "tokenization_sanity_check_mode")},
    # ---------------------------------------------------------------- critic
    **{"critic.optim." + k: to("critic." + k) for k in (
        "lr", "weight_decay", "lr_warmup_steps", "lr_warmup_steps_ratio", "warmup_style")},
    "critic.optim.lr_scheduler_type": to("critic.warmup_style"),
    "critic.optim.clip_grad": to("critic.grad_clip"),
    "critic.optim.betas": only(([0.9, 0.999],), "AdamW betas (0.9, 0.999)", "the critic's AdamW betas are fixed at (0.9, 0.999)"),
    "critic.optim.min_lr_ratio": only((0, 0.0), "no cosine floor", "the critic's schedule has no min_lr_ratio"),
    "critic.optim.num_cycles": only((0.5,), "half a cosine cycle", "only num_cycles=0.5"),
    "critic.optim.total_training_steps": ignored("set by the trainer"),
    "critic.optim.optimizer": only(("AdamW",), "AdamW", "only AdamW is implemented"),
    "critic.model.path": to("critic.model_path"),
    "critic.model.tokenizer_path": ignored("the critic reads the actor's tokens"),
    "critic.model.trust_remote_code": ignored("follows model.trust_remote_code"),
    "critic.model.enable_gradient_checkpointing": ignored("follows model.enable_gradient_checkpointing"),
    "critic.model.use_remove_padding": ignored("the critic always runs the padded path"),
    "critic.model.lora_rank": only((0,), "full critic", "critic LoRA is not supported"),
    "critic.model.override_config": only(({},), "no override", "overriding the critic config is not supported"),
    "critic.model.external_lib": only((None,), "nothing to import", "external model libraries are not imported"),
    **{"critic.model." + k: ignored(_PERF) for k in (
        "fsdp_config", "use_shm", "enable_activation_offload", "lora_alpha", "target_modules")},
    "critic.ppo_micro_batch_size": to("critic.ppo_micro_batch_size_per_gpu", "global size / world size",
                                      convert=_per_gpu("critic.ppo_micro_batch_size_per_gpu")),
    "critic.forward_micro_batch_size": ignored("critic forwards use critic.ppo_micro_batch_size_per_gpu"),
    "critic.forward_micro_batch_size_per_gpu": ignored("critic forwards use critic.ppo_micro_batch_size_per_gpu"),
    "critic.forward_max_token_len_per_gpu": ignored("critic forwards use actor.log_prob_max_token_len_per_gpu"),
    "critic.use_dynamic_bsz": ignored("follows actor.use_dynamic_bsz"),
    "critic.shuffle": ignored("follows the actor's mini-batch order"),
    "critic.ulysses_sequence_parallel_size": follows("parallel.sp", "one sp size for all models"),
    "critic.rollout_n": ignored("follows rollout.n"),
    "critic.strategy": only(("fsdp", "fsdp2"), "FSDP2", "only FSDP (FSDP2) training exists here"),
    "critic.enable": ignored("a critic is trained exactly when algorithm.adv_estimator=gae"),
    "critic.checkpoint": ignored("a checkpoint always holds model, optimizer and trainer state"),
    "critic.profiler": ignored("profile with trainer.profile_steps"),
    # ---------------------------------------------------------------- reward_model, custom_reward_function
    "reward_model.enable": to("reward.reward_model.enable"),
    "reward_model.model.path": to("reward.reward_model.path"),
    "reward_model.micro_batch_size_per_gpu": to("reward.reward_model.micro_batch_size_per_gpu"),
    "reward_model.max_length": to("reward.reward_model.max_length"),
    "reward_model.model.input_tokenizer": ignored("responses are decoded with the actor's tokenizer"),
    "reward_model.reward_manager": to("reward.reward_manager", convert=_reward_manager),
    "reward_model.launch_reward_fn_async": ignored("see reward.score_during_generation"),
    # DAPO's overlong buffer, in each of the three places verl versions put it
    **{f"{where}.{k}": to(native) for where in _OVERLONG_BUFFER for k, native in (
        ("enable", "reward.overlong_buffer_enable"), ("len", "reward.overlong_buffer_len"),
        ("penalty_factor", "reward.overlong_penalty_factor"))},
    **{f"{where}.log": ignored("reward shaping is logged") for where in _OVERLONG_BUFFER},
    "reward_model.reward_kwargs.max_resp_len": follows("data.max_response_length"),
    "reward.reward_kwargs.max_resp_len": follows("data.max_response_length"),
    "reward.reward_manager": to("reward.reward_manager", convert=_reward_manager),
    "reward_model.sandbox_fusion.url": only((None,), "no sandbox", "sandbox-fusion code execution is not supported"),
    **{"reward_model." + k: ignored(_PERF) for k in (
        "model.fsdp_config", "model.use_remove_padding", "model.trust_remote_code", "model.use_shm",
        "model.use_fused_kernels", "model.external_lib", "strategy", "use_dynamic_bsz",
        "forward_max_token_len_per_gpu", "micro_batch_size", "profiler", "ulysses_sequence_parallel_size",
        "sandbox_fusion.max_concurrent", "sandbox_fusion.memory_limit_mb", "enable_resource_pool",
        "n_gpus_per_node", "nnodes")},
    "custom_reward_function.path": to("reward.reward_fn", "path:name"),
    "custom_reward_function.name": to("reward.reward_fn", "path:name"),
    "custom_reward_function.reward_kwargs": to("reward.reward_kwargs"),
    # ---------------------------------------------------------------- algorithm, data
    "algorithm.rollout_correction": to("actor.rollout_is_decoupled", "IS weights / rejection against the rollout policy",
                                       convert=_rollout_correction),
    "algorithm.use_pf_ppo": only((False,), "no preference-feedback PPO", "PF-PPO reweighting is not supported"),
    "algorithm.pf_ppo": ignored("PF-PPO is off"),
    "data.tokenizer": to("model.tokenizer_path"),
    "data.reward_fn_key": only(("data_source",), "rewards are chosen by data_source",
                               "rewards are chosen by the data_source column only"),
    "data.val_batch_size": ignored("validation prompts are batched by the sampler (rollout.max_num_seqs)"),
    "data.custom_cls.path": only((None,), "the built-in dataset", "custom dataset classes are not supported"),
    "data.custom_cls.name": ignored("the built-in dataset"),
    "data.sampler.class_path": only((None,), "the built-in sampler", "custom data samplers are not supported"),
    "data.sampler.class_name": ignored("the built-in sampler"),
    "data.datagen.path": only((None,), "no data generation", "dynamic data generation is not supported"),
    "data.datagen.name": ignored("no data generation"),
    "data.apply_chat_template_kwargs": only(({},), "default chat template arguments",
                                            "chat template arguments are not supported"),
    "data.trust_remote_code": ignored("see model.trust_remote_code"),
    "data.return_multi_modal_inputs": ignored("a vision-language model's rows always keep their processor outputs"),
    "data.image_key": to("data.image_key"),
    **{"data." + k: ignored("not needed by this data path") for k in (
        "use_shm", "return_raw_input_ids", "return_raw_chat", "return_full_prompt", "dataloader_num_workers",
        "filter_overlong_prompts_workers", "video_key", "validation_shuffle")},
    # ---------------------------------------------------------------- trainer
    "trainer.save_freq": to("checkpoint.save_freq"),
    "trainer.default_local_dir": to("trainer.output_dir", "checkpoints go to <dir>/checkpoints/global_step_N"),
    "trainer.critic_warmup": to("algorithm.critic_warmup"),
    "trainer.resume_mode": to("checkpoint.resume", "with trainer.resume_from_path (rlhf/verl_compat.py)"),
    "trainer.resume_from_path": to("checkpoint.resume", "used only with trainer.resume_mode=resume_path"),
    "trainer.max_actor_ckpt_to_keep": to("checkpoint.max_to_keep", "null = keep all (0)",
                                         convert=lambda v: {"checkpoint.max_to_keep": 0 if v is None else v}),
    "trainer.max_critic_ckpt_to_keep": ignored("actor and critic are saved together (checkpoint.max_to_keep)"),
    "trainer.remove_previous_ckpt_in_save": to("checkpoint.max_to_keep", "true keeps the last one",
                                               convert=lambda v: {"checkpoint.max_to_keep": 1} if v else {}),
    "trainer.default_hdfs_dir": only((None,), "no HDFS copy", "copying checkpoints to HDFS is not supported"),
    "trainer.del_local_ckpt_after_load": only((False,), "checkpoints are kept", "deleting checkpoints is not supported"),
    "trainer.val_only": only((False,), "training runs", "validation-only runs: use python -m rlhf.eval"),
    "trainer.balance_batch": ignored("micro-batches are balanced by token count (actor.use_dynamic_bsz)"),
    "trainer.rollout_data_dir": to("trainer.rollout_data_dir", convert=lambda v: {"trainer.rollout_data_dir": v or ""}),
    "trainer.validation_data_dir": ignored("see trainer.log_val_generations (generations.jsonl)"),
    **{"trainer." + k: ignored("no Ray / verl worker here") for k in (
        "ray_wait_register_center_timeout", "use_legacy_worker_impl", "esi_redundant_time", "use_v1")},
    # ---------------------------------------------------------------- fully async (verl's fully_async_policy)
    **{"async_training." + k: to("async_training." + k) for k in (
        "staleness_threshold", "trigger_parameter_sync_step", "require_batches", "partial_rollout",
        "use_rollout_log_probs")},
    "rollout.nnodes": to("rollout.nnodes", "the rollout role of trainer.mode fully_async"),
    "rollout.n_gpus_per_node": to("rollout.n_gpus_per_node", "the rollout role of trainer.mode fully_async"),
    "global_profiler": ignored("profile with trainer.profile_steps"),
    "ray_init": ignored("no Ray: torchrun launches the ranks"),
    "ray_kwargs": ignored("no Ray: torchrun launches the ranks"),
    "transfer_queue": ignored("no Ray: torchrun launches the ranks"),
}

# Where a refused key has a near equivalent: the hint printed with its refusal.
HINTS: dict[str, str] = {
    _A + "loss_mode": f"set {_A}policy_loss.loss_mode",
    _A + "k_percent": f"set {_A}policy_loss.kl_cov_ratio (a fraction of the tokens)",
    _A + "ppo_kl_coef": f"set {_A}policy_loss.ppo_kl_coef",
    "reward_model.overlong_buffer_cfg": "set reward_model.overlong_buffer.{enable,len,penalty_factor}",
}


def hint_for(key: str) -> str:
    """`` (README: ...)`` or the hint of the closest refused key with one."""
    for k in sorted(HINTS, key=len, reverse=True):
        if key == k or key.startswith(k + "."):
            return f"; {HINTS[k]}"
    return " (README: 'Coming from verl')"


# Subtrees that exist only in verl's spelling: an unlisted key under them is refused by name.
VERL_ONLY = ("actor_rollout_ref", "custom_reward_function", "reward_model", "critic.optim", "critic.model",
             "reward.reward_kwargs.overlong_buffer_cfg")

# verl's defaults (ppo_trainer.yaml) where they differ from ours; applied, where unset, to a
# configuration written only in verl's spelling.
VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "trainer.total_epochs": 30,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "data.filter_overlong_prompts": False,
    "model.enable_gradient_checkpointing": True,
    "checkpoint.max_to_keep": 0,
}

# verl interpolations: (key, the key it follows) — critic.ppo_mini_batch_size: ${actor...ppo_mini_batch_size}.
VERL_FOLLOWS = (("critic.ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
                ("critic.ppo_epochs", "actor.ppo_epochs"),
                ("critic.loss_agg_mode", "actor.loss_agg_mode"),
                ("actor.log_prob_max_token_len_per_gpu", "actor.ppo_max_token_len_per_gpu"))
