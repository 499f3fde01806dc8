"""Memory planner: parameter counts against instantiated HF models, hand-computed bytes, fit decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.config.load import load_config
from rlhf.planner import GIB, ModelShape, main, parse_bytes, plan_memory
from rlhf.schema.config import Config, ConfigError

REPO = Path(__file__).resolve().parents[2]

# V=10, H=4, I=8, 2 layers, 2 heads of dim 2, 1 kv head, tied: counted by hand below.
TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 10, "hidden_size": 4,
        "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "tie_word_embeddings": True, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def _cfg(*overrides: str) -> Config:
    return load_config(None, ["model.path=x", "data.train_files=x", "data.train_batch_size=4",
                              "actor.ppo_mini_batch_size=2", *overrides])


def test_tiny_shape_by_hand():
    s = ModelShape.from_config_dict(TINY)
    # q 4x4, k 4x2, v 4x2, o 4x4, gate/up/down 3 x 4x8, q/k/v bias 4+2+2, two norms 4+4
    assert s.layer_params() == 16 + 8 + 8 + 16 + 96 + 8 + 8
    assert s.num_params() == 10 * 4 + 2 * 160 + 4  # embeddings (tied head) + layers + final norm


@pytest.mark.parametrize("arch,extra", [
    ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    ("Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    ("LlamaForCausalLM", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
    ("MistralForCausalLM", {"tie_word_embeddings": False}),
    ("Qwen3ForCausalLM", {"tie_word_embeddings": True, "head_dim": 16}),
])
def test_params_equal_instantiated_hf_model(arch, extra):
    import transformers

    d = {"architectures": [arch], "vocab_size": 97, "hidden_size": 48, "intermediate_size": 80,
         "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, **extra}
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model = getattr(transformers, arch)(config_cls(**{k: v for k, v in d.items() if k != "architectures"}))
    assert ModelShape.from_config_dict(d).num_params() == sum(p.numel() for p in model.parameters())


def test_shipped_configs_match_published_sizes():
    published = {"Qwen2.5-0.5B": 494_032_768, "Qwen2.5-1.5B": 1_543_714_304, "Qwen2.5-7B": 7_615_616_512,
                 "Qwen2.5-32B": 32_763_876_352, "Qwen2.5-72B": 72_706_203_648, "Llama-3.1-8B": 8_030_261_248}
    for name, n in published.items():
        assert ModelShape.from_model_dir(str(REPO / "configs" / "models" / name)).num_params() == n, name


def test_unknown_architecture_is_one_line():
    with pytest.raises(ConfigError, match=r"does not know architecture BertModel; known: LlamaForCausalLM"):
        ModelShape.from_config_dict({**TINY, "architectures": ["BertModel"]})


def test_generic_path_family_is_planned_llama_shaped():
    """A causal LM of the generic rollout path is planned from its sizes (as the Llama-shaped decoder)."""
    granite = ModelShape.from_config_dict({**TINY, "architectures": ["GraniteForCausalLM"]})
    llama = ModelShape.from_config_dict({**TINY, "architectures": ["LlamaForCausalLM"]})
    assert granite.num_params() == llama.num_params() > 0


def test_hand_computed_bytes_dp2_cpu():
    s = ModelShape.from_config_dict(TINY)
    cfg = _cfg("data.max_prompt_length=6", "data.max_response_length=2", "rollout.n=2", "rollout.max_num_seqs=3")
    p = plan_memory(s, cfg, world_size=2, device="cpu")
    assert p.layout["dp"] == 2
    c = p.components
    assert c["parameters"] == 364 / 2 * 4  # fp32 shard
    assert c["gradients"] == 364 / 2 * 4
    assert c["optimizer (AdamW m+v)"] == 2 * 364 / 2 * 4
    assert c["reference"] == 0  # no KL term
    assert c["rollout weights"] == 364 * 4  # full copy on every rank
    # 2 prompts per replica x n=2 = 4 sequences > max_num_seqs=3 slots; 2 layers x K|V x 2 dims x 8 tokens x 4 B
    assert p.layout["slots"] == 3
    assert c["kv cache"] == 2 * 3 * 2 * 2 * 8 * 4
    assert p.total("update") > p.total("log-probs") - c["logits (log-prob pass)"]


def test_sharding_lora_offload_and_reference():
    s = ModelShape.from_config_dict(TINY)
    base = plan_memory(s, _cfg(), world_size=1, device="cpu").components
    kl = plan_memory(s, _cfg("actor.use_kl_loss=true"), world_size=1, device="cpu").components
    assert kl["reference"] == base["parameters"]
    lora = plan_memory(s, _cfg("model.lora_rank=2", "actor.use_kl_loss=true"), world_size=1, device="cpu")
    adapters = 2 * 2 * (4 + 4 + 4 + 2 + 4 + 2 + 4 + 4 + 4 + 8 + 4 + 8 + 8 + 4)  # layers x r x (in + out) of 7 linears
    assert lora.components["gradients"] == adapters * 4
    assert lora.components["reference"] == 0  # the base with adapters off is the reference
    off = plan_memory(s, _cfg("model.param_offload=true"), world_size=1, device="cpu")
    assert off.components["parameters"] == 0 and off.host["parameters"] == base["parameters"]


def test_mixed_precision_on_cuda_halves_rollout_and_compute_copies():
    s = ModelShape.from_model_dir(str(REPO / "configs" / "models" / "Qwen2.5-7B"))
    cfg = _cfg("data.train_batch_size=8", "actor.ppo_mini_batch_size=8")
    gpu = plan_memory(s, cfg, world_size=8, device="cuda")
    cpu = plan_memory(s, cfg, world_size=8, device="cpu")
    assert gpu.components["rollout weights"] == s.num_params() * 2
    assert cpu.components["rollout weights"] == s.num_params() * 4
    assert gpu.components["parameters"] == cpu.components["parameters"] == s.num_params() / 8 * 4
    tp2 = plan_memory(s, _cfg("data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "parallel.tp=2"),
                      world_size=16, device="cuda")
    assert tp2.layout["dp"] == 8 and tp2.components["parameters"] == s.num_params() / 16 * 4
    # Only shards reach the GPU; the host holds one weight's slice at a time (checkpoint + master bytes).
    assert tp2.components["load (host slice being placed)"] == 0
    assert tp2.host["load (slice being placed)"] == s.largest_param() / 16 * (s.checkpoint_bytes + 4)
    assert cpu.components["load (host slice being placed)"] == s.largest_param() / 8 * (s.checkpoint_bytes + 4)
    lora = plan_memory(s, _cfg("data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "model.lora_rank=8"),
                       world_size=8, device="cuda")
    assert lora.host["load (slice being placed)"] == s.num_params() * 4  # peft wraps the whole loaded model


def test_fit_decision_and_bytes_parsing():
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("141GB") == 141 * 10 ** 9
    assert parse_bytes("512 MiB") == 512 * 1024 ** 2
    with pytest.raises(ConfigError, match="--device-memory"):
        parse_bytes("lots")
    p = plan_memory(ModelShape.from_config_dict(TINY), _cfg(), world_size=1, device="cpu")
    assert p.fits(int(p.peak / 0.9) + 1) and not p.fits(int(p.peak / 0.9) - 1)
    assert p.fits(int(p.peak) + 1, headroom=0.0)


def test_cli_plans_7b_on_8_gpus(tmp_path, capsys):
    model = REPO / "configs" / "models" / "Qwen2.5-7B"
    args = ["--world-size", "8", "--device", "cuda", "model.path=" + str(model), "data.train_files=x",
            "data.train_batch_size=64", "actor.ppo_mini_batch_size=16", "rollout.n=8", "parallel.tp=2",
            "actor.ppo_micro_batch_size_per_gpu=1", "model.enable_gradient_checkpointing=true",
            "rollout.max_num_seqs=64", "data.max_prompt_length=512", "data.max_response_length=1024"]
    main(args + ["--device-memory", "80GiB"])
    out = capsys.readouterr().out
    assert "world 8 = dp 4 x tp 2 x pp 1" in out and "fits: peak" in out
    with pytest.raises(SystemExit) as e:
        main(args + ["--device-memory", "8GiB"])
    assert e.value.code == 3 and "does NOT fit" in capsys.readouterr().out
    main(args + ["--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["peak_phase"] in plan["phases"] and plan["layout"]["tp"] == 2
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**TINY, "architectures": ["BertModel"]}))
    with pytest.raises(SystemExit) as e:
        main(["model.path=" + str(bad), "data.train_files=x"])
    assert e.value.code == 2 and "does not know architecture BertModel" in capsys.readouterr().err


def test_no_sync_accumulation_counts_unsharded_fp32_gradients():
    s = ModelShape.from_model_dir(str(REPO / "configs" / "models" / "Qwen2.5-7B"))
    base = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    key = "unsharded grads (no-sync accumulation)"
    default = plan_memory(s, _cfg(*base), world_size=8, device="cuda")
    opted = plan_memory(s, _cfg(*base, "model.unsharded_grad_accumulation=true"), world_size=8, device="cuda")
    assert default.components[key] == 0
    # The whole model's gradients in fp32 on every rank (~28 GiB at 7B), in the update phase, in place of the
    # sharded ones (those appear as the last backward reduce-scatters and frees the unsharded ones)
    assert opted.components[key] == s.num_params() * 4
    assert opted.total("update") - default.total("update") == s.num_params() * 4 - default.components["gradients"]
    assert opted.phases["update"]["gradients"] == 0 < default.phases["update"]["gradients"]
    pp2 = plan_memory(s, _cfg(*base, "parallel.pp=2"), world_size=8, device="cuda")  # the schedule never syncs early
    assert pp2.components[key] > 0


def test_rollout_copies_fusing_send_buffer_and_kept_sampler():
    from rlhf.train.async_rl.transfer import SEND_BUCKET_BYTES

    s = ModelShape.from_model_dir(str(REPO / "configs" / "models" / "Qwen2.5-7B"))
    base = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    colo = plan_memory(s, _cfg(*base), world_size=8, device="cuda")
    fused = (s.q_dim + 2 * s.kv_dim + 2 * s.intermediate_size) * s.hidden_size * 2  # one layer, bf16
    assert colo.components["rollout fusing (q|k|v, gate|up)"] == fused
    assert colo.phases["rollout"]["rollout weights"] == s.num_params() * 2
    # rollout.dtype: a float32 rollout on CUDA doubles the copy
    fp32 = plan_memory(s, _cfg(*base, "rollout.dtype=float32"), world_size=8, device="cuda")
    assert fp32.components["rollout weights"] == s.num_params() * 4
    # CUDA graphs keep the sampler (weights + KV cache) through the training phases
    kept = plan_memory(s, _cfg(*base, "rollout.compile=true"), world_size=8, device="cuda")
    extra = s.num_params() * 2 + kept.components["kv cache"]
    assert kept.total("update") - colo.total("update") == extra
    assert kept.total("rollout") - colo.total("rollout") == s.num_params() * 2
    # one_step_off: 4 training ranks gather their partners' weights and send them through one buffer
    off = plan_memory(s, _cfg(*base, "trainer.mode=one_step_off", "actor.tis_imp_ratio_cap=2"), world_size=8,
                      device="cuda")
    assert off.layout["dp"] == 4 and "rollout" not in off.phases
    assert off.phases["weight send"]["send buffer"] == SEND_BUCKET_BYTES
    assert off.phases["weight send"]["rollout weights (for the partner)"] == s.num_params() * 2
    assert "parameters" not in off.phases["rollout (rollout ranks)"]


def test_decode_gather_buffers_without_flash_attn_and_host_per_node():
    """Issue 32: the gather kernel's per-layer window copy and scores (CUDA without flash-attn or in fp32,
    kept in the graph pool under rollout.compile), and the host memory of a node's ranks at load."""
    from rlhf.planner import decode_gather_bytes

    s = ModelShape.from_model_dir(str(REPO / "configs" / "models" / "Qwen2.5-7B"))
    base = ["data.train_batch_size=64", "actor.ppo_mini_batch_size=64", "rollout.max_num_seqs=256",
            "data.max_prompt_length=512", "data.max_response_length=15872"]
    key = "decode gather buffers (no flash-attn)"
    flash = plan_memory(s, _cfg(*base), world_size=8, device="cuda", flash_attn=True)
    assert flash.components[key] == 0
    nof = plan_memory(s, _cfg(*base), world_size=8, device="cuda", flash_attn=False)
    slots, L = nof.layout["slots"], nof.layout["seq_len"]
    assert nof.components[key] == decode_gather_bytes(s, slots=slots, seq_len=L, rollout_tp=1, rb=2, paged=True)
    assert nof.components[key] == slots * L * (2 * s.kv_dim * 2 + s.num_heads * (2 * 2 + 4))
    assert nof.total("rollout") - flash.total("rollout") == nof.components[key]
    assert any("without flash-attn" in n for n in nof.notes)
    fp32 = plan_memory(s, _cfg(*base, "rollout.dtype=float32"), world_size=8, device="cuda", flash_attn=True)
    assert fp32.components[key] > 0  # flash-attn takes no fp32
    graphs = plan_memory(s, _cfg(*base, "rollout.compile=true"), world_size=8, device="cuda", flash_attn=False)
    all_slots = decode_gather_bytes(s, slots=256, seq_len=L, rollout_tp=1, rb=2, paged=True)
    assert graphs.components[key] == all_slots and graphs.phases["update"]["cuda-graph pool (decode gather buffers)"]
    # every slot at full length fits the KV budget: slot regions, no window copy
    regions = plan_memory(s, _cfg(*base, f"rollout.kv_cache_tokens={256 * L}"), world_size=8, device="cuda",
                          flash_attn=False)
    assert regions.components[key] == decode_gather_bytes(s, slots=regions.layout["slots"], seq_len=L, rollout_tp=1,
                                                          rb=2, paged=False)
    # host: 8 ranks of a node each hold one bf16 slice + its fp32 upcast at load, not the fp32 model
    assert s.checkpoint_bytes == 2
    assert flash.host_per_node == pytest.approx(8 * s.largest_param() / 8 * (2 + 4))
    assert flash.host_per_node < 8 * s.num_params() * 4 / 30  # it was every rank's whole fp32 model
    offload = [*base, "model.param_offload=true"]
    tight = plan_memory(s, _cfg(*offload), world_size=16, device="cuda", host_memory=48 * GIB)
    assert tight.layout["ranks_per_node"] == 8 and any("host memory at load" in n for n in tight.notes)
    assert not any("host memory at load" in n for n in flash.notes)
    one = plan_memory(s, _cfg(*offload, "model.load_ranks_per_node=1"), world_size=16, device="cuda")
    load = one.host["load (slice being placed)"]
    assert tight.host_per_node - one.host_per_node == pytest.approx(7 * load)  # only one rank's load slice at a time


def test_fsdp_unit_auto_gathers_small_models_whole_and_large_ones_per_block():
    from rlhf.models.fsdp import FSDP_MODEL_UNIT_MAX_BYTES, resolve_fsdp_unit

    assert resolve_fsdp_unit("auto", FSDP_MODEL_UNIT_MAX_BYTES) == "model"
    assert resolve_fsdp_unit("auto", FSDP_MODEL_UNIT_MAX_BYTES + 1) == "block"
    assert resolve_fsdp_unit("block", 1) == "block" and resolve_fsdp_unit("model", 2**40) == "model"
    with pytest.raises(ValueError, match="model.fsdp_unit"):
        resolve_fsdp_unit("layer", 1)
    s = ModelShape.from_config_dict(TINY)  # 364 fp32 parameters: auto = one unit
    auto = plan_memory(s, _cfg(), world_size=2, device="cpu")
    block = plan_memory(s, _cfg("model.fsdp_unit=block"), world_size=2, device="cpu")
    assert auto.components["fsdp unsharded"] == 364 * 4  # the whole model, gathered
    assert auto.phases["update"]["fsdp unsharded (+grads)"] == 2 * 364 * 4  # and its gradients
    assert block.phases["update"]["fsdp unsharded (+grads)"] < 2 * 364 * 4  # root + one block's gradients
