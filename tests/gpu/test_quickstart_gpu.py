"""The quickstart (SFT warm start + 60 GRPO steps) on one GPU learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.gpu._gpu import GPU

pytestmark = GPU
ROOT = Path(__file__).resolve().parents[2]


def _run(args, cwd):
    r = subprocess.run([sys.executable] + args, cwd=cwd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_quickstart_learns_on_gpu(tmp_path):
    d = tmp_path
    _run(["-m", "rlhf.data.synthetic", "--out", str(d / "data"), "--n-sft", "8000"], ROOT)
    _run(["-m", "rlhf.models.tiny", "--out", str(d / "init")], ROOT)
    _run([str(ROOT / "train_sft.py"), "--config", str(ROOT / "configs/quickstart_sft.yaml"),
          f"model.path={d / 'init'}", f"sft.train_files={d / 'data/sft.jsonl'}", "trainer.device=cuda",
          f"trainer.output_dir={d / 'sft'}"], ROOT)
    _run([str(ROOT / "train_grpo.py"), "--config", str(ROOT / "configs/quickstart.yaml"),
          f"model.path={d / 'sft/hf_export'}", f"data.train_files={d / 'data/train.parquet'}",
          f"data.val_files={d / 'data/val.parquet'}", "trainer.device=cuda", f"trainer.output_dir={d / 'grpo'}"], ROOT)
    rows = [json.loads(line) for line in (d / "grpo/metrics.jsonl").read_text().splitlines()]
    acc = [r["val/acc"] for r in rows if "val/acc" in r]
    print(f"GPU quickstart val/acc: first {acc[0]:.3f}, last {acc[-1]:.3f}, best {max(acc):.3f}")
    assert acc[-1] - acc[0] >= 0.20, acc
