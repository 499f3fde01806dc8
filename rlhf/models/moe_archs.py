"""The mixture-of-experts families beyond Qwen3-MoE: what each changes, and the sampler pieces they add.

All of them store their experts fused as transformers 5.x does (``mlp.experts.gate_up_proj``
``[E, 2I, hidden]``, gate rows then up rows; ``mlp.experts.down_proj`` ``[E, hidden, I]``), route with
``mlp.gate`` (``[E, hidden]``, softmax in fp32 then top-k) and call ``mlp.experts(x, top_i, top_w)``,
so the experts over tp (``rlhf.models.tensor_parallel.ExpertsOverTP``), over ep
(``rlhf.models.expert_parallel``) and in the sampler (``rlhf.models.moe.experts``) are shared:

==========  ==========================================================================================
family      differences (transformers 5.x modeling code)
==========  ==========================================================================================
qwen2_moe   Qwen2 attention (q/k/v bias; sliding windows on the layers ``layer_types`` marks);
            ``norm_topk_prob`` (False in the released models); a shared expert beside the routed ones:
            ``y += sigmoid(x . shared_expert_gate) * down(act(gate(x)) * up(x))`` (``mlp.shared_expert.*``,
            width ``shared_expert_intermediate_size``); ``mlp_only_layers`` / ``decoder_sparse_step``
mixtral     Mistral attention (sliding window on every layer when ``sliding_window`` is set); the top-k
            weights always renormalised (no ``norm_topk_prob`` key); experts of ``intermediate_size``;
            ``router_jitter_noise`` only multiplies the inputs in training mode (0 in the released
            models; refused otherwise: the sampler and the trainer's eval-mode forwards would differ)
olmoe       RMSNorm of the WHOLE q and k projections (``q_norm [H * D]``, ``k_norm [Hkv * D]``, one
            norm over all heads of a token, before rope), optional ``clip_qkv`` clamp of q, k, v after
            it; ``norm_topk_prob`` False; experts of ``intermediate_size``
==========  ==========================================================================================

deepseek_v3 (``rlhf.models.deepseek_v3``, ``rlhf.models.mla``): multi-head latent attention; a sigmoid router
whose selection adds ``e_score_correction_bias`` and is limited to ``topk_group`` of ``n_group`` expert groups,
weights ``routed_scaling_factor`` x the (renormalised) sigmoid scores of the chosen experts; an ungated shared
expert ``mlp.shared_experts`` of width ``n_shared_experts x moe_intermediate_size``; the first
``first_k_dense_replace`` layers dense; ``n_routed_experts`` experts (no ``num_experts`` key: :func:`num_experts`).

GPT-OSS (attention sinks, alternating sliding / full layers, expert biases, the clamped SwiGLU, a
router with bias and top-k before the softmax): ``rlhf.models.gpt_oss``.

Tensor parallelism of OLMoE's whole-projection norm: the trainer gathers the q/k/v projections
(Phi-3's plan, ``rlhf.models.tensor_parallel``); the sampler keeps its head slices and all-reduces
the per-token sums of squares over tp (:func:`full_qk_norm`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rlhf.models.gpt_oss import GPT_OSS_TYPES

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", *GPT_OSS_TYPES, "deepseek_v3")
FULL_QK_NORM_TYPES = ("olmoe",)


def num_experts(config: Any) -> int:
    """Routed experts of a MoE config (DeepSeek-V3 names them ``n_routed_experts``); 0 for a dense one."""
    return int(getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 0)


def is_moe(config: Any) -> bool:
    """Whether ``config`` is one of the supported mixture-of-experts families with experts."""
    return getattr(config, "model_type", None) in MOE_MODEL_TYPES and bool(num_experts(config))


def check_config(config: Any) -> None:
    """Refuse what the sampler would compute differently from HF (one line, NotImplementedError)."""
    if getattr(config, "model_type", None) == "mixtral" and getattr(config, "router_jitter_noise", 0.0):
        raise NotImplementedError(f"mixtral: router_jitter_noise={config.router_jitter_noise} is not supported "
                                  "(it makes training forwards random); set it to 0")


def shared_expert(x: Tensor, gate_up: Tensor, down: Tensor, gate: Optional[Tensor],
                  act: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Qwen2-MoE's gated shared expert ``sigmoid(x gate^T) * down(act(gate_x) * up_x)`` (DeepSeek-V3's
    ``gate=None``: ungated).

    Args:
        x: ``[M, hidden]``; gate_up: ``[2 I_s, hidden]`` (gate rows then up rows; under tp this rank's
            columns of each); down: ``[hidden, I_s]`` (under tp its columns: the result is a partial sum
            that the caller all-reduces with the experts'); gate: ``[1, hidden]`` (replicated).
    Returns:
        ``[M, hidden]``.
    """
    h = F.linear(x, gate_up)
    i = h.shape[-1] // 2
    y = F.linear(act(h[:, :i], h[:, i:]), down)
    return y if gate is None else torch.sigmoid(F.linear(x, gate)) * y


def _local_part(w: Tensor, n: int, tp_group: Any) -> Tensor:
    """This tp rank's ``n`` entries of a full norm weight, following the projection rows it holds
    (a rollout wider than the KV heads gives ``tp / parts`` ranks the same head: ``rlhf.rollout.reshard``)."""
    if w.shape[0] == n:
        return w
    parts = w.shape[0] // n
    rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    return w.narrow(0, (rank // (tp // parts)) * n, n)


def full_qk_norm(qkv: Tensor, q_w: Tensor, k_w: Tensor, q_len: int, k_len: int, eps: float,
                 tp_group: Optional[Any] = None) -> Tensor:
    """OLMoE's q / k RMSNorm over the whole projection of each token: ``qkv [M, q_len + k_len + v]``
    (this rank's q heads, k heads, v heads) -> the same with q and k normed (v untouched).

    Under tp the sums of squares of each token's local q and k are all-reduced; the mean divides by
    ``tp * local length``, which is the full length, or with replicated KV heads (``r`` ranks per head)
    ``r`` times it, as the all-reduced sum is then ``r`` times the full one. HF's fp32 normalisation,
    cast back, then the weight (``q_w [H * D]``, ``k_w [Hkv * D]``, full: this rank's part is taken here).
    """
    q, k, v = qkv.split([q_len, k_len, qkv.shape[-1] - q_len - k_len], dim=-1)
    qf, kf = q.float(), k.float()
    sums = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)])  # [2, M]
    tp = 1
    if tp_group is not None:
        dist.all_reduce(sums, group=tp_group)
        tp = dist.get_world_size(tp_group)
    qn = (qf * torch.rsqrt(sums[0] / (tp * q_len) + eps)[:, None]).to(q.dtype)
    kn = (kf * torch.rsqrt(sums[1] / (tp * k_len) + eps)[:, None]).to(k.dtype)
    if tp_group is not None:
        q_w, k_w = _local_part(q_w, q_len, tp_group), _local_part(k_w, k_len, tp_group)
    return torch.cat((q_w * qn, k_w * kn, v), dim=-1)
