"""Training-health alerts: thresholds on the global per-step metrics.

``trainer.alerts`` maps an alert name to its threshold. After each step the
:class:`HealthMonitor` checks the step's metrics (already reduced over ranks, so every
rank reaches the same verdict); a crossed threshold prints one warning line (rank 0) and
sets ``alerts/<name>`` to 1.0 for that step (0.0 otherwise). Alerts never stop the run.

==========================  ==========================  ===========================================
name                        metric                      fires when
==========================  ==========================  ===========================================
kl_to_ref                   actor/kl_to_ref             value > threshold (nats per token)
                            (else kl_penalty/kl)
entropy_collapse            actor/entropy               value < threshold (nats per token)
logprob_diff                rollout/logprob_diff_max    value > threshold: sampler and trainer
                                                        disagree (weights not synced, precision)
grad_norm_spike             actor/grad_norm             value > threshold x median of the last
                                                        ``window`` steps
response_length_collapse    response_length/mean        value < threshold x median of the last
                                                        ``window`` steps
==========================  ==========================  ===========================================

The two relative alerts need ``min_history`` earlier steps before they can fire; their
history starts afresh in a resumed process.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Optional


@dataclass(frozen=True)
class AlertRule:
    metrics: tuple[str, ...]  # the first one present in a step's metrics is checked
    kind: str  # "above", "below" (absolute) or "spike", "drop" (relative to the recent median)


ALERTS: dict[str, AlertRule] = {
    "kl_to_ref": AlertRule(("actor/kl_to_ref", "kl_penalty/kl"), "above"),
    "entropy_collapse": AlertRule(("actor/entropy",), "below"),
    "logprob_diff": AlertRule(("rollout/logprob_diff_max",), "above"),
    "grad_norm_spike": AlertRule(("actor/grad_norm",), "spike"),
    "response_length_collapse": AlertRule(("response_length/mean",), "drop"),
}


def check_alerts_config(alerts: Mapping[str, object]) -> None:
    """Raise ValueError (one line) for an unknown alert name or a threshold that is not a positive number."""
    for name, threshold in alerts.items():
        if name not in ALERTS:
            raise ValueError(f"unknown alert '{name}'; valid: {', '.join(sorted(ALERTS))}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(f"alert '{name}' needs a positive number as threshold, got {threshold!r}")


class HealthMonitor:
    """Checks each step's metrics against ``thresholds`` (see the module docstring)."""

    def __init__(self, thresholds: Mapping[str, float], *, window: int = 20, min_history: int = 3,
                 warn: Optional[Callable[[str], None]] = None) -> None:
        check_alerts_config(thresholds)
        self.thresholds = {k: float(v) for k, v in thresholds.items()}
        self.min_history = min_history
        self.warn = warn
        self._history = {name: deque(maxlen=window) for name in self.thresholds}

    def check(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """``{"alerts/<name>": 0.0 or 1.0}`` for every configured alert whose metric is in ``metrics``."""
        out: dict[str, float] = {}
        for name, threshold in self.thresholds.items():
            rule = ALERTS[name]
            key = next((m for m in rule.metrics if m in metrics), None)
            if key is None:
                continue
            value = float(metrics[key])
            message = self._crossed(name, rule.kind, value, threshold, key)
            out[f"alerts/{name}"] = float(message is not None)
            if message is not None and self.warn is not None:
                self.warn(f"[rlhf] alert at step {step}: {message} (trainer.alerts.{name})")
        return out

    def _crossed(self, name: str, kind: str, value: float, threshold: float, key: str) -> Optional[str]:
        if kind == "above":
            return f"{key} = {value:.4g} > {threshold:g}" if value > threshold else None
        if kind == "below":
            return f"{key} = {value:.4g} < {threshold:g}" if value < threshold else None
        history = self._history[name]
        message = None
        if len(history) >= self.min_history:
            median = statistics.median(history)
            if kind == "spike" and value > threshold * median:
                message = f"{key} = {value:.4g} > {threshold:g} x recent median {median:.4g}"
            elif kind == "drop" and value < threshold * median:
                message = f"{key} = {value:.4g} < {threshold:g} x recent median {median:.4g}"
        history.append(value)
        return message
