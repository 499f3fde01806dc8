"""rlhf.ops: datasheet lookup, measured CPU roof, and the FLOPs counter on hand-computed numbers."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from rlhf.ops.flops import matmul_params, model_flops_per_token
from rlhf.ops.hardware import gpu_spec, hbm_bandwidth, measured_matmul_flops, peak_flops


@pytest.mark.parametrize("name, label, bf16, hbm", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4e12, 3.35e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12, 2.0e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12, 3.9e12),
    ("NVIDIA H200", "H200 SXM", 989.4e12, 4.8e12),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 312e12, 2.039e12),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 312e12, 1.935e12),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB", 312e12, 1.555e12),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312e12, 1.555e12),
])
def test_gpu_table_matches_driver_names(name, label, bf16, hbm):
    spec = gpu_spec(name)
    assert spec is not None and spec.name == label
    assert spec.bf16 == bf16 and spec.hbm == hbm


def test_unknown_gpu_has_no_roof():
    assert gpu_spec("NVIDIA GeForce GTX 1080") is None


def test_cpu_roof_is_measured_and_cached():
    a = peak_flops(torch.device("cpu"), torch.float32)
    assert a is not None and a > 1e6
    assert measured_matmul_flops(torch.float32) == a        # cached: same number, no re-timing
    assert hbm_bandwidth(torch.device("cpu")) is None


def _tiny():
    # hidden 8, 2 layers, 2 heads of dim 4, 1 kv head, MLP 16, vocab 10
    return Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1)


def test_matmul_params_by_hand():
    # per layer: q 8x8 + o 8x8 = 128; k 8x4 + v 8x4 = 64; mlp 3*8*16 = 384  -> 576; x2 layers
    assert matmul_params(_tiny()) == {"layers": 1152, "lm_head": 80}


def test_flops_per_token_by_hand():
    cfg = _tiny()
    dense = 2 * (1152 + 80)                          # 2464
    full_attn = 4 * 2 * 6 * 8                        # 4 * layers * seq * q_dim = 384
    assert model_flops_per_token(cfg, 6, training=False, causal=False) == dense + full_attn
    assert model_flops_per_token(cfg, 6, training=False) == dense + full_attn / 2
    assert model_flops_per_token(cfg, 6, training=True) == 3 * (dense + full_attn / 2)


def test_head_dim_override_and_moe_refused():
    cfg = _tiny()
    cfg.head_dim = 6                                 # Qwen3-style explicit head_dim (q_dim 12, kv_dim 6)
    # per layer: q 8x12 + o 12x8 = 192; k,v 8x6 each = 96; mlp 384 -> 672
    assert matmul_params(cfg)["layers"] == 2 * 672
    cfg.num_experts = 8
    with pytest.raises(ValueError, match="mixture-of-experts"):
        matmul_params(cfg)
