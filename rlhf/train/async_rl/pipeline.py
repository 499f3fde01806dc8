"""One-step-off-policy pipelining, the training side (verl's one_step_off_policy recipe).

With theta_k the weights after update k (theta_0 = the loaded model) and B_j the j-th
rollout batch, batch B_j is generated with theta_{max(j-2, 0)}: while the training role
updates on B_k, the rollout role generates B_{k+1} with theta_{k-1}. The messages each
partner pair exchanges, in the one order both sides follow (so plain blocking
point-to-point calls never cross):

    training:  W_s0  [B_{s0+1}]  | update s  ->  B_{s+1}  ->  W_s  | update s+1 ...
    rollout:   W_s0  [gen, B_{s0+1}]  | gen B_{j}  ->  B_j  ->  W_{j-1}  | gen B_{j+1} ...

``s0`` is the step the run starts after (0, or a resumed checkpoint's). B_{s+1} arrives
before checkpoint s is written, so the checkpoint holds it (rank state) together with
theta_s; a resumed run sends theta_s, trains on the saved B_{s+1}, and the rollout role
generates B_{s+2} with theta_s, exactly as the uninterrupted run did. The staleness is
corrected by the update's truncated importance weights min(pi_old / pi_rollout, cap)
(``actor.tis_imp_ratio_cap``): pi_old is recomputed by the training weights, pi_rollout
is the sampler's. Step 1 has no lag (B_1 and B_2 both use theta_0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Optional

import torch

from rlhf.models.parallel import all_reduce_max, all_reduce_sum
from rlhf.schema.batch import RolloutBatch
from rlhf.train.async_rl.roles import Roles
from rlhf.train.async_rl.transfer import WeightSender, recv_object


@dataclass(frozen=True)
class Schedule:
    """Which batches and weights cross between the roles in a run that starts after step ``start``."""

    start: int  # steps done before this run (0, or the resumed checkpoint's step)
    last_step: int  # the last step this run trains
    total_steps: int

    @classmethod
    def of(cls, start: int, total_steps: int, stop_after_steps: int) -> "Schedule":
        last = total_steps if stop_after_steps < 0 else min(total_steps, start + stop_after_steps)
        return cls(start=start, last_step=max(last, start), total_steps=total_steps)

    @property
    def idle(self) -> bool:
        return self.last_step == self.start

    @property
    def last_batch(self) -> int:
        """The last batch generated: B_{last_step + 1} too, when there is one, so the last checkpoint holds it."""
        return min(self.last_step + 1, self.total_steps)

    def batch_after(self, step: int) -> bool:
        """Whether B_{step+1} is sent after update ``step``."""
        return step + 1 <= self.last_batch

    def weights_after(self, step: int) -> bool:
        """Whether theta_step is sent after update ``step`` (it generates B_{step+2})."""
        return step + 2 <= self.last_batch

    @staticmethod
    def version_of(batch: int) -> int:
        """The weights B_batch is generated with."""
        return max(batch - 2, 0)


def offpolicy_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                      cap: float, group=None) -> dict[str, float]:
    """Global statistics of the truncated IS weights w = exp(log pi_old - log pi_rollout) [N, R] and of
    the policy mismatch: mean / max w, the fraction of tokens whose w is capped, and
    KL(pi_rollout || pi_old) by the k3 estimate E[w - 1 - log w] (>= 0 per token, low variance)
    over the response tokens of every dp rank."""
    log_w = (old_log_probs - rollout_log_probs) * mask
    w = log_w.exp() * mask
    k3 = (w - 1 - log_w) * mask
    sums = torch.stack([w.sum(), ((w > cap) & mask.bool()).sum(), k3.sum(), mask.sum()]).double()
    all_reduce_sum(sums, group)
    mx = all_reduce_max(w.max().clone(), group)
    n = sums[3].clamp(min=1)
    return {"async/is_weight_mean": float(sums[0] / n), "async/is_weight_max": float(mx),
            "async/is_capped_frac": float(sums[1] / n), "async/mismatch_kl": float(sums[2] / n)}


class OneStepOff:
    """The training role's end of the pipeline: holds the next batch, ships weights after each update."""

    def __init__(self, roles: Roles, *, device: torch.device, dtype: Optional[torch.dtype], rollout_tp: int,
                 lora: bool, total_steps: int, stop_after_steps: int, tis_cap: float, dp_group):
        self.roles, self.device = roles, device
        self.total_steps, self.stop_after_steps, self.tis_cap = total_steps, stop_after_steps, tis_cap
        self.dp_group = dp_group
        self.sender = WeightSender(roles.partner, device, dtype=dtype, rollout_tp=rollout_tp,
                                   rollout_tp_rank=roles.env.rank % rollout_tp, lora=lora, group=roles.pair_group)
        self.schedule: Optional[Schedule] = None
        self.held: Optional[dict] = None  # the next batch's message (see RolloutWorker.generate)

    def start(self, done_steps: int, model: torch.nn.Module, loader) -> None:
        """Ship theta_{done_steps}; receive B_{done_steps+1} unless the resumed checkpoint held it."""
        self.schedule = Schedule.of(done_steps, self.total_steps, self.stop_after_steps)
        if self.schedule.idle:
            return
        self.sender.send(model)
        if self.held is None:
            self._receive(loader)

    def _receive(self, loader) -> float:
        t0 = time.perf_counter()
        msg = recv_object(self.roles.partner, self.device, self.roles.pair_group)
        wait = time.perf_counter() - t0
        if "started" in msg:  # rollout.over_sample_rate: the prompts it started, then the ones it gave back
            expected, got = loader.take(len(msg["started"])), msg["started"]
            loader.give_back(msg["returned"])
        else:  # the loader is mirrored here so that checkpoints hold its position
            expected, got = loader.next_batch(), msg["global_idx"]
        if got != expected:
            raise RuntimeError(f"one_step_off: the rollout role generated batch {msg['step']} from other prompts "
                               f"than this rank's data order; both roles must run the same config and data")
        msg["batch"] = msg["batch"].to(self.device)
        self.held = msg
        return wait

    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float], list[int]]:
        """B_step, its metrics and its global prompt indices."""
        msg, self.held = self.held, None
        if msg is None or msg["step"] != step:
            raise RuntimeError(f"one_step_off: no rollout batch for step {step} (holding "
                               f"{None if msg is None else msg['step']})")
        metrics = dict(msg["stats"])
        metrics["async/policy_lag"] = float(step - 1 - msg["version"])
        return msg["batch"], metrics, msg["global_idx"]

    def after_update(self, step: int, batch: RolloutBatch, model: torch.nn.Module, loader) -> dict[str, float]:
        """IS / mismatch statistics of the batch just trained on; B_{step+1} in, theta_step out."""
        metrics = offpolicy_metrics(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask,
                                    self.tis_cap, self.dp_group)
        if self.schedule.batch_after(step):
            metrics["async/train_wait_s"] = self._receive(loader)
        if self.schedule.weights_after(step):
            metrics.update(self.sender.send(model))
        return metrics

    def rank_state(self) -> Optional[dict]:
        """What a checkpoint keeps on this rank: the received next batch."""
        if self.held is None:
            return None
        batch = self.held["batch"].to(torch.device("cpu"))  # its fields as a dict: plain data, no class to unpickle
        return {**self.held, "batch": {f.name: getattr(batch, f.name) for f in fields(batch)}}

    def load_rank_state(self, state: Optional[dict]) -> None:
        if state is not None:
            self.held = {**state, "batch": RolloutBatch(**state["batch"]).to(self.device)}
