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

The critic starts from `critic.model_path` (empty = the actor's checkpoint, fresh value
head; a `*ForSequenceClassification` reward model reuses its score head). Not included:
critic LoRA and padding-free critic passes (the critic always runs the padded path).
"""

from rlhf.cli import train_main


def build_trainer(cfg, dry_run: bool = False, **kw):
    from rlhf.ppo_trainer import PPOTrainer

    return PPOTrainer(cfg, dry_run=dry_run, **kw)


if __name__ == "__main__":
    train_main(__doc__, build_trainer)
