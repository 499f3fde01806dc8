"""Padding-free SFT (model.use_remove_padding): the packed micro-batch gives the padded pass's loss and
gradients, tool-result holes in the loss mask included."""

from __future__ import annotations

import torch
import transformers

from rlhf.train.sft import collate, sft_loss


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(cfg).double()


def _examples() -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for p_len, r_len in ((3, 9), (7, 4), (5, 12), (2, 6)):
        p = torch.randint(1, 50, (p_len,), generator=g).tolist()
        r = torch.randint(1, 50, (r_len,), generator=g).tolist()
        m = [1] * r_len
        if r_len > 6:  # a tool result in the middle of the response: no loss there
            m[2:5] = [0, 0, 0]
        out.append((p, r, m))
    return out


def test_layout_holds_prompt_then_response_with_the_loss_mask_on_the_response():
    ex = _examples()
    ids, attn, rmask = collate(ex, 0)
    for i, (p, r, m) in enumerate(ex):
        assert ids[i][attn[i].bool()].tolist() == p + r
        assert rmask[i, :len(r)].tolist() == m and rmask[i, len(r):].sum() == 0
    assert rmask.sum() == sum(sum(e[2]) for e in ex)


def test_packed_loss_and_gradients_equal_the_padded_pass():
    ex = _examples()
    n_tok = torch.tensor(float(sum(sum(e[2]) for e in ex)), dtype=torch.float64)
    results = []
    for packed in (False, True):
        model = _model()
        loss = sft_loss(model, ex, 0, n_tok, torch.device("cpu"), packed=packed)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (padded, g_padded), (packed, g_packed) = results
    assert torch.allclose(padded, packed, rtol=1e-6), (padded, packed)  # log-probs are fp32 in the packed path
    for name in g_padded:
        assert torch.allclose(g_padded[name], g_packed[name], rtol=1e-5, atol=1e-7), name
    # the holes matter: counting the tool tokens too changes the loss
    full = [(p, r, [1] * len(r)) for p, r, _ in ex]
    assert not torch.allclose(sft_loss(_model(), full, 0, n_tok, torch.device("cpu"), packed=True), packed)
