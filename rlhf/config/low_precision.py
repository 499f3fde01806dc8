"""Low-precision settings resolved and checked at load time: FP8 rollout (``rollout.quantization``) and
FP8 training (``actor.fp8``).

FP8 rollout samples from a quantized copy of the policy, so the sampler's log-probs differ from the
trainer's more than a bf16 rollout's do. verl's FP8 recipes pair it with token-level truncated
importance sampling at cap 2 (verl docs/advance/fp8.md: accuracy drops without it); here that is
``actor.rollout_is_decoupled`` with ``actor.rollout_is=token`` and ``actor.rollout_is_threshold=2``,
turned on unless the config already corrects (TIS, decoupled IS, AReaL's decoupled loss), uses
``bypass_mode`` (whose ratio is already to the rollout policy), or opts out with ``actor.rollout_is=''``.
"""

from __future__ import annotations

from rlhf.schema.config import Config, ConfigError


def resolve_low_precision(cfg: Config) -> list[str]:
    """Fill the defaults FP8 rollout implies (in place); returns one note per setting changed."""
    notes: list[str] = []
    a = cfg.actor
    if cfg.rollout.quantization == "fp8" and a.rollout_is and not a.corrects_off_policy \
            and a.policy_loss != "bypass_mode":
        a.rollout_is_decoupled = True
        notes.append(f"rollout.quantization=fp8: actor.rollout_is_decoupled=true ({a.rollout_is} IS weights capped "
                     f"at actor.rollout_is_threshold={a.rollout_is_threshold}; actor.rollout_is='' turns it off)")
    return notes


def check_low_precision(cfg: Config) -> None:
    """One-line refusals of the low-precision settings the config alone can judge (the device's FP8 support
    is checked where the model is built: ``rlhf.models.fp8_training``)."""
    if cfg.rollout.quantization and cfg.trainer.mode != "colocated":
        raise ConfigError(f"config key 'rollout.quantization': FP8 rollout is built for trainer.mode colocated, got "
                          f"{cfg.trainer.mode} (set rollout.quantization='' or trainer.mode=colocated)")
    if cfg.actor.fp8 and cfg.trainer.device == "cpu":
        raise ConfigError("config key 'actor.fp8': FP8 training needs a GPU with FP8 matmuls (sm89+); "
                          "trainer.device is cpu (set actor.fp8=false)")
    if cfg.actor.fp8_all_gather and not cfg.actor.fp8:
        raise ConfigError("config key 'actor.fp8_all_gather': all-gathers the FP8-trained weights; set actor.fp8=true")
