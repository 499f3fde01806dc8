"""Tensor parallel (and TP x FSDP2) against the single-process model, on 4 gloo ranks (every supported
family: Llama / Qwen2 / Qwen3 / Mistral, and Gemma 2 / Gemma 3 / Phi-3 / Qwen3-MoE with experts over tp)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rlhf.models.pipeline import positions_from_mask
from rlhf.models.tensor_parallel import apply_tp, tp_plan_supported, validate_tp
from rlhf.models.vocab_parallel import log_probs_from_logits, vocab_parallel_log_probs

from tests._archs import ARCHS, tiny_model
from tests.dist._dist_utils import run_distributed

ATOL = 1e-5


def _tiny(arch: str, **overrides) -> torch.nn.Module:
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    common.update(overrides)
    cls_cfg, cls_model = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    attn = common.pop("attn_implementation")
    config = cls_cfg(**common)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls_model(config).float()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """[4, 8] ids with right padding (rows 0, 1) and left padding (rows 2, 3)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, 6:] = 0
    mask[1, 5:] = 0
    mask[2, :2] = 0
    mask[3, :3] = 0
    return ids, mask


def _rl_loss(logits, ids, mask, n_tokens: int) -> torch.Tensor:
    """Masked token NLL plus an entropy bonus, normalised by the global token count."""
    lp, ent = log_probs_from_logits(logits[:, :-1], ids[:, 1:], temperature=0.9, compute_entropy=True)
    m = mask[:, 1:].float()
    return (-(lp * m).sum() - 0.01 * (ent * m).sum()) / n_tokens


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _sum_dp_grads(model: torch.nn.Module) -> None:
    """The loss is normalised by the global token count, so dp grads are summed, not
    averaged (force_sum: gloo has no AVG / PREMUL_SUM reduce-scatter)."""
    for mod in model.modules():
        if hasattr(mod, "set_gradient_divide_factor"):
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)


def _check_tp_dp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    ids, mask = _batch()
    pos = positions_from_mask(mask)
    n_tokens = int(mask[:, 1:].sum())
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    cases = [
        ("qwen2", {"tie_word_embeddings": False}, False),
        ("llama", {"tie_word_embeddings": True}, False),
        ("qwen3", {"head_dim": 8}, False),
        ("mistral", {}, True),  # sequence parallel
        *((kind, {}, False) for kind in ARCHS),  # tests/_archs.py
    ]
    for arch, overrides, sp in cases:
        ref = tiny_model(arch) if arch in ARCHS else _tiny(arch, **overrides)
        model = copy.deepcopy(ref)
        assert tp_plan_supported(model)
        apply_tp(model, mesh["tp"], sequence_parallel=sp, loss_parallel=True)
        norm_w = model.model.layers[0].input_layernorm.weight
        assert isinstance(norm_w, DTensor) == sp, "sequence parallel shards the norms' inputs"
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        _sum_dp_grads(model)

        ref_logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        _rl_loss(ref_logits, ids, mask, n_tokens).backward()

        logits = model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=pos[rows]).logits
        assert isinstance(logits, DTensor), "loss_parallel keeps logits as a vocab-sharded DTensor"
        assert logits.to_local().shape[-1] == 64 // 2
        torch.testing.assert_close(logits.full_tensor(), ref_logits[rows], atol=ATOL, rtol=0)
        loss = _rl_loss(logits, ids[rows], mask[rows], n_tokens)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        ref_loss = _rl_loss(ref_logits.detach(), ids, mask, n_tokens)
        torch.testing.assert_close(total, ref_loss, atol=ATOL, rtol=0)

        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{arch}: no grad for {name}"
            if ".experts." in name:  # Qwen3-MoE's 8 experts: 4 per tp rank, 2 per (tp, dp) rank
                assert p.to_local().shape[0] == 2, (name, p.placements)
            torch.testing.assert_close(
                _full(p.grad), ref_params[name].grad, atol=ATOL, rtol=0, msg=f"{arch} grad {name}"
            )
            torch.testing.assert_close(_full(p.data), ref_params[name].data, atol=0, rtol=0)
        if overrides.get("tie_word_embeddings"):
            assert model.lm_head.weight is model.model.embed_tokens.weight

    # loss_parallel=False: full logits as a plain local tensor.
    ref = _tiny("qwen2")
    model = copy.deepcopy(ref)
    apply_tp(model, mesh["tp"], loss_parallel=False)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert not isinstance(logits, DTensor)
    ref_logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def _check_vocab_parallel(rank: int, world_size: int) -> None:
    g = torch.Generator().manual_seed(3)
    n, vocab = 6, 12
    full = torch.randn(n, vocab, generator=g, dtype=torch.float64).float() * 3
    labels = torch.tensor([0, 3, 5, 6, 11, 7])  # every rank's slice owns some labels
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    temperature = 0.7

    ref = full.clone().requires_grad_(True)
    logp_all = torch.log_softmax(ref / temperature, -1)
    ref_lp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()

    width = vocab // world_size
    local = full[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(
        local, labels, None, vocab_start=rank * width, temperature=temperature, compute_entropy=True
    )
    torch.testing.assert_close(lp, ref_lp.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=ATOL, rtol=0)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    torch.testing.assert_close(local.grad, ref.grad[:, rank * width : (rank + 1) * width], atol=ATOL, rtol=0)

    # log-prob only: entropy is None and the gradient is onehot - p.
    local2 = local.detach().clone().requires_grad_(True)
    lp2, ent2 = vocab_parallel_log_probs(local2, labels, None, vocab_start=rank * width)
    assert ent2 is None
    lp2.sum().backward()
    ref2 = full.clone().requires_grad_(True)
    torch.log_softmax(ref2, -1).gather(-1, labels[:, None]).sum().backward()
    torch.testing.assert_close(local2.grad, ref2.grad[:, rank * width : (rank + 1) * width], atol=ATOL, rtol=0)


def test_tp2_dp2_matches_single_process() -> None:
    run_distributed(_check_tp_dp, 4)


def test_vocab_parallel_log_probs_match_unsharded() -> None:
    run_distributed(_check_vocab_parallel, 4)


class _FakeMesh:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_unsupported_architecture_names_the_class() -> None:
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    assert not tp_plan_supported(gpt2)
    # outside the fast families, the model's own base_model_tp_plan is used (rlhf.models.generic_tp); GPT-2 has none
    with pytest.raises(ValueError, match="GPT2LMHeadModel: gpt2 has no base_model_tp_plan"):
        apply_tp(gpt2, _FakeMesh(2))


@pytest.mark.parametrize(
    "overrides, tp, key",
    [
        ({}, 3, "num_attention_heads=4"),
        ({}, 4, "num_key_value_heads=2"),
        ({"num_key_value_heads": 4, "intermediate_size": 66}, 4, "intermediate_size=66"),
        ({"vocab_size": 65, "num_key_value_heads": 4}, 2, "vocab_size=65"),
    ],
)
def test_bad_sizes_name_the_product(overrides, tp, key) -> None:
    model = _tiny("qwen2", **overrides)
    with pytest.raises(ValueError, match=f"{key} is not divisible by parallel.tp={tp}"):
        validate_tp(model, tp)
    with pytest.raises(ValueError, match=key):
        apply_tp(model, _FakeMesh(tp))
