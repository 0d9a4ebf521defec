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
 * bulk (streamed, stream.cuh): the steps are laid over one chunk, so a
 *   warp's step covers the same units of every chunk. A warp pushes its
 *   step of chunk j into rank j's slot for this sender, for every peer j,
 *   and sums its step of our chunk in rank order as soon as every peer has
 *   signalled it; step i+1 is pushed before step i is summed. No barrier:
 *   the first phase of the two-shot all-reduce (all_reduce.cuh) without its
 *   gather. Each rank sends (n-1)/n of its input, the minimum.
 * Each comes in two builds: OutF32 = 0 rounds the sums to the input's dtype;
 * OutF32 = 1 writes them as fp32, unrounded (a.out_f32: the bulk path of
 * all_reduce_add_rms_norm adds the residual before it rounds). What moves
 * between ranks is the same; only the local output differs. Each is also
 * templated on its dtype (DTYPE: a tpc_dtype), as the all-reduce kernels.
 */
#ifndef TPCOMM_REDUCE_SCATTER_CUH
#define TPCOMM_REDUCE_SCATTER_CUH

#include "line.cuh"
#include "reduce.cuh"
#include "stream_sum.cuh"

/* Stores the fp32 sums of one unit of UNIT_BYTES input bytes (8: a packet
 * unit, 16: a line's or a stream's) at unit index u of a float output: a
 * sum for each of its values of DTYPE. */
template <int DTYPE, int UNIT_BYTES>
TPC_DEVICE void tpc_store_sums_f32(const tpc_kernel_args *a, uint64_t u, const float *acc, int broken) {
  constexpr int values = UNIT_BYTES / (DTYPE == TPC_FLOAT32 ? 4 : 2);
  uint32_t *out = (uint32_t *)a->out + u * (uint64_t)values;
  for (int i = 0; i < values; i += 4) {
    const uint4 v = broken ? tpc_poison16(a)
                           : make_uint4(__float_as_uint(acc[i]), __float_as_uint(acc[i + 1]),
                                        __float_as_uint(acc[i + 2]), __float_as_uint(acc[i + 3]));
    if (values - i >= 4) *(uint4 *)(out + i) = v;
    else *(uint2 *)(out + i) = make_uint2(v.x, v.y);
  }
}

template <int DTYPE, int OutF32>
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
      tpc_accumulate_packet<DTYPE>(&op, &a, in[me * units + u], u, folded, acc);
      tpc_store_sums_f32<DTYPE, 8>(&a, u, acc, tpc_op_broken(&op));
    } else {
      const uint2 sum = tpc_sum_packet<DTYPE>(&op, &a, in[me * units + u], u, folded);
      ((uint2 *)a.out)[u] = tpc_op_broken(&op) ? tpc_poison8(&a) : sum;
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* Lines are laid out over one chunk (a.nbytes); warp w takes steps of the
 * n-1 other chunks t = w, w + W, ... (chunk me + 1 + t / steps, step t % steps)
 * and then the steps of its own. */
template <int DTYPE, int OutF32>
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
      tpc_line_accumulate<DTYPE>(&op, &l, s, own, s == 0, acc);
      if (u < l.units) tpc_store_sums_f32<DTYPE, 16>(&a, u, acc, tpc_op_broken(&op));
    } else {
      tpc_line_store(&op, &l, a.out, u, tpc_line_sum<DTYPE>(&op, &l, s, own, s == 0));
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* The bulk kernel (tpc_reduce_scatter_bulk_kernel), any world size.
 *
 * Steps: the stream's (stream.cuh) over one chunk, a.nbytes: C = nbytes / 16
 * 16-byte units, chunk-local units x in [0, C), every chunk whole; chunk o
 * of the input starts at in + o * nbytes. The grid (tpc_stream_geometry(C))
 * depends on the size and the world only, so block b of every rank takes
 * the same steps.
 *
 * Slots: in rank p's half of the bulk region, sender q's slot (packed as
 * q - (q > p), tpc_stream_slot) holds q's chunk p at offset x: n-1 slots of
 * C units, the one-shot all-reduce's layout. They always fit in the op's
 * half (TPC_BULK_HALF): the core caps a bulk reduce-scatter at nbytes <=
 * max_bytes / n (ops.c: parts = world), so (n-1) nbytes < n nbytes <=
 * max_bytes, and a half is data_bytes / 2 >= max_bytes + 8n (layout.h:
 * data_bytes = round_up(2 max_bytes + 16n, 4096), a multiple of 32). So the
 * kernel never takes the whole region, and the next op may start while a
 * peer still reads this one.
 *
 * Each data warp, over its block steps i = 0 .. S-1: pushes step 0, then
 * for each i pushes step i+1 (if any), waits for every peer's count of step
 * i (the first wait also checks the headers) and sums step i of its own
 * chunk. Counts are the one-shot's (tpc_stream_mark): 1 after the push of
 * step 0, i+2 after the push of step i+1, so count j+1 covers the push of
 * step j and the control warp's last is S.
 * No deadlock: the wait for step i needs only the peers' pushes of step i,
 * which every warp marks before its own wait for step i-1 (step 0: before
 * the loop), so the earliest wait no warp passes would need only counts
 * every warp has marked, which the control warps send.
 *
 * Memory order: stream.cuh's chain. A warp's stores into a peer's slot ->
 * __syncwarp and the block-scope release of its count -> the control
 * warp's acquire of it and its system-scope release of the peer's flag ->
 * the peer warp's system-scope acquire of the flag (tpc_stream_wait) -> its
 * loads of the slot. Every slot unit is written once per op; across ops,
 * tpc_bulk_acquire orders the peers' reads of a half before the next op
 * that takes it writes it.
 *
 * Results: the sums of chunk me in rank order in fp32 from -0.0
 * (tpc_stream_sum: tpc_add_rank over this rank's input and the peers'
 * slots), what every reducing kernel adds, rounded once to the dtype
 * (tpc_stream_reduce; on two ranks in packed arithmetic, the same bits:
 * data_ops.cuh) or written as fp32 (OutF32). Poison once the op broke, if
 * out takes it (a.poison_out).
 *
 * in == out is safe where out is one of in's chunks (out and the chunk
 * alike in size: not the fp32 sums of a 16-bit dtype): unit x of every
 * chunk is touched by one lane only, which reads in[o*C+x] for every o (the
 * push of step j, or its own chunk's load in the sums of step j) before it
 * writes out[x] (the sums of step j). */

/* Step t of every peer o's chunk of the input into o's slot for this
 * sender (tpc_stream_scatter). */
TPC_DEVICE void tpc_reduce_scatter_push(const tpc_op *op, const tpc_steps *s, uint32_t t) {
  const tpc_kernel_args *a = op->args;
  tpc_stream_scatter(
      op, s, t, a->nbytes, [&](int) { return s->units; },
      [&](int o) { return tpc_stream_slot(a, s, o, a->rank); });
}

/* Step t of this rank's chunk summed (the peers' from this rank's slots,
 * already waited for) into out: rounded to the dtype, or fp32 (4 or 8
 * values a 16-byte unit); NaN once the op broke. */
template <int DTYPE, int OutF32>
TPC_DEVICE void tpc_reduce_scatter_sum(const tpc_op *op, const tpc_steps *s, uint32_t t) {
  const tpc_kernel_args *a = op->args;
  uint4 own[TPC_STREAM_UNITS];
  tpc_stream_load(s, (const char *)a->in + (uint64_t)a->rank * a->nbytes, t, own);
  if (!OutF32) {
    tpc_stream_reduce<DTYPE>(op, s, t, own, (char *)a->out);
    return;
  }
  tpc_stream_sum<DTYPE>(op, s, t, own, [&](uint64_t u, const float *sums, int broken) {
    tpc_store_sums_f32<DTYPE, 16>(a, u, sums, broken);
  });
}

/* One block a multiprocessor, said outright: without it ptxas aims the fp32
 * and bf16 instantiations that round at two (96 registers) and spills. */
template <int DTYPE, int OutF32>
__global__ void __launch_bounds__(TPC_STREAM_MAX_THREADS, 1)
    tpc_reduce_scatter_bulk_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_stream_op(
      &a, [&](tpc_op *op, const tpc_steps *s, uint32_t t) { tpc_reduce_scatter_push(op, s, t); },
      [&](tpc_op *op, const tpc_steps *s, uint32_t t) {
        if (!tpc_op_broken(op) || a.poison_out) tpc_reduce_scatter_sum<DTYPE, OutF32>(op, s, t);
      });
}

#endif /* TPCOMM_REDUCE_SCATTER_CUH */
