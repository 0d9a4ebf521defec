/*
 * quant.cuh's hardware paths give the same bits as its software ones, on
 * every input the codec can see:
 *
 *   e4m3 encode  (sm_89+: cvt.rn.satfinite.e4m3x2.f32, through cuda_fp8.h)
 *                every fp32 bit pattern but NaN (tpc_quant_scaled's
 *                values), against the clamp to +-448 and tpc_e4m3_of; and
 *                that never makes a NaN code (0x7f, 0xff);
 *   e4m3 decode  (sm_89+: cvt.rn.f16x2.e4m3x2) every code but the NaN ones;
 *   int clamp    for qmax 127 and 7, every group absmax A in
 *                [TPC_QUANT_TINY, FLT_MAX]: A * (qmax / A) < qmax + 1/2 (each
 *                operation rounded as tpc_quant_scale_of and
 *                tpc_quant_scaled do), so the codes need no clamp;
 *   absmax step  (sm_80+: max.NaN.f32) every pattern of v against every
 *                magnitude or NaN m (m is never negative): the same bits,
 *                or NaN for both;
 *   int codes    tpc_quant_int (rounding by adding 1.5 * 2^23, packing by
 *                byte permutes) against qi_code's rint packed as
 *                the payload's layout says, int8 and int4: every scaled
 *                value |y| < qmax + 1/2 in every position, every pattern
 *                with inv 0 (a NaN or zero-scale group), and every
 *                combination of codes in a word (15^8 int4, 255^4 int8);
 *   int values   tpc_quant_int_value against qi_value for every
 *                32-bit payload word, int8 and int4;
 *   scales       tpc_quant_scale_of's quotients (sm_90: an fma-corrected
 *                guess, no slow path) against __fdiv_rn for every absmax
 *                in [TPC_QUANT_TINY, FLT_MAX], each mode;
 *   FP8 quotients the fused norm's FP8 epilogue (tpc_fp8_quotient: a
 *                reciprocal and one fma correction) against __fdiv_rn for
 *                every bf16 and fp16 x and 8192 scales over 2^-64 .. 2^64:
 *                the same e4m3 codes, the same bits where |x / s| >= 2^-30;
 *   FP8 reciprocals tpc_fp8_reciprocal against __frcp_rn for every scale
 *                the quotient takes it for (tpc_fp8_fast_scale).
 *
 * On the CPU (no argument): tpc_e4m3_sat_of and tpc_e4m3_value against
 * cuda_fp8.h's host conversions, the same functions as its device ones (the
 * header's contract). On a GPU (`device`): tpc_e4m3x2_of, tpc_e4m3x2_value
 * and tpc_absmax2, as the kernels compile them, against the software path,
 * both halves of each pair, and the integer codecs against their
 * definition. Exits 1 on any difference.
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/quant_identity.cu -o build/quant_identity
 *   build/quant_identity          (CPU, all 2^32 patterns, about a minute)
 *   build/quant_identity device   (sm_89+ GPU)
 */
#include <cmath>
#include <cstdio>
#include <cstring>

#include "kernels/fp8_quotient.cuh"
#include "probe_check.h"

/* Whether tpc_quant_scaled can return y: not NaN. */
static __host__ __device__ bool qi_reachable(float y) { return y == y; }

/* The same bits, or both NaN. */
static __device__ bool qi_same(float a, float b) { return tpc_bits_of(a) == tpc_bits_of(b) || (a != a && b != b); }

static __host__ __device__ bool qi_nan_code(uint32_t c) { return (c & 0x7fu) == 0x7fu; }

static int qi_cpu(void) {
  unsigned long long checked = 0, bad = 0;
  uint32_t u = 0;
  do {
    const float y = tpc_float_of(u);
    if (qi_reachable(y)) {
      ++checked;
      const uint32_t mine = tpc_e4m3_sat_of(y);
      const uint32_t theirs = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
      if (mine != theirs || qi_nan_code(mine)) {
        if (bad++ < 5) fprintf(stderr, "encode %08x (%g): software %02x, cuda_fp8.h %02x\n", u, y, mine, theirs);
      }
    }
  } while (++u != 0);
  for (uint32_t c = 0; c < 256; ++c) {
    if (qi_nan_code(c)) continue;
    __half_raw h;
    h.x = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3).x;
    const float theirs = __half2float(h), mine = tpc_e4m3_value(c);
    if (tpc_bits_of(mine) != tpc_bits_of(theirs) && bad++ < 10)
      fprintf(stderr, "decode %02x: software %g, cuda_fp8.h %g\n", c, mine, theirs);
  }
  for (const float qmax : {127.0f, 7.0f}) {
    for (uint32_t u = tpc_bits_of(TPC_QUANT_TINY); u < 0x7f800000u; ++u) {
      const float a = tpc_float_of(u), inv = qmax / a; /* IEEE fp32, to nearest: __fdiv_rn, __fmul_rn */
      if (!(a * inv < qmax + 0.5f) && bad++ < 15) fprintf(stderr, "qmax %g, absmax %g: %g\n", qmax, a, a * inv);
    }
  }
  printf("cpu: %llu non-NaN values, 254 codes, the int clamps: %llu differences\n", checked, bad);
  return bad != 0;
}

/* Pattern i and a second, unrelated one (a permutation of all patterns), so
 * each half of a pair meets every value. */
__global__ void qi_encode(unsigned long long *bad) {
  unsigned long long n = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += (uint64_t)gridDim.x * blockDim.x) {
    const uint32_t u0 = (uint32_t)i, u1 = (uint32_t)i * 2654435761u + 0x9e3779b9u;
    float y0 = tpc_float_of(u0), y1 = tpc_float_of(u1);
    if (!qi_reachable(y0)) y0 = 0.0f;
    if (!qi_reachable(y1)) y1 = -0.0f;
    const uint32_t hw = tpc_e4m3x2_of(y0, y1) & 0xffffu, sw = tpc_e4m3_sat_of(y0) | tpc_e4m3_sat_of(y1) << 8;
    n += hw != sw || qi_nan_code(sw) || qi_nan_code(sw >> 8);
    const float v = tpc_float_of(u0), m = fabsf(tpc_float_of(u1)); /* u1 takes every pattern too */
    n += !qi_same(tpc_absmax2(m, v), tpc_absmax2_soft(m, v)) || !qi_same(tpc_absmax2(0.0f, v), tpc_absmax2_soft(0.0f, v));
  }
  atomicAdd(bad, n);
}

__global__ void qi_decode(unsigned long long *bad) {
  const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x; /* 65536 pairs */
  if (qi_nan_code(c) || qi_nan_code(c >> 8)) return;
  float a, b;
  tpc_e4m3x2_value(c | 0xabcd0000u, &a, &b); /* bits above the pair ignored */
  if (tpc_bits_of(a) != tpc_bits_of(tpc_e4m3_value(c & 0xffu)) ||
      tpc_bits_of(b) != tpc_bits_of(tpc_e4m3_value(c >> 8)))
    atomicAdd(bad, 1ull);
}

/* One value's integer code by its definition (quant.cuh): rint of the
 * scaled value, unclamped (int clamp above: it never changes the code);
 * int8 its low 8 bits, int4 its low 4. */
static __device__ uint32_t qi_code(float v, float inv) {
  return (uint32_t)(int32_t)rintf(tpc_quant_scaled(v, inv));
}

/* An integer code's value by its definition (int8: its low 8 bits as two's
 * complement, int4: its low 4). */
static __device__ float qi_value(uint32_t code, int mode) {
  if (mode == TPC_QUANT_INT8) return (float)(int32_t)(int8_t)(uint8_t)code;
  return (float)((int32_t)(code << 28) >> 28);
}

/* The payload by qi_code's definition: byte i the code of value i (int4:
 * nibble i of .x). */
static __device__ uint2 qi_int_def(const float f[8], float inv, int mode) {
  uint32_t lo = 0, hi = 0;
  for (int i = 0; i < 8; ++i) {
    const uint32_t c = qi_code(f[i], inv);
    if (mode == TPC_QUANT_INT4) lo |= (c & 15u) << (4 * i);
    else if (i < 4) lo |= (c & 255u) << (8 * i);
    else hi |= (c & 255u) << (8 * (i - 4));
  }
  return make_uint2(lo, hi);
}

template <int mode>
static __device__ unsigned long long qi_int_differs(const float f[8], float inv) {
  const uint2 a = tpc_quant_int<mode>(f, inv), b = qi_int_def(f, inv, mode);
  return a.x != b.x || a.y != b.y;
}

/* Every scaled value in every position (pattern i and its permutation
 * alternate), those past qmax + 1/2 replaced by 0; then every pattern as a
 * value of a group whose inv is 0. */
template <int mode>
__global__ void qi_int_encode(unsigned long long *bad) {
  const float lim = tpc_quant_qmax(mode) + 0.5f;
  unsigned long long n = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += (uint64_t)gridDim.x * blockDim.x) {
    const float y0 = tpc_float_of((uint32_t)i), y1 = tpc_float_of((uint32_t)i * 2654435761u + 0x9e3779b9u);
    const float r0 = fabsf(y0) < lim ? y0 : 0.0f, r1 = fabsf(y1) < lim ? y1 : -0.0f;
    const float f[8] = {r0, r1, r1, r0, r0, r1, r1, r0}, g[8] = {y0, y1, y0, y1, y1, y0, y1, y0};
    n += qi_int_differs<mode>(f, 1.0f) + qi_int_differs<mode>(g, 0.0f);
  }
  atomicAdd(bad, n);
}

/* Every combination of codes in a word: index i's base-(2 qmax + 1) digits
 * as the codes (int8: the high word's in reverse order). */
template <int mode>
__global__ void qi_int_pack(unsigned long long *bad) {
  const uint32_t base = 2 * (uint32_t)tpc_quant_qmax(mode) + 1, per_word = mode == TPC_QUANT_INT4 ? 8 : 4;
  uint64_t combos = 1;
  for (uint32_t d = 0; d < per_word; ++d) combos *= base;
  unsigned long long n = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < combos;
       i += (uint64_t)gridDim.x * blockDim.x) {
    float f[8];
    uint64_t r = i;
    for (uint32_t d = 0; d < per_word; ++d, r /= base) {
      f[d] = (float)((int)(r % base) - (int)(base / 2));
      if (per_word == 4) f[7 - d] = f[d];
    }
    n += qi_int_differs<mode>(f, 1.0f);
  }
  atomicAdd(bad, n);
}

/* Every payload word's values (int8: the high word a permutation of it). */
template <int mode>
__global__ void qi_int_decode(unsigned long long *bad) {
  unsigned long long n = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += (uint64_t)gridDim.x * blockDim.x) {
    const uint2 p = make_uint2((uint32_t)i, mode == TPC_QUANT_INT4 ? 0u : (uint32_t)i * 2654435761u + 0x9e3779b9u);
    float f[8];
    tpc_quant_int_value<mode>(p, f);
    for (int k = 0; k < 8; ++k) {
      const uint32_t code = mode == TPC_QUANT_INT4 ? p.x >> (4 * k) : (k < 4 ? p.x : p.y) >> (8 * (k & 3));
      n += tpc_bits_of(f[k]) != tpc_bits_of(qi_value(code, mode));
    }
  }
  atomicAdd(bad, n);
}

/* Whether a's scale and inv under the mode differ from __fdiv_rn's. */
template <int mode>
static __device__ int qi_scale_differs(float a) {
  const tpc_quant_scale s = tpc_quant_scale_of<mode>(a);
  const float qmax = tpc_quant_qmax(mode);
  return tpc_bits_of(s.scale) != tpc_bits_of(__fdiv_rn(a, qmax)) || tpc_bits_of(s.inv) != tpc_bits_of(__fdiv_rn(qmax, a));
}

/* Every group absmax a mode quantizes with: scale and inv as __fdiv_rn. */
__global__ void qi_scales(unsigned long long *bad) {
  unsigned long long n = 0;
  const uint32_t lo = tpc_bits_of(TPC_QUANT_TINY);
  for (uint64_t i = lo + (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < 0x7f800000u;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const float a = tpc_float_of((uint32_t)i);
    n += qi_scale_differs<TPC_QUANT_FP8>(a) + qi_scale_differs<TPC_QUANT_INT8>(a) + qi_scale_differs<TPC_QUANT_INT4>(a);
  }
  atomicAdd(bad, n);
}

/* The FP8 epilogue's quotient (tpc_fp8_quotient) against __fdiv_rn, for
 * every bf16 and fp16 value x (what the epilogue divides) and 8192 scales,
 * 64 in each binade 2^-64 .. 2^63 (fast ones and not): bad[0] the e4m3
 * codes that differ, bad[1] the quotients whose bits differ where |x / s| >=
 * 2^-30 (below it both are e4m3 zero of x's sign). */
static __device__ uint32_t qi_fp8_code(float q) { return q != q ? 0x7fu : tpc_e4m3x2_of(q, 0.0f) & 0xffu; }

__global__ void qi_fp8_quotients(unsigned long long *bad) {
  unsigned long long codes = 0, bits = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (uint64_t)8192 << 17;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const uint32_t k = (uint32_t)(i >> 17), v = (uint32_t)i & 0xffffu;
    const float s = tpc_float_of((k / 64 + 63) << 23 | ((k % 64) * 0x1fff1u & 0x7fffffu));
    const float x = i >> 16 & 1 ? tpc_16_to_float(v, 1) : tpc_16_to_float(v, 0);
    const float r = __fdiv_rn(1.0f, s), want = __fdiv_rn(x, s);
    const float got = tpc_fp8_quotient(x, s, r, tpc_fp8_fast_scale(s));
    codes += qi_fp8_code(got) != qi_fp8_code(want);
    bits += !qi_same(got, want) && !(fabsf(want) < 0x1p-30f);
  }
  atomicAdd(bad, codes);
  atomicAdd(bad + 1, bits);
}

/* The FP8 epilogue's reciprocal (tpc_fp8_reciprocal) against __frcp_rn for
 * every fast scale: the bits it multiplies by. */
__global__ void qi_fp8_reciprocals(unsigned long long *bad) {
  unsigned long long n = 0;
  const uint32_t lo = tpc_bits_of(0x1p-60f), hi = tpc_bits_of(0x1p60f);
  for (uint32_t i = lo + blockIdx.x * blockDim.x + threadIdx.x; i <= hi; i += gridDim.x * blockDim.x)
    n += tpc_bits_of(tpc_fp8_reciprocal(tpc_float_of(i))) != tpc_bits_of(__frcp_rn(tpc_float_of(i)));
  atomicAdd(bad, n);
}

static int qi_device(void) {
  unsigned long long *bad, nbad[9];
  CHECK(cudaMalloc(&bad, sizeof nbad));
  CHECK(cudaMemset(bad, 0, sizeof nbad));
  qi_encode<<<4096, 256>>>(bad);
  qi_decode<<<256, 256>>>(bad + 1);
  qi_int_encode<TPC_QUANT_INT8><<<4096, 256>>>(bad + 2);
  qi_int_pack<TPC_QUANT_INT8><<<4096, 256>>>(bad + 3);
  qi_int_decode<TPC_QUANT_INT8><<<4096, 256>>>(bad + 4);
  qi_int_encode<TPC_QUANT_INT4><<<4096, 256>>>(bad + 2);
  qi_int_pack<TPC_QUANT_INT4><<<4096, 256>>>(bad + 3);
  qi_int_decode<TPC_QUANT_INT4><<<4096, 256>>>(bad + 4);
  qi_scales<<<4096, 256>>>(bad + 5);
  qi_fp8_quotients<<<4096, 256>>>(bad + 6);
  qi_fp8_reciprocals<<<4096, 256>>>(bad + 8);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost));
  printf("device: 2^32 encoded pairs and absmax steps: %llu differences; 65536 decoded pairs: %llu differences\n", nbad[0], nbad[1]);
  printf("device, int8 and int4: 2^32 scaled values and 2^32 zero-inv groups: %llu differences; every word's codes "
         "(255^4, 15^8): %llu differences; 2^32 payload words decoded: %llu differences\n",
         nbad[2], nbad[3], nbad[4]);
  printf("device: every absmax's scale and inv, 3 modes: %llu differences\n", nbad[5]);
  printf("device: FP8 epilogue quotients, every bf16 and fp16 x by 8192 scales: %llu codes and %llu quotients "
         "(|x / s| >= 2^-30) differ\n", nbad[6], nbad[7]);
  printf("device: FP8 epilogue reciprocals, every fast scale (2^-60 .. 2^60): %llu differences\n", nbad[8]);
  for (int i = 0; i < 9; ++i)
    if (nbad[i]) return 1;
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "device")) return qi_device();
  return qi_cpu();
}
