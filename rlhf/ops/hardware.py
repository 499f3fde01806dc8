"""Peak dense FLOP/s and memory bandwidth of the device a run is on.

Used to turn measured times into shares of a roof (MFU, share of the HBM-bandwidth roofline).
The GPU figures are the vendors' datasheet numbers for *dense* math (the datasheets also
print "with sparsity" figures, twice as large, which no training run reaches); a GPU that
is not in the table gets `None` so that no share is ever computed against a guessed roof.
On CPU there is no datasheet to look up, so the roof is measured: the best FLOP/s of a few
matmuls of model-like shapes with the current thread count, cached per (dtype, thread count).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU model: dense peak FLOP/s by math mode and HBM bytes/s."""

    name: str
    bf16: float   # dense tensor-core bf16 (fp16 is the same on these parts)
    tf32: float   # dense tensor-core tf32 (fp32 matmuls when allow_tf32 is on)
    fp32: float   # non-tensor-core fp32
    hbm: float    # bytes/s


# NVIDIA datasheets, dense (not "with sparsity") figures:
#  - H100 SXM5 80GB / PCIe 80GB / NVL 94GB: "NVIDIA H100 Tensor Core GPU" datasheet (2023):
#    SXM bf16 989.4 TF, tf32 494.7 TF, fp32 67 TF, HBM3 3.35 TB/s; PCIe bf16 756 TF, tf32 378 TF,
#    fp32 51 TF, HBM2e 2.0 TB/s; NVL bf16 835 TF, tf32 417.5 TF, fp32 60 TF, HBM3 3.9 TB/s.
#  - H200 SXM 141GB / H200 NVL: "NVIDIA H200 Tensor Core GPU" datasheet (2024): the H100 SXM
#    (resp. NVL) compute with HBM3e at 4.8 TB/s.
#  - A100 80GB SXM / 80GB PCIe / 40GB: "NVIDIA A100 Tensor Core GPU" datasheet (2021): bf16
#    312 TF, tf32 156 TF, fp32 19.5 TF; HBM2e 2,039 GB/s (80GB SXM), 1,935 GB/s (80GB PCIe),
#    HBM2 1,555 GB/s (40GB, SXM and PCIe).
_H100_SXM = GpuSpec("H100 SXM", bf16=989.4e12, tf32=494.7e12, fp32=67e12, hbm=3.35e12)
_H100_PCIE = GpuSpec("H100 PCIe", bf16=756e12, tf32=378e12, fp32=51e12, hbm=2.0e12)
_H100_NVL = GpuSpec("H100 NVL", bf16=835e12, tf32=417.5e12, fp32=60e12, hbm=3.9e12)
_H200_SXM = GpuSpec("H200 SXM", bf16=989.4e12, tf32=494.7e12, fp32=67e12, hbm=4.8e12)
_H200_NVL = GpuSpec("H200 NVL", bf16=835e12, tf32=417.5e12, fp32=60e12, hbm=4.8e12)
_A100_80_SXM = GpuSpec("A100 80GB SXM", bf16=312e12, tf32=156e12, fp32=19.5e12, hbm=2.039e12)
_A100_80_PCIE = GpuSpec("A100 80GB PCIe", bf16=312e12, tf32=156e12, fp32=19.5e12, hbm=1.935e12)
_A100_40 = GpuSpec("A100 40GB", bf16=312e12, tf32=156e12, fp32=19.5e12, hbm=1.555e12)


def gpu_spec(device_name: str) -> GpuSpec | None:
    """The datasheet entry for a `torch.cuda.get_device_name()` string, or None if unknown.

    Names as the driver reports them, e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe",
    "NVIDIA A100-PCIE-40GB". The more specific form factors are tested first.
    """
    n = device_name.lower()
    if "h200" in n:
        return _H200_NVL if "nvl" in n else _H200_SXM
    if "h100" in n:
        if "nvl" in n:
            return _H100_NVL
        return _H100_PCIE if "pcie" in n else _H100_SXM
    if "a100" in n:
        if "80gb" in n:
            return _A100_80_PCIE if "pcie" in n else _A100_80_SXM
        return _A100_40
    return None


def _cuda_spec(device: torch.device) -> GpuSpec | None:
    return gpu_spec(torch.cuda.get_device_name(device))


def _tf32_enabled() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak dense matmul FLOP/s of `device` for matmuls in `dtype`.

    CUDA: the datasheet figure (bf16 and fp16 share the tensor-core figure; fp32 is the tf32
    tensor-core figure when torch lets fp32 matmuls use tf32, else plain fp32), or None for a
    GPU not in the table. CPU: measured (see `measured_matmul_flops`), never None.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return measured_matmul_flops(dtype)
    if device.type != "cuda":
        return None
    spec = _cuda_spec(device)
    if spec is None:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        return spec.bf16
    if dtype == torch.float32:
        return spec.tf32 if _tf32_enabled() else spec.fp32
    return None


def hbm_bandwidth(device: torch.device) -> float | None:
    """Datasheet device-memory bandwidth in bytes/s; None on CPU and for an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    spec = _cuda_spec(device)
    return spec.hbm if spec is not None else None


# Shapes like a decoder's projections and LM head (hidden 768, MLP 2048, a vocab slice) and a
# square one: the CPU roof is the best a matmul of model-like shape reaches. Kept small because
# every rank of every trainer pays for it at start-up: the earlier shapes (up to 256x768x32000)
# took 2.5 s on one thread and reached a lower roof (45 vs 96 GFLOP/s, 2026-11-26, load 2).
_ROOF_SHAPES = ((128, 768, 2048), (64, 768, 8192), (512, 512, 512))


def measured_matmul_flops(dtype: torch.dtype = torch.float32, repeats: int = 3) -> float:
    """Best FLOP/s of CPU matmuls of model-like shapes in `dtype` with the current thread count.

    The roof is what the machine can reach, so the best over shapes and repeats, not a median.
    Cached per (dtype, repeats, thread count): well under a second the first time.
    """
    return _measured(dtype, repeats, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measured(dtype: torch.dtype, repeats: int, threads: int) -> float:
    del threads  # part of the cache key only
    g = torch.Generator().manual_seed(0)
    best = 0.0
    for m, k, n in _ROOF_SHAPES:
        a = torch.randn(m, k, generator=g).to(dtype)
        b = torch.randn(k, n, generator=g).to(dtype)
        a @ b  # first call pays for kernel selection and page faults
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = max(best, 2.0 * m * k * n / max(time.perf_counter() - t, 1e-9))
    return best


def device_description(device: torch.device) -> dict:
    """Name, memory and software versions of `device`, for bench summaries."""
    device = torch.device(device)
    out: dict = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        spec = _cuda_spec(device)
        out.update(name=props.name, total_memory_gib=props.total_memory / 2 ** 30,
                   capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                   datasheet=spec.name if spec else None)
    else:
        import platform
        out.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return out


__all__ = ["GpuSpec", "gpu_spec", "peak_flops", "hbm_bandwidth", "measured_matmul_flops", "device_description"]


@dataclass(frozen=True)
class LinkSpec:
    """Per-GPU bandwidth of one interconnect, bytes/s in one direction (what a ring collective uses)."""

    name: str
    bandwidth: float


# - NVLink 4 (H100 / H200 SXM): 900 GB/s total per GPU, i.e. 450 GB/s each way ("NVIDIA H100 Tensor
#   Core GPU" datasheet, 2023; H200 datasheet, 2024).
# - NVLink 3 (A100 SXM): 600 GB/s total, 300 GB/s each way (A100 datasheet, 2021).
# - InfiniBand NDR: 400 Gb/s = 50 GB/s per port, one ConnectX-7 port per GPU as in a DGX H100
#   ("NVIDIA DGX H100 user guide": 8 x single-port ConnectX-7 for the compute fabric).
LINKS = {"nvlink4": LinkSpec("NVLink 4 (H100/H200 SXM)", 450e9),
         "nvlink3": LinkSpec("NVLink 3 (A100 SXM)", 300e9),
         "ib-ndr": LinkSpec("InfiniBand NDR 400 Gb/s per GPU", 50e9)}
GPUS = {"h100": _H100_SXM, "h200": _H200_SXM, "a100": _A100_80_SXM}
