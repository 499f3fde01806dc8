"""DCP's ``.metadata`` read without running it, and the errors of a checkpoint that cannot be used.

DCP keeps a checkpoint's metadata as a pickle and torch loads it with ``pickle.load``, which runs
whatever a crafted file names. :func:`read_dcp_metadata` reads it first with an unpickler that
builds only what DCP writes there, so a resume, an export or an eval refuses such a file before
torch opens it.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (corrupt, truncated, incomplete); the message names it."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that does not load as plain data (tensors, numbers, strings, containers)."""


_DCP_METADATA = "torch.distributed.checkpoint.metadata"


def _dcp_enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` as the unpickler runs it: only a member of one of DCP's own metadata enums.

    Early 3.11 releases (Debian 12's ``python3`` is 3.11.2) pickle an Enum member by name, as
    ``builtins.getattr(cls, 'NAME')`` (later ones too, for an enum that opts into
    ``enum.pickle_by_enum_name``); the others pickle it by value, as ``cls(value)``. A
    checkpoint written there holds the by-name form, so the unpickler hands out this instead of
    ``getattr``: anything but a member name of an allowed enum (a dunder, a method, another class)
    is refused before it is looked up."""
    import enum

    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == _DCP_METADATA
            and isinstance(name, str) and name in cls.__members__):
        return cls.__members__[name]
    what = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else type(cls).__name__
    raise UnsafeCheckpointError(f"calls getattr({what}, {name!r}), which is not a member of a DCP metadata "
                                f"enum (refused, nothing of it was run)")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle (torch loads it with ``pickle.load``). Read first with this, which
    only builds what DCP writes there (its metadata classes, torch sizes, dtypes, layouts, paths, and
    its enums' members by name through :func:`_dcp_enum_member`), a crafted file is refused before
    torch would run it."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                *(("pathlib", n) for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        # A protocol-2 pickle names builtins by its Python 2 name (pickle's fix_imports); the base class maps
        # it back, an override must too. Still only what the checks below allow.
        module = "builtins" if module == "__builtin__" else module
        if (module, name) in self._ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "pathlib._local" and ("pathlib", name) in self._ALLOWED:
            # Python 3.13 moved the path classes into pathlib._local (pathlib re-exports them): a
            # checkpoint written there names that module, one written before it names pathlib
            return getattr(importlib.import_module("pathlib"), name)
        if (module, name) == ("builtins", "getattr"):  # by-name enum members (early 3.11)
            return _dcp_enum_member
        if module == _DCP_METADATA:  # its dataclasses and enums
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type):
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"names {module}.{name}, which DCP metadata never holds "
                                    f"(refused, nothing of it was run)")


def read_dcp_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` in ``path``, built only from the classes DCP writes there (see above)."""
    with Path(path).open("rb") as f:
        meta = _MetadataUnpickler(f).load()
    if not hasattr(meta, "state_dict_metadata"):
        raise ValueError(f"{path} holds a {type(meta).__name__}, not DCP metadata")
    return meta
