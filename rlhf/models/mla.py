"""Multi-head latent attention (DeepSeek-V2/V3, transformers' ``DeepseekV3Attention``) in the rollout decoder.

Per token ``x`` (after the input norm), ``H`` heads, dims ``N`` (nope), ``R`` (rope), ``Dv`` (value)::

    q        = q_b(RMSNorm(q_a(x)))  (or q_proj(x) when q_lora_rank is None)   [H, N + R]: [q_nope | q_rot]
    c, k_rot = kv_a_proj_with_mqa(x)                                           [kv_lora_rank], [R] (one per token)
    k_nope, v = kv_b(RMSNorm(c))                                               [H, N], [H, Dv]
    attn     = softmax((q_nope . k_nope + rope(q_rot) . rope(k_rot)) * scale) v
    scale    = (N + R)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with ``mscale_all_dim``

``rope_interleave`` (DeepSeek's checkpoints): the rotary dims come in pairs ``(x0, x1), (x2, x3)``, and
HF's rotated output is laid out ``[evens | odds]``; that equals the standard ``rotate_half`` rope on the
input permuted to ``[evens | odds]``. The permutation is applied to the weight rows that produce
``q_rot`` and ``k_rot`` when the weights are prepared, so the decoder's rope runs unchanged.

The KV cache stores the DECOMPRESSED per-head K and V (exact and the simplest: every attention kernel of
the sampler stays as it is). A cache head is ``D = max(N + R, Dv)`` wide, laid out ``[rot | nope]`` for q
and k (a dot product does not depend on the order of dims as long as q and k agree; rope rotates the
leading ``R`` dims, as for Phi-3's partial rotary) and ``[v | 0]`` for v (zero padding adds zeros to the
output, which is sliced back to ``Dv`` before ``o_proj``). Cost: ``2 H D`` values per token and layer,
against ``kv_lora_rank + R`` for a latent cache (DeepSeek-V3: 2 x 128 x 192 = 49152 vs 576, 85x more);
a latent cache would need the attention kernels to absorb ``kv_b`` into q and o (DeepSeek's "weight
absorption"), which is not built.

Tensor parallelism: heads split over tp (``q_b`` / ``kv_b`` column slices, ``o_proj`` row slices,
``q_a`` / ``kv_a`` and their norms replicated: ``rlhf.rollout.reshard``); each rank decompresses its heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class MLADims:
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v: int  # v_head_dim

    @property
    def qk(self) -> int:
        return self.nope + self.rope

    @property
    def head_dim(self) -> int:
        """Width of a cache head (q, k and v padded to the widest)."""
        return max(self.qk, self.v)

    @classmethod
    def from_config(cls, config: Any) -> MLADims:
        return cls(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, nope=config.qk_nope_head_dim,
                   rope=config.qk_rope_head_dim, v=config.v_head_dim)


def softmax_scale(config: Any) -> float:
    """HF's ``DeepseekV3Attention.scaling``: ``qk_head_dim^-0.5``, times ``mscale^2`` under YaRN."""
    dims = MLADims.from_config(config)
    scale = dims.qk ** -0.5
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def _rope_rows(dims: MLADims, heads: int, per_head: int, start: int, interleave: bool) -> Tensor:
    """Row order of a projection with ``heads`` blocks of ``per_head`` rows whose rope rows are
    ``[start, start + R)`` of each block: the rope rows first (de-interleaved when ``interleave``), then the
    block's other rows."""
    r = dims.rope
    rot = torch.arange(r)
    if interleave:
        rot = torch.cat((rot[0::2], rot[1::2]))
    other = torch.cat((torch.arange(start), torch.arange(start + r, per_head)))
    block = torch.cat((rot + start, other))
    return (torch.arange(heads)[:, None] * per_head + block).reshape(-1)


def permute_q(w: Tensor, dims: MLADims, interleave: bool) -> Tensor:
    """``q_b_proj`` / ``q_proj`` weight ``[H (N + R), in]`` -> rows per head ``[rot | nope]`` (rot de-interleaved)."""
    heads = w.shape[0] // dims.qk
    return w.index_select(0, _rope_rows(dims, heads, dims.qk, dims.nope, interleave).to(w.device))


def permute_kv_a(w: Tensor, dims: MLADims, interleave: bool) -> Tensor:
    """``kv_a_proj_with_mqa`` weight (or bias) ``[kv_lora_rank + R, ...]`` -> its rope rows de-interleaved."""
    if not interleave:
        return w
    rows = _rope_rows(dims, 1, dims.kv_lora_rank + dims.rope, dims.kv_lora_rank, True)
    rows = torch.cat((rows[dims.rope:], rows[:dims.rope]))  # latent rows first, as stored
    return w.index_select(0, rows.to(w.device))


def qkv(x: Tensor, lw: Any, dims: MLADims, heads: int, eps: float, rms_norm) -> Tensor:
    """``x [M, hidden]`` (normed) -> ``[M, 3 H, D]``: q ``[rot | nope | 0]``, k ``[rot | nope | 0]``,
    v ``[v | 0]`` (rope not yet applied). ``lw``: the layer's ``mla_*`` weights (``rlhf.models.decoder``)."""
    a = F.linear(x, lw.mla_a_w, lw.mla_a_b)  # [M, (q_lora) + kv_lora + R]
    qr = dims.q_lora_rank or 0
    q_in = rms_norm(a[:, :qr], lw.mla_q_norm, eps) if qr else x
    q = F.linear(q_in, lw.mla_q_w).view(-1, heads, dims.qk)
    latent = rms_norm(a[:, qr:qr + dims.kv_lora_rank], lw.mla_kv_norm, eps)
    k_rot = a[:, qr + dims.kv_lora_rank:]  # [M, R]
    kv = F.linear(latent, lw.mla_kv_b_w).view(-1, heads, dims.nope + dims.v)
    out = x.new_zeros((x.shape[0], 3 * heads, dims.head_dim))
    out[:, :heads, :dims.qk] = q
    out[:, heads:2 * heads, :dims.rope] = k_rot[:, None]
    out[:, heads:2 * heads, dims.rope:dims.qk] = kv[..., :dims.nope]
    out[:, 2 * heads:, :dims.v] = kv[..., dims.nope:]
    return out



def layer_weights(get, prefix: str, dims: MLADims, interleave: bool) -> dict[str, Optional[Tensor]]:
    """The ``mla_*`` fields of a decoder ``LayerWeights`` from HF names under ``prefix`` (``...self_attn.``):
    ``q_a`` and ``kv_a`` fused into one matmul, rope rows permuted (:func:`permute_q`, :func:`permute_kv_a`).
    ``get(name, required=True)`` returns the tensor (on device, cast) or None."""
    kv_a = permute_kv_a(get(prefix + "kv_a_proj_with_mqa.weight"), dims, interleave)
    kv_a_b = get(prefix + "kv_a_proj_with_mqa.bias", False)
    if dims.q_lora_rank:
        a_w = torch.cat((get(prefix + "q_a_proj.weight"), kv_a))
        q_a_b = get(prefix + "q_a_proj.bias", False)
        a_b = None if kv_a_b is None else torch.cat((q_a_b, permute_kv_a(kv_a_b, dims, interleave)))
        q_w, q_norm = get(prefix + "q_b_proj.weight"), get(prefix + "q_a_layernorm.weight")
    else:
        a_w, a_b = kv_a, None if kv_a_b is None else permute_kv_a(kv_a_b, dims, interleave)
        q_w, q_norm = get(prefix + "q_proj.weight"), None
    return {"mla_a_w": a_w.contiguous(), "mla_a_b": a_b, "mla_q_norm": q_norm,
            "mla_q_w": permute_q(q_w, dims, interleave).contiguous(),
            "mla_kv_norm": get(prefix + "kv_a_layernorm.weight"), "mla_kv_b_w": get(prefix + "kv_b_proj.weight")}


class _SumGradTail(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient of the last ``n`` columns over ``group``."""

    @staticmethod
    def forward(ctx, x: Tensor, n: int, group: Any) -> Tensor:
        ctx.n, ctx.group = n, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        import torch.distributed as dist

        tail = g[..., -ctx.n:].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        return torch.cat((g[..., :-ctx.n], tail), dim=-1), None, None


def sum_rope_key_grad(module: Any, rope_dim: int, group: Any) -> None:
    """Under trainer tp: the shared rope key ``k_rot`` (the last ``R`` outputs of ``kv_a_proj_with_mqa``)
    feeds every head, but each rank attends with its own heads only, so its gradient is a partial sum; the
    latent part's gradient is already whole (it comes back through the column-parallel ``kv_b_proj``)."""
    module.register_forward_hook(lambda mod, args, out: _SumGradTail.apply(out, rope_dim, group))
