/*
 * All-gather kernels. Bit-exact for any dtype: data only moves, and packets
 * carry their flag beside the data, so no bit pattern is reserved.
 *
 * The output is the concatenation of the ranks' inputs along a dimension
 * whose contiguous run per rank is row_bytes: word w of rank q lands at
 * (w / row) * n * row + q * row + w % row (row in words).
 *
 * packet: push the input as packets to every peer, copy it to our own output,
 *   then wait for each peer's packets and place them. No barrier.
 * bulk: push the input into every peer's bulk slot, barrier, copy the slots
 *   out. Peers release the slots at the end (tpc_bulk_acquire).
 */
#ifndef TPCOMM_ALL_GATHER_CUH
#define TPCOMM_ALL_GATHER_CUH

#include "data_ops.cuh"
#include "primitives.cuh"

/* Position in the output of element `index` of rank q's input, in units of
 * the element (4 bytes for packets, 16 for bulk); row is in the same units.
 * Indices fit 32 bits (the caps keep buffers under 4 GiB), so the division is
 * a 32-bit one; dim 0 (a single row) needs none. */
static __device__ __forceinline__ uint64_t tpc_gather_index(uint64_t index, uint64_t row, int q, int n) {
  if (index < row) return (uint64_t)q * row + index;
  const uint32_t i = (uint32_t)index, r = (uint32_t)row;
  return (uint64_t)(i / r) * (uint64_t)n * row + (uint64_t)q * row + (i % r);
}

__global__ void tpc_all_gather_packet_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const int n = a.world, me = a.rank;
  const uint64_t words = a.nbytes / 4, row = a.row_bytes / 4;
  const uint64_t units = (words + 1) / 2; /* a packet carries two words */
  const tpc_span span = tpc_data_span();
  const uint64_t first = span.first, stride = span.stride;
  const uint32_t *in = (const uint32_t *)a.in;
  uint32_t *out = (uint32_t *)a.out;
  uint2 v0 = make_uint2(0, 0); /* the first unit, loaded while the epoch is read */
  tpc_op op = tpc_op_begin(&a, [&] {
    if (first < units) v0 = make_uint2(in[2 * first], 2 * first + 1 < words ? in[2 * first + 1] : 0u);
  });
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  const int folded = tpc_header_folded(1);
  tpc_header_exchange(&a, &op, folded);

  for (uint64_t u = first; u < units; u += stride) {
    const uint64_t w = 2 * u;
    const int pair = w + 1 < words;
    const uint2 v = u == first ? v0 : make_uint2(in[w], pair ? in[w + 1] : 0u);
    for (int i = 1; i < n; ++i) {
      const int peer = (me + i) % n;
      tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, me) + u * TPC_PACKET_BYTES, v, op.epoch);
    }
    out[tpc_gather_index(w, row, me, n)] = v.x;
    if (pair) out[tpc_gather_index(w + 1, row, me, n)] = v.y;
  }
  for (uint64_t u = first; u < units; u += stride) {
    const uint64_t w = 2 * u;
    const int pair = w + 1 < words;
    for (int i = 1; i < n; ++i) {
      const int q = (me + i) % n;
      uint2 v = tpc_packet_wait(&op, tpc_packet_slot(&a, me, op.epoch, q) + u * TPC_PACKET_BYTES, q, folded && u == 0);
      const uint64_t o = tpc_gather_index(w, row, q, n), o1 = tpc_gather_index(w + 1, row, q, n);
      if (tpc_op_broken(&op)) {
        if (!a.poison_out) continue;
        v = make_uint2(tpc_poison_word(&a, o), tpc_poison_word(&a, o1));
      }
      out[o] = v.x;
      if (pair) out[o1] = v.y;
    }
  }
  tpc_op_end(&a, &op, 0);
}

__global__ void tpc_all_gather_bulk_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  tpc_header_send(&a, &op, 0);
  tpc_bulk_acquire(&a, &op);
  const int n = a.world, me = a.rank;
  const uint64_t units = a.nbytes / 16, row = a.row_bytes / 16;
  const tpc_span span = tpc_data_span();
  const uint64_t first = span.first, stride = span.stride;
  const char *in = (const char *)a.in;
  char *out = (char *)a.out;
#define SLOT(owner, sender) (a.bufs[owner] + a.data_off + (uint64_t)(sender) * a.nbytes)

  for (uint64_t k = first; k < units; k += stride) {
    const uint4 v = tpc_load16(in + k * 16);
    /* After a failed acquire a peer may still read its slots: write nothing. */
    for (int i = 1; i < n && !op.failed; ++i) tpc_store16(SLOT((me + i) % n, me) + k * 16, v);
    tpc_store16(out + tpc_gather_index(k, row, me, n) * 16, v);
  }
  tpc_header_check(&a, &op);
  tpc_block_barrier(&a, &op, 0);
  const int broken = tpc_op_broken(&op);
  for (int i = 1; i < n && (!broken || a.poison_out); ++i) {
    const int q = (me + i) % n;
    for (uint64_t k = first; k < units; k += stride)
      tpc_store16(out + tpc_gather_index(k, row, q, n) * 16,
                  broken ? tpc_poison16(&a) : tpc_load16_from_peer(SLOT(me, q) + k * 16));
  }
#undef SLOT
  tpc_op_end(&a, &op, 1);
}

#endif /* TPCOMM_ALL_GATHER_CUH */
