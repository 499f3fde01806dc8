"""The RL loop, phase by phase, run identically on every rank (SPMD).

    prompts -> reshard + generate -> score -> old/ref log-probs (+ values)
            -> advantages -> update (critic, actor) -> log / validate / checkpoint

Each dp rank owns a contiguous slice of the global prompt batch with all `n` samples of
its prompts, so group statistics (GRPO, RLOO) are local; every loss is normalised by
global counts, so results do not depend on the layout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from rlhf.agent.rollout import make_agent
from rlhf.algos.advantages import get_adv_estimator
from rlhf.algos.kl import apply_kl_penalty, get_kl_controller, kl_penalty, update_kl_controller
from rlhf.algos.optimal_token_baseline import TOKEN_BASELINE_ESTIMATORS
from rlhf.algos.reward_shaping import overlong_reward_penalty, place_reward_on_last_token
from rlhf.schema.batch import RolloutBatch, minibatch_major_shard
from rlhf.train.actor import PolicyWorker
from rlhf.train.checkpoint import (ModelOptimState, check_output_dir, export_hf, find_resume_path, load_checkpoint,
                                   load_rank_state, save_checkpoint)
from rlhf.algos.dynamic_sampling import select_informative_groups
from rlhf.algos.rollout_correction import rollout_is_weights
from rlhf.models.loading import check_rollout_support, language_config, load_tokenizer, model_config
from rlhf.models.lora import reference_context
from rlhf.models.parallel import ParallelDims, all_gather_object, all_reduce_sum, init_distributed, make_global_whiten
from rlhf.models.parallelize import validate_layout
from rlhf.ops.metrics import MetricsLogger, PhaseTimer
from rlhf.ops.oom import apply_oom_records, record_oom
from rlhf.ops.runtime import StepOps
from rlhf.rewards.pool import RewardPool, make_scorer
from rlhf.rewards.scoring import FailedStepGuard, mean_of_sums, reward_components
from rlhf.rewards.streaming import StreamingScores
from rlhf.rollout.engine import RolloutEngine, rollout_dtype
from rlhf.rollout.reshard import RolloutLayout
from rlhf.config.checks import check_startup
from rlhf.schema.config import Config, ConfigError
from rlhf.train.evaluation import (flat_metrics, generation_rows, rollout_rows, run_summary, score_batch, summarize,
                                   val_sampling)
from rlhf.train.prompts import data_metrics, load_data, make_loader, prompt_batch, vlm_processor
from rlhf.train.async_rl import training_side
from rlhf.models.batch_invariant import step_metrics as invariant_step_metrics
from rlhf.train.distill import build_distiller
from rlhf.train.async_rl.staleness import skips_old_log_prob_pass, uses_rollout_log_probs as rollout_lp
from rlhf.train.over_sampling import over_sampling_for, with_row_lists
from rlhf.train.regroup import regroup_rows
from rlhf.train.rollout_corr import apply_rollout_correction


class RLTrainer:
    """GRPO / PPO-family trainer. Build once per process, then `fit()`."""

    def __init__(self, cfg: Config, *, dry_run: bool = False, roles=None):
        """``roles``: this process's :class:`rlhf.train.async_rl.roles.Roles` under trainer.mode one_step_off
        or fully_async (the trainer then runs on the training role's ranks and takes its batches from the rollout role)."""
        self.cfg = cfg
        self.env = roles.env if roles is not None else \
            init_distributed(cfg.trainer.device, timeout_s=cfg.trainer.collective_timeout_s)
        # Budgets halved after an out-of-memory end of an earlier attempt of this run (before anything is sized).
        self.oom_retries = apply_oom_records(cfg, cfg.trainer.max_oom_retries)
        torch.manual_seed(cfg.trainer.seed)
        self.dims = ParallelDims.resolve(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, self.env.world_size,
                                         sp=cfg.parallel.sp, ep=cfg.parallel.ep)
        self.dims.check_batch(train_batch_size=cfg.data.train_batch_size, n=cfg.rollout.n,
                              mini_batch_size=cfg.actor.ppo_mini_batch_size)
        self.mesh = roles.mesh if roles is not None else self.dims.build_mesh(self.env.device.type)
        self.group = self.env.group  # the ranks this trainer runs on (None: all)
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.dp_group = self.mesh["dp"].get_group()
        self.device = self.env.device
        self.out_dir = Path(cfg.trainer.output_dir)
        check_output_dir(cfg.trainer.output_dir)
        check_rollout_support(cfg.model.path, cfg.model.trust_remote_code,
                              cfg.data.max_prompt_length + cfg.data.max_response_length,
                              rollout_tp=cfg.rollout.tp, quantization=cfg.rollout.quantization,
                              announce=self.env.rank == 0)
        check_startup(cfg)  # the same checks a one-process --dry-run makes (rlhf/config/checks.py)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code,
                                        key="model.tokenizer_path" if cfg.model.tokenizer_path else "model.path")
        self.train_data = self._load_data(cfg.data.train_files, "data.train_files")
        self.val_data = self._load_data(cfg.data.val_files, "data.val_files") if cfg.data.val_files else None
        self.loader, self.total_steps = make_loader(cfg, len(self.train_data))
        # rollout.over_sample_rate: prompts given back wait in front of the loader (saved with its state)
        self.loader, self.over = over_sampling_for(cfg, self.loader, self.dp_rank, self.dims.dp, self.dp_group,
                                                   generates=roles is None)
        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.kl_coef,
                                         cfg.algorithm.kl_ctrl.target_kl, cfg.algorithm.kl_ctrl.horizon)
        self._print_setup()
        lm_config = language_config(model_config(cfg.model.path, cfg.model.trust_remote_code))
        validate_layout(cfg.parallel, lm_config, self.env.world_size,
                        rollout_tp=cfg.rollout.tp, train_batch_size=cfg.data.train_batch_size,
                        mini_batch_size=cfg.actor.ppo_mini_batch_size, n=cfg.rollout.n,
                        use_remove_padding=cfg.model.use_remove_padding)
        if dry_run:
            return
        # Watchdog, phase memory, profiler, MFU: started before the models load, which can hang too.
        self.ops = StepOps(cfg, self.env, lm_config, self.out_dir)  # MFU: the language model's FLOPs
        self.actor = PolicyWorker(cfg.model, self.mesh, self.device, trainable=True, actor_cfg=cfg.actor,
                                  total_steps=self.total_steps, parallel_cfg=cfg.parallel,
                                  batch_invariant=cfg.rollout.batch_invariant)
        self.actor.nonfinite.max_consecutive = cfg.trainer.max_nan_steps
        self.need_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        # With LoRA the reference is the actor with its adapters disabled: no second base copy.
        self.ref = PolicyWorker(cfg.model, self.mesh, self.device, trainable=False, parallel_cfg=cfg.parallel,
                                lora=False, actor_cfg=cfg.actor) if self.need_ref and cfg.model.lora_rank == 0 else None
        self.distill = build_distiller(cfg, self.mesh, self.device, self.tokenizer, self.train_data)  # teachers
        # Worker processes with a per-call timeout: a hung reward function scores 0 instead of hanging the job.
        self.scorer = make_scorer(cfg.reward.reward_fn, num_workers=cfg.reward.num_workers,
                                  timeout_s=cfg.reward.timeout_s, reward_kwargs=cfg.reward.reward_kwargs,
                                  mesh=self.mesh, manager=cfg.reward.reward_manager)
        self.reward_guard = FailedStepGuard(cfg.reward.max_failed_steps, cfg.reward.timeout_s, self.scorer)
        self.reward_model = None
        if cfg.reward.reward_model.enable:
            from rlhf.rewards.reward_model import RewardModelScorer

            self.reward_model = RewardModelScorer(cfg.reward.reward_model, self.mesh, self.device, self.tokenizer)
        self.rollout = RolloutEngine(cfg.rollout, self.tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                                     max_response_length=cfg.data.max_response_length, device=self.device,
                                     dtype=rollout_dtype(cfg.rollout.dtype, self.device.type, cfg.model.dtype),
                                     layout=roles.layout if roles is not None else
                                     RolloutLayout.build(cfg.rollout.tp, self.device.type, ep=cfg.rollout.ep,
                                                         exchange_timeout_s=cfg.trainer.exchange_timeout_s),
                                     lora=(cfg.model.lora_alpha, cfg.model.lora_rank) if cfg.model.lora_rank else None, record_routes=cfg.actor.router_replay != "R2")
        # Tool-using multi-turn rollouts: tools, their workers, a turn handler per generate call.
        self.agent = make_agent(cfg.rollout.multi_turn, self.tokenizer, self.rollout.layout)
        self.timer = PhaseTimer(self.device, listeners=self.ops.listeners)
        self.logger = MetricsLogger(self.out_dir, backends=cfg.trainer.logger, total_steps=self.total_steps,
                                    project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name,
                                    rank=self.env.rank, config=cfg.to_dict())
        self.global_step = 0
        self._streamed = None  # (StreamingScores, local rows) of the last generate, collected by score()
        # trainer.mode one_step_off / fully_async: the training side of the exchange with the rollout role
        self.offpolicy = None if roles is None else training_side(roles, cfg, self)

    # ------------------------------------------------------------------ setup helpers

    def _load_data(self, files, key: str):
        ds = load_data(self.cfg, files, self.tokenizer)
        if self.env.is_main:
            print(f"[rlhf] {key}: {ds.stats.summary()}", flush=True)
        return ds

    def _print_setup(self) -> None:
        if not self.env.is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        text = self.cfg.to_yaml()
        (self.out_dir / "config.yaml").write_text(text)
        print("[rlhf] resolved config:\n" + text, flush=True)
        print(f"[rlhf] world={self.env.world_size} layout dp={self.dims.dp} tp={self.dims.tp} pp={self.dims.pp} sp={self.dims.sp} ep={self.dims.ep} "
              f"device={self.device} backend={self.env.backend} steps={self.total_steps}", flush=True)

    # ------------------------------------------------------------------ phases

    def generate(self, step: int) -> tuple[RolloutBatch, dict]:
        """Next global prompt batch -> this rank's slice -> reshard + sample."""
        if self.over is not None:  # rollout.over_sample_rate: more started than needed (train/over_sampling.py)
            global_idx, local_rows = self.over.draw()
        else:
            global_idx = self.loader.next_batch()
            local_rows = minibatch_major_shard(list(range(len(global_idx))), self.dp_rank, self.dims.dp,
                                               self.cfg.actor.ppo_mini_batch_size)
        global_prompts = prompt_batch(global_idx, self.train_data.examples)
        prompts = global_prompts.subset(local_rows)
        self._last_prompts = prompts
        self._data_metrics = data_metrics(self.loader, global_idx)
        stream = self._stream_scores(global_prompts)
        self._streamed = (stream, local_rows) if stream is not None else None
        # The rollout layout splits the global batch over its replicas; rows come back to their dp rank.
        turns = self.agent.turns() if self.agent is not None else None
        batch, stats = self.rollout.generate(self.actor.model, self.actor.hf_config, global_prompts, step=step,
                                             n=self.cfg.rollout.n, temperature=self.cfg.rollout.temperature,
                                             local_rows=local_rows, pp_group=self.actor.pp_group, on_finished=stream,
                                             turns=turns, keep_groups=None if self.over is None else self.over.need)
        if self.over is not None:  # the first groups done, dealt like fresh prompts; the rest back to the data order
            batch, used, over_stats = self.over.settle(batch, global_idx, local_rows, self.cfg.rollout.n)
            batch, self._data_metrics = self.rebalance_groups(batch, self.over.need), data_metrics(self.loader, used)
            self._last_prompts = prompt_batch(list(dict.fromkeys(batch.index.tolist())), self.train_data.examples)
            stats.update(over_stats)
        if turns is not None:
            stats.update(self.agent.metrics(batch, turns, self.dp_group))
            if self.agent.executes:  # tool step rewards to the reward function's extra_info (verl)
                self.agent.attach_step_rewards(batch, turns, self.cfg.rollout.n, self.group)
        return batch, stats

    def _stream_scores(self, prompts) -> StreamingScores | None:
        """Scoring during generation needs a worker pool and each row generated once by a rank whose
        peers are all dp ranks (no shared scorer, rollout.tp = 1)."""
        if not self.cfg.reward.score_during_generation or not isinstance(self.scorer, RewardPool) \
                or self.rollout.layout.tp > 1 or (self.agent is not None and self.agent.executes) \
                or self.over is not None:  # over-sampling: the unused rows are never scored
            return None
        return StreamingScores(self.scorer, self.tokenizer, prompts)

    def collect_rollouts(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """generate + score; with DAPO `filter_groups`, keep generating until enough informative groups."""
        if self.offpolicy is not None:  # generated by the rollout role; scored here
            batch, metrics, global_idx = self.offpolicy.take(step)
            self._data_metrics = data_metrics(self.loader, global_idx)
            with self.timer("score"):
                metrics.update(self.score(batch))
            return batch, metrics
        fg = self.cfg.algorithm.filter_groups
        kept: list[RolloutBatch] = []
        n_gen = n_filtered = 0
        while True:
            n_gen += 1
            with self.timer("rollout"):
                batch, metrics = self.generate(step)
            with self.timer("score"):
                metrics.update(self.score(batch))
                if self.cfg.algorithm.adv_estimator == "remax":
                    metrics.update(self.remax_baseline(batch, step))
            if not fg.enable:
                return batch, metrics
            metric = batch.acc if fg.metric == "acc" else batch.token_level_scores.sum(-1)
            keep, _, filtered = select_informative_groups(batch.index, metric)
            kept.append(batch.select(keep.nonzero().squeeze(-1).cpu()))
            n_filtered += filtered
            n_groups = torch.tensor(float(sum(len(set(b.index.tolist())) for b in kept)), device=self.device)
            all_reduce_sum(n_groups, self.dp_group)
            if n_groups.item() >= self.cfg.data.train_batch_size:
                break
            if 0 < fg.max_num_gen_batches <= n_gen:
                raise RuntimeError(
                    f"algorithm.filter_groups: only {int(n_groups.item())} of {self.cfg.data.train_batch_size} prompt "
                    f"groups had varied '{fg.metric}' after {n_gen} generation batches "
                    f"(algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); raise the bound, "
                    f"increase rollout.n, or disable filter_groups")
        batch = self.rebalance_groups(RolloutBatch.concat(kept))
        filt = all_reduce_sum(torch.tensor(float(n_filtered), device=self.device), self.dp_group)
        metrics.update({"dynamic_sampling/gen_batches": float(n_gen), "dynamic_sampling/filtered_groups": float(filt),
                        "dynamic_sampling/kept_groups": n_groups.item()})
        return batch, metrics

    def rebalance_groups(self, batch: RolloutBatch, keep: int = 0) -> RolloutBatch:
        """Exactly ``keep`` (default train_batch_size) kept groups, dealt to dp ranks mini-batch-major (like fresh
        prompts). Rows move with tensor collectives (rlhf/train/regroup.py); the per-row lists are rebuilt here."""
        out = regroup_rows(batch, keep_groups=keep or self.cfg.data.train_batch_size, dp_rank=self.dp_rank,
                           dp=self.dims.dp, mini_batch_size=self.cfg.actor.ppo_mini_batch_size, group=self.dp_group)
        return with_row_lists(out, self.train_data.examples, self.tokenizer)

    def remax_baseline(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """ReMax: reward of the greedy response to each prompt is the baseline of its samples."""
        greedy, _ = self.rollout.generate(self.actor.model, self.actor.hf_config, self._last_prompts, step=step,
                                          n=1, temperature=0.0)
        res = self.scorer.score(greedy.response_texts, greedy.ground_truths, greedy.data_sources, greedy.extra_infos)
        by_prompt = dict(zip(greedy.index.tolist(), res.scores.tolist()))
        batch.reward_baselines = torch.tensor([by_prompt[i] for i in batch.index.tolist()], device=self.device)
        return self._global_means({"reward/remax_baseline_mean": batch.reward_baselines.sum()}, len(batch))

    def score(self, batch: RolloutBatch) -> dict[str, float]:
        """Rule-based rewards on the last response token, plus DAPO overlong shaping."""
        # A phase of its own: rank-local user code, so the watchdog sees the ranks that finished it waiting.
        streamed, self._streamed = self._streamed, None
        with self.timer("reward_fn"):
            if streamed is not None:  # submitted while generating: collect
                stream, local_rows = streamed
                res = stream.collect(local_rows, self.cfg.rollout.n, self.rollout.layout.dp_group)
            else:
                res = self.scorer.score(batch.response_texts, batch.ground_truths, batch.data_sources,
                                        batch.extra_infos)
        scores = res.scores.to(self.device)
        acc = torch.tensor(res.extra_metrics["acc"], device=self.device) if "acc" in res.extra_metrics \
            else (scores >= 1.0).float()
        sums = {"reward/score_mean": scores.sum(), "reward/errors": float(res.n_errors), "reward/timeouts":
                float(res.n_timeouts), "reward/untried": float(res.n_untried), "reward/samples": float(len(batch))}
        r = self.cfg.reward
        if self.reward_model is not None:
            rm_scores = self.reward_model.score(batch).to(self.device).float()  # [N]
            sums["reward/rm_score_mean"] = rm_scores.sum()
            scores = rm_scores if r.reward_model.combine == "replace" else scores + rm_scores
        if r.overlong_buffer_enable:  # on the trajectory length, tool outputs included (see reward_shaping)
            penalty = overlong_reward_penalty(batch.trajectory_lengths(),
                                              max_response_length=self.cfg.data.max_response_length,
                                              overlong_buffer_len=r.overlong_buffer_len,
                                              penalty_factor=r.overlong_penalty_factor)
            scores = scores + penalty
            sums["reward/overlong_penalty"] = penalty.sum()
        batch.token_level_scores = place_reward_on_last_token(scores, batch.response_mask)
        batch.acc = acc
        if self.cfg.trainer.rollout_data_dir:  # verl's rollout dump: <dir>/<step>.jsonl
            rows = rollout_rows(batch, scores.tolist(), res.extra_metrics, self.train_data.examples, self.timer.step)
            rows = [row for piece in all_gather_object(rows, self.dp_group) for row in piece]
            if self.env.is_main:
                Path(self.cfg.trainer.rollout_data_dir).mkdir(parents=True, exist_ok=True)
                with (Path(self.cfg.trainer.rollout_data_dir) / f"{self.timer.step}.jsonl").open("a") as f:
                    f.writelines(json.dumps(row) + "\n" for row in rows)
        if self.cfg.algorithm.gdpo_reward_keys:
            batch.reward_components = reward_components(res, self.cfg.algorithm.gdpo_reward_keys).to(self.device)
        # The reward dict's other numeric keys: means over every dp rank's samples that reported them.
        metrics = mean_of_sums(all_gather_object(res.metric_sums(), self.dp_group))
        metrics.update(self._global_means(sums, len(batch), totals=("reward/errors", "reward/timeouts",
                                                                    "reward/untried", "reward/samples")))
        failed = metrics["reward/errors"] + metrics["reward/timeouts"]
        if failed and self.env.is_main:
            where = f"; first on this rank: {res.first_error}" if res.first_error else ""
            print(f"[rlhf] reward function failed on {int(metrics['reward/errors'])} samples and timed out on "
                  f"{int(metrics['reward/timeouts'])} (scored 0; {int(metrics['reward/untried'])} not tried){where}",
                  flush=True)
        self.reward_guard.update(metrics["reward/errors"], metrics["reward/timeouts"], metrics.pop("reward/samples"))
        return metrics

    def _global_means(self, sums: dict, n_rows: int, totals: tuple[str, ...] = ()) -> dict[str, float]:
        """Per-row sums on this rank -> means over every dp rank's rows (``totals``: global sums), so the
        logged value does not depend on the layout. One all-reduce."""
        keys = list(sums)
        t = torch.tensor([float(sums[k]) for k in keys] + [float(n_rows)], dtype=torch.float64, device=self.device)
        all_reduce_sum(t, self.dp_group)
        n = max(float(t[-1]), 1.0)
        return {k: float(t[i]) if k in totals else float(t[i]) / n for i, k in enumerate(keys)}

    def compute_log_probs(self, batch: RolloutBatch) -> dict[str, float]:
        """Old log-probs of the actor (training layout) and reference log-probs."""
        a, mask, T = self.cfg.actor, batch.response_mask, self.cfg.rollout.temperature or 1.0
        if skips_old_log_prob_pass(self.cfg, self.actor):  # the sampler's log-probs are the old policy's
            batch.old_log_probs, metrics = batch.rollout_log_probs, {"rollout/logprob_diff_max": 0.0}
        else:
            old, entropy = self.actor.compute_log_probs(batch, temperature=T, compute_entropy=True, record_routes=True,
                                                        micro_batch_size=a.log_prob_micro_batch_size_per_gpu)
            batch.old_log_probs = batch.rollout_log_probs if rollout_lp(self.cfg) else old
            diff = ((batch.old_log_probs - batch.rollout_log_probs).abs() * mask).max()
            if dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=self.dp_group)
            metrics = {"actor/entropy": self._global_masked_mean(entropy, mask), "rollout/logprob_diff_max": float(diff)}
            if self.cfg.rollout.batch_invariant:  # exactly 0 unless a kernel broke the mode (then a warning)
                metrics.update(invariant_step_metrics(float(diff), self.actor.hf_config.model_type, self.device.type))
        if self.cfg.algorithm.adv_estimator in TOKEN_BASELINE_ESTIMATORS:
            batch.sum_pi_squared = self.actor.compute_sum_pi_squared(
                batch, temperature=T, micro_batch_size=a.log_prob_micro_batch_size_per_gpu)
        if self.need_ref:
            if self.ref is not None:
                ref_lp, _ = self.ref.compute_log_probs(batch, temperature=T,
                                                       micro_batch_size=a.log_prob_micro_batch_size_per_gpu)
            else:
                with reference_context(self.actor.model):
                    ref_lp, _ = self.actor.compute_log_probs(batch, temperature=T,
                                                             micro_batch_size=a.log_prob_micro_batch_size_per_gpu)
            batch.ref_log_probs = ref_lp
            kl = kl_penalty(batch.old_log_probs, batch.ref_log_probs, a.kl_loss_type)
            metrics["actor/kl_to_ref"] = self._global_masked_mean(kl, mask)
        if self.distill is not None:
            metrics.update(self.distill.score(batch, temperature=T))
        return metrics

    def _global_masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        s = all_reduce_sum(torch.stack([(x * mask).sum(), mask.sum()]).double(), self.dp_group)
        return float(s[0] / s[1].clamp(min=1))

    def compute_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        alg = self.cfg.algorithm
        metrics = {}
        if alg.use_kl_in_reward:
            batch.token_level_rewards, kl_metrics = apply_kl_penalty(
                batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
                kl_coef=self.kl_ctrl.value, kl_penalty=alg.kl_penalty)
            metrics.update({f"kl_penalty/{k}": float(v) for k, v in kl_metrics.items()})
            # The controller must see the global mean KL so that every rank keeps one coefficient.
            kl = all_reduce_sum(torch.tensor([float(kl_metrics["kl"]) * len(batch), float(len(batch))],
                                             dtype=torch.float64, device=self.device), self.dp_group)
            metrics["kl_penalty/kl"] = float(kl[0] / kl[1])
            metrics["kl_penalty/coef"] = self.kl_ctrl.value
        else:
            batch.token_level_rewards = batch.token_level_scores
        # after the in-reward KL and before the estimator, as verl's ray_trainer
        metrics.update(apply_rollout_correction(batch, self.cfg.actor, self.dp_group))
        fn = get_adv_estimator(alg.adv_estimator)
        batch.advantages, batch.returns = fn(
            token_level_rewards=batch.token_level_rewards, response_mask=batch.response_mask, index=batch.index,
            values=batch.values, reward_baselines=batch.reward_baselines, gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, whiten=make_global_whiten(self.dp_group),
            global_sum=lambda t: all_reduce_sum(t, self.dp_group), reward_components=batch.reward_components,
            reward_weights=alg.gdpo_reward_weights, old_log_probs=batch.old_log_probs,
            sum_pi_squared=batch.sum_pi_squared, rollout_is_weights=self._rollout_is_weights(batch),
            teacher_log_probs=batch.teacher_log_probs)
        metrics.update(self.distill.shape_advantages(batch) if self.distill is not None else {})
        if alg.filter_truncated:
            batch.response_mask = batch.response_mask * (~batch.truncated).float().unsqueeze(-1)
        adv = all_reduce_sum(torch.stack([(batch.advantages * batch.response_mask).sum(),
                                          batch.response_mask.sum()]).double(), self.dp_group)
        metrics["advantage/mean"] = float(adv[0] / adv[1].clamp(min=1))
        return metrics

    def _rollout_is_weights(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Truncated rollout IS weights [N, R] under rollout correction (bypass_mode with actor.rollout_is),
        for the estimators that use them (the optimal token baselines)."""
        a = self.cfg.actor
        if batch.rollout_is_weights is not None:  # decoupled mode (rlhf/train/rollout_corr.py)
            return batch.rollout_is_weights
        if a.policy_loss != "bypass_mode" or not a.rollout_is or batch.old_log_probs is None:
            return None
        return rollout_is_weights(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, a.rollout_is,
                                  a.rollout_is_threshold)

    def compute_values(self, batch: RolloutBatch) -> dict[str, float]:
        """Critic values [N, R]; none in critic-free algorithms (PPOTrainer overrides)."""
        return {}

    def update_critic(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """Critic update; none in critic-free algorithms (PPOTrainer overrides)."""
        return {}

    def update_actor(self, batch: RolloutBatch) -> dict[str, float]:
        a = self.cfg.actor
        mini_rows = a.ppo_mini_batch_size * self.cfg.rollout.n // self.dims.dp
        return self.actor.update_policy(batch, mini_batch_rows=mini_rows, temperature=self.cfg.rollout.temperature or 1.0,
                                        max_response_length=self.cfg.data.max_response_length,
                                        old_log_probs_current=not rollout_lp(self.cfg))

    # ------------------------------------------------------------------ one step

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.timer.step = step
        self.ops.begin_step(step)
        batch, metrics = self.collect_rollouts(step)
        with self.timer("logprobs"):
            metrics.update(self.compute_log_probs(batch))
            metrics.update(self.compute_values(batch))
        with self.timer("advantage"):
            metrics.update(self.compute_advantages(batch))
        with self.timer("update"):
            metrics.update(self.update_critic(batch, step))
            if step > self.cfg.algorithm.critic_warmup:
                metrics.update(self.update_actor(batch))
        if self.cfg.algorithm.use_kl_in_reward and "kl_penalty/kl" in metrics:
            update_kl_controller(self.kl_ctrl, metrics["kl_penalty/kl"], self.cfg.data.train_batch_size, self.cfg.rollout.n)
        if self.offpolicy is not None:
            with self.timer("async_exchange"):  # next batch in, these weights out
                metrics.update(self.offpolicy.after_update(step, batch, self.actor.model, self.loader))
        metrics.update(self.timer.pop())
        metrics.update(self.batch_metrics(batch))
        metrics.update(getattr(self, "_data_metrics", {}))
        elapsed = time.perf_counter() - t0
        metrics["timing/step"] = elapsed
        metrics["oom/retries"] = float(self.oom_retries)
        metrics.update(self.ops.end_step(step, batch, metrics, self.dp_group))  # perf/*: MFU, tokens/s, memory
        return metrics

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """Global reward / length statistics (summed over dp, so layout-independent).

        ``response_length/*`` is the trajectory length (tool outputs included, as verl);
        ``response_length/generated_mean`` counts only the policy's own (loss) tokens."""
        lengths = batch.trajectory_lengths().float()
        seq_scores = batch.token_level_scores.sum(-1)
        stats = torch.stack([seq_scores.sum(), (seq_scores ** 2).sum(), lengths.sum(), batch.acc.nan_to_num(0).sum(),
                             batch.truncated.float().sum(), torch.tensor(float(len(batch)), device=self.device),
                             batch.generated_lengths().sum()]).double()
        all_reduce_sum(stats, self.dp_group)
        mx = lengths.max().clone()
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=self.dp_group)
        n = stats[5]
        mean = stats[0] / n
        return {"reward/mean": float(mean), "reward/std": float((stats[1] / n - mean ** 2).clamp(min=0).sqrt()),
                "reward/acc": float(stats[3] / n), "response_length/mean": float(stats[2] / n),
                "response_length/max": float(mx), "response_length/clip_ratio": float(stats[4] / n),
                "response_length/generated_mean": float(stats[6] / n)}

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """pass@1 / pass@k / maj@k (trainer.val_kwargs sampling) on the whole held-out set, split over dp ranks."""
        if self.val_data is None:
            return {}
        idx = list(range(self.dp_rank, len(self.val_data), self.dims.dp))
        prompts = prompt_batch(idx, self.val_data.examples)
        turns = self.agent.turns() if self.agent is not None else None
        try:
            with self.timer("validate"):
                batch, stats = self.rollout.generate(self.actor.model, self.actor.hf_config, prompts, step=step,
                                                     turns=turns, **val_sampling(self.cfg))
        except torch.OutOfMemoryError:
            self.end_after_oom(step)
        seconds = self.timer.pop()  # between steps: its own figure, not added to the next step's timings
        mine = score_batch(self.scorer, batch)
        records = [r for piece in all_gather_object(mine, self.dp_group) for r in piece]
        text = {i: self.val_data.examples[i].prompt_text for i in idx}
        self.logger.log_generations(step, generation_rows(mine, batch, text, self.cfg.trainer.log_val_generations,
                                                          self.dp_group))
        agent = self.agent.metrics(batch, turns, self.dp_group, prefix="val/agent/") if turns is not None else {}
        return {**flat_metrics(summarize(records), "val"), "timing/validate_generate": stats["timing/generate"],
                **seconds, **agent}

    # ------------------------------------------------------------------ checkpoints

    def _stateful(self) -> dict:
        """DCP Statefuls to checkpoint; subclasses add theirs (e.g. "critic")."""
        return {"actor": ModelOptimState(self.actor.model, self.actor.optimizer)}

    def trainer_state(self) -> dict:
        """JSON-able state; subclasses extend it and `load_trainer_state`."""
        return {"global_step": self.global_step, "loader": self.loader.state_dict(),
                "actor_scheduler": self.actor.scheduler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "skipped_steps": self.actor.nonfinite.skipped,
                **({"fully_async": self.offpolicy.trainer_state()} if hasattr(self.offpolicy, "trainer_state") else {})}

    def load_trainer_state(self, st: dict) -> None:
        self.global_step = st["global_step"]
        self.loader.load_state_dict(st["loader"])
        self.actor.scheduler.load_state_dict(st["actor_scheduler"])
        self.kl_ctrl.load_state_dict(st["kl_ctrl"])
        self.actor.nonfinite.skipped = st.get("skipped_steps", 0)
        if "fully_async" in st and hasattr(self.offpolicy, "load_trainer_state"):
            self.offpolicy.load_trainer_state(st["fully_async"])

    def save(self) -> None:
        path = save_checkpoint(str(self.out_dir), self.global_step, self._stateful(), self.trainer_state(),
                               max_to_keep=self.cfg.checkpoint.max_to_keep, group=self.group,
                               rank_state=self.offpolicy.rank_state() if self.offpolicy is not None else None)
        self._saved_at = self.global_step
        if self.env.is_main:
            print(f"[rlhf] checkpoint saved: {path}", flush=True)

    def maybe_resume(self) -> None:
        path = find_resume_path(self.cfg.checkpoint.resume, str(self.out_dir), group=self.group)
        if path is None:
            return
        try:
            self.load_trainer_state(load_checkpoint(path, self._stateful(), group=self.group))
        except ValueError as e:  # the data loader's: another batch size, seed or dataset
            raise ConfigError(f"checkpoint.resume: checkpoint {path}: {e}; resume with the settings it was "
                              f"written with, or start a new trainer.output_dir") from None
        if self.offpolicy is not None:
            self.offpolicy.load_rank_state(load_rank_state(path))
        if self.env.is_main:
            print(f"[rlhf] resumed from {path} at step {self.global_step}", flush=True)

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        self.maybe_resume()
        self.logger.mark_start(self.global_step)
        first_val = {}
        if self.val_data is not None and cfg.val_before_train and self.global_step == 0:
            first_val = self.validate(0)
            self.logger.log(0, first_val)
        if self.offpolicy is not None:
            self.offpolicy.start(self.global_step, self.actor.model, self.loader)
        # A resumed run's summary compares with what earlier processes logged (step-0 and last validation).
        first_val = first_val or self.logger.logged(0, "val/acc")
        last = self.logger.logged(self.global_step, "val/acc")
        start = self.global_step
        while self.global_step < self.total_steps:
            if 0 <= cfg.stop_after_steps <= self.global_step - start:
                ck = self.cfg.checkpoint  # saved at the stop (colocated), so the next job loses no step
                if self.offpolicy is None and getattr(self, "_saved_at", start) != self.global_step and \
                        (ck.save_freq > 0 or ck.save_final):
                    self.save()
                if self.env.is_main:
                    print(f"[rlhf] stopping after {cfg.stop_after_steps} steps in this run "
                          f"(trainer.stop_after_steps); resume continues from the last checkpoint", flush=True)
                self.close()
                return {}
            step = self.global_step + 1
            try:
                metrics = self.train_step(step)
            except torch.OutOfMemoryError:
                self.end_after_oom(step)
            self.global_step = step
            is_last = step == self.total_steps
            if self.val_data is not None and ((cfg.test_freq > 0 and step % cfg.test_freq == 0) or is_last):
                metrics.update(self.validate(step))
            self.logger.log(step, metrics)
            last = metrics
            ck = self.cfg.checkpoint
            if (ck.save_freq > 0 and step % ck.save_freq == 0) or (is_last and ck.save_final):
                self.save()
        summary = self.summarize(first_val, last)
        if self.cfg.checkpoint.export_hf:
            # a VLM's processor (its tokenizer included): the export loads with AutoProcessor
            export_hf(self.actor.model, vlm_processor(self.cfg) or self.tokenizer, str(self.out_dir / "hf_export"),
                      group=self.group)
        self.close()
        return summary

    def end_after_oom(self, step: int) -> NoReturn:
        """Record the phase, end every rank at once; the restarted job halves that phase's budget."""
        self.ops.abort(record_oom(self.out_dir, rank=self.env.rank, phase=self.timer.failed_phase or "unknown",
                                  step=step, attempt=self.oom_retries))

    def close(self) -> None:
        """End the run's side components (logger backends, reward workers, watchdog, profiler)."""
        self.logger.close()
        self.scorer.close()
        if self.agent is not None:
            self.agent.close()
        self.ops.close()

    def summarize(self, first_val: dict, last: dict) -> dict[str, float]:
        summary = run_summary(self.global_step, first_val, last)
        self.logger.log(self.global_step, summary)
        if self.env.is_main:
            print("[rlhf] final summary: " + ", ".join(f"{k}={v:.4f}" for k, v in summary.items()), flush=True)
        return summary
