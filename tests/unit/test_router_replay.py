"""Routing replay (actor.router_replay=R2) on a tiny Qwen3-MoE, 1 rank: routes recorded by the old-log-prob
pass, a perturbed router that flips >= 5% of them, then replay: no mismatch, a >= 10x smaller log-prob gap
to the old pass, and the router still learns. Padding-free and padded forwards."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.router_replay import replay_route, routes_differ
from tests._archs import write_tiny_model
from tests.dist._batches import random_rollout_batch


def test_replayed_weights_come_from_the_live_router():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], requires_grad=True)
    w, ids, live = replay_route(logits, 2, True, torch.tensor([[3, 2]]))
    assert ids.tolist() == [[3, 2]] and live.tolist() == [[0, 1]]
    p = torch.softmax(logits.detach(), -1)[0]
    torch.testing.assert_close(w.detach()[0], torch.stack([p[3], p[2]]) / (p[3] + p[2]))
    w[0, 0].backward()
    assert logits.grad.abs().sum() > 0  # the router gets gradients through the replayed weights
    assert routes_differ(torch.tensor([[0, 1], [1, 0], [0, 2]]), torch.tensor([[1, 0], [0, 1], [0, 1]])).tolist() \
        == [False, False, True]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


@pytest.mark.parametrize("packed", [True, False])
def test_r2_replays_the_old_routes(mesh, model_dir, packed):
    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, grad_clip=1e9,
                      weight_decay=0.0, router_replay="R2")
    worker = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=packed, mixed_precision=False), mesh,
                          torch.device("cpu"), actor_cfg=cfg, total_steps=1)
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=1.0)
    batch = random_rollout_batch(4, 2, 6, 8, worker.hf_config.vocab_size, holes=True)
    batch.old_log_probs, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=3, record_routes=True)
    assert batch.routes.shape == (8, 14, 2, 2) and batch.routes.dtype == torch.int16
    gates = [m for n, m in worker.model.named_modules() if n.endswith("mlp.gate")]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for gate in gates:  # a perturbed router: close calls flip
            gate.weight.to_local().add_(torch.randn(gate.weight.to_local().shape, generator=g) * 2e-2)
    before = [gate.weight.full_tensor().clone() for gate in gates]
    replay = worker.router_replay
    runs = {}
    for mode, on in (("none", False), ("R2", True)):  # the same weights, replay off / on
        replay.replay, replay.reference = on, batch.routes
        lp, _ = worker.forward_log_probs(batch.input_ids, batch.attention_mask, response_length=8, temperature=1.0)
        replay.reference = None
        gap = float(((lp - batch.old_log_probs).abs() * batch.response_mask).max())
        runs[mode] = dict(gap=gap, **replay.mismatch(torch.device("cpu")))
    none, r2 = runs["none"], runs["R2"]
    assert none["moe/routing_mismatch"] == none["moe/routing_mismatch_live"] >= 0.05, runs  # >= 5% flip
    assert r2["moe/routing_mismatch"] == 0.0 and r2["moe/routing_mismatch_live"] == none["moe/routing_mismatch"]
    assert r2["gap"] * 10 <= none["gap"], runs
    metrics = worker.update_policy(batch, mini_batch_rows=8, temperature=1.0, max_response_length=8)
    assert metrics["moe/routing_mismatch"] == 0.0 and metrics["moe/routing_mismatch_live"] >= 0.05, metrics
    assert max(float((gate.weight.full_tensor() - b).abs().max()) for gate, b in zip(gates, before)) > 0  # router grads


def test_aux_loss_is_transformers_load_balancing_loss(mesh, model_dir):
    """actor.router_aux_loss_coef: the collected loss equals transformers' (padded and padding-free forwards),
    reaches the update's loss and metrics, and its gradient reaches the routers."""
    from transformers import AutoModelForCausalLM

    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    batch = random_rollout_batch(4, 2, 6, 8, 64, holes=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).float()
    ref = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True).aux_loss
    for packed in (True, False):
        cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8, grad_clip=1e9, weight_decay=0.0,
                          router_aux_loss_coef=0.5)
        worker = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=packed, mixed_precision=False), mesh,
                              torch.device("cpu"), actor_cfg=cfg, total_steps=1)
        worker.router_replay.collect_aux(True)
        worker.forward_log_probs(batch.input_ids, batch.attention_mask, response_length=8, temperature=1.0)
        got = worker.router_replay.collect_aux(False)
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)
    batch.old_log_probs = batch.rollout_log_probs
    batch.advantages = torch.zeros_like(batch.response_mask)  # the policy loss has no gradient: only aux
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=1.0)
    gate = next(m for n, m in worker.model.named_modules() if n.endswith("mlp.gate"))
    before = gate.weight.full_tensor().clone()
    metrics = worker.update_policy(batch, mini_batch_rows=8, temperature=1.0, max_response_length=8)
    assert metrics["moe/aux_loss"] == pytest.approx(float(ref), rel=1e-5)
    assert float((gate.weight.full_tensor() - before).abs().max()) > 0
