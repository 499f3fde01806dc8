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
import os
import pickle
import random
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any, NoReturn, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from rlhf.models.parallel import all_gather_object
from rlhf.schema.config import ConfigError
from rlhf.train.checkpoint_metadata import CheckpointError, UnsafeCheckpointError, read_dcp_metadata
from rlhf.train.write_guard import SaveFailedError, agree, attempt, full_disk, space_note

_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class ModelOptimState(Stateful):
    """DCP Stateful for an FSDP2 model (or this rank's pipeline stages) and its optimizer.

    Sharded and reshardable on load. The optimizer state is flattened to one key per
    parameter (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): with pipeline stages
    every rank holds other parameters, and a nested ``param_groups`` list would be one
    key that DCP de-duplicates across ranks, so stages would load each other's groups.
    Per-parameter keys also let a checkpoint load into another pp / dp / tp layout.
    """

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        sd = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            sd["optim"] = get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd["model"])
        if self.optimizer is not None and "optim" in sd:
            set_optimizer_state_dict(self.model, self.optimizer, sd["optim"], options=self._OPTIONS)


def rng_state() -> dict:
    """This process's RNG states as tensors, ints and tuples only: loadable with ``weights_only=True``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st = {"python": random.getstate(), "torch": torch.get_rng_state(),
          "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    npst = st["numpy"]
    if isinstance(npst, dict):
        npst = (npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                npst["cached_gaussian"])
    np.random.set_state(npst)  # a tuple: checkpoints written before the tensor form
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# Older checkpoints kept numpy's RNG state as an ndarray; these globals rebuild only that (under
# either module name numpy has given ``_reconstruct``).
def _numpy_globals() -> list:
    reconstruct = np.zeros(1).__reduce__()[0]  # numpy's _reconstruct, wherever this numpy keeps it
    return [(reconstruct, "numpy.core.multiarray._reconstruct"), (reconstruct, "numpy._core.multiarray._reconstruct"),
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_plain(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``: a checkpoint's own small files (RNG, rank state) hold
    plain data only, so a crafted pickle raises instead of running. Errors name the file."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"checkpoint file {path} is not plain data (refused, nothing of it was run): "
                                    f"{_why(e).split('. Please')[0]}") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UnsafeCheckpointError(f"checkpoint file {path} is unreadable ({_why(e)})") from e


def _why(e: BaseException) -> str:
    """One line of what went wrong inside torch (a DCP failure: the first failing rank's error)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))
        e = e[0] if isinstance(e, tuple) else e  # (exception, traceback) of the failing rank
    unpickler = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(e))
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    return f"{type(e).__name__}: " + (unpickler.group(1).strip() if unpickler else (lines or [""])[0])[:300]


def to_plain(obj: Any) -> Any:
    """``obj`` with numpy values as lists / Python scalars, tuples and dicts kept: what ``load_plain`` reads."""
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_plain(v) for v in obj)
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    return obj


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


CHECKSUMS = "CHECKSUMS.json"


def check_output_dir(path: str, key: str = "trainer.output_dir") -> None:
    """A ConfigError naming ``key`` when the run could not write there (a file, read-only, under a
    file), found before any work instead of at the first write. Creates nothing."""

    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{key}: {path} exists and is not a directory")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}: {path} cannot be created: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {path} is not writable ({probe} is read-only for this user)")


def _crc32(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _checkpoint_files(path: Path) -> list[str]:
    """Every file of a checkpoint but its markers, relative and sorted (the same list on every rank)."""
    return sorted(str(f.relative_to(path)) for f in path.rglob("*")
                  if f.is_file() and f.name not in ("COMPLETE", CHECKSUMS))


def _my_share(names: list, group: Optional[dist.ProcessGroup], collective: bool = True) -> list:
    """This rank's part of ``names``: checksums are computed and verified by all ranks in parallel."""
    if not collective or not dist.is_initialized():
        return names
    return names[dist.get_rank(group):: dist.get_world_size(group)]


def _structure_problem(path: Path, group: Optional[dist.ProcessGroup] = None,
                       collective: bool = True) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be loaded, judged from its files' presence and sizes."""
    try:
        st = json.loads((path / "trainer_state.json").read_text())
        if not isinstance(st, dict) or "global_step" not in st:
            return "trainer_state.json has no global_step"
    except (OSError, ValueError) as e:
        return f"trainer_state.json unreadable ({type(e).__name__})"
    shards = path / "model_optim"
    if not (shards / ".metadata").is_file():
        return "model_optim/.metadata is missing"
    try:
        meta = read_dcp_metadata(shards / ".metadata")
        needed: dict[str, int] = {}
        for info in (meta.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except UnsafeCheckpointError as e:
        return f"model_optim/.metadata {e}"
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises anything
        return f"model_optim/.metadata unreadable ({type(e).__name__})"
    for name, size in sorted(needed.items()):
        f = shards / name
        if not f.is_file():
            return f"model_optim/{name} is missing"
        if f.stat().st_size < size:
            return f"model_optim/{name} is truncated ({f.stat().st_size} of {size} bytes)"
    for f in _my_share(sorted(path.glob("rng_rank*.pt")) + sorted(path.glob("rank_state*.pt")), group, collective):
        try:
            load_plain(f)
        except CheckpointError as e:
            return str(e).replace(f"checkpoint file {f}", f.name, 1)
    return None


def verify_checkpoint(path: Path, group: Optional[dist.ProcessGroup] = None, *,
                      collective: bool = True) -> Optional[str]:
    """None if the checkpoint at ``path`` looks loadable, else why not (files missing or truncated, a
    checksum that differs from the one written at save time). A collective of ``group`` when the
    process group is up: each rank checks its share of the files. ``collective=False``: this process
    checks every file alone (the offline export, which one rank may run inside a job)."""
    problem = _structure_problem(path, group, collective)
    if problem is None and (path / CHECKSUMS).is_file():
        try:
            sums = json.loads((path / CHECKSUMS).read_text())
        except (OSError, ValueError):
            sums, problem = {}, f"{CHECKSUMS} unreadable"
        for name in _my_share(sorted(sums), group, collective):
            f = path / name
            if not f.is_file():
                problem = f"{name} is missing"
            elif _crc32(f) != sums[name]:
                problem = f"{name} differs from its checksum"
            if problem:
                break
    if collective and dist.is_initialized():  # every rank takes the same decision
        problems = [p for p in all_gather_object(problem, group) if p]
        problem = problems[0] if problems else None
    return problem


def find_resume_path(resume: str, output_dir: str, group: Optional[dist.ProcessGroup] = None) -> Optional[Path]:
    """`auto` -> latest complete checkpoint that verifies (a damaged newer one is passed over with a
    warning) or None; `disable` -> None; else that path, which must verify. A collective of ``group``
    when the process group is up (see :func:`verify_checkpoint`). Raises :class:`CheckpointError`
    naming the checkpoint when none can be used."""
    if resume == "disable":
        return None
    if resume == "auto":
        bad = []
        for _, path in reversed(list_checkpoints(Path(output_dir) / "checkpoints")):
            problem = verify_checkpoint(path, group)
            if problem is None:
                if bad and (not dist.is_initialized() or dist.get_rank() == 0):
                    print(f"[rlhf] warning: skipped damaged checkpoint(s) {'; '.join(bad)}; resuming from {path}",
                          file=sys.stderr, flush=True)
                return path
            bad.append(f"{path}: {problem}")
        if bad:  # starting over would re-log (and drop) the steps these checkpoints hold
            raise CheckpointError(f"checkpoint.resume=auto: no usable checkpoint ({'; '.join(bad)}); "
                                  f"move them away to start over, or set checkpoint.resume=disable")
        return None
    p = Path(resume)
    if not (p / "COMPLETE").is_file():
        raise FileNotFoundError(f"checkpoint.resume: {resume} is not a complete checkpoint (no COMPLETE marker)")
    problem = verify_checkpoint(p, group)
    if problem is not None:
        raise CheckpointError(f"checkpoint.resume: checkpoint {p} is damaged: {problem}")
    return p


def save_checkpoint(output_dir: str, step: int, stateful: dict[str, ModelOptimState], trainer_state: dict,
                    *, max_to_keep: int = 0, group: Optional[dist.ProcessGroup] = None,
                    rank_state: Any = None) -> Path:
    """A collective of ``group`` (None: the world; its first rank must be global rank 0).

    ``rank_state``: plain data this rank keeps beside the model (tensors, numbers, strings, lists,
    tuples, dicts; numpy values become lists), e.g. the in-flight rollout batch of trainer.mode
    one_step_off; :func:`load_rank_state` reads it back with ``weights_only=True``.

    A write that fails on any rank (a full disk) raises the same :class:`SaveFailedError` on every
    rank once they agree on it (:mod:`rlhf.train.write_guard`); the partial ``*.tmp`` is removed and
    the complete checkpoints before it are kept."""
    root = Path(output_dir) / "checkpoints"
    final = root / f"global_step_{step}"
    tmp = root / f"global_step_{step}.tmp"
    rank = dist.get_rank()

    def step_ok(problem: Optional[str]) -> None:
        problem = agree(problem, group)
        if problem is not None:
            _save_failed(problem, step, tmp, stateful, group)

    def begin() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    step_ok(attempt(begin, tmp) if rank == 0 else None)
    # DCP agrees by itself: a write that fails on one rank raises the same CheckpointException on all
    problem = attempt(lambda: dcp.save({k: v for k, v in stateful.items()}, checkpoint_id=str(tmp / "model_optim"),
                                       process_group=group), tmp / "model_optim")

    def own_files() -> None:
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        if rank_state is not None:
            torch.save(to_plain(rank_state), tmp / f"rank_state{rank}.pt")

    step_ok(problem or attempt(own_files, tmp))
    if rank == 0:
        problem = attempt(lambda: (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1)), tmp)
    step_ok(problem if rank == 0 else None)
    # Checksums of every file, computed by all ranks in parallel: a resume verifies them first.
    names = _checkpoint_files(tmp)
    sums = all_gather_object({n: _crc32(tmp / n) for n in _my_share(names, group)}, group)

    def finish() -> None:
        (tmp / CHECKSUMS).write_text(json.dumps({k: v for part in sums for k, v in part.items()}, indent=0))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (final / "COMPLETE").write_text(str(step))

    step_ok(attempt(finish, tmp) if rank == 0 else None)
    if rank == 0 and max_to_keep > 0:
        for _, old in list_checkpoints(root)[:-max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return final


def _state_bytes(stateful: dict[str, ModelOptimState]) -> int:
    """Bytes of this rank's shards of ``stateful``'s tensors: about what it adds to a checkpoint."""
    from torch.distributed.tensor import DTensor

    def walk(x: Any) -> int:
        if isinstance(x, DTensor):
            x = x.to_local()
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0

    return sum(walk(v.state_dict()) for v in stateful.values())


def _save_failed(problem: str, step: int, tmp: Path, stateful: dict[str, ModelOptimState],
                 group: Optional[dist.ProcessGroup]) -> NoReturn:
    """Every rank: remove the partial checkpoint (rank 0), say what it needed and what is kept, raise."""
    try:
        needed: Optional[int] = sum(all_gather_object(_state_bytes(stateful), group))
    except Exception:  # noqa: BLE001 - the size is a hint; the error must still be raised
        needed = None
    problem = full_disk(problem, tmp.parent, needed)
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "COMPLETE").is_file():  # renamed, but its marker could not be written
            shutil.rmtree(final, ignore_errors=True)
    dist.barrier(group=group)
    kept = list_checkpoints(tmp.parent)
    keep = (f"kept: the last complete checkpoint {kept[-1][1]} (step {kept[-1][0]}); free space and rerun, "
            f"checkpoint.resume=auto continues from it") if kept else \
        "kept: no checkpoint (this was the run's first); free space and rerun"
    note = space_note(tmp.parent, needed, like=kept[-1][1] if kept else None)
    raise SaveFailedError(f"checkpoint of step {step} not saved: {problem}{note}; the partial {tmp.name} was "
                          f"removed; {keep}")


def load_rank_state(path: Path) -> Any:
    """This rank's ``rank_state`` of :func:`save_checkpoint` (None if it saved none)."""
    f = Path(path) / f"rank_state{dist.get_rank()}.pt"
    return load_plain(f) if f.is_file() else None


def load_checkpoint(path: Path, stateful: dict[str, ModelOptimState],
                    group: Optional[dist.ProcessGroup] = None) -> dict:
    """Restore models/optimizers in place, this rank's RNG; returns the trainer state."""
    try:
        dcp.load({k: v for k, v in stateful.items()}, checkpoint_id=str(path / "model_optim"), process_group=group)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch's errors name no checkpoint
        raise CheckpointError(f"checkpoint {path} cannot be loaded ({_why(e)})") from e
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(load_plain(rng_file))
    return json.loads((path / "trainer_state.json").read_text())


def export_hf(model: torch.nn.Module, tokenizer, out_dir: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Write the training model as an HF checkpoint (safetensors) in ``out_dir``; a collective.

    * FSDP2 / TP model: the full state dict is gathered to rank 0 and written with the
      model's own ``save_pretrained``.
    * Pipeline stage(s) (pp > 1, ``model.pp_group`` set by ``parallelize_model``): no
      rank holds a whole model, so the stages' full tensors are gathered across pp
      (:func:`rlhf.rollout.reshard.gather_rollout_weights`) and rank 0 rebuilds the HF
      model from its config (on the meta device, weights assigned, no second copy).
    * peft LoRA model: rank 0 rebuilds base + adapters from the gathered state dict and
      writes the adapters in PEFT format to ``<out_dir>/adapter`` and the merged model
      (``W + alpha / r B A``) as a plain HF checkpoint in ``out_dir``.

    The tokenizer (if given) is saved next to the model. A write that fails on rank 0 (a full disk)
    raises the same :class:`SaveFailedError` on every rank, naming what is kept.
    """
    out = Path(out_dir)
    existed = out.exists()
    pp_group = getattr(model, "pp_group", None)
    split = pp_group is not None and dist.get_world_size(pp_group) > 1

    def write() -> None:
        if split:
            _export_pipeline(model, pp_group, out_dir)
        elif _is_peft(model):
            _export_lora(model, out_dir)
        else:
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if dist.get_rank() == 0:
                target = getattr(model, "save_pretrained", None)
                if target is None:
                    raise TypeError(f"{type(model).__name__} has no save_pretrained")
                model.save_pretrained(out_dir, state_dict=_clean_names(sd), safe_serialization=True)
        if dist.get_rank() == 0 and tokenizer is not None:
            tokenizer.save_pretrained(out_dir)

    problem = agree(attempt(write, out), group)  # the barrier: every rank ends the same way
    if problem is not None:
        _export_failed(problem, model, out, existed, split, group)


def _export_failed(problem: str, model: torch.nn.Module, out: Path, existed: bool, split: bool,
                   group: Optional[dist.ProcessGroup]) -> NoReturn:
    """Every rank: remove an export directory this call created (rank 0), say what is kept, raise."""
    needed = None if split else sum(p.numel() * p.element_size() for p in model.parameters())  # global sizes
    problem = full_disk(problem, out, needed)
    if dist.get_rank() == 0 and not existed:
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier(group=group)
    left = f"the incomplete {out} was removed" if not existed else f"{out} is incomplete"
    kept = list_checkpoints(out.parent / "checkpoints")
    keep = (f"kept: the checkpoints, the last {kept[-1][1]} (step {kept[-1][0]}); after freeing space, export it "
            f"with python -m rlhf.checkpoint export --ckpt {kept[-1][1]} --out {out}") if kept else \
        "kept: no checkpoint (none was saved: checkpoint.save_freq, checkpoint.save_final)"
    raise SaveFailedError(f"HF export not written: {problem}{space_note(out, needed)}; {left}; {keep}")


_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_names(sd: dict[str, Any]) -> dict[str, Any]:
    """Drop activation-checkpoint / compile wrapper parts from state-dict keys."""
    out = {}
    for k, v in sd.items():
        for part in _WRAPPER_PARTS:
            k = k.replace(part, "")
        out[k] = v
    return out


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional unless LoRA is used
        return False
    return isinstance(model, PeftModel)


def _hf_class(module: torch.nn.Module) -> type:
    """The transformers class of ``module`` (FSDP2 subclasses it as ``FSDP<Name>``)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    return next(c for c in type(module).__mro__ if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule))


def hf_model_from_state_dict(cls: type, config, sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Build ``cls(config)`` on the meta device and assign the full tensors of ``sd`` (HF names).

    With tied word embeddings ``lm_head.weight`` (the last pipeline stage's copy, equal to
    the embedding) is dropped and re-tied. Raises ``KeyError`` naming missing or unexpected
    keys. Non-persistent buffers (rotary ``inv_freq``) stay on meta: the model is for
    ``save_pretrained`` only, which does not write them.
    """
    sd = dict(sd)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        sd.pop("lm_head.weight", None)
    with torch.device("meta"):
        # An Auto* class picks the architecture from the config; a model class is used as is.
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise KeyError(f"export: state dict does not match {cls.__name__}: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    return model


def _export_pipeline(model: torch.nn.Module, pp_group: dist.ProcessGroup, out_dir: str) -> None:
    from rlhf.rollout.reshard import gather_rollout_weights

    full, _ = gather_rollout_weights(model, pp_group=pp_group)  # HF names, full tensors on every rank
    if dist.get_rank() != 0:
        return
    # Own CPU copies: the pp exchange hands out views of one flat buffer per stage.
    sd = {n: t.to("cpu", copy=True) for n, t in full.items()}
    del full
    import transformers

    name = getattr(model, "source_class_name", None)
    if name is not None and hasattr(transformers, name):
        cls = getattr(transformers, name)
    else:  # a union of interleaved stages: the head tells the kind of model
        cls = transformers.AutoModelForTokenClassification if "score.weight" in sd \
            else transformers.AutoModelForCausalLM
    hf_model_from_state_dict(cls, model.config, sd).save_pretrained(out_dir, safe_serialization=True)


def _export_lora(model: torch.nn.Module, out_dir: str) -> None:
    """Adapters (PEFT format) to ``<out_dir>/adapter`` and the merged model to ``out_dir``."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    import copy

    from peft import get_peft_model

    from rlhf.models.lora import export_merged, hf_param_name, save_adapter

    sd = _clean_names(sd)
    adapter = model.active_adapter
    base_src = model.get_base_model()
    base_sd = {hf_param_name(k): v for k, v in sd.items() if ".lora_" not in k}
    base = hf_model_from_state_dict(_hf_class(base_src), base_src.config, base_sd)
    rebuilt = get_peft_model(base, copy.deepcopy(model.peft_config[adapter]), adapter_name=adapter)
    lora_sd = {k: v for k, v in sd.items() if ".lora_" in k}
    missing, unexpected = rebuilt.load_state_dict(lora_sd, strict=False)
    missing = [k for k in missing if ".lora_" in k]
    if missing or unexpected or not lora_sd:
        raise KeyError(f"export: LoRA adapter weights do not match the rebuilt model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    save_adapter(rebuilt, Path(out_dir) / "adapter")
    export_merged(rebuilt, out_dir)
