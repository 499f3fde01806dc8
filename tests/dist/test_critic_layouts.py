"""The critic in 3-D layouts against the 1-rank run, on 4 gloo ranks.

For each layout (dp2 x tp2, pp2 x dp2, pp2 x tp2, and dp4 with padding-free passes and
token-budget micro-batches), one spawn of 4 ranks computes the values of a fixed global batch and runs
one critic update (two mini-batches, clipped value loss, grad clipping); the values, the
loss, the grad norm and the updated parameters must equal the 1-rank result (fp32
tolerance). In the dp4 case the ranks hold 3, 3, 1 and 1 rows for the forward pass, so
two ranks run empty (dummy) micro-batches to keep FSDP's collectives in step.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist._dist_utils import run_distributed

# name -> (pp, dp, tp, padding-free + dynamic batch size)
LAYOUTS = {"dp2xtp2": (1, 2, 2, False), "pp2xdp2": (2, 2, 1, False), "pp2xtp2": (2, 1, 2, False),
           "dp4_packed_dynamic": (1, 4, 1, True)}
REFERENCE = (1, 1, 1, False)
N, P, R, MINI = 8, 5, 6, 4  # rows, prompt / response columns, global rows per mini-batch
UNEVEN = [[0, 1, 2], [3, 4, 5], [6], [7]]  # forward-pass rows per rank in the dp4 case
METRICS = ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean")


def _tiny_critic() -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    cfg.classifier_dropout = 0.0
    torch.manual_seed(0)
    model = transformers.Qwen2ForTokenClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    return model


def _global_batch():
    from rlhf.schema.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    prompt_len = torch.randint(1, P + 1, (N,), generator=g)
    resp_len = torch.randint(1, R + 1, (N,), generator=g)
    ids = torch.randint(3, 64, (N, P + R), generator=g)
    attn = torch.zeros(N, P + R, dtype=torch.long)
    for i in range(N):
        attn[i, P - prompt_len[i]:P + resp_len[i]] = 1
    ids = ids * attn
    mask = attn[:, P:].float()
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, responses=ids[:, P:], response_mask=mask,
                         index=torch.arange(N), rollout_log_probs=torch.zeros(N, R),
                         truncated=torch.zeros(N, dtype=torch.bool))
    batch.values = 0.3 * torch.randn(N, R, generator=g) * mask  # old values: fixed, so clipping engages
    batch.returns = torch.randn(N, R, generator=g) * mask
    return batch


def _run_layout(layout) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.rollout.reshard import gather_rollout_weights
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.schema.config import CriticConfig, ModelConfig, ParallelConfig
    from rlhf.train.critic import CriticWorker

    pp, dp, tp, packed = layout
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    cfg = CriticConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, cliprange_value=0.1, ppo_micro_batch_size_per_gpu=1,
                       ppo_max_token_len_per_gpu=12)
    worker = CriticWorker(cfg, ModelConfig(use_remove_padding=packed), mesh, torch.device("cpu"), total_steps=1,
                          max_response_length=R, build_model=_tiny_critic,
                          parallel_cfg=ParallelConfig(pp=pp, dp=dp, tp=tp, pp_microbatches=2),
                          use_dynamic_bsz=packed, forward_max_token_len=P + R)
    batch = _global_batch()
    out: dict = {}
    fwd_rows = UNEVEN[dp_rank] if packed else minibatch_major_shard(list(range(N)), dp_rank, dp, MINI)
    out["fwd_rows"] = fwd_rows
    out["values"] = worker.compute_values(batch.select(fwd_rows), micro_batch_size=1)
    rows = minibatch_major_shard(list(range(N)), dp_rank, dp, MINI)
    out["metrics"] = worker.update_critic(batch.select(rows), mini_batch_rows=MINI // dp)
    full, _ = gather_rollout_weights(worker.model, pp_group=worker.pp_group)
    out["params"] = {n: t.clone() for n, t in full.items()}
    return out


def _worker(rank: int, world: int, layouts: list, out: str) -> None:
    torch.save({layout: _run_layout(layout) for layout in layouts}, f"{out}.rank{rank}")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("critic_layouts")
    run_distributed(_worker, 1, [REFERENCE], str(d / "ref"))
    run_distributed(_worker, 4, list(LAYOUTS.values()), str(d / "par"))
    ref = torch.load(str(d / "ref.rank0"), weights_only=False)[REFERENCE]
    return ref, [torch.load(str(d / f"par.rank{r}"), weights_only=False) for r in range(4)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_critic_values_and_update_match_one_rank(results, name):
    ref, par = results
    assert ref["metrics"]["critic/grad_norm"] > 0 and 0 < ref["metrics"]["critic/vf_clipfrac"] < 1
    for rank in range(4):
        got = par[rank][LAYOUTS[name]]
        torch.testing.assert_close(got["values"], ref["values"][got["fwd_rows"]], rtol=0, atol=2e-5,
                                   msg=f"{name} rank {rank} values")
        for key in METRICS:
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), (name, rank, key)
        assert set(got["params"]) == set(ref["params"])
        for pname, value in got["params"].items():
            diff = float((value - ref["params"][pname]).abs().max())
            assert diff < 2e-5, f"{name} rank {rank} {pname}: {diff}"
    moved = max(float((ref["params"][n] - p).abs().max()) for n, p in _tiny_critic().named_parameters())
    assert moved > 1e-4  # the update really changed the parameters

