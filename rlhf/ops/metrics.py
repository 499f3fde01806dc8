"""Metrics: a per-step logger with pluggable backends, phase timers, summaries.

* :class:`MetricsLogger` — only rank 0 writes. ``log(step, metrics)`` appends one JSON line
  per step to ``<output_dir>/metrics.jsonl`` (``{"step": 3, "time": ..., "reward/mean": ...}``),
  prints a one-line progress bar with ETA and a few key metrics, and forwards to
  tensorboard / mlflow / wandb when asked (imported lazily; a clear error if missing), with
  the run's config as their hyperparameters (:mod:`rlhf.ops.trackers`: names, run identity).
* :class:`PhaseTimer` — ``with timer("generate"):`` accumulates wall-clock seconds per
  phase; it synchronises the accelerator first so asynchronous kernels are counted in
  the phase that launched them.
* :func:`summarize_metrics` — ``{k/mean, k/std, k/max, k/min}`` of per-sample values.
* :func:`read_metrics` — the jsonl back as a list of dicts.

Metric names follow verl where one exists: ``reward/mean``, ``val/acc``,
``timing/<phase>``, ``perf/tokens_per_s``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, TextIO

import torch

from rlhf.ops.trackers import flatten_config, mlflow_name, mlflow_start_run, tensorboard_config, wandb_run_id

BACKENDS = ("console", "jsonl", "file", "tensorboard", "mlflow", "wandb")
# Backend -> (module that must be importable, pip package).
_BACKEND_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
                     "wandb": ("wandb", "wandb")}
# Shown on the console line when present (in this order); others only go to files. Each is a
# name the RL trainers log (tests/e2e/test_ppo_quickstart.py checks it on a real run).
DEFAULT_CONSOLE_KEYS = (
    "reward/mean",
    "val/acc",
    "actor/loss",
    "actor/kl_to_ref",
    "critic/vf_loss",
    "response_length/mean",
    "timing/step",
)


def check_backends(backends: Sequence[str]) -> None:
    """ValueError naming an unknown backend (with the nearest valid one), ImportError naming a missing
    package: a run fails at start-up instead of at its first logged step."""
    import difflib
    import importlib.util

    for b in backends:
        if b not in BACKENDS:
            near = difflib.get_close_matches(str(b), BACKENDS, n=1, cutoff=0.6)
            raise ValueError(f"unknown logger backend {b!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                             + f" (valid: {', '.join(BACKENDS)})")
        module, package = _BACKEND_PACKAGES.get(b, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ImportError(f"logger backend {b!r} needs the {package} package: pip install {package}")


def verl_file_logger_path(project: str, experiment: str) -> Path:
    """Where verl's ``file`` logger writes: ``VERL_FILE_LOGGER_PATH``, else
    ``${VERL_FILE_LOGGER_ROOT:-.}/<project>/<experiment>.jsonl``."""
    if os.environ.get("VERL_FILE_LOGGER_PATH"):
        return Path(os.environ["VERL_FILE_LOGGER_PATH"])
    return Path(os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))) / project / f"{experiment}.jsonl"


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric '{key}' is a tensor of shape {tuple(value.shape)}; log a scalar "
                             f"(e.g. summarize_metrics for per-sample values)")
        return float(value.item())
    return float(value)


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _fmt_value(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}"


def _md_cell(value: Any) -> str:
    """A markdown table cell: pipes escaped, line breaks kept visible."""
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def progress_line(step: int, total_steps: int, elapsed_s: float, steps_done: int, metrics: Mapping[str, float],
                  keys: Sequence[str], width: int = 20) -> str:
    """``step 12/100 [####----------------]  12% ETA 3m10s | reward/mean 0.53 | ...``"""
    frac = min(max(step / total_steps, 0.0), 1.0) if total_steps > 0 else 0.0
    filled = int(round(frac * width))
    bar = "#" * filled + "-" * (width - filled)
    eta = elapsed_s / steps_done * max(total_steps - step, 0) if steps_done > 0 else float("nan")
    parts = [f"step {step}/{total_steps} [{bar}] {frac * 100:3.0f}% ETA {_fmt_duration(eta)}"]
    parts += [f"{k} {_fmt_value(metrics[k])}" for k in keys if k in metrics]
    return " | ".join(parts)


class MetricsLogger:
    """Per-step metrics to the console, ``metrics.jsonl`` and optional trackers (rank 0 only).

    Args:
        output_dir: run directory; ``metrics.jsonl`` is appended to (a resumed run continues the file).
        backends: any of ``console``, ``jsonl`` (metrics.jsonl is written whatever the list), ``file``
            (verl's file logger), ``tensorboard`` (in ``TENSORBOARD_DIR`` when set), ``mlflow``, ``wandb``.
        total_steps: for the progress bar and ETA.
        project, experiment: names given to tensorboard's subdirectory / mlflow / wandb.
        rank: global rank; ranks other than 0 do nothing.
        console_keys: metrics shown on the console line when present.
        stream: console stream (stdout by default).
        config: the resolved run config (nested dict): hyperparameters of the trackers (mlflow
            params, wandb config, tensorboard hparams and a ``config`` text).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        backends: Sequence[str] = ("console", "jsonl"),
        total_steps: int,
        project: str = "rlhf",
        experiment: str = "run",
        rank: int = 0,
        console_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
        stream: TextIO | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        check_backends(backends)
        self.output_dir = Path(output_dir)
        self.backends = tuple(backends)
        self.total_steps = total_steps
        self.project = project
        self.experiment = experiment
        self.rank = rank
        self.console_keys = tuple(console_keys)
        self.enabled = rank == 0
        self.path = self.output_dir / "metrics.jsonl"
        self._stream = stream
        self._start = time.perf_counter()
        # ETA from steps done in *this* process, so a resumed run estimates correctly.
        self._first_step = 0
        self._file: TextIO | None = None
        self._tb: Any = None
        self._mlflow: Any = None
        self._wandb: Any = None
        self._verl_file: TextIO | None = None
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # metrics.jsonl is always written (the run's own record; "jsonl" in the backends changes nothing),
        # so a verl command that lists only its loggers still leaves the summaries.
        self._file = self.path.open("a")
        if "file" in self.backends:  # verl's FileLogger: {"step", "data"} lines at its path
            path = verl_file_logger_path(project, experiment)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._verl_file = path.open("a")
        if "tensorboard" in self.backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "logger backend 'tensorboard' needs the tensorboard package: pip install tensorboard"
                ) from e
            # verl's TENSORBOARD_DIR, when set, is the log directory
            self._tb = SummaryWriter(log_dir=os.environ.get("TENSORBOARD_DIR") or
                                     str(self.output_dir / "tensorboard" / experiment))
            if config:
                tensorboard_config(self._tb, config, self.console_keys)
        if "mlflow" in self.backends:
            try:
                import mlflow
            except ImportError as e:
                raise ImportError("logger backend 'mlflow' needs the mlflow package: pip install mlflow") from e
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                # Keep the run beside its other outputs: a sqlite store (mlflow's recommended local
                # backend; its file store is deprecated) and an artifact folder in output_dir.
                mlflow.set_tracking_uri(f"sqlite:///{(self.output_dir / 'mlflow.db').resolve()}")
                if mlflow.get_experiment_by_name(project) is None:
                    mlflow.create_experiment(project, (self.output_dir / "mlartifacts").resolve().as_uri())
            mlflow.set_experiment(project)
            mlflow_start_run(mlflow, self.output_dir, experiment, flatten_config(config) if config else {})
            self._mlflow = mlflow
        if "wandb" in self.backends:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("logger backend 'wandb' needs the wandb package: pip install wandb") from e
            # A resumed job continues its run (WANDB_RUN_ID, when set, names the run instead).
            run_id = None if os.environ.get("WANDB_RUN_ID") else wandb_run_id(self.output_dir)
            wandb.init(project=project, name=experiment, dir=str(self.output_dir), id=run_id, resume="allow",
                       config=flatten_config(config) if config else None)
            self._wandb = wandb

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (floats, ints or scalar tensors) for ``step``."""
        if not self.enabled:
            return
        values = {k: _to_float(k, v) for k, v in metrics.items()}
        if self._file is not None:
            # Non-finite values become null: strict JSON readers (jq, JS) reject NaN.
            row = {"step": step, "time": time.time()}
            row.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._verl_file is not None:
            data = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
            self._verl_file.write(json.dumps({"step": step, "data": data}) + "\n")
            self._verl_file.flush()
        if "console" in self.backends:
            line = progress_line(
                step, self.total_steps, time.perf_counter() - self._start, step - self._first_step,
                values, self.console_keys,
            )
            print(line, file=self._stream or sys.stdout, flush=True)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, global_step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({mlflow_name(k): v for k, v in values.items()}, step=step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def log_generations(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Sample generations of ``step`` (rows of prompt, response, ground truth, score): appended to
        ``generations.jsonl`` with the step, and logged as a table to tensorboard (markdown text
        ``val/generations``), mlflow (artifact ``generations/step_<step>.json``) and wandb."""
        if not self.enabled or not rows:
            return
        rows = [{"step": step, **row} for row in rows]
        with (self.output_dir / "generations.jsonl").open("a") as f:  # always, as metrics.jsonl
            f.writelines(json.dumps(row) + "\n" for row in rows)
        columns = list(rows[0])
        if self._tb is not None:
            table = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
            table += "".join("| " + " | ".join(_md_cell(r.get(c, "")) for c in columns) + " |\n" for r in rows)
            self._tb.add_text("val/generations", table, global_step=step)
        if self._mlflow is not None:
            self._mlflow.log_dict({"columns": columns, "data": [[r.get(c) for c in columns] for r in rows]},
                                  f"generations/step_{step}.json")
        if self._wandb is not None:
            table = self._wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
            self._wandb.log({"val/generations": table}, step=step)

    def mark_start(self, step: int) -> None:
        """Steps before `step` were done by an earlier process (resume): ETA counts from here,
        and rows the earlier process logged after its last checkpoint (step > `step`) are
        dropped, so each step appears once in metrics.jsonl."""
        self._first_step = step
        self._start = time.perf_counter()
        if self._file is None or not self.path.is_file():
            return
        text = self.path.read_text(errors="replace")
        keep, broken = [], 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:  # a partial line (killed or disk full mid-write): that row was never complete
                broken += 1
                continue
            # A summary row is logged again when the resumed run ends (one that was killed during its final
            # export would otherwise leave two).
            if row.get("step", 0) <= step and not any(k.startswith("summary/") for k in row):
                keep.append(line + "\n")
        if broken:
            print(f"[rlhf] note: {self.path}: dropped {broken} incomplete line(s) (a write cut short); "
                  f"{len(keep)} row(s) kept", file=self._stream or sys.stdout, flush=True)
        if "".join(keep) != text:
            # The append-mode handle writes at the end of whatever the file now holds.
            self.path.write_text("".join(keep))

    def logged(self, step: int, key: str) -> dict[str, float]:
        """``{key: value}`` as last logged for ``step`` in metrics.jsonl (by this or an earlier process),
        or ``{}``; read by every rank (the file is rank 0's)."""
        try:
            lines = self.path.read_text(errors="replace").splitlines() if "jsonl" in self.backends else []
        except OSError:
            return {}
        found: dict[str, float] = {}
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("step") == step and isinstance(row.get(key), (int, float)):
                found = {key: float(row[key])}
        return found

    def close(self) -> None:
        """Flush and close every backend."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._verl_file is not None:
            self._verl_file.close()
            self._verl_file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _synchronize(device: torch.device | None) -> None:
    if device is None or device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps ...
    sync = getattr(backend, "synchronize", None)
    if sync is not None:
        sync() if device.type == "mps" else sync(device)


class PhaseTimer:
    """Wall-clock seconds per named phase, accumulated until :meth:`pop`.

    ``device``: when it is an accelerator, the device is synchronised at the start and
    end of each phase, so kernels launched in a phase are charged to it. On CPU nothing
    device-specific is called.

    The phases are also the seam for operations components (``listeners``: the watchdog,
    NVTX ranges, per-phase memory): each gets ``enter(phase, step)`` and ``exit(phase, step)``,
    with ``step`` whatever the trainer last set on :attr:`step`. :attr:`failed_phase` is the
    innermost phase an exception left (the out-of-memory handler reports it).
    """

    def __init__(self, device: torch.device | str | None = None, listeners: Sequence[Any] = ()) -> None:
        self.device = torch.device(device) if device is not None else None
        self.listeners = list(listeners)
        self.step = 0
        self.failed_phase: str | None = None
        self._totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        _synchronize(self.device)
        start = time.perf_counter()
        entered = []
        try:
            for listener in self.listeners:
                listener.enter(phase, self.step)
                entered.append(listener)
            yield
        except BaseException:
            self.failed_phase = self.failed_phase or phase  # the innermost phase unwinds first
            raise
        finally:
            _synchronize(self.device)
            self._totals[phase] = self._totals.get(phase, 0.0) + time.perf_counter() - start
            for listener in reversed(entered):
                listener.exit(phase, self.step)

    def pop(self) -> dict[str, float]:
        """``{"timing/<phase>": seconds}`` since the last pop; resets the totals (and ``failed_phase``)."""
        out = {f"timing/{k}": v for k, v in self._totals.items()}
        self._totals = {}
        self.failed_phase = None
        return out


def summarize_metrics(values: Mapping[str, Sequence[float] | torch.Tensor]) -> dict[str, float]:
    """``{k/mean, k/std, k/max, k/min}`` for each entry (population std; NaNs ignored; empty entries skipped)."""
    out: dict[str, float] = {}
    for key, vals in values.items():
        t = torch.as_tensor(vals, dtype=torch.float64).flatten() if not isinstance(vals, torch.Tensor) \
            else vals.detach().to("cpu", torch.float64).flatten()
        t = t[~torch.isnan(t)]
        if t.numel() == 0:
            continue
        out[f"{key}/mean"] = t.mean().item()
        out[f"{key}/std"] = t.std(unbiased=False).item()
        out[f"{key}/max"] = t.max().item()
        out[f"{key}/min"] = t.min().item()
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (``null`` values come back as NaN)."""
    rows = []
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.append({k: (math.nan if v is None else v) for k, v in row.items()})
    return rows
