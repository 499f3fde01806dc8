"""DCP metadata pickled with Enum members by name (early Python 3.11, e.g. Debian 12's 3.11.2) or by
value (other Pythons) both load; ``getattr`` on anything but a DCP enum's member stays refused."""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

from rlhf.train.checkpoint import (ModelOptimState, UnsafeCheckpointError, find_resume_path, load_checkpoint,
                                   read_dcp_metadata, save_checkpoint, verify_checkpoint)


class _EnumPickler(pickle.Pickler):
    """Writes every Enum member in one form, whatever this Python's default: ``by_name`` as
    ``getattr(cls, 'NAME')`` (what 3.11.2's ``Enum.__reduce_ex__`` returns), else as ``cls(value)``."""

    def __init__(self, f, by_name: bool):
        super().__init__(f, protocol=pickle.DEFAULT_PROTOCOL)
        self.by_name = by_name

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return (getattr, (type(obj), obj.name)) if self.by_name else (type(obj), (obj.value,))
        return NotImplemented


def _dump(obj, by_name: bool) -> bytes:
    buf = io.BytesIO()
    _EnumPickler(buf, by_name).dump(obj)
    return buf.getvalue()


@pytest.fixture
def saved(mesh, tmp_path):
    model = torch.nn.Linear(3, 2)
    state = {"actor": ModelOptimState(model, torch.optim.AdamW(model.parameters()))}
    model(torch.ones(1, 3)).sum().backward()
    state["actor"].optimizer.step()  # optimizer state too: more tensors, more enum members
    return save_checkpoint(str(tmp_path), 1, state, {"global_step": 1}), state


@pytest.mark.parametrize("by_name", [True, False], ids=["by-name (3.11.2)", "by-value"])
def test_dcp_metadata_loads_with_enum_members_pickled_either_way(saved, by_name):
    path, state = saved
    meta_file = path / "model_optim" / ".metadata"
    with meta_file.open("rb") as f:
        meta = pickle.load(f)  # our own file: the trusted reader, to rewrite it in the other form
    data = _dump(meta, by_name)  # TensorProperties pickles its memory format as a _MEM_FORMAT_ENCODING
    assert b"_MEM_FORMAT_ENCODING" in data
    assert (b"getattr" in data) == by_name  # the form under test is really the one written
    meta_file.write_bytes(data)
    (path / "CHECKSUMS.json").unlink()  # the rewrite changes the bytes, not the content

    read = read_dcp_metadata(meta_file)
    assert isinstance(read, Metadata) and read == meta
    assert verify_checkpoint(path) is None
    assert find_resume_path("auto", str(path.parent.parent)) == path
    assert load_checkpoint(path, state) == {"global_step": 1}


def test_dcp_metadata_written_on_python_3_13_names_pathlib_local_and_loads(saved):
    """Python 3.13 pickles a PosixPath (DCP's storage_meta.checkpoint_id) as pathlib._local.PosixPath."""
    path, _ = saved
    meta_file = path / "model_optim" / ".metadata"
    with meta_file.open("rb") as f:
        meta = pickle.load(f)
    data = pickle.dumps(meta, protocol=2)  # no frames: a global's module can be renamed in place
    for module in (b"pathlib._local", b"pathlib"):
        data = data.replace(b"c" + module + b"\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
    assert b"cpathlib._local\nPosixPath\n" in data
    meta_file.write_bytes(data)
    assert read_dcp_metadata(meta_file) == meta


def _getattr_pickle(obj, name: str) -> bytes:
    """A crafted pickle: ``getattr(obj, name)``, as the by-name Enum form writes it."""
    return pickle.dumps(_Reduce(getattr, (obj, name)))


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _touch_pickle(marker: Path) -> bytes:
    """A crafted pickle: ``getattr(PosixPath(marker), 'touch')()``, a bound method of an allowed class."""
    return (b"cbuiltins\ngetattr\n(cpathlib\nPosixPath\n(V" + str(marker).encode()
            + b"\ntRVtouch\ntR(tR.")


def _refused(data: bytes, path: Path) -> str:
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=r"refused, nothing of it was run") as e:
        read_dcp_metadata(path)
    return str(e.value)


@pytest.mark.parametrize("obj, name, says", [
    (_MEM_FORMAT_ENCODING, "__class__", "getattr(torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING, "
                                        "'__class__')"),
    (_MEM_FORMAT_ENCODING, "NOT_A_MEMBER", "'NOT_A_MEMBER'"),
    (_MEM_FORMAT_ENCODING, "_missing_", "'_missing_'"),
    (torch.Size, "__reduce__", "getattr(torch.Size, '__reduce__')"),  # an allowed class, not an enum
    (Metadata, "__init__", "Metadata, '__init__'"),  # a DCP metadata class, not an enum
])
def test_getattr_on_anything_but_a_dcp_enum_member_is_refused(tmp_path, obj, name, says):
    assert says in _refused(_getattr_pickle(obj, name), tmp_path / ".metadata")


def test_a_crafted_getattr_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    # getattr(PosixPath(marker), 'touch')(): a bound method of an allowed class, then called.
    pickle.loads(_touch_pickle(tmp_path / "control"))
    assert (tmp_path / "control").exists()  # the plain unpickler runs it
    msg = _refused(_touch_pickle(marker), tmp_path / ".metadata")
    assert "getattr(PosixPath, 'touch')" in msg and not marker.exists()
    # getattr(os, 'system')('touch marker'), hand-written: the module never gets built.
    crafted = (b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(Vtouch "
               + str(marker).encode() + b"\ntR.")
    assert "names builtins.__import__" in _refused(crafted, tmp_path / ".metadata") and not marker.exists()
    crafted = b"cbuiltins\ngetattr\n(cos\nsystem\nV__call__\ntR(Vtouch " + str(marker).encode() + b"\ntR."
    assert "names os.system" in _refused(crafted, tmp_path / ".metadata") and not marker.exists()


def test_a_checkpoint_whose_metadata_calls_getattr_elsewhere_is_passed_over(saved, tmp_path):
    path, _ = saved
    marker = tmp_path / "pwned"
    (path / "model_optim" / ".metadata").write_bytes(_touch_pickle(marker))
    assert "calls getattr(PosixPath, 'touch')" in verify_checkpoint(path)
    assert not marker.exists()
