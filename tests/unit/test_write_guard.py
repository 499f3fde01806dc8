"""A checkpoint or HF export whose write fails (a full disk) raises one SaveFailedError naming the path,
the bytes needed and what was kept; the partial files go, the complete checkpoints stay.

ENOSPC is injected at the write seams here (fast, anywhere); the first checkpoint also on a real
tmpfs where mounting is permitted. The 2-rank run is tests/e2e/test_disk_full.py."""

from __future__ import annotations

import errno
import pathlib
import subprocess

import pytest
import torch

from rlhf.train.checkpoint import ModelOptimState, export_hf, find_resume_path, list_checkpoints, save_checkpoint
from rlhf.train.write_guard import SaveFailedError, describe, is_write_error


def _state():
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 64)).sum().backward()
    opt.step()
    return {"actor": ModelOptimState(model, opt)}


def _enospc(path=None):
    return OSError(errno.ENOSPC, "No space left on device", None if path is None else str(path))


def test_the_first_checkpoint_on_a_full_disk_keeps_nothing_and_says_so(mesh, tmp_path, monkeypatch):
    real = pathlib.Path.write_text

    def full(self, *a, **k):
        if self.name == "trainer_state.json":
            raise _enospc(self)
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(SaveFailedError) as e:
        save_checkpoint(str(tmp_path), 1, _state(), {"global_step": 1})
    ckpts = tmp_path / "checkpoints"
    # the tensors' bytes: Linear(64, 64)'s weight and bias (16,640 B), twice more for AdamW's moments
    assert str(e.value).startswith(f"checkpoint of step 1 not saved: no space left on device writing "
                                   f"{ckpts}/global_step_1.tmp/trainer_state.json (needs at least 49.9 KB, ")
    assert "the partial global_step_1.tmp was removed; kept: no checkpoint (this was the run's first)" in str(e.value)
    assert list(ckpts.iterdir()) == []


def test_a_later_checkpoint_on_a_full_disk_keeps_the_last_one_and_the_next_save_works(mesh, tmp_path, monkeypatch):
    state = _state()
    good = save_checkpoint(str(tmp_path), 1, state, {"global_step": 1})
    real = torch.save

    def full(obj, f, *a, **k):  # DCP's tensor writes and the RNG files all go through torch.save
        raise _enospc(f if isinstance(f, (str, pathlib.Path)) else None)

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SaveFailedError, match=rf"kept: the last complete checkpoint {good} \(step 1\)") as e:
        save_checkpoint(str(tmp_path), 2, state, {"global_step": 2})
    assert "checkpoint of step 2 not saved: no space left on device writing" in str(e.value)
    assert "needs about" in str(e.value) and "as global_step_1 took" in str(e.value)
    assert [p for _, p in list_checkpoints(tmp_path / "checkpoints")] == [good]
    assert not (tmp_path / "checkpoints" / "global_step_2.tmp").exists()
    monkeypatch.setattr(torch, "save", real)  # space freed
    assert save_checkpoint(str(tmp_path), 2, state, {"global_step": 2}) == find_resume_path("auto", str(tmp_path))


class _Exportable(torch.nn.Linear):
    """An HF-like model whose save_pretrained writes part of its file, then meets a full disk."""

    fail_with: BaseException = _enospc()

    def save_pretrained(self, out_dir, state_dict=None, safe_serialization=True):
        pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(out_dir) / "model.safetensors").write_bytes(b"\0" * 100)
        raise type(self).fail_with


@pytest.fixture
def no_peft(monkeypatch):
    """_Exportable is no LoRA model: skip importing peft to find out (seconds of imports)."""
    import rlhf.train.checkpoint as ckpt

    monkeypatch.setattr(ckpt, "_is_peft", lambda model: False)


def test_an_export_on_a_full_disk_removes_its_directory_and_names_the_checkpoint_to_export(mesh, tmp_path, no_peft):
    ckpt = save_checkpoint(str(tmp_path), 3, _state(), {"global_step": 3})
    out = tmp_path / "hf_export"
    model = _Exportable(8, 8)
    _Exportable.fail_with = _enospc(out / "model.safetensors")
    with pytest.raises(SaveFailedError) as e:
        export_hf(model, None, str(out))
    assert str(e.value) == (
        f"HF export not written: no space left on device writing {out}/model.safetensors (needs at least 288 B, "
        f"{str(e.value).split(', ')[1].split(')')[0]}); the incomplete {out} was removed; kept: the checkpoints, "
        f"the last {ckpt} (step 3); after freeing space, export it with python -m rlhf.checkpoint export "
        f"--ckpt {ckpt} --out {out}")
    assert not out.exists()


def test_a_failure_that_is_not_the_disks_still_ends_every_rank_with_its_traceback_printed(mesh, tmp_path, capsys,
                                                                                            no_peft):
    _Exportable.fail_with = KeyError("lm_head.weight")
    with pytest.raises(SaveFailedError, match=r"HF export not written: KeyError: 'lm_head.weight' writing "):
        export_hf(_Exportable(8, 8), None, str(tmp_path / "hf"))
    assert "Traceback" in capsys.readouterr().err  # a bug keeps its traceback


@pytest.mark.parametrize("e, full", [
    (_enospc(), True), (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), True),
    (Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"), True),
    (KeyError("x"), False), (OSError(errno.ENOENT, "No such file"), False)])
def test_the_writers_ways_of_saying_the_disk_is_full(e, full):
    assert is_write_error(e) == full
    assert describe(_enospc("/x/y"), pathlib.Path("/x")) == "no space left on device writing /x/y"


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_the_first_checkpoint_on_a_real_full_filesystem(mesh, tiny_fs):
    state = _state()
    with pytest.raises(SaveFailedError, match=r"checkpoint of step 1 not saved: no space left on device writing "
                                              rf"{tiny_fs}/checkpoints/global_step_1.tmp") as e:
        save_checkpoint(str(tiny_fs), 1, state, {"global_step": 1})
    assert "kept: no checkpoint (this was the run's first)" in str(e.value)
    assert list((tiny_fs / "checkpoints").iterdir()) == []
    subprocess.run(["mount", "-o", "remount,size=4m", str(tiny_fs)], check=True)  # space freed
    assert save_checkpoint(str(tiny_fs), 1, state, {"global_step": 1}) == find_resume_path("auto", str(tiny_fs))
