"""A deterministic random rollout batch for the multi-process equivalence tests."""

from __future__ import annotations

import torch


def random_rollout_batch(n_prompts: int, n_samples: int, P: int, R: int, vocab: int, seed: int = 0,
                         holes: bool = False):
    """N = n_prompts x n_samples rows: left-padded prompts of 2..P tokens, responses of
    1..R tokens (with ``holes``, a tool-output hole in ``response_mask`` when 4+), random old / ref /
    rollout log-probs and advantages.

    Rows of one prompt are contiguous (row p*n+j), as the trainer lays them out.
    """
    from rlhf.schema.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    N = n_prompts * n_samples
    prompt_len = torch.randint(2, P + 1, (N,), generator=g)
    resp_len = torch.randint(1, R + 1, (N,), generator=g)
    ids = torch.randint(6, vocab, (N, P + R), generator=g)
    cols = torch.arange(P + R)
    attn = ((cols >= P - prompt_len[:, None]) & (cols < P + resp_len[:, None])).long()
    resp_mask = (torch.arange(R) < resp_len[:, None]).float()
    ids = ids * attn
    # Multi-turn masks: responses of 4+ tokens get a 1-2 token tool output inside (context, attention 1;
    # no loss, response_mask 0), for the layout tests of masks with holes. Own generator:
    # the draws above stay what they were.
    h = torch.Generator().manual_seed(seed + 1000)
    start = 1 + (torch.rand(N, generator=h) * (resp_len - 2).clamp(min=0)).long()
    end = start + torch.randint(1, 3, (N,), generator=h)
    col = torch.arange(R)
    hole = (col >= start[:, None]) & (col < end[:, None]) & (col < resp_len[:, None] - 1) & (resp_len[:, None] >= 4)
    if holes:
        resp_mask = resp_mask * (~hole).float()
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, responses=ids[:, P:], response_mask=resp_mask,
        index=torch.arange(n_prompts).repeat_interleave(n_samples),
        rollout_log_probs=-torch.rand(N, R, generator=g) * 3, truncated=torch.zeros(N, dtype=torch.bool),
        old_log_probs=-torch.rand(N, R, generator=g) * 3, ref_log_probs=-torch.rand(N, R, generator=g) * 3,
        advantages=torch.randn(N, R, generator=g))
