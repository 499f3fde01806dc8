"""Pure RL algorithm math: advantages, losses, KL, aggregation, reward shaping.

No distributed code here: every function is a pure tensor function tested with
hand-derived numbers.  Names and numbers follow verl's ``core_algos``.
"""

from rlhf.algos.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimatorFn,
    get_adv_estimator,
    register_adv_estimator,
)
from rlhf.algos.aggregation import LOSS_AGG_MODES, AggNorm, agg_loss
from rlhf.algos.dynamic_sampling import select_informative_groups
from rlhf.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
)
from rlhf.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf.algos.policy_loss import (
    POLICY_LOSS_REGISTRY,
    PolicyLossFn,
    PolicyLossParams,
    get_policy_loss,
    register_policy_loss,
)
from rlhf.algos import policy_loss_cov, policy_loss_pg, rollout_correction  # noqa: F401  (register their losses)
from rlhf.algos import optimal_token_baseline  # noqa: F401  (registers its estimators)
from rlhf.algos.reward_shaping import overlong_reward_penalty, place_reward_on_last_token
from rlhf.algos.value_loss import compute_value_loss, explained_variance

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AdvantageEstimatorFn",
    "get_adv_estimator",
    "register_adv_estimator",
    "LOSS_AGG_MODES",
    "AggNorm",
    "agg_loss",
    "select_informative_groups",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "entropy_from_logits",
    "get_kl_controller",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "POLICY_LOSS_REGISTRY",
    "PolicyLossFn",
    "PolicyLossParams",
    "get_policy_loss",
    "register_policy_loss",
    "overlong_reward_penalty",
    "place_reward_on_last_token",
    "compute_value_loss",
    "explained_variance",
]
