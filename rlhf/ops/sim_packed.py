"""Padding-free (and Ulysses ``parallel.sp``) passes in the simulation (``python -m rlhf.simulate``).

A packed pass computes its token layout from the data: ``unpad`` runs ``nonzero`` over the
attention mask, the response positions and this sp rank's slice are read off it, and the CPU
attention path reads the sequence boundaries on the host. Fake tensors have no data, so
:func:`packed_layout_on_host` runs those few index functions of ``rlhf.models.packed`` on real
(host) tensors while the model runs on fake ones: the simulation builds real ``input_ids`` /
``attention_mask`` of the simulated shapes, the index tensors it derives stay real, and
``FakeTensorMode(allow_non_fake_inputs=True)`` takes them as inputs.

Attention then runs through the flash-attn entry (``varlen_kernel``) with
:func:`flash_attention_shapes`: what ``flash_attn_varlen_func`` allocates, its output and its
fp32 log-sum-exp per head and token, and in the backward ``dq``, ``dk``, ``dv``; never a
``[T, T]`` score matrix, as on a GPU. Under Ulysses the real all-to-alls run around it
(``rlhf.models.ulysses``), so their bytes are counted.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from rlhf.models import packed as _packed
from rlhf.models.varlen_attention import use_varlen_kernel


def on_host(fn):
    """``fn`` run with fake-tensor mode suspended: its tensors are real host values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return run


@contextmanager
def packed_layout_on_host() -> Iterator[None]:
    """Inside: ``rlhf.models.packed``'s layout functions (unpad, response positions, the sp slice) run
    outside fake mode, on the real index tensors the caller passes."""
    from rlhf.models import varlen_attention as _varlen

    # (GPT-OSS's packed rows take the bucketed attention path, whose plan is read off the sequence bounds)
    patched = [(_packed, n) for n in ("unpad", "response_positions", "shard_packed", "_local_positions")]
    patched.append((_varlen, "_get_plan"))
    saved = [(mod, n, getattr(mod, n)) for mod, n in patched]
    for mod, n, fn in saved:
        setattr(mod, n, on_host(fn))
    try:
        yield
    finally:
        for mod, n, fn in saved:
            setattr(mod, n, fn)


class _FlashShapes(torch.autograd.Function):
    """flash-attn varlen's allocations: out [T, H, D] and lse [H, T] fp32; backward dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_shapes(q, k, v, **_):
    return _FlashShapes.apply(q, k, v)


@contextmanager
def flash_attention_shapes() -> Iterator[None]:
    """Inside: packed attention calls :class:`_FlashShapes` (flash-attn's memory, no math)."""
    with use_varlen_kernel(_flash_shapes):
        yield
