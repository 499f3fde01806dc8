"""DAPO dynamic sampling (Yu et al. 2025, eq. 11): drop groups that carry no learning signal.

A group whose responses all got the same metric (all correct or all wrong) has zero GRPO
advantage and contributes no gradient; DAPO keeps sampling until the batch is filled with
informative groups.  This module only decides which samples to keep; the trainer refills.
Matches verl's ``algorithm.filter_groups``: keep groups with ``std > 0`` or of size one.
"""

from __future__ import annotations

import torch

from rlhf.algos.advantages import GroupIndex, group_ids

__all__ = ["select_informative_groups"]


@torch.no_grad()
def select_informative_groups(index: GroupIndex, metric: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Select the samples of groups whose ``metric`` varies.

    Args:
        index: group id (prompt uid) per sample ``[B]``.
        metric: the filter metric per sample ``[B]`` (verl's ``filter_groups.metric``, e.g. the
            sequence score or accuracy).

    Returns:
        ``(keep [B] bool, num_kept_groups, num_filtered_groups)``.  A group is kept when its
        values are not all equal (population std > 0) or when it has a single sample.
    """
    metric = metric.reshape(-1)
    if len(index) != metric.shape[0]:
        raise ValueError(f"`index` has {len(index)} entries but `metric` has {metric.shape[0]}")
    gid, n_groups = group_ids(index, metric.device)
    values = metric.double()
    empty = values.new_zeros(n_groups)
    max_g = empty.scatter_reduce(0, gid, values, reduce="amax", include_self=False)
    min_g = empty.scatter_reduce(0, gid, values, reduce="amin", include_self=False)
    count_g = empty.index_add(0, gid, torch.ones_like(values))
    keep_g = (max_g != min_g) | (count_g == 1)
    n_kept = int(keep_g.sum())
    return keep_g[gid], n_kept, n_groups - n_kept
