/*
 * The group-wise codecs of the quantized all-reduce (all_reduce_quant.cuh):
 * a group is TPC_QUANT_GROUP (tpcomm.h) consecutive values, held by
 * TPC_QUANT_LANES adjacent lanes of a warp, 8 values (one 16-byte unit of a
 * 16-bit dtype) each. The mode and the dtype are template parameters, fixed
 * at launch (launch.cu), so no codec branches on them at run time. A
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
 * contracted into an fma (__fmul_rn); where the kernels compute one another
 * way (the codes by a magic constant, the quotients without __fdiv_rn's slow
 * path), benchmarks/quant_identity.cu checks the same bits on every input.
 * So python/tpcomm/quantized_reference.py reproduces the bits on the CPU,
 * and docs/design.md bounds the error:
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

/* The software e4m3 path below is TPC_HOST_DEVICE, so the identity check
 * runs it on the CPU against cuda_fp8.h's host conversion. */

#define TPC_QUANT_TINY 5.421010862427522e-20f /* 2^-64 */
#define TPC_QUANT_UNIT_VALUES 8 /* values of a 16-byte unit of a 16-bit dtype */
#define TPC_QUANT_LANES (TPC_QUANT_GROUP / TPC_QUANT_UNIT_VALUES) /* lanes of a group, a unit each */
static_assert(TPC_QUANT_LANES == 4, "tpc_group_absmax's two shuffles span a group of 4 lanes");

/* The mode of an algorithm code, 0 for none. */
enum { TPC_QUANT_FP8 = 1, TPC_QUANT_INT8 = 2, TPC_QUANT_INT4 = 3 };

TPC_HOST_DEVICE constexpr int tpc_quant_mode(int algo) {
  return algo == TPC_ALGO_QUANTIZED_FP8 ? TPC_QUANT_FP8
         : algo == TPC_ALGO_QUANTIZED_INT8 ? TPC_QUANT_INT8
         : algo == TPC_ALGO_QUANTIZED_INT4 ? TPC_QUANT_INT4 : 0;
}

TPC_HOST_DEVICE constexpr float tpc_quant_qmax(int mode) {
  return mode == TPC_QUANT_FP8 ? 448.0f : mode == TPC_QUANT_INT8 ? 127.0f : 7.0f;
}

/* The float nearest to 1 / tpc_quant_qmax(mode). */
TPC_HOST_DEVICE constexpr float tpc_quant_inv_qmax(int mode) {
  return mode == TPC_QUANT_FP8 ? 1.0f / 448.0f : mode == TPC_QUANT_INT8 ? 1.0f / 127.0f : 1.0f / 7.0f;
}

/* Payload bytes of one 16-byte unit (8 values). */
TPC_HOST_DEVICE constexpr uint32_t tpc_quant_unit_bytes(int mode) { return mode == TPC_QUANT_INT4 ? 4u : 8u; }

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

/* The 8 values of a 16-byte unit of a 16-bit dtype (TPC_FLOAT16 or
 * TPC_BFLOAT16) as fp32 (exact). */
template <int Dtype>
TPC_DEVICE void tpc_unit_floats(uint4 v, float f[8]) {
  static_assert(Dtype == TPC_FLOAT16 || Dtype == TPC_BFLOAT16, "the codecs read 16-bit values");
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = tpc_16_to_float(w[i] & 0xffffu, Dtype == TPC_BFLOAT16);
    f[2 * i + 1] = tpc_16_to_float(w[i] >> 16, Dtype == TPC_BFLOAT16);
  }
}

template <int Dtype>
TPC_DEVICE uint4 tpc_unit_of_floats(const float f[8]) {
  static_assert(Dtype == TPC_FLOAT16 || Dtype == TPC_BFLOAT16, "the codecs write 16-bit values");
  uint32_t w[4];
  tpc_round(f, w, 4, Dtype);
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

/* a / d as the division rounds it, from r, the nearest float to 1 / d: the
 * guess a * r, corrected once by its residual a - q * d (an fma; Markstein).
 * The correctly rounded quotient wherever that residual is exact and the
 * quotient normal; callers state the ranges they keep it in. */
TPC_DEVICE float tpc_div_by_reciprocal(float a, float d, float r) {
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(__fmaf_rn(-q, d, a), r, q);
}

/* a / qmax for a in [TPC_QUANT_TINY, FLT_MAX], as __fdiv_rn
 * (tpc_div_by_reciprocal; benchmarks/quant_identity.cu checks every a)
 * without its range check, a branch around a slow path that would split the
 * warp between the group's shuffles. HIP: __fdiv_rn. */
template <int Mode>
TPC_DEVICE float tpc_quant_div_by(float a) {
#ifdef TPC_HIP
  return __fdiv_rn(a, tpc_quant_qmax(Mode));
#else
  return tpc_div_by_reciprocal(a, tpc_quant_qmax(Mode), tpc_quant_inv_qmax(Mode));
#endif
}

/* n / a for a in [TPC_QUANT_TINY, FLT_MAX] and n a qmax, as __fdiv_rn: the
 * hardware's approximate 1 / a refined by one Newton step, then the same
 * correction. Past 2^64, a is scaled by 2^-64 first and the quotient after
 * (exact: both stay normal), so 1 / a is never subnormal. HIP: __fdiv_rn. */
TPC_DEVICE float tpc_quant_div_of(float n, float a) {
#ifdef TPC_HIP
  return __fdiv_rn(n, a);
#else
  const bool big = a >= 18446744073709551616.0f; /* 2^64 */
  const float b = big ? __fmul_rn(a, TPC_QUANT_TINY) : a;
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(b));
  y = __fmaf_rn(__fmaf_rn(-b, y, 1.0f), y, y);
  const float q = __fmul_rn(n, y), inv = __fmaf_rn(__fmaf_rn(-q, b, n), y, q);
  return big ? __fmul_rn(inv, TPC_QUANT_TINY) : inv;
#endif
}

template <int Mode>
TPC_DEVICE tpc_quant_scale tpc_quant_scale_of(float absmax) {
  constexpr float qmax = tpc_quant_qmax(Mode);
  tpc_quant_scale s;
  if (!(absmax <= 3.402823466e38f)) {
    s.scale = __uint_as_float(0x7fc00000u);
    s.inv = 0.0f;
  } else if (absmax < TPC_QUANT_TINY) {
    s.scale = 0.0f;
    s.inv = 0.0f;
  } else {
    s.scale = tpc_quant_div_by<Mode>(absmax);
    s.inv = tpc_quant_div_of(qmax, absmax);
  }
  return s;
}

/* One value scaled, NaN as 0 (NaN only in a NaN group, whose codes are 0). */
TPC_DEVICE float tpc_quant_scaled(float v, float inv) {
  const float y = __fmul_rn(v, inv);
  return y != y ? 0.0f : y;
}

/* The integer codes without a float-to-int conversion (a quarter-rate
 * instruction): for |y| < 2^22, y + 1.5 * 2^23 rounded once to nearest even
 * is 1.5 * 2^23 + rint(y) (the sum's ulp is 1 and 1.5 * 2^23 is even, so a
 * tie goes to the even integer as rint's does), whose bits end in rint(y)
 * in two's complement; a bias b added to the constant gives rint(y) + b.
 * The codes' |y| < qmax + 1/2 is far inside. Decoding runs it backwards: a
 * biased code u (0 <= u < 2^8) as the low bits of 2^23's bits is the float
 * 2^23 + u, and subtracting 2^23 + bias is exact. */
#define TPC_QUANT_ROUNDER 12582912.0f /* 1.5 * 2^23 */
#define TPC_QUANT_TWO23 0x4b000000u   /* the bits of 2^23 */

/* y + 1.5 * 2^23 + bias, as bits (y the product of tpc_quant_scale's inv:
 * never NaN where it is read, see tpc_quant_int). */
TPC_DEVICE uint32_t tpc_quant_rounded(float v, float inv, float bias) {
  return __float_as_uint(tpc_add_rn(__fmul_rn(v, inv), TPC_QUANT_ROUNDER + bias));
}

/* Bytes 0 of a, b, c, d as one word's bytes 0-3. */
TPC_DEVICE uint32_t tpc_low_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040u), __byte_perm(c, d, 0x0040u), 0x5410u);
}

/* The integer codes of 8 values (int8, int4), packed as tpc_quant_encode
 * lays them: rint of each scaled value clamped to +-qmax, with the clamp
 * left out because it never changes the code: |v| <= A gives |v * inv| <=
 * A * inv (rounding is monotonic) < qmax + 1/2 for every A, and rounding
 * maps (qmax, qmax + 1/2) to qmax as the clamp would. inv is 0 for a group
 * of scale 0 or NaN, whose codes are 0 (the values scaled may then be NaN).
 * benchmarks/quant_identity.cu checks the bound and these codes against
 * that definition on every input. int4: each value rounded with bias 8 (its
 * byte 8 + code, in 1..15, so two values pack with one shift-add), the
 * nibbles' bias taken off by one xor at the end. */
template <int Mode>
TPC_DEVICE uint2 tpc_quant_int(const float f[8], float inv) {
  static_assert(Mode == TPC_QUANT_INT8 || Mode == TPC_QUANT_INT4, "integer codes");
  uint32_t lo, hi = 0;
  if constexpr (Mode == TPC_QUANT_INT4) {
    uint32_t pair[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      pair[j] = (tpc_quant_rounded(f[2 * j + 1], inv, 8.0f) << 4) + tpc_quant_rounded(f[2 * j], inv, 8.0f);
    lo = tpc_low_bytes(pair[0], pair[1], pair[2], pair[3]) ^ 0x88888888u;
  } else {
    uint32_t m[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) m[i] = tpc_quant_rounded(f[i], inv, 0.0f);
    lo = tpc_low_bytes(m[0], m[1], m[2], m[3]);
    hi = tpc_low_bytes(m[4], m[5], m[6], m[7]);
  }
  return inv == 0.0f ? make_uint2(0u, 0u) : make_uint2(lo, hi);
}

/* The value of the biased code in byte j of w (j < 4): 2^23 + byte, less
 * 2^23 + bias (exact). */
TPC_DEVICE float tpc_quant_biased_value(uint32_t w, uint32_t j, float bias) {
  return tpc_add_rn(__uint_as_float(__byte_perm(w, TPC_QUANT_TWO23, 0x7440u + j)), -(8388608.0f + bias));
}

/* The values of a payload's 8 integer codes (int8: byte i the two's
 * complement code of value i; int4: nibble i of .x). Flipping a two's
 * complement code's top bit adds the bias (8 for int4, 128 for int8) and
 * leaves it in 0..2^bits - 1. int4: word x's even nibbles (values 0, 2, 4,
 * 6) and odd ones as bytes. */
template <int Mode>
TPC_DEVICE void tpc_quant_int_value(uint2 p, float f[8]) {
  static_assert(Mode == TPC_QUANT_INT8 || Mode == TPC_QUANT_INT4, "integer codes");
  if constexpr (Mode == TPC_QUANT_INT4) {
    const uint32_t even = (p.x ^ 0x88888888u) & 0x0f0f0f0fu, odd = ((p.x >> 4) ^ 0x08080808u) & 0x0f0f0f0fu;
#pragma unroll
    for (uint32_t j = 0; j < 4; ++j) {
      f[2 * j] = tpc_quant_biased_value(even, j, 8.0f);
      f[2 * j + 1] = tpc_quant_biased_value(odd, j, 8.0f);
    }
  } else {
    const uint32_t lo = p.x ^ 0x80808080u, hi = p.y ^ 0x80808080u;
#pragma unroll
    for (uint32_t j = 0; j < 4; ++j) {
      f[j] = tpc_quant_biased_value(lo, j, 128.0f);
      f[4 + j] = tpc_quant_biased_value(hi, j, 128.0f);
    }
  }
}

/* The payload of 8 values: byte i the code of value i (int4: nibble i,
 * value 2j in the low half of byte j; the payload's .x only). */
template <int Mode>
TPC_DEVICE uint2 tpc_quant_encode(const float f[8], float inv) {
  if constexpr (Mode != TPC_QUANT_FP8) {
    return tpc_quant_int<Mode>(f, inv);
  } else {
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      lo |= tpc_e4m3x2_of(tpc_quant_scaled(f[i], inv), tpc_quant_scaled(f[i + 1], inv)) << (8 * i);
      hi |= tpc_e4m3x2_of(tpc_quant_scaled(f[4 + i], inv), tpc_quant_scaled(f[5 + i], inv)) << (8 * i);
    }
    return make_uint2(lo, hi);
  }
}

/* code * scale, one rounding each, for the 8 values of a payload. */
template <int Mode>
TPC_DEVICE void tpc_quant_decode(uint2 p, float scale, float f[8]) {
  if constexpr (Mode == TPC_QUANT_FP8) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      float a, b;
      tpc_e4m3x2_value((i < 4 ? p.x : p.y) >> (8 * (i & 3)), &a, &b);
      f[i] = __fmul_rn(a, scale);
      f[i + 1] = __fmul_rn(b, scale);
    }
  } else {
    tpc_quant_int_value<Mode>(p, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __fmul_rn(f[i], scale);
  }
}

/* One unit's 8 values quantized with their group (every lane of the warp
 * calls it: the absmax shuffles over the group's lanes). */
template <int Mode>
TPC_DEVICE void tpc_quant_unit(const float f[8], uint2 *payload, float *scale) {
  const tpc_quant_scale q = tpc_quant_scale_of<Mode>(tpc_group_absmax(f));
  *payload = tpc_quant_encode<Mode>(f, q.inv);
  *scale = q.scale;
}

#endif /* TPCOMM_QUANT_CUH */
