"""The built-in sampler on CUDA: bf16 against HF, log-probs against the trainer, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.logprobs import forward_log_probs
from rlhf.rollout import Sampler, SamplingParams
from tests.gpu._gpu import GPU, PAD, qwen2_model, random_prompts

pytestmark = GPU

# bf16 tolerance of sampler log-probs vs the trainer's recomputation (both bf16 weights,
# fp32 log-softmax): the two use different kernels (our decode vs HF SDPA over the whole
# sequence), so the logits differ by bf16 rounding, ~1e-2 relative.
BF16_MEAN_ABS = 0.02
BF16_MAX_ABS = 0.25


def _rows(prompts, out, R):
    """[left-padded prompt | response] rows and masks, the trainer's layout."""
    P = max(map(len, prompts))
    n = out.response_ids.shape[0] // len(prompts)
    ids = torch.full((len(prompts) * n, P + R), PAD, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        for j in range(n):
            r = i * n + j
            ids[r, P - len(p):P] = torch.tensor(p)
            attn[r, P - len(p):P] = 1
            L = int(out.response_lengths[r])
            ids[r, P:P + L] = out.response_ids[r, :L].cpu()
            attn[r, P:P + L] = 1
    return ids.cuda(), attn.cuda()


@torch.no_grad()
def test_bf16_greedy_matches_hf_and_logprobs_match_trainer():
    model = qwen2_model(torch.bfloat16)
    prompts = random_prompts(32, model.config.vocab_size)
    R = 48
    sampler = Sampler(model.config, model.state_dict(), pad_token_id=PAD, device="cuda")
    out = sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=R))
    ids, attn = _rows(prompts, out, R)
    # Teacher-forced agreement: HF's argmax given our prefix, at each of our positions (one
    # early flip does not cascade into counting every later position as a mismatch).
    logits = model(input_ids=ids, attention_mask=attn,
                   position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits[:, -R - 1:-1].float()
    mask = out.response_mask.cuda()
    agree = (logits.argmax(-1) == out.response_ids.cuda())[mask].float().mean().item()
    assert agree >= 0.99, f"greedy agreement with HF bf16 {agree:.4f} < 0.99"
    # free-running agreement with HF generate, reported for the closing note
    lp, _ = forward_log_probs(model, ids, attn, response_length=R)
    diff = (lp - out.log_probs.cuda()).abs()[mask]
    print(f"bf16: teacher-forced greedy agreement {agree:.4f}; log-prob |diff| mean {diff.mean():.4g} max {diff.max():.4g}")
    assert diff.mean() < BF16_MEAN_ABS and diff.max() < BF16_MAX_ABS, (diff.mean().item(), diff.max().item())


@torch.no_grad()
def test_fp32_logprobs_match_trainer():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = qwen2_model(torch.float32)
    prompts = random_prompts(16, model.config.vocab_size, seed=1)
    R = 32
    sampler = Sampler(model.config, model.state_dict(), pad_token_id=PAD, device="cuda")
    out = sampler.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=R, seed=3))
    ids, attn = _rows(prompts, out, R)
    lp, _ = forward_log_probs(model, ids, attn, response_length=R)
    mask = out.response_mask.cuda()
    torch.testing.assert_close(lp[mask], out.log_probs.cuda()[mask], rtol=0, atol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_cuda_graph_decode_equals_eager(dtype):
    """CUDA-graph decode gives the eager tokens at several batch sizes, and after the batch shrinks
    on the same sampler (graphs captured for the large batch are replayed for the small one)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = qwen2_model(dtype, seed=2)
    V = model.config.vocab_size
    weights = model.state_dict()
    eager = Sampler(model.config, weights, pad_token_id=PAD, device="cuda", max_num_seqs=64)
    graph = Sampler(model.config, weights, pad_token_id=PAD, device="cuda", max_num_seqs=64, use_cuda_graph=True)
    for batch in (64, 1, 7, 64, 3):  # shrink after the first full batch
        prompts = random_prompts(batch, V, seed=batch)
        params = SamplingParams(temperature=0.0, max_new_tokens=40)
        a, b = eager.generate(prompts, params), graph.generate(prompts, params)
        same = (a.response_ids == b.response_ids).float().mean().item()
        if dtype == torch.float32:
            assert torch.equal(a.response_ids, b.response_ids), f"batch {batch}: {same:.4f} of tokens equal"
        else:  # bf16 matmuls of different shapes round differently; allow a rare late flip
            assert same >= 0.99, f"batch {batch}: {same:.4f} of tokens equal"
    assert graph._graphs, "no CUDA graph was captured"


@torch.no_grad()
def test_flash_paged_decode_kernel_matches_the_gather_kernel():
    """flash-attn's block-table decode (the default on CUDA in bf16 when flash-attn imports) against
    the gather reference (batched-matmul attention) on the same cache: blocks in random order, uneven lengths, GQA."""
    from rlhf.models.arch import LayerAttn
    from rlhf.rollout.kv_cache import PagedKVCache
    from rlhf.rollout.paged_attention import FlashPagedAttention, GatherAttention, _flash_with_kvcache

    if _flash_with_kvcache() is None:
        pytest.skip("flash-attn is not installed")
    torch.manual_seed(0)
    b, hkv, g, d, blocks = 8, 2, 4, 64, 4
    cache = PagedKVCache(1, 64, b, hkv, blocks * 256, d, block_size=256, dtype=torch.bfloat16,
                         device=torch.device("cuda"))
    cache.start(contiguous=False)
    cache.kv.normal_()
    cache.table.copy_(torch.randperm(64, device="cuda")[: b * blocks].view(b, blocks))
    pos = torch.randint(0, blocks * 256, (b,), device="cuda")
    q = torch.randn(b, hkv, g, d, device="cuda", dtype=torch.bfloat16)
    window = int(pos.max()) + 1
    for layer in (LayerAttn(d**-0.5, None, None, 0), LayerAttn(d**-0.5, 30.0, 100, 0)):  # plain; capped + window
        out = [k.attend(cache, 0, q, k.plan(cache, b, pos, window, q.dtype), layer)
               for k in (GatherAttention(), FlashPagedAttention())]
        torch.testing.assert_close(out[1].float(), out[0].float(), atol=2e-2, rtol=2e-2)
