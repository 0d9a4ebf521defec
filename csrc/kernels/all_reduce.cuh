/*
 * All-reduce kernels.
 *
 * packet: every rank pushes its input as packets into every peer's slot, then
 *   waits for the peers' packets at the same offsets and sums in rank order.
 *   No barrier: each thread needs only the packets at its own offsets.
 * bulk (two-shot): rank j owns chunk j. Scatter chunk j of the input into
 *   rank j's scatter slot, barrier, rank j sums its chunk and pushes the result
 *   into everyone's gather area, barrier, everyone copies out. Each rank sends
 *   2(n-1)/n of the input: the minimum for an all-reduce.
 * Both read only the input and registered buffers, so captured graphs need no
 * registration after capture; a block touches the same indices in every phase,
 * so in == out is safe.
 */
#ifndef TPCOMM_ALL_REDUCE_CUH
#define TPCOMM_ALL_REDUCE_CUH

#include "reduce.cuh"

__global__ void tpc_all_reduce_packet_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const uint64_t units = a.nbytes / TPC_PACKET_DATA_BYTES;
  const tpc_span span = tpc_data_span();
  const uint64_t first = span.first, stride = span.stride;
  const uint2 *in = (const uint2 *)a.in;
  uint2 v0 = make_uint2(0, 0); /* the first unit, loaded while the epoch is read */
  tpc_op op = tpc_op_begin(&a, [&] {
    if (first < units) v0 = in[first];
  });
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  const int folded = tpc_header_folded(1);
  tpc_header_exchange(&a, &op, folded);

  for (uint64_t u = first; u < units; u += stride) {
    const uint2 v = u == first ? v0 : in[u];
    for (int i = 1; i < a.world; ++i) {
      const int peer = (a.rank + i) % a.world; /* ranks start on different peers */
      tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, a.rank) + u * TPC_PACKET_BYTES, v, op.epoch);
    }
  }
  for (uint64_t u = first; u < units; u += stride) {
    const uint2 sum = tpc_sum_packet(&op, &a, u == first ? v0 : in[u], u, folded);
    ((uint2 *)a.out)[u] = tpc_op_broken(&op) ? tpc_poison8(&a) : sum;
  }
  tpc_op_end(&a, &op, 0);
}

/* First 16-byte unit of rank j's chunk: chunks differ by at most one unit. */
static __device__ __forceinline__ uint64_t tpc_chunk_begin(uint64_t units, int j, int world) {
  return units * (uint64_t)j / (uint64_t)world;
}

__global__ void tpc_all_reduce_bulk_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  tpc_header_send(&a, &op, 0);
  tpc_bulk_acquire(&a, &op);
  const int n = a.world, me = a.rank;
  const uint64_t units = a.nbytes / 16;
  const uint64_t slot_units = (units + n - 1) / n;
  const tpc_span span = tpc_data_span();
  const uint64_t first = span.first, stride = span.stride;
  const char *in = (const char *)a.in;
  char *out = (char *)a.out;
  /* scatter slot of `sender` in `owner`'s buffer, then the gathered result */
#define SCATTER_SLOT(owner, sender) (a.bufs[owner] + a.data_off + (uint64_t)(sender) * slot_units * 16)
#define GATHERED(owner) (a.bufs[owner] + a.data_off + (uint64_t)n * slot_units * 16)

  /* After a failed acquire a peer may still read its slots: write nothing. */
  for (int i = 1; i < n && !op.failed; ++i) {
    const int j = (me + i) % n;
    const uint64_t b = tpc_chunk_begin(units, j, n), e = tpc_chunk_begin(units, j + 1, n);
    for (uint64_t k = b + first; k < e; k += stride)
      tpc_store16(SCATTER_SLOT(j, me) + (k - b) * 16, tpc_load16(in + k * 16));
  }
  tpc_header_check(&a, &op);
  tpc_block_barrier(&a, &op, 0);

  const uint64_t b = tpc_chunk_begin(units, me, n), e = tpc_chunk_begin(units, me + 1, n);
  for (uint64_t k = b + first; k < e; k += stride) {
    const uint4 s = tpc_sum16(&a, tpc_load16(in + k * 16), SCATTER_SLOT(me, 0) + (k - b) * 16, slot_units * 16);
    const uint4 sum = tpc_op_broken(&op) ? tpc_poison16(&a) : s;
    tpc_store16(out + k * 16, sum);
    for (int i = 1; i < n; ++i) tpc_store16(GATHERED((me + i) % n) + k * 16, sum);
  }
  tpc_block_barrier(&a, &op, 1);

  const int broken = tpc_op_broken(&op);
  for (int i = 1; i < n; ++i) {
    const int j = (me + i) % n;
    const uint64_t cb = tpc_chunk_begin(units, j, n), ce = tpc_chunk_begin(units, j + 1, n);
    for (uint64_t k = cb + first; k < ce; k += stride)
      tpc_store16(out + k * 16, broken ? tpc_poison16(&a) : tpc_load16_from_peer(GATHERED(me) + k * 16));
  }
#undef SCATTER_SLOT
#undef GATHERED
  tpc_op_end(&a, &op, 1);
}

#endif /* TPCOMM_ALL_REDUCE_CUH */
