"""N-gram draft tokens from what the sampler already holds (no draft model).

Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculator) generalised to a corpus per
sequence: the last ``n`` tokens of a sequence are looked up in its corpus rows (the trajectories
of the other samples of its prompt, GRPO's group, and its own prompt, tokens and earlier turns),
and the tokens that followed the match are the draft. In a GRPO group the samples share the
prompt and often whole stretches of reasoning or tool-call syntax, so a sibling that has already
written a passage drafts it for the others.

Everything is batched tensor ops over the live sequences; no Python per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def ngram_drafts(context: Tensor, corpus: Tensor, known: Tensor, ngram_sizes: Sequence[int],
                 k: int) -> tuple[Tensor, Tensor]:
    """Draft tokens of ``B`` sequences by suffix n-gram matching.

    For each size ``n`` in ``ngram_sizes`` (longest first) and each sequence not drafted yet, the
    windows of ``n`` tokens of its corpus rows equal to its last ``n`` tokens are candidates; the one
    followed by the most known tokens (up to ``k``; ties: the first row, then the earliest place)
    gives the draft: the tokens after it.

    Args:
        context: ``[B, N]`` the last ``N >= max(ngram_sizes)`` tokens of each sequence (-1 where the
            sequence is shorter: never matched).
        corpus: ``[B, M, L]`` each sequence's corpus rows (token ids; -1 = nothing).
        known: ``[B, M]`` columns ``< known`` of a row hold known tokens (the rest is not read).
        ngram_sizes: the n-gram lengths looked up.
        k: the most draft tokens per sequence.
    Returns:
        ``drafts`` ``[B, k]`` int64 (-1 past a sequence's draft) and their lengths ``[B]`` int64.
    """
    bsz, m, width = corpus.shape
    dev = corpus.device
    drafts = torch.full((bsz, k), -1, dtype=torch.int64, device=dev)
    lengths = torch.zeros(bsz, dtype=torch.int64, device=dev)
    offsets = torch.arange(k, device=dev)
    for n in sorted(set(ngram_sizes), reverse=True):
        if n > width - 1:
            continue
        ctx = context[:, -n:]  # [B, n]
        windows = corpus.unfold(2, n, 1)  # [B, M, L - n + 1, n] views: window s covers columns s .. s+n-1
        match = (windows == ctx[:, None, None, :]).all(-1) & (ctx >= 0).all(-1)[:, None, None]
        start = torch.arange(windows.shape[2], device=dev)
        follow = (known[:, :, None] - (start + n)).clamp(min=0, max=k)  # [B, M, S] known tokens after it
        score = torch.where(match, follow, 0).flatten(1)  # [B, M * S]
        best, at = score.max(dim=1)  # first maximum
        take = (best > 0) & (lengths == 0)
        row, s = at // windows.shape[2], at % windows.shape[2]
        cols = (s + n)[:, None] + offsets  # [B, k]
        toks = corpus[torch.arange(bsz, device=dev)[:, None], row[:, None], cols.clamp(max=width - 1)]
        toks = torch.where(offsets < best[:, None], toks, -1)
        drafts = torch.where(take[:, None], toks, drafts)
        lengths = torch.where(take, best, lengths)
    return drafts, lengths
