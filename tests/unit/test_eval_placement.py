"""python -m rlhf.eval keeps the loaded model on the host: only the sampler's weights (this rank's
--tp slices) reach the device (issue 32 item 7: the whole model went to every GPU before slicing)."""

from __future__ import annotations

from tests._assets import write_tiny_assets


def test_eval_never_moves_the_whole_model(tmp_path, monkeypatch):
    from rlhf import eval as rlhf_eval
    from rlhf.models import loading

    real = loading.load_causal_lm
    loaded = []

    def load(*a, **k):
        model = real(*a, **k)

        def refuse(*args, **kwargs):
            raise AssertionError(f"the whole model was moved: .to{args}")

        model.to = refuse
        loaded.append(model)
        return model

    monkeypatch.setattr(loading, "load_causal_lm", load)
    assets = write_tiny_assets(tmp_path / "a", n_train=4, n_val=4, n_sft=4)
    args = rlhf_eval.parse_args(["--model", str(assets / "model"), "--data", str(assets / "data" / "val.parquet"),
                                 "--max-new-tokens", "4", "--max-prompt-length", "16", "--device", "cpu",
                                 "--reward-workers", "0", "--limit", "2"])
    out = rlhf_eval.evaluate(args)
    assert loaded and all(p.device.type == "cpu" for p in loaded[0].parameters())
    assert len(out["generations"]) == 2
