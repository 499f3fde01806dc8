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
                    *, max_to_keep: int = 0, group: Optional[dist.ProcessGroup] = None,
                    rank_state: Any = None) -> Path:
    """A collective of ``group`` (None: the world; its first rank must be global rank 0).

    ``rank_state``: anything picklable this rank keeps beside the model (e.g. the in-flight
    rollout batch of trainer.mode one_step_off); :func:`load_rank_state` reads it back."""
    root = Path(output_dir) / "checkpoints"
    final = root / f"global_step_{step}"
    tmp = root / f"global_step_{step}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    dcp.save({k: v for k, v in stateful.items()}, checkpoint_id=str(tmp / "model_optim"), process_group=group)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank_state is not None:
        torch.save(rank_state, tmp / f"rank_state{rank}.pt")
    dist.barrier(group=group)
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (final / "COMPLETE").write_text(str(step))
        if max_to_keep > 0:
            for _, old in list_checkpoints(root)[:-max_to_keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return final


def load_rank_state(path: Path) -> Any:
    """This rank's ``rank_state`` of :func:`save_checkpoint` (None if it saved none)."""
    f = Path(path) / f"rank_state{dist.get_rank()}.pt"
    return torch.load(f, weights_only=False) if f.is_file() else None


def load_checkpoint(path: Path, stateful: dict[str, ModelOptimState],
                    group: Optional[dist.ProcessGroup] = None) -> dict:
    """Restore models/optimizers in place, this rank's RNG; returns the trainer state."""
    dcp.load({k: v for k, v in stateful.items()}, checkpoint_id=str(path / "model_optim"), process_group=group)
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
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

    The tokenizer (if given) is saved next to the model.
    """
    pp_group = getattr(model, "pp_group", None)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
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
    dist.barrier(group=group)


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
