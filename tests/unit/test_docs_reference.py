"""The generated reference pages are complete: every config key is in the configuration page, and every metric
key the code can log is in the metrics registry (docs/reference/metrics.txt) the metrics page is made from.

Metrics are checked three ways, so a key added later without its line in the registry fails here:
1. every metric-key string literal in the package (``"actor/loss"``, ``f"moe/router_entropy/layer{i}"``) must be
   in the registry: literals exactly (a ``<name>`` pattern line does not cover them), f-string templates by
   matching some registry line;
2. the families the code builds from names (the sampler's ``rollout/*`` stats, the tool-use ``agent/*``
   metrics, the alerts) are enumerated from their code;
3. the e2e runs check the keys of the metrics.jsonl they write (:func:`assert_documented`, used in
   tests/e2e/test_algorithms.py and test_ops_metrics.py).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from scripts import docs_reference as ref

ROOT = Path(__file__).resolve().parents[2]

# String literals shaped like metric keys that are not metrics: dataset names, paths, logger names, prefixes.
NOT_METRICS = {"hiyouga/geometry3k", "lighteval/MATH", "openai/gsm8k", "outputs/run", "outputs/sft",
               "synthetic/addition", "synthetic/multiplication", "synthetic/shapes", "rlhf/watchdog/",
               "val/generations", "generations/step_<x>.json", "checkpoints/<x>/<x>", "rlhf/attempt_<x>",
               "reward/samples"}  # reward/samples: a count the trainer pops before logging
# Fields of a metrics.jsonl row that are not metrics.
ROW_FIELDS = {"step", "time"}
_KEY = re.compile(r"[a-z][a-z0-9_]*(/[A-Za-z0-9_@.<>-]+)+")


def assert_documented(keys) -> None:
    """Every logged metric key in ``keys`` is in docs/reference/metrics.txt (for the e2e runs' metrics.jsonl)."""
    docs = ref.metric_docs()
    missing = sorted(k for k in set(keys) - ROW_FIELDS if not ref.documented(k, docs))
    assert not missing, f"metric keys logged but not documented in docs/reference/metrics.txt: {missing}"


def _literal_keys() -> dict[str, str]:
    """Metric-key-shaped string literals and f-string templates (``{...}`` -> ``<x>``) in the package and the
    entry scripts -> the file they are in."""
    found: dict[str, str] = {}
    files = list((ROOT / "rlhf").rglob("*.py")) + list(ROOT.glob("train_*.py"))
    for path in files:
        tree = ast.parse(path.read_text())
        parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
                text = node.value
            else:
                continue
            if _KEY.fullmatch(text) and not text.startswith("<"):
                found.setdefault(text, str(path.relative_to(ROOT)))
    return found


def test_every_metric_literal_in_the_code_is_documented():
    docs = ref.metric_docs()
    exact = set(docs)
    missing = []
    for key, where in _literal_keys().items():
        if key in NOT_METRICS or key.endswith("/"):
            continue
        ok = key in exact if "<" not in key else ref.documented(key, docs)
        if not ok:
            missing.append(f"{key} ({where})")
    assert not missing, ("metric keys in the code without a line in docs/reference/metrics.txt (add 'key: meaning'; "
                         f"or, if not a metric, to NOT_METRICS here): {missing}")


def test_metric_families_built_from_names_are_documented():
    import torch

    from rlhf.agent.rollout import tool_use_metrics
    from rlhf.ops.alerts import ALERTS
    from rlhf.rollout import engine
    from rlhf.rollout.speculative import SPEC_STATS, derived_stats

    stats = engine._SUMMED_STATS + engine.MULTI_TURN_STATS + engine._MAX_STATS + SPEC_STATS
    stats += ("slot_utilisation", "tokens_per_s") + tuple(derived_stats({k: 1.0 for k in SPEC_STATS}))
    keys = [f"rollout/{k}" for k in stats]

    class Batch:  # the two masks tool_use_metrics reads: 1 row, 2 generated tokens around a 1-token observation
        response_mask = torch.tensor([[1.0, 0.0, 1.0]])
        attention_mask = torch.ones(1, 5)

        def __len__(self):
            return 1

    from rlhf.agent.loop import AgentCounts

    for prefix in ("agent/", "val/agent/"):
        keys += list(tool_use_metrics(Batch(), AgentCounts(), prefix=prefix, reduce=False))
    keys += [f"alerts/{name}" for name in ALERTS]
    assert_documented(keys)


def test_the_metrics_check_fails_on_an_undocumented_key():
    docs = ref.metric_docs()
    assert ref.documented("reward/format", docs)  # a reward dict's own key: the reward/<key> line
    assert ref.documented("val/openai/gsm8k/pass@16", docs) and ref.documented("val/pass_at_4", docs)
    assert ref.documented("moe/router_entropy/layer3", docs)
    assert not ref.documented("distill/kl", docs) and not ref.documented("rollout/new_stat", docs)
    with pytest.raises(AssertionError, match="distill/kl"):
        assert_documented(["actor/loss", "step", "distill/kl"])


def test_metrics_page_lists_every_registry_line():
    docs = ref.metric_docs()
    page = ref.metrics_page()
    assert all(f"| `{k}` | {ref._cell(meaning)} |" in page for k, meaning in docs.items())
    assert page.index("## `reward/`") < page.index("## `actor/`")


def test_configuration_page_has_every_key_with_type_default_verl_name_and_mode_refusals():
    from rlhf.schema.config import Config
    from rlhf.train.sft import SFTConfig

    page = ref.config_page()
    keys = [k for k, _, _ in ref.leaf_fields(Config)]
    assert len(keys) > 150
    missing = [k for k in keys if f'<a id="{k}"></a>`{k}`' not in page]
    assert not missing, missing
    hints = __import__("typing").get_type_hints(SFTConfig)
    for section in ("sft", "trainer"):
        for key, _, _ in ref.leaf_fields(hints[section], f"{section}."):
            assert f"| `{key}` |" in page, key
    row = next(line for line in page.splitlines() if line.startswith('| <a id="actor.ppo_micro_batch_size_per_gpu"'))
    assert "| int | `8` |" in row and "`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`" in row
    assert "Sequences per forward/backward micro-batch per rank." in row
    refusals = page.split("## Keys refused under a mode", 1)[1]
    assert "| `rollout.ep=2` | `one_step_off` |" in refusals and "| `rollout.tp=2` | `fully_async` |" in refusals
    assert "| `algorithm.filter_groups.enable=true` | `one_step_off` |" in refusals
    assert "`rollout.ep=2` | `colocated`" not in refusals


def test_verl_names_come_from_the_translation_table():
    from rlhf.config.verl_keys import RULES

    names = ref.verl_names()
    assert names["parallel.sp"] == [k for k, r in RULES.items() if r.native == "parallel.sp"]
    assert "actor_rollout_ref.model.override_config" not in sum(names.values(), [])


def test_cli_page_has_every_entry_point():
    page = ref.cli_page()
    for cmd in [f"python {s}" for s in ref.ENTRY_SCRIPTS] + [c for c, _ in ref.MODULES]:
        assert f"## `{cmd}`" in page
    assert "--dry-run" in page and "--world-size" in page and "usage: python train_grpo.py" in page


def test_leaf_fields_cover_nested_sections():
    from rlhf.schema.config import Config

    keys = {k for k, _, _ in ref.leaf_fields(Config)}
    assert {"rollout.multi_turn.enable", "algorithm.kl_ctrl.kl_coef", "trainer.val_kwargs.n"} <= keys
    assert not any(dataclasses.is_dataclass(tp) for _, _, tp in ref.leaf_fields(Config))


def test_committed_reference_pages_equal_the_code():
    """docs/reference/configuration.md and metrics.md are committed (README links to them on GitHub); a config key
    or metric line added without refreshing them fails here."""
    pages = ref.pages()
    for path in ref.COMMITTED:
        committed = (ROOT / "docs" / path).read_text()
        assert committed == pages[path], (f"docs/{path} is stale: run `python scripts/docs_reference.py docs` and "
                                          f"commit the result")
