"""Fused CPU decode attention over the KV cache's slot regions or paged blocks, compiled at run time.

At decode shapes (``G`` query rows per (slot, kv head), a few dozen to a few thousand columns) the
torch-ops kernels spend most of their time outside the FLOPs: a batched matmul pays MKL's
per-matrix cost (~0.15 us) for each of ``B * Hkv`` tiny matrices, twice, and the scores make a round
trip through memory for the mask, the softmax and the second matmul (docs/benchmarks.md, "where the
tiny GRPO generate goes"). This kernel makes one pass per (slot, kv head): ``G`` dot products per
column, the fp32 softmax, the weighted sum of V, in registers and L1.

What it computes, for slot ``s``, kv head ``h``, query row ``g`` (``[B, Hkv, G, D]``, fp32)::

    out[s, h, g] = softmax_c(scale * q[s, h, g] . K[c]) V[c],   c in [lo_s, hi_s]

with ``K[c], V[c]`` read from slot ``lead[s]``'s region for columns ``c < pm`` (a GRPO group's
aligned prompt, ``rlhf.rollout.region_cascade``: one copy read by every member while it is in L1) and
from slot ``s``'s own region otherwise (``paged_decode_attention``: from the blocks of the slot's table
row, a run of columns per block); ``hi_s`` the slot's current column, ``lo_s`` its first visible column,
raised to ``hi_s - window + 1`` under a sliding window; GPT-OSS's sink logit (per query head) joins the
softmax's denominator. K and V go through in 16 KB tiles that every query row reads from L1. The softmax is the reference's (max-subtracted, fp32, normalised
before the weighted sum); the sums run in another order and ``exp`` is a degree-6 polynomial
(Cephes' ``expf``, ~1 ulp), so the result equals the torch-ops kernels to fp32 rounding
(``tests/unit/test_cpu_attention.py``). Gemma 2's soft-capped layers stay on the torch ops.

Build: the C source below is compiled once per machine and source (``cc -O3 -march=native``, under a
second) into ``$RLHF_KERNEL_CACHE`` (default ``~/.cache/rlhf/kernels``; the temporary directory where
that is not writable) and loaded with ``ctypes``: no torch headers, so the build is quick enough to
happen on first use; GCC or Clang (``CC``). With OpenMP the (slot, kv head)
pairs are split over torch's threads (it shares torch's ``libgomp``). Where no compiler works the
sampler keeps the torch-ops kernels and says so once; ``RLHF_FUSED_CPU_ATTENTION=0`` turns the kernel
off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC / Clang vector extensions: 8 fp32 lanes, lowered to whatever SIMD the machine has (AVX2 / AVX-512
   here, NEON on Arm). */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define INLINE static inline __attribute__((always_inline))

INLINE v8 ld(const float* p) { v8 x; memcpy(&x, p, sizeof x); return x; }
INLINE void st(float* p, v8 x) { memcpy(p, &x, sizeof x); }
INLINE v8 bc(float a) { return (v8){a, a, a, a, a, a, a, a}; }
INLINE float hsum(v8 x) {
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += x[i];
    return s;
}

/* Two-vector shuffles: GCC's __builtin_shuffle, Clang's __builtin_shufflevector. */
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif
#define EVEN 0, 8, 2, 10, 4, 12, 6, 14
#define ODD 1, 9, 3, 11, 5, 13, 7, 15

/* The sums of 8 vectors as one vector (lane j: the sum of a[j]'s lanes): three shuffle-add levels. */
INLINE v8 sum8(const v8* a) {
    v8 x0 = SHUF(a[0], a[1], EVEN) + SHUF(a[0], a[1], ODD);
    v8 x1 = SHUF(a[2], a[3], EVEN) + SHUF(a[2], a[3], ODD);
    v8 x2 = SHUF(a[4], a[5], EVEN) + SHUF(a[4], a[5], ODD);
    v8 x3 = SHUF(a[6], a[7], EVEN) + SHUF(a[6], a[7], ODD);
    v8 y0 = SHUF(x0, x1, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(x0, x1, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 y1 = SHUF(x2, x3, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(x2, x3, 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(y0, y1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(y0, y1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* exp(x) for x <= 0 (scores minus their row maximum), Cephes expf: x = n ln2 + r, |r| <= ln2 / 2,
   exp(r) by a degree-6 polynomial, 2^n from the exponent bits; n rounded by the 1.5 * 2^23 trick. */
INLINE v8 exp_le0(v8 x) {
    v8i low = x < bc(-87.0f);
    x = (v8)(((v8i)x & ~low) | ((v8i)bc(-87.0f) & low));
    v8 n = (x * bc(1.44269504088896341f) + bc(12582912.0f)) - bc(12582912.0f);
    v8 r = x - n * bc(0.693359375f);
    r = r + n * bc(2.12194440e-4f);
    v8 p = bc(1.9875691500e-4f);
    p = p * r + bc(1.3981999507e-3f);
    p = p * r + bc(8.3334519073e-3f);
    p = p * r + bc(4.1665795894e-2f);
    p = p * r + bc(1.6666665459e-1f);
    p = p * r + bc(5.0000001201e-1f);
    p = p * r * r + r + bc(1.0f);
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)e;
}

INLINE float exp1(float x) { return exp_le0(bc(x))[0]; }

/* Columns per tile: a tile's K (or V) rows, TILE_BYTES of them, stay in L1 while every query row of the
   pair reads them, so a pair's K / V come from L2 or memory once, not once per row (G up to 8 and more). */
#define TILE_BYTES 16384
INLINE int64_t tile_cols(int DV) { return TILE_BYTES / (32 * DV) < 8 ? 8 : TILE_BYTES / (32 * DV); }

/* A run of columns [c0, c1) whose K and V rows are contiguous: k, v point at column c0's rows. */
typedef struct { const float* k; const float* v; int64_t c0, c1; } seg_t;

/* Scores of the G query rows q (rows of D = 8 * DV) against the columns of one run, into
   sc[g * n + c - lo]. */
INLINE void scores(const float* q, int64_t G, int DV, seg_t sg, int64_t lo, int64_t n, float scale, float* sc) {
    const int64_t D = 8 * DV, tc = tile_cols(DV);
    for (int64_t t0 = sg.c0; t0 < sg.c1; t0 += tc) {
        const int64_t t1 = t0 + tc < sg.c1 ? t0 + tc : sg.c1;
        for (int64_t g = 0; g < G; ++g) {
            v8 qv[DV];
            for (int t = 0; t < DV; ++t) qv[t] = ld(q + g * D + 8 * t);
            float* row = sc + g * n - lo;
            int64_t c = t0;
            for (; c + 8 <= t1; c += 8) {
                v8 acc[8];
                for (int j = 0; j < 8; ++j) {
                    const float* kc = sg.k + (c + j - sg.c0) * D;
                    acc[j] = qv[0] * ld(kc);
                    for (int t = 1; t < DV; ++t) acc[j] += qv[t] * ld(kc + 8 * t);
                }
                st(row + c, sum8(acc) * bc(scale));
            }
            for (; c < t1; ++c) {
                const float* kc = sg.k + (c - sg.c0) * D;
                v8 a = qv[0] * ld(kc);
                for (int t = 1; t < DV; ++t) a += qv[t] * ld(kc + 8 * t);
                row[c] = hsum(a) * scale;
            }
        }
    }
}

/* out[g] (+)= sum over the run's columns of p[g][c] V[c], rows two at a time with their accumulators in
   registers, tile by tile; init: out starts with this run (not read). */
INLINE void weigh(const float* sc, int64_t G, int DV, seg_t sg, int64_t lo, int64_t n, float* out, int init) {
    const int64_t D = 8 * DV, tc = tile_cols(DV);
    for (int64_t t0 = sg.c0; t0 < sg.c1; t0 += tc) {
        const int64_t t1 = t0 + tc < sg.c1 ? t0 + tc : sg.c1;
        for (int64_t g0 = 0; g0 < G; g0 += 2) {
            const int gc = G - g0 < 2 ? (int)(G - g0) : 2;
            v8 acc[2 * DV];
            for (int g = 0; g < gc; ++g)
                for (int t = 0; t < DV; ++t)
                    acc[g * DV + t] = init && t0 == sg.c0 ? bc(0.0f) : ld(out + (g0 + g) * D + 8 * t);
            for (int64_t c = t0; c < t1; ++c) {
                const float* vc = sg.v + (c - sg.c0) * D;
                for (int g = 0; g < gc; ++g) {
                    v8 p = bc(sc[(g0 + g) * n + c - lo]);
                    for (int t = 0; t < DV; ++t) acc[g * DV + t] += p * ld(vc + 8 * t);
                }
            }
            for (int g = 0; g < gc; ++g)
                for (int t = 0; t < DV; ++t) st(out + (g0 + g) * D + 8 * t, acc[g * DV + t]);
        }
    }
}

/* One (slot, kv head) pair: G query rows over columns [lo, hi], given as nseg non-empty runs in column
   order. sc: G * (hi - lo + 1) floats. */
INLINE void pair(const float* q, float* out, const seg_t* segs, int64_t nseg, int64_t lo, int64_t hi, int64_t G,
                 int DV, float scale, const float* sink, float* sc) {
    const int64_t n = hi - lo + 1;
    for (int64_t i = 0; i < nseg; ++i) scores(q, G, DV, segs[i], lo, n, scale, sc);
    for (int64_t g = 0; g < G; ++g) {
        float* row = sc + g * n;
        float m = row[0];
        for (int64_t j = 1; j < n; ++j) m = row[j] > m ? row[j] : m;
        float sk = sink ? sink[g] : 0.0f;
        if (sink && sk > m) m = sk;
        v8 vs = bc(0.0f), vm = bc(m);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            v8 e = exp_le0(ld(row + j) - vm);
            st(row + j, e);
            vs += e;
        }
        float sum = hsum(vs);
        for (; j < n; ++j) { row[j] = exp1(row[j] - m); sum += row[j]; }
        if (sink) sum += exp1(sk - m);
        v8 inv = bc(1.0f / sum);
        for (j = 0; j + 8 <= n; j += 8) st(row + j, ld(row + j) * inv);
        for (; j < n; ++j) row[j] *= inv[0];
    }
    for (int64_t i = 0; i < nseg; ++i) weigh(sc, G, DV, segs[i], lo, n, out, i == 0);
}

#define PAIR(DV) \
    static void pair_##DV(const float* q, float* out, const seg_t* segs, int64_t nseg, int64_t lo, int64_t hi, \
                          int64_t G, float scale, const float* sink, float* sc) { \
        pair(q, out, segs, nseg, lo, hi, G, DV, scale, sink, sc); \
    }
PAIR(1)
PAIR(2)
PAIR(4)
PAIR(8)
PAIR(16)
PAIR(32)

/* Any other multiple of 8: the same code with DV unknown at compile time (slower: stack accumulators). */
static void pair_any(const float* q, float* out, const seg_t* segs, int64_t nseg, int64_t lo, int64_t hi,
                     int64_t G, int DV, float scale, const float* sink, float* sc) {
    pair(q, out, segs, nseg, lo, hi, G, DV, scale, sink, sc);
}

static void run_pair(int DV, const float* q, float* out, const seg_t* segs, int64_t nseg, int64_t lo, int64_t hi,
                     int64_t G, float scale, const float* sink, float* sc) {
    switch (DV) {
        case 1: pair_1(q, out, segs, nseg, lo, hi, G, scale, sink, sc); break;
        case 2: pair_2(q, out, segs, nseg, lo, hi, G, scale, sink, sc); break;
        case 4: pair_4(q, out, segs, nseg, lo, hi, G, scale, sink, sc); break;
        case 8: pair_8(q, out, segs, nseg, lo, hi, G, scale, sink, sc); break;
        case 16: pair_16(q, out, segs, nseg, lo, hi, G, scale, sink, sc); break;
        case 32: pair_32(q, out, segs, nseg, lo, hi, G, scale, sink, sc); break;
        default: pair_any(q, out, segs, nseg, lo, hi, G, DV, scale, sink, sc);
    }
}

/* The layout of one layer's K / V: slot regions (paged = 0: slot s / head h / column c at s * ss + h * hs +
   c * D, columns [0, pm) from slot lead[s]) or paged blocks (paged = 1: head h / block b / offset o at
   h * hs + b * ss + o * D, blocks of bs positions, slot s's column c in block table[s * tw + c / bs]). */
typedef struct {
    int paged;
    int64_t ss, hs, pm, bs, tw;
    const int64_t *lead, *table;
} layout_t;

/* The runs of columns [lo, hi] of slot s, head h, in column order; returns how many. */
INLINE int64_t runs(const layout_t* L, const float* k, const float* v, int64_t s, int64_t h, int64_t lo, int64_t hi,
                    int64_t D, seg_t* segs) {
    int64_t nseg = 0;
    if (L->paged) {
        for (int64_t c0 = lo; c0 <= hi;) {
            const int64_t blk = L->table[s * L->tw + c0 / L->bs], off = c0 % L->bs;
            const int64_t c1 = c0 - off + L->bs < hi + 1 ? c0 - off + L->bs : hi + 1;
            const int64_t at = h * L->hs + blk * L->ss + off * D;
            segs[nseg++] = (seg_t){k + at, v + at, c0, c1};
            c0 = c1;
        }
        return nseg;
    }
    const int64_t mid = L->pm < lo ? lo : (L->pm > hi + 1 ? hi + 1 : L->pm);
    const int64_t lead = (L->lead[s] * L->ss + h * L->hs), own = (s * L->ss + h * L->hs);
    if (mid > lo) segs[nseg++] = (seg_t){k + lead + lo * D, v + lead + lo * D, lo, mid};
    if (hi + 1 > mid) segs[nseg++] = (seg_t){k + own + mid * D, v + own + mid * D, mid, hi + 1};
    return nseg;
}

/* q, out: [B, H, G, D] contiguous, D a multiple of 8; first, last: [B] each slot's first and last visible
   column (window > 0: a sliding window); sinks: [H * G] or NULL. Returns 0; -1 when out of memory; -2 for a
   D that is not a multiple of 8. */
static int attend(const layout_t* L, const float* q, float* out, const float* k, const float* v, int64_t B,
                  int64_t H, int64_t G, int64_t D, const int64_t* first, const int64_t* last, int64_t window,
                  float scale, const float* sinks, int nthreads) {
    if (D % 8 != 0 || D <= 0) return -2;
    const int DV = (int)(D / 8);
    int64_t wmax = 1;
    for (int64_t s = 0; s < B; ++s) wmax = last[s] + 1 > wmax ? last[s] + 1 : wmax;
    const int64_t max_runs = L->paged ? wmax / L->bs + 2 : 2;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float* sc = (float*)malloc((size_t)(G * wmax + 8) * sizeof(float));
        seg_t* segs = (seg_t*)malloc((size_t)max_runs * sizeof(seg_t));
        if (!sc || !segs) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < B * H; ++i) {
            if (!sc || !segs) continue;
            const int64_t s = i / H, h = i % H;
            int64_t lo = first[s], hi = last[s];
            if (window > 0 && hi - window + 1 > lo) lo = hi - window + 1;
            const int64_t nseg = runs(L, k, v, s, h, lo, hi, D, segs);
            run_pair(DV, q + i * G * D, out + i * G * D, segs, nseg, lo, hi, G, scale, sinks ? sinks + h * G : 0, sc);
        }
        free(sc);
        free(segs);
    }
    return failed ? -1 : 0;
}

/* Slot regions: k, v the layer's K / V regions (see layout_t). */
int region_decode_attention(const float* q, float* out, const float* k, const float* v, int64_t B,
                            int64_t H, int64_t G, int64_t D, int64_t ss, int64_t hs, const int64_t* lead,
                            const int64_t* first, const int64_t* last, int64_t pm, int64_t window,
                            float scale, const float* sinks, int nthreads) {
    const layout_t L = {0, ss, hs, pm, 1, 0, lead, 0};
    return attend(&L, q, out, k, v, B, H, G, D, first, last, window, scale, sinks, nthreads);
}

/* Paged blocks: k, v the layer's K / V heads (see layout_t; bstride: one block). */
int paged_decode_attention(const float* q, float* out, const float* k, const float* v, int64_t B, int64_t H,
                           int64_t G, int64_t D, int64_t hs, int64_t bstride, int64_t bs, const int64_t* table,
                           int64_t tw, const int64_t* first, const int64_t* last, int64_t window, float scale,
                           const float* sinks, int nthreads) {
    const layout_t L = {1, bstride, hs, 0, bs, tw, 0, table};
    return attend(&L, q, out, k, v, B, H, G, D, first, last, window, scale, sinks, nthreads);
}
"""

_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno"]
_STATE: dict[str, object] = {}


def _enabled_by_env() -> bool:
    return os.environ.get("RLHF_FUSED_CPU_ATTENTION", "1").strip().lower() not in ("0", "false", "off", "no")


def _cache_dir() -> str:
    return os.environ.get("RLHF_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlhf", "kernels")


def _compile(cc: str, omp: bool) -> str:
    """Path of the shared library for this source, compiler, flags and machine (built if missing).
    Built into a temporary file and renamed, so that ranks compiling at once do not read half a file."""
    flags = _FLAGS + (["-fopenmp"] if omp else ["-fopenmp-simd"])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([_SOURCE, cc, version, platform.machine(), platform.node(), *flags])
                         .encode()).hexdigest()[:16]
    name = f"region_decode_attention_{key}.so"
    folders = [_cache_dir(), os.path.join(tempfile.gettempdir(), f"rlhf-kernels-{os.getuid()}")]
    for folder in folders:
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    for folder in folders:  # a read-only home: the temporary directory
        try:
            os.makedirs(folder, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:
            continue
    path = os.path.join(folder, name)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, lib = os.path.join(tmp, "k.c"), os.path.join(tmp, "k.so")
        with open(src, "w") as f:
            f.write(_SOURCE)
        done = subprocess.run([cc, *flags, src, "-o", lib, "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
        os.replace(lib, path)
    return path


def _load() -> Optional[ctypes.CDLL]:
    """The compiled kernel, built on first use; None (and the reason in ``unavailable_reason``) where
    it cannot be."""
    if "lib" in _STATE:
        return _STATE["lib"]  # type: ignore[return-value]
    lib, reason = None, None
    cc = os.environ.get("CC", "cc")
    for omp in (True, False):
        try:
            lib = ctypes.CDLL(_compile(cc, omp))
            break
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            reason = f"{type(e).__name__}: {e}"
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.region_decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64,
                                                i64, ctypes.c_float, ptr, ctypes.c_int]
        lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ptr,
                                               ptr, i64, ctypes.c_float, ptr, ctypes.c_int]
        lib.region_decode_attention.restype = lib.paged_decode_attention.restype = ctypes.c_int
    _STATE["lib"], _STATE["reason"] = lib, reason
    return lib


def unavailable_reason() -> Optional[str]:
    """Why the fused kernel is not used in this process (None: it is)."""
    if not _enabled_by_env():
        return "RLHF_FUSED_CPU_ATTENTION=0"
    _load()
    return _STATE["reason"] if _STATE["lib"] is None else None  # type: ignore[return-value]


def available() -> bool:
    """Whether the fused kernel can run here: a CPU build of the C source loads (and the env allows it)."""
    if not _enabled_by_env():
        return False
    lib = _load()
    if lib is None and not _STATE.get("warned"):
        _STATE["warned"] = True
        warnings.warn(f"rollout: the fused CPU decode attention is unavailable ({_STATE['reason']}); decoding with "
                      "torch ops (slower on CPU). Install a C compiler (gcc) or set CC.", stacklevel=2)
    return lib is not None


def supports(q: Tensor) -> bool:
    """Whether the kernel takes these queries (``[B, Hkv, G, D]``): fp32 on CPU, a head size that is a
    multiple of 8 (compiled for 8-256 in powers of two; other multiples run a slower generic loop)."""
    return q.dtype == torch.float32 and q.device.type == "cpu" and q.shape[-1] % 8 == 0


def region_decode_attention(q: Tensor, k: Tensor, v: Tensor, lead: Tensor, first: Tensor, last: Tensor, pm: int,
                            scale: float, window: Optional[int] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """Decode attention of ``q`` ``[B, Hkv, G, D]`` over slot regions (module docstring): ``k``, ``v``
    ``[S, Hkv, T, D]`` (S >= B; the layer's regions, columns contiguous), ``lead`` / ``first`` / ``last``
    ``[B]`` int64 (each slot's prompt source, first and last visible column), ``pm`` the aligned prompt
    columns (0: every column from the slot's own region). Returns ``[B, Hkv, G, D]`` fp32."""
    if is_fake(q):  # the simulation (rlhf.simulate) runs the sampler on fake tensors: the output is what it allocates
        return torch.empty_like(q)
    assert k.dtype == v.dtype == torch.float32 and k.stride() == v.stride(), "K and V regions of one layer"
    assert k.stride(3) == 1 and k.stride(2) == q.shape[-1], "columns must be contiguous rows"
    return _call("region_decode_attention", q, sinks, k, v, k.stride(0), k.stride(1),
                 _index(lead), _index(first), _index(last), int(pm), int(window or 0), float(scale))


def paged_decode_attention(q: Tensor, kv: Tensor, table: Tensor, first: Tensor, last: Tensor, scale: float,
                           window: Optional[int] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """Decode attention of ``q`` ``[B, Hkv, G, D]`` over paged blocks: ``kv`` ``[2 * Hkv, NB, BS, D]`` (one
    layer of ``PagedKVCache.kv``: K heads then V heads, each block's positions contiguous), ``table``
    ``[>= B, MB]`` int64 (slot ``s``'s column ``c`` in block ``table[s, c // BS]``), ``first`` / ``last``
    ``[B]`` each slot's first and last visible column. Shared prompt blocks are read through every member's
    table row, so a group's prompt comes from L1 / L2 after its first sample. Returns ``[B, Hkv, G, D]``."""
    if is_fake(q):
        return torch.empty_like(q)
    hkv = q.shape[1]
    assert kv.dtype == torch.float32 and kv.shape[0] == 2 * hkv, "one layer's K and V heads"
    assert kv.stride(3) == 1 and kv.stride(2) == q.shape[-1], "blocks must hold contiguous rows"
    tab = _index(table)
    return _call("paged_decode_attention", q, sinks, kv[0], kv[hkv], kv.stride(0), kv.stride(1), kv.shape[2], tab,
                 tab.shape[1], _index(first), _index(last), int(window or 0), float(scale))


def _index(t: Tensor) -> Tensor:
    return t.to(torch.int64).contiguous()


def _call(name: str, q: Tensor, sinks: Optional[Tensor], k: Tensor, v: Tensor, *layout: object) -> Tensor:
    """Run the kernel ``name`` on ``q`` (made contiguous) over ``k`` / ``v`` with the rest of its arguments
    ``layout`` in the C signature's order (tensors passed by address, kept alive here); sinks and the thread
    count go last. Returns the output ``[B, Hkv, G, D]``."""
    lib = _load()
    assert lib is not None, f"{name}: call available() first"
    assert q.dtype == torch.float32 and q.device.type == "cpu"
    q = q.contiguous()
    out = torch.empty_like(q)
    b, hkv, g, d = q.shape
    sk = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    rest = [a.data_ptr() if isinstance(a, Tensor) else a for a in layout]
    rc = getattr(lib, name)(q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(), b, hkv, g, d, *rest,
                            None if sk is None else sk.data_ptr(), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("fused CPU decode attention: out of memory for the scores buffer")
    if rc != 0:
        raise ValueError(f"fused CPU decode attention: head size {d} is not a multiple of 8")
    return out
