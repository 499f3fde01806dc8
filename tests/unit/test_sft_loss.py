"""The SFT loss is the textbook one: on a fixed batch it equals a plain per-token cross-entropy over
the response tokens (HF's shift-by-one, one unpadded row at a time, written independently of the
project's log-prob passes), and splitting the batch into micro-batches changes neither the loss
nor the gradients (each micro-batch is divided by the step's token count, not its own)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf.train.sft import sft_loss
from tests.unit.test_sft_packed import _model  # the same tiny double-precision Qwen2


def _examples() -> list:
    g = torch.Generator().manual_seed(3)
    out = []
    for p_len, r_len in ((4, 7), (2, 3), (6, 9), (3, 5), (5, 2)):
        p = torch.randint(1, 50, (p_len,), generator=g).tolist()
        r = torch.randint(1, 50, (r_len,), generator=g).tolist()
        m = [1] * r_len
        if r_len > 6:  # a hole (a tool result): no loss on it
            m[1:3] = [0, 0]
        out.append((p, r, m))
    return out


def plain_cross_entropy(model: torch.nn.Module, examples: list) -> torch.Tensor:
    """Mean next-token cross-entropy over the loss-masked response tokens, one row at a time, unpadded."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for p, r, m in examples:
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, :-1]  # position t predicts token t + 1
        ce = F.cross_entropy(logits, ids[0, 1:], reduction="none")[len(p) - 1:]  # the response tokens
        total = total + (ce * torch.tensor(m, dtype=ce.dtype)).sum()
        count += sum(m)
    return total / count


@pytest.mark.parametrize("packed", [False, True])
def test_sft_loss_equals_plain_cross_entropy_on_response_tokens(packed):
    ex = _examples()
    ref_model, model = _model(), _model()
    ref = plain_cross_entropy(ref_model, ex)
    ref.backward()
    n_tok = torch.tensor(float(sum(sum(e[2]) for e in ex)), dtype=torch.float64)
    loss = sft_loss(model, ex, 0, n_tok, torch.device("cpu"), packed=packed)
    loss.backward()
    # log-probs are taken in fp32 by the RL passes, so agreement is to fp32 rounding
    assert torch.allclose(loss.double(), ref, rtol=1e-6), (loss.item(), ref.item())
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-8), name


def test_micro_batches_sum_to_the_whole_batch():
    ex = _examples()
    n_tok = torch.tensor(float(sum(sum(e[2]) for e in ex)), dtype=torch.float64)
    whole, split = _model(), _model()
    l_whole = sft_loss(whole, ex, 0, n_tok, torch.device("cpu"), packed=False)
    l_whole.backward()
    l_split = sum(sft_loss(split, ex[i:i + 2], 0, n_tok, torch.device("cpu"), packed=False) for i in (0, 2, 4))
    l_split.backward()
    assert torch.allclose(l_whole, l_split, rtol=1e-6)
    for (name, p), q in zip(whole.named_parameters(), split.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-8), name
