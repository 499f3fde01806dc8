"""MoE routing metrics (rlhf.models.moe_stats): expert load max/mean and router entropy by hand, and
padding excluded: a padded batch gives the numbers of its rows run alone."""

from __future__ import annotations

import math

import torch

from rlhf.models.moe_stats import RouterStats, router_sums, summarize
from tests._archs import tiny_model


def test_router_sums_and_summary_by_hand():
    E = 4
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0], [5.0, 5.0, -50.0, -50.0]])
    top_i = torch.tensor([[0, 1], [0, 2], [0, 1]])
    s = router_sums(logits, top_i, E, mask=torch.tensor([True, False, True]))
    assert s[:E].tolist() == [2, 2, 0, 0] and s[-1].item() == 2  # row 1 masked out
    torch.testing.assert_close(s[-2].item(), math.log(4) + math.log(2), atol=1e-5, rtol=0)
    out = summarize(torch.stack([s, torch.zeros_like(s)]), [3, 5])  # layer 5 saw no token: skipped
    assert out["moe/load_max_mean/layer3"] == 2.0 and out["moe/load_max_mean"] == 2.0
    assert abs(out["moe/router_entropy"] - (math.log(4) + math.log(2)) / 2) < 1e-6
    assert "moe/load_max_mean/layer5" not in out


def _forward(model, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)


def test_padded_batch_counts_real_tokens_only():
    model = tiny_model("qwen3_moe")  # layers 0 and 2 sparse, 8 experts, top-2
    rows = [torch.tensor([5, 9, 11, 3, 7]), torch.tensor([12, 4]), torch.tensor([8, 8, 30, 2])]
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):  # left padding, as the rollout batches
        ids[b, L - len(r):], mask[b, L - len(r):] = r, 1
    stats = RouterStats(model, [0, 2], 8)
    assert len(stats.handles) == 2
    with torch.no_grad():
        with stats.record():
            for r in rows:
                _forward(model, r[None], torch.ones(1, len(r), dtype=torch.long))
        alone = stats.reduce(torch.device("cpu"))
        with stats.record():
            stats.mask = mask
            _forward(model, ids, mask)
        padded = stats.reduce(torch.device("cpu"))
        with stats.record():  # without the mask the pad tokens count: different numbers
            _forward(model, ids, mask)
        unmasked = stats.reduce(torch.device("cpu"))
    assert set(alone) == set(padded) and "moe/router_entropy/layer2" in alone
    for k in alone:
        assert abs(alone[k] - padded[k]) < 1e-5, k
    assert any(abs(alone[k] - unmasked[k]) > 1e-4 for k in alone)
    assert 1.0 <= alone["moe/load_max_mean"] <= 8 / 2 and 0 < alone["moe/router_entropy"] < math.log(8)
