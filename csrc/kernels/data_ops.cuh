/*
 * Reduction arithmetic per dtype on 8-byte (packet) and 16-byte (bulk) units.
 * Sums are kept in fp32 and rounded once at the end, and callers add ranks in
 * the order 0..n-1, so every rank produces the same bits. `dtype` is always
 * the calling kernel's template constant: inlined, every test of it folds.
 */
#ifndef TPCOMM_DATA_OPS_CUH
#define TPCOMM_DATA_OPS_CUH

#include "../tpcomm.h"
#include "portability.cuh"

/* Adds the values held in `words` (nwords 32-bit words) to acc, which has
 * room for 2 values per word (fp32 uses one). */
TPC_DEVICE void tpc_accumulate(float *acc, const uint32_t *words, int nwords, int dtype) {
  for (int w = 0; w < nwords; ++w) {
    const uint32_t v = words[w];
    if (dtype == TPC_FLOAT32) {
      acc[w] += __uint_as_float(v);
    } else if (dtype == TPC_FLOAT16) {
      acc[2 * w] += tpc_half_to_float((uint16_t)(v & 0xffffu));
      acc[2 * w + 1] += tpc_half_to_float((uint16_t)(v >> 16));
    } else {
      acc[2 * w] += tpc_bf16_to_float((uint16_t)(v & 0xffffu));
      acc[2 * w + 1] += tpc_bf16_to_float((uint16_t)(v >> 16));
    }
  }
}

TPC_DEVICE void tpc_round(const float *acc, uint32_t *words, int nwords, int dtype) {
  for (int w = 0; w < nwords; ++w) {
    words[w] = dtype == TPC_FLOAT32 ? __float_as_uint(acc[w])
                                    : tpc_pack2(acc[2 * w], acc[2 * w + 1], dtype == TPC_BFLOAT16);
  }
}

/* Sums start from -0.0, the exact additive identity (0.0 + -0.0 would give
 * +0.0): ((-0 + a) + b) is bit-for-bit a + b, the two-rank NCCL result. */
TPC_DEVICE void tpc_start(float *acc, const uint32_t *words, int nwords, int dtype) {
  for (int i = 0; i < 2 * nwords; ++i) acc[i] = -0.0f;
  tpc_accumulate(acc, words, nwords, dtype);
}

/* Rank q's words into a sum kept in rank order: rank 0 starts it. */
TPC_DEVICE void tpc_add_rank(float *acc, const uint32_t *words, int nwords, int dtype, int q) {
  if (q == 0) tpc_start(acc, words, nwords, dtype);
  else tpc_accumulate(acc, words, nwords, dtype);
}

/* Two ranks: the rounded sum of two words, bit for bit what tpc_add_rank
 * over both and tpc_round give (for fp32 the same one addition; for 16-bit
 * dtypes portability.cuh's tpc_add2 says why), in a quarter of the
 * instructions; and of 8- and 16-byte units. */
TPC_DEVICE uint32_t tpc_sum_pair(uint32_t x, uint32_t y, int dtype) {
  return dtype == TPC_FLOAT32 ? __float_as_uint(__uint_as_float(x) + __uint_as_float(y))
                              : tpc_add2(x, y, dtype == TPC_BFLOAT16);
}

TPC_DEVICE uint2 tpc_sum_pair8(uint2 a, uint2 b, int dtype) {
  return make_uint2(tpc_sum_pair(a.x, b.x, dtype), tpc_sum_pair(a.y, b.y, dtype));
}

TPC_DEVICE uint4 tpc_sum_pair16(uint4 a, uint4 b, int dtype) {
  return make_uint4(tpc_sum_pair(a.x, b.x, dtype), tpc_sum_pair(a.y, b.y, dtype), tpc_sum_pair(a.z, b.z, dtype),
                    tpc_sum_pair(a.w, b.w, dtype));
}

TPC_DEVICE uint4 tpc_load16(const void *p) { return *(const uint4 *)p; }
TPC_DEVICE void tpc_store16(void *p, uint4 v) { *(uint4 *)p = v; }

#endif /* TPCOMM_DATA_OPS_CUH */
