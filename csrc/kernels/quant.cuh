/*
 * The group-wise codecs of the quantized all-reduce (all_reduce_quant.cuh):
 * a group is TPC_QUANT_GROUP (32) consecutive values, held by 4 adjacent
 * lanes of a warp, 8 values (one 16-byte unit of a 16-bit dtype) each. A
 * group travels as its values quantized against one fp32 scale, its absmax
 * over the mode's largest code (qmax):
 *
 *   mode  code              qmax  payload bytes per 8 values
 *   fp8   e4m3 (RNE)        448   8
 *   int8  [-127, 127]       127   8
 *   int4  [-7, 7], 2/byte   7     4
 *
 * With A the group's absmax (fp32, NaN-propagating):
 *   A NaN or inf (a value NaN or +-inf): scale NaN, codes 0: the group
 *     decodes to NaN, and so does every sum it enters;
 *   A < TPC_QUANT_TINY: scale 0, codes 0: the group decodes to 0 (an error
 *     below 2^-64, where qmax / A would overflow fp32);
 *   else scale s = A / qmax and code = round(clamp(v * (qmax / A), +-qmax))
 *     (to nearest even; e4m3 saturated at 448), decoded as code * s.
 * Every step is one IEEE fp32 operation, rounded to nearest, never
 * contracted into an fma (__fmul_rn), so python/tpcomm/quantized_reference.py
 * reproduces the bits on the CPU, and docs/design.md bounds the error:
 * |v - decode| <= A / (2 qmax) + 2^-21 A (int), 2^-4 A + 2^-18 A (fp8).
 */
#ifndef TPCOMM_QUANT_CUH
#define TPCOMM_QUANT_CUH

#include "data_ops.cuh"

#define TPC_QUANT_TINY 5.421010862427522e-20f /* 2^-64 */
#define TPC_QUANT_LANES 4                     /* lanes of a group: 4 x 8 values */

/* The mode of an algorithm code, 0 for none. */
enum { TPC_QUANT_FP8 = 1, TPC_QUANT_INT8 = 2, TPC_QUANT_INT4 = 3 };

TPC_DEVICE int tpc_quant_mode(int algo) {
  return algo == TPC_ALGO_QUANTIZED_FP8 ? TPC_QUANT_FP8
         : algo == TPC_ALGO_QUANTIZED_INT8 ? TPC_QUANT_INT8
         : algo == TPC_ALGO_QUANTIZED_INT4 ? TPC_QUANT_INT4 : 0;
}

TPC_DEVICE float tpc_quant_qmax(int mode) {
  return mode == TPC_QUANT_FP8 ? 448.0f : mode == TPC_QUANT_INT8 ? 127.0f : 7.0f;
}

/* Payload bytes of one 16-byte unit (8 values). */
TPC_DEVICE uint32_t tpc_quant_unit_bytes(int mode) { return mode == TPC_QUANT_INT4 ? 4u : 8u; }

/* e4m3 ("fn": no infinities, 0x7f NaN) of a finite |y| <= 448, to nearest
 * even: below 2^-6 the subnormals, steps of 2^-9 (y * 512 is exact). */
TPC_DEVICE uint32_t tpc_e4m3_of(float y) {
  const uint32_t sign = (__float_as_uint(y) >> 24) & 0x80u;
  const float a = fabsf(y);
  if (a < 0.015625f) return sign | (uint32_t)rintf(a * 512.0f);
  uint32_t b = __float_as_uint(a);
  b += 0x7ffffu + ((b >> 20) & 1u); /* round the 23-bit mantissa to 3 bits */
  return sign | (((b >> 23) - 120u) << 3) | ((b >> 20) & 7u);
}

TPC_DEVICE float tpc_e4m3_value(uint32_t c) {
  const uint32_t e = (c >> 3) & 15u, m = c & 7u;
  const float a = e == 0 ? (float)m * 0.001953125f : __uint_as_float((e + 120u) << 23 | m << 20);
  return c & 0x80u ? -a : a;
}

/* The 8 values of a 16-byte unit of a 16-bit dtype as fp32 (exact). */
TPC_DEVICE void tpc_unit_floats(uint4 v, int dtype, float f[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = tpc_16_to_float(w[i] & 0xffffu, dtype == TPC_BFLOAT16);
    f[2 * i + 1] = tpc_16_to_float(w[i] >> 16, dtype == TPC_BFLOAT16);
  }
}

TPC_DEVICE uint4 tpc_unit_of_floats(const float f[8], int dtype) {
  uint32_t w[4];
  tpc_round(f, w, 4, dtype);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* The larger magnitude, NaN winning. */
TPC_DEVICE float tpc_absmax2(float m, float v) {
  const float a = fabsf(v);
  return (a > m || a != a) ? a : m;
}

/* The group's absmax: this lane's 8 values, then over its 4 lanes. Every
 * lane of the warp calls it (lanes past the data with zeros). */
TPC_DEVICE float tpc_group_absmax(const float f[8]) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = tpc_absmax2(m, f[i]);
  m = tpc_absmax2(m, tpc_shfl_xor_float(m, 1));
  return tpc_absmax2(m, tpc_shfl_xor_float(m, 2));
}

/* A group's scale and its multiplier (the header's rules). */
typedef struct {
  float scale, inv;
} tpc_quant_scale;

TPC_DEVICE tpc_quant_scale tpc_quant_scale_of(float absmax, int mode) {
  const float qmax = tpc_quant_qmax(mode);
  tpc_quant_scale s;
  if (!(absmax <= 3.402823466e38f)) {
    s.scale = __uint_as_float(0x7fc00000u);
    s.inv = 0.0f;
  } else if (absmax < TPC_QUANT_TINY) {
    s.scale = 0.0f;
    s.inv = 0.0f;
  } else {
    s.scale = __fdiv_rn(absmax, qmax);
    s.inv = __fdiv_rn(qmax, absmax);
  }
  return s;
}

/* One value's code (its low 8 bits; int4 its low 4). */
TPC_DEVICE uint32_t tpc_quant_code(float v, float inv, int mode) {
  const float qmax = tpc_quant_qmax(mode);
  float y = __fmul_rn(v, inv);
  y = y != y ? 0.0f : fminf(fmaxf(y, -qmax), qmax); /* NaN only in a NaN group, whose codes are 0 */
  if (mode == TPC_QUANT_FP8) return tpc_e4m3_of(y);
  return (uint32_t)(int32_t)rintf(y);
}

TPC_DEVICE float tpc_quant_value(uint32_t code, int mode) {
  if (mode == TPC_QUANT_FP8) return tpc_e4m3_value(code & 0xffu);
  if (mode == TPC_QUANT_INT8) return (float)(int32_t)(int8_t)(uint8_t)code;
  return (float)((int32_t)(code << 28) >> 28);
}

/* The payload of 8 values: byte i the code of value i (int4: nibble i,
 * value 2j in the low half of byte j; the payload's .x only). */
TPC_DEVICE uint2 tpc_quant_encode(const float f[8], float inv, int mode) {
  uint32_t lo = 0, hi = 0;
  if (mode == TPC_QUANT_INT4) {
#pragma unroll
    for (int i = 0; i < 8; ++i) lo |= (tpc_quant_code(f[i], inv, mode) & 15u) << (4 * i);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) lo |= (tpc_quant_code(f[i], inv, mode) & 255u) << (8 * i);
#pragma unroll
    for (int i = 0; i < 4; ++i) hi |= (tpc_quant_code(f[4 + i], inv, mode) & 255u) << (8 * i);
  }
  return make_uint2(lo, hi);
}

/* code * scale, one rounding each, for the 8 values of a payload. */
TPC_DEVICE void tpc_quant_decode(uint2 p, float scale, int mode, float f[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t code = mode == TPC_QUANT_INT4 ? p.x >> (4 * i) : (i < 4 ? p.x : p.y) >> (8 * (i & 3));
    f[i] = __fmul_rn(tpc_quant_value(code, mode), scale);
  }
}

#endif /* TPCOMM_QUANT_CUH */
