"""GRPO (and its relatives) post-training of a causal LM, one SPMD program per rank.

Every rank runs this same script: the actor's FSDP2 shards are redistributed into a
rollout copy, the built-in KV-cache sampler draws `rollout.n` responses per prompt,
rule-based rewards score them, group-normalised advantages drive a PPO-clip update.

    python train_grpo.py --config configs/quickstart.yaml               # 1 process
    torchrun --nproc_per_node=2 train_grpo.py --config configs/quickstart.yaml
    torchrun --nnodes=4 --nproc_per_node=8 ... train_grpo.py --config x.yaml parallel.tp=2

Change the algorithm with `algorithm.adv_estimator` (grpo, rloo, reinforce_plus_plus, ...)
and the layout with `parallel.*`. PPO with a critic lives in train_ppo.py.
"""

from rlhf.cli import train_main


def build_trainer(cfg, dry_run: bool = False, **kw):
    from rlhf.schema.config import ConfigError
    from rlhf.train.trainer import RLTrainer

    if cfg.algorithm.adv_estimator == "gae":
        raise ConfigError("algorithm.adv_estimator 'gae' trains a critic: run train_ppo.py")
    return RLTrainer(cfg, dry_run=dry_run, **kw)


if __name__ == "__main__":
    train_main(__doc__, build_trainer)
