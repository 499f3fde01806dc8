"""FP8 rollout weights (rlhf/models/fp8.py, the reshard's quantization) and the low-precision refusals."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhf.models import fp8
from rlhf.rollout import Sampler, SamplingParams
from rlhf.rollout.reshard import gather_rollout_weights, quantized_name, rollout_slice
from tests._archs import tiny_model

F64 = torch.float64


def _bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3's round-to-nearest bound per element: half an ulp (|w| / 16), or half the subnormal spacing."""
    if scale.shape[-1] == 1 and w.shape[-1] > 1:
        s = scale.double().expand_as(w)
    else:
        s = scale.double().repeat_interleave(128, -2)[..., : w.shape[-2], :].repeat_interleave(128, -1)[..., : w.shape[-1]]
    return torch.maximum(w.abs() / 16, s / 1024)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (3, 130, 257)])
@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_round_trip_within_the_e4m3_bound_of_a_float64_reference(shape, scheme):
    gen = torch.Generator().manual_seed(0)
    # magnitudes over six decades, so some tiles hit e4m3's subnormals relative to their scale
    w = torch.randn(shape, generator=gen, dtype=F64) * torch.logspace(-4, 2, shape[-1], dtype=F64)
    q, s = fp8.quantize(w, scheme)
    assert q.dtype == fp8.FP8 and s.dtype == torch.float32 and tuple(s.shape) == fp8.scale_shape(shape, scheme)
    err = (fp8.dequantize(q, s, F64) - w).abs()
    bound = _bound(w, s)
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())
    assert float((err / bound).max()) > 0.5  # the rounding happened (the bound is nearly reached)
    # each scale is its tile's (row's) amax / 448, from the float64 weights
    if scheme == "block":
        pad = torch.nn.functional.pad(w.abs(), (0, -shape[-1] % 128, 0, -shape[-2] % 128))
        amax = pad.unflatten(-1, (-1, 128)).unflatten(-3, (-1, 128)).amax(dim=(-3, -1))
    else:
        amax = w.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s.double(), amax / fp8.FP8_MAX, rtol=1e-6, atol=0)


def test_zero_tiles_stay_zero_without_nan():
    w = torch.zeros(130, 140)
    w[0, 0] = 3.0
    q, s = fp8.quantize(w)
    out = fp8.dequantize(q, s)
    assert torch.isfinite(out).all() and out[0, 0] == 3.0 and out.abs().sum() == 3.0


def test_experts_and_tp_shards_quantize_as_the_whole_weight():
    gen = torch.Generator().manual_seed(1)
    experts = torch.randn(4, 256, 384, generator=gen)
    q, s = fp8.quantize(experts)
    for e in range(4):  # each expert alone, and a slice of whole experts (rollout.ep / MoE over tp)
        qe, se = fp8.quantize(experts[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)
    qs, ss = fp8.quantize(experts[2:])
    assert torch.equal(q[2:].view(torch.uint8), qs.view(torch.uint8)) and torch.equal(s[2:], ss)
    w = torch.randn(512, 384, generator=gen)
    qw, sw = fp8.quantize(w)
    for name, dim, tp in (("model.layers.0.mlp.up_proj.weight", 0, 2), ("model.layers.0.mlp.down_proj.weight", 1, 3)):
        for rank in range(tp):
            qp, sp = fp8.quantize(rollout_slice(w, name, rank, tp))
            n = w.shape[dim] // tp
            assert torch.equal(qp.view(torch.uint8), qw.narrow(dim, rank * n, n).view(torch.uint8))
            assert torch.equal(sp, sw.narrow(dim, rank * n // 128, n // 128))


_MODELS: dict = {}


def _qwen2(hidden=256, inter=512, layers=1) -> torch.nn.Module:
    """A Qwen2 whose projections are whole 128 x 128 tiles (two heads of 128), built once per shape."""
    if (hidden, inter, layers) not in _MODELS:
        torch.manual_seed(0)
        cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                                       num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                       num_key_value_heads=hidden // 128, initializer_range=0.1)
        _MODELS[hidden, inter, layers] = transformers.Qwen2ForCausalLM(cfg).eval()
    return _MODELS[hidden, inter, layers]


def test_reshard_quantizes_the_linear_weights_only_and_tp_ranks_get_slices_of_the_whole():
    model = _qwen2()
    whole, _ = gather_rollout_weights(model, quantization="fp8")
    plain = dict(model.named_parameters())
    for name, p in plain.items():
        if quantized_name(name):
            assert whole[name].dtype == fp8.FP8 and fp8.scale_name(name) in whole, name
        else:  # embeddings, norms, biases, LM head
            assert torch.equal(whole[name], p), name
    assert sum(quantized_name(n) for n in plain) == 7  # q k v o gate up down
    for rank in range(2):
        part, _ = gather_rollout_weights(model, quantization="fp8", tp_rank=rank, tp_size=2)
        for name in plain:
            if quantized_name(name):  # every shard here is whole 128-row / column tiles
                want = rollout_slice(fp8.dequantize(whole[name], whole[fp8.scale_name(name)]), name, rank, 2)
                torch.testing.assert_close(fp8.dequantize(part[name], part[fp8.scale_name(name)]), want, rtol=0, atol=0)


def test_moe_reshard_keeps_the_router_and_quantizes_the_experts():
    model = tiny_model("qwen3_moe")
    weights, _ = gather_rollout_weights(model, quantization="fp8", quantization_scale="channel")
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].dtype == fp8.FP8
    assert weights["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape[-1] == 1
    assert weights["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert weights["lm_head.weight"].dtype == torch.float32 and weights["model.embed_tokens.weight"].dtype == torch.float32


PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13]]


def _generate(model, weights, **kw):
    s = Sampler(model.config, dict(weights), pad_token_id=0, **kw)
    out = s.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    return s, out


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_the_dequantized_rollout_runs_the_quantized_model(kind):
    model = _qwen2(hidden=128, inter=256, layers=2) if kind == "qwen2" else tiny_model(kind)
    q, _ = gather_rollout_weights(model, quantization="fp8")
    deq = {n: fp8.dequantize(t, q[fp8.scale_name(n)]) for n, t in q.items() if t.dtype == fp8.FP8}
    deq.update({n: t for n, t in q.items() if n not in deq and not n.endswith("_scale_inv")})
    _, got = _generate(model, q)
    _, want = _generate(model, deq)  # a bf16 model holding the quantized values: the same numbers
    assert torch.equal(got.response_ids, want.response_ids)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=0)
    _, full = _generate(model, dict(model.named_parameters()))
    assert not torch.equal(got.log_probs, full.log_probs)  # and it is not the full-precision model


def test_kernel_path_runs_scaled_mm_and_reloads_in_place(monkeypatch):
    """The FP8 matmul path, on the CPU's per-channel torch._scaled_mm: the weights stay FP8 in the sampler,
    a reload copies into them in place, and the log-probs stay near the dequantized model's."""
    monkeypatch.setitem(fp8._KERNEL_OK, ("cpu", 0, "channel"), True)
    model = _qwen2(hidden=128, inter=256, layers=2)
    q, _ = gather_rollout_weights(model, quantization="fp8", quantization_scale="channel")
    s, got = _generate(model, q, reload_in_place=True, dtype=torch.bfloat16)  # the kernels' activation dtype
    lw = s.weights.layers[0]
    assert all(isinstance(w, fp8.Fp8Weight) for w in (lw.qkv_w, lw.o_w, lw.gate_up_w, lw.down_w))
    ptr = lw.qkv_w.data.data_ptr()
    s.load_weights(dict(q))
    assert s.weights.layers[0].qkv_w.data.data_ptr() == ptr
    monkeypatch.setitem(fp8._KERNEL_OK, ("cpu", 0, "channel"), False)
    _, want = _generate(model, q, dtype=torch.bfloat16)
    # the first token (same prompt, same draw): activations rounded to e4m3 per token move its log-prob a little;
    # a wrong scale layout would move it by nats
    same = got.response_ids[:, 0] == want.response_ids[:, 0]  # (a near tie may draw another token)
    assert int(same.sum()) >= 3 and (got.log_probs[same, 0] - want.log_probs[same, 0]).abs().max() < 0.15


def test_fp8_rollout_turns_token_tis_on_and_refuses_async_modes(tmp_path):
    from rlhf.config.load import load_config
    from rlhf.schema.config import ConfigError

    base = ["model.path=m", "data.train_files=x.parquet"]
    cfg = load_config(overrides=base + ["rollout.quantization=fp8"])
    a = cfg.actor
    assert a.rollout_is_decoupled and a.rollout_is == "token" and a.rollout_is_threshold == 2.0
    assert not load_config(overrides=base + ["rollout.quantization=fp8", "actor.rollout_is=''"]).actor.rollout_is_decoupled
    kept = load_config(overrides=base + ["rollout.quantization=fp8", "actor.tis_imp_ratio_cap=3"]).actor
    assert not kept.rollout_is_decoupled and kept.tis_imp_ratio_cap == 3
    assert not load_config(overrides=base).actor.rollout_is_decoupled
    verl = load_config(overrides=base + ["actor_rollout_ref.rollout.quantization=fp8"])
    assert verl.rollout.quantization == "fp8"
    with pytest.raises(ConfigError, match="trainer.mode colocated"):
        load_config(overrides=base + ["rollout.quantization=fp8", "trainer.mode=one_step_off"])
    with pytest.raises(ConfigError, match="actor.fp8.*cpu"):
        load_config(overrides=base + ["actor.fp8=true", "trainer.device=cpu"])


def test_fp8_training_is_refused_in_one_line_without_fp8_or_torchao(monkeypatch):
    import builtins

    from rlhf.models.fp8_training import apply_fp8_training, check_fp8_training, fp8_layer
    from rlhf.schema.config import ConfigError

    with pytest.raises(ConfigError, match=r"sm89\+.*device is cpu") as e:
        apply_fp8_training(_qwen2(), torch.device("cpu"))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(fp8, "supports_fp8", lambda d: True)
    monkeypatch.setattr("rlhf.models.fp8_training.supports_fp8", lambda d: True)
    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda n, *a, **k: (_ for _ in ()).throw(ImportError(n))
                        if n.startswith("torchao") else real(n, *a, **k))
    with pytest.raises(ConfigError, match=r"pip install 'torchao>=0.12'"):
        check_fp8_training(torch.device("cuda"))
    model = _qwen2()
    chosen = {n for n, m in model.named_modules() if fp8_layer(n, m)}
    assert chosen == {f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                       "mlp.down_proj")}


def test_planner_counts_the_fp8_rollout_copy():
    from pathlib import Path

    from rlhf.config.load import load_config
    from rlhf.planner.plan import plan_memory
    from rlhf.planner.shape import ModelShape

    shape = ModelShape.from_model_dir(str(Path(__file__).resolve().parents[2] / "configs" / "models" / "Qwen2.5-7B"))
    base = ["model.path=x", "data.train_files=x", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]

    def weights(device, *extra):
        return plan_memory(shape, load_config(None, base + list(extra)), world_size=8,
                           device=device).components["rollout weights"]

    bf16 = weights("cuda", "rollout.dtype=bfloat16")
    dense = shape.fp8_kernel_params()  # 6.5B of the 7.6B parameters: the rest (embeddings, head) stays bf16
    for scheme, per in (("block", 1 + 4 / 128**2), ("channel", 1 + 4 / shape.hidden_size)):
        fp8w = weights("cuda", "rollout.dtype=bfloat16", "rollout.quantization=fp8", f"rollout.quantization_scale={scheme}")
        assert abs(fp8w - (bf16 - dense * (2 - per))) < 1.0
    assert weights("cpu", "rollout.quantization=fp8") == weights("cpu")  # dequantized in the sampler


def test_quantize_rollout_weights_after_a_lora_merge_is_the_reshards_quantization():
    from rlhf.rollout.reshard import quantize_rollout_weights

    model = _qwen2()
    plain, _ = gather_rollout_weights(model)  # e.g. LoRA's merged copy: built unquantized, quantized after
    want, _ = gather_rollout_weights(model, quantization="fp8", quantization_scale="channel")
    got = quantize_rollout_weights(dict(plain), "fp8", "channel")
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name].view(torch.uint8) if t.dtype == fp8.FP8 else got[name],
                           t.view(torch.uint8) if t.dtype == fp8.FP8 else t), name
    assert quantize_rollout_weights(dict(plain), None) == plain  # rollout.quantization off: untouched
