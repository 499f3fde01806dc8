"""Read this rank's slices of an HF safetensors checkpoint, in the checkpoint's dtype.

Loading a model with ``from_pretrained`` puts every weight of the model on every rank's host
in the training dtype (Qwen3-30B-A3B in fp32: ~114 GiB per rank, ~0.9 TiB per 8-GPU node).
Here the model is built with its parameters on the meta device and each parameter carries a
:class:`CheckpointSlice` source; :func:`rlhf.models.shard_init.materialize_shards` asks it for
exactly the slice its DTensor placements give this rank (``safe_open(...).get_slice``, which
reads only those bytes from the memory-mapped file), upcasts that slice to the training dtype
and places it. A rank's host then holds one slice at a time.

Where transformers renames or fuses checkpoint tensors on load (``conversion_mapping``), only
the fused-experts layout of the Qwen2/Qwen3-MoE family (``experts.gate_up_proj`` = per-expert
``gate_proj`` and ``up_proj`` concatenated on dim 1, ``experts.down_proj`` = ``down_proj``
stacked) and Mixtral's (``block_sparse_moe``: ``w1`` / ``w3`` / ``w2`` the same way) are read
by slices; any other mismatch makes :func:`checkpoint_sources` return None
and the caller loads with ``from_pretrained`` in the checkpoint dtype instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class CheckpointIndex:
    """Where each tensor of a safetensors checkpoint lives: ``{key: (file, shape, dtype)}``.

    ``bytes_read`` counts the bytes of every slice read through it (a test seam and a
    measure of what a rank touched); files are opened once and kept open (memory-mapped).
    """

    def __init__(self, model_dir: Path):
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
        self.entries: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        self._open: dict[Path, object] = {}
        self.bytes_read = 0
        self.file_bytes = sum(f.stat().st_size for f in files)
        for f in files:
            h = self._handle(f)
            for k in h.keys():
                s = h.get_slice(k)
                dt = _ST_DTYPES.get(s.get_dtype())
                if dt is not None:  # integer buffers (none in the supported models) stay unmapped
                    self.entries[k] = (f, tuple(s.get_shape()), dt)

    def _handle(self, f: Path):
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt")
        return self._open[f]

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` of ``key`` in the checkpoint dtype; only those bytes are read."""
        f, _, _ = self.entries[key]
        t = self._handle(f).get_slice(key)[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def dtype(self) -> Optional[torch.dtype]:
        """The floating dtype most of the checkpoint's bytes are in (None when empty)."""
        by: dict[torch.dtype, int] = {}
        for _, shape, dt in self.entries.values():
            by[dt] = by.get(dt, 0) + int(torch.Size(shape).numel()) * dt.itemsize
        return max(by, key=by.get) if by else None


class CheckpointSlice:
    """A lazy global tensor read from the checkpoint by slices: one key, or per-expert keys
    concatenated (``parts[e]`` = the keys concatenated on dim 0 of row ``e``, then stacked)."""

    def __init__(self, index: CheckpointIndex, shape: tuple[int, ...], dtype: torch.dtype, *,
                 key: Optional[str] = None, parts: Optional[list[list[str]]] = None):
        self.index, self.shape, self.dtype, self.key, self.parts = index, tuple(shape), dtype, key, parts

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` (one slice per dim, steps of 1) in the checkpoint dtype."""
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        if self.key is not None:
            return self.index.read(self.key, index)
        e_range, r_slice, rest = index[0], index[1], index[2:]
        r0, r1, _ = r_slice.indices(self.shape[1])
        rows = []
        for e in range(*e_range.indices(self.shape[0])):
            pieces, off = [], 0
            for k in self.parts[e]:
                n = self.index.entries[k][1][0]
                lo, hi = max(r0, off), min(r1, off + n)
                if lo < hi:
                    pieces.append(self.index.read(k, (slice(lo - off, hi - off),) + rest))
                off += n
            rows.append(torch.cat(pieces, dim=0) if len(pieces) != 1 else pieces[0])
        return torch.stack(rows) if rows else torch.empty((0,) + self.shape[1:], dtype=self.dtype)


class HFLoad:
    """One parameter's tensor from a whole-model ``from_pretrained`` (in the checkpoint dtype) that
    runs only when the first parameter is placed, inside the staggered placement, and lets each
    tensor go once taken: for checkpoint layouts that need transformers' own conversions."""

    def __init__(self, shared: dict, name: str, nbytes: int):
        self.shared, self.name, self.nbytes = shared, name, nbytes

    def take(self) -> torch.Tensor:
        if "tensors" not in self.shared:
            model = self.shared.pop("load")()
            self.shared["tensors"] = {n: p.detach() for n, p in model.named_parameters()}
            del model
        return self.shared["tensors"].pop(self.name)


def deferred_whole_loads(model: nn.Module, load, nbytes: int) -> dict[str, HFLoad]:
    """``{parameter name: HFLoad}`` sharing one deferred ``load()`` of the whole model."""
    shared = {"load": load}
    return {name: HFLoad(shared, name, nbytes) for name, _ in model.named_parameters()}


def _mixtral_key(name: str) -> str:
    # Mixtral's hub layout (which transformers' save_pretrained writes back): block_sparse_moe.*
    return name.replace(".mlp.", ".block_sparse_moe.")


def _fused_expert_parts(name: str, num_experts: int, keys: dict) -> Optional[list[list[str]]]:
    # transformers' qwen2_moe conversion: gate_up_proj[e] = cat(gate_e, up_e), down_proj[e] = down_e;
    # its mixtral one: the same of w1 (gate), w3 (up) and w2 (down) under block_sparse_moe
    base, _, leaf = name.rpartition(".")
    hub = _mixtral_key(base)
    if leaf == "gate_up_proj":
        layouts = [[[f"{base}.{e}.gate_proj.weight", f"{base}.{e}.up_proj.weight"] for e in range(num_experts)],
                   [[f"{hub}.{e}.w1.weight", f"{hub}.{e}.w3.weight"] for e in range(num_experts)]]
    elif leaf == "down_proj":
        layouts = [[[f"{base}.{e}.down_proj.weight"] for e in range(num_experts)],
                   [[f"{hub}.{e}.w2.weight"] for e in range(num_experts)]]
    else:
        return None
    return next((parts for parts in layouts if all(k in keys for row in parts for k in row)), None)


def checkpoint_sources(model: nn.Module, index: CheckpointIndex) -> Optional[dict[str, CheckpointSlice]]:
    """``{parameter name: source}`` for every (deduplicated) parameter of ``model``, or None when
    some parameter has no tensor of the same shape in the checkpoint (a layout transformers
    converts in ways read here by slices does not follow)."""
    out: dict[str, CheckpointSlice] = {}
    for name, p in model.named_parameters():
        key = name if name in index.entries else _mixtral_key(name)
        entry = index.entries.get(key)
        if entry is not None and entry[1] == tuple(p.shape):
            out[name] = CheckpointSlice(index, p.shape, entry[2], key=key)
            continue
        parts = _fused_expert_parts(name, p.shape[0], index.entries) if p.dim() == 3 else None
        if parts is None:
            return None
        src = CheckpointSlice(index, p.shape, index.entries[parts[0][0]][2], parts=parts)
        widths = [sum(index.entries[k][1][0] for k in row) for row in parts]
        tails = {index.entries[k][1][1:] for row in parts for k in row}
        if set(widths) != {p.shape[1]} or tails != {tuple(p.shape[2:])}:
            return None
        out[name] = src
    return out


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real (rotary
    ``inv_freq`` is computed at construction and not stored in the checkpoint)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_dtype(model_dir: Path) -> Optional[torch.dtype]:
    """The checkpoint's floating dtype from its safetensors headers (config.json's ``dtype`` /
    ``torch_dtype`` describes the training run that saved it, not always the bytes)."""
    try:
        return CheckpointIndex(model_dir).dtype()
    except FileNotFoundError:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        name = cfg.get("dtype") or cfg.get("torch_dtype")
        return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None
