/*
 * x / s as fp32's division rounds it, for the fused norm's FP8 epilogue
 * (norm_fp8.cuh): a scale per tensor, row or group divides many values, so
 * each value takes the scale's reciprocal and one fma correction instead of
 * a division. benchmarks/quant_identity.cu checks the codes and quotients
 * against __fdiv_rn and the reciprocals against __frcp_rn.
 */
#ifndef TPCOMM_FP8_QUOTIENT_CUH
#define TPCOMM_FP8_QUOTIENT_CUH

#include "quant.cuh"

/* Whether tpc_fp8_quotient may take x / s from r = 1 / s: s within
 * [2^-60, 2^60]. The FP8 epilogue's scales (norm_fp8.cuh) are one per
 * tensor, row or group, so the test is the same for each value under one.
 * benchmarks/quant_identity.cu checks the quotient's codes. */
TPC_DEVICE int tpc_fp8_fast_scale(float s) { return s >= 0x1p-60f && s <= 0x1p60f; }

/* 1 / s as __frcp_rn rounds it where s is fast: its own path for such s (the
 * hardware's approximation, one Newton step) without its range check, a
 * branch around its slow path (quant_identity.cu checks every fast s). Any
 * value for an s that is not fast: such a scale divides. HIP: 1 / s. */
TPC_DEVICE float tpc_fp8_reciprocal(float s) {
#ifdef TPC_HIP
  return 1.0f / s;
#else
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(s));
  return __fmaf_rn(__fmaf_rn(-s, y, 1.0f), y, y);
#endif
}

/* x / s as the division rounds it, from r = 1 / s (correctly rounded) and
 * the guess q = x * r, where s is fast and q finite (tpc_div_by_reciprocal):
 * its residual is exact for |x| >= 2^-90; below that |x / s| < 2^-30, and
 * both quotients give e4m3 zero of x's sign. A zero guess is the quotient
 * (x is a zero, or x / s is below the subnormals): the correction would add
 * +0 to -0, losing its sign. */
TPC_DEVICE float tpc_fp8_quotient_finite(float x, float s, float r, float q) {
  return q == 0.0f ? q : tpc_div_by_reciprocal(x, s, r);
}

/* The same for any x and s: a scale that is not fast, and an infinite or
 * NaN guess, take the division. */
TPC_DEVICE float tpc_fp8_quotient(float x, float s, float r, int fast) {
  const float q = __fmul_rn(x, r);
  if (!fast || !(fabsf(q) <= 0x1.fffffep127f)) return x / s;
  return tpc_fp8_quotient_finite(x, s, r, q);
}

#endif /* TPCOMM_FP8_QUOTIENT_CUH */
