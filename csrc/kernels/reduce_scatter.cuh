/*
 * Reduce-scatter kernels. Rank r's output is the sum over ranks of chunk r
 * of their input (NCCL's reduce_scatter_tensor layout: the input is world
 * chunks of a.nbytes each). Sums in fp32 in rank order 0..n-1 from -0.0, as
 * all_reduce, so every rank's chunk has the bits an all_reduce would give it.
 *
 * packet: push chunk j of the input as packets into rank j's slot for this
 *   sender, then wait for the peers' packets of our chunk and sum. No barrier;
 *   each rank sends (n-1)/n of its input, the minimum.
 * line (line.cuh): the packet kernel's scheme in 128-byte lines: chunk j's
 *   lines go into rank j's slot, and each rank sums its chunk's lines in rank
 *   order. Every rank waits for a line from every peer, so a rank is at most
 *   one op ahead, as with packets.
 * bulk: push chunk j into rank j's bulk slot for this sender, barrier, sum
 *   our chunk from the slots. Peers release the slots at the end
 *   (tpc_bulk_acquire), as for the other bulk kernels.
 * Each comes in two builds: OutF32 = 0 rounds the sums to the input's dtype;
 * OutF32 = 1 writes them as fp32, unrounded (a.out_f32: the bulk path of
 * all_reduce_add_rms_norm adds the residual before it rounds). What moves
 * between ranks is the same; only the local output differs.
 */
#ifndef TPCOMM_REDUCE_SCATTER_CUH
#define TPCOMM_REDUCE_SCATTER_CUH

#include "line.cuh"
#include "reduce.cuh"

/* Stores the fp32 sums of one unit (2 or 4 values for a packet unit, 4 or 8
 * for a 16-byte one: fp32 or 16-bit input) at unit index u of a float output. */
TPC_DEVICE void tpc_store_sums_f32(const tpc_kernel_args *a, uint64_t u, const float *acc, int values, int broken) {
  uint32_t *out = (uint32_t *)a->out + u * (uint64_t)values;
  for (int i = 0; i < values; i += 4) {
    const uint4 v = broken ? tpc_poison16(a)
                           : make_uint4(__float_as_uint(acc[i]), __float_as_uint(acc[i + 1]),
                                        __float_as_uint(acc[i + 2]), __float_as_uint(acc[i + 3]));
    if (values - i >= 4) *(uint4 *)(out + i) = v;
    else *(uint2 *)(out + i) = make_uint2(v.x, v.y);
  }
}

template <int OutF32>
__global__ void tpc_reduce_scatter_packet_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_packet_start p;
  if (!tpc_packet_prologue(&a, 0, tpc_no_prefetch(), &p)) return;
  tpc_op &op = p.op;
  const int folded = p.folded;
  const int me = a.rank;
  const uint64_t units = a.nbytes / TPC_PACKET_DATA_BYTES; /* per chunk */
  const tpc_span span = p.span;
  const uint2 *in = (const uint2 *)a.in;

  for (uint64_t u = span.first; u < units; u += span.stride)
    tpc_packet_push(&a, op.epoch, u, [&](int peer) { return in[peer * units + u]; });
  for (uint64_t u = span.first; u < units; u += span.stride) {
    if (OutF32) {
      float acc[4];
      tpc_accumulate_packet(&op, &a, in[me * units + u], u, folded, acc);
      tpc_store_sums_f32(&a, u, acc, a.dtype == TPC_FLOAT32 ? 2 : 4, tpc_op_broken(&op));
    } else {
      const uint2 sum = tpc_sum_packet(&op, &a, in[me * units + u], u, folded);
      ((uint2 *)a.out)[u] = tpc_op_broken(&op) ? tpc_poison8(&a) : sum;
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* Lines are laid out over one chunk (a.nbytes); warp w takes steps of the
 * n-1 other chunks t = w, w + W, ... (chunk me + 1 + t / steps, step t % steps)
 * and then the steps of its own. */
template <int OutF32>
__global__ void tpc_reduce_scatter_line_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const tpc_lines l = tpc_lines_of(&a);
  const int n = a.world, me = a.rank;
  const uint64_t others = (uint64_t)(n - 1) * l.steps;
  auto chunk_of = [&](uint64_t t) { return (int)((me + 1 + t / l.steps) % n); };
  auto chunk_in = [&](int j) { return (const char *)a.in + (uint64_t)j * a.nbytes; };
  uint4 v0 = make_uint4(0, 0, 0, 0);
  tpc_op op = tpc_op_begin(&a, [&] {
    if (l.first < others) v0 = tpc_line_load(&l, chunk_in(chunk_of(l.first)), l.first % l.steps);
  });
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);

  for (uint64_t t = l.first; t < others; t += l.stride) {
    const int j = chunk_of(t);
    const uint64_t s = t % l.steps;
    tpc_line_put(&op, &l, s, t == l.first ? v0 : tpc_line_load(&l, chunk_in(j), s), j);
  }
  for (uint64_t s = l.first; s < l.steps; s += l.stride) {
    const uint4 own = tpc_line_load(&l, chunk_in(me), s);
    const uint64_t u = tpc_line_unit(&l, s);
    if (OutF32) {
      float acc[8];
      tpc_line_accumulate_together(&op, &l, s, own, s == 0, acc);
      const int values = a.dtype == TPC_FLOAT32 ? 4 : 8;
      if (u < l.units) tpc_store_sums_f32(&a, u, acc, values, tpc_op_broken(&op));
    } else {
      tpc_line_store(&op, &l, a.out, u, tpc_line_sum<true>(&op, &l, s, own, s == 0));
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

template <int OutF32>
__global__ void tpc_reduce_scatter_bulk_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  tpc_bulk_acquire(&a, &op, TPC_BULK_WHOLE);
  const int n = a.world, me = a.rank;
  const uint64_t units = a.nbytes / 16; /* per chunk */
  const tpc_span span = tpc_data_span();
  const char *in = (const char *)a.in;
#define SLOT(owner, sender) (a.bufs[owner] + a.data_off + (uint64_t)(sender) * a.nbytes)

  /* After a failed acquire a peer may still read its slots: write nothing. */
  for (int i = 1; i < n && !op.failed; ++i) {
    const int j = (me + i) % n;
    for (uint64_t k = span.first; k < units; k += span.stride)
      tpc_store16(SLOT(j, me) + k * 16, tpc_load16(in + (j * units + k) * 16));
  }
  tpc_header_check(&a, &op, 0);
  tpc_block_barrier(&a, &op);
  const int broken = tpc_op_broken(&op);
  for (uint64_t k = span.first; k < units && (!broken || a.poison_out); k += span.stride) {
    if (OutF32) {
      float acc[8];
      tpc_accumulate16(&a, tpc_load16(in + (me * units + k) * 16), SLOT(me, 0) + k * 16, a.nbytes, acc);
      tpc_store_sums_f32(&a, k, acc, a.dtype == TPC_FLOAT32 ? 4 : 8, broken);
    } else {
      const uint4 s = tpc_sum16(&a, tpc_load16(in + (me * units + k) * 16), SLOT(me, 0) + k * 16, a.nbytes);
      tpc_store16((char *)a.out + k * 16, broken ? tpc_poison16(&a) : s);
    }
  }
#undef SLOT
  tpc_op_end(&a, &op, TPC_BULK_WHOLE);
}

#endif /* TPCOMM_REDUCE_SCATTER_CUH */
