"""Prefix-grouped training passes vs the plain padding-free passes, in one run (issue 38 item 3).

    python bench/prefix_grouping.py                  # prompt 1024, response 128, n 8; a few minutes on 2 cores
    python bench/prefix_grouping.py --prompt 256 --groups 4 --repeats 2
    python bench/prefix_grouping.py --device cuda --hidden 1024 --layers 8 --clock wall   # one GPU (nccl)

A 1-process ``PolicyWorker`` (gloo, CPU, fp32) on the project's tiny Qwen2 model
(``rlhf.models.tiny``, ``--hidden`` / ``--layers``), ``model.use_remove_padding``. A GRPO batch of
``--groups`` prompts of ``--prompt`` tokens x ``n`` responses of ``--response`` tokens (lengths
drawn in [response/2, response]). Timed, alternating off / on ``--repeats`` times, median:

* ``logprob``: ``compute_log_probs`` over the batch (micro-batches of ``--micro`` rows, eval, no grad);
* ``update``: ``update_policy``, one mini-batch of the whole batch, micro-batches of ``--micro`` rows
  (forward, backward, grad clip, AdamW step).

Prints the per-pass ratio off / on, the largest log-prob difference of the two layouts, and one
JSON line. ``--clock cpu`` (default) uses process CPU time with one torch thread (steady on a loaded
machine); ``--clock wall --threads 2`` for an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rlhf.models.tiny import write_tiny_model  # noqa: E402
from rlhf.schema.batch import RolloutBatch  # noqa: E402
from rlhf.schema.config import ActorConfig, ModelConfig  # noqa: E402
from rlhf.train.actor import PolicyWorker  # noqa: E402


def grpo_batch(groups: int, n: int, P: int, R: int, vocab: int, seed: int = 0) -> RolloutBatch:
    """``groups x n`` rows; rows of a group share a prompt of ``P`` tokens (left-padded to P)."""
    g = torch.Generator().manual_seed(seed)
    N = groups * n
    prompts = torch.randint(3, vocab, (groups, P), generator=g).repeat_interleave(n, 0)  # [N, P]
    resp_len = torch.randint(R // 2, R + 1, (N,), generator=g)
    resp_mask = (torch.arange(R)[None] < resp_len[:, None]).long()
    resp = torch.randint(3, vocab, (N, R), generator=g) * resp_mask
    ids = torch.cat([prompts, resp], 1)
    attn = torch.cat([torch.ones(N, P, dtype=torch.long), resp_mask], 1)
    lp = lambda: -torch.rand(N, R, generator=g)  # noqa: E731
    return RolloutBatch(input_ids=ids, attention_mask=attn, responses=resp, response_mask=resp_mask.float(),
                        index=torch.arange(groups).repeat_interleave(n), rollout_log_probs=lp(),
                        truncated=torch.zeros(N, dtype=torch.bool), old_log_probs=lp(), ref_log_probs=lp(),
                        advantages=torch.randn(N, R, generator=g))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared CPU)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, timings synchronised)")
    ap.add_argument("--bf16", action="store_true", help="model.mixed_precision (bf16 compute)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    cuda = a.device == "cuda"
    if cuda:  # kernels launch asynchronously: a pass ends when the GPU has finished it
        clock = lambda: (torch.cuda.synchronize(), time.perf_counter())[1]  # noqa: E731
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp()
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0,
                            world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(a.device, (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    path = write_tiny_model(os.path.join(tmp, "model"), hidden_size=a.hidden, num_layers=a.layers,
                            intermediate_size=3 * a.hidden, max_positions=a.prompt + a.response + 8)
    N = a.groups * a.n
    actor = ActorConfig(lr=1e-5, ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=a.micro, weight_decay=0.0)
    worker = PolicyWorker(ModelConfig(path=str(path), use_remove_padding=True, mixed_precision=a.bf16,
                                      prefix_grouping=True), mesh, torch.device(a.device), actor_cfg=actor,
                          total_steps=100)
    # on the device, as the sampler's batches are (the packed layouts' plans follow the batch's device)
    batch = grpo_batch(a.groups, a.n, a.prompt, a.response, worker.hf_config.vocab_size).to(torch.device(a.device))
    times = {k: {False: [], True: []} for k in ("logprob", "update")}
    lps = {}
    for on in (False, True):  # the same weights: the two layouts' log-probs must agree
        worker.prefix_grouping = on
        lps[on], _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=a.micro)
    diff = float(((lps[True] - lps[False]).abs() * batch.response_mask).max())
    for rep in range(a.repeats + 1):  # round 0 warms up (allocator, plans) and is not timed
        for on in (False, True):
            worker.prefix_grouping = on
            t = clock()
            worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=a.micro)
            t_lp = clock() - t
            t = clock()
            worker.update_policy(batch, mini_batch_rows=N, temperature=1.0, max_response_length=a.response)
            t_up = clock() - t
            if rep:
                times["logprob"][on].append(t_lp)
                times["update"][on].append(t_up)
    med = {k: {on: statistics.median(v[on]) for on in (False, True)} for k, v in times.items()}
    out = {"device": a.device, "bf16": a.bf16, "prompt": a.prompt, "response": a.response, "n": a.n,
           "groups": a.groups, "micro": a.micro,
           "hidden": a.hidden, "layers": a.layers, "clock": a.clock, "load": os.getloadavg()[0],
           "logprob_off_s": med["logprob"][False], "logprob_on_s": med["logprob"][True],
           "logprob_speedup": med["logprob"][False] / med["logprob"][True],
           "update_off_s": med["update"][False], "update_on_s": med["update"][True],
           "update_speedup": med["update"][False] / med["update"][True],
           "max_logprob_diff": diff}
    print(f"log-prob pass: ungrouped {out['logprob_off_s']:.3f} s, grouped {out['logprob_on_s']:.3f} s -> "
          f"{out['logprob_speedup']:.2f}x")
    print(f"update step:   ungrouped {out['update_off_s']:.3f} s, grouped {out['update_on_s']:.3f} s -> "
          f"{out['update_speedup']:.2f}x")
    print(f"load average {out['load']:.1f}; max |log-prob grouped - ungrouped| = {diff:.2e}")
    print(json.dumps(out))
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
