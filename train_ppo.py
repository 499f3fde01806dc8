"""PPO with a critic (GAE) post-training of a causal LM, one SPMD program per rank.

Why a separate entry: PPO adds a value model (the critic) that is trained alongside the
policy. Both are FSDP2-sharded on the same mesh and colocated with the rollout (hybrid
engine); each step samples responses, scores them (rule-based reward and/or a reward
model), computes old/ref log-probs and critic values, GAE advantages (optionally with a
per-token KL penalty in the reward), then updates the critic and, after
`algorithm.critic_warmup` steps, the actor.

    python train_ppo.py --config configs/quickstart_ppo.yaml                  # 1 process
    torchrun --nproc_per_node=2 train_ppo.py --config configs/quickstart_ppo.yaml
    torchrun --nnodes=N --nproc_per_node=8 ... train_ppo.py --config configs/ppo_qwen2.5_0.5b_gsm8k.yaml

This is also the place of verl's `python3 -m verl.trainer.main_ppo ARGS`: verl's key names
are accepted (rlhf/config/verl.py), and as in verl a critic is trained only for
`algorithm.adv_estimator=gae`; a critic-free estimator (grpo, rloo, ...) runs as train_grpo.py.

The critic starts from `critic.model_path` (empty = the actor's checkpoint, fresh value
head; a `*ForSequenceClassification` reward model reuses its score head). Not included:
critic LoRA and padding-free critic passes (the critic always runs the padded path).
"""

import os

from rlhf.cli import train_main


def build_trainer(cfg, dry_run: bool = False, **kw):
    if cfg.algorithm.adv_estimator != "gae":
        from rlhf.train.trainer import RLTrainer

        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[rlhf] algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} needs no critic: training "
                  "without one, as train_grpo.py (verl's main_ppo does the same)", flush=True)
        return RLTrainer(cfg, dry_run=dry_run, **kw)
    from rlhf.train.ppo_trainer import PPOTrainer

    return PPOTrainer(cfg, dry_run=dry_run, **kw)


if __name__ == "__main__":
    train_main(__doc__, build_trainer)
