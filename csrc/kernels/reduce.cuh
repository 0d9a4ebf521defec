/*
 * The sum of one packet unit across ranks, as the packet kernels (all_reduce,
 * reduce_scatter) compute it: in fp32, in rank order 0..n-1, this rank's own
 * value taken from its input, the peers' from the slots they pushed into.
 * The line and streamed kernels sum the same way (line.cuh, stream.cuh).
 */
#ifndef TPCOMM_REDUCE_CUH
#define TPCOMM_REDUCE_CUH

#include "data_ops.cuh"
#include "lifecycle.cuh"

/* Packet unit u (8 data bytes), 4 fp32 values in acc, not rounded: the
 * peers' packets for this epoch, waited for one peer after another; with
 * folded headers unit 0 also checks them (tpc_packet_wait). The fused norm
 * kernel sums this way at every world size: its register cap
 * (__launch_bounds__ of 17 warps) cannot hold every peer's packet of its
 * TPC_NORM_UNITS units at once. dtype: the calling kernel's template
 * constant, so that the conversions fold to the dtype's (inlined). */
TPC_DEVICE void tpc_accumulate_packet_in_turn(tpc_op *op, const tpc_kernel_args *a, uint2 own, uint64_t u, int folded,
                                              float acc[4], int dtype) {
  for (int q = 0; q < a->world; ++q) {
    const uint2 v = q == a->rank ? own : tpc_packet_from(op, u, q, folded);
    const uint32_t words[2] = {v.x, v.y};
    tpc_add_rank(acc, words, 2, dtype, q);
  }
}

/* The same sum; with three or more ranks the peers' packets are waited for
 * all at once (tpc_packets_from_peers). DTYPE: a tpc_dtype, the kernel's. */
template <int DTYPE>
TPC_DEVICE void tpc_accumulate_packet(tpc_op *op, const tpc_kernel_args *a, uint2 own, uint64_t u, int folded,
                                      float acc[4]) {
  if (a->world == 2) {
    tpc_accumulate_packet_in_turn(op, a, own, u, folded, acc, DTYPE);
    return;
  }
  uint2 got[TPC_MAX_RANKS];
  tpc_packets_from_peers(op, u, folded, got);
#pragma unroll
  for (int q = 0; q < TPC_MAX_RANKS; ++q) {
    if (q >= a->world) break;
    const uint2 v = q == a->rank ? own : got[q];
    const uint32_t words[2] = {v.x, v.y};
    tpc_add_rank(acc, words, 2, DTYPE, q);
  }
}

/* The same, rounded once to the dtype. Two ranks add in packed arithmetic
 * (tpc_sum_pair8, the same bits): the general loop's conversions and
 * rounding sit on the critical path of the smallest all_reduce
 * (latency_probe.cu: "with a packed bf16 sum"). */
template <int DTYPE>
TPC_DEVICE uint2 tpc_sum_packet(tpc_op *op, const tpc_kernel_args *a, uint2 own, uint64_t u, int folded) {
  if (a->world == 2) return tpc_sum_pair8(own, tpc_packet_from(op, u, 1 - a->rank, folded), DTYPE);
  float acc[4];
  tpc_accumulate_packet<DTYPE>(op, a, own, u, folded, acc);
  uint32_t sum[2];
  tpc_round(acc, sum, 2, DTYPE);
  return make_uint2(sum[0], sum[1]);
}

#endif /* TPCOMM_REDUCE_CUH */
