/*
 * All-reduce + residual add + RMSNorm in one launch (packet path), for the
 * row counts of decode: what a transformer layer runs after its row-parallel
 * matmul, with the add and the norm that follow folded in.
 *
 * One block per row (blocks stride over the rows). Every rank pushes its row
 * as packets into every peer's slot, exactly as the all-reduce packet kernel
 * does. With fewer rows than the launch has blocks ("spread": decode's 1 to
 * 8 rows), every block pushes a contiguous share of all rows' packets first,
 * because one multiprocessor's remote stores saturate early, and only the
 * first `rows` blocks go on to reduce; the launch spreads only when out is
 * not the input, since a reducing block may write out before another block
 * has read that input to push it. Then each data thread sums its units over
 * the ranks in fp32 in rank
 * order, adds the residual in fp32 and keeps the result z in registers. The
 * block sums z^2 in a fixed order (a butterfly per warp, then the warps in
 * index order), so every rank with the same residual computes the same bits:
 *   residual_out = round(z)
 *   normed       = round(z * rsqrt(mean(z^2) + eps) * weight)
 * z is never rounded before the norm: the result is the fp32 reference
 * (all-reduce in rank order, add, RMSNorm) rounded once. A thread reads and
 * writes only its own units, and writes them last, so out may be the input
 * and out2 the residual (the in-place variant).
 *
 * 16-bit dtypes only: a unit holds 4 values. A row holds at most
 * TPC_NORM_MAX_ROW_BYTES (tpcomm.h): TPC_NORM_THREADS data threads with
 * TPC_NORM_UNITS units each.
 */
#ifndef TPCOMM_ALL_REDUCE_NORM_CUH
#define TPCOMM_ALL_REDUCE_NORM_CUH

#include "reduce.cuh"

#define TPC_NORM_THREADS 512 /* data threads per block at most */
#define TPC_NORM_UNITS 8     /* packet units per data thread at most: z in 32 registers */

#if defined(__cplusplus)
static_assert(TPC_NORM_THREADS * TPC_NORM_UNITS * TPC_PACKET_DATA_BYTES == TPC_NORM_MAX_ROW_BYTES,
              "the kernel's row capacity is what tpcomm.h announces");
#endif

/* The sum of v over the block, the same bits in every thread; every thread
 * of the block calls it. Also a barrier: returns in *broken whether any
 * thread of the block has failed. */
TPC_DEVICE float tpc_block_sum(float v, int failed, int *broken) {
  __shared__ float partial[1024 / 32];
  v = tpc_warp_sum(v);
  if (threadIdx.x % TPC_WARP_LANES == 0) partial[threadIdx.x / TPC_WARP_LANES] = v;
  *broken = __syncthreads_or(failed);
  float sum = 0.0f;
  const unsigned warps = (blockDim.x + TPC_WARP_LANES - 1) / TPC_WARP_LANES;
  for (unsigned w = 0; w < warps; ++w) sum += partial[w];
  __syncthreads(); /* partial is reused by the next row */
  return sum;
}

/* Refused: both outputs are NaN (tpc_op_refuse fills out), nothing else
 * touched. Apart from tpc_op_refuse, so that the other kernels' cold path
 * carries no second output. */
TPC_COLD void tpc_norm_refuse(const tpc_kernel_args *a, uint32_t refused, uint32_t epoch) {
  tpc_op_refuse(a, refused, epoch);
  tpc_poison_fill(a, a->out2, a->nbytes);
}

/* The launch bound caps registers so that a full block (17 warps) fits: the
 * register file is split over 4 schedulers, so 98 registers a thread, what
 * the compiler picks unbounded, allow only 16 warps (launch error 701;
 * tests/test_kernel_resources.py checks every kernel against its block). */
__global__ void __launch_bounds__(TPC_NORM_THREADS + TPC_CONTROL_THREADS)
    tpc_all_reduce_norm_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_packet_start p;
  if (!tpc_packet_prologue(&a, 0, tpc_no_prefetch(), &p, tpc_norm_refuse)) return;
  tpc_op &op = p.op;
  const int folded = p.folded;

  const unsigned data_threads = blockDim.x - TPC_CONTROL_THREADS;
  const unsigned t = threadIdx.x; /* a data thread when t < data_threads */
  const uint64_t row_units = a.row_bytes / TPC_PACKET_DATA_BYTES;
  const uint64_t rows = a.nbytes / a.row_bytes;
  const float inv_n = 1.0f / (float)(row_units * 4);
  const uint2 *in = (const uint2 *)a.in, *residual = (const uint2 *)a.residual, *weight = (const uint2 *)a.weight;
  uint2 *out = (uint2 *)a.out, *out2 = (uint2 *)a.out2;
  const int spread = gridDim.x > rows; /* the same in every block */

  if (spread && t < data_threads) {
    const uint64_t total = rows * row_units, share = (total + gridDim.x - 1) / gridDim.x;
    const uint64_t end = (blockIdx.x + 1) * share < total ? (blockIdx.x + 1) * share : total;
    for (uint64_t u = blockIdx.x * share + t; u < end; u += data_threads) {
      const uint2 v = in[u];
      tpc_packet_push(&a, op.epoch, u, [&](int) { return v; });
    }
  }

  for (uint64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint64_t base = row * row_units;
    if (!spread && t < data_threads)
      for (uint64_t u = t; u < row_units; u += data_threads) {
        const uint2 v = in[base + u];
        tpc_packet_push(&a, op.epoch, base + u, [&](int) { return v; });
      }

    float z[TPC_NORM_UNITS][4];
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < TPC_NORM_UNITS; ++k) {
      const uint64_t u = t + (uint64_t)k * data_threads;
      for (int j = 0; j < 4; ++j) z[k][j] = 0.0f;
      if (t >= data_threads || u >= row_units) continue;
      tpc_accumulate_packet_in_turn(&op, &a, in[base + u], base + u, folded, z[k]);
      const uint2 r = residual[base + u];
      const uint32_t words[2] = {r.x, r.y};
      tpc_accumulate(z[k], words, 2, a.dtype);
      for (int j = 0; j < 4; ++j) squares += z[k][j] * z[k][j];
    }

    int broken = 0;
    const float scale = rsqrtf(tpc_block_sum(squares, op.failed, &broken) * inv_n + a.eps);
#pragma unroll
    for (int k = 0; k < TPC_NORM_UNITS; ++k) {
      const uint64_t u = t + (uint64_t)k * data_threads;
      if (t >= data_threads || u >= row_units) continue;
      const uint2 wv = weight[u];
      const uint32_t wwords[2] = {wv.x, wv.y};
      float w[4];
      tpc_start(w, wwords, 2, a.dtype); /* -0 + w: w exactly */
      float normed[4];
      for (int j = 0; j < 4; ++j) normed[j] = z[k][j] * scale * w[j];
      uint32_t n[2], s[2];
      tpc_round(normed, n, 2, a.dtype);
      tpc_round(z[k], s, 2, a.dtype);
      out[base + u] = broken ? tpc_poison8(&a) : make_uint2(n[0], n[1]);
      out2[base + u] = broken ? tpc_poison8(&a) : make_uint2(s[0], s[1]);
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

#endif /* TPCOMM_ALL_REDUCE_NORM_CUH */
