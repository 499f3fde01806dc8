"""Issue 32 on CUDA: deferred loading (bf16 checkpoint read by slices, upcast to fp32 on the GPU) equals
``from_pretrained``; top-p with the pre-filter equals the full-vocabulary sort on a GPU scan."""

from __future__ import annotations

import torch

from tests._archs import tiny_model
from tests.gpu._gpu import GPU

pytestmark = GPU


def test_deferred_load_places_upcast_slices_on_the_gpu(tmp_path):
    import rlhf.models.shard_init as shard_init
    from rlhf.models.loading import load_causal_lm

    tiny_model("qwen3_moe").to(torch.bfloat16).save_pretrained(str(tmp_path))
    want = dict(load_causal_lm(str(tmp_path)).named_parameters())
    model = load_causal_lm(str(tmp_path), deferred=True)
    shard_init.materialize_shards(model, shard_init.params_to_meta(model), torch.device("cuda"))
    for n, p in model.named_parameters():
        assert p.device.type == "cuda" and p.dtype == torch.float32, n
        assert torch.equal(p.cpu(), want[n]), n


def test_top_p_prefilter_equals_the_full_sort_on_cuda():
    from rlhf.rollout.sampling import top_p_nucleus

    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(64, 32000, generator=g) * 6, -1).cuda()
    for top_p in (0.5, 0.9, 0.99):
        p_fast, i_fast = top_p_nucleus(logp, top_p)
        p_full, i_full = top_p_nucleus(logp, top_p, prefilter=logp.shape[1])
        assert p_fast.shape[1] < logp.shape[1]
        dense = [torch.zeros_like(logp).scatter_(1, i, p) for i, p in ((i_fast, p_fast), (i_full, p_full))]
        # a GPU scan of k entries vs of the vocabulary may round the cumulative mass differently
        torch.testing.assert_close(dense[0], dense[1], rtol=1e-5, atol=1e-7)
