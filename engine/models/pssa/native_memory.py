"""PSSA's memory read, ball map and write rule on the CPU as C loops, built and loaded as `native` builds
the scan (`native.load`: cached per source and machine, None without a compiler or with
`NSCONSOLE_PSSA_NATIVE=0`, and then the PyTorch code runs).

Why native code: at pssa-1.5m's 8 rows of 64 tokens the PyTorch top-k read is some 40 small
operations forward and backward (ranking, top-k, gathers, the distance's clamps, softmax,
embedding_bag), each too small for a second thread, about 3 ms of a 30 ms update; the write rule
is a loop over rows of a dozen 1-element operations each (0.7 ms). Here the read is one pass per
query: its distance argument to every occupied slot (keys transposed once a call, so the dot
products vectorise over slots), the k smallest kept by insertion (ties to the lower slot), and the
softmax and weighted sum of the k values; the backward runs the chain rule of the same
expression, clamps included (a clamp passes the gradient where its input is at or inside the
bound, as PyTorch's clamp does). Queries are shared among threads and each writes only its own
outputs, so the numbers do not depend on the thread count. The write rule is the host rule of
DESIGN.md ("PSSA memory write rule") run row by row in C: float64 damage with libm's exp, float32
confidence, and each row's target slot resolved so that the last row writing a slot wins. The
ball map (`memory.to_poincare_ball`, some twenty small operations each way) is one loop per row.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.models.pssa import native

SLOT_BLOCK = 64
"""Slots a query ranks at once: four AVX-512 registers of float32 dot products, enough
independent chains to keep the fused multiply-adds busy (one register waits ~4 cycles an add)."""
_READ_BODY = r"""
typedef struct {
    const REAL *q, *keys, *values, *grad_m;
    const uint8_t *occupied;
    REAL *key_sq, *barred, *keys_t, *weights, *m, *grad_q;
    int64_t *chosen;
    int64_t queries, slots, padded_slots, key_dim, value_dim, top_k;
    double tau, margin, acosh_min;
} NAME(read_args);

typedef REAL NAME(vec) __attribute__((vector_size(64), aligned(sizeof(REAL))));
#define CHAINS ((int)(SLOT_BLOCK * sizeof(REAL) / 64))

/* The block of slots s0.. against query i: its distance arguments, SLOT_BLOCK / lanes independent
   chains of fused multiply-adds in registers, and the slots among them that beat the k-th kept
   enter the query's ascending list of the k smallest (chosen, -1 where still empty; the
   arguments in w). A block none of whose arguments beats the k-th is passed over after one
   vector comparison (a free slot's argument is barred: +inf added). */
static void NAME(rank_block)(const NAME(read_args) *a, int64_t i, int64_t s0) {
    const int64_t S = a->slots, P = a->padded_slots, Dk = a->key_dim, K = a->top_k;
    const REAL margin = (REAL)a->margin, amin = (REAL)a->acosh_min;
    const REAL *q = a->q + i * Dk;
    REAL qsq = 0;
#pragma omp simd reduction(+ : qsq)
    for (int64_t d = 0; d < Dk; ++d) qsq += q[d] * q[d];
    const REAL cq = (1 - qsq) < margin ? margin : (1 - qsq);
    NAME(vec) dots[CHAINS] = {{0}};  /* registers: an array of REAL would be kept in memory */
    for (int64_t d = 0; d < Dk; ++d) {
        const NAME(vec) qd = (NAME(vec)){0} + q[d], *kt = (const NAME(vec) *)(a->keys_t + d * P + s0);
        for (int c = 0; c < CHAINS; ++c) dots[c] += qd * kt[c];
    }
    REAL arg[SLOT_BLOCK];
    memcpy(arg, dots, sizeof(arg));
    int64_t *chosen = a->chosen + i * K;
    REAL *w = a->weights + i * K;
    const REAL *key_sq = a->key_sq + s0, *barred = a->barred + s0;
    const REAL bar = chosen[K - 1] >= 0 ? w[K - 1] : (REAL)INFINITY;
    int beaten = 0;
    for (int k = 0; k < SLOT_BLOCK; ++k) {
        const REAL ck = (1 - key_sq[k]) < margin ? margin : (1 - key_sq[k]);
        REAL gap = qsq + key_sq[k] - 2 * arg[k];
        gap = gap < 0 ? 0 : gap;
        const REAL v = 1 + 2 * gap / (cq * ck);
        arg[k] = v < amin ? amin : v;
        beaten |= arg[k] + barred[k] < bar;
    }
    if (!beaten) return;
    for (int k = 0; k < SLOT_BLOCK && s0 + k < S; ++k) {
        const REAL v = arg[k];
        if (!a->occupied[s0 + k] || (chosen[K - 1] >= 0 && !(v < w[K - 1]))) continue;
        int64_t j = K - 1;
        for (; j > 0 && (chosen[j - 1] < 0 || v < w[j - 1]); --j) {
            w[j] = w[j - 1];
            chosen[j] = chosen[j - 1];
        }
        w[j] = v;
        chosen[j] = s0 + k;
    }
}

/* Query i's softmax weights over -acosh(argument) / tau of its kept slots (0 past them) and the
   weighted sum of their values. */
static void NAME(finish_query)(const NAME(read_args) *a, int64_t i) {
    const int64_t Dv = a->value_dim, K = a->top_k;
    const REAL tau = (REAL)a->tau;
    const int64_t *chosen = a->chosen + i * K;
    REAL *w = a->weights + i * K, shift = 0, total = 0;  /* shift: the largest logit, the nearest's */
    int64_t found = 0;
    for (; found < K && chosen[found] >= 0; ++found) {
        w[found] = -acosh(w[found]) / tau;
        shift = (found == 0 || w[found] > shift) ? w[found] : shift;
    }
    for (int64_t j = 0; j < found; ++j) {
        w[j] = exp(w[j] - shift);
        total += w[j];
    }
    for (int64_t j = 0; j < K; ++j) w[j] = j < found ? w[j] / total : 0;
    REAL *m = a->m + i * Dv;
    for (int64_t v = 0; v < Dv; ++v) m[v] = 0;
    for (int64_t j = 0; j < found; ++j) {
        const REAL wj = w[j], *value = a->values + chosen[j] * Dv;
        for (int64_t v = 0; v < Dv; ++v) m[v] += wj * value[v];
    }
}

/* The gradient of query i from its read's: softmax, acosh, the clamps, the argument. */
static void NAME(read_query_backward)(const NAME(read_args) *a, int64_t i) {
    const int64_t Dk = a->key_dim, Dv = a->value_dim, K = a->top_k;
    const REAL margin = (REAL)a->margin, amin = (REAL)a->acosh_min, tau = (REAL)a->tau;
    const REAL *q = a->q + i * Dk, *gm = a->grad_m + i * Dv, *w = a->weights + i * K;
    const int64_t *chosen = a->chosen + i * K;
    REAL *g = a->grad_q + i * Dk;
    REAL gw[K], mean = 0, qsq = 0, g_qsq = 0;
#pragma omp simd reduction(+ : qsq)
    for (int64_t d = 0; d < Dk; ++d) qsq += q[d] * q[d];
    for (int64_t d = 0; d < Dk; ++d) g[d] = 0;
    const REAL cq_raw = 1 - qsq, cq = cq_raw < margin ? margin : cq_raw;
    for (int64_t j = 0; j < K && chosen[j] >= 0; ++j) {
        const REAL *value = a->values + chosen[j] * Dv;
        REAL sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t v = 0; v < Dv; ++v) sum += gm[v] * value[v];
        gw[j] = sum;
        mean += w[j] * sum;
    }
    for (int64_t j = 0; j < K && chosen[j] >= 0; ++j) {
        const REAL *key = a->keys + chosen[j] * Dk, ksq = a->key_sq[chosen[j]];
        REAL dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < Dk; ++d) dot += q[d] * key[d];
        const REAL ck = (1 - ksq) < margin ? margin : (1 - ksq), conformal = cq * ck;
        const REAL gap_raw = qsq + ksq - 2 * dot, gap = gap_raw < 0 ? 0 : gap_raw;
        const REAL arg_raw = 1 + 2 * gap / conformal, arg = arg_raw < amin ? amin : arg_raw;
        const REAL g_distance = -(w[j] * (gw[j] - mean)) / tau;
        const REAL g_arg = arg_raw >= amin ? g_distance / sqrt(arg * arg - 1) : 0;
        const REAL g_gap = gap_raw >= 0 ? g_arg * 2 / conformal : 0;
        if (cq_raw >= margin) g_qsq += g_arg * 2 * gap / (conformal * conformal) * ck;
        g_qsq += g_gap;
        for (int64_t d = 0; d < Dk; ++d) g[d] -= 2 * g_gap * key[d];
    }
    for (int64_t d = 0; d < Dk; ++d) g[d] += 2 * q[d] * g_qsq;
}

/* Each thread takes a range of queries and walks the slot blocks outside them, so a block's
   transposed keys (SLOT_BLOCK x Dk numbers) stay in the L1 cache for all of its queries (query by
   query, the keys of a 512-slot bank streamed from L2 for every query were the read's cost). */
void NAME(pssa_read_forward)(const NAME(read_args) *a, int threads) {
    const int64_t S = a->slots, P = a->padded_slots, Dk = a->key_dim, K = a->top_k;
#pragma omp parallel num_threads(threads)
    {
        /* The keys transposed, (Dk, P), their squared norms, and +inf barring free slots; zeros
           and +inf in the padding. */
#pragma omp for schedule(static)
        for (int64_t s = 0; s < P; ++s) {
            const REAL *key = a->keys + s * Dk;
            REAL sq = 0;
            for (int64_t d = 0; d < Dk; ++d) {
                const REAL value = s < S ? key[d] : 0;
                sq += value * value;
                a->keys_t[d * P + s] = value;
            }
            a->key_sq[s] = sq;
            a->barred[s] = s < S && a->occupied[s] ? 0 : (REAL)INFINITY;
        }
        const int64_t team = omp_get_num_threads(), member = omp_get_thread_num();
        const int64_t first = a->queries * member / team, stop = a->queries * (member + 1) / team;
        for (int64_t j = first * K; j < stop * K; ++j) a->chosen[j] = -1;
        for (int64_t s0 = 0; s0 < P; s0 += SLOT_BLOCK)
            for (int64_t i = first; i < stop; ++i) NAME(rank_block)(a, i, s0);
        for (int64_t i = first; i < stop; ++i) NAME(finish_query)(a, i);
    }
}

/* `memory.to_poincare_ball` of rows (rows, dim), and with grad_out its backward into grad: the
   same operations (the scale by the row's largest magnitude held constant, as its detach holds
   it), each clamp passing the gradient where its input is inside or at the bound and the
   norm's gradient 0 at norm 0, as PyTorch's do. tiny, huge: the dtype's smallest normal and
   largest finite numbers; cap: the largest ball radius. */
void NAME(pssa_ball)(const REAL *q, const REAL *grad_out, REAL *out, REAL *grad, int64_t rows, int64_t dim,
                     double tiny, double huge, double cap, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < rows; ++i) {
        const REAL *x = q + i * dim;
        REAL largest = 0, norm_sq = 0;
        for (int64_t d = 0; d < dim; ++d) largest = fabs(x[d]) > largest ? fabs(x[d]) : largest;
        largest = largest > 0 ? largest : 1;
        for (int64_t d = 0; d < dim; ++d) norm_sq += (x[d] / largest) * (x[d] / largest);
        const REAL norm = sqrt(norm_sq), held = norm < (REAL)tiny ? (REAL)tiny : norm;
        const REAL radius_raw = largest * norm, radius = radius_raw > (REAL)huge ? (REAL)huge : radius_raw;
        const REAL ball_raw = radius / (1 + radius), ball = ball_raw > (REAL)cap ? (REAL)cap : ball_raw;
        if (!grad_out) {
            for (int64_t d = 0; d < dim; ++d) out[i * dim + d] = x[d] / largest / held * ball;
            continue;
        }
        const REAL *g_out = grad_out + i * dim;
        REAL g_ball = 0, g_dir_s = 0;  /* the gradient of the radius; sum of g_direction * scaled */
        for (int64_t d = 0; d < dim; ++d) {
            g_ball += g_out[d] * (x[d] / largest / held);
            g_dir_s += g_out[d] * ball * (x[d] / largest);
        }
        const REAL g_radius = ball_raw <= (REAL)cap ? g_ball / (1 + radius) / (1 + radius) : 0;
        REAL g_norm = radius_raw <= (REAL)huge ? g_radius * largest : 0;
        if (norm >= (REAL)tiny) g_norm -= g_dir_s / (held * held);
        for (int64_t d = 0; d < dim; ++d) {
            const REAL scaled = x[d] / largest;
            const REAL g_scaled = g_out[d] * ball / held + (norm > 0 ? g_norm * scaled / norm : 0);
            grad[i * dim + d] = g_scaled / largest;
        }
    }
}

void NAME(pssa_read_backward)(const NAME(read_args) *a, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < a->queries; ++i) NAME(read_query_backward)(a, i);
}
#undef CHAINS
"""

_WRITE = r"""
typedef struct {
    const double *losses;
    const int64_t *update;
    float *confidence;
    int64_t *last_touched, *slot_count, *ring_head, *write_counts, *target;
    int64_t rows, capacity;
    double threshold, damage_rate, recovery, min_gain;
} write_args;

/* The rule over one bank's rows in order; target[r]: the slot row r's key and value go to, or
   capacity (nothing, or a later row of this write takes the slot). */
void pssa_write_rule(const write_args *a) {
    const int64_t S = a->capacity, now = a->update[0];
    int64_t count = a->slot_count[0], head = a->ring_head[0];
    for (int64_t r = 0; r < a->rows; ++r) {
        a->target[r] = S;
        const double loss = a->losses[r];
        if (!(loss > a->threshold)) continue;  /* nan never writes */
        int64_t slot;
        if (count < S) {
            slot = count++;
            a->write_counts[0] += 1;
        } else {
            slot = head;
            const double fresh = 1.0 - exp(-(double)(now - a->last_touched[slot]) / a->recovery);
            const double gain = fresh * fresh < a->min_gain ? a->min_gain : fresh * fresh;
            const double damage = a->damage_rate * loss * gain;
            if ((double)a->confidence[slot] > damage) {
                a->confidence[slot] = a->confidence[slot] - (float)damage;
                a->last_touched[slot] = now;
                a->write_counts[2] += 1;
                continue;
            }
            head = (head + 1) % S;
            a->write_counts[1] += 1;
        }
        a->confidence[slot] = 1.0f;
        a->last_touched[slot] = now;
        for (int64_t earlier = 0; earlier < r; ++earlier)
            if (a->target[earlier] == slot) a->target[earlier] = S;
        a->target[r] = slot;
    }
    a->slot_count[0] = count;
    a->ring_head[0] = head;
}

/* `PendingDreams.record`'s rule: the rows whose loss passes the threshold (nan never does), in
   row order, at ring positions recorded, recorded + 1, ... (slot: position % capacity), a row that
   a later row of the same piece would overwrite skipped; each chunk padded to chunk_len. Rows of
   tokens and targets are row_stride apart. */
void pssa_record_dreams(const double *losses, const int64_t *tokens, const int64_t *targets, int64_t rows,
                        int64_t length, int64_t row_stride, int64_t *ring_tokens, int64_t *ring_targets,
                        int64_t *recorded, int64_t capacity, int64_t chunk_len, double threshold,
                        int64_t ignore_index) {
    int64_t gated = 0;
    for (int64_t r = 0; r < rows; ++r) gated += losses[r] > threshold;
    const int64_t total = recorded[0] + gated;
    for (int64_t r = 0, position = recorded[0]; r < rows; ++r) {
        if (!(losses[r] > threshold)) continue;
        if (position >= total - capacity) {
            int64_t *slot_tokens = ring_tokens + (position % capacity) * chunk_len;
            int64_t *slot_targets = ring_targets + (position % capacity) * chunk_len;
            for (int64_t j = 0; j < chunk_len; ++j) {
                slot_tokens[j] = j < length ? tokens[r * row_stride + j] : 0;
                slot_targets[j] = j < length ? targets[r * row_stride + j] : ignore_index;
            }
        }
        ++position;
    }
    recorded[0] = total;
}

/* Row r of rows (row_bytes each) into slot target[r] of slots, where target[r] < capacity. */
void pssa_store_rows(char *slots, const char *rows, const int64_t *target, int64_t count, int64_t capacity,
                     int64_t row_bytes) {
    for (int64_t r = 0; r < count; ++r)
        if (target[r] < capacity) memcpy(slots + target[r] * row_bytes, rows + r * row_bytes, row_bytes);
}
"""


class _ReadArgs(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("q", "keys", "values", "grad_m", "occupied", "key_sq", "barred", "keys_t",
                                               "weights", "m", "grad_q", "chosen")],  # fmt: skip
        *[(name, ctypes.c_int64) for name in ("queries", "slots", "padded_slots", "key_dim", "value_dim", "top_k")],
        *[(name, ctypes.c_double) for name in ("tau", "margin", "acosh_min")],
    ]


class _WriteArgs(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("losses", "update", "confidence", "last_touched", "slot_count",
                                               "ring_head", "write_counts", "target")],  # fmt: skip
        *[(name, ctypes.c_int64) for name in ("rows", "capacity")],
        *[(name, ctypes.c_double) for name in ("threshold", "damage_rate", "recovery", "min_gain")],
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The read's and write rule's library, or None (`native.load`): then PyTorch's code runs."""
    source = "#include <stdint.h>\n#include <string.h>\n#include <omp.h>\n#include <tgmath.h>\n"
    source += f"#define SLOT_BLOCK {SLOT_BLOCK}\n"
    source += native.typed_source(_READ_BODY) + _WRITE
    read = [ctypes.POINTER(_ReadArgs), ctypes.c_int]
    signatures = {f"pssa_read_{way}_{kind}": read for way in ("forward", "backward") for kind in ("f32", "f64")}
    ball = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_double] * 3 + [ctypes.c_int]
    signatures.update({f"pssa_ball_{kind}": ball for kind in ("f32", "f64")})
    signatures["pssa_write_rule"] = [ctypes.POINTER(_WriteArgs)]
    signatures["pssa_store_rows"] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64]  # fmt: skip
    signatures["pssa_record_dreams"] = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + [
        ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_int64]  # fmt: skip
    return native.load("pssa_memory", source, signatures, "memory read and write")


def read_forward(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    occupied: torch.Tensor,
    tau: float,
    top_k: int,
    margin: float,
    acosh_min: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous q (Nq, Dk), keys (S, Dk), values (S, Dv) of one dtype and occupied (S,) bool
    -> m (Nq, Dv), chosen (Nq, k) int64 (-1: no slot), weights (Nq, k) and the keys' squared
    norms (padded to whole blocks), which the backward takes."""
    queries, key_dim = q.shape
    slots, value_dim = values.shape
    m = q.new_empty((queries, value_dim))
    chosen = torch.empty((queries, top_k), dtype=torch.int64)
    weights = q.new_empty((queries, top_k))
    padded = -(-slots // SLOT_BLOCK) * SLOT_BLOCK
    key_sq, barred, keys_t = q.new_empty(padded), q.new_empty(padded), q.new_empty((key_dim, padded))
    args = _ReadArgs(
        q=q.data_ptr(), keys=keys.data_ptr(), values=values.data_ptr(), occupied=occupied.data_ptr(),
        key_sq=key_sq.data_ptr(), barred=barred.data_ptr(), keys_t=keys_t.data_ptr(), weights=weights.data_ptr(), m=m.data_ptr(),
        chosen=chosen.data_ptr(), queries=queries, slots=slots, padded_slots=padded, key_dim=key_dim,
        value_dim=value_dim, top_k=top_k, tau=tau, margin=margin, acosh_min=acosh_min,
    )  # fmt: skip
    getattr(lib, "pssa_read_forward_" + native.suffix(q.dtype))(ctypes.byref(args), torch.get_num_threads())
    return m, chosen, weights, key_sq


def read_backward(
    lib: ctypes.CDLL,
    saved: tuple[torch.Tensor, ...],
    grad_m: torch.Tensor,
    tau: float,
    margin: float,
    acosh_min: float,
) -> torch.Tensor:
    """saved = (q, keys, values, chosen, weights, key_sq) as the forward had them and returned
    them; grad_m (Nq, Dv) contiguous in q's dtype -> the gradient of q (Nq, Dk)."""
    q, keys, values, chosen, weights, key_sq = saved
    queries, key_dim = q.shape
    slots, value_dim = values.shape
    grad_q = torch.empty_like(q)
    args = _ReadArgs(
        q=q.data_ptr(), keys=keys.data_ptr(), values=values.data_ptr(), grad_m=grad_m.data_ptr(),
        key_sq=key_sq.data_ptr(), weights=weights.data_ptr(), chosen=chosen.data_ptr(), grad_q=grad_q.data_ptr(),
        queries=queries, slots=slots, key_dim=key_dim, value_dim=value_dim, top_k=chosen.shape[1], tau=tau,
        margin=margin, acosh_min=acosh_min,
    )  # fmt: skip
    getattr(lib, "pssa_read_backward_" + native.suffix(q.dtype))(ctypes.byref(args), torch.get_num_threads())
    return grad_q


def ball(lib: ctypes.CDLL, q: torch.Tensor, grad_out: torch.Tensor | None, cap: float) -> torch.Tensor:
    """Contiguous q (rows, dim) -> its map into the ball (radius at most cap); with grad_out (the
    map's gradient, contiguous, q's dtype) the gradient of q instead."""
    rows, dim = q.shape
    result = torch.empty_like(q)
    info = torch.finfo(q.dtype)
    out, grad = (None, result) if grad_out is not None else (result, None)
    getattr(lib, "pssa_ball_" + native.suffix(q.dtype))(
        q.data_ptr(), native.pointer(grad_out), native.pointer(out), native.pointer(grad), rows, dim,
        info.tiny, info.max, cap, torch.get_num_threads(),
    )  # fmt: skip
    return result


def write_rule(
    lib: ctypes.CDLL,
    rule_numbers: tuple[float, float, float, float],
    losses: torch.Tensor,
    update: torch.Tensor,
    state: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """One bank's rule, in place on its state = (confidence (S,) float32, last_touched (S,),
    slot_count (1,), ring_head (1,), write_counts (3,)) int64; rule_numbers = (loss threshold,
    damage rate, recovery updates, minimum gain); losses (R,) float64, update (1,) int64, all
    contiguous CPU tensors -> (R,) int64 target slot of each row (capacity: none)."""
    confidence, last_touched, slot_count, ring_head, write_counts = state
    target = torch.empty(losses.shape[0], dtype=torch.int64)
    threshold, damage_rate, recovery, min_gain = rule_numbers
    args = _WriteArgs(
        losses=losses.data_ptr(), update=update.data_ptr(), confidence=confidence.data_ptr(),
        last_touched=last_touched.data_ptr(), slot_count=slot_count.data_ptr(), ring_head=ring_head.data_ptr(),
        write_counts=write_counts.data_ptr(), target=target.data_ptr(), rows=losses.shape[0],
        capacity=confidence.shape[0], threshold=threshold, damage_rate=damage_rate, recovery=recovery,
        min_gain=min_gain,
    )  # fmt: skip
    lib.pssa_write_rule(ctypes.byref(args))
    return target


def stored(lib: ctypes.CDLL, slots: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A copy of slots (S, D) with row r of rows (R, D) in slot target[r] where target[r] < S:
    out of place, so a read's autograd graph that saved the old tensor keeps it."""
    result = slots.clone()
    rows = rows.detach().to(slots.dtype).contiguous()
    lib.pssa_store_rows(result.data_ptr(), rows.data_ptr(), target.data_ptr(), rows.shape[0], slots.shape[0],
                        rows.shape[1] * rows.element_size())  # fmt: skip
    return result


def record_dreams(
    lib: ctypes.CDLL,
    ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    losses: torch.Tensor,
    threshold: float,
    ignore_index: int,
) -> None:
    """`PendingDreams.record` in place on ring = (tokens (capacity + 1, chunk_len), targets of
    that shape, recorded (1,)), all int64 CPU tensors; tokens and targets (R, L) int64, losses (R,)."""
    ring_tokens, ring_targets, recorded = ring
    if tokens.stride() != targets.stride() or tokens.stride(1) != 1:
        tokens, targets = tokens.contiguous(), targets.contiguous()
    losses = losses.detach().to(torch.float64).contiguous()
    lib.pssa_record_dreams(
        losses.data_ptr(), tokens.data_ptr(), targets.data_ptr(), tokens.shape[0], tokens.shape[1],
        tokens.stride(0), ring_tokens.data_ptr(), ring_targets.data_ptr(), recorded.data_ptr(),
        ring_tokens.shape[0] - 1, ring_tokens.shape[1], threshold, ignore_index,
    )  # fmt: skip
