"""Apply a rule-based reward function to a batch of decoded responses.

A reward function is user code: one that raises, returns a non-number, or returns
NaN/inf must not end a long run. Such a sample scores 0.0 and is counted in
``ScoreResult.n_errors`` (with the first message kept), so the trainer can log it and
decide to stop when every sample fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from rlhf.config import ConfigError


@dataclass
class ScoreResult:
    """Scores of one batch.

    ``scores`` is ``[B]`` float32. ``extra_metrics[k]`` is a length-``B`` list aligned with
    the responses: the numeric value under key ``k`` of the dict a sample returned, NaN
    where that sample did not return ``k`` (or failed). ``preds[i]`` is the string a dict
    returned under ``"pred"`` (the extracted answer that majority voting counts), else None.
    """

    scores: torch.Tensor
    extra_metrics: dict[str, list[float]] = field(default_factory=dict)
    n_errors: int = 0
    first_error: str | None = None
    preds: list[str | None] = field(default_factory=list)

    def metric_means(self, prefix: str = "reward/") -> dict[str, float]:
        """``{prefix + key: mean over the samples that reported key}`` for the extra metrics."""
        out: dict[str, float] = {}
        for key, values in self.extra_metrics.items():
            finite = [v for v in values if not math.isnan(v)]
            if finite:
                out[prefix + key] = sum(finite) / len(finite)
        return out


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"returned a tensor with {value.numel()} elements, expected a scalar")
        return float(value.item())
    if isinstance(value, (bool, int, float)) or hasattr(value, "__float__"):
        return float(value)
    raise TypeError(f"returned {type(value).__name__}, expected a number or a dict with 'score'")


def score_responses(
    fn: Callable[..., Any],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    data_sources: Sequence[str],
    extra_infos: Sequence[dict[str, Any] | None] | None = None,
) -> ScoreResult:
    """Score ``B`` responses with ``fn(data_source, solution_str, ground_truth, extra_info)``.

    Args:
        fn: a reward function (see :mod:`rlhf.rewards.registry`).
        responses: ``[B]`` decoded responses (without the prompt).
        ground_truths, data_sources: ``[B]`` each, aligned with ``responses``.
        extra_infos: ``[B]`` dicts (or None).

    Returns:
        :class:`ScoreResult` with ``scores`` ``[B]`` float32; failed samples score 0.0.
    """
    b = len(responses)
    if extra_infos is None:
        extra_infos = [None] * b
    if not (len(ground_truths) == len(data_sources) == len(extra_infos) == b):
        raise ValueError(
            f"score_responses needs aligned inputs; got {b} responses, {len(ground_truths)} ground truths, "
            f"{len(data_sources)} data sources, {len(extra_infos)} extra_infos"
        )
    scores = [0.0] * b
    preds: list[str | None] = [None] * b
    extra: dict[str, list[float]] = {}
    n_errors = 0
    first_error: str | None = None

    def fail(i: int, msg: str) -> None:
        nonlocal n_errors, first_error
        n_errors += 1
        if first_error is None:
            first_error = f"sample {i} (data_source={data_sources[i]}): {msg}"

    # A Python loop is the only option: reward functions are arbitrary per-string code.
    for i in range(b):
        try:
            out = fn(data_sources[i], responses[i], ground_truths[i], extra_infos[i])
            metrics: dict[str, float] = {}
            if isinstance(out, dict):
                if isinstance(out.get("pred"), str):
                    preds[i] = out["pred"]
                if "score" not in out:
                    raise KeyError(f"returned a dict without 'score' (keys: {sorted(out)})")
                value = _as_float(out["score"])
                for key, v in out.items():
                    if key == "score":
                        continue
                    try:
                        metrics[key] = _as_float(v)
                    except TypeError:
                        pass  # non-numeric extras (e.g. the extracted answer) are not metrics
            else:
                value = _as_float(out)
        except Exception as e:  # user code: any failure is counted, never fatal
            fail(i, f"{type(e).__name__}: {e}")
            continue
        if not math.isfinite(value):
            fail(i, f"non-finite score {value}")
            continue
        scores[i] = value
        for key, v in metrics.items():
            extra.setdefault(key, [math.nan] * b)[i] = v
    return ScoreResult(torch.tensor(scores, dtype=torch.float32), extra, n_errors, first_error, preds)


def reward_components(res: ScoreResult, keys: Sequence[str]) -> torch.Tensor:
    """``[B, K]`` values of the reward-dict ``keys`` (gdpo), 0 where a sample did not report one
    (a failed sample, already counted in ``n_errors``).  A key no sample reported is a config
    error, named with the keys the reward function does return."""
    missing = [k for k in keys if k not in res.extra_metrics]
    if missing:
        raise ConfigError(f"algorithm.gdpo_reward_keys: the reward function returned no {missing} "
                         f"(its dict keys besides 'score': {sorted(res.extra_metrics) or 'none'})")
    cols = [torch.tensor(res.extra_metrics[k], dtype=torch.float32).nan_to_num(0.0) for k in keys]
    return torch.stack(cols, dim=-1)
