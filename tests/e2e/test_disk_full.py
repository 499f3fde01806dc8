"""A disk that fills while a 2-rank run saves: the second checkpoint, then the HF export, each end the
job with one ``error:`` line naming the path, the bytes needed and what was kept; no rank dies of a
lost peer; the last good checkpoint stays, the run resumes from it once space is freed, and the
checkpoint kept when the export failed exports.

A real small filesystem: a tmpfs mounted for the test (skipped where mounting is not permitted; the
first-checkpoint case and the agreement logic are unit-tested with an injected ENOSPC in
tests/unit/test_write_guard.py). A ballast file fills it to the free space each case needs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import grpo_args, run_script


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:100]})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _leave_free(fs: Path, n_bytes: int) -> Path:
    """Fill ``fs`` with a ballast file so that about ``n_bytes`` stay free."""
    ballast = fs / f"ballast-{uuid.uuid4().hex[:6]}"
    size = shutil.disk_usage(fs).free - n_bytes
    with ballast.open("wb") as f:
        f.write(b"\0" * max(0, size))
    return ballast


def _size(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def _one_error_line(r) -> str:
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, out[-3000:]
    # torchrun's own summary of a failed worker is its one traceback; none comes from a rank
    assert out.count("Traceback") == out.count("elastic.multiprocessing.errors.ChildFailedError:"), out[-3000:]
    assert "Connection closed by peer" not in out and "OSError" not in out, out[-3000:]
    return lines[0]


def test_a_full_disk_at_the_second_checkpoint_and_at_the_export_keeps_the_last_one(tiny_assets, small_fs):
    out = small_fs / "run"
    ckpts = out / "checkpoints"

    def run():
        return run_script("train_grpo.py", grpo_args(tiny_assets, out, **{
            "trainer.total_training_steps": 2, "checkpoint.save_freq": 1, "checkpoint.export_hf": True,
            "data.val_files": ""}), nproc=2, timeout=400)

    # The second checkpoint: room for one (about 1 MB with its optimizer state), not two.
    ballast = _leave_free(small_fs, 1_600_000)
    line = _one_error_line(run())
    assert f"checkpoint of step 2 not saved: no space left on device writing {ckpts}/global_step_2.tmp" in line
    assert re.search(r"\(needs about 1\.\d MB, as global_step_1 took, \d+\.\d KB free\)", line), line
    assert "the partial global_step_2.tmp was removed" in line, line
    assert f"kept: the last complete checkpoint {ckpts}/global_step_1 (step 1)" in line, line
    assert sorted(p.name for p in ckpts.iterdir()) == ["global_step_1"]

    # Space freed for the checkpoint, not for the export (about 100 KB): the run resumes from step 1,
    # saves step 2, and the export fails.
    ballast.unlink()
    ballast = _leave_free(small_fs, _size(ckpts / "global_step_1") + 40_000)
    r = run()
    assert f"resumed from {ckpts}/global_step_1 at step 1" in r.stdout, r.stdout[-3000:]
    line = _one_error_line(r)
    assert f"HF export not written: no space left on device writing {out}/hf_export" in line, line
    assert f"the incomplete {out}/hf_export was removed" in line, line
    assert f"kept: the checkpoints, the last {ckpts}/global_step_2 (step 2)" in line, line
    assert not (out / "hf_export").exists()

    # Freed: the kept checkpoint exports (the offline export, in this process: a third run would only
    # resume at its last step and call the same export_hf).
    ballast.unlink()
    from rlhf.export import export_checkpoint

    export_checkpoint(ckpts / "global_step_2", out / "hf_export")
    assert (out / "hf_export" / "config.json").is_file()
