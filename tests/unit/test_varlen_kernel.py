"""The flash-attn varlen code path on CPU, and the fallback from a broken flash-attn build.

* A kernel with flash-attn's calling convention (``reference_varlen_attention``, plain
  PyTorch) injected with ``use_varlen_kernel`` runs the packed forward exactly as flash-attn
  would on a GPU (no SDPA plan is built; the kernel gets ``[total, H, D]`` tensors and the
  int32 boundaries): log-probs and gradients equal the padded model's.
* A flash_attn package that is installed but does not import (a build for another torch /
  CUDA) used to pass the ``find_spec`` check and fail at the first forward; now it is
  imported once, reported on one warning line, and packed attention falls back to SDPA.
"""

from __future__ import annotations

import sys

import pytest
import torch

import rlhf.models.varlen_attention as va
from rlhf.models.packed import packed_forward_log_probs
from tests.unit.test_packing import _batch, _tiny, padded_reference


@pytest.mark.parametrize("family", ["qwen2", "mistral_sw"])
def test_injected_flash_convention_kernel_drives_the_packed_path(family, monkeypatch):
    model = _tiny(family)
    ids, mask, R = _batch([2, 6, 4, 1], [7, 3, 1, 5])
    resp = mask[:, -R:].float()
    weights = torch.randn(ids.shape[0], R)
    lp_ref, _ = padded_reference(model, ids, mask, response_length=R)
    g_ref = torch.autograd.grad((lp_ref * weights * resp).sum(), list(model.parameters()))

    calls = []

    def kernel(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
        assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32 and kw["causal"] is True
        calls.append(int(max_seqlen_q))
        return va.reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)

    monkeypatch.setattr(va, "_bucketed_sdpa", lambda *a, **k: pytest.fail("the SDPA path ran"))
    with va.use_varlen_kernel(kernel):
        lp, _ = packed_forward_log_probs(model, ids, mask, response_length=R)
        g = torch.autograd.grad((lp * weights * resp).sum(), list(model.parameters()))
    assert calls == [int(mask.sum(-1).max())] * model.config.num_hidden_layers
    torch.testing.assert_close(lp * resp, lp_ref * resp, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert va.varlen_kernel(torch.device("cpu"), torch.float32) is None  # nothing injected any more


def test_reference_kernel_matches_sdpa_with_a_window():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = va.reference_varlen_attention(q, k, v, cu, cu, 5, 5, causal=True, window_size=(1, 0))
    # the second sequence, each query sees itself and the key before it
    s = slice(4, 9)
    qs, ks, vs = (x[s].transpose(0, 1)[None] for x in (q, k, v))
    pos = torch.arange(5)
    allowed = (pos[:, None] - pos[None, :] >= 0) & (pos[:, None] - pos[None, :] <= 1)
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(out[s], ref[0].transpose(0, 1))


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    """A flash_attn package on sys.path whose import fails like a build for another torch."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path / 'imports')!r}).open('a').write('x')\n"
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(va, "_FLASH", {})
    monkeypatch.setattr(va, "_LOGGED", set())
    return tmp_path / "imports"


def test_broken_flash_attn_build_falls_back_to_sdpa_with_one_warning(broken_flash_attn, capsys):
    assert not va.flash_attn_available()
    assert va.flash_attn_varlen_kernel() is None and va.varlen_kernel(torch.device("cuda"), torch.bfloat16) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "flash-attn is installed but does not import" in err[0] and "undefined symbol" in err[0]
    assert broken_flash_attn.read_text() == "x"  # imported once, not per forward
    model = _tiny("qwen2")
    ids, mask, R = _batch([2, 5], [3, 6])
    lp, _ = packed_forward_log_probs(model, ids, mask, response_length=R)  # the SDPA path
    lp_ref, _ = padded_reference(model, ids, mask, response_length=R)
    resp = mask[:, -R:].float()
    torch.testing.assert_close(lp * resp, lp_ref * resp, atol=1e-5, rtol=1e-5)
