"""The offline export of a DCP checkpoint equals what ``export_hf`` gathers from the live model,
for checkpoints written by a pp2 layout and by a dp2 LoRA actor (both with activation
checkpointing, whose wrapper names must not reach the HF names)."""

from __future__ import annotations

import torch

from tests.dist._dist_utils import run_distributed


def _worker(rank: int, world: int, tmp: str) -> None:
    _check_layout(rank, world, tmp, pp=2, lora_rank=0)
    _check_layout(rank, world, tmp, pp=1, lora_rank=4)


def _check_layout(rank: int, world: int, tmp: str, *, pp: int, lora_rank: int) -> None:
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rlhf.export import export_checkpoint
    from rlhf.models.lora import load_adapter
    from rlhf.schema.config import ActorConfig, Config, ModelConfig, ParallelConfig
    from rlhf.train.actor import PolicyWorker
    from rlhf.train.checkpoint import ModelOptimState, export_hf, save_checkpoint

    run = Path(tmp) / f"run_pp{pp}_lora{lora_rank}"
    model_cfg = ModelConfig(path=f"{tmp}/base", lora_rank=lora_rank, lora_alpha=8, enable_gradient_checkpointing=True,
                            target_modules=["q_proj", "v_proj", "down_proj"] if lora_rank else "all-linear")
    mesh = init_device_mesh("cpu", (pp, world // pp, 1), mesh_dim_names=("pp", "dp", "tp"))
    actor = PolicyWorker(model_cfg, mesh, torch.device("cpu"), actor_cfg=ActorConfig(),
                         parallel_cfg=ParallelConfig(pp=pp, pp_microbatches=2))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # "trained" weights: every local shard moves (peft starts lora_B at 0)
        for p in actor.model.parameters():
            if p.requires_grad:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(torch.randn(local.shape, generator=g) * 0.2)
    ckpt = save_checkpoint(str(run), 1, {"actor": ModelOptimState(actor.model, actor.optimizer)}, {"global_step": 1})
    export_hf(actor.model, None, str(run / "hf_export"))
    if rank == 0:
        (run / "config.yaml").write_text(Config(model=model_cfg).to_yaml())
        out = export_checkpoint(ckpt, run / "exported")
        got, want = load_file(out / "model.safetensors"), load_file(run / "hf_export" / "model.safetensors")
        assert sorted(got) == sorted(want) and not any("_checkpoint_wrapped" in k for k in got)
        for name in want:
            assert torch.equal(got[name], want[name]), name
        ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(1))
        logits = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(f"{tmp}/base").eval()
        assert not torch.allclose(logits, base(input_ids=ids).logits)
        if lora_rank:
            got = load_file(out / "adapter" / "adapter_model.safetensors")
            want = load_file(run / "hf_export" / "adapter" / "adapter_model.safetensors")
            assert sorted(got) == sorted(want) and len(got) == 2 * 3 * 2  # A, B x 3 modules x 2 layers
            for name in want:
                assert torch.equal(got[name], want[name]), name
            adapted = load_adapter(base, str(out / "adapter")).eval()
            torch.testing.assert_close(adapted(input_ids=ids).logits, logits, rtol=0, atol=1e-5)
    dist.barrier()


def test_export_of_pp2_and_dp2_lora_checkpoints(tmp_path):
    from rlhf.models.tiny import write_tiny_model

    write_tiny_model(f"{tmp_path}/base", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    run_distributed(_worker, 2, str(tmp_path))
