"""Planner (and FLOP counter) on Gemma 2, Gemma 3, Phi-3 and the MoE families (GPT-OSS and DeepSeek-V3
included): parameter counts against HF, published sizes, MoE total vs active parameters, experts over tp,
the sampler's route record and the dry-run plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlhf.cli import parse_args, print_memory_plan
from rlhf.config.load import load_config
from rlhf.ops.flops import matmul_params
from rlhf.planner import ModelShape, plan_memory
from rlhf.schema.config import ConfigError
from tests._archs import ARCHS, tiny_config

REPO = Path(__file__).resolve().parents[2]
CLASS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
         "olmoe": "OlmoeForCausalLM", "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# name: (total, active per token)
PUBLISHED = {"gemma-2-2b": (2_614_341_888, 2_614_341_888), "gemma-3-1b-it": (999_885_952, 999_885_952),
             "Phi-3-mini-4k-instruct": (3_821_079_552, 3_821_079_552),
             "Qwen3-30B-A3B": (30_532_122_624, 3_353_032_704),
             # OpenAI's card: 20.91B total, 3.61B active (its active count leaves out the 0.58B embedding table)
             "gpt-oss-20b": (20_914_757_184, 4_187_440_704),
             # DeepSeek's: 671B total, 37B activated (the multi-token-prediction layer, not in the HF model, aside)
             "DeepSeek-V3": (671_026_404_352, 37_552_282_624)}


def _shape(kind: str) -> ModelShape:
    return ModelShape.from_config_dict({**tiny_config(kind).to_dict(), "architectures": [CLASS[kind]]})


@pytest.mark.parametrize("kind", [k for k in ARCHS if k in CLASS])
def test_counts_equal_instantiated_hf_model(kind):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(kind))
    assert _shape(kind).num_params() == sum(p.numel() for p in model.parameters())


def test_moe_active_params_and_flops_by_hand():
    s = _shape("qwen3_moe")  # 3 layers, layer 1 dense; 8 experts of 3 x 64 x 16, 2 routed per token
    experts = 3 * 64 * 16
    assert s.sparse_layers == 2 and s.layer_params() > s.decoder_params() / 3  # largest block: a sparse one
    assert s.num_params() - s.num_active_params() == 2 * (8 - 2) * experts
    assert s.mlp_width == 2 * 16
    cfg = tiny_config("qwen3_moe")
    attn = 3 * (64 * 64 * 2 + 64 * 32 * 2)  # q, o and k, v of 3 layers
    assert matmul_params(cfg)["layers"] == attn + 3 * 64 * 128 + 2 * (2 * experts + 8 * 64)


@pytest.mark.parametrize("name", PUBLISHED)
def test_shipped_configs_match_published_and_hf_sizes(name):
    d = str(REPO / "configs" / "models" / name)
    s = ModelShape.from_model_dir(d)
    assert (s.num_params(), s.num_active_params()) == PUBLISHED[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    assert s.num_params() == sum(p.numel() for p in model.parameters())


def _cfg(name: str, *overrides: str):
    return load_config(None, [f"model.path={REPO / 'configs' / 'models' / name}", "data.train_files=x",
                              "data.train_batch_size=64", "actor.ppo_mini_batch_size=16", "rollout.n=4",
                              "data.max_prompt_length=512", "data.max_response_length=1024", *overrides])


def test_moe_plan_splits_experts_over_tp_and_refuses_a_tp_that_does_not_divide_them(capsys):
    d = REPO / "configs" / "models" / "Qwen3-30B-A3B"
    s = ModelShape.from_model_dir(str(d))
    cfg = _cfg("Qwen3-30B-A3B", "parallel.tp=4", "rollout.tp=4")
    p = plan_memory(s, cfg, world_size=16, device="cuda")
    assert p.components["parameters"] == s.num_params() / 16 * 4  # experts too are split over tp (and dp)
    ends = s.embed_params() + s.head_params()  # the reshard keeps embedding and head whole on every rollout rank
    assert p.components["rollout weights"] == ((s.num_params() - ends) / 4 + ends) * 2
    args = parse_args("x", ["--dry-run", "--world-size", "16", "--plan-device", "cuda"])
    assert print_memory_plan(cfg, args) is False  # a config-only directory: plan printed, nothing else to check
    out = capsys.readouterr().out
    assert "30.532B parameters, 3.353B active per token (8 of 128 experts; experts split over tp)" in out
    six = ModelShape.from_config_dict({**json.loads((d / "config.json").read_text()), "num_experts": 6})
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by parallel.tp=4"):
        plan_memory(six, _cfg("Qwen3-30B-A3B", "parallel.tp=4"), world_size=4, device="cuda")
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by rollout.tp=4"):
        plan_memory(six, _cfg("Qwen3-30B-A3B", "rollout.tp=4"), world_size=4, device="cuda")


@pytest.mark.parametrize("name,tp", [("gemma-2-2b", 2), ("gemma-3-1b-it", 1), ("Phi-3-mini-4k-instruct", 2)])
def test_dry_run_plans_the_dense_families(name, tp, capsys):
    args = parse_args("x", ["--dry-run", "--world-size", "8", "--plan-device", "cuda"])
    assert print_memory_plan(_cfg(name, f"parallel.tp={tp}"), args) is False
    assert f"{PUBLISHED[name][0] / 1e9:.3f}B parameters (" in capsys.readouterr().out


def test_moe_plan_with_expert_parallel_unshards_fewer_experts(capsys):
    s = ModelShape.from_model_dir(str(REPO / "configs" / "models" / "Qwen3-30B-A3B"))
    base = plan_memory(s, _cfg("Qwen3-30B-A3B"), world_size=8, device="cuda")
    ep = plan_memory(s, _cfg("Qwen3-30B-A3B", "parallel.ep=8"), world_size=8, device="cuda")
    # the per-rank shard is the same (experts / (dp x tp) either way); a block unshards 1/ep of its experts
    assert ep.components["parameters"] == base.components["parameters"]
    assert ep.components["fsdp unsharded"] < 0.5 * base.components["fsdp unsharded"]
    assert ep.components["all-to-all buffers (ep)"] > 0 == base.components["all-to-all buffers (ep)"]
    args = parse_args("x", ["--dry-run", "--world-size", "8", "--plan-device", "cuda"])
    print_memory_plan(_cfg("Qwen3-30B-A3B", "parallel.ep=8"), args)
    out = capsys.readouterr().out
    assert "experts split over ep x tp" in out and "(ep 8 from dp)" in out
    rep = plan_memory(s, _cfg("Qwen3-30B-A3B", "rollout.ep=2"), world_size=8, device="cuda")  # rollout.ep
    routed = 48 * 128 * 3 * 2048 * 768 / 2 * 2  # half the routed experts (rollout.tp 1), bf16
    assert base.components["rollout weights"] - rep.components["rollout weights"] == pytest.approx(routed)
    with pytest.raises(ConfigError, match="parallel.ep=3 must be >= 1 and divide dp=8"):
        plan_memory(s, _cfg("Qwen3-30B-A3B", "parallel.ep=3"), world_size=8, device="cuda")


def test_moe_plan_counts_the_samplers_route_record_as_the_sampler_allocates_it():
    """The rollout's MoE route record (rlhf.rollout.routes.RouteBook, kept unless router_replay is R2): the
    planner's bytes equal the book the sampler allocates for the replica's sequences; host memory on a GPU."""
    from rlhf.rollout.routes import RouteBook

    s = ModelShape.from_model_dir(str(REPO / "configs" / "models" / "Qwen3-30B-A3B"))
    cfg = _cfg("Qwen3-30B-A3B", "parallel.ep=8", "rollout.tp=4", "actor.router_replay=R3")
    seqs = 64 // (8 // 4) * 4  # train_batch_size / rollout replicas x n
    book = RouteBook(seqs, 512, 1024, (s.sparse_layers, s.experts_per_tok), torch.device("meta"), on_host=False)
    want = book.ids.numel() * book.ids.element_size()
    assert plan_memory(s, cfg, world_size=8, device="cuda").host["rollout route record"] == want
    assert plan_memory(s, cfg, world_size=8, device="cpu").components["rollout route record"] == want
    r2 = _cfg("Qwen3-30B-A3B", "parallel.ep=8", "rollout.tp=4", "actor.router_replay=R2")
    assert plan_memory(s, r2, world_size=8, device="cuda").host.get("rollout route record", 0) == 0
