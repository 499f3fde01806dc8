"""The documentation site's reference pages, generated from the code at build time so they cannot drift.

``mkdocs build`` calls :func:`pages` through ``scripts/mkdocs_hooks.py`` (a MkDocs hook: no plugin to install)
and serves what it returns as ``docs/reference/configuration.md``, ``cli.md`` and ``metrics.md``. The
configuration and metrics pages are also committed (:data:`COMMITTED`; ``python scripts/docs_reference.py docs``
refreshes them, and a test fails when they drift), so they read on GitHub too. The sources:

* configuration: the dataclasses of :mod:`rlhf.schema.config` (and SFT's in :mod:`rlhf.train.sft`): every key,
  its type, default and ``_f`` help text; the verl key that maps to it (:data:`rlhf.config.verl_keys.RULES`);
  and the values each ``trainer.mode`` refuses, found by running the real checks
  (:func:`rlhf.config.checks.validate`, ``check_one_step_off``, ``check_fully_async``) on probe values;
* CLI: the ``--help`` of every entry point, from its own argparse parser;
* metrics: ``docs/reference/metrics.txt`` (one line per metric key: ``key: meaning``), checked against the
  keys the code logs by ``tests/unit/test_docs_reference.py``.

``python scripts/docs_reference.py OUT_DIR`` writes the pages to a directory, for reading without MkDocs.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import io
import json
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
METRICS_FILE = ROOT / "docs" / "reference" / "metrics.txt"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("one_step_off", "fully_async")
WORLD = 8  # the world size the mode checks are probed with


# ---------------------------------------------------------------------------------------------- configuration

def leaf_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) of every leaf of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, tp


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return " \\| ".join("null" if a is type(None) else type_name(a) for a in args)
    return getattr(tp, "__name__", str(tp))


def default_of(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def yaml_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    if isinstance(v, str):
        return json.dumps(v) if v == "" or v != v.strip() else v
    return repr(v)


def verl_names() -> dict[str, list[str]]:
    """Native dotted key -> the verl keys that set it (rlhf/config/verl_keys.py)."""
    from rlhf.config.verl_keys import RULES

    out: dict[str, list[str]] = {}
    for verl, rule in RULES.items():
        # override_config only names model.path as a carrier for its note: it sets no key
        if rule.native and not verl.endswith("override_config"):
            out.setdefault(rule.native, []).append(verl)
    return out


def _probe_values(key: str, f: dataclasses.Field, tp: Any, base: Any) -> list:
    """Values other than the base config's worth trying for one key under each mode."""
    default, origin = default_of(f), typing.get_origin(tp)
    vals: list = []
    if tp is bool:
        vals = [not base]
    elif origin is typing.Literal:
        vals = [a for a in typing.get_args(tp) if a != base]
    elif tp is int and default in (-1, 0, 1):
        vals = [2]
    elif tp is float and default == 0.0:
        vals = [0.5]
    if base != default:
        vals.append(default)
    return vals + EXTRA_PROBES.get(key, [])


# Values the type alone does not suggest (names in registries) that a mode check treats specially.
EXTRA_PROBES = {"algorithm.adv_estimator": ["remax"]}
# Combinations of two keys a mode refuses together (each alone is accepted).
PAIR_PROBES = [{"model.lora_rank": 8, "rollout.tp": 2}]


def _base_config():
    from rlhf.schema.config import Config

    cfg = Config()
    for key, v in {"model.path": "m", "data.train_files": "d.parquet", "data.train_batch_size": 8,
                   "actor.ppo_mini_batch_size": 8, "actor.tis_imp_ratio_cap": 2.0}.items():
        _set(cfg, key, v)
    return cfg


def _set(cfg: Any, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for p in path:
        cfg = getattr(cfg, p)
    setattr(cfg, last, value)


def _get(cfg: Any, key: str) -> Any:
    for p in key.split("."):
        cfg = getattr(cfg, p)
    return cfg


def _refusal(settings: dict, mode: str) -> str | None:
    """The one-line error the checks give ``settings`` under ``mode`` (None: accepted)."""
    from rlhf.config.checks import check_startup, validate
    from rlhf.schema.config import ConfigError
    from rlhf.train.async_rl.roles import check_one_step_off
    from rlhf.train.async_rl.split import check_fully_async

    cfg = _base_config()
    for k, v in settings.items():
        _set(cfg, k, v)
    _set(cfg, "trainer.mode", mode)
    try:
        validate(cfg)
        if "model.lora_rank" in settings:  # the LoRA layout check of check_startup (the rest loads registries)
            check_startup(cfg)
        if mode == "one_step_off":
            check_one_step_off(cfg, WORLD)
        elif mode == "fully_async":
            check_fully_async(cfg, WORLD)
    except ConfigError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - a probe the colocated check also refuses is filtered out below
        return "?"
    return None


def mode_refusals() -> list[tuple[str, str, str]]:
    """(settings, mode, error) for every probe accepted by trainer.mode colocated and refused by another mode."""
    from rlhf.schema.config import Config

    base = _base_config()
    probes: list[dict] = []
    for key, f, tp in leaf_fields(Config):
        if key == "trainer.mode":
            continue
        probes += [{key: v} for v in _probe_values(key, f, tp, _get(base, key))]
    probes += PAIR_PROBES
    rows = []
    for settings in probes:
        if _refusal(settings, "colocated") is not None:
            continue
        for mode in MODES:
            err = _refusal(settings, mode)
            if err is not None and err != "?":
                rows.append((", ".join(f"{k}={yaml_value(v)}" for k, v in settings.items()), mode, err))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _config_table(cls: type, verl: dict[str, list[str]], refused: dict[str, list[str]]) -> list[str]:
    lines = []
    hints = typing.get_type_hints(cls)
    top = [f for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    for section in top:
        sub = hints[section.name]
        lines += ["", f"## `{section.name}`", ""]
        if sub.__doc__ and not sub.__doc__.startswith(sub.__name__ + "("):
            lines += [_cell(sub.__doc__.strip()), ""]
        lines += ["| key | type | default | verl | meaning |", "|---|---|---|---|---|"]
        for key, f, tp in leaf_fields(sub, f"{section.name}."):
            doc = f.metadata.get("doc", "")
            if key in refused:
                modes = ", ".join(f"`{m}`" for m in refused[key])
                doc += f" **Refused under {modes}** for some values (see the table at the end)."
            names = "<br>".join(f"`{n}`" for n in verl.get(key, [])) or ""
            lines.append(f'| <a id="{key}"></a>`{key}` | {type_name(tp)} | `{_cell(yaml_value(default_of(f)))}` | '
                         f"{names} | {_cell(doc)} |")
    return lines


def config_page() -> str:
    from rlhf.schema.config import Config
    from rlhf.train.sft import SFTConfig

    verl = verl_names()
    rows = mode_refusals()
    refused: dict[str, list[str]] = {}
    for settings, mode, _ in rows:
        for part in settings.split(", "):
            key = part.split("=")[0]
            if mode not in refused.setdefault(key, []):
                refused[key].append(mode)
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses (`rlhf/schema/config.py`) when the site is built: every key, its",
        "type, its default and its help text. Set keys in the yaml file passed with `--config` or as dotted",
        "overrides (`actor.lr=1e-6`); `python train_grpo.py --list-keys` prints the same list. The *verl* column",
        "names the verl keys that set a key here (`rlhf/config/verl_keys.py`; see",
        "[Coming from verl](../howto/from-verl.md)). Unknown keys, wrong types and impossible values fail at",
        "start-up with the dotted key and the nearest valid names.",
    ]
    lines += _config_table(Config, verl, refused)
    lines += ["", "## Keys refused under a mode", "",
              f"`trainer.mode` `colocated` accepts each setting below; the mode named refuses it at start-up with the",
              f"line shown (found by running the start-up checks on each key's other values, world size {WORLD}).",
              "See [Modes](../concepts/modes.md).", "",
              "| setting | refused under | error |", "|---|---|---|"]
    lines += [f"| `{_cell(s)}` | `{m}` | {_cell(e)} |" for s, m, e in rows]
    lines += ["", "## `train_sft.py` (supervised warm start)", "",
              "SFT reads `model.*` (as above), `parallel.*` (data parallel only: `parallel.tp`, `pp` and `sp` are",
              "refused) and these sections:"]
    hints = typing.get_type_hints(SFTConfig)
    for name in ("sft", "trainer"):
        lines += ["", f"### SFT `{name}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, f, tp in leaf_fields(hints[name], f"{name}."):
            lines.append(f"| `{key}` | {type_name(tp)} | `{_cell(yaml_value(default_of(f)))}` | "
                         f"{_cell(f.metadata.get('doc', ''))} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- CLI

# (command as a user types it, how to get its parser's --help)
ENTRY_SCRIPTS = ("train_grpo.py", "train_ppo.py", "train_sft.py")
MODULES = (
    ("python -m rlhf.eval", "rlhf.eval"),
    ("python -m rlhf.planner", "rlhf.planner.plan"),
    ("python -m rlhf.simulate", "rlhf.simulate"),
    ("python -m rlhf.checkpoint export", "rlhf.export"),
    ("python -m rlhf.verl_compat", "rlhf.verl_compat.__main__"),
    ("python -m rlhf.data.prepare", "rlhf.data.prepare"),
    ("python -m rlhf.data.synthetic", "rlhf.data.synthetic"),
    ("python -m rlhf.data.shapes", "rlhf.data.shapes"),
    ("python -m rlhf.models.tiny", "rlhf.models.tiny"),
    ("python -m rlhf.models.tiny_vlm", "rlhf.models.tiny_vlm"),
)


def _help(call) -> str:
    buf = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            call()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return buf.getvalue().rstrip()


def cli_help() -> dict[str, str]:
    """Command -> its --help text."""
    import importlib

    from rlhf.cli import parse_args

    out = {}
    for script in ENTRY_SCRIPTS:
        doc = ast.get_docstring(ast.parse((ROOT / script).read_text())) or ""
        out[f"python {script}"] = _help(lambda d=doc: parse_args(d, ["--help"])).replace(
            Path(sys.argv[0]).name, script, 1)
    for cmd, module in MODULES:
        mod = importlib.import_module(module)
        argv = ["--help"]
        out[cmd] = _help(lambda m=mod, a=argv: m.main(a))
    return out


def cli_page() -> str:
    lines = ["# Command-line reference", "",
             "Generated from each entry point's own argument parser when the site is built. The training scripts",
             "run as one process (`python train_grpo.py ...`) or under `torchrun`; every one takes dotted config",
             "overrides after its flags ([Configuration](configuration.md)).", ""]
    for cmd, text in cli_help().items():
        text = re.sub(r"^usage: \S+", "usage: " + cmd, text)
        lines += [f"## `{cmd}`", "", "```text", text, "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- metrics

def metric_docs() -> dict[str, str]:
    """``docs/reference/metrics.txt``: metric key (``<name>`` marks a variable part) -> meaning. One
    ``key: meaning`` line per metric; blank lines and ``#`` comments are skipped."""
    out: dict[str, str] = {}
    for n, line in enumerate(METRICS_FILE.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, meaning = line.partition(": ")
        if not sep or not meaning.strip() or " " in key.strip() or key.strip() in out:
            raise ValueError(f"{METRICS_FILE.name}:{n}: expected a new 'key: meaning' line, got {line!r}")
        out[key.strip()] = meaning.strip()
    return out


def _pattern(key: str) -> re.Pattern:
    """``<name>`` matches one path part; ``<data_source>`` any text (data sources such as openai/gsm8k hold slashes)."""
    parts = re.split(r"(<[^>]+>)", key)
    return re.compile("".join((r".+?" if p == "<data_source>" else r"[^/]+?") if p.startswith("<") else re.escape(p)
                              for p in parts if p) + r"\Z")


def documented(key: str, docs: dict[str, str] | None = None) -> bool:
    """Whether a logged metric key (or a key template with ``<...>`` parts) is in the metrics registry.
    The mlflow spelling (``pass_at_4`` for ``pass@4``) counts as the same key."""
    docs = metric_docs() if docs is None else docs
    key = key.replace("_at_", "@") if "pass_at_" in key or "maj_at_" in key else key
    if key in docs:
        return True
    probe = re.sub(r"<[^>]+>", "x", key)
    return any(_pattern(k).match(probe) for k in docs if "<" in k) or any(
        _pattern(key).match(k) for k in docs if "<" in key)


SECTIONS = {
    "reward": "Rewards of the training samples (global means over ranks).",
    "response_length": "Response lengths in tokens.",
    "actor": "The policy update (means over the mini-batches of the step).",
    "critic": "The critic (train_ppo.py).",
    "advantage": "Advantages.",
    "kl_penalty": "KL penalty in the reward (`algorithm.use_kl_in_reward`).",
    "mismatch": "Sampler vs trainer log-probs (every step; the rollout correction's statistics when it is on).",
    "rollout": "The sampler.",
    "dynamic_sampling": "DAPO's dynamic sampling (`algorithm.filter_groups`).",
    "agent": "Tool-using multi-turn rollouts (`rollout.multi_turn`); `val/agent/*` the same for validation.",
    "moe": "Mixture-of-experts models.",
    "async": "`trainer.mode` one_step_off and fully_async.",
    "timing": "Seconds per phase of the step.",
    "perf": "Throughput, model FLOPs utilisation and memory.",
    "reshard": "The training -> rollout weight reshard.",
    "val": "Validation (`trainer.test_freq`, `trainer.val_kwargs`).",
    "summary": "One row at the end of a run.",
    "alerts": "Training-health alerts (`trainer.alerts`).",
    "oom": "Out-of-memory recovery (`trainer.max_oom_retries`).",
    "data": "The data order.",
    "sft": "train_sft.py.",
}


def metrics_page() -> str:
    docs = metric_docs()
    groups: dict[str, list[tuple[str, str]]] = {}
    for key, meaning in docs.items():
        groups.setdefault(key.split("/")[0], []).append((key, meaning))
    lines = ["# Metrics reference", "",
             "Every key a run logs, per step on rank 0, to the console, `<output_dir>/metrics.jsonl` and the trackers",
             "of `trainer.logger` ([Trackers](../howto/trackers.md)). Every per-step metric is global (reduced over",
             "ranks): the same value whatever the layout. `<name>` marks a variable part of a key. mlflow refuses",
             "`@`, so there `val/pass@4` is `val/pass_at_4`.", "",
             "Generated from `docs/reference/metrics.txt`; a test fails when the code logs a key that is not there.",
             ""]
    order = list(SECTIONS) + sorted(set(groups) - set(SECTIONS))
    for ns in order:
        if ns not in groups:
            continue
        lines += [f"## `{ns}/`", ""]
        if ns in SECTIONS:
            lines += [SECTIONS[ns], ""]
        lines += ["| key | meaning |", "|---|---|"]
        lines += [f"| `{_cell(k)}` | {_cell(m)} |" for k, m in groups[ns]]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- all

def pages() -> dict[str, str]:
    """Site path -> markdown of every generated page."""
    return {"reference/configuration.md": config_page(), "reference/cli.md": cli_page(),
            "reference/metrics.md": metrics_page()}


# Committed under docs/ so that README's links work on GitHub and in a fresh clone; the build regenerates them
# all and tests/unit/test_docs_reference.py fails when a committed copy drifts from the code. The CLI page is
# not committed: argparse's help layout changes between Python versions.
COMMITTED = ("reference/configuration.md", "reference/metrics.md")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Write the generated reference pages to a directory (docs/ refreshes "
                                             "the committed configuration and metrics pages).")
    ap.add_argument("out", help="output directory")
    out = Path(ap.parse_args(argv).out)
    for path, text in pages().items():
        if out.resolve() == (ROOT / "docs").resolve() and path not in COMMITTED:
            continue
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
        print(out / path)


if __name__ == "__main__":
    main()
