"""Rollout routing replay (actor.router_replay=R3) on a tiny Qwen3-MoE, 1 rank.

(a) The sampler's recorded routes are the trainer's: prompt, generated and multi-turn observation
tokens, through chunked prefill and preemption (recompute), in the batch layout. (b) A rollout copy
with a perturbed router flips >= 5% of the routes: R3 makes the trainer use the rollout's (mismatch 0),
the sampler-vs-trainer log-prob gap falls >= 10x, and the router still gets gradients; a bf16 rollout's
routes (fewer flips) are replayed exactly too.
"""

from __future__ import annotations

import pytest
import torch

from tests._archs import write_tiny_model
from tests.unit.test_sampler_turns import CALLS, FakeTool

PROMPTS = [[2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19, 20, 21]]
P, R = 12, 24


class _Tok:
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("moe_r3"), "qwen3_moe")


def _worker(mesh, path: str, mode: str):
    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, grad_clip=1e9,
                      weight_decay=0.0, router_replay=mode)
    worker = PolicyWorker(ModelConfig(path=path, use_remove_padding=True, mixed_precision=False), mesh,
                          torch.device("cpu"), actor_cfg=cfg, total_steps=1)
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=1.0)
    return worker


def _rollout(worker, noise: float = 0.0, turns=None, **sampler_kw):
    """A rollout batch sampled from the worker's weights (the routers perturbed by ``noise``)."""
    from rlhf.rollout import Sampler, SamplingParams
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.rollout.reshard import gather_rollout_weights
    from rlhf.schema.batch import PromptBatch
    from rlhf.schema.config import RolloutConfig

    weights, _ = gather_rollout_weights(worker.model, tp_rank=0, tp_size=1, tp_group=None)
    g = torch.Generator().manual_seed(1)
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        weights[name] = weights[name] + torch.randn(weights[name].shape, generator=g) * noise
    sampler = Sampler(worker.hf_config, weights, pad_token_id=0, record_routes=True, **sampler_kw)
    stops = [*CALLS, 1] if turns is not None else [1]
    out = sampler.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=R, seed=3,
                                                   stop_token_ids=stops), turns=turns)
    engine = RolloutEngine(RolloutConfig(), _Tok(), max_prompt_length=P, max_response_length=R,
                           device=torch.device("cpu"), record_routes=True)
    k = len(PROMPTS)
    prompts = PromptBatch(prompt_ids=PROMPTS, keys=list(range(k)), ground_truths=[""] * k, data_sources=[""] * k,
                          extra_infos=[{}] * k)
    return engine.to_batch(prompts, out, 2), out


def test_sampler_routes_are_the_trainers(mesh, model_dir):
    worker = _worker(mesh, model_dir, "R2")
    tool = FakeTool()
    batch, out = _rollout(worker, turns=tool, kv_cache_tokens=64, block_size=8, prefill_tokens=4, max_num_seqs=4)
    st = out.stats
    assert st["turns"] >= 2 and st["preemptions"] + st["parked_preemptions"] >= 1 and st["observation_tokens"] > 0
    rollout = batch.routes
    assert rollout.shape == (8, P + R, 2, 2) and rollout.dtype == torch.int16
    known = (rollout >= 0).all(-1).all(-1)  # [N, P+R]
    # every token in context but the last of each trajectory was routed by the sampler, and nothing else
    last = batch.attention_mask.cumsum(1) == batch.attention_mask.sum(1, keepdim=True)
    assert torch.equal(known, batch.attention_mask.bool() & ~last)
    holes = (batch.response_mask == 0) & batch.attention_mask[:, P:].bool()
    assert (known[:, P:] & holes).any()  # observation tokens carry routes (from their prefill)
    batch.routes = None  # R2: the trainer records its own
    worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=3, record_routes=True)
    trainer = batch.routes
    same = (rollout.sort(-1).values == trainer.sort(-1).values).all(-1)  # [N, P+R, S]
    assert same[known].all(), f"{int((~same[known]).sum())} of {int(known.sum()) * 2} routes differ"


def test_r3_replays_the_rollout_routes(mesh, model_dir):
    worker = _worker(mesh, model_dir, "R3")
    batch, _ = _rollout(worker, noise=2e-2)
    mask = batch.response_mask
    replay = worker.router_replay
    gates = [m for n, m in worker.model.named_modules() if n.endswith("mlp.gate")]
    runs = {}
    for mode in ("none", "R3"):  # the same trainer weights, replay off / on
        replay.replay = mode == "R3"
        lp, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=3, record_routes=True)
        runs[mode] = dict(gap=float(((lp - batch.rollout_log_probs).abs() * mask).max()),
                          **replay.mismatch(torch.device("cpu")))
        if mode == "R3":
            batch.old_log_probs = lp
    none, r3 = runs["none"], runs["R3"]
    print("R3 figures:", runs)
    assert none["moe/routing_mismatch"] == none["moe/routing_mismatch_live"] >= 0.05, runs  # >= 5% flip
    # (live routing of later layers follows the replayed earlier ones: not the same count as without replay)
    assert r3["moe/routing_mismatch"] == 0.0 and r3["moe/routing_mismatch_live"] >= 0.05, runs
    assert r3["gap"] * 10 <= none["gap"], runs
    # A bf16 sampler against the fp32 trainer flips only ~1% of this tiny model's routes (0.013 here) and its
    # log-prob gap is bf16 rounding, which replay cannot remove (docs/benchmarks.md): R3 still replays its
    # routes exactly.
    bf16, _ = _rollout(worker, dtype=torch.bfloat16)
    for mode in ("none", "R3"):
        replay.replay = mode == "R3"
        worker.compute_log_probs(bf16, temperature=1.0, micro_batch_size=3, record_routes=True)
        runs[f"bf16_{mode}"] = replay.mismatch(torch.device("cpu"))
    assert runs["bf16_none"]["moe/routing_mismatch"] > 0 and runs["bf16_R3"]["moe/routing_mismatch"] == 0.0, runs
    batch.advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    before = [gate.weight.full_tensor().clone() for gate in gates]
    metrics = worker.update_policy(batch, mini_batch_rows=8, temperature=1.0, max_response_length=R)
    assert metrics["moe/routing_mismatch"] == 0.0 and metrics["moe/routing_mismatch_live"] >= 0.05, metrics
    assert max(float((gate.weight.full_tensor() - b).abs().max()) for gate, b in zip(gates, before)) > 0


@pytest.mark.parametrize("on_host", [False, True])
def test_route_book_positions_and_staged_writes(on_host):
    """Columns: the prompt right-aligned to W, the response from W; -1 where nothing was written. The
    staged (host) book copies its inputs at once: the slot tensors change in place afterwards."""
    from rlhf.rollout.routes import RouteBook, batch_routes

    book = RouteBook(3, 4, 3, (1, 2), torch.device("cpu"), on_host=on_host)
    book.start_rows([0, 1], 2)
    book.start_rows([2], 4)
    book.write_span(0, 0, torch.tensor([[[1, 2]], [[3, 4]]]))  # prompt of row 0 (positions 0, 1)
    rows, pos = torch.tensor([0, 2]), torch.tensor([2, 4])
    book.write_steps(rows, pos, torch.tensor([[[5, 6]], [[7, 0]]]))
    rows.fill_(1)  # compaction moves slots after the step
    t = book.table()
    assert t[0, 2:5, 0].tolist() == [[1, 2], [3, 4], [5, 6]] and t[2, 4, 0].tolist() == [7, 0]
    assert (t[1] == -1).all() and (t[0, :2] == -1).all()
    assert batch_routes(t, 4, 6).shape == (3, 9, 1, 2) and (batch_routes(t, 4, 6)[:, :2] == -1).all()
    assert torch.equal(batch_routes(t, 4, 3), t[:, 1:])
