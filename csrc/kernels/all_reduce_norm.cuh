/*
 * The fused all-reduce + residual add + RMSNorm family in one launch (packet
 * path), for the row counts of decode: what a transformer layer runs around
 * its row-parallel matmul's all-reduce, with the adds and norms folded in.
 * The pattern (tpc_norm_pattern, tpcomm.h) is a template parameter: one
 * source, one instantiation per pattern, which launch.cu picks from the
 * args. A runtime branch would be uniform over the grid as well, but each
 * instantiation keeps only its own pattern's live values in registers (the
 * kernel already runs at its register cap: tests/test_kernel_resources.py)
 * and carries none of the others' code.
 *
 * One block per row (blocks stride over the rows). Every rank pushes its row
 * as packets into every peer's slot, exactly as the all-reduce packet kernel
 * does. With fewer rows than the launch has blocks ("spread": decode's 1 to
 * 8 rows), every block pushes a contiguous share of all rows' packets first,
 * because one multiprocessor's remote stores saturate early, and only the
 * first `rows` blocks go on to reduce; the launch spreads only when no output
 * is the input, since a reducing block may write out before another block
 * has read that input to push it. Then each data thread sums its units over
 * the ranks in fp32 in rank order (s) and keeps the values in registers.
 * With r the residual, m the residual scale and w' = w + weight_offset, all
 * in fp32, norm is the pattern's RMSNorm v * rsqrt(mean(v^2) + eps) * w' or
 * LayerNorm (v - mean(v)) * rsqrt(mean((v - mean(v))^2) + eps) * w' + b
 * (an absent weight loads as 1 and an absent bias as -0: both exact no-ops):
 *   ADD_NORM, ADD_LAYER_NORM  z = r + m*s;  out = round(norm(z)), out2 = round(z)
 *   NORM_ADD, LAYER_NORM_ADD  o = r + m*norm(s);  out = out2 = round(o)
 *   NORM_ADD_NORM, LAYER_NORM_ADD_LAYER_NORM
 *                             o as above;  out = round(norm_next(o)), out2 = round(o)
 * Each block sums in a fixed order (tpc_block_sum: a butterfly per warp,
 * then the warps in index order): the squares (RMSNorm), or the values and
 * then their squared distances from that mean, from registers (LayerNorm).
 * So every rank with the same residual computes the same bits. Nothing is
 * rounded before the outputs: each is the fp32 reference
 * (tpcomm.reference.reference_all_reduce_norm) rounded once; m*s is
 * tpc_mul_rn and every other add after a product tpc_add_rn, so that the
 * compiler does not contract them into an fma the reference does not do
 * (m = 1 multiplies exactly: the bits of no m). A thread reads and writes only its own units, and writes them last, so
 * out may be the input and out2 the residual (the in-place variant).
 *
 * 16-bit dtypes only: a unit holds 4 values. DTYPE (TPC_FLOAT16 or
 * TPC_BFLOAT16), a template parameter like the pattern and the epilogue, so
 * that each conversion is the one instruction of its dtype rather than both
 * behind a test of a.dtype on every value. A row holds at most
 * TPC_NORM_MAX_ROW_BYTES (tpcomm.h): TPC_NORM_THREADS data threads with
 * TPC_NORM_UNITS units each. UNITS, a template parameter like the pattern,
 * is the units a thread holds in registers: TPC_NORM_UNITS, or
 * TPC_NORM_FEW_UNITS where the row needs no more (launch.cu picks), which
 * keeps every instantiation within its register cap without spilling.
 */
#ifndef TPCOMM_ALL_REDUCE_NORM_CUH
#define TPCOMM_ALL_REDUCE_NORM_CUH

#include "reduce.cuh"

#define TPC_NORM_THREADS 512 /* data threads per block at most */
#define TPC_NORM_UNITS 8     /* packet units per data thread at most: z in 32 registers */
#define TPC_NORM_FEW_UNITS 4 /* the instantiation for rows of at most 2048 units (8192 16-bit values) */

#include "norm_fp8.cuh" /* the FP8 epilogue */

/* Phase marks, empty in the library: benchmarks/norm_fp8_probe.cu's phase
 * build defines them to clock block 0's first row through the kernel. */
#ifndef TPC_NORM_MARK
#define TPC_NORM_MARK_START
#define TPC_NORM_MARK(phase, first_row)
#endif

#if defined(__cplusplus)
static_assert(TPC_NORM_THREADS * TPC_NORM_UNITS * TPC_PACKET_DATA_BYTES == TPC_NORM_MAX_ROW_BYTES,
              "the kernel's row capacity is what tpcomm.h announces");
#endif

/* The sum of v over the block's data warps, the same bits in every data
 * thread; every thread of the block calls it, `call` counting its calls in
 * the op (the same in every thread). Also a barrier: returns in *broken
 * whether any thread of the block has failed. The partial sums alternate
 * between two halves by call: one call's reads and the next call's writes
 * touch different halves, and the call after that writes this half only after
 * the next call's barrier, which every thread reaches after its reads here.
 * So one barrier a call orders every reuse. The control warp only meets the
 * barrier (it gets 0): it writes no output, so it needs no sum, and it
 * touches no partial, since racecheck reported its accesses against the
 * data warps' (docs/testing.md). Its v was +0, the last term: leaving it
 * out changes no bit (no partial sum here is -0). */
TPC_DEVICE float tpc_block_sum(float v, int failed, int *broken, unsigned call) {
  __shared__ float partial[2][1024 / 32];
  float *half = partial[call & 1u];
  const unsigned warp = threadIdx.x / TPC_WARP_LANES, data_warps = tpc_data_warps();
  v = tpc_warp_sum(v);
  if (threadIdx.x % TPC_WARP_LANES == 0 && warp < data_warps) half[warp] = v;
  *broken = __syncthreads_or(failed);
  float sum = 0.0f;
  if (warp >= data_warps) return sum;
  for (unsigned w = 0; w < data_warps; ++w) sum += half[w];
  return sum;
}

/* Refused: both outputs are NaN (tpc_op_refuse fills out), nothing else
 * touched. Apart from tpc_op_refuse, so that the other kernels' cold path
 * carries no second output. */
TPC_COLD void tpc_norm_refuse(const tpc_kernel_args *a, uint32_t refused, uint32_t epoch) {
  tpc_op_refuse(a, refused, epoch);
  if (!a->quant) {
    tpc_poison_fill(a, a->out2, a->nbytes);
    return;
  }
  /* the FP8 epilogue: out holds the codes (e4m3's NaN); the 16-bit outputs take the dtype's */
  uint32_t *outs[2] = {(uint32_t *)a->out2, (uint32_t *)a->out3};
  for (int i = 0; i < 2; ++i)
    for (uint64_t w = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; outs[i] && w < a->nbytes / 4;
         w += (uint64_t)gridDim.x * blockDim.x)
      outs[i][w] = (uint32_t)(w & 1u ? a->poison2 >> 32 : a->poison2);
  tpc_fp8_refuse_scales(a);
}

/* The 4 fp32 values of a unit of a 16-bit row (weight or residual) plus `add`:
 * -0.0f adds nothing (-0 + v is v exactly, signed zeros included). */
TPC_DEVICE void tpc_norm_load(const void *row, uint64_t u, int dtype, float add, float *v) {
  const uint2 raw = ((const uint2 *)row)[u];
  const uint32_t words[2] = {raw.x, raw.y};
  for (int j = 0; j < 4; ++j) v[j] = add;
  tpc_accumulate(v, words, 2, dtype);
}

/* tpc_norm_load of a LayerNorm's optional vector: `absent` where row is NULL
 * (a uniform branch: the pointer is the launch's). */
TPC_DEVICE void tpc_norm_vector(const void *row, uint64_t u, int dtype, float add, float absent, float *v) {
  if (!row) {
    for (int j = 0; j < 4; ++j) v[j] = absent;
    return;
  }
  tpc_norm_load(row, u, dtype, add, v);
}

/* Unit u's w' and b of a norm: RMSNorm reads its weight (b unused); a
 * LayerNorm's absent weight is 1 (weight_offset is then 0) and absent bias
 * -0, so that y * w' + b is y exactly. */
template <int DTYPE, bool LAYER>
TPC_DEVICE void tpc_norm_affine(const tpc_kernel_args &a, const void *weight, const void *bias, uint64_t u, float *w,
                                float *b) {
  if (LAYER) {
    tpc_norm_vector(weight, u, DTYPE, a.weight_offset, 1.0f, w);
    tpc_norm_vector(bias, u, DTYPE, -0.0f, -0.0f, b);
  } else {
    tpc_norm_load(weight, u, DTYPE, a.weight_offset, w);
    for (int j = 0; j < 4; ++j) b[j] = -0.0f;
  }
}

/* One value of the norm: v * scale * w (RMSNorm) or (v - mean) * scale * w + b
 * (LayerNorm), in the reference's order. */
template <bool LAYER>
TPC_DEVICE float tpc_norm_value(float v, float mean, float scale, float w, float b) {
  return LAYER ? tpc_add_rn((v - mean) * scale * w, b) : v * scale * w;
}

/* A LayerNorm's rsqrt(mean((v - mean)^2) + eps), with *mean = mean(v), over
 * this thread's valid units of v: two block sums, the values and then their
 * squared distances from the mean, from registers. Every thread of the block
 * calls it; *broken as tpc_block_sum's. (An RMSNorm sums its squares in the
 * loop that makes v.) */
template <int UNITS>
TPC_DEVICE float tpc_layer_norm_scale(const float (&v)[UNITS][4], unsigned t, unsigned data_threads,
                                      uint64_t row_units, float inv_n, float eps, int failed, int *broken,
                                      unsigned *sums, float *mean) {
  float part = 0.0f;
#pragma unroll
  for (int k = 0; k < UNITS; ++k)
    if (t < data_threads && t + (uint64_t)k * data_threads < row_units)
      for (int j = 0; j < 4; ++j) part += v[k][j];
  int broken_mean = 0;
  *mean = tpc_block_sum(part, failed, &broken_mean, (*sums)++) * inv_n;
  part = 0.0f;
#pragma unroll
  for (int k = 0; k < UNITS; ++k)
    if (t < data_threads && t + (uint64_t)k * data_threads < row_units)
      for (int j = 0; j < 4; ++j) {
        const float d = v[k][j] - *mean;
        part += d * d;
      }
  const float total = tpc_block_sum(part, failed, broken, (*sums)++);
  *broken |= broken_mean;
  return rsqrtf(total * inv_n + eps);
}

/* The launch bound caps registers so that a full block (17 warps) fits: the
 * register file is split over 4 schedulers, so 98 registers a thread, what
 * the compiler picks unbounded, allow only 16 warps (launch error 701;
 * tests/test_kernel_resources.py checks every kernel against its block). */
/* The stream output's poison: the dtype's NaN (poison is e4m3's under an epilogue). */
template <int QUANT>
TPC_DEVICE uint2 tpc_norm_poison2(const tpc_kernel_args &a) {
  return QUANT == TPC_QUANT_NONE ? tpc_poison8(&a) : make_uint2((uint32_t)a.poison2, (uint32_t)(a.poison2 >> 32));
}

/* The normed words n of unit u: written to out (no epilogue), or to out3
 * where asked and kept in x for the FP8 epilogue (QUANT). */
template <int DTYPE, int QUANT>
TPC_DEVICE void tpc_norm_put(const tpc_kernel_args &a, uint64_t unit, const uint32_t *n, int broken, float *x,
                             uint32_t *amax) {
  if (QUANT == TPC_QUANT_NONE) {
    ((uint2 *)a.out)[unit] = broken ? tpc_poison8(&a) : make_uint2(n[0], n[1]);
    return;
  }
  if (a.out3) ((uint2 *)a.out3)[unit] = broken ? tpc_norm_poison2<QUANT>(a) : make_uint2(n[0], n[1]);
  tpc_fp8_keep<QUANT>(n, DTYPE, x, amax);
}

/* Every unit of this thread: the norm of v (with this weight, bias, mean and
 * scale) to the normed output, v itself rounded to the stream output. */
template <int DTYPE, bool LAYER, int QUANT, int UNITS>
TPC_DEVICE void tpc_norm_write(const tpc_kernel_args &a, const void *weight, const void *bias, float (&v)[UNITS][4],
                               float mean, float scale, uint64_t base,
                               uint64_t row_units, unsigned t, unsigned data_threads, int broken, uint32_t *amax) {
#pragma unroll
  for (int k = 0; k < UNITS; ++k) {
    const uint64_t u = t + (uint64_t)k * data_threads;
    if (t >= data_threads || u >= row_units) continue;
    float w[4], b[4], normed[4];
    tpc_norm_affine<DTYPE, LAYER>(a, weight, bias, u, w, b);
    for (int j = 0; j < 4; ++j) normed[j] = tpc_norm_value<LAYER>(v[k][j], mean, scale, w[j], b[j]);
    uint32_t n[2], s[2];
    tpc_round(normed, n, 2, DTYPE);
    tpc_round(v[k], s, 2, DTYPE);
    ((uint2 *)a.out2)[base + u] = broken ? tpc_norm_poison2<QUANT>(a) : make_uint2(s[0], s[1]);
    tpc_norm_put<DTYPE, QUANT>(a, base + u, n, broken, v[k], amax);
  }
}

template <int DTYPE, int PATTERN, int QUANT, int UNITS>
__global__ void __launch_bounds__(TPC_NORM_THREADS + TPC_CONTROL_THREADS)
    tpc_all_reduce_norm_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  constexpr bool layer = PATTERN >= TPC_PATTERN_ADD_LAYER_NORM;
  constexpr bool add_first = PATTERN == TPC_PATTERN_ADD_NORM || PATTERN == TPC_PATTERN_ADD_LAYER_NORM;
  constexpr bool second = PATTERN == TPC_PATTERN_NORM_ADD_NORM || PATTERN == TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM;
  TPC_NORM_MARK_START;
  tpc_packet_start p;
  if (!tpc_packet_prologue(&a, 0, tpc_no_prefetch(), &p, tpc_norm_refuse)) return;
  TPC_NORM_MARK(0, true);
  tpc_op &op = p.op;
  const int folded = p.folded;

  const unsigned data_threads = blockDim.x - TPC_CONTROL_THREADS;
  const unsigned t = threadIdx.x; /* a data thread when t < data_threads */
  const uint64_t row_units = a.row_bytes / TPC_PACKET_DATA_BYTES;
  const uint64_t rows = a.nbytes / a.row_bytes;
  const float inv_n = 1.0f / (float)(row_units * 4);
  const float m = a.residual_scale;
  const uint2 *in = (const uint2 *)a.in, *residual = (const uint2 *)a.residual;
  uint2 *out2 = (uint2 *)a.out2;
  const int spread = gridDim.x > rows; /* the same in every block */
  /* the FP8 epilogue's given scale: an input no op writes, loaded before the
   * exchange so that its latency hides behind it */
  const float tensor_scale = QUANT == TPC_QUANT_PER_TENSOR ? a.scales[0] : 0.0f;

  if (spread && t < data_threads) {
    const uint64_t total = rows * row_units, share = (total + gridDim.x - 1) / gridDim.x;
    const uint64_t end = (blockIdx.x + 1) * share < total ? (blockIdx.x + 1) * share : total;
    for (uint64_t u = blockIdx.x * share + t; u < end; u += data_threads) {
      const uint2 v = in[u];
      tpc_packet_push(&a, op.epoch, u, [&](int) { return v; });
    }
  }

  unsigned sums = 0; /* tpc_block_sum's calls */
  for (uint64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint64_t base = row * row_units;
    if (!spread && t < data_threads)
      for (uint64_t u = t; u < row_units; u += data_threads) {
        const uint2 v = in[base + u];
        tpc_packet_push(&a, op.epoch, base + u, [&](int) { return v; });
      }

    /* v: z (add_first) or s, then o; what the first norm normalises */
    float v[UNITS][4];
    float squares = 0.0f; /* an RMSNorm's */
#pragma unroll
    for (int k = 0; k < UNITS; ++k) {
      const uint64_t u = t + (uint64_t)k * data_threads;
      for (int j = 0; j < 4; ++j) v[k][j] = 0.0f;
      if (t >= data_threads || u >= row_units) continue;
      tpc_accumulate_packet_in_turn(&op, &a, in[base + u], base + u, folded, v[k], DTYPE);
      if (add_first) { /* m*s rounded, then + r */
        for (int j = 0; j < 4; ++j) v[k][j] = tpc_mul_rn(m, v[k][j]);
        const uint2 r = residual[base + u];
        const uint32_t words[2] = {r.x, r.y};
        tpc_accumulate(v[k], words, 2, DTYPE);
      }
      if (!layer)
        for (int j = 0; j < 4; ++j) squares += v[k][j] * v[k][j];
    }

    TPC_NORM_MARK(1, row == blockIdx.x);
    int broken = 0;
    float mean = 0.0f;
    const float scale = layer ? tpc_layer_norm_scale(v, t, data_threads, row_units, inv_n, a.eps, op.failed, &broken,
                                                     &sums, &mean)
                              : rsqrtf(tpc_block_sum(squares, op.failed, &broken, sums++) * inv_n + a.eps);
    TPC_NORM_MARK(2, row == blockIdx.x);
    uint32_t amax = 0; /* the FP8 epilogue's maximum |x| (bits) over this thread's units of the row */
    if constexpr (add_first) {
      tpc_norm_write<DTYPE, layer, QUANT, UNITS>(a, a.weight, a.bias, v, mean, scale, base, row_units, t, data_threads,
                                                 broken, &amax);
    } else {
      /* o = r + m * norm(s), kept in v */
      float squares2 = 0.0f; /* an RMSNorm's, of o */
#pragma unroll
      for (int k = 0; k < UNITS; ++k) {
        const uint64_t u = t + (uint64_t)k * data_threads;
        if (t >= data_threads || u >= row_units) continue;
        float w[4], b[4], r[4];
        tpc_norm_affine<DTYPE, layer>(a, a.weight, a.bias, u, w, b);
        tpc_norm_load(residual, base + u, DTYPE, -0.0f, r);
        for (int j = 0; j < 4; ++j)
          v[k][j] = tpc_add_rn(r[j], m * tpc_norm_value<layer>(v[k][j], mean, scale, w[j], b[j]));
        if constexpr (!second) {
          uint32_t o[2];
          tpc_round(v[k], o, 2, DTYPE);
          out2[base + u] = broken ? tpc_norm_poison2<QUANT>(a) : make_uint2(o[0], o[1]);
          tpc_norm_put<DTYPE, QUANT>(a, base + u, o, broken, v[k], &amax);
        } else if (!layer) {
          for (int j = 0; j < 4; ++j) squares2 += v[k][j] * v[k][j];
        }
      }
      if constexpr (second) {
        /* the second norm, over o, in the same fixed order */
        int broken2 = 0;
        float mean2 = 0.0f;
        const float scale2 =
            layer ? tpc_layer_norm_scale(v, t, data_threads, row_units, inv_n, a.next_eps, op.failed, &broken2, &sums,
                                         &mean2)
                  : rsqrtf(tpc_block_sum(squares2, op.failed, &broken2, sums++) * inv_n + a.next_eps);
        broken |= broken2;
        tpc_norm_write<DTYPE, layer, QUANT, UNITS>(a, a.next_weight, a.next_bias, v, mean2, scale2, base, row_units, t,
                                                   data_threads, broken, &amax);
      }
    }
    TPC_NORM_MARK(3, row == blockIdx.x);
    if (QUANT != TPC_QUANT_NONE)
      tpc_fp8_emit<QUANT, UNITS>(a, v, amax, tensor_scale, row, base, row_units, t, data_threads, broken);
    TPC_NORM_MARK(4, row == blockIdx.x);
  }
  TPC_NORM_MARK(5, true);
  tpc_op_end(&a, &op, TPC_NOT_BULK);
  TPC_NORM_MARK(6, true);
}

#endif /* TPCOMM_ALL_REDUCE_NORM_CUH */
