"""Qwen2-MoE, Mixtral, OLMoE, GPT-OSS and DeepSeek-V3 (rlhf/models/moe_archs.py): HF checkpoints load (deferred,
by slices; DeepSeek's selection-bias buffer too) and export back unchanged, Mixtral's hub layout (per-expert
``block_sparse_moe.experts.N.w1/w2/w3``) is read by slices, the FLOP counter counts active experts (and
Qwen2-MoE's shared expert), what the sampler cannot match is refused in one line, and OLMoE's q/k norm is
exact over tp ranks with replicated KV heads.
Sampler / trainer log-probs against HF are in test_sampler_archs.py / test_trainer_archs.py, the tp2 / ep2
GRPO step in tests/dist/test_grpo_archs.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests._archs import tiny_config, tiny_model

NEW = ("qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")


def _placed(model) -> dict[str, torch.Tensor]:
    import rlhf.models.shard_init as shard_init

    host = shard_init.params_to_meta(model)
    shard_init.materialize_shards(model, host, torch.device("cpu"))
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", NEW)
def test_checkpoint_loads_by_slices_and_exports_unchanged(kind, tmp_path):
    from rlhf.models.checkpoint_reader import CheckpointIndex, checkpoint_sources
    from rlhf.models.loading import load_causal_lm

    ref = tiny_model(kind)
    ref.save_pretrained(tmp_path / "in")
    model = load_causal_lm(str(tmp_path / "in"), deferred=True)
    assert checkpoint_sources(model, CheckpointIndex(tmp_path / "in")) is not None  # read by slices
    got = _placed(model)
    want = dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for n, p in got.items():
        assert torch.equal(p, want[n]), n
    # persistent buffers too (DeepSeek-V3's selection bias decides the routes; HF initialises it to 0)
    buffers = {n: b for n, b in ref.named_buffers() if n in ref.state_dict() and "rotary" not in n}
    assert bool(buffers) == (kind == "deepseek_v3")
    for n, b in model.named_buffers():
        assert n not in buffers or torch.equal(b, buffers[n]), n
    model.save_pretrained(tmp_path / "out", safe_serialization=True)  # what export_hf writes on rank 0
    back_model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    back = {**dict(back_model.named_parameters()), **dict(back_model.named_buffers())}
    for n, p in {**want, **buffers}.items():
        assert torch.equal(back[n], p), n


def test_mixtral_hub_layout_is_read_by_slices(tmp_path):
    """Mixtral checkpoints on the hub keep one tensor per expert (w1 = gate, w3 = up, w2 = down) under
    ``block_sparse_moe``; this one is bf16: each slice is read in bf16 and upcast as it is placed."""
    from rlhf.models.checkpoint_reader import CheckpointIndex, checkpoint_sources
    from rlhf.models.loading import load_causal_lm

    ref = tiny_model("mixtral").to(torch.bfloat16)
    sd, inter = {}, ref.config.intermediate_size
    for name, t in ref.state_dict().items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                sd[name.replace("gate_up_proj", f"{e}.w1.weight")] = t[e, :inter].clone()
                sd[name.replace("gate_up_proj", f"{e}.w3.weight")] = t[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                sd[name.replace("down_proj", f"{e}.w2.weight")] = t[e].clone()
        else:
            sd[name] = t.clone()
    (tmp_path / "hub").mkdir()
    ref.config.save_pretrained(tmp_path / "hub")
    save_file(sd, str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    model = load_causal_lm(str(tmp_path / "hub"), deferred=True)
    index = CheckpointIndex(tmp_path / "hub")
    src = checkpoint_sources(model, index)
    assert src is not None
    gate_up = src["model.layers.1.mlp.experts.gate_up_proj"].read((slice(3, 5), slice(10, 22)))  # across w1 | w3
    assert gate_up.dtype == torch.bfloat16
    assert torch.equal(gate_up, ref.model.layers[1].mlp.experts.gate_up_proj.detach()[3:5, 10:22])
    got = _placed(model)
    for n, p in ref.named_parameters():
        assert got[n].dtype == torch.float32 and torch.equal(got[n], p.detach().float()), n


def test_flops_count_the_routed_and_shared_experts():
    from rlhf.ops.flops import matmul_params

    h, attn = 64, 64 * 64 * 2 + 64 * 32 * 2  # q, o and k, v of one layer
    mixtral = matmul_params(tiny_config("mixtral"))  # 3 sparse layers: 2 of 8 experts of width 16
    assert mixtral["layers"] == 3 * (attn + 2 * 3 * h * 16 + 8 * h)
    qwen2 = matmul_params(tiny_config("qwen2_moe"))  # layer 1 dense (128); shared expert 32 wide + its gate
    assert qwen2["layers"] == 3 * attn + 3 * h * 128 + 2 * (2 * 3 * h * 16 + 8 * h + 3 * h * 32 + h)


def test_mixtral_router_jitter_is_refused_in_one_line():
    from rlhf.models.decoder import check_supported

    with pytest.raises(NotImplementedError, match="router_jitter_noise=0.1 is not supported"):
        check_supported(tiny_config("mixtral", router_jitter_noise=0.1))


def test_olmoe_norm_over_tp_ranks_equals_the_whole_projection(monkeypatch):
    """The sampler's OLMoE q/k norm on each of 4 tp ranks (4 heads, 2 KV heads: each KV head on 2 ranks,
    as rlhf.rollout.reshard slices them) equals the norm of the whole projection; the all-reduce of the
    sums of squares is simulated by handing each rank the sum of every rank's local sums."""
    import rlhf.models.moe_archs as ma

    torch.manual_seed(0)
    h, kv, d, tp, m = 4, 2, 8, 4, 5
    qkv = torch.randn(m, (h + 2 * kv) * d)
    q_w, k_w = torch.randn(h * d), torch.randn(kv * d)
    full = ma.full_qk_norm(qkv, q_w, k_w, h * d, kv * d, 1e-6)
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
    heads = lambda t, r, n: t.view(m, -1, d)[:, r * n:(r + 1) * n].reshape(m, -1)  # noqa: E731
    local = [torch.cat((heads(q, r, 1), heads(k, r // 2, 1), heads(v, r // 2, 1)), -1) for r in range(tp)]
    sums = sum(torch.stack([t[:, :d].pow(2).sum(-1), t[:, d:2 * d].pow(2).sum(-1)]) for t in local)
    monkeypatch.setattr(ma.dist, "all_reduce", lambda t, group=None: t.copy_(sums))
    monkeypatch.setattr(ma.dist, "get_world_size", lambda group=None: tp)
    for r in range(tp):
        monkeypatch.setattr(ma.dist, "get_rank", lambda group=None, r=r: r)
        got = ma.full_qk_norm(local[r], q_w, k_w, d, d, 1e-6, tp_group=object())
        fq, fk, _ = full.split([h * d, kv * d, kv * d], dim=-1)
        want = torch.cat((heads(fq, r, 1), heads(fk, r // 2, 1), heads(v, r // 2, 1)), -1)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=f"rank {r}")
