"""Apply a rule-based reward function to a batch of decoded responses.

A reward function is user code: one that raises, returns a non-number, or returns
NaN/inf must not end a long run. Such a sample scores 0.0 and is counted in
``ScoreResult.n_errors`` (with the first message kept), so the trainer can log it and
decide to stop when every sample fails.

torch is imported only where a batch result is built, so reward worker processes
(:mod:`rlhf.rewards.worker`, which use :func:`score_one`) start without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rlhf.schema.config import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass
class ScoreResult:
    """Scores of one batch.

    ``scores`` is ``[B]`` float32; failed and timed-out samples score 0 and are counted in
    ``n_errors`` / ``n_timeouts``; ``n_untried`` of the timeouts were failed without a call (the pool
    had seen every worker hang in this step, :meth:`rlhf.rewards.pool.RewardPool.set_fail_fast`). ``extra_metrics[k]`` is a length-``B`` list aligned with
    the responses: the numeric value under key ``k`` of the dict a sample returned, NaN
    where that sample did not return ``k`` (or failed). ``preds[i]`` is the string a dict
    returned under ``"pred"`` (the extracted answer that majority voting counts), else None.
    """

    scores: torch.Tensor
    extra_metrics: dict[str, list[float]] = field(default_factory=dict)
    n_errors: int = 0
    first_error: str | None = None
    preds: list[str | None] = field(default_factory=list)
    n_timeouts: int = 0
    n_untried: int = 0

    def metric_means(self, prefix: str = "reward/") -> dict[str, float]:
        """``{prefix + key: mean over the samples that reported key}`` for the extra metrics."""
        return mean_of_sums([self.metric_sums()], prefix)

    def metric_sums(self) -> dict[str, tuple[float, int]]:
        """``{key: (sum, count)}`` of each extra metric over the samples that reported it: what ranks
        exchange so that a mean over every rank's samples does not depend on the layout."""
        out = {}
        for key, values in self.extra_metrics.items():
            reported = [v for v in values if not math.isnan(v)]
            out[key] = (sum(reported), len(reported))
        return out


def mean_of_sums(pieces: Sequence[dict[str, tuple[float, int]]], prefix: str = "reward/") -> dict[str, float]:
    """Merge :meth:`ScoreResult.metric_sums` of several ranks (keys may differ between them) into
    ``{prefix + key: mean over all reported samples}``."""
    total: dict[str, list[float]] = {}
    for piece in pieces:
        for key, (s, n) in piece.items():
            acc = total.setdefault(key, [0.0, 0])
            acc[0] += s
            acc[1] += n
    return {prefix + key: s / n for key, (s, n) in sorted(total.items()) if n}


def _as_float(value: Any) -> float:
    if hasattr(value, "numel") and hasattr(value, "item"):  # a tensor (torch need not be imported here)
        if value.numel() != 1:
            raise TypeError(f"returned a tensor with {value.numel()} elements, expected a scalar")
        return float(value.item())
    if isinstance(value, (bool, int, float)) or hasattr(value, "__float__"):
        return float(value)
    raise TypeError(f"returned {type(value).__name__}, expected a number or a dict with 'score'")


def score_one(fn: Callable[..., Any], data_source: str, response: str, ground_truth: str,
              extra_info: dict[str, Any] | None) -> tuple[float, dict[str, float], str | None]:
    """One sample: ``(score, numeric extras, pred)``. Raises on any failure of the function or its
    output (an exception, a dict without 'score', a non-number, NaN/inf)."""
    return parse_score(fn(data_source, response, ground_truth, extra_info))


def parse_score(out: Any) -> tuple[float, dict[str, float], str | None]:
    """What a reward function returned for one sample (a number or a dict with 'score') as
    ``(score, numeric extras, pred)``; raises on a dict without 'score', a non-number, NaN/inf."""
    metrics: dict[str, float] = {}
    pred = None
    if isinstance(out, dict):
        if isinstance(out.get("pred"), str):
            pred = out["pred"]
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
    if not math.isfinite(value):
        raise ValueError(f"non-finite score {value}")
    return value, metrics, pred


class ScoreCollector:
    """Per-sample outcomes of one batch, in any order -> :class:`ScoreResult` (the serial loop and
    the worker pool both fill one)."""

    def __init__(self, data_sources: Sequence[str]) -> None:
        self.data_sources = list(data_sources)
        self.scores = [0.0] * len(self.data_sources)
        self.preds: list[str | None] = [None] * len(self.data_sources)
        self.extra: dict[str, list[float]] = {}
        self.n_errors = self.n_timeouts = self.n_untried = 0
        self.first_error: str | None = None

    def ok(self, i: int, value: float, metrics: dict[str, float], pred: str | None) -> None:
        self.scores[i], self.preds[i] = value, pred
        for key, v in metrics.items():
            self.extra.setdefault(key, [math.nan] * len(self.scores))[i] = v

    def fail(self, i: int, msg: str, *, timeout: bool = False, untried: bool = False) -> None:
        """Sample ``i`` scores 0 and is counted, as a timeout (``untried``: one failed without a call) or
        as an error."""
        if timeout:
            self.n_timeouts += 1
            self.n_untried += untried
        else:
            self.n_errors += 1
        if self.first_error is None:
            self.first_error = f"sample {i} (data_source={self.data_sources[i]}): {msg}"

    def result(self) -> ScoreResult:
        import torch

        return ScoreResult(torch.tensor(self.scores, dtype=torch.float32), self.extra, self.n_errors,
                           self.first_error, self.preds, self.n_timeouts, self.n_untried)


def aligned(responses: Sequence[str], ground_truths: Sequence[str], data_sources: Sequence[str],
            extra_infos: Sequence[dict[str, Any] | None] | None) -> list[dict[str, Any] | None]:
    """``extra_infos`` as a list of length B; a length mismatch of the inputs is an error."""
    b = len(responses)
    extra_infos = [None] * b if extra_infos is None else list(extra_infos)
    if not (len(ground_truths) == len(data_sources) == len(extra_infos) == b):
        raise ValueError(f"scoring needs aligned inputs; got {b} responses, {len(ground_truths)} ground truths, "
                         f"{len(data_sources)} data sources, {len(extra_infos)} extra_infos")
    return extra_infos


def score_responses(
    fn: Callable[..., Any],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    data_sources: Sequence[str],
    extra_infos: Sequence[dict[str, Any] | None] | None = None,
) -> ScoreResult:
    """Score ``B`` responses with ``fn(data_source, solution_str, ground_truth, extra_info)`` in this
    process (no timeout; :mod:`rlhf.rewards.pool` runs the same per-sample code in workers).

    Args:
        fn: a reward function (see :mod:`rlhf.rewards.registry`).
        responses: ``[B]`` decoded responses (without the prompt).
        ground_truths, data_sources: ``[B]`` each, aligned with ``responses``.
        extra_infos: ``[B]`` dicts (or None).

    Returns:
        :class:`ScoreResult` with ``scores`` ``[B]`` float32; failed samples score 0.0.
    """
    extra_infos = aligned(responses, ground_truths, data_sources, extra_infos)
    acc = ScoreCollector(data_sources)
    # A Python loop is the only option: reward functions are arbitrary per-string code.
    for i in range(len(responses)):
        try:
            value, metrics, pred = score_one(fn, data_sources[i], responses[i], ground_truths[i], extra_infos[i])
        except Exception as e:  # user code: any failure is counted, never fatal
            acc.fail(i, f"{type(e).__name__}: {e}")
            continue
        acc.ok(i, value, metrics, pred)
    return acc.result()


def score_batched(
    fn: Callable[..., Any],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    data_sources: Sequence[str],
    extra_infos: Sequence[dict[str, Any] | None] | None = None,
) -> ScoreResult:
    """verl's ``reward_manager: batch``: one call ``fn(data_sources=, solution_strs=, ground_truths=,
    extra_infos=)`` for the whole batch, returning one score (a number or a dict with 'score') per
    response. A call that raises or returns the wrong count scores every sample 0, counted as errors."""
    extra_infos = aligned(responses, ground_truths, data_sources, extra_infos)
    acc = ScoreCollector(data_sources)
    try:
        outs = list(fn(data_sources=list(data_sources), solution_strs=list(responses),
                       ground_truths=list(ground_truths), extra_infos=extra_infos))
        if len(outs) != len(responses):
            raise ValueError(f"returned {len(outs)} scores for {len(responses)} responses")
    except Exception as e:  # user code: counted, never fatal
        for i in range(len(responses)):
            acc.fail(i, f"{type(e).__name__}: {e} (reward.reward_manager batch)")
        return acc.result()
    for i, out in enumerate(outs):
        try:
            acc.ok(i, *parse_score(out))
        except Exception as e:
            acc.fail(i, f"{type(e).__name__}: {e}")
    return acc.result()


def reward_components(res: ScoreResult, keys: Sequence[str]) -> torch.Tensor:
    """``[B, K]`` values of the reward-dict ``keys`` (gdpo), 0 where a sample did not report one
    (a failed sample, already counted in ``n_errors``).  A key no sample reported is a config
    error, named with the keys the reward function does return."""
    missing = [k for k in keys if k not in res.extra_metrics]
    if missing:
        raise ConfigError(f"algorithm.gdpo_reward_keys: the reward function returned no {missing} "
                         f"(its dict keys besides 'score': {sorted(res.extra_metrics) or 'none'})")
    import torch

    cols = [torch.tensor(res.extra_metrics[k], dtype=torch.float32).nan_to_num(0.0) for k in keys]
    return torch.stack(cols, dim=-1)


class RewardFailureError(RuntimeError):
    """Every reward call failed or timed out for ``reward.max_failed_steps`` steps in a row."""


class FailedStepGuard:
    """Counts training steps in which no sample got a reward (every call raised or timed out): the
    update then learns nothing, so after ``max_steps`` such steps in a row the run stops, saying why."""

    def __init__(self, max_steps: int, timeout_s: float, scorer: Any = None) -> None:
        self.max_steps, self.timeout_s, self.in_a_row, self.scorer = max_steps, timeout_s, 0, scorer
        self._new_step()

    def _new_step(self) -> None:
        """The scorer's worker pool (if any) starts a step: once every worker has hung in a row in it, the
        rest of the step's calls fail at once (counted), so a hanging reward costs one timeout per step."""
        pool = getattr(self.scorer, "inner", self.scorer)
        if hasattr(pool, "set_fail_fast"):
            pool.set_fail_fast(True)

    def update(self, n_errors: float, n_timeouts: float, n_samples: float) -> None:
        """Global counts of one step (the same on every rank, so every rank stops together)."""
        all_failed = n_samples > 0 and n_errors + n_timeouts >= n_samples
        self.in_a_row = self.in_a_row + 1 if all_failed else 0
        self._new_step()
        if self.max_steps > 0 and self.in_a_row >= self.max_steps:
            raise RewardFailureError(
                f"reward.reward_fn: no sample got a reward in {self.in_a_row} steps in a row (last step: "
                f"{int(n_timeouts)} of {int(n_samples)} calls timed out after reward.timeout_s={self.timeout_s:g} s, "
                f"{int(n_errors)} raised or returned no number); there is no learning signal, so the run stops "
                f"(reward.max_failed_steps={self.max_steps})")
