"""Remove padding from a batch and put it back (verl's ``use_remove_padding``).

A rollout batch is ``input_ids [B, L]`` with a left-padded prompt and a right-padded
response; ``attention_mask [B, L]`` marks the real tokens. Packing keeps only the real
tokens, concatenated into one row ``[1, total]`` with ``total = attention_mask.sum()``,
so that no compute is spent on pads. The sequence boundaries travel as ``cu_seqlens``
(the flash-attn varlen convention: ``cu_seqlens[i]`` is where sequence ``i`` starts) and
``position_ids`` restart at 0 for every sequence, which is exactly
``cumsum(attention_mask) - 1`` of the padded path restricted to real tokens, so rotary
embeddings see the same positions in both layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedBatch", "unpad", "repad"]


@dataclass
class PackedBatch:
    """A padding-free batch.

    Attributes:
        input_ids: ``[1, total]`` real tokens of all sequences, back to back.
        position_ids: ``[1, total]`` position of each token inside its own sequence.
        cu_seqlens: ``[B+1]`` int32 cumulative sequence lengths, ``cu_seqlens[0] == 0``.
        max_seqlen: length of the longest sequence (python int, for the varlen kernels).
        indices: ``[total]`` int64 positions of the real tokens in the flattened padded
            tensor ``[B*L]`` (row-major), i.e. ``padded.flatten()[indices] == packed``.
        seq_lens: ``[B]`` int64 number of real tokens per sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    indices: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def total(self) -> int:
        """Number of real tokens ``total``."""
        return int(self.indices.numel())

    def attention_kwargs(self) -> dict:
        """Keyword arguments that ``model.forward(**kw)`` passes down to the attention
        function (transformers' ``FlashAttentionKwargs`` names)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Pack the real tokens of a padded batch into one row.

    Args:
        input_ids: ``[B, L]`` token ids.
        attention_mask: ``[B, L]`` 1 for real tokens, 0 for pads (any pattern; holes
            are dropped, consistent with ``position_ids = cumsum(mask) - 1``).

    Returns:
        A :class:`PackedBatch` with ``total = attention_mask.sum()`` tokens.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"unpad expects input_ids and attention_mask of the same shape [B, L]; got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.bool()
    seq_lens = mask.sum(dim=-1, dtype=torch.int64)  # [B]
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()  # [total]
    cu_seqlens = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = torch.cumsum(seq_lens, dim=0).to(torch.int32)
    # Position inside the own sequence: the running count of real tokens minus one,
    # read off at the real tokens (identical to the padded path's position_ids there).
    positions = (torch.cumsum(mask.long(), dim=-1) - 1).flatten()[indices]  # [total]
    max_seqlen = int(seq_lens.max().item()) if seq_lens.numel() > 0 else 0
    return PackedBatch(
        input_ids=input_ids.flatten()[indices].unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        indices=indices,
        seq_lens=seq_lens,
    )


def repad(
    values: torch.Tensor, packed: PackedBatch | torch.Tensor, batch: int, seqlen: int, fill: float = 0.0
) -> torch.Tensor:
    """Scatter per-token values back into the padded layout.

    Args:
        values: ``[total, ...]`` (a leading ``1`` as in ``[1, total, ...]`` is accepted).
        packed: the :class:`PackedBatch` (or its ``indices [total]``) from :func:`unpad`.
        batch, seqlen: ``B`` and ``L`` of the padded layout.
        fill: value written at pad positions.

    Returns:
        ``[B, L, ...]``; differentiable with respect to ``values``.
    """
    indices = packed.indices if isinstance(packed, PackedBatch) else packed
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == indices.numel():
        values = values.squeeze(0)
    if values.shape[0] != indices.numel():
        raise ValueError(f"repad: values has {values.shape[0]} rows but the packed batch has {indices.numel()} tokens")
    out = values.new_full((batch * seqlen, *values.shape[1:]), fill)
    out = out.index_put((indices,), values)
    return out.view(batch, seqlen, *values.shape[1:])
