"""What the experiment trackers (tensorboard, mlflow, wandb) need beyond scalar logging.

* Hyperparameters: the resolved run config as flat dotted keys (``actor.lr``), the form
  every tracker filters and compares runs by (:func:`flatten_config`).
* Metric names: ``metrics.jsonl`` keeps the project's names (``val/<source>/pass@1``); a
  tracker that rejects some characters gets a sanitised name at its boundary. mlflow
  accepts only alphanumerics, ``_ - . : /`` and space (``@`` -> ``_at_``, anything else
  -> ``_``); tensorboard tags and wandb keys take any string, so they keep the names.
* wandb run identity: a resumed job must continue its run, not start another one. The
  run id is kept in the output directory (:func:`wandb_run_id`): the first job of a
  directory draws one, every later job there reuses it (``resume="allow"``); a fresh
  directory (or one whose outputs were deleted) is a new run, never an old run continued.
  mlflow draws its own run ids, so the id it gave the directory's first job is kept the same
  way (``<output_dir>/mlflow_run_id``) and a later job reopens that run
  (:func:`mlflow_start_run`); a stored id that the tracking store no longer has starts a new run.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any, Mapping, Sequence

_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def flatten_config(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"actor": {"lr": 1e-6}}`` -> ``{"actor.lr": 1e-6}``; dicts are flattened to their leaves,
    an empty dict stays one ``{}`` entry, lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def mlflow_name(name: str) -> str:
    """A metric name mlflow accepts (see the module docstring); names it accepts come back unchanged."""
    name = _MLFLOW_BAD.sub("_", name.replace("@", "_at_"))
    # mlflow also refuses names that a path normalisation would change (``a//b``, ``/a``, ``a/./b``).
    parts = [p for p in name.split("/") if p not in ("", ".", "..")]
    return "/".join(parts) or "_"


def wandb_run_id(output_dir: str | Path) -> str:
    """The wandb run id of ``output_dir``: read from ``<output_dir>/wandb_run_id``, or drawn and written
    there by the directory's first job."""
    path = Path(output_dir) / "wandb_run_id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)
    path.write_text(run_id + "\n")
    return run_id


def tensorboard_config(writer: Any, config: Mapping[str, Any], metric_names: Sequence[str]) -> None:
    """The run's hyperparameters in the HParams dashboard of ``writer``'s run (numbers, strings and
    booleans as they are, other values as JSON, None left out) with ``metric_names`` as its metric
    columns, and the whole config as a text summary ``config``."""
    import yaml
    from torch.utils.tensorboard.summary import hparams

    values = {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
              for k, v in flatten_config(config).items() if v is not None}
    # torch's add_hparams writes into a new sub-run; the same summaries in this writer keep one run.
    for summary in hparams(values, {name: 0.0 for name in metric_names}):
        writer.file_writer.add_summary(summary)
    text = yaml.safe_dump(dict(config), sort_keys=False)
    writer.add_text("config", "    " + text.replace("\n", "\n    "))  # a markdown code block


def mlflow_start_run(mlflow: Any, output_dir: str | Path, run_name: str, params: Mapping[str, Any]) -> str:
    """Start the mlflow run of ``output_dir`` (reopened when an earlier job there started it) and log
    ``params``; returns the run id.

    mlflow refuses to change a logged parameter, and a resumed job may legitimately differ (a longer
    ``trainer.total_training_steps``): parameters the run already has keep their first value, and
    the keys whose value changed are listed in the run's tag ``rlhf.params_changed_on_resume``.
    """
    path = Path(output_dir) / "mlflow_run_id"
    stored = path.read_text().strip() if path.is_file() else ""
    old: dict[str, str] | None = None
    if stored:
        try:
            run = mlflow.tracking.MlflowClient().get_run(stored)
        except mlflow.exceptions.MlflowException:  # another tracking store, or the run was deleted there
            run = None
        if run is not None and run.info.lifecycle_stage == "active":
            old = dict(run.data.params)
    if old is None:
        run_id = mlflow.start_run(run_name=run_name).info.run_id
        path.write_text(run_id + "\n")
        old = {}
    else:
        run_id = mlflow.start_run(run_id=stored).info.run_id
    new = {k: v for k, v in params.items() if k not in old}
    if new:
        mlflow.log_params(new)
    changed = sorted(k for k, v in params.items() if k in old and old[k] != str(v))
    if changed:
        mlflow.set_tag("rlhf.params_changed_on_resume", ", ".join(changed))
    return run_id
