"""Per-step efficiency figures: MFU of generation and of the update, peak memory, tokens/s per device.

Model FLOPs follow ``rlhf.ops.flops.model_flops_per_token`` at the batch's mean sequence
length (prompt + response):

* generation: forward FLOPs per *generated* token (prefill not counted: decode dominates);
* update: training FLOPs (forward + backward, 3 x forward) per token of every sequence,
  times ``actor.ppo_epochs`` (the actor's update; a PPO critic is not counted).

MFU = FLOPs of the global batch / (slowest rank's phase seconds x world size x peak FLOP/s
per device), with the peak from ``rlhf.ops.hardware.peak_flops`` (datasheet on GPU, a
measured matmul roof on CPU, agreed over ranks). Peak memory per phase is the maximum over
ranks (``torch.cuda.max_memory_allocated`` on GPU, peak RSS on CPU). All figures are
reduced over ranks, so every rank returns the same numbers.

``perf/attn_backend`` / ``perf/attn_backend_decode``: the attention kernel of the packed training pass and of
decode as ``rlhf.models.attention_backend.BACKEND_CODES`` (0 reference, 1 flex, 2 torch varlen_attn, 3 flash-attn),
the same on every rank; the start-up line names them.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from rlhf.models.attention_backend import backend_metrics, log_choices, model_traits
from rlhf.models.parallel import all_reduce_max, all_reduce_sum
from rlhf.ops.flops import model_flops_per_token
from rlhf.ops.hardware import peak_flops


class EfficiencyMeter:
    """MFU, tokens/s per device and per-phase peak memory of one step (global figures)."""

    def __init__(self, hf_config, device: torch.device, compute_dtype: torch.dtype, *, world_size: int,
                 ppo_epochs: int, group: Optional[dist.ProcessGroup] = None):
        """``world_size`` / ``group``: the ranks the figures cover (None: the world)."""
        self.hf_config = hf_config
        self.device = device
        self.world_size = world_size
        self.ppo_epochs = ppo_epochs
        self.group = group
        peak = peak_flops(device, compute_dtype)
        # One figure for all ranks (a measured CPU roof varies a little from process to process).
        t = all_reduce_max(torch.tensor([float(peak or 0.0)], dtype=torch.float64, device=device), group)
        self.peak = float(t.item()) or None
        # the attention kernels this run's call sites use: one start-up line, and perf/attn_backend* codes
        self.attn_metrics = backend_metrics(log_choices(device, compute_dtype, **model_traits(hf_config)))

    def step_metrics(self, *, prompt_tokens: torch.Tensor, response_tokens: torch.Tensor, n_seqs: int,
                     times: Mapping[str, float], peaks: Mapping[str, float],
                     dp_group: Optional[dist.ProcessGroup]) -> dict[str, float]:
        """Args: this dp rank's prompt / response token counts (scalars) and sequences; this
        rank's seconds for ``step``, ``generate`` and ``update``; this rank's peak bytes per phase."""
        counts = torch.stack([prompt_tokens.double().sum(), response_tokens.double().sum(),
                              torch.tensor(float(n_seqs), dtype=torch.float64, device=prompt_tokens.device)])
        p_tok, r_tok, seqs = all_reduce_sum(counts.to(self.device), dp_group).tolist()
        names = sorted(peaks)
        slow = torch.tensor([times.get("step", 0.0), times.get("generate", 0.0), times.get("update", 0.0)]
                            + [peaks[k] for k in names], dtype=torch.float64, device=self.device)
        t_step, t_gen, t_upd, *mem = all_reduce_max(slow, self.group).tolist()
        out = {f"perf/max_memory_gb/{k}": v / 2 ** 30 for k, v in zip(names, mem)}
        out.update(self.attn_metrics)
        tokens = p_tok + r_tok
        if t_step > 0:
            out["perf/tokens_per_s"] = tokens / t_step
            out["perf/tokens_per_s_per_device"] = tokens / t_step / self.world_size
        mean_len = max(1, round(tokens / max(seqs, 1.0)))
        gen_flops = r_tok * model_flops_per_token(self.hf_config, mean_len, training=False)
        upd_flops = self.ppo_epochs * tokens * model_flops_per_token(self.hf_config, mean_len, training=True)
        out["perf/flops_generate"] = gen_flops
        out["perf/flops_update"] = upd_flops
        if self.peak:
            roof = self.world_size * self.peak
            if t_gen > 0:
                out["perf/mfu/generate"] = gen_flops / (t_gen * roof)
            if t_upd > 0:
                out["perf/mfu/update"] = upd_flops / (t_upd * roof)
        return out
