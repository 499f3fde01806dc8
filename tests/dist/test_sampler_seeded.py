"""Seeded sampling on 2 ranks equals the 1-process result (keys are global prompt indices).

gloo on CPU; nccl on GPUs under the RLHF_DIST_DEVICE=cuda switch (tests/dist/_dist_utils.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers

from rlhf.rollout import Sampler, SamplingParams
from tests.dist._dist_utils import dist_device, run_distributed

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [5], [33, 34, 35, 36], [40, 41], [2, 9, 4]]
PARAMS = SamplingParams(n=2, temperature=0.9, top_p=0.95, max_new_tokens=12, seed=21, stop_token_ids=[3, 7])
STEP = 4


def _sampler(max_num_seqs: int) -> Sampler:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    return Sampler(cfg, model.state_dict(), pad_token_id=0, max_num_seqs=max_num_seqs, device=dist_device())


def _generate_shard(rank: int, world_size: int) -> None:
    # the 1-process result (computed on every rank: no tensors cross the spawn boundary)
    expected = _sampler(max_num_seqs=64).generate(PROMPTS, PARAMS, step=STEP)
    assert expected.response_lengths.min() < PARAMS.max_new_tokens  # stops happen, lengths are uneven
    # interleaved split (prompt i goes to rank i % world), a different slot count per rank
    mine = list(range(rank, len(PROMPTS), world_size))
    out = _sampler(max_num_seqs=3 + rank).generate([PROMPTS[i] for i in mine], PARAMS, step=STEP, prompt_keys=mine)
    n = PARAMS.n
    local = torch.zeros(len(PROMPTS) * n, PARAMS.max_new_tokens, dtype=torch.int64, device=dist_device())
    local_lp = torch.zeros(len(PROMPTS) * n, PARAMS.max_new_tokens, device=dist_device())
    for j, i in enumerate(mine):
        local[i * n : (i + 1) * n] = out.response_ids[j * n : (j + 1) * n]
        local_lp[i * n : (i + 1) * n] = out.log_probs[j * n : (j + 1) * n]
    dist.all_reduce(local)  # each row is filled on exactly one rank
    dist.all_reduce(local_lp)
    assert torch.equal(local, expected.response_ids)
    torch.testing.assert_close(local_lp, expected.log_probs, atol=1e-5, rtol=0)
    dist.barrier()


def test_two_ranks_match_single_process():
    run_distributed(_generate_shard, 2)


def _tp_slice(name: str, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rollout slice: rows of q/k/v/gate/up, columns of o/down, the rest full."""
    col = any(f".{m}." in name for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    row = any(f".{m}.weight" in name for m in ("o_proj", "down_proj"))
    if not (col or row):
        return t
    dim = 0 if col else 1
    part = t.shape[dim] // size
    return t.narrow(dim, rank * part, part).clone()


def _tp_weights(cfg, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's TP slice of the weights ``_sampler`` uses (same seed)."""
    torch.manual_seed(0)
    weights = transformers.Qwen2ForCausalLM(cfg).eval().state_dict()
    return {k: _tp_slice(k, v, rank, world_size) for k, v in weights.items()}


def _generate_tensor_parallel(rank: int, world_size: int) -> None:
    full = _sampler(max_num_seqs=64)  # same seed on every rank: same weights
    ref = full.generate(PROMPTS, PARAMS, step=STEP)  # the 1-process result, no TP
    cfg = full.config
    sharded = _tp_weights(cfg, rank, world_size)
    s = Sampler(cfg, sharded, pad_token_id=0, max_num_seqs=5, tp_group=dist.group.WORLD, device=dist_device())
    assert s.spec.num_heads == 2 and s.spec.num_kv_heads == 1
    out = s.generate(PROMPTS, PARAMS, step=STEP)
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-4, rtol=0)
    # a KV budget from free memory that differs per rank: the group's minimum (MIN all-reduce),
    # or the peers would schedule differently and their all-reduces would not match
    per_token = 2 * 2 * 1 * 16 * 4  # layers x (K, V) x local kv heads x head dim x fp32 bytes
    free = (1 + 5 * rank) * 64 * per_token  # rank 0 has room for 1 sequence of 64 tokens, rank 1 for 6
    s = Sampler(cfg, sharded, pad_token_id=0, max_num_seqs=8, max_seq_len=64, tp_group=dist.group.WORLD,
                device=dist_device(), gpu_memory_utilization=1.0, free_memory=lambda device: free)
    assert s.cache.capacity_tokens == 64
    out = s.generate(PROMPTS, PARAMS, step=STEP)
    assert out.stats["preemptions"] > 0
    assert torch.equal(out.response_ids, ref.response_ids)
    dist.barrier()


def test_tensor_parallel_rollout_matches_single_process():
    """2-way TP over gloo (sharded q/k/v/o/MLP, all-reduce after o_proj and down_proj); the KV
    budget from per-rank free memory is the group's minimum."""
    run_distributed(_generate_tensor_parallel, 2)


def _generate_replicated_kv(rank: int, world_size: int) -> None:
    """A rollout wider than the KV heads (1 KV head, tp 2): each rank holds the KV head whole (replicated,
    as vLLM), its half of the query heads; same tokens and log-probs as one process."""
    from rlhf.rollout.reshard import rollout_slice

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, initializer_range=0.1)
    weights = transformers.Qwen2ForCausalLM(cfg).eval().state_dict()
    ref = Sampler(cfg, dict(weights), pad_token_id=0, max_num_seqs=64, device=dist_device()).generate(
        PROMPTS, PARAMS, step=STEP)
    sharded = {k: rollout_slice(v, k, rank, world_size, cfg).clone() for k, v in weights.items()}
    assert sharded["model.layers.0.self_attn.k_proj.weight"].shape == weights["model.layers.0.self_attn.k_proj.weight"].shape
    s = Sampler(cfg, sharded, pad_token_id=0, max_num_seqs=5, tp_group=dist.group.WORLD, device=dist_device())
    assert s.spec.num_heads == 2 and s.spec.num_kv_heads == 1
    out = s.generate(PROMPTS, PARAMS, step=STEP)
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-4, rtol=0)
    dist.barrier()


def test_rollout_tp_above_the_kv_heads_replicates_them():
    """Issue 39 item 8: rollout.tp 2 with one KV head (verl/vLLM replicate KV heads)."""
    run_distributed(_generate_replicated_kv, 2)
