"""Mixture-of-experts MLP (Qwen3-MoE), batched: no Python loop over tokens or experts.

Used by the rollout decoder (routing and experts) and by the trainer's tensor-parallel experts
(``rlhf.models.tensor_parallel``: HF routes, :func:`experts` runs this rank's experts).

Math of one sparse layer (transformers' ``Qwen3MoeSparseMoeBlock``), for ``x [M, hidden]``::

    p = softmax_fp32(x W_router^T)              [M, E]
    w, e = top_k(p)                             [M, k]   (w / sum(w) when norm_topk_prob)
    y[m] = sum_j w[m, j] * down_e(act(gate_e(x[m])) * up_e(x[m]))      e = e[m, j]

Dispatch: the ``M * k`` (token, expert) assignments are sorted by expert, so that each expert's
tokens are a contiguous block, and both projections run as ONE grouped matmul over all experts
(``torch.nn.functional.grouped_mm`` with the block offsets); the weighted results are put back
in assignment order and summed over the k experts of each token (the order transformers'
``grouped_mm`` experts path sums in). Shapes are static (sort, histogram by ``index_add_``,
offsets by ``cumsum``), so a decode step stays capturable in a CUDA graph where torch's
grouped_mm is sync-free (bf16 on sm90 / sm100: :func:`grouped_mm_mode`; the sampler decodes eagerly
elsewhere). Where grouped_mm cannot run (a CUDA GPU older than sm80, sizes whose rows are not
16-byte aligned), the blocks are multiplied one expert at a time instead (same result, one host sync).

Experts over tensor parallelism: a rank holds the experts ``[offset, offset + E_local)`` (the
weights' dim 0 is split over tp: ``rlhf.rollout.reshard``, ``rlhf.models.tensor_parallel``) and
every rank sees all tokens (the residual stream is replicated over tp). Assignments to other
ranks' experts are sorted past the last block, skipped by the grouped matmul and zeroed; the
partial outputs are summed over tp by the caller (the all-reduce a row-parallel ``down_proj``
would need anyway).

Router load-balancing (aux) loss: not added. The RL loss is built from per-token log-probs
only; transformers adds ``router_aux_loss_coef * aux`` only when ``labels`` are passed, which
the trainer never does, so ``output_router_logits`` changes nothing but memory. RL fine-tuning
starts from a trained router at a small learning rate; watch ``actor/grad_norm`` and the
rollout/trainer log-prob gap if a run drifts, rather than paying a balancing term on every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.models import deepseek_v3


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    intermediate_size: int  # per expert (moe_intermediate_size)
    sparse: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP
    shared_intermediate_size: int = 0  # Qwen2-MoE: the sigmoid-gated shared expert (0: none)
    # DeepSeek-V3's router (rlhf.models.deepseek_v3): sigmoid scores, biased group-limited selection
    scoring: str = "softmax"  # or "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_config(cls, config: Any) -> MoESpec:
        """Any family of ``rlhf.models.moe_archs`` (Mixtral / OLMoE name the per-expert width
        ``intermediate_size``; Mixtral always renormalises its top-k)."""
        from rlhf.models.moe_archs import num_experts

        if config.model_type == "deepseek_v3":
            return deepseek_v3.moe_spec(cls, config)
        n = num_experts(config)
        skip = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = tuple(i not in skip and n > 0 and (i + 1) % step == 0 for i in range(config.num_hidden_layers))
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        return cls(num_experts=n, top_k=config.num_experts_per_tok,
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)), intermediate_size=width,
                   sparse=sparse, shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0)

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.sparse)


def route(spec: MoESpec, x: Tensor, router_w: Tensor, router_b: Tensor | None = None,
          select_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-k routing ``x [M, hidden]`` -> (weights ``[M, k]`` in x's dtype, expert ids ``[M, k]``).
    ``router_b``: GPT-OSS's router bias (its softmax over the top-k logits is this renormalised top-k);
    DeepSeek-V3's sigmoid router (``select_bias``: its selection bias) in ``rlhf.models.deepseek_v3``."""
    if spec.scoring == "sigmoid":
        return deepseek_v3.route(spec, x, router_w, select_bias)
    logits = F.linear(x, router_w, router_b)  # [M, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


def grouped_mm_mode(dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None,
                    sizes: tuple[int, ...], has_grouped_mm: bool | None = None) -> str:
    """How ``torch.nn.functional.grouped_mm`` runs for these operands (a pure function: no device query).

    Returns ``"sync_free"`` (one kernel, offsets read on the device: capturable in a CUDA graph),
    ``"host_sync"`` (runs, but copies the offsets to the host first: torch's CUDA fallback, which
    fails inside graph capture) or ``"none"`` (cannot run: use the per-expert loop).

    torch's CUDA ``grouped_mm`` takes its sync-free kernel only for bf16 operands on sm90 / sm100;
    any other dtype, or sm80 / sm89 / sm120, goes through a fallback that moves ``offs`` to the host.
    Below sm80 it refuses. ``sizes``: the weights' row lengths (``out`` and ``in`` features), whose
    bytes must be multiples of 16 (the kernel's strides). ``capability``: ``(major, minor)`` on CUDA.
    """
    if has_grouped_mm is None:
        has_grouped_mm = hasattr(F, "grouped_mm")
    if not has_grouped_mm:
        return "none"
    elsize = torch.empty((), dtype=dtype).element_size()
    if any(int(n) * elsize % 16 for n in sizes):
        return "none"
    if device_type == "cpu":
        return "sync_free"
    if device_type != "cuda" or capability is None or tuple(capability) < (8, 0):
        return "none"
    if dtype == torch.bfloat16 and tuple(capability) in ((9, 0), (10, 0)):
        return "sync_free"
    return "host_sync"


def experts_capturable(dtype: torch.dtype, device: torch.device | str, hidden: int, intermediate: int,
                       capability: tuple[int, int] | None = None) -> bool:
    """Whether the experts' grouped matmuls (``gate_up [E, 2I, hidden]``, ``down [E, hidden, I]``) can be
    captured in a CUDA graph. ``capability`` defaults to the device's (queried only on CUDA)."""
    device = torch.device(device)
    if capability is None and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
    return grouped_mm_mode(dtype, device.type, capability, (hidden, 2 * intermediate, intermediate)) == "sync_free"


def _grouped_mm_mode(a: Tensor, w: Tensor) -> str:
    cap = torch.cuda.get_device_capability(a.device) if a.device.type == "cuda" else None
    return grouped_mm_mode(a.dtype, a.device.type, cap, (w.shape[-1], w.shape[-2]))


def _grouped_mm_ok(a: Tensor, w: Tensor) -> bool:
    return _grouped_mm_mode(a, w) != "none"


def grouped_linear(a: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``a [S, in]`` rows grouped by expert (group g = rows ``[offs[g-1], offs[g])``) times
    ``w [G, out, in]`` transposed -> ``[S, out]``; rows past ``offs[-1]`` are left undefined."""
    mode = _grouped_mm_mode(a, w)
    if mode != "sync_free" and a.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"MoE experts: torch grouped_mm needs bf16 on sm90/sm100 to run without a host sync "
                           f"(here {a.dtype}, sizes {tuple(w.shape[-2:])}); the other paths cannot be captured in "
                           "a CUDA graph: use a bf16 rollout or set rollout.compile=false")
    if mode != "none":
        return F.grouped_mm(a, w.transpose(-2, -1), offs=offs)
    out = a.new_zeros((a.shape[0], w.shape[1]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(a[start:end], w[g])
        start = end
    return out


def experts(x: Tensor, top_i: Tensor, top_w: Tensor, gate_up: Tensor, down: Tensor,
            act: Callable[[Tensor, Tensor], Tensor], expert_offset: int = 0, *, gate_up_b: Tensor | None = None,
            down_b: Tensor | None = None, interleaved: bool = False) -> Tensor:
    """Weighted sum of this rank's experts over each token's assignments (differentiable).

    Args:
        x: ``[M, hidden]``; top_i, top_w: ``[M, k]`` expert ids (global) and routing weights.
        gate_up: ``[E_local, 2 * I, hidden]`` (gate rows, then up rows); down: ``[E_local, hidden, I]``.
        act: ``act(gate, up) -> [S, I]`` (SwiGLU).
        expert_offset: global id of ``gate_up[0]`` (tensor-parallel rank x E_local).
        gate_up_b, down_b: ``[E_local, 2 * I]`` / ``[E_local, hidden]`` per-expert biases (GPT-OSS), added
            once per assignment; interleaved: gate / up are the even / odd rows of ``gate_up`` (GPT-OSS).
    Returns:
        ``[M, hidden]`` in x's dtype: the contributions of the local experts only.
    """
    m, k = top_i.shape
    n_local, i2 = gate_up.shape[0], gate_up.shape[1]
    local = top_i.reshape(-1) - expert_offset  # [S]
    mine = (local >= 0) & (local < n_local)
    key = torch.where(mine, local, n_local)  # other ranks' experts sort past the last block
    key_sorted, perm = torch.sort(key, stable=True)  # [S]
    counts = torch.zeros(n_local + 1, dtype=torch.int64, device=x.device).index_add_(0, key, torch.ones_like(key))
    offs = counts[:n_local].cumsum(0).to(torch.int32)
    keep = (key_sorted < n_local)[:, None]  # [S, 1]
    # masked before the matmul too: the grouped matmul's backward leaves the skipped rows undefined
    xs = torch.where(keep, x.index_select(0, perm // k), 0)  # [S, hidden]
    h = grouped_linear(xs, gate_up, offs)  # [S, 2I]
    eid = key_sorted.clamp(max=n_local - 1)  # each sorted row's local expert (others' rows are masked)
    if gate_up_b is not None:  # masked: the matmul's backward leaves the skipped rows' gradients undefined
        h = h + torch.where(keep, gate_up_b.index_select(0, eid), 0)
    h = act(h[:, 0::2], h[:, 1::2]) if interleaved else act(h[:, : i2 // 2], h[:, i2 // 2:])
    y = grouped_linear(h, down, offs)
    if down_b is not None:
        y = y + down_b.index_select(0, eid)
    y = torch.where(keep, y, 0)  # [S, hidden]
    y = y * top_w.reshape(-1).index_select(0, perm)[:, None]
    y = torch.zeros_like(y).index_copy(0, perm, y)  # back to assignment order [M * k]
    return y.view(m, k, y.shape[-1]).sum(dim=1).to(x.dtype)  # (m may be 0: an ep rank sent no rows)
