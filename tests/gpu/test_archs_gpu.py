"""Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE on CUDA: the sampler's CUDA-graph decode (MoE: grouped matmul
inside the graph) against HF teacher forcing (fp32), and against eager decode (bf16)."""

from __future__ import annotations

import pytest
import torch

from rlhf.rollout import Sampler, SamplingParams
from tests._archs import ARCHS, tiny_model
from tests.gpu._gpu import GPU, PAD, random_prompts

pytestmark = GPU


@pytest.mark.parametrize("kind", ARCHS)
@torch.no_grad()
def test_cuda_graph_sampler_matches_hf_fp32_and_eager_bf16(kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(kind).cuda()
    prompts = random_prompts(8, model.config.vocab_size, lo=2, hi=12, seed=4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=3)
    out = Sampler(model.config, model.state_dict(), pad_token_id=PAD, device="cuda", max_num_seqs=16,
                  use_cuda_graph=True).generate(prompts, params)
    for row in range(out.response_ids.shape[0]):
        p, r = prompts[row // 2], out.response_ids[row, : int(out.response_lengths[row])].tolist()
        logits = model(torch.tensor([p + r], device="cuda")).logits[0, len(p) - 1: -1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r, device="cuda")[:, None]).squeeze(1)
        torch.testing.assert_close(out.log_probs[row, : len(r)], ref, atol=2e-4, rtol=0)
    bf16 = {k: v.bfloat16() for k, v in model.state_dict().items()}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    a = Sampler(model.config, bf16, pad_token_id=PAD, device="cuda", max_num_seqs=16).generate(prompts, greedy)
    b = Sampler(model.config, bf16, pad_token_id=PAD, device="cuda", max_num_seqs=16,
                use_cuda_graph=True).generate(prompts, greedy)
    assert (a.response_ids == b.response_ids).float().mean().item() >= 0.95


@torch.no_grad()
def test_moe_decode_is_captured_in_bf16_on_sm90_and_decoded_eagerly_otherwise():
    """grouped_mm is sync-free (capturable) only in bf16 on sm90/sm100 (rlhf.models.moe.grouped_mm_mode):
    there the MoE decode step is a CUDA graph; elsewhere (fp32, other GPUs) the sampler warns and decodes eagerly."""
    model = tiny_model("qwen3_moe").cuda()
    prompts = random_prompts(8, model.config.vocab_size, lo=2, hi=12, seed=5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    with pytest.warns(UserWarning, match="CUDA graphs off"):
        s32 = Sampler(model.config, model.state_dict(), pad_token_id=PAD, device="cuda", max_num_seqs=16,
                      use_cuda_graph=True)
    assert not s32.use_cuda_graph
    s32.generate(prompts, greedy)
    bf16 = {k: v.bfloat16() for k, v in model.state_dict().items()}
    if torch.cuda.get_device_capability() not in ((9, 0), (10, 0)):
        pytest.skip("grouped_mm is sync-free only on sm90 / sm100")
    a = Sampler(model.config, bf16, pad_token_id=PAD, device="cuda", max_num_seqs=16).generate(prompts, greedy)
    s = Sampler(model.config, bf16, pad_token_id=PAD, device="cuda", max_num_seqs=16, use_cuda_graph=True)
    b = s.generate(prompts, greedy)
    assert s.use_cuda_graph and s._graphs  # captured, not silently eager
    assert (a.response_ids == b.response_ids).float().mean().item() >= 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the gather kernel; flash-attn's when installed
@torch.no_grad()
def test_cuda_graph_decode_with_slots_vacated_past_the_sliding_window(dtype):
    """A window-4 model (Gemma 3) under CUDA graphs, a slot vacated at position 78 while the others
    decode in a 64-key window: the idle slot is reset (position 0), so it neither reads its old length
    nor writes NaN K/V into the scratch block the live rows read."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model("gemma3").cuda()
    w = {k: v.to(dtype) for k, v in model.state_dict().items()}
    long = [(3 * i) % 50 + 2 for i in range(68)]
    prompts = [[5, 6, 7], long, [9, 10, 11], long[:40], [12, 13]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    for regions in (False, True):
        kw = dict(pad_token_id=PAD, device="cuda", max_num_seqs=2, slot_regions=regions)
        a = Sampler(model.config, w, **kw).generate(prompts, greedy)
        s = Sampler(model.config, w, use_cuda_graph=True, **kw)
        b = s.generate(prompts, greedy)
        assert b.log_probs.isfinite().all() and s._graphs
        match = (a.response_ids == b.response_ids).float().mean().item()
        assert match >= (0.95 if dtype == torch.float32 else 0.9), (regions, match)  # kernels' shapes differ
