"""``python -m rlhf.checkpoint export`` of a tiny GRPO run's checkpoint equals the run's own
``hf_export`` (tensors, tokenizer, logits in transformers); ``rlhf.eval`` takes the checkpoint
directory itself (a 30-line traceback before); wrong directories end with one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.e2e.conftest import ROOT, grpo_args, run_script


@pytest.fixture(scope="module")
def grpo_run(tiny_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "grpo"
    args = grpo_args(tiny_assets, out, **{"trainer.total_training_steps": 1, "checkpoint.save_freq": 1,
                                          "checkpoint.export_hf": True, "data.val_files": "", "reward.num_workers": 0,
                                          "model.enable_gradient_checkpointing": True})
    r = run_script("train_grpo.py", args)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _module(*args: str):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_export_equals_the_runs_hf_export(grpo_run, tiny_assets, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = grpo_run / "checkpoints" / "global_step_1"
    r = _module("rlhf.checkpoint", "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"exported the actor of {ckpt} to {tmp_path / 'hf'}" in r.stdout and "Warning" not in r.stderr
    got, want = load_file(tmp_path / "hf" / "model.safetensors"), load_file(grpo_run / "hf_export" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "hf" / f).read_text() == (grpo_run / "hf_export" / f).read_text(), f
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = AutoModelForCausalLM.from_pretrained(grpo_run / "hf_export").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_assets / "model").eval()
    with torch.no_grad():
        logits = exported(input_ids=ids).logits
        assert torch.equal(logits, trained(input_ids=ids).logits)
        assert not torch.allclose(logits, base(input_ids=ids).logits)  # the step changed the weights


def test_eval_takes_the_checkpoint_dir(grpo_run, tiny_assets):
    ckpt = grpo_run / "checkpoints" / "global_step_1"
    common = ["--data", str(tiny_assets / "data" / "val.parquet"), "--max-new-tokens", "4", "--max-prompt-length",
              "16", "--reward-workers", "0", "--limit", "4"]
    r = _module("rlhf.eval", "--model", str(ckpt), *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "a training checkpoint, exported to" in r.stdout and "4 samples of 4 prompts" in r.stdout


def test_export_errors_are_one_line(grpo_run, tmp_path):
    import shutil

    from rlhf.export import export_checkpoint, hf_model_dir
    from rlhf.schema.config import ConfigError

    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        export_checkpoint(grpo_run, tmp_path / "x")
    with pytest.raises(ConfigError, match=re.escape(f"--model: {grpo_run} is a run directory; pass "
                                                    f"{grpo_run / 'hf_export'} or a checkpoint")):
        with hf_model_dir(str(grpo_run)):
            pass
    partial = tmp_path / "run" / "checkpoints" / "global_step_1"
    shutil.copytree(grpo_run / "checkpoints" / "global_step_1", partial)
    (partial / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match="an incomplete checkpoint"):
        export_checkpoint(partial, tmp_path / "x")
    (partial / "COMPLETE").write_text("1")
    with pytest.raises(ConfigError, match=r"the run's config.yaml is not at .*run/config.yaml.*--run-config"):
        export_checkpoint(partial, tmp_path / "x")
    (tmp_path / "run" / "config.yaml").write_text("model:\n  path: /moved/away\n")
    with pytest.raises(ConfigError, match=r"model.path of the run's config.yaml \(or --model-path\): model directory "
                                          r"not found: /moved/away"):
        export_checkpoint(partial, tmp_path / "x")


def test_critic_export_is_a_value_model_a_later_run_starts_from(grpo_run, tiny_assets, tmp_path, parity_reward):
    """``--role critic`` of a PPO checkpoint: the trained critic's tensors, loadable as ``critic.model_path``
    (values equal to the checkpoint's critic, not to a fresh head's zeros)."""
    from transformers import AutoModelForTokenClassification

    from rlhf.export import read_model_state
    from rlhf.train.critic import load_value_model

    out = tmp_path / "ppo"
    args = grpo_args(tiny_assets, out, **{"algorithm.adv_estimator": "gae", "critic.lr": 1e-2, "critic.ppo_mini_batch_size": 4,
                                          "critic.ppo_micro_batch_size_per_gpu": 4,
                                          "trainer.total_training_steps": 1, "checkpoint.save_freq": 1,
                                          "data.val_files": "", "reward.num_workers": 0,
                                          "reward.reward_fn": parity_reward})  # varied rewards: the critic learns
    r = run_script("train_ppo.py", args)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = out / "checkpoints" / "global_step_1"
    r = _module("rlhf.checkpoint", "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "critic"), "--role", "critic")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"exported the critic of {ckpt}" in r.stdout
    want = read_model_state(ckpt, "critic")
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic").eval()
    assert exported.config.num_labels == 1 and exported.config.architectures[0].endswith("ForTokenClassification")
    got = exported.state_dict()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert want["score.weight"].abs().sum() > 0  # trained from the zero-initialised head
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    critic = load_value_model(str(tmp_path / "critic")).eval()
    with torch.no_grad():
        values = critic(input_ids=ids).logits
        assert torch.equal(values, exported(input_ids=ids).logits) and values.abs().sum() > 0
    # a GRPO checkpoint has no critic: one line
    from rlhf.export import export_checkpoint
    from rlhf.schema.config import ConfigError

    with pytest.raises(ConfigError, match="holds no 'critic' model"):
        export_checkpoint(grpo_run / "checkpoints" / "global_step_1", tmp_path / "x", role="critic")


def test_an_offline_export_to_a_full_disk_is_one_line(grpo_run, tmp_path, capsys):
    """issue 55: `python -m rlhf.checkpoint export` onto a filesystem without room (a 16 KB tmpfs; the
    export is about 100 KB): one line naming the path and what is unchanged, exit status 2."""
    import subprocess

    from rlhf.export import main

    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    ckpt = grpo_run / "checkpoints" / "global_step_1"
    try:
        with pytest.raises(SystemExit) as e:
            main(["export", "--ckpt", str(ckpt), "--out", str(mnt / "hf")])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert e.value.code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: export to {mnt / 'hf'} not written: no space left on device writing "
                               f"{mnt / 'hf'}"), err
    assert f"the checkpoint {ckpt} is unchanged: free space and rerun" in err and "Traceback" not in err
