"""Which attention kernel each call site runs: one rule, printed once, recorded as a metric.

Call sites (``SITES``):

* ``packed``: the padding-free training and log-prob pass (``rlhf.models.varlen_attention``);
* ``prefix_grouped``: the prefix-grouped pass (``rlhf.models.prefix_grouping``: prompts packed, responses
  over ``[prompt keys ; own keys]``), the same varlen convention;
* ``prefill``: the sampler's padded prefill (``rlhf.models.arch.attend``): torch's SDPA, which dispatches to
  its own FlashAttention-2 kernel on sm80+ in half precision; nothing to choose;
* ``cascade_prefix``: a GRPO group's shared prompt read once at decode, merged by its log-sum-exp
  (``rlhf.rollout.cascade_attention``);
* ``decode``: decode over the paged KV cache (``rlhf.rollout.paged_attention``), eager and under CUDA graphs
  (every kernel here keeps its shapes and reads no host data per step).

Order (:func:`choose`), first that applies:

1. ``flash_attn``: the flash-attn package, when it imports, on CUDA in fp16 / bf16 (soft-cap too);
2. ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 bundled with torch >= 2.10;
   packed rows, GQA, sliding windows, the LSE, a paged ``block_table``): CUDA, fp16 / bf16, sm80+; no
   soft-cap and no dropout, so Gemma 2's capped layers go on down the list;
3. ``flex``: compiled FlexAttention (document mask, sliding window, soft-cap as a ``score_mod``, GQA) for the
   packed and prefix-grouped passes on CUDA (any dtype, triton present);
4. ``reference``: today's paths: bucketed SDPA (packed), SDPA (prefill), torch-op cascade, the gather kernel
   (decode); the only choice on CPU.

Sinks (GPT-OSS) are exact only where the kernel returns the LSE and no gradient has to flow through it:
decode and the cascade (the output rescaled by ``sigmoid(lse - sink)``). Training passes with sinks take the
reference path (the sink as one more SDPA key).

The metric: ``perf/attn_backend`` is the packed site's :data:`BACKEND_CODES` code, ``perf/attn_backend_decode``
the decode site's (a string does not average; the start-up line gives the names).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SITES", "BACKEND_CODES", "Capability", "probe", "choose", "choices", "startup_line", "log_choices",
           "backend_metrics", "cascade_auto", "model_traits"]

SITES = ("packed", "prefix_grouped", "prefill", "cascade_prefix", "decode")
# Higher = further up the order; 0 = today's path.
BACKEND_CODES = {"reference": 0, "sdpa": 0, "flex": 1, "torch_varlen": 2, "flash_attn": 3}
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Capability:
    """What a device / dtype / install offers (the inputs of :func:`choose`; tests build them by hand).

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ...
        dtype: the attention inputs' dtype (None: any half precision, e.g. a rule asked before the model loads).
        sm: the CUDA compute capability ``(major, minor)``, None off CUDA.
        flash_attn: the flash-attn package imports.
        torch_varlen: ``torch.nn.attention.varlen.varlen_attn`` exists (torch >= 2.10).
        flex: ``torch.nn.attention.flex_attention`` exists and (on CUDA) triton is installed to compile it.
    """

    device_type: str
    dtype: Optional[torch.dtype]
    sm: Optional[tuple[int, int]]
    flash_attn: bool
    torch_varlen: bool
    flex: bool

    @property
    def half(self) -> bool:
        return self.dtype is None or self.dtype in _HALF


@functools.lru_cache(maxsize=None)
def _flash_attn_imports() -> bool:
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401  (optional GPU dependency; a broken build says so in varlen_attention)
    except (ImportError, OSError, RuntimeError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def _has(module: str, attr: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False


@functools.lru_cache(maxsize=None)
def _sm(index: Optional[int]) -> Optional[tuple[int, int]]:
    return tuple(torch.cuda.get_device_capability(index)) if torch.cuda.is_available() else None


def probe(device: torch.device | str, dtype: Optional[torch.dtype] = None, *,
          flash_attn: Optional[bool] = None) -> Capability:
    """The :class:`Capability` of ``device`` in ``dtype`` on this install (cached per process); ``flash_attn``:
    whether the caller's flash-attn entry imported (None: whether the package imports)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    return _probe(device.type, device.index, dtype, cuda and (_flash_attn_imports() if flash_attn is None
                                                              else flash_attn))


@functools.lru_cache(maxsize=None)
def _probe(device_type: str, index: Optional[int], dtype: Optional[torch.dtype], flash_attn: bool) -> Capability:
    # cached: the packed site asks once per layer
    cuda = device_type == "cuda"
    gpu = cuda and torch.cuda.is_available()
    return Capability(
        device_type=device_type, dtype=dtype, sm=_sm(index) if gpu else None, flash_attn=flash_attn,
        torch_varlen=_has("torch.nn.attention.varlen", "varlen_attn"),
        flex=_has("torch.nn.attention.flex_attention", "flex_attention")
        and (not cuda or (gpu and importlib.util.find_spec("triton") is not None)))


def choose(site: str, cap: Capability, *, softcap: bool = False, sinks: bool = False, dropout: bool = False) -> str:
    """The backend name of ``site`` (one of :data:`SITES`) for ``cap`` (see the module docstring's order).

    Args:
        softcap: the model soft-caps its attention logits (Gemma 2).
        sinks: the model has attention sinks (GPT-OSS).
        dropout: the pass uses attention dropout (only flash-attn and the reference take it).
    """
    if site not in SITES:
        raise ValueError(f"unknown attention call site {site!r}; one of {SITES}")
    if site == "prefill":
        return "sdpa"
    if cap.device_type != "cuda":
        return "reference"
    training = site in ("packed", "prefix_grouped")
    if training and sinks:  # the sink needs the LSE's gradient: the exact reference (sink as an SDPA key)
        return "reference"
    if cap.flash_attn and cap.half:
        return "flash_attn"
    sm80 = cap.sm is not None and tuple(cap.sm) >= (8, 0)
    if cap.torch_varlen and cap.half and sm80 and not softcap and not dropout:
        return "torch_varlen"
    if training and cap.flex and not dropout:
        return "flex"
    return "reference"


def choices(cap: Capability, *, softcap: bool = False, sinks: bool = False) -> dict[str, str]:
    """Every site's backend for ``cap`` (the start-up line and the metrics)."""
    return {s: choose(s, cap, softcap=softcap, sinks=sinks) for s in SITES}


def cascade_auto(device_type: str, decode_backend: str, cuda_graphs: bool) -> bool:
    """Whether the sampler wraps its decode kernel in the cascade (shared prompt once per group).

    CPU: yes (measured: ``bench/cascade_attention.py``). Under CUDA graphs: no (a cascade step's groups are host
    data). On CUDA eager: not yet. With flash-attn or torch's varlen kernel both parts run through the LSE-
    returning paged kernel (``rlhf.rollout.cascade_attention``), tested on CPU against the gather reference, but
    eager decode on a GPU is launch-bound and the cascade adds launches; it turns on when ``bench/gpu_step.py``
    shows it pays (docs/howto/gpu-attention.md)."""
    del decode_backend  # the rule does not depend on it yet; kept so the GPU measurement can change one line
    return device_type != "cuda" and not cuda_graphs


def startup_line(cap: Capability, picked: dict[str, str]) -> str:
    """One line: each site's kernel and the capability it was chosen from."""
    sites = " ".join(f"{s}={b}" for s, b in picked.items())
    sm = f"sm{cap.sm[0]}{cap.sm[1]}" if cap.sm else cap.device_type
    dtype = str(cap.dtype).replace("torch.", "") if cap.dtype is not None else "half"
    return (f"attention kernels: {sites} ({sm}, {dtype}; flash-attn {'yes' if cap.flash_attn else 'no'}, "
            f"torch varlen_attn {'yes' if cap.torch_varlen else 'no'}, flex {'yes' if cap.flex else 'no'})")


_LOGGED: set[str] = set()


def log_choices(device: torch.device | str, dtype: Optional[torch.dtype], *, softcap: bool = False,
                sinks: bool = False) -> dict[str, str]:
    """Print the start-up line once per process (local rank 0) and return the choices."""
    cap = probe(device, dtype)
    picked = choices(cap, softcap=softcap, sinks=sinks)
    line = startup_line(cap, picked)
    if line not in _LOGGED and os.environ.get("LOCAL_RANK", "0") == "0":
        _LOGGED.add(line)
        print(f"[rlhf] {line}", file=sys.stdout, flush=True)
    return picked


def model_traits(hf_config: object) -> dict[str, bool]:
    """``softcap`` / ``sinks`` of a transformers config (Gemma 2's capped logits, GPT-OSS's sinks): the
    keywords :func:`choose` takes (a vision-language model's text config is read)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    kind = getattr(text, "model_type", "")
    return {"softcap": kind == "gemma2" and getattr(text, "attn_logit_softcapping", None) is not None,
            "sinks": kind == "gpt_oss"}


def backend_metrics(picked: dict[str, str]) -> dict[str, float]:
    """``perf/attn_backend`` (packed site) and ``perf/attn_backend_decode`` as :data:`BACKEND_CODES` codes."""
    return {"perf/attn_backend": float(BACKEND_CODES[picked["packed"]]),
            "perf/attn_backend_decode": float(BACKEND_CODES[picked["decode"]])}
