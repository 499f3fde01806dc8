"""Out-of-memory recovery: halve the budget of the phase that ran out, restart, resume.

Why restart instead of catching the error and retrying in place: the phases that run out of
memory (generation, log-probs, the update) are full of collectives (FSDP2 all-gathers and
reduce-scatters, tensor-parallel reductions). When one rank raises ``OutOfMemoryError`` in the
middle of one, its peers are already blocked in the next collective; a flag all-reduce from
the failed rank would be paired with the peers' pending all-gather, not with their flag. Only
a fresh process group is safe. So the rank that ran out records the phase in
``<output_dir>/oom/``, the watchdog's abort line ends every rank at once, and torchrun's
``--max-restarts`` starts the job again: it reads the records, halves that phase's budget
(the same knobs on every rank, so the layout stays consistent) and resumes from the last
complete checkpoint. Micro-batch sizes and token budgets change how a batch is cut, not the
loss (gradients are accumulated over micro-batches), so the resumed run computes what a run
with the smaller budget from the start computes.

Without restarts (plain ``python`` or ``--max-restarts 0``) the job ends with the same line,
and running it again applies the halved budget.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rlhf.schema.config import Config, ConfigError

# Phase -> the (section, key) budgets halved when it runs out of memory.
_SAMPLER = (("rollout", "max_num_seqs"), ("rollout", "kv_cache_tokens"), ("rollout", "kv_cache_memory"),
            ("rollout", "prefill_tokens"))
KNOBS: dict[str, tuple[tuple[str, str], ...]] = {
    "rollout": _SAMPLER,
    "validate": _SAMPLER,  # validation sampling
    "logprobs": (("actor", "log_prob_micro_batch_size_per_gpu"), ("actor", "log_prob_max_token_len_per_gpu"),
                 ("critic", "ppo_micro_batch_size_per_gpu"), ("critic", "ppo_max_token_len_per_gpu")),
    "update": (("actor", "ppo_micro_batch_size_per_gpu"), ("actor", "ppo_max_token_len_per_gpu"),
               ("critic", "ppo_micro_batch_size_per_gpu"), ("critic", "ppo_max_token_len_per_gpu")),
}


def _records(out_dir: Path) -> dict[str, int]:
    """Halvings per phase recorded by earlier attempts of this run (several ranks running out in
    one attempt count once per phase)."""
    seen = {(r["phase"], r["attempt"]) for r in (json.loads(f.read_text()) for f in (out_dir / "oom").glob("*.json"))}
    counts: dict[str, int] = {}
    for phase, _ in seen:
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def apply_oom_records(cfg: Config, max_retries: int) -> int:
    """Halve the budgets of every recorded out-of-memory phase in ``cfg`` (in place).

    Returns the number of retries so far (logged as ``oom/retries``). Raises a one-line
    ``ConfigError`` naming the knobs once more than ``max_retries`` were needed.
    """
    counts = _records(Path(cfg.trainer.output_dir))
    total = sum(counts.values())
    if total > max_retries:
        knobs = sorted({f"{s}.{k}" for phase in counts for s, k in KNOBS.get(phase, ())})
        raise ConfigError(f"out of memory {total} times (in {', '.join(sorted(counts))}), more than "
                          f"trainer.max_oom_retries={max_retries}: lower {', '.join(knobs) or 'the batch size'}, "
                          f"enable model.enable_gradient_checkpointing or use more ranks (parallel.*); delete "
                          f"{Path(cfg.trainer.output_dir) / 'oom'} to start over")
    for phase, n in counts.items():
        for section, key in KNOBS.get(phase, ()):
            sec = getattr(cfg, section)
            value = getattr(sec, key)
            if value > 0:  # 0 means "derived" (kv_cache_tokens / memory); leave it to its formula
                setattr(sec, key, max(1, value >> n) if isinstance(value, int) else value / 2**n)
    return total


def record_oom(out_dir: Path, *, rank: int, phase: str, step: int, attempt: int) -> str:
    """Write this rank's record and return the line that ends the job. ``attempt``: the retries
    applied at start-up (the same on every rank)."""
    d = out_dir / "oom"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"attempt{attempt}_rank{rank}.json").write_text(json.dumps({"phase": phase, "step": step,
                                                                      "attempt": attempt}))
    knobs = ", ".join(f"{s}.{k}" for s, k in KNOBS.get(phase, ())) or "no budget knob"
    return (f"[rlhf] rank {rank} ran out of memory in phase '{phase}' of step {step}; the job restarts (torchrun "
            f"--max-restarts) or is run again and resumes with {knobs} halved")


class InjectedOom:
    """Test hook, a PhaseTimer listener added only when ``RLHF_TEST_OOM=<phase>:<step>`` is set:
    entering that phase of that step raises a real ``torch.OutOfMemoryError`` on rank
    ``RLHF_TEST_OOM_RANK`` (default 0), in the first attempt of the job only (torchrun's
    restart count 0)."""

    def __init__(self, spec: str, rank: int) -> None:
        self.phase, step = spec.split(":")
        self.step = int(step)
        self.armed = (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                      and rank == int(os.environ.get("RLHF_TEST_OOM_RANK", "0")))

    @classmethod
    def from_env(cls, rank: int) -> "InjectedOom | None":
        spec = os.environ.get("RLHF_TEST_OOM")
        return cls(spec, rank) if spec else None

    def enter(self, phase: str, step: int) -> None:
        if self.armed and (phase, step) == (self.phase, self.step):
            self.armed = False
            raise torch.OutOfMemoryError(f"injected by RLHF_TEST_OOM in phase '{phase}' of step {step}")

    def exit(self, phase: str, step: int) -> None:
        pass
