"""Token-budget micro-batches, dp balancing, equal counts across ranks, exact loss."""

from __future__ import annotations

import os
import random
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from rlhf.data.batching import (
    balance_across_dp,
    karmarkar_karp,
    make_token_budget_micro_batches,
    micro_batches_for_rank,
    reverse_index,
    seq_lens_from_mask,
    sync_num_micro_batches,
)
from rlhf.models.packed import packed_forward_log_probs


def _covers_once(bins, n):
    flat = sorted(i for b in bins for i in b)
    return flat == list(range(n))


def test_karmarkar_karp_hand_examples():
    # {8,7,6,5,4}, by hand: 8-7=1, 6-5=1, 4-1=3, 3-1=2 -> difference 2, sums 16 / 14
    # (the textbook case where KK misses the optimum 15 / 15)
    lens = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(lens, 2, equal_size=False)
    assert sorted(sum(lens[i] for i in p) for p in parts) == [14, 16]
    assert _covers_once(parts, 5)
    # equal size, 2 sets of 4: sums 22 / 22
    lens = [10, 1, 9, 2, 8, 3, 7, 4]
    parts = karmarkar_karp(lens, 2, equal_size=True)
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(sum(lens[i] for i in p) for p in parts) == [22, 22]


def test_token_budget_bins_respect_budget_and_cover_once():
    rng = random.Random(0)
    lens = [rng.randint(16, 544) for _ in range(64)]
    budget = 2048
    bins = make_token_budget_micro_batches(lens, budget)
    assert _covers_once(bins, len(lens))
    assert all(sum(lens[i] for i in b) <= budget for b in bins)
    lower = -(-sum(lens) // budget)
    assert lower <= len(bins) <= lower + 1  # at (or one above) the bin-count lower bound
    sums = [sum(lens[i] for i in b) for b in bins]
    assert max(sums) - min(sums) < max(lens)  # balanced, not first-fit leftovers


def test_token_budget_exact_small_case_and_oversized():
    bins = make_token_budget_micro_batches([5, 5, 5, 5], 10)
    assert len(bins) == 2 and all(len(b) == 2 for b in bins)  # 20 tokens, budget 10: exactly 2 full bins
    bins = make_token_budget_micro_batches([3, 50, 4, 2], 10)
    assert [1] in bins and len(bins) == 2  # the 50-token sequence alone, the rest (9 tokens) together
    assert _covers_once(bins, 4)


def test_min_num_micro_batches_splits_further():
    lens = [4, 4, 4, 4, 4, 4]
    assert len(make_token_budget_micro_batches(lens, 100)) == 1
    bins = make_token_budget_micro_batches(lens, 100, min_num_micro_batches=3)
    assert len(bins) == 3 and _covers_once(bins, 6) and all(len(b) == 2 for b in bins)
    bins = make_token_budget_micro_batches([7, 9], 100, min_num_micro_batches=3)
    assert len(bins) == 3 and [] in bins  # fewer sequences than micro-batches: one empty (dummy) batch


def test_balance_across_dp_equal_counts_balanced_sums():
    rng = random.Random(1)
    lens = [rng.randint(16, 512) for _ in range(32)]
    groups = balance_across_dp(lens, 4)
    assert [len(g) for g in groups] == [8, 8, 8, 8] and _covers_once(groups, 32)
    sums = [sum(lens[i] for i in g) for g in groups]
    naive = [sum(lens[r * 8 : (r + 1) * 8]) for r in range(4)]
    assert max(sums) - min(sums) <= max(naive) - min(naive)
    assert max(sums) - min(sums) < 64


def test_reverse_index_and_seq_lens():
    bins = [[2, 0], [3], [1]]
    rev = reverse_index(bins)
    order = torch.tensor([i for b in bins for i in b])
    assert torch.equal(order[rev], torch.arange(4))
    assert seq_lens_from_mask(torch.tensor([[0, 1, 1], [1, 1, 1]])) == [2, 3]
    assert sync_num_micro_batches(3) == 3  # no process group: identity


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # rank 0 fits in one micro-batch, rank 1 needs three
    lens = [10, 10, 10, 10] if rank == 0 else [90, 90, 90, 10]
    bins = micro_batches_for_rank(lens, 100)
    q.put((rank, bins))
    dist.destroy_process_group()


def test_micro_batch_count_synced_across_ranks():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(out[0]) == len(out[1]) == 3
    assert _covers_once(out[0], 4) and _covers_once(out[1], 4)


def test_token_budget_and_fixed_micro_batches_same_loss_and_grad():
    """Token-mean loss with the global normaliser: any partition gives the same sum."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    model = transformers.Qwen2ForCausalLM(cfg).float()
    B, P, R = 8, 4, 12
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    resp = [12, 3, 7, 1, 9, 5, 11, 2]
    for b, r in enumerate(resp):
        mask[b, P + r :] = 0
    mask[1, :2] = 0  # a left-padded prompt
    adv = torch.randn(B, R, generator=g)
    resp_mask = mask[:, P:].float()
    n_tokens = resp_mask.sum()  # global normaliser

    def run(micro_batches):
        model.zero_grad()
        total = torch.zeros(())
        for mb in micro_batches:
            idx = torch.tensor(mb)
            lp, _ = packed_forward_log_probs(model, ids[idx], mask[idx], response_length=R)
            loss = -(lp * adv[idx] * resp_mask[idx]).sum() / n_tokens
            loss.backward()
            total += loss.detach()
        return total, [p.grad.clone() for p in model.parameters()]

    fixed = [list(range(i, i + 2)) for i in range(0, B, 2)]
    budget = make_token_budget_micro_batches(seq_lens_from_mask(mask), max_token_len=40)
    assert all(sum(seq_lens_from_mask(mask[torch.tensor(b)])) <= 40 for b in budget)
    assert sorted(len(b) for b in budget) != [2, 2, 2, 2]  # really a different split
    l1, g1 = run(fixed)
    l2, g2 = run(budget)
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
