"""A checkpoint's own files (RNG, rank state) load as plain data: a crafted pickle does not run."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf.train.async_rl.pipeline import OneStepOff
from rlhf.schema.batch import RolloutBatch
from rlhf.train.checkpoint import (CheckpointError, ModelOptimState, UnsafeCheckpointError, find_resume_path,
                             load_checkpoint, load_rank_state, save_checkpoint, set_rng_state, verify_checkpoint)


class _Payload:
    """Unpickling this creates ``marker``: proof that loading ran code from the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def _batch() -> RolloutBatch:
    n, r = 2, 3
    return RolloutBatch(input_ids=torch.ones(n, 5, dtype=torch.long), attention_mask=torch.ones(n, 5),
                        responses=torch.ones(n, r, dtype=torch.long), response_mask=torch.ones(n, r),
                        index=torch.arange(n), rollout_log_probs=torch.zeros(n, r), truncated=torch.zeros(n).bool(),
                        response_texts=["a", "b"], ground_truths=["1", "2"], data_sources=["x", "x"],
                        extra_infos=[{"index": np.int64(3), "v": np.arange(2)}, {"index": 4}])


@pytest.fixture
def saved(mesh, tmp_path):
    model = torch.nn.Linear(3, 2)
    state = {"actor": ModelOptimState(model, torch.optim.AdamW(model.parameters()))}
    held = {"step": 3, "version": 1, "global_idx": [0, 1], "stats": {"a": 1.0}, "batch": _batch()}
    rank_state = OneStepOff.rank_state(SimpleNamespace(held=held))
    path = save_checkpoint(str(tmp_path), 2, state, {"global_step": 2}, rank_state=rank_state)
    return path, state


def test_rng_and_rank_state_round_trip_as_plain_data(saved):
    path, state = saved
    expected = _draws()
    assert load_checkpoint(path, state) == {"global_step": 2}
    assert _draws() == expected  # python, numpy and torch RNG all restored
    me = SimpleNamespace(held=None, device=torch.device("cpu"))
    OneStepOff.load_rank_state(me, load_rank_state(path))
    assert isinstance(me.held["batch"], RolloutBatch) and me.held["step"] == 3
    assert torch.equal(me.held["batch"].index, torch.arange(2))
    assert me.held["batch"].extra_infos[0] == {"index": 3, "v": [0, 1]}  # numpy values as plain ones


@pytest.mark.parametrize("name", ["rng_rank0.pt", "rank_state0.pt"])
def test_a_crafted_pickle_in_a_checkpoint_does_not_run(saved, tmp_path, name):
    path, state = saved
    marker = tmp_path / "pwned"
    torch.save({"python": _Payload(marker)}, path / name)
    with pytest.raises(UnsafeCheckpointError, match=f"{name}.*not plain data"):
        load_checkpoint(path, state)
        load_rank_state(path)
    assert not marker.exists()


def test_rng_state_of_an_older_checkpoint_still_loads(saved):
    """Before plain RNG files, numpy's state was a tuple holding an ndarray."""
    path, state = saved
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, path / "rng_rank0.pt")
    expected = _draws()
    load_checkpoint(path, state)
    assert _draws() == expected
    set_rng_state(old)


def _flip(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


DAMAGE = {  # what the fault-injection run of issue 33 did to the latest checkpoint
    "flipped shard": (lambda p: _flip(next((p / "model_optim").glob("*.distcp"))), "differs from its checksum"),
    "truncated shard": (lambda p: _truncate(next((p / "model_optim").glob("*.distcp"))), "truncated"),
    "no metadata": (lambda p: (p / "model_optim" / ".metadata").unlink(), ".metadata is missing"),
    "garbage rng": (lambda p: (p / "rng_rank0.pt").write_bytes(b"garbage" * 10), "rng_rank0.pt"),
    "bad trainer state": (lambda p: (p / "trainer_state.json").write_text('{"global_st'), "trainer_state.json"),
}


def _two_checkpoints(tmp_path):
    model = torch.nn.Linear(3, 2)
    state = {"actor": ModelOptimState(model, torch.optim.AdamW(model.parameters()))}
    good = save_checkpoint(str(tmp_path), 2, state, {"global_step": 2})
    with torch.no_grad():
        model.weight.add_(1.0)
    latest = save_checkpoint(str(tmp_path), 4, state, {"global_step": 4})
    return good, latest, state


@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("checksums", [True, False])
def test_a_damaged_latest_checkpoint_is_passed_over_with_a_warning(mesh, tmp_path, capsys, kind, checksums):
    good, latest, state = _two_checkpoints(tmp_path)
    assert verify_checkpoint(latest) is None and find_resume_path("auto", str(tmp_path)) == latest
    damage, why = DAMAGE[kind]
    damage(latest)
    if not checksums:  # a checkpoint written before checksums: sizes and readability still checked
        (latest / "CHECKSUMS.json").unlink()
        if kind == "flipped shard":
            why = None  # nothing tells a flipped byte then; loading it is still a one-line error at worst
    problem = verify_checkpoint(latest)
    if why is None:
        assert problem is None
        return
    assert why in problem, problem
    assert find_resume_path("auto", str(tmp_path)) == good
    err = capsys.readouterr().err
    assert "warning: skipped damaged checkpoint" in err and str(latest) in err and f"resuming from {good}" in err
    with pytest.raises(CheckpointError, match=f"checkpoint {latest} is damaged: .*{why.split()[0]}"):
        find_resume_path(str(latest), str(tmp_path))
    assert (good / "COMPLETE").is_file() and (latest / "COMPLETE").is_file()  # nothing deleted
    load_checkpoint(good, state)


def test_no_usable_checkpoint_is_one_error_naming_them(mesh, tmp_path):
    good, latest, _ = _two_checkpoints(tmp_path)
    for p in (good, latest):
        (p / "model_optim" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint .*global_step_4.*global_step_2"):
        find_resume_path("auto", str(tmp_path))


def test_loading_a_damaged_checkpoint_names_it(mesh, tmp_path):
    _, latest, state = _two_checkpoints(tmp_path)
    for f in (latest / "model_optim").glob("*.distcp"):
        f.write_bytes(b"x" * f.stat().st_size)  # same size, no checksums: only the load can tell
    (latest / "CHECKSUMS.json").unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint {latest} cannot be loaded"):
        load_checkpoint(latest, state)


def test_a_crafted_dcp_metadata_is_refused_before_torch_unpickles_it(mesh, tmp_path, capsys):
    """DCP reads .metadata with pickle.load: the resume reads it first with an unpickler that builds
    only DCP's metadata classes, so a crafted one is passed over (auto) or refused (a named path)."""
    good, latest, state = _two_checkpoints(tmp_path)
    marker = tmp_path / "pwned"
    (latest / "model_optim" / ".metadata").write_bytes(__import__("pickle").dumps(_Payload(marker)))
    assert re.search(r"names _?io\.open", verify_checkpoint(latest)) and not marker.exists()  # _io: 3.12+
    assert find_resume_path("auto", str(tmp_path)) == good
    with pytest.raises(CheckpointError, match=r"is damaged: model_optim/.metadata names _?io\.open"):
        find_resume_path(str(latest), str(tmp_path))
    assert not marker.exists()
