"""python -m rlhf.eval on CUDA: the loaded model stays on the host, only the sampler's weights reach the GPU."""

from __future__ import annotations

from tests._assets import write_tiny_assets
from tests.gpu._gpu import GPU

pytestmark = GPU


def test_eval_on_cuda_moves_only_the_sampler_weights(tmp_path, monkeypatch):
    from rlhf import eval as rlhf_eval
    from rlhf.models import loading

    real, loaded = loading.load_causal_lm, []
    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    assets = write_tiny_assets(tmp_path / "a", n_train=4, n_val=8, n_sft=4)
    args = rlhf_eval.parse_args(["--model", str(assets / "model"), "--data", str(assets / "data" / "val.parquet"),
                                 "--max-new-tokens", "8", "--max-prompt-length", "16", "--device", "cuda",
                                 "--reward-workers", "0"])
    out = rlhf_eval.evaluate(args)
    assert out["generations"] and all(p.device.type == "cpu" for p in loaded[0].parameters())
