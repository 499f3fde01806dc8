"""The sampler's per-step dispatch cuts (issue 38 item 4): decode forwards and sampling under
``torch.inference_mode``, and CPU inverse-CDF sampling without the GPU-scan guard. Both must leave the
tokens and log-probs unchanged; bench/decode_dispatch.py measures what they save."""

from __future__ import annotations

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf.models import decoder
from rlhf.rollout import Sampler, SamplingParams, sampling
from rlhf.rollout import scheduler

PAD = 0


def _sampler(**kw) -> Sampler:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    return Sampler(model.config, model.state_dict(), pad_token_id=PAD, **kw)


def test_inference_mode_decode_equals_no_grad_and_keeps_buffers_usable(monkeypatch):
    """Paged cache (the gather kernel keeps a buffer across calls), chunked prefill, top-p and a stop
    token: on and off give the same tokens and log-probs, the forward and the sampling ran in inference
    mode only when on, and a buffer the decode allocated still takes writes from a later prefill (run
    outside inference mode), which it could not if it were an inference tensor."""
    seen: dict[str, list[bool]] = {"decode": [], "sample": []}
    real_decode, real_sample = decoder.decode, scheduler.sample_next

    def decode(*a, **k):
        seen["decode"].append(torch.is_inference_mode_enabled())
        return real_decode(*a, **k)

    def sample(*a, **k):
        seen["sample"].append(torch.is_inference_mode_enabled())
        return real_sample(*a, **k)

    monkeypatch.setattr(decoder, "decode", decode)
    monkeypatch.setattr(scheduler, "sample_next", sample)
    s = _sampler(slot_regions=False, prefill_tokens=6, max_num_seqs=8)
    short = [[1, 2, 3], [4, 5, 6, 7]]
    long = [list(range(1, 15))]  # 14 tokens: prefilled in chunks of 6, reading the cache through the gather buffer
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=12, stop_token_ids=[9], seed=3)
    outs = {}
    for on in (True, False):
        s.inference_mode = on
        seen["decode"].clear(), seen["sample"].clear()
        outs[on] = [s.generate(short, params), s.generate(long, params)]
        assert seen["decode"] and set(seen["decode"]) == {on}
        assert seen["sample"] and set(seen["sample"]) == {on}
        assert not s.cache._window.is_inference()
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.equal(a.response_lengths, b.response_lengths)
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-6, rtol=0)
        assert not a.log_probs.is_inference() and not a.response_ids.is_inference()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_cpu_inverse_cdf_skips_the_scan_guard_only_for_torch_cumsum(monkeypatch):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8, 32, generator=g), -1).masked_fill(torch.rand(8, 32, generator=g) < 0.3, 0.0)
    u = torch.rand(8, generator=g).clamp_min(1e-6)
    with _Ops() as plain:
        pick = sampling.inverse_cdf(probs, u)
    assert "aten.cummin" not in plain.names
    monkeypatch.setattr(sampling, "_cumsum", lambda p, dim: torch.cumsum(p, dim))  # the seam: guard on
    with _Ops() as guarded:
        assert torch.equal(sampling.inverse_cdf(probs, u), pick)
    assert "aten.cummin" in guarded.names
