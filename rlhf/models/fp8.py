"""FP8 (e4m3) weights for the rollout: quantize, dequantize, and the matmul that reads them.

The rollout copy of each linear weight ``W`` ``[..., out, in]`` is stored as ``q = round_e4m3(W / s)``
with float32 scales ``s`` (the DeepSeek-V3 checkpoint convention: ``weight_scale_inv`` is the factor
that turns ``q`` back into ``W``):

* ``block`` (default, DeepSeek-V3's scheme): one scale per 128 x 128 tile of the last two dims,
  ``s[i, j] = amax(|W[tile i, j]|) / 448`` (448 = e4m3's largest finite value); ``s`` is
  ``[..., ceil(out / 128), ceil(in / 128)]``; edge tiles are partial.
* ``channel``: one scale per output row, ``s`` ``[..., out, 1]``.

Leading dims (MoE experts ``[E, out, in]``) are independent matrices, so a slice of whole experts
quantizes exactly as the same experts of the whole tensor do; a tensor-parallel row or column slice
does too when its offset and size are multiples of 128 (tiles are counted from the slice's start).

Error bound (round to nearest e4m3, 3 mantissa bits): ``|dequant(q) - W| <= max(|W| / 16, s / 1024)``
per element (half a unit in the last place; the second term is e4m3's subnormal spacing ``2^-9 s``
halved). Zeros stay zeros; an all-zero tile gets the smallest positive scale, not 0 (no 0 / 0).

The matmul (:func:`linear`): an :class:`Fp8Weight` runs ``torch._scaled_mm`` (activations quantized
per token: per 128 columns for block weights, per row for channel weights) where
:func:`kernel_ok` has checked it on this device against the dequantized product; elsewhere the
sampler holds the weights dequantized (same numbers, rollout-dtype matmuls), so the CPU runs the same
quantized model as an H100 does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128
_TINY = 1e-12  # scale floor of an all-zero tile / row
Scheme = Literal["block", "channel"]

__all__ = ["FP8", "FP8_MAX", "BLOCK", "Fp8Weight", "quantize", "dequantize", "scale_shape", "fp8_bytes",
           "linear", "kernel_ok", "supports_fp8"]


def scale_shape(shape: tuple[int, ...], scheme: Scheme = "block", block: int = BLOCK) -> tuple[int, ...]:
    """Shape of the scales of a weight of ``shape`` ``[..., out, in]``."""
    *lead, rows, cols = shape
    if scheme == "channel":
        return (*lead, rows, 1)
    return (*lead, math.ceil(rows / block), math.ceil(cols / block))


def fp8_bytes(shape: tuple[int, ...], scheme: Scheme = "block", block: int = BLOCK) -> int:
    """Bytes of a quantized weight of ``shape``: one per element plus its float32 scales (planner, simulation)."""
    return math.prod(shape) + 4 * math.prod(scale_shape(shape, scheme, block))


def _tiles(w: Tensor, block: int) -> tuple[Tensor, int, int]:
    """``w`` ``[..., R, C]`` zero-padded to whole tiles and viewed ``[..., R/b, b, C/b, b]``; returns (view, R, C)."""
    *lead, rows, cols = w.shape
    pr, pc = -rows % block, -cols % block
    if pr or pc:
        w = F.pad(w, (0, pc, 0, pr))
    return w.view(*lead, (rows + pr) // block, block, (cols + pc) // block, block), rows, cols


def quantize(w: Tensor, scheme: Scheme = "block", block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``w`` ``[..., out, in]`` (any float dtype) -> (``q`` float8_e4m3fn ``[..., out, in]``, scales float32
    of :func:`scale_shape`), with ``dequantize(q, s) ~= w`` (module docstring). The division runs in float32."""
    if w.dim() < 2:
        raise ValueError(f"fp8.quantize: a weight has >= 2 dims, got shape {tuple(w.shape)}")
    wf = w.detach().float()
    if scheme == "channel":
        scale = (wf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
        return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    if scheme != "block":
        raise ValueError(f"fp8.quantize: scheme must be 'block' or 'channel', got {scheme!r}")
    tiles, rows, cols = _tiles(wf, block)
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(_TINY)  # [..., R/b, C/b]
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols]
    return q.contiguous(), scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK) -> Tensor:
    """``q * s`` in ``dtype`` (the scheme is read from the scale's shape: a last dim of 1 on a wider
    weight is per channel)."""
    *_, rows, cols = q.shape
    qf = q.float()
    if scale.shape[-1] == 1 and cols > 1 and scale.shape[-2] == rows:
        return (qf * scale).to(dtype)
    s = scale.repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]
    return (qf * s).to(dtype)


def supports_fp8(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor-core matmuls (CUDA compute capability 8.9 or newer)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass
class Fp8Weight:
    """A linear weight kept in FP8 for the matmul kernel: ``data`` float8_e4m3fn ``[out, in]``, ``scale``
    float32 (block ``[out/128, in/128]`` or channel ``[out, 1]``), ``out_dtype`` the activations' dtype."""

    data: Tensor
    scale: Tensor
    out_dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def scheme(self) -> Scheme:
        return "channel" if self.scale.shape[-1] == 1 and self.data.shape[-1] > 1 else "block"

    def dequantize(self) -> Tensor:
        return dequantize(self.data, self.scale, self.out_dtype)

    def copy_(self, other: "Fp8Weight") -> "Fp8Weight":
        """In place (CUDA graphs read these addresses): new values, same storage."""
        self.data.copy_(other.data)
        self.scale.copy_(other.scale)
        return self

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> Optional["Fp8Weight"]:
        """Row concatenation (fused q|k|v, gate|up); None when a part's rows are not whole tiles (its
        scales would not line up: the caller dequantizes instead)."""
        if any(p.scheme == "block" and p.shape[0] % BLOCK for p in parts[:-1]) or \
                len({p.scheme for p in parts}) > 1:
            return None
        return Fp8Weight(torch.cat([p.data for p in parts]).contiguous(),
                         torch.cat([p.scale for p in parts]).contiguous(), parts[0].out_dtype)


def _quantize_rows(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Activations ``[M, K]`` per token: scales ``[M, K / group]`` (group = K: one per row)."""
    m, k = x.shape
    xf = x.float().view(m, k // group, group)
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp_min(_TINY)  # [M, K/g]
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    return q, scale


def _scaled_mm(x: Tensor, w: Fp8Weight) -> Tensor:
    """``x @ W.T`` with FP8 operands; ``x`` ``[M, K]``."""
    if w.scheme == "channel":
        q, sx = _quantize_rows(x, x.shape[-1])
        return torch._scaled_mm(q, w.data.t(), scale_a=sx, scale_b=w.scale.t(), out_dtype=w.out_dtype)
    from torch.nn.functional import ScalingType, scaled_mm

    q, sx = _quantize_rows(x, BLOCK)
    # torch's layouts (its meta check): the activation scales [M, K/128] outer-dim-major; the weight's
    # [N/128, K/128] transposed, its K/128 padded to a multiple of 4 (the pad multiplies no data)
    sx = sx.t().contiguous().t()
    kb = w.scale.shape[-1]
    sw = F.pad(w.scale, (0, -kb % 4), value=1.0) if kb % 4 else w.scale
    return scaled_mm(q, w.data.t(), sx, ScalingType.BlockWise1x128, sw.t(), ScalingType.BlockWise128x128,
                     output_dtype=w.out_dtype)


_KERNEL_OK: dict[tuple[str, int, str], bool] = {}


def kernel_ok(device: torch.device, scheme: Scheme, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``torch._scaled_mm`` runs this scheme on ``device`` with ``dtype`` activations and matches the
    dequantized product (checked once per device and scheme on a small product; False off FP8 hardware and
    for other activation dtypes than bf16, the one cuBLAS' scaled kernels all output). A torch or cuBLAS
    without the block-scaled kernel then decodes from dequantized weights rather than failing."""
    if dtype != torch.bfloat16:
        return False
    key = (device.type, device.index or 0, scheme)
    if key not in _KERNEL_OK:
        _KERNEL_OK[key] = supports_fp8(device) and _check_kernel(device, scheme)
    return _KERNEL_OK[key]


def _check_kernel(device: torch.device, scheme: Scheme) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(24, 2 * BLOCK, generator=gen).to(device, torch.bfloat16)
    q, s = quantize(torch.randn(3 * BLOCK, 2 * BLOCK, generator=gen).to(device), scheme)
    w = Fp8Weight(q, s, torch.bfloat16)
    try:
        got = _scaled_mm(x, w).float()
    except (RuntimeError, NotImplementedError, ImportError):
        return False
    want = F.linear(x.float(), w.dequantize().float())
    # activations rounded to e4m3 too: relative error ~2^-4 per product term, far less over a sum
    return bool((got - want).norm() <= 0.05 * want.norm())


def runs_kernel(w: Fp8Weight) -> bool:
    """Whether :func:`linear` can hand ``w`` to the kernel: K whole tiles (block) and the cuBLAS multiples of 16."""
    n, k = w.shape
    return k % 16 == 0 and n % 16 == 0 and (w.scheme == "channel" or k % BLOCK == 0)


def linear(x: Tensor, w: "Tensor | Fp8Weight", b: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` that also takes an :class:`Fp8Weight` (``x`` ``[..., K]``)."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, b)
    lead = x.shape[:-1]
    out = _scaled_mm(x.reshape(-1, x.shape[-1]), w).view(*lead, -1)
    return out if b is None else out + b


def scale_name(name: str) -> str:
    """Key of the scales of the quantized weight ``name`` in a rollout weight dict (DeepSeek-V3's
    checkpoint names: ``x.weight`` -> ``x.weight_scale_inv``; an expert tensor ``..._proj`` -> ``..._proj_scale_inv``)."""
    return name + "_scale_inv"
