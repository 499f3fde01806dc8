"""Pipeline parallel (x FSDP2 dp, x TP) against the single-process model, on 4 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rlhf.models.pipeline import PipelineModel, positions_from_mask, split_layers
from rlhf.models.tensor_parallel import apply_tp

from tests.dist._dist_utils import run_distributed

ATOL = 1e-5
B, L = 8, 8


def _tiny(arch: str = "qwen2", layers: int = 4, **overrides) -> torch.nn.Module:
    cfg_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    config = cfg_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return model_cls(config).float()


def _batch() -> dict[str, torch.Tensor]:
    """[B, L] ids with right padding (first half) and left padding (second half), plus
    RL loss inputs: old log-probs, advantages and a response mask."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    for i in range(B // 2):
        mask[i, L - 1 - i :] = 0  # right padding
        mask[B // 2 + i, : i + 1] = 0  # left padding
    response = mask.clone()
    response[:, :3] = 0  # first tokens are the "prompt"
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "old_log_probs": -3.0 + 0.1 * torch.randn(B, L, generator=g),
        "advantages": torch.randn(B, L, generator=g),
        "response_mask": response,
    }


def _ref_log_probs(model, ids, mask, temperature=1.0):
    """[B, L] log p(ids[:, t] | ids[:, :t]) from the unsplit HF model; column 0 is 0."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, -1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    pad = torch.nn.functional.pad
    return pad(lp, (1, 0)), pad(ent, (1, 0))


def _make_loss_fn(n_tokens: int):
    def loss_fn(log_probs, old_log_probs, advantages, response_mask):
        """Policy-gradient surrogate, token-sum normalised by the global token count."""
        ratio = (log_probs - old_log_probs).exp()
        return -(ratio * advantages * response_mask).sum() / n_tokens

    return loss_fn


def _sum_dp_grads(module: torch.nn.Module) -> None:
    for mod in module.modules():
        if hasattr(mod, "set_gradient_divide_factor"):
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _reference(model, batch):
    n_tokens = int(batch["response_mask"].sum())
    loss_fn = _make_loss_fn(n_tokens)
    lp, ent = _ref_log_probs(model, batch["input_ids"], batch["attention_mask"])
    loss = loss_fn(lp, batch["old_log_probs"], batch["advantages"], batch["response_mask"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return loss.detach(), lp.detach(), ent.detach(), grads, loss_fn


def _compare_grads(pm: PipelineModel, ref_grads: dict[str, torch.Tensor], tag: str) -> None:
    params = pm.named_hf_parameters()
    assert params, tag
    for name, p in params.items():
        assert p.grad is not None, f"{tag}: no grad for {name}"
        torch.testing.assert_close(_full(p.grad), ref_grads[name], atol=ATOL, rtol=0, msg=f"{tag} {name}")


def _check_pp_dp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    batch = _batch()
    rows = slice(dp_rank * B // 2, (dp_rank + 1) * B // 2)
    local = {k: v[rows] for k, v in batch.items()}
    loss_inputs = {k: local[k] for k in ("old_log_probs", "advantages", "response_mask")}
    cases = [
        ("qwen2", {"tie_word_embeddings": False}, "1F1B"),
        ("qwen2", {"tie_word_embeddings": False}, "GPipe"),
        ("qwen2", {"tie_word_embeddings": False}, "Interleaved1F1B"),
        ("llama", {"tie_word_embeddings": True}, "1F1B"),
    ]
    for arch, overrides, schedule in cases:
        tag = f"{arch} {overrides} {schedule}"
        ref = _tiny(arch, **overrides)
        ref_loss, ref_lp, _, ref_grads, loss_fn = _reference(ref, batch)
        pm = PipelineModel(
            copy.deepcopy(_tiny(arch, **overrides)),
            mesh["pp"],
            n_microbatches=2,
            schedule=schedule,
            device="cpu",
        )
        assert len(pm.stages) == (2 if schedule == "Interleaved1F1B" else 1)
        for stage in pm.stages:
            for layer in stage.model.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(stage, mesh=mesh["dp"])
            _sum_dp_grads(stage)

        lp = pm.forward(local["input_ids"], local["attention_mask"])
        torch.testing.assert_close(lp, ref_lp[rows], atol=ATOL, rtol=0, msg=tag)

        loss = pm.forward_backward(local["input_ids"], local["attention_mask"], loss_fn, loss_inputs)
        dist.all_reduce(loss, group=dp_group)  # each dp rank returns its half of the sum
        torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0, msg=tag)
        _compare_grads(pm, ref_grads, tag)

    pm = PipelineModel(_tiny(), mesh["pp"], n_microbatches=3, device="cpu")
    with pytest.raises(ValueError, match="batch size 4 is not divisible by n_microbatches=3"):
        pm.forward(local["input_ids"], local["attention_mask"])


def _check_pp_tp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    batch = _batch()
    ref = _tiny()
    ref_loss, ref_lp, ref_ent, ref_grads, _ = _reference(ref, batch)
    pm = PipelineModel(
        copy.deepcopy(_tiny()), mesh["pp"], n_microbatches=2, device="cpu", compute_entropy=True
    )
    for stage in pm.stages:
        apply_tp(stage, mesh["tp"], loss_parallel=True)
    assert isinstance(pm.stages[0].model.layers[str(2 * mesh["pp"].get_local_rank())].mlp.up_proj.weight, DTensor)

    out = pm.forward(batch["input_ids"], batch["attention_mask"])  # [B, L, 2]
    torch.testing.assert_close(out[..., 0], ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(out[..., 1], ref_ent, atol=ATOL, rtol=0)

    n_tokens = int(batch["response_mask"].sum())
    base = _make_loss_fn(n_tokens)

    def loss_fn(log_probs, entropy, **slices):
        assert entropy.shape == log_probs.shape
        return base(log_probs, **slices)

    loss_inputs = {k: batch[k] for k in ("old_log_probs", "advantages", "response_mask")}
    loss = pm.forward_backward(batch["input_ids"], batch["attention_mask"], loss_fn, loss_inputs)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    _compare_grads(pm, ref_grads, "pp2 x tp2")

    # Critic: token-classification head with one label -> values [B, L].
    critic_cfg = copy.deepcopy(ref.config)
    critic_cfg.num_labels = 1
    torch.manual_seed(0)
    critic = transformers.Qwen2ForTokenClassification(critic_cfg).float().eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ref_values = critic(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    pv = PipelineModel(copy.deepcopy(critic), mesh["pp"], n_microbatches=2, device="cpu", output="values")
    for stage in pv.stages:
        apply_tp(stage, mesh["tp"])
    torch.testing.assert_close(pv.forward(ids, mask), ref_values.squeeze(-1), atol=ATOL, rtol=0)


def test_pp2_dp2_forward_backward_matches_single_process() -> None:
    run_distributed(_check_pp_dp, 4)


def test_pp2_tp2_matches_single_process() -> None:
    run_distributed(_check_pp_tp, 4)


class _FakeMesh:
    def get_group(self):
        return None

    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0


def test_split_layers() -> None:
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="num_hidden_layers=3 is not divisible .* stages 2"):
        split_layers(3, 2)


def test_bad_configs_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers=3 is not divisible .* stages 2"):
        PipelineModel(_tiny(layers=3), _FakeMesh(), n_microbatches=2, device="cpu")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; valid: GPipe, 1F1B"):
        PipelineModel(_tiny(), _FakeMesh(), n_microbatches=2, schedule="zb", device="cpu")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="cannot split GPT2LMHeadModel"):
        PipelineModel(gpt2, _FakeMesh(), n_microbatches=2, device="cpu")
