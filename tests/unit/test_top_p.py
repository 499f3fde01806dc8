"""Top-p without sorting the vocabulary (rlhf/rollout/sampling.py ``top_p_nucleus``): the same kept
tokens, probabilities and seeded draws as the full stable sort it replaces."""

from __future__ import annotations

import pytest
import torch

from rlhf.rollout import sampling
from rlhf.rollout.sampling import SamplingParams, sample_next, top_p_nucleus


def _sorted_top_p(logits, params, u):
    """The top-p path before this change: stable sort of the whole vocabulary, softmax, HF's rule."""
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    cand, idx = logp.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(cand, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= params.top_p, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs[:, :1], 0.0)
    tok = idx.gather(1, sampling.inverse_cdf(probs, u))
    return tok.squeeze(1), logp.gather(1, tok).squeeze(1)


def _logits(kind: str, rows: int = 128, vocab: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed({"peaked": 0, "flat": 1, "ties": 2}[kind])
    if kind == "flat":  # the nucleus reaches far past the pre-filter: the sort fallback
        return torch.randn(rows, vocab, generator=g) * 0.3
    x = torch.randn(rows, vocab, generator=g) * 6.0
    return x.bfloat16().float() if kind == "ties" else x  # bf16 logits: many equal values


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties"])
def test_seeded_draws_equal_the_full_sort(kind, monkeypatch):
    monkeypatch.setattr(sampling, "TOP_P_PREFILTER", 64)
    monkeypatch.setattr(sampling.top_p_nucleus, "__defaults__", (64,))
    logits = _logits(kind)
    keys = sampling.sequence_keys(5, 0, torch.arange(logits.shape[0]), torch.zeros(logits.shape[0], dtype=torch.long))
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda t, *a, **k: sorts.append(t.shape[-1]) or real_sort(t, *a, **k))
    full_sorts = 0
    for top_p, min_p, temp in ((0.9, 0.0, 1.0), (0.5, 0.0, 0.7), (0.95, 0.05, 1.0)):
        params = SamplingParams(temperature=temp, top_p=top_p, min_p=min_p)
        for step in range(2):
            u = sampling.uniforms(keys, sampling.position_keys(2, torch.device("cpu"))[step])
            sorts.clear()
            tok, logp = sample_next(logits, params, u)
            full_sorts += sum(n == logits.shape[1] for n in sorts)
            want_tok, want_logp = _sorted_top_p(logits, params, u)
            assert torch.equal(tok, want_tok), (kind, top_p, (tok != want_tok).sum())
            torch.testing.assert_close(logp, want_logp, rtol=0, atol=0)
    assert full_sorts == (6 if kind == "flat" else 0), (kind, full_sorts)  # the vocabulary sorted only when flat


@pytest.mark.parametrize("kind", ["peaked", "ties"])
def test_nucleus_is_the_same_distribution_on_both_paths(kind):
    logp = torch.log_softmax(_logits(kind), dim=-1)
    for top_p in (0.3, 0.9):
        p_fast, i_fast = top_p_nucleus(logp, top_p, prefilter=64)
        p_full, i_full = top_p_nucleus(logp, top_p, prefilter=logp.shape[1])
        assert p_fast.shape[1] == 64
        dense_fast = torch.zeros_like(logp).scatter_(1, i_fast, p_fast)
        dense_full = torch.zeros_like(logp).scatter_(1, i_full, p_full)
        assert torch.equal(dense_fast, dense_full)  # same tokens, same probabilities, bit for bit
        assert torch.equal(i_fast[:, :8], i_full[:, :8])  # and the same (stable) order
        # and the full sort's distribution (softmax of the sorted log-probs), to float round-off
        probs = torch.softmax(logp.sort(dim=-1, descending=True, stable=True)[0], -1)
        kept = (probs.cumsum(-1) - probs) < top_p
        assert torch.equal(p_full > 0, kept)
