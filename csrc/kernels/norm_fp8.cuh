/*
 * The FP8 epilogue of the fused norm family (tpc_norm_quant, tpcomm.h): the
 * normed output, rounded to the input's dtype and read back in fp32 (x, exact),
 * quantized to e4m3 codes with a scale per tensor (given), per row or per
 * TPC_FP8_GROUP values of a row (computed, written). The kernel calls
 * tpc_fp8_keep on each unit as it rounds the normed values, then
 * tpc_fp8_emit once per row with every thread of the block.
 *
 * The absolute maximum: a thread's by max.NaN (tpc_absmax2), a warp's and a
 * block's over the bits of those maxima: without a sign bit the unsigned
 * order is the float order, with inf above every finite value and NaN above
 * inf, so a NaN anywhere makes the maximum NaN (torch.amax propagates NaN)
 * and the order of the reduction cannot change the result.
 * Each group of a row is one warp's 32 units in one step k: the data threads
 * are a multiple of 32 and a unit holds 4 values, so units [32g, 32g + 32)
 * are lanes 0-31 of one warp at one k.
 */
#ifndef TPCOMM_NORM_FP8_CUH
#define TPCOMM_NORM_FP8_CUH

#include "fp8_quotient.cuh"

#define TPC_FP8_MAX 448.0f

/* A thread's units are steps 0 .. n-1 of its row. Past them, the
 * instantiations of up to TPC_NORM_FEW_UNITS units leave the unrolled loop,
 * which saves the remaining steps' tests; the larger one skips each
 * remaining step instead (leaving made it spill more), as clang (HIP) does
 * everywhere: it unrolls no loop with an exit. */
#ifdef TPC_HIP
#define TPC_FP8_LEAVES(UNITS) false
#else
#define TPC_FP8_LEAVES(UNITS) ((UNITS) <= TPC_NORM_FEW_UNITS)
#endif
#define TPC_FP8_PAST_UNITS(UNITS)          \
  {                                        \
    if constexpr (TPC_FP8_LEAVES(UNITS))   \
      break;                               \
    else                                   \
      continue;                            \
  }

#if defined(__cplusplus)
static_assert(TPC_FP8_GROUP == 32 * 4, "a group is one warp's units at one step: 32 lanes of 4 values");
#endif

/* The maximum of v over the block, the same in every data thread; every
 * thread of the block calls it, once a row. One barrier: the next call's
 * writes of `partial` come after the next row's tpc_block_sum, a barrier
 * every thread reaches after its reads here. The control warp touches no
 * partial (it gets 0), as in tpc_block_sum. Each data warp takes the
 * partials' maximum in one step: lane i reads partial i, or partial 0 past
 * the data warps (at most 32: 1024 threads in warps of 32, or of 64). */
TPC_DEVICE uint32_t tpc_block_max_u32(uint32_t v) {
  __shared__ uint32_t partial[1024 / 32];
  const unsigned warp = threadIdx.x / TPC_WARP_LANES, data_warps = tpc_data_warps(), i = threadIdx.x % 32;
  v = tpc_max32_u32(v);
  if (threadIdx.x % TPC_WARP_LANES == 0 && warp < data_warps) partial[warp] = v;
  __syncthreads();
  if (warp >= data_warps) return 0;
  return tpc_max32_u32(partial[i < data_warps ? i : 0]);
}

/* The bits of the largest |x| of a unit, NaN winning: tpc_absmax2, one
 * max.NaN a value on sm_80+ with |x| an operand modifier. A NaN gives a NaN
 * (its payload is not the input's; only its NaN-ness is read), anything
 * else the largest magnitude, +0 for zeros. */
TPC_DEVICE uint32_t tpc_fp8_unit_absmax(const float *x) {
  float a = tpc_absmax2(fabsf(x[0]), x[1]);
  a = tpc_absmax2(a, x[2]);
  return __float_as_uint(tpc_absmax2(a, x[3]));
}

/* The rounded normed words of a unit back into x (exact) and, for a scale
 * per tensor or row, |x|'s bits into *amax: this thread's maximum (a
 * group's is its warp's, taken in tpc_fp8_emit_groups). */
template <int QUANT>
TPC_DEVICE void tpc_fp8_keep(const uint32_t *words, int dtype, float *x, uint32_t *amax) {
  tpc_start(x, words, 2, dtype);
  if constexpr (QUANT == TPC_QUANT_PER_TENSOR || QUANT == TPC_QUANT_PER_TOKEN)
    *amax = __float_as_uint(tpc_absmax2(__uint_as_float(*amax), __uint_as_float(tpc_fp8_unit_absmax(x))));
}

/* The dynamic scale of an absolute maximum: max(amax / 448, floor), NaN kept
 * (a NaN compares false). The quotient of a maximum in [2^-64, FLT_MAX]
 * comes from 1 / 448 and a correction (tpc_quant_div_by, checked for every
 * such value by benchmarks/quant_identity.cu); zeros, smaller values, inf
 * and NaN divide. The branch is uniform over the row's block or the group's
 * warp, which share the maximum. */
TPC_DEVICE float tpc_fp8_scale(uint32_t amax, float floor) {
  const float a = __uint_as_float(amax);
  const float s = a >= TPC_QUANT_TINY && a <= 0x1.fffffep127f ? tpc_quant_div_by<TPC_QUANT_FP8>(a) : a / TPC_FP8_MAX;
  return s < floor ? floor : s;
}

/* e4m3 codes of x / s, 4 values in a word (value j in byte j); NaN to 0x7f
 * (the conversion's saturation would otherwise clamp it). r and fast as
 * tpc_fp8_quotient takes them. */
TPC_DEVICE uint32_t tpc_fp8_codes(const float *x, float s, float r, int fast) {
  float q[4];
  for (int j = 0; j < 4; ++j) q[j] = tpc_fp8_quotient(x[j], s, r, fast);
  uint32_t c = tpc_e4m3x2_of(q[0], q[1]) | tpc_e4m3x2_of(q[2], q[3]) << 16;
  for (int j = 0; j < 4; ++j)
    if (q[j] != q[j]) c = (c & ~(0xffu << (8 * j))) | 0x7fu << (8 * j);
  return c;
}

/* Whether every x under a maximum |x| of bits amax has a finite quotient
 * x * r, so that tpc_fp8_codes_finite may code it (fast: s's). A NaN or
 * infinite maximum, or a scale that is not fast, is not. */
TPC_DEVICE int tpc_fp8_finite(uint32_t amax, float r, int fast) {
  return fast && __fmul_rn(__uint_as_float(amax), r) <= 0x1.fffffep127f;
}

/* tpc_fp8_codes where tpc_fp8_finite holds for x: no NaN to mend and no
 * quotient past the floats, so each value is tpc_fp8_quotient_finite's. */
TPC_DEVICE uint32_t tpc_fp8_codes_finite(const float *x, float s, float r) {
  float q[4];
  for (int j = 0; j < 4; ++j) q[j] = tpc_fp8_quotient_finite(x[j], s, r, __fmul_rn(x[j], r));
  return tpc_e4m3x2_of(q[0], q[1]) | tpc_e4m3x2_of(q[2], q[3]) << 16;
}

/* The codes of x, finite's or not (tpc_fp8_finite(m, r, fast)); NaN bytes
 * where the op failed. */
TPC_DEVICE uint32_t tpc_fp8_unit_codes(const float *x, float s, float r, int fast, uint32_t m, int broken) {
  return broken                        ? (uint32_t)TPC_E4M3_NAN_BYTES
         : tpc_fp8_finite(m, r, fast) ? tpc_fp8_codes_finite(x, s, r)
                                      : tpc_fp8_codes(x, s, r, fast);
}

/* Codes and scales of one row's groups (TPC_QUANT_PER_TOKEN_GROUP), by the
 * data threads. Group k of a warp is its 32 units at step k, so its maximum
 * is one warp reduction, the same in every lane. The scale and reciprocal of
 * a group are the same arithmetic in every lane: lane k computes group k's
 * and writes its scale, and the warp reads them with a shuffle each, one
 * scale computation for the warp's groups instead of one a group. A
 * thread's units are steps 0 .. n-1, n the same over the warp (the row's
 * units are a multiple of 32), so every lane takes every shuffle it reaches
 * and none past n (TPC_FP8_PAST_UNITS). */
template <int UNITS>
TPC_DEVICE void tpc_fp8_emit_groups(const tpc_kernel_args &a, float (*x)[4], uint64_t row, uint64_t base,
                                    uint64_t row_units, unsigned t, unsigned data_threads, int broken) {
  static_assert(UNITS <= 32, "lane k takes group k");
  if (t >= data_threads || t >= row_units) return; /* no unit in this row: the whole warp */
  const unsigned lane = t % 32, left = (unsigned)(row_units - t); /* rows hold at most 4096 units */
  /* lane k's maximum: group k's where step k holds one, else group 0's
   * again (unused), so that no lane's scale takes another path than a
   * group's would (a maximum of 0 would divide) */
  uint32_t m[UNITS] = {}, own = 0;
#pragma unroll
  for (int k = 0; k < UNITS; ++k) {
    if ((unsigned)k * data_threads >= left) TPC_FP8_PAST_UNITS(UNITS)
    m[k] = tpc_max32_u32(tpc_fp8_unit_absmax(x[k]));
    if (k == 0 || lane == (unsigned)k) own = m[k];
  }
  const float own_s = broken ? __uint_as_float(0x7fc00000u) : tpc_fp8_scale(own, a.scale_floor);
  const float own_r = tpc_fp8_reciprocal(own_s);
  /* r's sign: + where the group's values all take the finite path (tpc_fp8_finite), - elsewhere
   * (a NaN r, of a failed op, is not > 0 either), so that a unit tests one comparison */
  const float own_rs = tpc_fp8_finite(own, own_r, tpc_fp8_fast_scale(own_s)) ? own_r : -own_r;
  /* lane k's unit at step k is t + k * data_threads, in group warp + k * data_warps */
  if (lane < UNITS && lane * data_threads < left)
    a.scales[row * a.scale_row_stride +
             (uint64_t)(t / 32 + lane * (data_threads / 32)) * a.scale_group_stride] = own_s;
  uint32_t *codes = (uint32_t *)a.out + base + t;
#pragma unroll
  for (int k = 0; k < UNITS; ++k) {
    if ((unsigned)k * data_threads >= left) TPC_FP8_PAST_UNITS(UNITS)
    const float s = tpc_shfl32_float(own_s, k), r = tpc_shfl32_float(own_rs, k);
    codes[k * data_threads] = r > 0.0f ? tpc_fp8_codes_finite(x[k], s, r)
                              : broken ? (uint32_t)TPC_E4M3_NAN_BYTES
                                       : tpc_fp8_codes(x[k], s, -r, tpc_fp8_fast_scale(s));
  }
}

/* Codes (and scales) of one row from the kept x; every thread of the block
 * calls it (PER_TOKEN's maximum is a block reduction). tensor_scale: the
 * given scale (PER_TENSOR), loaded at the kernel's start. broken: the op
 * failed; codes and written scales are NaN. */
template <int QUANT, int UNITS>
TPC_DEVICE void tpc_fp8_emit(const tpc_kernel_args &a, float (*x)[4], uint32_t amax, float tensor_scale, uint64_t row,
                             uint64_t base, uint64_t row_units, unsigned t, unsigned data_threads, int broken) {
  if constexpr (QUANT == TPC_QUANT_PER_TOKEN_GROUP) {
    tpc_fp8_emit_groups<UNITS>(a, x, row, base, row_units, t, data_threads, broken);
  } else {
    float s = tensor_scale;
    if (QUANT == TPC_QUANT_PER_TOKEN) {
      amax = tpc_block_max_u32(amax); /* every thread, broken or not: a barrier */
      s = broken ? __uint_as_float(0x7fc00000u) : tpc_fp8_scale(amax, a.scale_floor);
      if (t == 0) a.scales[row * a.scale_row_stride] = s;
    }
    if (t >= data_threads || t >= row_units) return;
    /* amax: the maximum |x| over the values coded with s (this thread's, per tensor) */
    const float r = tpc_fp8_reciprocal(s);
    const int fast = tpc_fp8_fast_scale(s);
    const unsigned left = (unsigned)(row_units - t); /* as in tpc_fp8_emit_groups */
    uint32_t *codes = (uint32_t *)a.out + base + t;
#pragma unroll
    for (int k = 0; k < UNITS; ++k) {
      if ((unsigned)k * data_threads >= left) TPC_FP8_PAST_UNITS(UNITS)
      codes[k * data_threads] = tpc_fp8_unit_codes(x[k], s, r, fast, amax, broken);
    }
  }
}

/* Refused or failed before the rows: the scales it writes are NaN too. */
TPC_COLD void tpc_fp8_refuse_scales(const tpc_kernel_args *a) {
  if (a->quant != TPC_QUANT_PER_TOKEN && a->quant != TPC_QUANT_PER_TOKEN_GROUP) return;
  const uint64_t rows = a->nbytes / a->row_bytes;
  const uint64_t groups = a->quant == TPC_QUANT_PER_TOKEN ? 1 : a->row_bytes / 2 / TPC_FP8_GROUP;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * groups;
       i += (uint64_t)gridDim.x * blockDim.x)
    a->scales[(i / groups) * a->scale_row_stride + (i % groups) * a->scale_group_stride] = __uint_as_float(0x7fc00000u);
}

#endif /* TPCOMM_NORM_FP8_CUH */
