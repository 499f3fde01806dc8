"""A vision-language actor update on 2 gloo ranks, one of which holds only text prompts, equals the
same batch on 1 rank (padding-free, vision tower trained), and the updated weights resharded into the
sampler (tower included) give the same greedy rollouts, also with a rollout TP group of 2 (the language
model split over the two ranks, the tower whole on each); the same step with parallel.tp = 2 gives the same
log-probs and updated weights; on 1 rank the padded path with a frozen
tower gives the same log-probs and leaves the tower's weights as they were.

The text-only rank runs the vision tower on a dummy image every micro-batch
(``rlhf.models.vlm.dummy_vision_loss``): without it the tower's FSDP2 collectives would differ
between the ranks and the job would hang (the process-group timeout fails the test instead).
"""

from __future__ import annotations

import torch

from tests.dist._dist_utils import run_distributed

N, R = 8, 6


def _vlm_batch(proc):
    """8 rows: 4 with images (rows 0-3), 4 text only (rows 4-7); random responses and RL fields."""
    from PIL import Image

    from rlhf.data.multimodal import QWEN_IMAGE_TEXT
    from rlhf.schema.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    texts, mms = [], []
    for i in range(N):
        if i < 4:
            im = Image.fromarray((torch.rand(16 + 8 * (i % 2), 16, 3, generator=g) * 255).byte().numpy())
            out = proc(text=[f"<|user|>{QWEN_IMAGE_TEXT}{i}?<|assistant|>"], images=[im], return_tensors="pt")
            mms.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]})
        else:
            out = proc(text=[f"<|user|>text {i}?<|assistant|>"], return_tensors="pt")
            mms.append(None)
        texts.append(out["input_ids"][0])
    P = max(len(t) for t in texts)
    pad = proc.tokenizer.pad_token_id
    prompts = torch.full((N, P), pad, dtype=torch.long)
    pmask = torch.zeros(N, P, dtype=torch.long)
    for i, t in enumerate(texts):
        prompts[i, P - len(t):], pmask[i, P - len(t):] = t, 1
    resp_len = torch.randint(2, R + 1, (N,), generator=g)
    rmask = (torch.arange(R) < resp_len[:, None]).long()
    resp = torch.randint(10, 60, (N, R), generator=g) * rmask
    return RolloutBatch(
        input_ids=torch.cat([prompts, resp], 1), attention_mask=torch.cat([pmask, rmask], 1), responses=resp,
        response_mask=rmask.float(), index=torch.arange(N), rollout_log_probs=-torch.rand(N, R, generator=g),
        truncated=torch.zeros(N, dtype=torch.bool), old_log_probs=-torch.rand(N, R, generator=g),
        advantages=torch.randn(N, R, generator=g), multi_modal=mms)


def _full_params(model) -> dict:
    return {n: p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in model.named_parameters()}


def _update(rank: int, world: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.models.processor import load_processor
    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    batch = _vlm_batch(load_processor(model_dir))
    per = N // world
    local = batch.select(list(range(rank * per, rank * per + per)))  # rank 1 of 2: text only
    result = {}
    # 1 rank also checks the padded path with a frozen tower; the 2-rank comparison is on the padding-free path
    for packed, freeze in ((True, False), (False, True))[:3 - world]:
        mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
        cfg = ActorConfig(lr=1e-2, ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9,
                          weight_decay=0.0)
        worker = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=packed, freeze_vision_tower=freeze),
                              mesh, torch.device("cpu"), actor_cfg=cfg, total_steps=1)
        lp, _ = worker.compute_log_probs(local, temperature=1.0, micro_batch_size=2)
        metrics = worker.update_policy(local, mini_batch_rows=per, temperature=1.0, max_response_length=R)
        result[packed] = {"grad_norm": metrics["actor/grad_norm"], "log_probs": lp,
                          "response_mask": local.response_mask, "params": _full_params(worker.model)}
        if packed:  # the updated weights resharded (vision tower included) into the sampler: greedy rollouts
            from rlhf.rollout.reshard import gather_rollout_weights
            from rlhf.rollout.sampler import Sampler
            from rlhf.rollout.sampling import SamplingParams

            weights, _ = gather_rollout_weights(worker.model)
            P = local.input_ids.shape[1] - R
            prompts = [row[m.bool()].tolist() for row, m in zip(local.input_ids[:, :P], local.attention_mask[:, :P])]
            gen = Sampler(worker.hf_config, weights, pad_token_id=0).generate(
                prompts, SamplingParams(temperature=0.0, max_new_tokens=4), multi_modal=local.multi_modal)
            result[packed]["rollout"] = gen.response_ids
            if world == 2:  # rollout.tp = 2: both ranks sample all rows, the tower whole on each
                full = batch
                tp_weights, _ = gather_rollout_weights(worker.model, tp_rank=rank, tp_size=2,
                                                       tp_group=dist.group.WORLD)
                prompts = [row[m.bool()].tolist() for row, m in zip(full.input_ids[:, :P], full.attention_mask[:, :P])]
                gen = Sampler(worker.hf_config, tp_weights, pad_token_id=0, tp_group=dist.group.WORLD).generate(
                    prompts, SamplingParams(temperature=0.0, max_new_tokens=4), multi_modal=full.multi_modal)
                result[packed]["rollout_tp2"] = gen.response_ids
                result[packed]["tp2_vision_shape"] = tp_weights["model.visual.blocks.0.mlp.gate_proj.weight"].shape
    if world == 2:  # parallel.tp = 2: the language model split over both ranks (the tower whole on each)
        mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
        cfg = ActorConfig(lr=1e-2, ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9,
                          weight_decay=0.0)
        worker = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=True), mesh, torch.device("cpu"),
                              actor_cfg=cfg, total_steps=1)
        lp, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=2)
        metrics = worker.update_policy(batch, mini_batch_rows=N, temperature=1.0, max_response_length=R)
        result["tp2"] = {"grad_norm": metrics["actor/grad_norm"], "log_probs": lp, "params": _full_params(worker.model)}
    torch.save(result, f"{out}.w{world}.rank{rank}")


def test_vlm_update_with_a_text_only_rank_equals_one_rank(tmp_path):
    from rlhf.models.tiny_vlm import write_tiny_vlm

    model_dir = str(write_tiny_vlm(str(tmp_path / "m")))
    out = str(tmp_path / "out")
    run_distributed(_update, 1, model_dir, out)
    run_distributed(_update, 2, model_dir, out)
    from transformers import AutoModelForImageTextToText

    init = dict(AutoModelForImageTextToText.from_pretrained(model_dir).named_parameters())
    one = torch.load(f"{out}.w1.rank0", weights_only=False)
    two = [torch.load(f"{out}.w2.rank{r}", weights_only=False) for r in range(2)]
    lp2 = torch.cat([two[0][True]["log_probs"], two[1][True]["log_probs"]])
    torch.testing.assert_close(lp2, one[True]["log_probs"], rtol=0, atol=1e-5)
    real = one[True]["response_mask"].bool()  # the padded path leaves arbitrary values on pad tokens
    torch.testing.assert_close(one[False]["log_probs"][real], one[True]["log_probs"][real], rtol=0, atol=1e-5)
    for n, p in one[True]["params"].items():
        torch.testing.assert_close(two[0][True]["params"][n], p, rtol=1e-5, atol=1e-6, msg=n)
    # rollouts after the update: the text-only rank and the image rank sample what 1 rank does
    assert torch.equal(torch.cat([two[0][True]["rollout"], two[1][True]["rollout"]]), one[True]["rollout"])
    # rollout.tp = 2 (the language model's heads / MLP split, the vision tower replicated) samples the same
    for r in range(2):
        assert torch.equal(two[r][True]["rollout_tp2"], one[True]["rollout"])
    assert two[0][True]["tp2_vision_shape"] == init["model.visual.blocks.0.mlp.gate_proj.weight"].shape
    # parallel.tp = 2 on the same GRPO step: the log-probs, the gradient norm (a tower gradient summed from half
    # the heads would change it) and the updated weights (tower included) of 1 rank. Adam's first step is
    # lr * g / |g| per weight: where g is ~0 the tp partial sums' rounding flips it, hence atol 1e-3 (lr 1e-2)
    torch.testing.assert_close(two[0]["tp2"]["log_probs"], one[True]["log_probs"], rtol=0, atol=1e-5)
    assert abs(two[0]["tp2"]["grad_norm"] - one[True]["grad_norm"]) < 1e-5 * one[True]["grad_norm"]
    for n, p in one[True]["params"].items():
        torch.testing.assert_close(two[0]["tp2"]["params"][n], p, rtol=0, atol=1e-3, msg=n)
    for packed in (True, False):
        moved = {n for n, p in one[packed]["params"].items() if not torch.equal(p, init[n].detach())}
        moved_visual = [n for n in moved if n.startswith("model.visual.")]
        assert any(n.startswith("model.language_model.") for n in moved)
        # trained (packed run): the images moved the tower; frozen (padded run): it keeps its weights
        assert moved_visual if packed else not moved_visual, (packed, moved_visual)
