"""The rollout role of trainer.mode one_step_off: generate, ship the rows, take new weights.

Each rollout rank keeps one rollout copy of the weights (received from its training
partner) and runs the same sampler as colocated mode over the rollout group's layout:
the global prompt batch is split over the rollout replicas, the generated rows are
exchanged inside the group, and each rank sends its partner the rows of the partner's
dp rank. Sampling is keyed by (seed, batch number, prompt, sample), so B_j with weights
theta is the same batch colocated mode would draw at step j with theta. See
pipeline.py for the message order. With ``rollout.multi_turn`` the rollout ranks run the
agent loop and its tools (their own worker processes); the tool-use metrics travel with
the batch, summed over the rollout role as colocated mode sums them over the training ranks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from rlhf.agent.rollout import closing_agent, make_agent
from rlhf.models.loading import load_tokenizer, model_config
from rlhf.rollout.engine import RolloutEngine, rollout_dtype
from rlhf.schema.batch import minibatch_major_shard
from rlhf.schema.config import Config
from rlhf.train.async_rl.pipeline import Schedule
from rlhf.train.async_rl.roles import Roles
from rlhf.train.async_rl.staleness import IdleClock
from rlhf.train.async_rl.transfer import WeightReceiver, send_object
from rlhf.train.over_sampling import over_sampling_for, with_row_lists
from rlhf.train.prompts import load_data, make_loader, prompt_batch
from rlhf.train.regroup import regroup_rows


def rollout_inputs(cfg: Config):
    """What a rollout rank reads before it generates: (tokenizer, HF model config, train prompts)."""
    m = cfg.model
    tokenizer = load_tokenizer(m.tokenizer_path or m.path, m.trust_remote_code,
                               key="model.tokenizer_path" if m.tokenizer_path else "model.path")
    return tokenizer, model_config(m.path, m.trust_remote_code), load_data(cfg, cfg.data.train_files, tokenizer)


class RolloutWorker:
    """Build on the rollout ranks; `run()` until the training role's last batch is sent."""

    def __init__(self, cfg: Config, roles: Roles, resume: Optional[str]):
        """``resume``: the checkpoint the training role resumes from (every rank agreed on it)."""
        self.cfg, self.roles, self.device = cfg, roles, roles.env.device
        m = cfg.model
        self.tokenizer, self.hf_config, self.data = rollout_inputs(cfg)
        loader, self.total_steps = make_loader(cfg, len(self.data))
        self.dp_rank, self.dp = roles.mesh["dp"].get_local_rank(), roles.mesh["dp"].size()
        # rollout.over_sample_rate: this role draws and settles; the training side mirrors the data order
        self.loader, self.over = over_sampling_for(cfg, loader, self.dp_rank, self.dp, roles.mesh["dp"].get_group())
        self.start = 0
        if resume is not None:
            state = json.loads((Path(resume) / "trainer_state.json").read_text())
            self.start = int(state["global_step"])
            self.loader.load_state_dict(state["loader"])  # already past B_{start+1}, which the checkpoint holds
        dtype = rollout_dtype(cfg.rollout.dtype, self.device.type, m.dtype)
        self.engine = RolloutEngine(cfg.rollout, self.tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                                    max_response_length=cfg.data.max_response_length, device=self.device, dtype=dtype,
                                    layout=roles.layout, record_routes=cfg.actor.router_replay != "R2")
        self.weights = WeightReceiver(roles.partner, self.device,
                                      (m.lora_alpha, m.lora_rank) if m.lora_rank else None, roles.pair_group)
        self.agent = make_agent(cfg.rollout.multi_turn, self.tokenizer, roles.layout)
        self.clock = IdleClock(time.perf_counter())  # waits on the partner, per generate-and-hand-over cycle

    def _recv_weights(self) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        weights = self.weights.recv()
        self.clock.wait(time.perf_counter() - t0)
        return weights

    def generate(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        """B_step with ``weights`` (= theta_{version_of(step)}) -> the partner's rows -> the partner."""
        c = self.cfg
        if self.over is not None:
            global_idx, local_rows = self.over.draw()
        else:
            global_idx = self.loader.next_batch()
            local_rows = minibatch_major_shard(list(range(len(global_idx))), self.dp_rank, self.dp,
                                               c.actor.ppo_mini_batch_size)
        t0 = time.perf_counter()
        share, idle_s = self.clock.lap(t0)  # the cycle that ended: the previous batch generated and handed over
        turns = self.agent.turns() if self.agent is not None else None
        batch, stats = self.engine.sample(weights, self.hf_config, prompt_batch(global_idx, self.data.examples),
                                          step=step, n=c.rollout.n, temperature=c.rollout.temperature,
                                          local_rows=local_rows, turns=turns,
                                          keep_groups=None if self.over is None else self.over.need)
        if turns is not None:  # each rank holds its partner's dp rows: sum over the role's dp ranks
            stats.update(self.agent.metrics(batch, turns, self.roles.mesh["dp"].get_group()))
        order = {}
        if self.over is not None:  # the used groups, dealt to the partners mini-batch-major; the rest given back
            batch, global_idx, order = self._settle(batch, global_idx, local_rows, stats)
        stats["async/rollout_generate_s"] = time.perf_counter() - t0
        stats["async/rollout_idle_s"], stats["async/rollout_idle_share"] = idle_s, share
        t1 = time.perf_counter()
        send_object({"step": step, "version": Schedule.version_of(step), "global_idx": global_idx, **order,
                     "batch": batch.to(torch.device("cpu")), "stats": stats}, self.roles.partner, self.device,
                    self.roles.pair_group)
        self.clock.wait(time.perf_counter() - t1)

    def _settle(self, batch, started: list[int], local_rows: list[int], stats: dict) -> tuple:
        """Over-sampling's settle (``rlhf.train.over_sampling``) on the rollout role: ``(this rank's partner's
        rows, the used prompts, the message's "started" / "returned" for the training side's mirror)``."""
        c = self.cfg
        kept, used, more = self.over.settle(batch, started, local_rows, c.rollout.n)
        stats.update(more)
        kept = regroup_rows(kept, keep_groups=self.over.need, dp_rank=self.dp_rank, dp=self.dp,
                            mini_batch_size=c.actor.ppo_mini_batch_size, group=self.roles.mesh["dp"].get_group())
        returned = [i for i in started if i not in set(used)]
        return with_row_lists(kept, self.data.examples, self.tokenizer), used, {"started": started,
                                                                               "returned": returned}

    def run(self) -> None:
        with closing_agent(self.agent):
            self._run()

    def _run(self) -> None:
        sched = Schedule.of(self.start, self.total_steps, self.cfg.trainer.stop_after_steps)
        if sched.idle:
            return
        weights = self._recv_weights()  # theta_start
        if self.start == 0:
            self.generate(1, weights)
        for j in range(self.start + 2, sched.last_batch + 1):
            self.generate(j, weights)
            if sched.weights_after(j - 1):
                del weights
                weights = self._recv_weights()  # theta_{j-1}, for B_{j+1}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=self.roles.group)
