"""Typed run configuration: one dataclass per section (the schema; loading it is :mod:`rlhf.config.load`).

Every field has a default and a one-line doc (the ``doc`` metadata). Loading is strict:
an unknown key, a value of the wrong type or an impossible value fails at start-up with
the dotted key and, for unknown keys, the nearest valid names. Names follow verl where a
setting has the same meaning (``actor.ppo_mini_batch_size``, ``algorithm.adv_estimator``,
``actor.clip_ratio_low`` ...), flattened from verl's ``actor_rollout_ref.*`` tree.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

from rlhf.schema.distill import DistillConfig


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message names the dotted key."""


def _f(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


@dataclass
class ModelConfig:
    path: str = _f("", "Local HF causal-LM directory (or hub cache snapshot path).")
    tokenizer_path: str = _f("", "Tokenizer directory; empty = model.path.")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "Dtype of the master weights held by the optimizer.")
    mixed_precision: bool = _f(True, "On CUDA: compute in bf16 with fp32 master weights and fp32 gradient reduce.")
    trust_remote_code: bool = _f(False, "Pass trust_remote_code to transformers.")
    attn_implementation: str = _f("sdpa", "HF attention kernel: sdpa, eager or flash_attention_2.")
    enable_gradient_checkpointing: bool = _f(False, "Activation checkpointing per decoder block.")
    use_remove_padding: bool = _f(False, "Padding-free (packed) forward/backward for actor, critic and reference.")
    lora_rank: int = _f(0, "LoRA rank; 0 disables LoRA (full fine-tuning).")
    lora_alpha: int = _f(16, "LoRA alpha (scale = alpha / rank).")
    freeze_vision_tower: bool = _f(False, "Vision-language models: train the language model only (verl: "
                                   "actor.freeze_vision_tower); the tower still runs every micro-batch.")
    target_modules: Union[str, list] = _f("all-linear", "LoRA target modules: 'all-linear' or a list of names.")
    param_offload: bool = _f(False, "FSDP2 CPU offload of parameters, gradients and optimizer state.")
    load_ranks_per_node: int = _f(0, "Local ranks that read and place their weight shards at once at load (staggered "
                                     "by local rank); 0 = auto: all where the checkpoint is read by slices, else as "
                                     "many whole checkpoints as fit 80% of the node's available memory.")
    unsharded_grad_accumulation: bool = _f(
        False, "Reduce-scatter gradients once per mini-batch instead of after every micro-batch (FSDP2 no-sync): "
               "fewer collectives, but each rank holds the unsharded fp32 gradients of its whole model between "
               "micro-batches (+4 bytes per parameter; the planner counts them). Actor and critic.")
    prefix_grouping: Union[bool, Literal["auto"]] = _f(
        "auto", "Padding-free passes: rows sharing a prompt (a GRPO group) forward it once and their responses attend "
                "to its K/V (exact). auto = per micro-batch when that removes >= 15% and >= 64 of its tokens and, on a "
                "GPU without flash-attn, removed tokens x hidden_size^2 >= 2.5e10 (smaller passes are host-bound "
                "there; rlhf.models.prefix_grouping); off with sp, tp, VLM or MoE models. Actor, reference and critic.")
    fsdp_unit: Literal["auto", "block", "model"] = _f(
        "auto", "FSDP2 units: block = one per decoder block plus the root (least memory); model = the whole model "
                "as one unit (one all-gather per forward, one reduce-scatter per backward, no re-gather in the "
                "update's backward; the full parameters are held from forward to backward); auto = model up to "
                "64 MiB of parameters, else block. Same maths either way. Actor, critic, reference and SFT.")


@dataclass
class DataConfig:
    train_files: Union[str, list] = _f("", "Parquet or jsonl prompt files (verl schema).")
    val_files: Union[str, list] = _f("", "Held-out prompt files for validation; empty disables validation.")
    prompt_key: str = _f("prompt", "Column holding the prompt (chat messages or a string).")
    image_key: str = _f("images", "Column holding a row's images (verl's multimodal schema; one <image> "
                        "placeholder per image in the prompt); read when model.path is a vision-language model.")
    max_prompt_length: int = _f(512, "Prompts longer than this (tokens) are filtered or truncated.")
    max_response_length: int = _f(512, "Maximum generated tokens per response.")
    train_batch_size: int = _f(1024, "Prompts per step, global over all dp ranks.")
    gen_batch_size: int = _f(0, "Prompts per generation batch under algorithm.filter_groups (verl); 0 = train_batch_size.")
    truncation: Literal["error", "left", "right", "middle"] = _f(
        "error", "How to shorten over-long prompts when not filtering: error, left (keep the end), right (keep the "
                 "start), middle (keep both ends, as verl).")
    filter_overlong_prompts: bool = _f(True, "Drop (and count) prompts longer than max_prompt_length.")
    apply_chat_template: bool = _f(True, "Render prompts with the tokenizer's chat template when it has one.")
    shuffle: bool = _f(True, "Shuffle the training prompts each epoch.")
    seed: int = _f(1, "Seed of the data order.")


@dataclass
class MultiTurnConfig:
    enable: bool = _f(False, "Multi-turn rollouts: the policy calls tools between assistant turns (rlhf/agent).")
    tool_config_path: str = _f("", "Yaml of the tools (verl's format): each with class_name (calculator, python or "
                                   "path/to/file.py:Class), optional config and tool_schema.")
    max_assistant_turns: Optional[int] = _f(None, "Most assistant turns per trajectory; null = until the response "
                                                  "budget (data.max_response_length) is spent.")
    max_user_turns: Optional[int] = _f(None, "Most tool-response turns per trajectory; null = no limit.")
    max_parallel_calls: int = _f(1, "Tool calls run per assistant turn; later calls in the same turn are ignored.")
    max_tool_response_length: int = _f(256, "Characters of a tool result kept in the observation.")
    tool_response_truncate_side: Literal["left", "middle", "right"] = _f(
        "middle", "Which part of a longer tool result is kept: left (start), right (end), middle (both ends).")
    format: Literal["hermes"] = _f("hermes", "Tool-call format: hermes, <tool_call>{\"name\", \"arguments\"}</tool_call>.")
    num_workers: int = _f(2, "Tool worker processes per rank (a hung or crashed tool cannot stop the job); "
                             "0 = run tools in the trainer process (no timeout).")
    tool_timeout_s: float = _f(30.0, "Seconds one tool call may take in a worker; past it the observation is an "
                                     "error, counted in agent/tool_errors/timeout, and the worker is replaced.")


@dataclass
class SpeculativeConfig:
    enable: bool = _f(False, "Lossless speculative decoding without a draft model: n-gram drafts from the prompt's "
                             "other samples and the sequence's own tokens, verified in one forward; the sampled "
                             "tokens are those of plain decoding (rlhf/rollout/speculative.py).")
    num_draft_tokens: int = _f(4, "Draft tokens verified per sequence and decode step (vLLM num_speculative_tokens).")
    ngram_max: int = _f(3, "Longest suffix n-gram looked up for a draft (vLLM prompt_lookup_max).")
    ngram_min: int = _f(1, "Shortest suffix n-gram looked up for a draft (vLLM prompt_lookup_min).")
    sources: list = _f(["siblings", "self"], "Where drafts are looked up: siblings (the other samples of the same "
                                             "prompt), self (the sequence's own prompt, tokens and earlier turns).")


@dataclass
class RolloutConfig:
    n: int = _f(1, "Responses sampled per prompt (group size for GRPO).")
    temperature: float = _f(1.0, "Sampling temperature; 0 = greedy.")
    top_k: int = _f(-1, "Top-k sampling; -1 disables.")
    top_p: float = _f(1.0, "Nucleus sampling threshold; 1.0 disables.")
    min_p: float = _f(0.0, "Min-p sampling threshold; 0 disables.")
    stop: list = _f([], "Extra stop strings (EOS always stops).")
    tp: int = _f(1, "Tensor-parallel size of the rollout layout (divides parallel.tp x pp x dp).")
    ep: int = _f(1, "Expert-parallel size of the rollout layout (divides the replicas, world / rollout.tp): ep "
                    "replicas share their experts, E / ep each, and route tokens by all-to-all; 1: a replica holds "
                    "all experts (split over rollout.tp). Independent of parallel.ep.")
    max_num_seqs: int = _f(256, "Most sequences decoded at once per rank.")
    nnodes: int = _f(0, "trainer.mode fully_async (verl's name): nodes of the rollout role; the rollout ranks are "
                        "nnodes x n_gpus_per_node (0 = parallel.rollout_ranks).")
    n_gpus_per_node: int = _f(0, "trainer.mode fully_async (verl's name): rollout ranks per node (see rollout.nnodes).")
    kv_cache_tokens: int = _f(0, "Paged KV-cache budget in tokens per rank; sequences beyond it are preempted and "
                                 "resumed (same tokens). 0 = kv_cache_memory, else max_num_seqs x max sequence length.")
    kv_cache_memory: float = _f(0.0, "Paged KV-cache budget in GiB per rank (used when kv_cache_tokens is 0; "
                                     "0 = gpu_memory_utilization on CUDA, else room for max_num_seqs full sequences).")
    prefill_tokens: int = _f(8192, "Tokens per prefill forward; longer prompts are prefilled in chunks of this size.")
    val_temperature: float = _f(0.0, "Validation sampling temperature (0 = greedy, like verl val_kwargs.do_sample=False).")
    seed: int = _f(0, "Sampling seed; samples are keyed by (seed, step, prompt index, sample index).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = _f(
        "auto", "Dtype of the rollout weights and KV cache (verl rollout.dtype); auto = bfloat16 on CUDA, "
                "model.dtype on CPU. A rollout dtype other than the trainer's makes the sampler's log-probs "
                "differ from the trainer's: correct with actor.tis_imp_ratio_cap.")
    quantization: Literal["", "fp8"] = _f(
        "", "FP8 rollout (verl rollout.quantization): 'fp8' quantizes each linear weight of the decoder layers "
            "to e4m3 at the reshard (scales: rollout.quantization_scale; embeddings, norms, routers, LM head "
            "stay in rollout.dtype); decode runs FP8 matmuls on sm89+, the same weights dequantized elsewhere. "
            "Turns on token TIS (actor.rollout_is_decoupled, cap actor.rollout_is_threshold) unless another "
            "correction is set or actor.rollout_is is ''. '' = off.")
    quantization_scale: Literal["block", "channel"] = _f(
        "block", "rollout.quantization fp8 scales: block = one per 128 x 128 tile (DeepSeek-V3's), channel = one "
                 "per output row.")
    compile: bool = _f(False, "On CUDA: capture decode steps as CUDA graphs (static shapes); ignored on CPU. "
                              "The sampler, its KV cache and graphs then stay allocated for the whole run.")
    free_cache_engine: bool = _f(True, "Free the sampler (KV cache, rollout weights) after each rollout (verl name). "
                                       "False: keep one sampler for the run, new weights copied into its buffers each "
                                       "step (no reallocation; more memory held during training). compile on CUDA "
                                       "always keeps it.")
    gpu_memory_utilization: float = _f(0.5, "On CUDA with kv_cache_tokens and kv_cache_memory 0: the KV cache takes at most this "
                                            "fraction of the device memory free after the rollout weights (verl name).")
    over_sample_rate: float = _f(0.0, "verl's long-tail cut: each rollout replica aborts its remaining requests once "
                                      "(1 - over_sample_rate) of the prompt groups it started have finished. Here "
                                      "enough extra prompts start that the finished groups fill data.train_batch_size, "
                                      "and aborted prompts go back to the front of the data order (none lost). 0: off. "
                                      "fully_async: no effect (its stream never waits for a tail).")
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig, metadata={
        "doc": "Tool-using multi-turn rollouts (verl's rollout.multi_turn names)."})
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig, metadata={
        "doc": "Speculative decoding with n-gram drafts (no draft model); exact: same tokens and log-probs."})
    batch_invariant: bool = _f(False, "The sampler and the trainer run one batch-invariant forward (row-tiled "
                                      "matmuls, attention grouped by key length): the sampler's log-probs equal "
                                      "the trainer's bit for bit (mismatch/max_abs_logprob_diff = 0). Dense "
                                      "Llama-block families and Qwen3-MoE, tp = pp = sp = 1, colocated.")


@dataclass
class ActorConfig:
    lr: float = _f(1e-6, "Peak learning rate (verl actor.optim.lr).")
    use_rollout_log_probs: bool = _f(False, "With rollout.batch_invariant: skip the old-log-prob forward; the "
                                            "sampler's log-probs (bitwise the trainer's) are the old log-probs "
                                            "(verl's name). Costs the actor/entropy metric.")
    router_replay: Literal["none", "R2", "R3"] = _f(
        "none", "MoE routing replay (verl router_replay.mode): R2 = every update forward uses the experts the "
        "old-log-prob pass chose (gate weights from the live router); R3 = every trainer forward (old / ref "
        "log-probs, update) uses the experts the sampler chose for each token.")
    router_aux_loss_coef: float = _f(0.0, "MoE load-balancing loss coefficient (transformers' router_aux_loss_coef; "
                                          "RL recipes keep 0): coef x the mean per-micro-batch aux loss is added "
                                          "to the policy loss; logged as moe/aux_loss either way.")
    weight_decay: float = _f(0.01, "AdamW weight decay.")
    betas: list = _f([0.9, 0.999], "AdamW betas.")
    lr_warmup_steps: int = _f(-1, "Warmup steps; -1 uses lr_warmup_steps_ratio.")
    lr_warmup_steps_ratio: float = _f(0.0, "Warmup steps as a fraction of total steps.")
    warmup_style: Literal["constant", "cosine"] = _f("constant", "LR schedule after warmup.")
    min_lr_ratio: float = _f(0.0, "Cosine floor as a fraction of lr.")
    ppo_mini_batch_size: int = _f(256, "Prompts per optimizer step (global; multiplied by rollout.n).")
    ppo_micro_batch_size_per_gpu: int = _f(8, "Sequences per forward/backward micro-batch per rank.")
    log_prob_micro_batch_size_per_gpu: int = _f(16, "Sequences per micro-batch for forward-only log-prob passes.")
    use_dynamic_bsz: bool = _f(False, "Form micro-batches by token budget instead of a fixed count.")
    ppo_max_token_len_per_gpu: int = _f(16384, "Token budget per micro-batch when use_dynamic_bsz.")
    log_prob_max_token_len_per_gpu: int = _f(32768, "Token budget for forward-only passes when use_dynamic_bsz.")
    ppo_epochs: int = _f(1, "Passes over each rollout batch.")
    shuffle: bool = _f(False, "Shuffle sequences between mini-batches each epoch.")
    policy_loss: str = _f("vanilla", "Policy loss by name (verl policy_loss.loss_mode): vanilla, gspo, clip_cov, "
                                     "kl_cov, cispo, gpg, geo_mean, sapo, dro, dppo_kl, dppo_tv, bypass_mode.")
    clip_ratio: float = _f(0.2, "PPO clip epsilon; default for clip_ratio_low/high.")
    clip_ratio_low: float = _f(-1.0, "Lower clip epsilon; -1 = clip_ratio.")
    clip_ratio_high: float = _f(-1.0, "Upper clip epsilon (DAPO clip-higher); -1 = clip_ratio.")
    clip_ratio_c: float = _f(3.0, "Dual-clip constant for negative advantages.")
    loss_agg_mode: str = _f("token-mean", "token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | "
                                          "seq-mean-token-sum-norm.")
    entropy_coeff: float = _f(0.0, "Entropy bonus coefficient.")
    use_kl_loss: bool = _f(False, "Add KL(actor || reference) as a loss term (GRPO style).")
    skip_zero_advantage_rows: bool = _f(True, "Rows whose advantage is 0 on every token run no backward in the update "
                                              "(their gradient is exactly 0; same step to fp32 rounding, same metrics; "
                                              "rlhf/train/grad_free.py says for which losses).")
    kl_loss_coef: float = _f(0.001, "Coefficient of the KL loss.")
    kl_loss_type: str = _f("low_var_kl", "KL estimator for the loss: kl(k1), abs, mse(k2), low_var_kl(k3).")
    tis_imp_ratio_cap: float = _f(-1.0, "Truncated importance sampling cap between sampler and trainer; -1 off.")
    grad_clip: float = _f(1.0, "Max global gradient norm.")
    fp8: bool = _f(False, "FP8 training of the actor's linear layers with torchao float8 "
                          "(convert_to_float8_training, dynamic scales; the LM head, routers and layers whose "
                          "dims are not multiples of 16 stay in bf16); needs a GPU with FP8 (sm89+) and "
                          "pip install torchao. Logged as perf/fp8.")
    fp8_all_gather: bool = _f(False, "actor.fp8: FSDP2 all-gathers the FP8-trained weights in FP8 (torchao's "
                                     "enable_fsdp_float8_all_gather): half the bytes of a bf16 all-gather.")
    # loss-specific settings (verl actor.policy_loss.* / algorithm.rollout_correction.*)
    clip_cov_ratio: float = _f(0.0002, "clip_cov: share of tokens dropped from the loss.")
    clip_cov_lb: float = _f(1.0, "clip_cov: lower covariance bound of the candidates.")
    clip_cov_ub: float = _f(5.0, "clip_cov: upper covariance bound of the candidates.")
    kl_cov_ratio: float = _f(0.0002, "kl_cov: share of tokens given the KL penalty.")
    ppo_kl_coef: float = _f(0.1, "kl_cov: coefficient of |log pi - log pi_old| on the selected tokens.")
    dro_beta: float = _f(-1.0, "dro: coefficient of the quadratic proximal penalty (required, > 0).")
    tau_pos: float = _f(1.0, "sapo: gate temperature for positive advantages.")
    tau_neg: float = _f(1.05, "sapo: gate temperature for negative advantages.")
    rollout_is: Literal["token", "sequence", ""] = _f(
        "token", "bypass_mode + reinforce: importance weights per token, sequence or '' (off).")
    rollout_is_threshold: float = _f(2.0, "bypass_mode: truncation of the importance weights.")
    rollout_correction_loss_type: Literal["ppo_clip", "reinforce"] = _f("ppo_clip", "bypass_mode: ppo_clip or reinforce.")
    # decoupled-mode rollout correction (verl algorithm.rollout_correction with bypass_mode: false)
    # and AReaL's decoupled PPO; the math is rlhf/algos/rollout_corr.py.
    rollout_is_decoupled: bool = _f(False, "Weight the policy loss by the actor.rollout_is IS weights of the "
                                           "recomputed old policy vs the sampler (verl's decoupled mode).")
    rollout_is_batch_normalize: bool = _f(False, "Normalise the decoupled IS weights to mean 1 over the global batch.")
    rollout_rs: str = _f("", "Rejection sampling, comma-separated verl options (token_k1..3, seq_sum_k1..3, "
                             "seq_mean_k1..3, seq_max_k2/k3) or token | sequence | geometric; '' off.")
    rollout_rs_threshold: str | float = _f("", "Rejection thresholds, verl's format: one or one per option; k1 options "
                                       "'lower_upper' ratio bounds, others an upper bound.")
    rollout_rs_threshold_lower: float = _f(-1.0, "token/sequence/geometric rejection: lower ratio bound; -1 = 1/upper.")
    rollout_token_veto_threshold: float = _f(-1.0, "Reject a whole sequence holding a token with pi_old/pi_rollout "
                                                   "below this; -1 off.")
    use_decoupled_loss: bool = _f(False, "AReaL decoupled PPO: clip around the recomputed (proximal) policy and "
                                         "weight each token by pi_prox / pi_rollout.")
    behav_imp_weight_cap: float = _f(-1.0, "use_decoupled_loss: tokens whose pi_prox / pi_rollout exceeds this "
                                           "(> 1) get weight 0; -1 no cap.")

    @property
    def corrects_off_policy(self) -> bool:
        """Whether the loss corrects for a sampler policy other than pi_old (truncated IS, verl's decoupled
        rollout IS, or AReaL's decoupled PPO): the async modes need one of them."""
        return self.tis_imp_ratio_cap > 0 or self.rollout_is_decoupled or self.use_decoupled_loss

    entropy_coeff_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant", "Entropy coefficient over training: from entropy_coeff to entropy_coeff_final.")
    entropy_coeff_final: float = _f(0.0, "Entropy coefficient at the last step (linear / cosine schedules).")


@dataclass
class CriticConfig:
    model_path: str = _f("", "Critic backbone; empty = the actor's model.path.")
    lr: float = _f(1e-5, "Critic learning rate.")
    weight_decay: float = _f(0.01, "AdamW weight decay.")
    lr_warmup_steps: int = _f(-1, "Warmup steps; -1 uses lr_warmup_steps_ratio.")
    lr_warmup_steps_ratio: float = _f(0.0, "Warmup steps as a fraction of total steps.")
    warmup_style: Literal["constant", "cosine"] = _f("constant", "LR schedule after warmup.")
    ppo_mini_batch_size: int = _f(256, "Prompts per critic optimizer step (global).")
    ppo_micro_batch_size_per_gpu: int = _f(8, "Sequences per critic micro-batch per rank.")
    ppo_max_token_len_per_gpu: int = _f(32768, "Critic token budget per micro-batch when use_dynamic_bsz.")
    ppo_epochs: int = _f(1, "Critic passes over each batch.")
    cliprange_value: float = _f(0.5, "Value clipping range.")
    loss_agg_mode: str = _f("token-mean", "Aggregation of the value loss.")
    grad_clip: float = _f(1.0, "Max critic gradient norm.")


@dataclass
class RewardModelConfig:
    enable: bool = _f(False, "Score responses with an HF sequence-classification reward model.")
    path: str = _f("", "Reward model directory.")
    tokenizer_path: str = _f("", "Reward model tokenizer; empty = path.")
    micro_batch_size_per_gpu: int = _f(16, "Sequences per reward-model forward.")
    max_length: int = _f(2048, "Maximum prompt+response tokens for the reward model.")
    combine: Literal["replace", "add"] = _f("replace", "Replace rule-based rewards or add to them.")


@dataclass
class RewardConfig:
    reward_fn: str = _f("default", "Registered reward name or path/to/file.py:function.")
    reward_manager: Literal["naive", "prime", "dapo", "batch"] = _f(
        "naive", "verl's reward manager: naive, prime and dapo call the function per sample (in the worker pool; "
                 "dapo's overlong penalty is reward.overlong_buffer_*), batch calls it once per batch in the trainer "
                 "process: fn(data_sources, solution_strs, ground_truths, extra_infos) -> one score per response.")
    reward_kwargs: dict = _f({}, "Keyword arguments passed to the reward function, e.g. {format_score: 0.1} "
                                 "(verl custom_reward_function.reward_kwargs).")
    overlong_buffer_enable: bool = _f(False, "DAPO overlong reward shaping.")
    overlong_buffer_len: int = _f(0, "Length of the soft overlong penalty window (tokens).")
    overlong_penalty_factor: float = _f(1.0, "Penalty at the maximum response length.")
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig, metadata={"doc": "Reward model."})
    num_workers: int = _f(4, "Reward worker processes per rank, so a hung or crashed reward call cannot stop the "
                             "job; 0 = score in the trainer process (no timeout).")
    timeout_s: float = _f(30.0, "Seconds one reward call may take in a worker; past it the sample scores 0, is "
                                "counted in reward/timeouts and the worker is replaced. Once every worker has "
                                "timed out in a training step with no call answered, the step's other calls "
                                "fail at once (counted in reward/untried too): one timeout per step at most.")
    max_failed_steps: int = _f(3, "Training steps in a row in which every reward call failed or timed out (no "
                                  "learning signal) before the run stops with a line saying why; 0 = never.")
    score_during_generation: bool = _f(True, "With a worker pool (num_workers > 0) and no tp / pp / sp peers: "
                                             "submit responses to the pool as they finish, so rewards are "
                                             "computed while the rest of the batch decodes.")


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = _f("fixed", "KL coefficient controller.")
    kl_coef: float = _f(0.001, "Initial / fixed KL coefficient.")
    target_kl: float = _f(0.1, "Adaptive controller target KL.")
    horizon: int = _f(10000, "Adaptive controller horizon.")


@dataclass
class FilterGroupsConfig:
    enable: bool = _f(False, "DAPO dynamic sampling: drop prompt groups whose metric is all-equal.")
    metric: str = _f("acc", "Metric whose spread decides: acc or score.")
    max_num_gen_batches: int = _f(10, "Generation batches allowed to fill one training batch; 0 = unbounded.")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = _f("grpo", "Advantage estimator by name (gae, grpo, rloo, reinforce_plus_plus, ...).")
    norm_adv_by_std_in_grpo: bool = _f(True, "GRPO std normalisation; False = Dr.GRPO mean-only.")
    gamma: float = _f(1.0, "Discount factor.")
    lam: float = _f(1.0, "GAE lambda.")
    use_kl_in_reward: bool = _f(False, "Subtract a per-token KL penalty from the reward (PPO style).")
    kl_penalty: str = _f("kl", "KL estimator for the in-reward penalty.")
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig, metadata={"doc": "KL controller."})
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig, metadata={"doc": "Dynamic sampling."})
    filter_truncated: bool = _f(False, "Mask out responses that hit max_response_length from the loss.")
    critic_warmup: int = _f(0, "Steps that update only the critic.")
    gdpo_reward_keys: list = _f([], "gdpo: keys of the reward dict normalised one by one (e.g. [format, acc]); "
                                     "empty = the summed score.")
    gdpo_reward_weights: Optional[list] = _f(None, "gdpo: one weight per gdpo_reward_keys entry; null = all 1.")


@dataclass
class ParallelConfig:
    dp: int = _f(-1, "Data-parallel size; -1 = world size / (tp x pp).")
    tp: int = _f(1, "Tensor-parallel size of training.")
    pp: int = _f(1, "Pipeline-parallel size of training.")
    pp_schedule: str = _f("1F1B", "Pipeline schedule: 1F1B or GPipe.")
    rollout_ranks: int = _f(0, "trainer.mode one_step_off / fully_async: ranks in the rollout group (the upper "
                               "ranks of the world; the rest train); 0 = half the world (one_step_off supports "
                               "only half; fully_async any split, or rollout.nnodes x rollout.n_gpus_per_node).")
    pp_microbatches: int = _f(2, "Pipeline micro-batches per forward/backward.")
    sp: int = _f(1, "Ulysses sequence-parallel size (verl ulysses_sequence_parallel_size): ranks that split the "
                    "tokens of the same rows; needs model.use_remove_padding. dp = world / (tp x pp x sp).")
    ep: int = _f(1, "Expert-parallel size (MoE; verl expert_model_parallel_size): experts are split over ep ranks "
                    "taken from dp (tokens reach them by all-to-all) and FSDP-sharded over the other dp / ep; "
                    "must divide dp, and ep x tp must divide num_experts.")


@dataclass
class ValKwargsConfig:
    n: int = _f(1, "Responses per validation prompt; pass@k and maj@k are logged for k = powers of 2 up to n.")
    do_sample: bool = _f(False, "Sample validation responses (False = greedy, unless rollout.val_temperature > 0).")
    temperature: float = _f(1.0, "Validation sampling temperature when do_sample.")
    top_p: float = _f(1.0, "Validation nucleus threshold when do_sample; 1.0 disables.")
    top_k: int = _f(-1, "Validation top-k when do_sample; -1 disables.")


@dataclass
class TrainerConfig:
    total_epochs: int = _f(1, "Epochs over the training prompts.")
    total_training_steps: int = _f(-1, "Stop after this many steps; -1 = total_epochs x steps per epoch.")
    seed: int = _f(42, "Seed for model init pieces and anything else random.")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto = cuda when available.")
    test_freq: int = _f(-1, "Validate every N steps; -1 = only before and after training.")
    val_before_train: bool = _f(True, "Run validation at step 0.")
    output_dir: str = _f("outputs/run", "Run directory: resolved config, metrics, checkpoints, export.")
    project_name: str = _f("rlhf", "Project name for loggers.")
    experiment_name: str = _f("run", "Experiment name for loggers.")
    logger: list = _f(["console", "jsonl"], "Backends: console, jsonl, file (verl's file logger: "
                                            "VERL_FILE_LOGGER_PATH), tensorboard (TENSORBOARD_DIR when set), mlflow, "
                                            "wandb. output_dir/metrics.jsonl is always written.")
    max_nan_steps: int = _f(3, "Optimizer steps with a non-finite loss/grad norm are skipped and counted; "
                                 "abort after this many in a row.")
    collective_timeout_s: float = _f(600.0, "Seconds a collective waits for the slowest rank (every process group); "
                                            "a rank the others have waited on this long ends the job, named.")
    exchange_timeout_s: float = _f(10800.0, "Seconds a rank may wait in an exchange whose length is other ranks' "
                                             "work, not a stuck collective: rollout replicas waiting for the "
                                             "slowest replica's rows; under trainer.mode one_step_off each role "
                                             "waiting for its partner's weights or batch (through model loading, "
                                             "validation, a whole update). Separate groups with this timeout.")
    heartbeat_timeout_s: float = _f(60.0, "A rank silent this long (stopped, its node lost) ends the job with a line "
                                          "naming it; 0 disables the watchdog.")
    alerts: dict = _f({"kl_to_ref": 1.0, "entropy_collapse": 0.01, "logprob_diff": 10.0, "grad_norm_spike": 10.0,
                       "response_length_collapse": 0.25},
                      "Training-health alerts, name -> threshold (rlhf/ops/alerts.py): a warning line and "
                      "alerts/<name> = 1 when crossed; {} disables.")
    rollout_data_dir: str = _f("", "verl's rollout dump: each training step's samples to <dir>/<step>.jsonl (input, "
                                   "output, gts, score, step and the reward dict's keys); empty = off.")
    log_val_generations: int = _f(0, "Validation samples (prompt, response, ground truth, score) logged each "
                                     "validation to generations.jsonl and the trackers' tables (verl's name).")
    profile_steps: list = _f([], "Steps to record with torch.profiler: a chrome trace per rank in "
                                 "output_dir/profile/step_<k>/ (CPU activity, and CUDA kernels on GPU).")
    max_oom_retries: int = _f(3, "Out of memory in a phase: record it, end the job, and on restart/rerun halve that "
                                 "phase's micro-batch / token budget (rlhf/ops/oom.py); fail after this many.")
    mode: Literal["colocated", "one_step_off", "fully_async"] = _f(
        "colocated", "colocated: every rank generates, then every rank trains. one_step_off: half the ranks "
                     "generate batch k+1 with the weights of step k-1 while the other half trains on batch k "
                     "(rlhf/train/async_rl). fully_async: parallel.rollout_ranks ranks generate continuously and "
                     "stream finished groups to the training ranks (async_training.*).")
    nnodes: int = _f(0, "verl's launch layout: nodes; with n_gpus_per_node, checked against the launched world "
                        "size (0 = unchecked); a single-process --dry-run plans for nnodes x n_gpus_per_node.")
    n_gpus_per_node: int = _f(0, "verl's launch layout: ranks per node (see trainer.nnodes; 0 = unchecked).")
    stop_after_steps: int = _f(-1, "Exit after this many steps in this process (e.g. a time-limited slurm job); "
                                   "the schedule still spans total_training_steps and a later run resumes.")
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig, metadata={
        "doc": "Validation sampling (verl's val_kwargs): n, do_sample, temperature, top_p, top_k."})


@dataclass
class CheckpointConfig:
    save_freq: int = _f(-1, "Save every N steps; -1 never (except final if save_final).")
    save_final: bool = _f(False, "Save a checkpoint after the last step.")
    resume: str = _f("auto", "auto = latest complete checkpoint in output_dir; disable; or a checkpoint path.")
    max_to_keep: int = _f(2, "Keep only this many checkpoints; 0 = all.")
    export_hf: bool = _f(True, "Write an HF save_pretrained (safetensors) export at the end.")


@dataclass
class AsyncTrainingConfig:
    """trainer.mode fully_async (verl's ``async_training`` section, same names and meanings)."""

    staleness_threshold: float = _f(0.0, "Bounded staleness (AReaL's eta): the rollout role admits a new prompt "
                                         "only while accepted + in-flight prompts stay within (1 + this) sync "
                                         "windows ahead of the weights it holds; 0 with trigger_parameter_sync_step "
                                         "1 is the synchronous algorithm.")
    trigger_parameter_sync_step: int = _f(1, "Updates between two weight pushes to the rollout ranks.")
    require_batches: int = _f(1, "An update starts once the trainer holds require_batches x "
                                 "actor.ppo_mini_batch_size prompts' groups (must equal data.train_batch_size).")
    partial_rollout: bool = _f(True, "At a weight push, sequences in flight pause at a token boundary, take the "
                                     "new weights and continue; false: they finish on the old weights first "
                                     "(no new prompt is admitted meanwhile).")
    partial_rollout_kv: Literal["recompute", "keep"] = _f(
        "recompute", "After a partial-rollout pause: recompute = re-prefill the kept tokens under the new weights "
                     "(AReaL); keep = continue on the stale KV cache (PipelineRL).")
    use_rollout_log_probs: bool = _f(False, "Use the sampler's per-token log-probs as the old log-probs (no "
                                            "recompute forward); false: the trainer recomputes them and corrects "
                                            "with actor.tis_imp_ratio_cap.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def describe(cls: type = Config, prefix: str = "") -> list[str]:
    """Lines ``dotted.key: default  # doc`` for the README / --help."""
    lines = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            lines += describe(tp, prefix + f.name + ".")
        elif typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
            lines.append(f"{prefix}{f.name}: {{}}  # {f.metadata.get('doc', '')}")  # named sections
            lines += describe(args[1], f"{prefix}{f.name}.<name>.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"{prefix}{f.name}: {default!r}  # {f.metadata.get('doc', '')}")
    return lines
