"""PPO with a critic (Ouyang et al. 2022; verl's PPO): the RL loop of RLTrainer plus a value model.

Per step, on top of the GRPO phases:

    values   V [N, R]   critic forward in the training layout (same positions as log-probs)
    rewards  r_t = score_t [last token] - beta KL_t      (algorithm.use_kl_in_reward)
    GAE      A_t = sum_l (gamma lam)^l delta_{t+l},  delta_t = r_t + gamma V_{t+1} - V_t
             R_t = A_t + V_t;  A whitened over the GLOBAL batch (all dp ranks)
    update   critic (clipped value loss) every step; actor (PPO clip) after critic_warmup

Whitening uses masked statistics all-reduced over dp (RLTrainer passes a global `whiten`
to the estimator), so the advantages, and hence the update, are the same for any dp size.
The in-reward KL fed to the adaptive controller is likewise the global mean, so every
rank keeps the same coefficient.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.algos.aggregation import LOSS_AGG_MODES
from rlhf.models.parallel import all_reduce_sum
from rlhf.schema.batch import RolloutBatch
from rlhf.schema.config import Config, ConfigError
from rlhf.train.checkpoint import ModelOptimState, export_hf
from rlhf.train.critic import CriticWorker
from rlhf.train.trainer import RLTrainer


def global_value_stats(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, group=None) -> dict[str, float]:
    """Explained variance ``1 - Var[R - V] / (Var[R] + 1e-5)`` and means over all ranks' tokens.

    Unbiased variances over masked tokens, as verl's ``critic/vf_explained_var``; fp64 sums.
    Shapes: ``[N, R]`` each.
    """
    m = mask.to(torch.float64)
    v = values.to(torch.float64) * m
    r = returns.to(torch.float64) * m
    d = r - v
    s = torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum(), v.sum()])
    all_reduce_sum(s, group)
    n, sr, srr, sd, sdd, sv = s.tolist()
    if n < 2:
        return {}
    var_r = (srr - sr * sr / n) / (n - 1)
    var_d = (sdd - sd * sd / n) / (n - 1)
    ev = 1.0 - var_d / (var_r + 1e-5)
    return {"critic/vf_explained_var": ev, "critic/explained_variance": ev,
            "critic/values/mean": sv / n, "critic/returns/mean": sr / n}


def check_ppo_config(cfg: Config) -> None:
    """PPO-specific settings that rlhf.config.checks.validate does not know about."""
    c, tb = cfg.critic, cfg.data.train_batch_size
    if cfg.algorithm.adv_estimator != "gae":
        raise ConfigError(f"config key 'algorithm.adv_estimator': train_ppo.py trains a critic for GAE, got "
                          f"{cfg.algorithm.adv_estimator!r}; set it to 'gae' or use train_grpo.py")
    if c.ppo_mini_batch_size <= 0 or tb % c.ppo_mini_batch_size != 0:
        raise ConfigError(f"config key 'critic.ppo_mini_batch_size': must be > 0 and divide data.train_batch_size "
                          f"({tb}), got {c.ppo_mini_batch_size}")
    for key, ok in (("ppo_micro_batch_size_per_gpu", c.ppo_micro_batch_size_per_gpu > 0),
                    ("ppo_epochs", c.ppo_epochs >= 1), ("cliprange_value", c.cliprange_value > 0),
                    ("grad_clip", c.grad_clip > 0), ("lr", c.lr >= 0)):
        if not ok:
            raise ConfigError(f"config key 'critic.{key}': must be > 0, got {getattr(c, key)!r}")
    if c.loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(f"config key 'critic.loss_agg_mode': unknown mode {c.loss_agg_mode!r}; "
                          f"valid: {', '.join(LOSS_AGG_MODES)}")


class PPOTrainer(RLTrainer):
    """RLTrainer + CriticWorker. Build once per process, then `fit()`."""

    def __init__(self, cfg: Config, *, dry_run: bool = False, roles=None):
        check_ppo_config(cfg)
        super().__init__(cfg, dry_run=dry_run, roles=roles)
        if cfg.critic.ppo_mini_batch_size % self.dims.dp != 0:
            raise ConfigError(f"impossible parallel layout: critic.ppo_mini_batch_size "
                              f"({cfg.critic.ppo_mini_batch_size}) is not divisible by dp ({self.dims.dp})")
        if (self.dims.dp > 1 and cfg.critic.ppo_mini_batch_size % cfg.actor.ppo_mini_batch_size != 0
                and self.env.is_main):
            # Ranks hold actor-mini-batch-major slices of the batch; other critic mini-batch sizes
            # still train correctly but group rows differently on different dp sizes.
            print(f"[rlhf] warning: critic.ppo_mini_batch_size ({cfg.critic.ppo_mini_batch_size}) is not a multiple "
                  f"of actor.ppo_mini_batch_size ({cfg.actor.ppo_mini_batch_size}); critic mini-batches then "
                  "depend on the dp layout", flush=True)
        local_rows = cfg.critic.ppo_mini_batch_size * cfg.rollout.n // self.dims.dp
        if self.dims.pp > 1 and local_rows % cfg.parallel.pp_microbatches:
            raise ConfigError(f"impossible parallel layout: the local critic mini-batch of critic.ppo_mini_batch_size "
                              f"x rollout.n / dp = {cfg.critic.ppo_mini_batch_size} x {cfg.rollout.n} / {self.dims.dp} "
                              f"= {local_rows} rows is not divisible by parallel.pp_microbatches="
                              f"{cfg.parallel.pp_microbatches}")
        self.critic = None
        if dry_run:
            return
        a = cfg.actor
        self.critic = CriticWorker(cfg.critic, cfg.model, self.mesh, self.device, total_steps=self.total_steps,
                                   max_response_length=cfg.data.max_response_length, parallel_cfg=cfg.parallel,
                                   use_dynamic_bsz=a.use_dynamic_bsz,
                                   forward_max_token_len=a.log_prob_max_token_len_per_gpu)
        self.critic.nonfinite.max_consecutive = cfg.trainer.max_nan_steps

    # ------------------------------------------------------------------ phases

    def compute_values(self, batch: RolloutBatch) -> dict[str, float]:
        batch.values = self.critic.compute_values(
            batch, micro_batch_size=self.cfg.critic.ppo_micro_batch_size_per_gpu)  # [N, R]
        return {}

    def compute_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        # GAE whitening and the in-reward KL mean are global in RLTrainer already.
        metrics = super().compute_advantages(batch)
        metrics.update(global_value_stats(batch.values, batch.returns, batch.response_mask, self.dp_group))
        return metrics

    def update_critic(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        mini_rows = self.cfg.critic.ppo_mini_batch_size * self.cfg.rollout.n // self.dims.dp
        return self.critic.update_critic(batch, mini_batch_rows=mini_rows)

    # ------------------------------------------------------------------ checkpoints / export

    def _stateful(self) -> dict:
        st = super()._stateful()
        st["critic"] = ModelOptimState(self.critic.model, self.critic.optimizer)
        return st

    def trainer_state(self) -> dict:
        st = super().trainer_state()
        st["critic_scheduler"] = self.critic.scheduler.state_dict()
        st["critic_skipped_steps"] = self.critic.nonfinite.skipped
        return st

    def load_trainer_state(self, st: dict) -> None:
        super().load_trainer_state(st)
        self.critic.scheduler.load_state_dict(st["critic_scheduler"])
        self.critic.nonfinite.skipped = st.get("critic_skipped_steps", 0)

    def fit(self) -> dict[str, float]:
        summary = super().fit()
        if self.cfg.checkpoint.export_hf and self.global_step >= self.total_steps:
            # A token-classification checkpoint: reloadable as critic.model_path of a later run.
            export_hf(self.critic.model, self.tokenizer, str(Path(self.cfg.trainer.output_dir) / "critic_hf_export"),
                      group=self.group)
        return summary
