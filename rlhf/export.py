"""A training checkpoint as a Hugging Face model directory, offline in one process (verl's model merger).

    python -m rlhf.checkpoint export --ckpt outputs/run/checkpoints/global_step_20 --out hf/step20

reads the actor's weights from the DCP shards of ``global_step_20/model_optim`` (written by any
layout: dp / tp / pp / sp, any number of ranks; DCP reassembles full tensors) without torchrun
or a process group, and writes what ``AutoModelForCausalLM.from_pretrained`` loads: the model's
``config.json``, ``*.safetensors`` and the tokenizer (a vision-language model: what
``AutoModelForImageTextToText`` loads, with its processor). The run's ``config.yaml`` (next to
``checkpoints/``) names the base model directory (config and tokenizer) and the LoRA settings;
``--model-path`` replaces the directory when the run's path is not reachable from here. A LoRA
run gives the merged model in ``--out`` and the PEFT adapter in ``--out/adapter``, as the
run's own ``hf_export`` does. The optimizer state is never read.

``--role critic`` writes a PPO run's critic instead (verl's merger of the ``critic`` directory):
an ``AutoModelForTokenClassification`` with ``num_labels=1`` whose ``score`` head gives the value
at every position, based on the run's ``critic.model_path`` (or ``model.path``). It loads as
``critic.model_path`` of a later run, which then starts from the trained values.

``python -m rlhf.eval --model <checkpoint dir>`` uses :func:`hf_model_dir` to export into a
temporary directory first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from rlhf.cli import run_main
from rlhf.schema.config import ConfigError
from rlhf.train.checkpoint import _clean_names, hf_model_from_state_dict


def is_checkpoint_dir(path: Path) -> bool:
    return (path / "model_optim" / ".metadata").is_file()


def _run_config(ckpt: Path, run_config: Optional[str]) -> dict:
    path = Path(run_config) if run_config else ckpt.parent.parent / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--ckpt {ckpt}: the run's config.yaml is not at {path} (it names the base model and "
                          "LoRA settings); pass --run-config FILE")
    return yaml.safe_load(path.read_text()) or {}


def read_model_state(ckpt: Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """Full tensors of ``role``'s model (state-dict names, wrapper parts removed), read in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(ckpt / "model_optim"))
    prefix = f"{role}.model."
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype)
          for k, m in reader.read_metadata().state_dict_metadata.items()
          if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not sd:
        raise ConfigError(f"--ckpt {ckpt}: holds no '{role}' model")
    with warnings.catch_warnings():  # DCP warns that it reads in one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, storage_reader=reader, no_dist=True)
    return _clean_names({k[len(prefix):]: v for k, v in sd.items()})


def export_checkpoint(ckpt: str | Path, out: str | Path, *, model_path: Optional[str] = None,
                      run_config: Optional[str] = None, role: str = "actor") -> Path:
    """Write ``role`` (``actor`` or ``critic``) of checkpoint ``ckpt`` as an HF directory ``out``; returns ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from rlhf.config.hub import resolve_model_path
    from rlhf.models.loading import check_model_dir, load_tokenizer
    from rlhf.models.mrope import is_vlm_config

    ckpt, out = Path(ckpt), Path(out)
    if not is_checkpoint_dir(ckpt):
        raise ConfigError(f"--ckpt {ckpt}: not a checkpoint directory (expected <output_dir>/checkpoints/"
                          "global_step_N with model_optim/)")
    if not (ckpt / "COMPLETE").is_file():
        raise ConfigError(f"--ckpt {ckpt}: an incomplete checkpoint (no COMPLETE marker: the save was interrupted)")
    if role not in ("actor", "critic"):
        raise ConfigError(f"--role {role}: expected actor or critic")
    from rlhf.train.checkpoint import verify_checkpoint

    # also reads .metadata safely before DCP unpickles it; not a collective: one rank may export alone
    problem = verify_checkpoint(ckpt, collective=False)
    if problem is not None:
        raise ConfigError(f"--ckpt {ckpt}: a damaged checkpoint: {problem}")
    run = _run_config(ckpt, run_config)
    model_cfg: dict[str, Any] = run.get("model") or {}
    base = model_path or model_cfg.get("path", "")
    if role == "critic":
        base = model_path or (run.get("critic") or {}).get("model_path") or base
    key = "--model-path" if model_path else "model.path of the run's config.yaml (or --model-path)"
    base_dir = check_model_dir(resolve_model_path(base, key), key)
    trust = bool(model_cfg.get("trust_remote_code", False))
    tok_dir = model_path or model_cfg.get("tokenizer_path") or base
    tokenizer = load_tokenizer(str(resolve_model_path(tok_dir, "model.tokenizer_path")), trust)
    config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=trust)
    causal_lm = AutoModelForCausalLM
    if is_vlm_config(config):  # the whole Qwen-VL (tower included), saved with its processor
        from transformers import AutoModelForImageTextToText as causal_lm

        from rlhf.models.processor import load_processor

        tokenizer = load_processor(str(base_dir), trust, key)
    sd = read_model_state(ckpt, role)
    config.dtype = next(iter(sd.values())).dtype  # the master weights' dtype, as the run's hf_export
    out.mkdir(parents=True, exist_ok=True)
    if role == "critic":  # as rlhf.train.critic.load_value_model builds it
        config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=trust, num_labels=1,
                                            classifier_dropout=0.0, dtype=config.dtype)
        config.architectures = None  # from_config picks the token-classification class; saving names it
        hf_model_from_state_dict(AutoModelForTokenClassification, config, sd).save_pretrained(
            str(out), safe_serialization=True)
    elif any(".lora_" in k for k in sd):
        _write_lora(sd, config, model_cfg, out, causal_lm)
    else:
        hf_model_from_state_dict(causal_lm, config, sd).save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def _write_lora(sd: dict[str, torch.Tensor], config, model_cfg: dict, out: Path, model_class: Any) -> None:
    """Merged model in ``out``, PEFT adapter in ``out/adapter``: the base rebuilt (``model_class``: the
    causal LM's or a VLM's auto class), LoRA re-applied with the run's settings, the trained adapters loaded."""
    from rlhf.models.lora import apply_lora, export_merged, hf_param_name, save_adapter

    if int(model_cfg.get("lora_rank", 0)) <= 0:
        raise ConfigError("the checkpoint holds LoRA adapters but the run's config.yaml has model.lora_rank 0")
    base = hf_model_from_state_dict(model_class, config,
                                    {hf_param_name(k): v for k, v in sd.items() if ".lora_" not in k})
    model = apply_lora(base, lora_rank=int(model_cfg["lora_rank"]), lora_alpha=model_cfg.get("lora_alpha", 16),
                       target_modules=model_cfg.get("target_modules", "all-linear"))
    lora = {k: v for k, v in sd.items() if ".lora_" in k}
    missing, unexpected = model.load_state_dict(lora, strict=False)
    missing = [k for k in missing if ".lora_" in k]
    if missing or unexpected:
        raise ConfigError(f"the checkpoint's LoRA adapters do not match the run's LoRA settings: missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]}")
    save_adapter(model, out / "adapter")
    export_merged(model, out)


@contextlib.contextmanager
def hf_model_dir(path: str, key: str = "--model") -> Iterator[str]:
    """A directory transformers loads: an HF directory or cached hub name as it is, a checkpoint
    directory exported into a temporary directory (removed on exit); else one clear error."""
    from rlhf.config.hub import resolve_model_path
    from rlhf.models.loading import check_model_dir

    p = Path(resolve_model_path(path, key)).expanduser()
    if is_checkpoint_dir(p):
        with tempfile.TemporaryDirectory(prefix="rlhf_export_") as tmp:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"[rlhf] {key} {path}: a training checkpoint, exported to {tmp} to load it", flush=True)
            yield str(export_checkpoint(p, tmp))
        return
    if not (p / "config.json").is_file() and ((p / "hf_export").is_dir() or (p / "checkpoints").is_dir()):
        raise ConfigError(f"{key}: {path} is a run directory; pass {p / 'hf_export'} or a checkpoint "
                          f"{p / 'checkpoints'}/global_step_N")
    yield str(check_model_dir(str(p), key))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's actor (or critic) as an HF model directory")
    ex.add_argument("--ckpt", required=True, help="<output_dir>/checkpoints/global_step_N")
    ex.add_argument("--out", required=True, help="directory for config, safetensors and tokenizer")
    ex.add_argument("--model-path", help="base model directory (config + tokenizer); default: the run's model.path")
    ex.add_argument("--run-config", help="the run's config.yaml; default: <ckpt>/../../config.yaml")
    ex.add_argument("--role", default="actor", choices=["actor", "critic"],
                    help="critic: the PPO critic as a token-classification model (num_labels=1)")
    args = ap.parse_args(argv)

    def export() -> None:
        from rlhf.train.write_guard import SaveFailedError, describe, is_write_error, space_note

        try:
            out = export_checkpoint(args.ckpt, args.out, model_path=args.model_path, run_config=args.run_config,
                                    role=args.role)
        except Exception as e:  # noqa: BLE001 - only the storage's errors become one line
            if not is_write_error(e):
                raise
            raise SaveFailedError(f"export to {args.out} not written: {describe(e, Path(args.out))}"
                                  f"{space_note(Path(args.out), None)}; the checkpoint {args.ckpt} is unchanged: "
                                  f"free space and rerun") from None
        adapter = " (merged; PEFT adapter in adapter/)" if (out / "adapter").is_dir() else ""
        print(f"[rlhf] exported the {args.role} of {args.ckpt} to {out}{adapter}", flush=True)

    run_main(export)
