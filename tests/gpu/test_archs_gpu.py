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
