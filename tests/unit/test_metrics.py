"""MetricsLogger, PhaseTimer, summaries and the plot script."""

import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf.ops.metrics import MetricsLogger, PhaseTimer, progress_line, read_metrics, summarize_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_jsonl_written_and_read_back(tmp_path):
    out = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=4, rank=0, stream=out) as logger:
        logger.log(1, {"reward/mean": 0.25, "timing/generate": torch.tensor(1.5)})
        logger.log(2, {"reward/mean": 0.5, "val/acc": 0.75, "actor/kl": float("nan")})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.25 and rows[0]["timing/generate"] == 1.5
    assert rows[1]["val/acc"] == 0.75 and "val/acc" not in rows[0]
    assert math.isnan(rows[1]["actor/kl"])
    # the file itself is strict JSON (NaN written as null)
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    console = out.getvalue().splitlines()
    assert console[0].startswith("step 1/4 [#####---------------]  25%")
    assert "reward/mean 0.25" in console[0] and "timing/generate" not in console[0]
    assert "val/acc 0.75" in console[1]


def test_appends_on_resume(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",), total_steps=3) as logger:
        logger.log(1, {"a": 1})
    with MetricsLogger(tmp_path, backends=("jsonl",), total_steps=3) as logger:
        logger.log(2, {"a": 2})
    assert [r["a"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_only_rank0_writes(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "r1", total_steps=2, rank=1)
    logger.log(1, {"a": 1.0})
    logger.close()
    assert not (tmp_path / "r1").exists()
    assert capsys.readouterr().out == ""


def test_bad_backend_and_nonscalar(tmp_path):
    with pytest.raises(ValueError, match="unknown logger backend.*'tensorbored'.*tensorboard"):
        MetricsLogger(tmp_path, backends=("tensorbored",), total_steps=1)
    logger = MetricsLogger(tmp_path, backends=("jsonl",), total_steps=1)
    with pytest.raises(ValueError, match="metric 'x' is a tensor of shape \\(2,\\)"):
        logger.log(1, {"x": torch.ones(2)})
    logger.close()


@pytest.mark.parametrize("name, module", [("tensorboard", "torch.utils.tensorboard"), ("mlflow", "mlflow"),
                                          ("wandb", "wandb")])
def test_missing_optional_backend_is_a_clear_error(tmp_path, monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail as if not installed
    with pytest.raises(ImportError, match=f"pip install {name}"):
        MetricsLogger(tmp_path, backends=(name,), total_steps=1)


def test_progress_line_eta():
    line = progress_line(5, 10, elapsed_s=50.0, steps_done=5, metrics={"reward/mean": 0.5}, keys=["reward/mean"])
    assert line == "step 5/10 [##########----------]  50% ETA 50s | reward/mean 0.5"


def test_phase_timer_accumulates_and_resets():
    timer = PhaseTimer("cpu")
    with timer("generate"):
        time.sleep(0.01)
    with timer("generate"):
        time.sleep(0.01)
    with timer("update"):
        pass
    t = timer.pop()
    assert set(t) == {"timing/generate", "timing/update"}
    assert t["timing/generate"] >= 0.02
    assert timer.pop() == {}
    with pytest.raises(RuntimeError):
        with timer("fail"):
            raise RuntimeError("x")
    assert "timing/fail" in timer.pop()  # time is recorded even when the phase raises


def test_summarize_metrics():
    s = summarize_metrics({"score": [1.0, 3.0], "len": torch.tensor([2, 2, 2]), "empty": []})
    assert s == {
        "score/mean": 2.0, "score/std": 1.0, "score/max": 3.0, "score/min": 1.0,
        "len/mean": 2.0, "len/std": 0.0, "len/max": 2.0, "len/min": 2.0,
    }


def test_plot_script(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",), total_steps=4) as logger:
        for step in range(1, 5):
            m = {"reward/mean": step / 4}
            if step % 2 == 0:
                m["val/acc"] = step / 8
            logger.log(step, m)
    out = tmp_path / "curve.png"
    cmd = [sys.executable, str(ROOT / "scripts" / "plot_metrics.py"), str(tmp_path / "metrics.jsonl"),
           "--out", str(out), "--keys", "val/acc", "reward/mean"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(cmd[:-2] + ["nope"], capture_output=True, text=True)
    assert bad.returncode != 0 and "['nope'] not in" in bad.stderr


def test_plot_series_last_value_per_step():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from plot_metrics import series
    finally:
        sys.path.pop(0)
    rows = [{"step": 1, "a": 1.0}, {"step": 2}, {"step": 2, "a": 5.0}, {"step": 1, "a": 3.0}, {"step": 3, "a": math.nan}]
    assert series(rows, "a") == ([1, 2], [3.0, 5.0])


def test_mark_start_drops_rows_after_the_resumed_step(tmp_path):
    from rlhf.ops.metrics import MetricsLogger, read_metrics

    first = MetricsLogger(tmp_path, backends=("jsonl",), total_steps=5)
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    first.close()
    # A restart from the step-2 checkpoint: steps 3-4 of the first process are gone, 3-5 re-logged.
    second = MetricsLogger(tmp_path, backends=("jsonl",), total_steps=5)
    second.mark_start(2)
    for step in range(3, 6):
        second.log(step, {"loss": 10.0 * step})
    second.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in rows] == [1.0, 2.0, 30.0, 40.0, 50.0]


@pytest.mark.parametrize("tail", ['{"step": 3, "loss": 3.', '{"step": 3, "loss": 3.0}', '\xff\xfe{"st'])
def test_mark_start_drops_a_partial_last_line_with_a_note(tmp_path, tail):
    """A kill or a full disk mid-write leaves a partial last line: resume drops it (with a note) and
    keeps every complete row; the next row starts on its own line."""
    first = MetricsLogger(tmp_path, backends=("jsonl",), total_steps=5)
    for step in (1, 2):
        first.log(step, {"loss": float(step)})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a", encoding="utf-8", errors="surrogateescape") as f:
        f.write(tail)  # no newline: the write was cut short
    out = io.StringIO()
    second = MetricsLogger(tmp_path, backends=("jsonl",), total_steps=5, stream=out)
    second.mark_start(2)
    second.log(3, {"loss": 30.0})
    second.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    if tail.endswith("}"):  # complete JSON without its newline (a step-3 row, after the checkpoint): dropped as a later step
        assert "incomplete" not in out.getvalue()
    else:
        assert "dropped 1 incomplete line" in out.getvalue() and "metrics.jsonl" in out.getvalue()
