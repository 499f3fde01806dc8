"""rlhf.simulate: one rank of a 64-rank world on a fake process group, and the launch's layout errors."""

import math

import pytest
import torch
import torch.distributed as dist

from rlhf.config.load import load_config
from rlhf.models.tiny import tiny_qwen2_config
from rlhf.schema.config import ConfigError

WORLD = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The simulation builds its own (fake) default group, as `python -m rlhf.simulate` does in a fresh
    # process; the 1-process gloo group an earlier test module of this pytest process left behind goes.
    if dist.is_initialized():
        dist.destroy_process_group()
    d = tmp_path_factory.mktemp("tiny_sim")
    # 8 heads / 4 kv heads so tp 2 and rollout.tp 4 divide; a config.json only (no weights needed)
    tiny_qwen2_config(256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=128
                      ).save_pretrained(d)
    return d


def _cfg(model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=unused.parquet", "data.train_batch_size=64",
                              "actor.ppo_mini_batch_size=64", "data.max_prompt_length=16",
                              "data.max_response_length=16", "rollout.n=2", "rollout.tp=4",
                              "actor.ppo_micro_batch_size_per_gpu=2", "actor.log_prob_micro_batch_size_per_gpu=4",
                              "actor.use_dynamic_bsz=false", *extra])


def test_world_64_rank_holds_its_shards_and_sends_fsdp_traffic(model_dir):
    from rlhf.simulate import simulate

    assert not dist.is_initialized()
    # per-block FSDP2 units (a model this small would otherwise be one unit: model.fsdp_unit auto)
    sim = simulate(_cfg(model_dir, "parallel.tp=2", "model.fsdp_unit=block"), world=WORLD, rank=5, device="cpu")
    assert not dist.is_initialized()  # the fake group is torn down
    assert sim.layout["dp"] == 32 and sim.layout["tp"] == 2
    # fp32 master shards: each parameter's tp piece, dim 0 padded to a multiple of dp = 32 (FSDP2), / 32
    H, I, V, kv = 64, 128, 256, 4 * 8

    def rows(n):
        return math.ceil(n / 32) * 32

    per_layer = sum(rows(o // 2) * H for o in (H, kv, kv, I, I))  # column parallel q k v gate up: out / tp
    per_layer += rows(H) * (H // 2) + rows(H) * (I // 2)  # row parallel o, down: in / tp
    per_layer += sum(rows(n // 2) for n in (H, kv, kv))  # q/k/v biases (column)
    per_layer += 2 * rows(H)  # two RMSNorms (replicated over tp)
    full = 4 * per_layer + rows(V // 2) * H + rows(H)  # tied embedding / lm_head (vocab rows over tp), final norm
    params = sim.peaks["log-probs"]["parameters"]
    assert params == 4 * full // 32
    # AdamW: two fp32 moments of every trainable shard and a step count per tensor (50 of them), alive in
    # every phase after the first step
    assert sim.peaks["log-probs"]["optimizer"] == 2 * params + 50 * 4
    # the KV cache at its default budget: one slot per sequence of this rollout replica (64 / 16 prompts x n=2),
    # blocks of 16 tokens plus the scratch block, 4 kv heads over rollout.tp 4, fp32 on cpu
    blocks = 8 * 32 // 16
    assert sim.peaks["rollout"]["kv cache"] >= 4 * 2 * 1 * (blocks + 1) * 16 * 8 * 4
    # FSDP2: one all-gather per unit (4 blocks + root) in the log-prob forward, again in the update's
    # backward; one reduce-scatter per unit
    assert sim.calls["log-probs"]["all_gather"] == 5
    assert sim.calls["update"]["all_gather"] == 10 and sim.calls["update"]["reduce_scatter"] == 5
    assert sim.comm["update"]["reduce_scatter"] == pytest.approx(sim.comm["update"]["all_gather"] / 2, rel=0.01)
    assert sim.calls["rollout"]["all_gather"] > 0  # the reshard to the rollout layout
    assert sim.peak_phase in sim.peaks and sim.peaks["update"]["activations"] > 0


def test_rollout_runs_the_sampler_kv_cache_prefill_and_decode(model_dir):
    from rlhf.simulate import simulate

    # dp 2: each rank is a rollout replica of 32 prompts x n 2 = 64 sequences of 16 + 16 tokens
    sim = simulate(_cfg(model_dir, "rollout.tp=1", "actor.ppo_micro_batch_size_per_gpu=256",
                        "actor.log_prob_micro_batch_size_per_gpu=256"), world=2, rank=0, device="cpu")
    roll = sim.peaks["rollout"]
    # the sampler's own cache, sized as the engine sizes it on cpu: max_num_seqs (256) slots of 32 positions,
    # + the scratch block; [4 layers, 2 x 4 kv heads, 513 blocks, 16, head_dim 8] fp32
    assert roll["kv cache"] >= 4 * 8 * 513 * 16 * 8 * 4
    # a generate call's work: its [64, 16] output ids and log-probs, the prefill's and decode step's activations
    assert roll["activations"] > 64 * 16 * (8 + 4)
    # the reshard's gathered weights were handed to the sampler and fused into the same bytes (none left over)
    full = sum(4 * n for n in (4 * ((64 + 64) * 65 + 64 * 64 + 2 * 128 * 64 + 128 * 64 + 2 * 64), 256 * 64, 64))
    assert full <= roll["rollout weights"] <= full + 64
    assert sim.layout["decode_weight_bytes"] == full  # what the roofline's decode reads per step
    # a micro-batch is never larger than the rows it is cut from: this rank's 64 (log-probs) and a mini-batch's 64
    assert sim.layout["lp_rows"] == 64 and sim.layout["update_rows"] == 64


def test_pipeline_stage_holds_its_layers_buffers_and_every_stage_after_the_reshard(model_dir):
    from rlhf.models.loading import model_config
    from rlhf.ops.sim_pipeline import peer_stage_tensors
    from rlhf.simulate import _meta_builder, simulate, stage_ranks

    assert stage_ranks(2, 8) == [0, 4]
    # the last of 2 stages (rank 4 of pp 2 x dp 4), 1F1B over 2 micro-batches of 16 rows (64 x 2 / 4 / 2)
    cfg = _cfg(model_dir, "parallel.pp=2", "model.use_remove_padding=false", "model.fsdp_unit=block",
               "parallel.pp_microbatches=2", "rollout.tp=1")
    sim = simulate(cfg, world=8, rank=4, device="cpu")
    assert sim.layout["pp"] == 2 and sim.layout["pp_stage"] == 1
    H, I, V, kv, L = 64, 128, 256, 4 * 8, 32

    def rows(n):
        return math.ceil(n / 4) * 4

    layer = sum(rows(o) * H for o in (H, kv, kv, I, I)) + rows(H) * H + rows(H) * I + sum(rows(n) for n in (H, kv, kv))
    layer += 2 * rows(H)
    # 2 of 4 layers, the final norm and the lm_head (the tied embedding's copy on the last stage), / dp 4
    assert sim.peaks["log-probs"]["parameters"] == 4 * (2 * layer + rows(H) + rows(V) * H) // 4
    # the schedule's receive buffers: one [16, L, H] fp32 activation per micro-batch (no gradient
    # buffers on the last stage); activations and gradients cross the stage boundary once per micro-batch
    assert sim.peaks["update"]["pipeline buffers"] == 2 * 16 * L * H * 4
    assert sim.calls["update"]["recv"] == 2 and sim.calls["update"]["send"] == 2
    assert sim.comm["update"]["recv"] == 2 * 16 * L * H * 4
    # after the reshard every stage holds the whole model: its own layers and the peers' from the exchange
    peers = peer_stage_tensors(_meta_builder(model_config(str(model_dir)), torch.float32, "sdpa")(), 2, 1,
                               dtype=torch.float32, tp_rank=0, tp_size=1, do_slice=True)
    whole = sum(4 * math.prod(shape) for entries in peers for _, shape, _ in entries)
    # the received tensors are views of the exchange's flat buffers, so the sampler's fused q|k|v (with biases)
    # and gate|up copies of all 4 layers exist next to them (+ its rope frequencies: a few bytes)
    fused = 4 * 4 * ((H + 2 * kv) * (H + 1) + 2 * I * H)
    assert whole + fused <= sim.peaks["rollout"]["rollout weights"] <= whole + fused + 64
    assert sim.calls["rollout"]["broadcast"] == 2  # one flat broadcast per stage


def test_ulysses_rank_exchanges_heads_around_attention(model_dir):
    from rlhf.simulate import simulate

    # sp 2 x dp 4; a packed micro-batch of the 64-token budget x sp = 4 rows of 32 tokens, 64 tokens per rank
    cfg = _cfg(model_dir, "parallel.sp=2", "model.use_remove_padding=true", "model.fsdp_unit=block",
               "actor.use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=64")
    sim = simulate(cfg, world=16, rank=1, device="cpu")
    assert sim.layout["sp"] == 2 and sim.layout["lp_rows"] == 4
    # per layer: q, k, v to heads and the output back; [8 heads | 4 kv heads, 64 tokens, head_dim 8] fp32
    assert sim.calls["log-probs"]["alltoall"] == 4 * 4
    assert sim.comm["log-probs"]["alltoall"] == 4 * (8 + 4 + 4 + 8) * 64 * 8 * 4
    # the sp pair (ranks 0, 1) sits in one node of 8: its all-to-alls stay inside it (priced at NVLink), while
    # FSDP2's all-gathers over dp x sp = 16 ranks cross nodes
    assert not sim.comm_cross["log-probs"].get("alltoall")
    assert sim.comm_cross["log-probs"]["all_gather"] == sim.comm["log-probs"]["all_gather"]
    # the per-token log-probs (and entropies) of the sp slices are summed: [4 rows x 16 response tokens]
    assert sim.calls["log-probs"]["all_reduce"] == 2


def test_moe_recipe_layout_offload_replay_and_expert_parallel(tmp_path):
    from tests._archs import tiny_config

    from rlhf.simulate import simulate

    # Qwen3-MoE, 8 experts top-2, layers 0 and 2 sparse; ep 4 of dp 16, router replay R3 on packed rows (the
    # routing positions are taken on the host), parameters, gradients and AdamW offloaded to the host
    d = tmp_path / "moe"
    tiny_config("qwen3_moe").save_pretrained(d)
    cfg = _cfg(d, "parallel.ep=4", "model.use_remove_padding=true", "model.param_offload=true", "rollout.tp=1",
               "actor.router_replay=R3", "actor.use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=64",
               "actor.ppo_max_token_len_per_gpu=64", "model.fsdp_unit=block")
    sim = simulate(cfg, world=16, rank=0, device="cpu")
    assert sim.layout["ep"] == 4
    for phase in ("log-probs", "update"):  # the training state is host memory, outside the device totals
        peak = sim.peaks[phase]
        assert peak["parameters"] == peak["gradients"] == peak["optimizer"] == 0 and peak["host (offload)"] > 0
        assert peak["total"] == sum(v for k, v in peak.items() if k not in ("total", "host (offload)"))
    # per sparse layer: the counts' all-to-all, then the 64 tokens x top-2 rows [128, 64] fp32 out and back
    # (balanced routing: every ep rank gets a quarter of them, and sends as many back)
    assert sim.calls["log-probs"]["alltoall"] == 2 * 3
    assert sim.comm["log-probs"]["alltoall"] == 2 * (4 * 2 * 8 + 2 * 128 * 64 * 4)
    # the update runs the same forward, then the reverse of each token all-to-all in the backward
    assert sim.calls["update"]["alltoall"] == 2 * (3 + 2)


def test_dry_run_simulates_every_pipeline_stage(model_dir, monkeypatch):
    import rlhf.simulate as sim_mod

    # --dry-run --simulate (rlhf/cli.py) and `python -m rlhf.simulate` without --rank: one rank of each of the
    # 4 stages, each child process handed the same config (the processes themselves are not started here)
    cfg = _cfg(model_dir, "parallel.pp=4", "model.use_remove_padding=false", "rollout.tp=1")
    seen = {}

    def children(argv, ranks):
        seen["ranks"], seen["cfg"] = ranks, load_config(argv[argv.index("--config") + 1], [])
        seen["world"] = argv[argv.index("--world") + 1]
        return []

    monkeypatch.setattr(sim_mod, "_in_children", children)
    sim_mod.simulate_stages(cfg, world=16, device="cpu")
    assert seen["ranks"] == [0, 4, 8, 12] and seen["world"] == "16" and seen["cfg"] == cfg


@pytest.mark.parametrize("overrides, world", [
    (["parallel.tp=8", "rollout.tp=1"], 64),  # tp wider than the 4 kv heads
    (["parallel.pp=8", "model.use_remove_padding=false", "rollout.tp=1"], 64),  # 8 stages of 4 layers
    (["parallel.tp=2", "rollout.tp=1"], 63),  # a world that does not factor
    (["parallel.sp=16", "model.use_remove_padding=true", "rollout.tp=1"], 64),  # sp wider than the 8 heads
    (["parallel.sp=2", "parallel.pp=2", "model.use_remove_padding=true", "rollout.tp=1"], 64),  # sp with pp
])
def test_impossible_layout_fails_with_the_launch_error(model_dir, overrides, world, capsys):
    from rlhf.models.loading import model_config
    from rlhf.models.parallel import ParallelDims
    from rlhf.models.parallelize import validate_layout
    from rlhf.simulate import main

    cfg = _cfg(model_dir, *overrides)
    with pytest.raises(ConfigError) as launch:  # what RLTrainer.__init__ raises at this world
        ParallelDims.resolve(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, world, sp=cfg.parallel.sp)
        validate_layout(cfg.parallel, model_config(str(model_dir)), world, rollout_tp=cfg.rollout.tp,
                        train_batch_size=cfg.data.train_batch_size, mini_batch_size=cfg.actor.ppo_mini_batch_size,
                        n=cfg.rollout.n, use_remove_padding=cfg.model.use_remove_padding)
    args = ["--world", str(world), f"model.path={model_dir}", "data.train_files=unused.parquet",
            "data.train_batch_size=64", "actor.ppo_mini_batch_size=64", "data.max_prompt_length=16",
            "data.max_response_length=16", "rollout.n=2", "rollout.tp=4", *overrides]
    with pytest.raises(SystemExit) as ex:
        main(args)
    assert ex.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {launch.value}"
    assert not dist.is_initialized()


def test_distill_teachers_counted_as_parameters(model_dir, tmp_path):
    from rlhf.simulate import simulate

    teacher = tmp_path / "teacher"  # twice the student's layers
    tiny_qwen2_config(256, hidden_size=64, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=128
                      ).save_pretrained(teacher)
    small = ("rollout.tp=1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=1")
    base = simulate(_cfg(model_dir, *small), world=1, rank=0, device="cpu").peaks["update"]["parameters"]
    sim = simulate(_cfg(model_dir, *small, "distill.enabled=true", f"distill.teachers.t.path={teacher}"), world=1,
                   rank=0, device="cpu")
    extra = sim.peaks["update"]["parameters"] - base
    assert 1.5 * base < extra < 2.5 * base  # a student-sized shard per teacher layer pair, sharded the same way
    assert any("distill.teachers" in n for n in sim.notes)
