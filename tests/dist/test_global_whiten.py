"""Estimators with batch-wide statistics (whitening, counts) and the per-group token baselines
give the same advantages on 1 and 2 ranks."""

from __future__ import annotations

import torch

from rlhf.algos.advantages import get_adv_estimator
from rlhf.algos.masked import masked_whiten
from tests.dist._dist_utils import dist_device, run_distributed


def _data():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(8, 5, generator=g)
    mask = (torch.rand(8, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    return rewards * mask, mask, torch.arange(4).repeat_interleave(2)


def _extras():
    g = torch.Generator().manual_seed(2)
    return {"reward_components": torch.randint(0, 2, (8, 2), generator=g).float(), "reward_weights": [1.0, 0.5],
            "old_log_probs": -torch.rand(8, 5, generator=g), "sum_pi_squared": torch.rand(8, 5, generator=g)}


def _worker(rank: int, world: int) -> None:
    from rlhf.models.parallel import all_reduce_sum, make_global_whiten

    rewards, mask, index = (t.to(dist_device()) for t in _data())
    extras = {k: v.to(dist_device()) if isinstance(v, torch.Tensor) else v for k, v in _extras().items()}
    rows = slice(rank * 4, rank * 4 + 4)
    local_extras = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in extras.items()}
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo", "gpg", "optimal_token_baseline",
                 "tir_optimal_token_baseline"):
        fn = get_adv_estimator(name)
        full, _ = fn(token_level_rewards=rewards, response_mask=mask, index=index, **extras)
        local, _ = fn(token_level_rewards=rewards[rows], response_mask=mask[rows], index=index[rows],
                      whiten=make_global_whiten(), global_sum=all_reduce_sum, **local_extras)
        torch.testing.assert_close(local * mask[rows], full[rows] * mask[rows], rtol=1e-5, atol=1e-6)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1)).to(dist_device())
    torch.testing.assert_close(make_global_whiten()(x[rank * 4:rank * 4 + 4], mask[rank * 4:rank * 4 + 4]),
                               masked_whiten(x, mask)[rank * 4:rank * 4 + 4], rtol=1e-5, atol=1e-6)


def test_global_whitening_matches_full_batch():
    run_distributed(_worker, 2)
