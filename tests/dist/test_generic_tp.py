"""Tensor parallel from the model's own base_model_tp_plan (rlhf.models.generic_tp), families outside the fast
list, on 2 gloo ranks: logits and gradients equal the single-process model's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rlhf.models.generic_tp import layer_plan
from rlhf.models.tensor_parallel import apply_tp
from tests.dist._dist_utils import run_distributed

# granite: plain colwise / rowwise; olmo3: gathered q/k/v (its q / k norms span all heads), split o_proj input
KINDS = {"granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
         "olmo3": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])}


def _model(kind: str) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(kind, vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, **KINDS[kind])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
    return model


def _loss(model, ids):
    logits = model(ids).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
    return logits, -lp.mean()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(rank: int, world: int, kind: str) -> None:
    ref = _model(kind)
    tp_model = copy.deepcopy(ref)
    apply_tp(tp_model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"])
    assert isinstance(tp_model.model.layers[0].self_attn.q_proj.weight, DTensor)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    logits_ref, loss_ref = _loss(ref, ids)
    loss_ref.backward()
    logits, loss = _loss(tp_model, ids)
    loss.backward()
    torch.testing.assert_close(_full(logits), logits_ref, atol=1e-5, rtol=1e-5)
    ref_grads = dict(ref.named_parameters())
    for name, p in tp_model.named_parameters():
        torch.testing.assert_close(_full(p.grad), ref_grads[name].grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_tp_plan_equals_one_rank(kind):
    run_distributed(_check, 2, kind)


def test_unsupported_plan_style_is_named():
    config = transformers.AutoConfig.for_model("exaone4")  # its q / k norms: replicated_with_grad_allreduce
    plan, why = layer_plan(SimpleNamespace(config=config))
    assert plan is None and "'replicated_with_grad_allreduce'" in why
    plan, _ = layer_plan(SimpleNamespace(config=transformers.AutoConfig.for_model("granite")))
    assert plan == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                    "mlp.down_proj": "rowwise"}
