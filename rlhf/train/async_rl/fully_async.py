"""trainer.mode fully_async, the training side (verl's fully_async_policy, AReaL's bounded staleness).

The training leader (rank 0) receives finished groups from every rollout rank as they come (one
receiving thread per rollout rank); an update starts as soon as it holds ``data.train_batch_size``
(= ``require_batches x ppo_mini_batch_size``) groups. The first ones to arrive are taken, put in
data order, and dealt to the training ranks mini-batch-major, as colocated mode deals a fresh
batch. After every ``trigger_parameter_sync_step``-th update the training ranks gather the
rollout weights and each pushes them to its rollout ranks (:class:`split.StreamRoles`); after the
last update they send STOP and the leader drains what is still in flight (``async/samples_dropped``).

Each token carries the version of the weights that sampled it (``RolloutBatch.token_versions``);
``async/staleness_*`` is ``(step - 1) - version`` over the batch's response tokens. With
``staleness_threshold = 0`` and ``trigger_parameter_sync_step = 1`` the rollout role may start
batch k only once it holds theta_{k-1}, so batch k is exactly colocated mode's batch k.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from rlhf.agent.loop import summed_counts
from rlhf.agent.rollout import tool_use_metrics
from rlhf.schema.batch import RolloutBatch, minibatch_major_shard
from rlhf.train.async_rl.pipeline import Schedule, offpolicy_metrics
from rlhf.train.async_rl.split import StreamRoles
from rlhf.train.async_rl.staleness import idle_share, staleness_metrics
from rlhf.train.async_rl.stream_worker import END
from rlhf.train.async_rl.transfer import gather_push, recv_object, send_object, send_tensors
from rlhf.rollout.stream import STOP


def receive_groups(src: int, device: torch.device, group, out: queue.Queue) -> None:
    """Thread body: the group messages of rollout rank ``src`` into ``out``, through its END (or the error)."""
    try:
        while True:
            msg = recv_object(src, device, group)
            out.put(msg)
            if END in msg:
                return
    except Exception as e:  # noqa: BLE001 - raised by the main thread, naming the rank
        out.put({"error": e, "rank": src})


class FullyAsync:
    """Same seam as :class:`pipeline.OneStepOff`: ``start``, ``take``, ``after_update``, rank state."""

    def __init__(self, roles: StreamRoles, cfg, *, device: torch.device, dtype: Optional[torch.dtype],
                 total_steps: int, dp_rank: int, dp: int, dp_group):
        self.roles, self.cfg, self.device, self.dtype = roles, cfg, device, dtype
        self.total_steps, self.dp_rank, self.dp, self.dp_group = total_steps, dp_rank, dp, dp_group
        self.trigger = cfg.async_training.trigger_parameter_sync_step
        self.leader = roles.env.rank == 0
        self.inbox: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.held: list[dict] = []
        self.schedule: Optional[Schedule] = None
        self.ended: set[int] = set()
        self.rollout_clock: dict[int, tuple[float, float]] = {}  # rank -> (idle_s, wall_s), last reported
        self.clock_at_take: dict[int, tuple[float, float]] = {}
        self.dropped = 0
        self.last_take = time.perf_counter()
        self.base_sent = False
        # Data-order positions trained on: all below ``base``, and ``consumed`` above it (checkpointed,
        # so a resumed rollout role regenerates exactly the others).
        self.base, self.consumed = 0, set()

    # ------------------------------------------------------------------ weights

    def _push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Gather the rollout weights (a collective of the training mesh); send them to my rollout ranks."""
        t0 = time.perf_counter()
        weights = gather_push(model, dtype=self.dtype, lora=self.cfg.model.lora_rank > 0, base_sent=self.base_sent)
        self.base_sent = True
        sent = 0
        for g in self.roles.weight_targets():
            send_object(("weights", version), g, self.device, self.roles.weight_groups[g])
            sent += send_tensors(dict(weights), g, self.device, self.roles.weight_groups[g])
        return {"async/weight_push_s": time.perf_counter() - t0, "async/weight_bytes": float(sent)}

    def _stop(self) -> None:
        for g in self.roles.weight_targets():
            send_object((STOP,), g, self.device, self.roles.weight_groups[g])
        if self.leader:  # what the rollout role still generated is not trained on
            while len(self.ended) < len(self.roles.rollout_ranks):
                self._next()
            self.dropped += len(self.held)
            self.held = []
            for t in self.threads:
                t.join()

    def start(self, done_steps: int, model: torch.nn.Module, loader) -> None:
        self.loader = loader
        self.schedule = Schedule.of(done_steps, self.total_steps, self.cfg.trainer.stop_after_steps)
        if self.leader:
            for g in self.roles.rollout_ranks:
                t = threading.Thread(target=receive_groups, daemon=True,
                                     args=(g, self.device, self.roles.row_groups[g], self.inbox))
                t.start()
                self.threads.append(t)
        if self.schedule.idle:
            self._stop()
            return
        self._push(model, done_steps)
        self.last_take = time.perf_counter()

    # ------------------------------------------------------------------ groups

    def _next(self) -> None:
        """Block for the next message of any rollout rank."""
        try:
            msg = self.inbox.get(timeout=self.cfg.trainer.exchange_timeout_s)
        except queue.Empty:
            raise RuntimeError("fully_async: no group from any rollout rank within trainer.exchange_timeout_s "
                               f"({self.cfg.trainer.exchange_timeout_s} s)") from None
        if "error" in msg:
            raise RuntimeError(f"fully_async: rollout rank {msg['rank']} failed or died: {msg['error']}")
        self.rollout_clock[msg["rank"]] = (msg["idle_s"], msg["wall_s"])
        if END in msg:
            self.ended.add(msg["rank"])
            return
        self.held.append(msg)

    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float], list[int]]:
        """The batch of update ``step`` on this rank, its metrics and its global prompt indices."""
        self.loader.next_batch()  # mirrored so that checkpoints hold the data position
        B = self.cfg.data.train_batch_size
        payload = None
        if self.leader:
            t0 = time.perf_counter()
            while len(self.held) < B:
                if len(self.ended) == len(self.roles.rollout_ranks):
                    raise RuntimeError(f"fully_async: the rollout ranks ended with {len(self.held)} of the {B} "
                                       f"groups update {step} needs")
                self._next()
            wait = time.perf_counter() - t0
            chosen = sorted(self.held[:B], key=lambda m: m["seq"])  # first to arrive, in data order
            self.held = self.held[B:]
            self.consumed.update(m["seq"] for m in chosen)
            while self.base in self.consumed:
                self.consumed.discard(self.base)
                self.base += 1
            batch = RolloutBatch.concat([RolloutBatch(**m["batch"]) for m in chosen])
            now = time.perf_counter()
            metrics = {**staleness_metrics(batch.token_versions, batch.response_mask, step - 1),
                       "async/samples_dropped": float(self.dropped * self.cfg.rollout.n),
                       "async/groups_held": float(len(self.held)), "async/train_wait_s": wait,
                       "async/trainer_idle_share": idle_share(wait, now - self.last_take),
                       "async/rollout_idle_share": self._rollout_idle_share()}
            if self.cfg.rollout.multi_turn.enable:  # tallied per group by the rollout ranks' agent loops
                metrics.update(tool_use_metrics(batch, summed_counts([m["tools"] for m in chosen]), reduce=False))
            self.last_take = now
            payload = [{k: v for k, v in vars(batch).items()}, metrics, [m["idx"] for m in chosen]]
        box = [payload]
        if len(self.roles.train_ranks) > 1:
            dist.broadcast_object_list(box, src=0, group=self.roles.group,
                                       device=self.device if self.device.type == "cuda" else None)
        fields, metrics, idx = box[0]
        batch = RolloutBatch(**fields)
        n = self.cfg.rollout.n
        groups = minibatch_major_shard(list(range(B)), self.dp_rank, self.dp, self.cfg.actor.ppo_mini_batch_size)
        batch = batch.select([i * n + j for i in groups for j in range(n)]).to(self.device)
        return batch, dict(metrics), idx

    def _rollout_idle_share(self) -> float:
        idle = wall = 0.0
        for r, (i, w) in self.rollout_clock.items():
            i0, w0 = self.clock_at_take.get(r, (0.0, 0.0))
            idle, wall = idle + i - i0, wall + w - w0
        self.clock_at_take = dict(self.rollout_clock)
        return idle_share(idle, wall)

    def after_update(self, step: int, batch: RolloutBatch, model: torch.nn.Module, loader) -> dict[str, float]:
        cap = self.cfg.actor.tis_imp_ratio_cap
        metrics = offpolicy_metrics(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask,
                                    cap if cap > 0 else float("inf"), self.dp_group)
        if step >= self.schedule.last_step:
            self._stop()
            metrics["async/samples_dropped"] = float(self.dropped * self.cfg.rollout.n)
        elif step % self.trigger == 0:
            metrics.update(self._push(model, step))
        return metrics

    def trainer_state(self) -> dict:
        """In the checkpoint's trainer_state.json (written by the leader, read by the rollout ranks):
        the data-order positions already trained on. Groups held or in flight are generated again."""
        return {"base": self.base, "consumed": sorted(self.consumed)}

    def load_trainer_state(self, state: dict) -> None:
        self.base, self.consumed = int(state["base"]), set(state["consumed"])

    def rank_state(self) -> Optional[dict]:
        return None

    def load_rank_state(self, state: Optional[dict]) -> None:
        pass
