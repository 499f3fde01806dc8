"""Checkpoints through torch.distributed.checkpoint (DCP), resume, and HF export.

Layout of ``<output_dir>/checkpoints``::

    global_step_20/            one complete checkpoint
        model_optim/           DCP shards: {"actor": model+optimizer, "critic": ...}
        trainer_state.json     step, scheduler(s), data-loader position, KL controller
        rng_rank{r}.pt         per-rank RNG states
        COMPLETE               written last, after every rank finished
    global_step_30.tmp/        an interrupted save: never taken for the latest

A checkpoint is written into ``*.tmp`` and renamed only after all ranks have written
their part, so a crash mid-save cannot be mistaken for the latest checkpoint.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class ModelOptimState(Stateful):
    """DCP Stateful for an FSDP2 model and its optimizer (sharded, reshardable on load)."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        sd = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            sd["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd["model"])
        if self.optimizer is not None and "optim" in sd:
            set_optimizer_state_dict(self.model, self.optimizer, sd["optim"])


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "COMPLETE").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def find_resume_path(resume: str, output_dir: str) -> Optional[Path]:
    """`auto` -> latest complete checkpoint or None; `disable` -> None; else that path."""
    if resume == "disable":
        return None
    if resume == "auto":
        ckpts = list_checkpoints(Path(output_dir) / "checkpoints")
        return ckpts[-1][1] if ckpts else None
    p = Path(resume)
    if not (p / "COMPLETE").is_file():
        raise FileNotFoundError(f"checkpoint.resume: {resume} is not a complete checkpoint (no COMPLETE marker)")
    return p


def save_checkpoint(output_dir: str, step: int, stateful: dict[str, ModelOptimState], trainer_state: dict,
                    *, max_to_keep: int = 0) -> Path:
    root = Path(output_dir) / "checkpoints"
    final = root / f"global_step_{step}"
    tmp = root / f"global_step_{step}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save({k: v for k, v in stateful.items()}, checkpoint_id=str(tmp / "model_optim"))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (final / "COMPLETE").write_text(str(step))
        if max_to_keep > 0:
            for _, old in list_checkpoints(root)[:-max_to_keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: Path, stateful: dict[str, ModelOptimState]) -> dict:
    """Restore models/optimizers in place, this rank's RNG; returns the trainer state."""
    dcp.load({k: v for k, v in stateful.items()}, checkpoint_id=str(path / "model_optim"))
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / "trainer_state.json").read_text())


def export_hf(model: torch.nn.Module, tokenizer, out_dir: str) -> None:
    """Gather the full state dict to rank 0 and write `save_pretrained` (safetensors)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        target = getattr(model, "save_pretrained", None)
        if target is None:
            raise TypeError(f"{type(model).__name__} has no save_pretrained")
        sd = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in sd.items()}
        model.save_pretrained(out_dir, state_dict=sd, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    dist.barrier()
