"""DeepSeek-V3's mixture of experts: the sigmoid, bias-corrected, group-limited router.

transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV3MoE`` (5.x), for ``x [M, hidden]``::

    s      = sigmoid(x W_router^T)            fp32 [M, E]     (router weight kept in fp32)
    c      = s + b                            b = e_score_correction_bias [E]: selection only
    g      = sum of the top-2 c of each of the n_group groups of E / n_group experts    [M, n_group]
    e      = top_k(c masked to the topk_group best groups)                              [M, k]
    w      = s[e] (/ (sum_j s[e_j] + 1e-20) when norm_topk_prob) * routed_scaling_factor
    y      = sum_j w_j expert_{e_j}(x) + shared_experts(x)          (shared: an ungated dense MLP)

The bias changes which experts are chosen, never the weights (DeepSeek's auxiliary-loss-free load
balancing); so routing replay (R3) replays the recorded ids, which the sampler chose with the bias, and
recomputes ``w`` from the live ``s`` (the router still gets gradients). The first
``first_k_dense_replace`` layers are dense. Attention (MLA) is ``rlhf.models.mla``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def moe_spec(cls: type, config: Any):
    """The ``rlhf.models.moe.MoESpec`` of a DeepSeek-V3 config."""
    n_group = config.n_group or 1
    if config.n_routed_experts % n_group:
        raise ValueError(f"deepseek_v3: n_routed_experts={config.n_routed_experts} must be divisible by "
                         f"n_group={n_group}")
    return cls(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
               norm_topk_prob=bool(config.norm_topk_prob), intermediate_size=config.moe_intermediate_size,
               sparse=tuple(i >= (config.first_k_dense_replace or 0) for i in range(config.num_hidden_layers)),
               shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
               scoring="sigmoid", n_group=n_group, topk_group=config.topk_group or 1,
               routed_scaling_factor=float(config.routed_scaling_factor))


def select(scores: Tensor, bias: Optional[Tensor], n_group: int, topk_group: int, top_k: int) -> Tensor:
    """Expert ids ``[M, k]``: top-k of ``scores + bias`` within the ``topk_group`` best groups (a group's
    score: the sum of its two best biased scores). ``scores`` ``[M, E]`` fp32."""
    choice = scores if bias is None else scores + bias.float()
    m, e = choice.shape
    if n_group > 1:
        group = choice.view(m, n_group, e // n_group).topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group).scatter_(1, torch.topk(group, topk_group, dim=-1, sorted=False)[1], 1.0)
        keep = keep.bool()[:, :, None].expand(m, n_group, e // n_group).reshape(m, e)
        choice = choice.masked_fill(~keep, float("-inf"))
    return torch.topk(choice, top_k, dim=-1, sorted=False)[1]


def weights(scores: Tensor, ids: Tensor, norm_topk_prob: bool, scaling: float) -> Tensor:
    """Routing weights ``[M, k]`` fp32 of the chosen ``ids``: their unbiased sigmoid scores."""
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling


def route(spec, x: Tensor, router_w: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The sampler's routing of ``x [M, hidden]`` (``spec``: a sigmoid ``MoESpec``) -> (weights ``[M, k]``
    fp32 as HF keeps them, ids ``[M, k]``)."""
    scores = torch.sigmoid(F.linear(x.float(), router_w.float()))
    ids = select(scores, bias, spec.n_group, spec.topk_group, spec.top_k)
    return weights(scores, ids, spec.norm_topk_prob, spec.routed_scaling_factor), ids


def is_router(gate: nn.Module) -> bool:
    return hasattr(gate, "e_score_correction_bias")


def replay_route(gate: nn.Module, h: Tensor, ids: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Routing replay through an HF ``DeepseekV3TopkRouter`` ``gate`` on ``h [M, hidden]``: ``(router
    logits [M, E] fp32, weights [M, k], ids used [M, k], live ids [M, k])``; a row of ``ids`` that is -1
    (or ``ids=None``) routes live. The weights are the live sigmoid scores of the ids used (differentiable)."""
    weight = gate.weight
    logits = F.linear(h.float(), weight.float())
    scores = logits.sigmoid()
    live = select(scores.detach(), gate.e_score_correction_bias, gate.num_group, gate.topk_group, gate.top_k)
    top_i = live if ids is None else torch.where(ids >= 0, ids.to(live.dtype), live)
    return logits, weights(scores, top_i, gate.norm_topk_prob, gate.routed_scaling_factor), top_i, live
