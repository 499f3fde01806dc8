"""LoRA: trainable set, save / load / merge round trips, reference = base."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from rlhf.models.lora import (
    apply_lora,
    base_weights_hf,
    export_merged,
    hf_param_name,
    load_adapter,
    lora_adapter_state_dict,
    merged_weights_for_rollout,
    reference_context,
    save_adapter,
)
from rlhf.models.packed import packed_forward_log_probs

V = 64


def _base(tie: bool = True) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
    )
    return transformers.Qwen2ForCausalLM(cfg).float().eval()


def _perturb_adapters(model) -> None:
    """peft initialises B = 0 (a no-op adapter); give it values so merges are tested."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _ids():
    return torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(5))


def test_only_adapters_trainable_and_counts():
    model = apply_lora(_base(), lora_rank=4, lora_alpha=8)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: 7 linears per layer (q,k,v,o,gate,up,down) x 2 layers x (A, B); lm_head excluded
    assert len(trainable) == 7 * 2 * 2
    assert not any("lm_head" in n for n in trainable)
    sd = lora_adapter_state_dict(model)
    assert set(sd) == {n.replace(".default", "") for n in trainable}
    assert sd["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 32)
    with pytest.raises(ValueError, match="valid names"):
        apply_lora(_base(), lora_rank=4, lora_alpha=8, target_modules=["qproj"])


def test_name_normalisation():
    assert hf_param_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert hf_param_name("base_model.model.lm_head.weight") == "lm_head.weight"
    base = _base()
    model = apply_lora(copy.deepcopy(base), lora_rank=2, lora_alpha=4)
    assert set(base_weights_hf(model)) == set(base.state_dict())


def test_reference_context_equals_base_model():
    base = _base()
    ids = _ids()
    want = base(input_ids=ids).logits
    model = apply_lora(copy.deepcopy(base), lora_rank=4, lora_alpha=8)
    _perturb_adapters(model)
    assert not torch.allclose(model(input_ids=ids).logits, want, atol=1e-4)
    with reference_context(model):
        torch.testing.assert_close(model(input_ids=ids).logits, want)
    assert not torch.allclose(model(input_ids=ids).logits, want, atol=1e-4)  # adapters back on
    with pytest.raises(TypeError, match="peft model"):
        reference_context(base)


def test_merged_weights_equal_peft_forward():
    base = _base()
    ids = _ids()
    model = apply_lora(copy.deepcopy(base), lora_rank=4, lora_alpha=16)
    _perturb_adapters(model)
    want = model(input_ids=ids).logits
    cached = {k: v.clone() for k, v in base.state_dict().items()}  # rollout's cached base, HF names
    merged = merged_weights_for_rollout(cached, lora_adapter_state_dict(model), lora_alpha=16, lora_rank=4)
    # hand check on one layer: W + (alpha/r) B A
    sd = lora_adapter_state_dict(model)
    k = "model.layers.1.mlp.down_proj"
    A, B = sd[f"base_model.model.{k}.lora_A.weight"], sd[f"base_model.model.{k}.lora_B.weight"]
    torch.testing.assert_close(merged[f"{k}.weight"], cached[f"{k}.weight"] + 4.0 * B @ A)
    assert merged["model.embed_tokens.weight"] is cached["model.embed_tokens.weight"]  # untouched, not copied
    rollout = _base()
    rollout.load_state_dict(merged)
    torch.testing.assert_close(rollout(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


def test_save_load_adapter_round_trip(tmp_path):
    base = _base()
    ids = _ids()
    model = apply_lora(copy.deepcopy(base), lora_rank=4, lora_alpha=8)
    _perturb_adapters(model)
    want = model(input_ids=ids).logits
    save_adapter(model, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    loaded = load_adapter(copy.deepcopy(base), tmp_path / "adapter")
    torch.testing.assert_close(loaded(input_ids=ids).logits, want)


@pytest.mark.parametrize("tie", [True, False])
def test_export_merged_round_trip(tmp_path, tie):
    base = _base(tie)
    ids = _ids()
    model = apply_lora(copy.deepcopy(base), lora_rank=4, lora_alpha=8)
    _perturb_adapters(model)
    want = model(input_ids=ids).logits
    export_merged(model, tmp_path / "merged")
    assert list((tmp_path / "merged").glob("*.safetensors"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    torch.testing.assert_close(reloaded(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(input_ids=ids).logits, want)  # training model unchanged


def test_packed_forward_through_peft_and_grads_only_on_adapters():
    model = apply_lora(_base(), lora_rank=4, lora_alpha=8)
    _perturb_adapters(model)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    lp, _ = packed_forward_log_probs(model, ids, mask, response_length=4)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -5:-1], -1)
    ref = ref.gather(-1, ids[:, -4:, None]).squeeze(-1)
    m = mask[:, -4:].bool()
    torch.testing.assert_close(lp[m], ref[m], atol=1e-5, rtol=1e-5)
    lp.sum().backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, n
