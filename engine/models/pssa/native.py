"""PSSA's CPU scan as one C loop nest, built on first use with the host's C compiler.

Why native code: in PyTorch the scan is a few tensor operations per token, each a pass over the
(B, N, d) state in memory and each too small for a second thread (32,768 numbers a token at
pssa-1.5m, the size below which PyTorch runs an operation on one thread). At 8 rows of 64
tokens that cost about 8 ms of a 2-thread update (the transformer's whole update is 25). Here
a task is one row and 16 channels: their N x 16 states, decays and adjoints live in registers
and the L1 cache for the whole chunk, every token is one pass over them, and the tasks are
shared among the threads (OpenMP, the runtime PyTorch already loaded).

The arithmetic is `scan.py`'s (its module docstring): the forward keeps each `TIME_BLOCK`-token
block's first state, the backward rebuilds a block's decays and states from it and runs the
adjoint back through them; a decay enters only as one token's exp(delta A), never as a product
over tokens. exp2 is a polynomial here (Horner on 2^f, |f| <= 1/2, with 2^k put in the exponent
bits) so that it vectorises; it is within a few units in the last place of the libm value, and a
decay below the smallest normal number (2^-126 in float32, 2^-1022 in float64) is 0. The
exponents are delta A <= 0 (delta = softplus >= 0, A = -softplus): nothing can overflow.

Determinism: a task's outputs are its own (rows and channels), and the sums across tasks (the
gradients of B, C and A) are left as per-task pieces that PyTorch adds in a fixed order, so the
numbers do not depend on the thread count or the schedule.

The library is built once per source and machine into the user's cache
(`$XDG_CACHE_HOME/nsconsole`, else ~/.cache/nsconsole; about a second with gcc) and loaded with
ctypes, which releases the GIL for the call. Without a working compiler `library()` returns None
and the PyTorch scan runs; `NSCONSOLE_PSSA_NATIVE=0` asks for the PyTorch scan outright.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

LANES = 16
"""Channels per task: one AVX-512 register of float32 (two of float64)."""
MAX_STATES = 64
"""The largest d_state the kernel takes (its per-task buffers are sized by it); beyond, PyTorch's scan."""
SPAN = 4
"""Groups of LANES channels in one backward task: g B and g C are summed over the lanes once per
token and task, so the more the fewer sums, but the fewer tasks to share among the threads
(pssa-1.5m, 8 rows of 256 channels: 32 tasks)."""

_BODY = r"""
/* exp2(v) = 2^k p(f), k = round(v), f = v - k in [-1/2, 1/2]: 0 below the normal range, and
   saturating at 2^EXP_BIAS above it (no decay comes near: delta A <= 0). */
static inline REAL NAME(exp2_poly)(REAL v) {
    const REAL low = (REAL)(1 - EXP_BIAS), high = (REAL)EXP_BIAS;
    REAL w = v < low ? low : (v > high ? high : v);
    REAL k = (w + ROUNDER) - ROUNDER;  /* round to nearest: 1.5 2^mantissa leaves no fraction bits */
    REAL f = w - k;
    REAL p = POLY(f);
    union { IBITS bits; REAL value; } scale = {((IBITS)k + EXP_BIAS) << MANT_BITS};  /* 2^k */
    return v < low ? (REAL)0 : p * scale.value;
}

/* Float32 only: subnormal numbers read and made as 0 (MXCSR's DAZ and FTZ bits) in each thread
   for the call, the caller's mode restored after. Adjoints times decays far below 1 reach the
   subnormal range, where each operation is slow even on these AVX-512 units (pssa-1.5m's backward
   in training: 1.8 -> 1.4 ms); a subnormal is below 1.2e-38, nothing next to the sums it enters.
   Float64, the exact reference, keeps them. */
static inline unsigned NAME(flush_begin)(void) {
#if defined(__SSE__)
    const unsigned mode = _mm_getcsr();
    if (sizeof(REAL) == sizeof(float)) _mm_setcsr(mode | 0x8040u);  /* FTZ (bit 15), DAZ (bit 6) */
    return mode;
#else
    return 0;
#endif
}

static inline void NAME(flush_end)(unsigned mode) {
#if defined(__SSE__)
    _mm_setcsr(mode);
#else
    (void)mode;
#endif
}

/* LANES numbers as one vector (GCC's and clang's vector extension), for `lane_sums`; and the
   index vector of GCC's __builtin_shuffle. */
typedef REAL NAME(lanes) __attribute__((vector_size(LANES * sizeof(REAL))));
typedef IBITS NAME(lane_mask) __attribute__((vector_size(LANES * sizeof(REAL))));

typedef struct {
    const REAL *x, *delta, *rates_log2, *rates, *B, *C, *h0, *gy, *g_last;
    REAL *y, *h_last, *firsts, *g_x, *g_delta, *g_rates, *g_B, *g_C, *g_h0;
    int64_t batch, length, channels, states, groups, spans;
} NAME(args);

/* One token of one task (the backward's rebuild of a block): decays into dec, states
   h = dec * h_prev + u B into h (N x gw). */
static inline void NAME(step)(const NAME(args) *a, int64_t b, int64_t t, int64_t i0, int gw,
                              REAL h[][LANES], REAL dec[][LANES], REAL const h_prev[][LANES]) {
    const int64_t d = a->channels, row = (b * a->length + t);
    const REAL *dl = a->delta + row * d + i0, *xx = a->x + row * d + i0, *Bt = a->B + row * a->states;
    REAL u[LANES];
    for (int k = 0; k < gw; ++k) u[k] = dl[k] * xx[k];
    for (int64_t n = 0; n < a->states; ++n) {
        const REAL *r2 = a->rates_log2 + n * d + i0, bn = Bt[n];
        for (int k = 0; k < gw; ++k) {
            REAL e = NAME(exp2_poly)(dl[k] * r2[k]);
            dec[n][k] = e;
            h[n][k] = e * h_prev[n][k] + u[k] * bn;
        }
    }
}

static inline void NAME(forward_task)(const NAME(args) *a, int64_t b, int64_t i0, int gw) {
    const int64_t d = a->channels, S = a->states;
    REAL h[MAX_STATES][LANES];
    for (int64_t n = 0; n < S; ++n)
        for (int k = 0; k < gw; ++k) h[n][k] = a->h0 ? a->h0[(b * d + i0 + k) * S + n] : (REAL)0;
    for (int64_t t = 0; t < a->length; ++t) {
        if (a->firsts && t % TIME_BLOCK == 0) {
            REAL *first = a->firsts + ((t / TIME_BLOCK) * a->batch + b) * S * d + i0;
            for (int64_t n = 0; n < S; ++n)
                for (int k = 0; k < gw; ++k) first[n * d + k] = h[n][k];
        }
        /* `step` with y's sum over the states in the same pass: kept apart, gcc vectorised that
           sum across the states and added the lanes one by one (half the forward's time). */
        const int64_t row = b * a->length + t;
        const REAL *dl = a->delta + row * d + i0, *xx = a->x + row * d + i0;
        const REAL *Bt = a->B + row * S, *Ct = a->C + row * S;
        REAL u[LANES], acc[LANES] = {0};
        for (int k = 0; k < gw; ++k) u[k] = dl[k] * xx[k];
        for (int64_t n = 0; n < S; ++n) {
            const REAL *r2 = a->rates_log2 + n * d + i0, bn = Bt[n], cn = Ct[n];
            for (int k = 0; k < gw; ++k) {
                h[n][k] = NAME(exp2_poly)(dl[k] * r2[k]) * h[n][k] + u[k] * bn;
                acc[k] += cn * h[n][k];
            }
        }
        REAL *out = a->y + row * d + i0;
        for (int k = 0; k < gw; ++k) out[k] = acc[k];
    }
    for (int64_t n = 0; n < S; ++n)
        for (int k = 0; k < gw; ++k) a->h_last[(b * d + i0 + k) * S + n] = h[n][k];
}

/* out[n] = the sum of terms[n][0..LANES) for the S states: LANES states at a time by a
   transposing tree (`_lane_sum_tree`: LANES - 1 vector additions for the LANES sums, where a sum
   of one state's lanes one by one takes LANES - 1 scalar additions), the rest one by one. */
static inline void NAME(lane_sums)(NAME(lanes) terms[], int64_t S, REAL *out) {
    int64_t n = 0;
    for (; n + LANES <= S; n += LANES) {
        NAME(lanes) v[LANES];  /* a copy: lanes past gw must stay 0 in terms */
        for (int k = 0; k < LANES; ++k) v[k] = terms[n + k];
        LANE_SUM_TREE
        for (int k = 0; k < LANES; ++k) out[n + k] = v[0][k];
    }
    for (; n < S; ++n) {
        REAL sum = 0;
        for (int k = 0; k < LANES; ++k) sum += terms[n][k];
        out[n] = sum;
    }
}

/* One group's adjoint back through the block [start, stop): its lam and g_rate carried on, its
   terms of g B and g C added lane by lane into acc_b, acc_c (hs, decs: room for the block). */
static inline void NAME(group_block)(const NAME(args) *a, int64_t b, int64_t i0, int gw, int64_t start,
                                     int64_t stop, REAL lam[restrict][LANES], REAL g_rate[restrict][LANES],
                                     REAL hs[restrict][MAX_STATES][LANES], REAL decs[restrict][MAX_STATES][LANES],
                                     NAME(lanes) acc_b[restrict][MAX_STATES], NAME(lanes) acc_c[restrict][MAX_STATES]) {
    const int64_t d = a->channels, S = a->states, L = a->length;
    const REAL *first = a->firsts + ((start / TIME_BLOCK) * a->batch + b) * S * d + i0;
    for (int64_t n = 0; n < S; ++n)
        for (int k = 0; k < gw; ++k) hs[0][n][k] = first[n * d + k];
    for (int64_t t = start; t < stop; ++t)
        NAME(step)(a, b, t, i0, gw, hs[t - start + 1], decs[t - start], (REAL const (*)[LANES])hs[t - start]);
    for (int64_t t = stop - 1; t >= start; --t) {
        const int64_t row = b * L + t, s = t - start;
        const REAL *dl = a->delta + row * d + i0, *xx = a->x + row * d + i0;
        const REAL *Bt = a->B + row * S, *Ct = a->C + row * S, *gy = a->gy ? a->gy + row * d + i0 : 0;
        REAL u[LANES], g_u[LANES] = {0}, g_dl[LANES] = {0};
        for (int k = 0; k < gw; ++k) u[k] = dl[k] * xx[k];
        for (int64_t n = 0; n < S; ++n) {
            const REAL bn = Bt[n], *an = a->rates + n * d + i0;
            if (gy) {
                const REAL cn = Ct[n];
                for (int k = 0; k < gw; ++k) {
                    lam[n][k] += gy[k] * cn;  /* lam_t = gy_t C_t + decay_{t+1} lam_{t+1} */
                    acc_c[s][n][k] += gy[k] * hs[s + 1][n][k];
                }
            }
            for (int k = 0; k < gw; ++k) {
                acc_b[s][n][k] += lam[n][k] * u[k];
                g_u[k] += lam[n][k] * bn;
                REAL r = lam[n][k] * hs[s][n][k] * decs[s][n][k];  /* the gradient of delta A */
                g_dl[k] += r * an[k];
                g_rate[n][k] += r * dl[k];
                lam[n][k] *= decs[s][n][k];
            }
        }
        REAL *gx = a->g_x + row * d + i0, *gd = a->g_delta + row * d + i0;
        for (int k = 0; k < gw; ++k) {
            gx[k] = g_u[k] * dl[k];
            gd[k] = g_dl[k] + g_u[k] * xx[k];
        }
    }
}

/* One row and SPAN groups of LANES channels (from group g0, gws[j] channels in the j-th): each
   group's adjoint runs back through a block as the forward went, and its terms of g B and g C are
   added lane by lane into the block's acc_b, acc_c, which `lane_sums` sums over the lanes once
   per token for all the task's groups (once per group and state, the sums were about a quarter of
   a one-thread backward at pssa-1.5m's shape). */
static inline void NAME(backward_task)(const NAME(args) *a, int64_t b, int64_t g0, int span, const int *gws) {
    const int64_t d = a->channels, S = a->states, L = a->length;
    REAL lam[SPAN][MAX_STATES][LANES], g_rate[SPAN][MAX_STATES][LANES];
    REAL hs[TIME_BLOCK + 1][MAX_STATES][LANES], decs[TIME_BLOCK][MAX_STATES][LANES];
    NAME(lanes) acc_b[TIME_BLOCK][MAX_STATES], acc_c[TIME_BLOCK][MAX_STATES];
    for (int j = 0; j < span; ++j)
        for (int64_t n = 0; n < S; ++n)
            for (int k = 0; k < gws[j]; ++k) {
                lam[j][n][k] = a->g_last ? a->g_last[(b * d + (g0 + j) * LANES + k) * S + n] : (REAL)0;
                g_rate[j][n][k] = 0;
            }
    REAL *gB = a->g_B + (b * a->spans + g0 / SPAN) * L * S, *gC = a->g_C + (b * a->spans + g0 / SPAN) * L * S;
    for (int64_t block = (L - 1) / TIME_BLOCK; block >= 0; --block) {
        const int64_t start = block * TIME_BLOCK, stop = start + TIME_BLOCK < L ? start + TIME_BLOCK : L;
        for (int64_t s = 0; s < stop - start; ++s)
            for (int64_t n = 0; n < S; ++n) acc_b[s][n] = acc_c[s][n] = (NAME(lanes)){0};
        for (int j = 0; j < span; ++j) {
            REAL (*lm)[LANES] = lam[j], (*gr)[LANES] = g_rate[j];
            const int64_t i0 = (g0 + j) * LANES;
            /* gw the constant LANES for a full group: the loops over lanes vectorise without a rest. */
            if (gws[j] == LANES) NAME(group_block)(a, b, i0, LANES, start, stop, lm, gr, hs, decs, acc_b, acc_c);
            else NAME(group_block)(a, b, i0, gws[j], start, stop, lm, gr, hs, decs, acc_b, acc_c);
        }
        for (int64_t t = start; t < stop; ++t) {
            NAME(lane_sums)(acc_b[t - start], S, gB + t * S);
            NAME(lane_sums)(acc_c[t - start], S, gC + t * S);
        }
    }
    for (int j = 0; j < span; ++j)
        for (int64_t n = 0; n < S; ++n)
            for (int k = 0; k < gws[j]; ++k) {
                const int64_t i = (g0 + j) * LANES + k;
                a->g_h0[(b * d + i) * S + n] = lam[j][n][k];
                a->g_rates[(b * S + n) * d + i] = g_rate[j][n][k];
            }
}

/* Tasks are (row, group of LANES channels); the full groups run with gw the constant LANES. */
void NAME(pssa_scan_forward)(const NAME(args) *a, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const unsigned mode = NAME(flush_begin)();
#pragma omp for schedule(static)
        for (int64_t task = 0; task < a->batch * a->groups; ++task) {
            int64_t b = task / a->groups, group = task % a->groups, i0 = group * LANES;
            if (i0 + LANES <= a->channels) NAME(forward_task)(a, b, i0, LANES);
            else NAME(forward_task)(a, b, i0, (int)(a->channels - i0));
        }
        NAME(flush_end)(mode);
    }
}

void NAME(pssa_scan_backward)(const NAME(args) *a, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const unsigned mode = NAME(flush_begin)();
#pragma omp for schedule(static)
        for (int64_t task = 0; task < a->batch * a->spans; ++task) {
            const int64_t b = task / a->spans, g0 = (task % a->spans) * SPAN;
            int gws[SPAN], span = 0;
            for (; span < SPAN && (g0 + span) * LANES < a->channels; ++span) {
                const int64_t left = a->channels - (g0 + span) * LANES;
                gws[span] = left < LANES ? (int)left : LANES;
            }
            NAME(backward_task)(a, b, g0, span, gws);
        }
        NAME(flush_end)(mode);
    }
}
"""

# 2^f = e^(f ln 2) by Taylor's series to the term below half a unit in the last place at |f| = 1/2.
_LN2 = 0.6931471805599453


def _horner(terms: int) -> str:
    coefficients = [1.0]
    for power in range(1, terms):
        coefficients.append(coefficients[-1] * _LN2 / power)
    expression = f"(REAL){coefficients[-1]!r}"
    for coefficient in reversed(coefficients[:-1]):
        expression = f"((REAL){coefficient!r} + (x) * {expression})"
    return expression


_TYPES = {
    "f32": ("float", "int32_t", 127, 23, _horner(8)),
    "f64": ("double", "int64_t", 1023, 52, _horner(14)),
}
"""Per variant: the real type, the integer of its bits, its exponent bias and mantissa bits, and
the exp2 polynomial (to the term below half a unit in the last place)."""


def typed_source(body: str) -> str:
    """body once per real type, f32 then f64: inside it NAME(f) is f_f32 or f_f64, and REAL,
    IBITS, EXP_BIAS, MANT_BITS, ROUNDER and POLY (exp2's polynomial) describe the type."""
    parts = []
    for suffix, (real, ibits, bias, mantissa, poly) in _TYPES.items():
        parts.append(
            f"#define REAL {real}\n#define IBITS {ibits}\n#define EXP_BIAS {bias}\n#define MANT_BITS {mantissa}\n"
            f"#define ROUNDER ((REAL){1.5 * 2.0**mantissa!r})\n"
            f"#define POLY(x) {poly}\n#define NAME(f) f##_{suffix}\n{body}\n"
            "#undef REAL\n#undef IBITS\n#undef EXP_BIAS\n#undef MANT_BITS\n#undef ROUNDER\n#undef POLY\n#undef NAME\n"
        )
    return "".join(parts)


def _lane_sum_tree() -> str:
    """C statements that sum each of the LANES vectors v[0..LANES) over its lanes into v[0] (lane
    n the sum of v[n]). A level of half-width w pairs v[i] with v[i + m] (m vectors remain after
    it) and adds the two shuffles that put, segment by segment of w lanes, one group's lower and
    its upper half side by side: every vector then holds twice the states, each over half the
    lanes; pairing i with i + m leaves the states in order at the end."""
    statements = []
    width, vectors = LANES // 2, LANES
    while width >= 1:
        vectors //= 2
        halves = []
        for offset in (0, width):
            lanes = [
                (LANES if segment % 2 else 0) + (segment // 2) * 2 * width + offset + j
                for segment in range(LANES // width)
                for j in range(width)
            ]
            halves.append(", ".join(map(str, lanes)))
        statements.append(
            f"for (int i = 0; i < {vectors}; ++i) v[i] = SHUFFLE(v[i], v[i + {vectors}], {halves[0]}) "
            f"+ SHUFFLE(v[i], v[i + {vectors}], {halves[1]});"
        )
        width //= 2
    return " ".join(statements)


def _source(time_block: int) -> str:
    header = (
        "#include <stdint.h>\n#ifdef __SSE__\n#include <xmmintrin.h>\n#endif\n"
        f"#define LANES {LANES}\n#define MAX_STATES {MAX_STATES}\n#define TIME_BLOCK {time_block}\n#define SPAN {SPAN}\n"
        "#ifdef __clang__\n#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)\n"
        "#else\n#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (NAME(lane_mask)){__VA_ARGS__})\n#endif\n"
        f"#define LANE_SUM_TREE {_lane_sum_tree()}\n"
    )
    return header + typed_source(_BODY)


class _Args(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("x", "delta", "rates_log2", "rates", "B", "C", "h0", "gy", "g_last")],
        *[(name, ctypes.c_void_p) for name in ("y", "h_last", "firsts", "g_x", "g_delta", "g_rates", "g_B", "g_C",
                                               "g_h0")],  # fmt: skip
        *[(name, ctypes.c_int64) for name in ("batch", "length", "channels", "states", "groups", "spans")],
    ]


_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nsconsole"


def _machine() -> str:
    """What `-march=native` depends on: the CPU's model and flags. Without the clock line, which
    changes from minute to minute on some hosts (each change was a rebuild)."""
    try:
        cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        cpu = platform.processor()
    return platform.machine() + "\n".join(line for line in cpu.splitlines() if not line.startswith("cpu MHz"))


def _build(stem: str, source: str, compiler: str) -> Path:
    """The shared library for source, compiled unless the cache holds it; written to a temporary
    name and renamed, so processes building at once never load a half-written file."""
    key = hashlib.sha256("\0".join([source, compiler, *_FLAGS, _machine()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{stem}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source_path = Path(work) / f"{stem}.c"
        source_path.write_text(source)
        built = Path(work) / target.name
        subprocess.run([compiler, *_FLAGS, str(source_path), "-o", str(built)], check=True,
                       capture_output=True, timeout=120)  # fmt: skip
        os.replace(built, target)
    return target


def load(stem: str, source: str, signatures: dict[str, list[Any]], what: str) -> ctypes.CDLL | None:
    """The library built from source (cached as `<stem>_<hash>.so`), each function named in
    signatures given those argument types (all return nothing); or None where it cannot run: no
    compiler or a failed build (a warning names `what`), not Linux, or `NSCONSOLE_PSSA_NATIVE=0`.
    Then the caller's PyTorch path runs."""
    if os.environ.get("NSCONSOLE_PSSA_NATIVE", "1") == "0" or platform.system() != "Linux":
        return None
    compiler = os.environ.get("CC", "cc")
    try:
        lib = ctypes.CDLL(str(_build(stem, source, compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        warnings.warn(f"PSSA: the native {what} did not build ({error}); PyTorch's runs", stacklevel=3)
        return None
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib


@functools.cache
def library(time_block: int) -> ctypes.CDLL | None:
    """The scan's library for blocks of time_block tokens, or None (`load`): then PyTorch's scan runs."""
    entry = [ctypes.POINTER(_Args), ctypes.c_int]
    names = ("pssa_scan_forward_f32", "pssa_scan_forward_f64", "pssa_scan_backward_f32", "pssa_scan_backward_f64")
    return load("pssa_scan", _source(time_block), dict.fromkeys(names, entry), "CPU scan")


def pointer(tensor: torch.Tensor | None) -> int | None:
    """A tensor's data address for ctypes; None (a null pointer) for None."""
    return None if tensor is None else tensor.data_ptr()


def suffix(dtype: torch.dtype) -> str:
    """The kernels' variant for a dtype: f64 for float64, else f32."""
    return "f64" if dtype == torch.float64 else "f32"


def _args(tensors: dict[str, torch.Tensor | None], batch: int, length: int, channels: int, states: int) -> _Args:
    groups = -(-channels // LANES)
    return _Args(**{name: pointer(t) for name, t in tensors.items()}, batch=batch, length=length,
                 channels=channels, states=states, groups=groups, spans=-(-groups // SPAN))  # fmt: skip


def forward(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    delta: torch.Tensor,
    rates_log2: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor | None,
    firsts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous x, delta (Bt, L, d), rates_log2 (N, d), B, C (Bt, L, N), h0 (Bt, d, N) or None,
    all in one dtype; firsts (blocks, Bt, N, d) to fill with each block's first state, or None
    -> y (Bt, L, d), h_last (Bt, d, N)."""
    batch, length, channels = x.shape
    states = rates_log2.shape[0]
    y = torch.empty_like(x)
    h_last = x.new_empty((batch, channels, states))
    tensors = {"x": x, "delta": delta, "rates_log2": rates_log2, "B": B, "C": C, "h0": h0, "y": y,
               "h_last": h_last, "firsts": firsts}  # fmt: skip
    args = _args(tensors, batch, length, channels, states)
    getattr(lib, "pssa_scan_forward_" + suffix(x.dtype))(ctypes.byref(args), torch.get_num_threads())
    return y, h_last


def backward(
    lib: ctypes.CDLL,
    saved: tuple[torch.Tensor, ...],
    gy: torch.Tensor | None,
    g_last: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """saved = (x, delta, rates_log2, rates, B, C, firsts) as the forward had them; gy (Bt, L, d)
    and g_last (Bt, d, N) contiguous or None -> gradients of x, delta, rates (N, d), B, C, h0."""
    x, delta, rates_log2, rates, B, C, firsts = saved
    batch, length, channels = x.shape
    states = rates.shape[0]
    spans = -(-channels // (LANES * SPAN))
    g_x, g_delta = torch.empty_like(x), torch.empty_like(x)
    g_rates = x.new_empty((batch, states, channels))  # per row: summed below in a fixed order
    g_B = x.new_empty((batch, spans, length, states))  # per task's channels, the same
    g_C = torch.empty_like(g_B)
    g_h0 = x.new_empty((batch, channels, states))
    tensors = {"x": x, "delta": delta, "rates_log2": rates_log2, "rates": rates, "B": B, "C": C, "gy": gy,
               "g_last": g_last, "firsts": firsts, "g_x": g_x, "g_delta": g_delta, "g_rates": g_rates,
               "g_B": g_B, "g_C": g_C, "g_h0": g_h0}  # fmt: skip
    args = _args(tensors, batch, length, channels, states)
    getattr(lib, "pssa_scan_backward_" + suffix(x.dtype))(ctypes.byref(args), torch.get_num_threads())
    return g_x, g_delta, g_rates.sum(0), g_B.sum(1), g_C.sum(1), g_h0
