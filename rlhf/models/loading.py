"""Loading HF checkpoints and tokenizers with errors a user can act on."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel,
                          PreTrainedTokenizerBase, PreTrainedTokenizerFast)

from rlhf.models.checkpoint_reader import (CheckpointIndex, checkpoint_dtype, checkpoint_sources,
                                             deferred_whole_loads, parameters_on_meta)
from rlhf.models.mrope import is_vlm_config
from rlhf.schema.config import ConfigError

_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")

# Files a HF tokenizer is built from; a directory with none of them has no tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tiktoken.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_dir(path: str, key: str = "model.path") -> Path:
    """A local HF directory (or hub cache snapshot) with a config.json, else one clear error."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{key}: model directory not found: {path}")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{key}: {path} has no config.json (expected a HF save_pretrained directory)")
    if not isinstance(read_json(p / "config.json", key), dict):
        raise ConfigError(f"{key}: {p / 'config.json'} holds no JSON object (a model config is one)")
    return p


def read_json(f: Path, key: str):
    """The JSON in ``f``; a malformed file is one ConfigError naming ``key``, the file and the position
    (transformers' own error names neither the position nor, through json, the file)."""
    try:
        return json.loads(f.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {f} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {f} is not UTF-8 text (byte {e.start})") from None


def load_tokenizer(path: str, trust_remote_code: bool = False, key: str = "model.tokenizer_path") -> PreTrainedTokenizerBase:
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{key}: tokenizer directory not found: {path}")
    if p.is_dir() and not any((p / f).is_file() for f in _TOKENIZER_FILES):
        # transformers would build a 1-token tokenizer from config.json alone: every prompt -> [].
        raise ConfigError(f"{key}: {path} has no tokenizer files (none of {', '.join(_TOKENIZER_FILES)}); "
                          f"copy them from the base model or set model.tokenizer_path")
    tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    cfg_file = p / "tokenizer_config.json"
    if cfg_file.is_file() and read_json(cfg_file, key).get("tokenizer_class") in _GENERIC_TOKENIZERS:
        # transformers 5 maps a model_type (e.g. qwen2) to its own tokenizer class, which
        # rebuilds the pre-tokenizer and ignores tokenizer.json. A generic tokenizer.json
        # (like the project's character tokenizer) must be loaded as written.
        tok = PreTrainedTokenizerFast.from_pretrained(str(p))
    if len(tok) < 2 or not tok("a1", add_special_tokens=False)["input_ids"]:
        raise ConfigError(f"{key}: the tokenizer in {path} is empty ({len(tok)} token(s); text tokenizes to "
                          f"nothing): its tokenizer files are incomplete")
    if tok.pad_token_id is None:
        # Causal LMs often ship without a pad token; padding is always masked, so EOS is safe.
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, *, dtype: str = "float32", attn_implementation: str = "sdpa",
                   trust_remote_code: bool = False, key: str = "model.path", deferred: bool = False) -> PreTrainedModel:
    """`AutoModelForCausalLM` on CPU in the master dtype ``dtype``.

    ``deferred``: the parameters are left on the meta device (in ``dtype``), each with the source
    :func:`rlhf.models.shard_init.materialize_shards` reads this rank's slice from: the
    safetensors file itself (only the slice's bytes, in the checkpoint dtype), or, where the
    checkpoint's layout needs transformers' conversions, the host tensor ``from_pretrained``
    loaded in the checkpoint's own dtype (a bf16 checkpoint stays bf16 on the host). Shards are
    upcast to ``dtype`` one by one as they are placed. Only for callers that go through
    ``parallelize_model`` (its ``params_to_meta`` takes the sources)."""
    p = check_model_dir(path, key)
    config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    attn_implementation = training_attn_implementation(config, attn_implementation)
    vlm = is_vlm_config(config)  # Qwen-VL: the *ForConditionalGeneration class (vision tower + language model)
    if deferred and not vlm:  # a VLM loads whole (its tower's and language model's names are converted on load)
        return _load_deferred(p, config, DTYPES[dtype], attn_implementation, trust_remote_code, key)
    model = _from_pretrained(p, DTYPES[dtype], attn_implementation, trust_remote_code, key, vlm=vlm)
    check_finite_weights(model, f"{key}: {p}")
    return model


def _weights_error(p: Path, key: str, e: Exception) -> ConfigError:
    files = ", ".join(sorted(f.name for f in p.glob("*.safetensors"))) or "no *.safetensors"
    return ConfigError(f"{key}: cannot read the weights in {p} ({files}): {type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}")


def _from_pretrained(p: Path, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool,
                     key: str, vlm: bool = False) -> PreTrainedModel:
    auto = AutoModelForCausalLM
    if vlm:
        from transformers import AutoModelForImageTextToText as auto
    try:
        model = auto.from_pretrained(
            str(p), dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a damaged weight file: safetensors' own error names no file
        if "safetensor" not in f"{type(e).__module__} {type(e).__name__} {e}".lower():
            raise
        raise _weights_error(p, key, e) from None
    model.config.use_cache = False
    return model


def _load_deferred(p: Path, config, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool,
                   key: str) -> PreTrainedModel:
    try:
        index = CheckpointIndex(p)
    except FileNotFoundError:
        index = None  # a .bin checkpoint: from_pretrained below
    except Exception as e:  # noqa: BLE001 - a damaged header
        raise _weights_error(p, key, e) from None
    if index is None:
        # No safetensors header to read slices by: its own loader, now, in the checkpoint's dtype.
        model = _from_pretrained(p, checkpoint_dtype(p) or dtype, attn_implementation, trust_remote_code, key)
        check_finite_weights(model, f"{key}: {p}")
        sources = {}
        for name, param in model.named_parameters():
            sources[name] = param.detach()
            with torch.no_grad():
                torch.utils.swap_tensors(param, torch.nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad))
    else:
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                     trust_remote_code=trust_remote_code)
        model.eval()  # as from_pretrained returns it
        model.config.use_cache = False
        sources = checkpoint_sources(model, index)
        _load_buffers(model, index)
        if sources is None:
            # A layout transformers converts on load: its loader in the checkpoint's dtype, run at
            # placement (staggered), each tensor dropped once its shard is placed.
            ckpt = index.dtype() or dtype
            sources = deferred_whole_loads(
                model, lambda: _from_pretrained(p, ckpt, attn_implementation, trust_remote_code, key),
                index.file_bytes)
    for name, param in model.named_parameters():
        param._rlhf_source = sources[name]
        param._rlhf_where = f"{key}: {p}"
    return model


def _load_buffers(model: torch.nn.Module, index: CheckpointIndex) -> None:
    """Copy the buffers the checkpoint holds (DeepSeek-V3's ``e_score_correction_bias``: it decides the
    routes) into the model, whole: the deferred path places parameters only, and a buffer left at its
    init value would route differently from the checkpoint (and from the sampler)."""
    for name, buf in model.named_buffers():
        if name in index.entries and buf.device.type != "meta":
            with torch.no_grad():
                buf.copy_(index.read(name, tuple(slice(None) for _ in buf.shape)))


def check_finite_weights(model: torch.nn.Module, where: str) -> None:
    """One ConfigError naming the first parameter that holds NaN / inf (a sampler fed such weights
    draws garbage, and validation would score it 0 silently)."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.device.type != "meta" and not bool(torch.isfinite(param).all()):
            bad = int((~torch.isfinite(param)).sum())
            raise ConfigError(f"{where}: weight {name} holds {bad} non-finite value(s) (NaN/inf) of {param.numel()}")


def training_attn_implementation(config, requested: str) -> str:
    """The attention kernel to load a model with: ``requested``, except that Gemma 2 (whose
    attention-logit soft-capping SDPA cannot express; transformers refuses sdpa for it) gets the
    project's varlen attention instead of sdpa: SDPA where there is no cap, soft-capped otherwise."""
    if requested == "sdpa" and config.model_type in ("gemma2", "gpt_oss"):  # GPT-OSS: attention sinks, no sdpa
        from rlhf.models.varlen_attention import register_varlen_attention

        return register_varlen_attention()
    return requested


def model_config(path: str, trust_remote_code: bool = False, key: str = "model.path"):
    return AutoConfig.from_pretrained(str(check_model_dir(path, key)), trust_remote_code=trust_remote_code)


def language_config(config):
    """The config of the language model: a Qwen-VL's ``text_config`` (sizes, heads, layers), else ``config``."""
    from rlhf.models.mrope import is_vlm_config

    return config.text_config if is_vlm_config(config) else config


def check_rollout_support(path: str, trust_remote_code: bool = False, max_seq_len: int | None = None,
                          key: str = "model.path", *, rollout_tp: int = 1, quantization: str = "",
                          announce: bool = False):
    """One ConfigError line, before any work, for a model the rollout sampler cannot run (instead of a
    traceback from the sampler after the model has loaded). Returns the model's
    ``rlhf.models.generic.RolloutPath`` (fast functional decoder or generic HF modules); ``announce``:
    print its one start-up line."""
    from rlhf.models.generic import GENERIC, GENERIC_SLOWDOWN, rollout_path

    config = model_config(path, trust_remote_code, key)
    try:
        where = rollout_path(config, max_seq_len)
    except NotImplementedError as e:
        raise ConfigError(f"{key}: {e}") from None
    if where.path == GENERIC and rollout_tp > 1:
        raise ConfigError(f"rollout.tp: {rollout_tp} > 1 is not supported on the generic rollout path "
                          f"({config.model_type}: {where.reason}); set rollout.tp=1")
    if where.path == GENERIC and quantization:
        raise ConfigError(f"rollout.quantization: {quantization} is not supported on the generic rollout path "
                          f"({config.model_type}: {where.reason}; its HF modules hold unquantized weights); "
                          f"set rollout.quantization=''")
    if announce:
        print(f"[rlhf] {where.startup_line(config.model_type, GENERIC_SLOWDOWN)}", flush=True)
    limit = getattr(language_config(config), "max_position_embeddings", None)
    if max_seq_len is not None and isinstance(limit, int) and max_seq_len > limit:
        raise ConfigError(f"data.max_response_length: prompt + response = {max_seq_len} tokens exceeds the "
                          f"model's max_position_embeddings ({limit}, {key}); lower data.max_prompt_length + "
                          f"data.max_response_length")
    return where


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of a HF causal LM (through PEFT / wrappers / pipeline stages)."""
    # CausalLM.model.layers, or PeftModel.base_model.model.model.layers
    # (Qwen-VL: ForConditionalGeneration.model.language_model.layers)
    m, seen = model, 0
    while seen < 6:
        if hasattr(m, "layers") and isinstance(m.layers, torch.nn.ModuleList):
            return list(m.layers)
        if hasattr(m, "layers") and isinstance(m.layers, torch.nn.ModuleDict):  # pipeline stage
            return list(m.layers.values())
        nxt = getattr(m, "model", None) or getattr(m, "language_model", None) or getattr(m, "base_model", None)
        if nxt is None or nxt is m:
            break
        m, seen = nxt, seen + 1
    from rlhf.models.generic import decoder_blocks  # any other HF layout (GPT-2's transformer.h, ...)

    blocks = decoder_blocks(model)
    if blocks:
        return blocks
    raise ConfigError(f"cannot find decoder layers in {type(model).__name__} (expected .model.layers)")


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a Qwen-VL model (``.model.visual``, through peft wrappers); None for a text LM."""
    for name, m in model.named_modules():
        if name.endswith("visual") and hasattr(m, "merger"):
            return m
    return None
