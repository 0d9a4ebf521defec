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
#ifndef TPC_HIP
#include <cuda_fp8.h>
#endif

/* sm_89 and later convert e4m3 in hardware (cvt.rn.satfinite.e4m3x2.f32,
 * cvt.rn.f16x2.e4m3x2), two values an instruction; elsewhere (HIP, older
 * GPUs) the software path below. Both give the same bits on every input the
 * codec can see: benchmarks/quant_identity.cu checks every one. */
#if !defined(TPC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define TPC_E4M3_HW 1
#endif

/* Host and device: the software e4m3 path, so the identity check runs it on
 * the CPU against cuda_fp8.h's host conversion. */
#define TPC_HOST_DEVICE static __host__ __device__ __forceinline__

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

/* A float's bits and back (__float_as_uint, __uint_as_float), on the host too. */
TPC_HOST_DEVICE uint32_t tpc_bits_of(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

TPC_HOST_DEVICE float tpc_float_of(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

/* e4m3 ("fn": no infinities, 0x7f NaN) of a finite |y| <= 448, to nearest
 * even: below 2^-6 the subnormals, steps of 2^-9 (y * 512 is exact). */
TPC_HOST_DEVICE uint32_t tpc_e4m3_of(float y) {
  const uint32_t sign = (tpc_bits_of(y) >> 24) & 0x80u;
  const float a = fabsf(y);
  if (a < 0.015625f) return sign | (uint32_t)rintf(a * 512.0f);
  uint32_t b = tpc_bits_of(a);
  b += 0x7ffffu + ((b >> 20) & 1u); /* round the 23-bit mantissa to 3 bits */
  return sign | (((b >> 23) - 120u) << 3) | ((b >> 20) & 7u);
}

/* The value of a code other than the NaNs 0x7f and 0xff, which the encoder
 * never makes (it saturates at 448, code 0x7e). */
TPC_HOST_DEVICE float tpc_e4m3_value(uint32_t c) {
  const uint32_t e = (c >> 3) & 15u, m = c & 7u;
  const float a = e == 0 ? (float)m * 0.001953125f : tpc_float_of((e + 120u) << 23 | m << 20);
  return c & 0x80u ? -a : a;
}

/* A value that is not NaN clamped to +-448, then its code: the saturation
 * of the hardware's conversion. */
TPC_HOST_DEVICE uint32_t tpc_e4m3_sat_of(float y) { return tpc_e4m3_of(fminf(fmaxf(y, -448.0f), 448.0f)); }

/* Two values, neither NaN, as tpc_e4m3_sat_of's codes: y0's in bits 0-7,
 * y1's in 8-15. */
TPC_DEVICE uint32_t tpc_e4m3x2_of(float y0, float y1) {
#ifdef TPC_E4M3_HW
  return __nv_cvt_float2_to_fp8x2(make_float2(y0, y1), __NV_SATFINITE, __NV_E4M3);
#else
  return tpc_e4m3_sat_of(y0) | tpc_e4m3_sat_of(y1) << 8;
#endif
}

/* The values of the codes in bits 0-7 and 8-15 of c (neither a NaN code). */
TPC_DEVICE void tpc_e4m3x2_value(uint32_t c, float *f0, float *f1) {
#ifdef TPC_E4M3_HW
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)c, __NV_E4M3);
  __half_raw h0, h1;
  h0.x = h.x;
  h1.x = h.y;
  *f0 = __half2float(h0); /* exact: every e4m3 value is an fp16 value */
  *f1 = __half2float(h1);
#else
  *f0 = tpc_e4m3_value(c & 0xffu);
  *f1 = tpc_e4m3_value((c >> 8) & 0xffu);
#endif
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
TPC_HOST_DEVICE float tpc_absmax2_soft(float m, float v) {
  const float a = fabsf(v);
  return (a > m || a != a) ? a : m;
}

/* The same on sm_80+ in one instruction (max.NaN.f32 with |v| folded in).
 * m is NaN or a magnitude, never -0, so the two agree bit for bit but for
 * which NaN a NaN group gets, and only its NaN-ness is ever read
 * (tpc_quant_scale_of); benchmarks/quant_identity.cu checks it. */
TPC_DEVICE float tpc_absmax2(float m, float v) {
#if !defined(TPC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
  return r;
#else
  return tpc_absmax2_soft(m, v);
#endif
}

/* The group's absmax: this lane's 8 values, then over its 4 lanes. Every
 * lane of the warp calls it (lanes past the data with zeros). It is NaN or
 * the largest magnitude, whichever of the two rules computes it. */
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

/* One value scaled, NaN as 0 (NaN only in a NaN group, whose codes are 0). */
TPC_DEVICE float tpc_quant_scaled(float v, float inv) {
  const float y = __fmul_rn(v, inv);
  return y != y ? 0.0f : y;
}

/* One value's integer code (int8, int4; its low 8 or 4 bits): rint of the
 * scaled value clamped to +-qmax, with the clamp left out because it never
 * changes the code: |v| <= A gives |v * inv| <= A * inv (rounding is
 * monotonic) < qmax + 1/2 for every A (benchmarks/quant_identity.cu), and
 * rint maps (qmax, qmax + 1/2) to qmax as the clamp would. */
TPC_DEVICE uint32_t tpc_quant_code(float v, float inv) {
  return (uint32_t)(int32_t)rintf(tpc_quant_scaled(v, inv));
}

/* An integer code's value (int8: its low 8 bits, int4: its low 4). */
TPC_DEVICE float tpc_quant_value(uint32_t code, int mode) {
  if (mode == TPC_QUANT_INT8) return (float)(int32_t)(int8_t)(uint8_t)code;
  return (float)((int32_t)(code << 28) >> 28);
}

/* The payload of 8 values: byte i the code of value i (int4: nibble i,
 * value 2j in the low half of byte j; the payload's .x only). */
TPC_DEVICE uint2 tpc_quant_encode(const float f[8], float inv, int mode) {
  uint32_t lo = 0, hi = 0;
  if (mode == TPC_QUANT_INT4) {
#pragma unroll
    for (int i = 0; i < 8; ++i) lo |= (tpc_quant_code(f[i], inv) & 15u) << (4 * i);
  } else if (mode == TPC_QUANT_FP8) {
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      lo |= tpc_e4m3x2_of(tpc_quant_scaled(f[i], inv), tpc_quant_scaled(f[i + 1], inv)) << (8 * i);
      hi |= tpc_e4m3x2_of(tpc_quant_scaled(f[4 + i], inv), tpc_quant_scaled(f[5 + i], inv)) << (8 * i);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) lo |= (tpc_quant_code(f[i], inv) & 255u) << (8 * i);
#pragma unroll
    for (int i = 0; i < 4; ++i) hi |= (tpc_quant_code(f[4 + i], inv) & 255u) << (8 * i);
  }
  return make_uint2(lo, hi);
}

/* code * scale, one rounding each, for the 8 values of a payload. */
TPC_DEVICE void tpc_quant_decode(uint2 p, float scale, int mode, float f[8]) {
  if (mode == TPC_QUANT_FP8) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      float a, b;
      tpc_e4m3x2_value((i < 4 ? p.x : p.y) >> (8 * (i & 3)), &a, &b);
      f[i] = __fmul_rn(a, scale);
      f[i + 1] = __fmul_rn(b, scale);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t code = mode == TPC_QUANT_INT4 ? p.x >> (4 * i) : (i < 4 ? p.x : p.y) >> (8 * (i & 3));
    f[i] = __fmul_rn(tpc_quant_value(code, mode), scale);
  }
}

#endif /* TPCOMM_QUANT_CUH */
