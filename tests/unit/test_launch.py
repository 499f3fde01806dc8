"""launch/slurm.sbatch finds the repository wherever the job was submitted from (issue 33 item 11)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_slurm(tmp_path):
    """``scontrol`` and ``srun`` stand-ins on PATH; srun records its working directory and arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n'
                                      'if [ "$2" = hostnames ]; then echo node1; fi\n'
                                      'if [ "$2" = job ]; then echo "   Command=$FAKE_COMMAND configs/x.yaml"; fi\n')
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\necho "cwd=$PWD"\necho "args=$*"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(ROOT / "launch" / "slurm.sbatch", spool / "slurm_script")  # what slurm runs
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "configs").mkdir(parents=True)
    (elsewhere / "configs" / "mine.yaml").write_text("{}\n")

    def run(command: str, **env):
        e = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node1",
                 SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=str(elsewhere), FAKE_COMMAND=command,
                 **env)
        e.pop("RLHF_ROOT", None)
        e.update(env)
        return subprocess.run(["bash", str(spool / "slurm_script"), "configs/mine.yaml", "actor.lr=1e-6"],
                              cwd=elsewhere, env=e, capture_output=True, text=True)

    return run, elsewhere


def test_submitted_from_another_directory_runs_in_the_repository(fake_slurm):
    run, elsewhere = fake_slurm
    r = run(str(ROOT / "launch" / "slurm.sbatch"))
    assert r.returncode == 0, r.stderr
    assert f"cwd={ROOT}" in r.stdout
    assert f"train_grpo.py --config {elsewhere}/configs/mine.yaml actor.lr=1e-6" in r.stdout


def test_repository_not_found_is_one_line(fake_slurm):
    run, elsewhere = fake_slurm
    r = run("/nowhere/launch/slurm.sbatch")
    assert r.returncode == 2 and "srun" not in r.stdout
    assert r.stderr.strip().startswith("error: cannot find train_grpo.py") and "RLHF_ROOT" in r.stderr
    r = run("/nowhere/launch/slurm.sbatch", RLHF_ROOT=str(ROOT))
    assert r.returncode == 0 and f"cwd={ROOT}" in r.stdout, r.stderr
