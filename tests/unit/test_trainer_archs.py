"""Trainer log-probs of Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE (padded and padding-free paths) against
HF run on each sequence alone, and the attention kernel the trainer loads them with."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.models.loading import training_attn_implementation
from rlhf.models.logprobs import forward_log_probs
from rlhf.models.packed import packed_forward_log_probs
from tests._archs import ARCHS, tiny_model

R = 6


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """[4, 16]: prompts of 10 / 7 / 4 / 9 tokens left-padded to 10, responses of 6 / 3 / 5 / 1 right-padded to 6
    (sequences longer than the 4- and 6-token sliding windows)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 64, (4, 10 + R), generator=g)
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate([(10, 6), (7, 3), (4, 5), (9, 1)]):
        mask[row, 10 - p: 10 + r] = 1
    return ids * mask, mask


@torch.no_grad()
def _reference(model, ids, mask, temperature: float) -> torch.Tensor:
    """Each row's real tokens alone through the HF model (no padding, no packing)."""
    out = torch.zeros(ids.shape[0], R)
    P = ids.shape[1] - R
    for b in range(ids.shape[0]):
        real = ids[b][mask[b].bool()]
        p = int(mask[b, :P].sum())
        logits = model(real[None]).logits[0].float() / temperature
        lp = torch.log_softmax(logits[p - 1: -1], -1).gather(1, real[p:, None]).squeeze(1)
        out[b, : lp.shape[0]] = lp
    return out


@pytest.mark.parametrize("kind", ARCHS)
def test_padded_and_packed_log_probs_match_hf(kind):
    ref_model = tiny_model(kind)
    ids, mask = _batch()
    ref = _reference(ref_model, ids, mask, 0.7)
    model = copy.deepcopy(ref_model)
    model.set_attn_implementation(training_attn_implementation(model.config, "sdpa"))
    resp_mask = mask[:, -R:].bool()
    with torch.no_grad():
        padded, _ = forward_log_probs(model, ids, mask, response_length=R, temperature=0.7)
        packed, _ = packed_forward_log_probs(model, ids, mask, response_length=R, temperature=0.7)
    torch.testing.assert_close(padded[resp_mask], ref[resp_mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[resp_mask], ref[resp_mask], atol=1e-5, rtol=0)


def test_gemma2_trains_on_the_softcapping_varlen_kernel():
    """transformers refuses sdpa for Gemma 2 (no soft-cap); the trainer loads it with the project's
    varlen attention, whose gradients equal HF's eager attention."""
    cfg = tiny_model("gemma2").config
    assert training_attn_implementation(cfg, "sdpa") == "rlhf_varlen"
    assert training_attn_implementation(cfg, "eager") == "eager"
    assert training_attn_implementation(tiny_model("gemma3").config, "sdpa") == "sdpa"
    eager = tiny_model("gemma2")
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("rlhf_varlen")
    ids, mask = _batch()
    for m in (eager, ours):
        lp, _ = forward_log_probs(m, ids, mask, response_length=R)
        (lp * mask[:, -R:]).sum().backward()
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gemma2_critic_loads_on_the_softcapping_kernel(tmp_path):
    from rlhf.train.critic import load_value_model
    from tests._archs import write_tiny_model

    critic = load_value_model(write_tiny_model(tmp_path, "gemma2"))
    assert critic.config._attn_implementation == "rlhf_varlen"
    ids, mask = _batch()
    assert critic(input_ids=ids, attention_mask=mask).logits.shape == (4, 16, 1)
