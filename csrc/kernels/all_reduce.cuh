/*
 * All-reduce kernels.
 *
 * packet: every rank pushes its input as packets into every peer's slot, then
 *   waits for the peers' packets at the same offsets and sums in rank order.
 *   No barrier: each thread needs only the packets at its own offsets.
 * stream (one-shot, the bulk kernel of two ranks): every rank pushes its whole
 *   input into every peer's slot, step by step (stream.cuh), and each warp
 *   sums a step as soon as the peers have signalled it. On two ranks this
 *   moves what the two-shot moves (the input's size each way) in one phase
 *   instead of two, with no barrier and no copy-out; with n ranks it would
 *   send (n-1) times the input, so larger worlds take the bulk two-shot.
 * line (line.cuh): the packet kernel's scheme with 128-byte lines that carry
 *   112 data bytes and one flag, where packets carry 8 of 16: for the sizes
 *   where the link, not the latency, sets the time.
 * two_shot (line.cuh's lines, in two phases): the warp steps are cut into
 *   world chunks and rank j owns chunk j. Every rank pushes chunk j's lines
 *   into rank j's slot; rank j sums its chunk in rank order, as soon as a
 *   step's lines are in, and pushes the sums into every peer's slot; every
 *   rank gathers the other chunks' sums. Each rank sends 2(n-1)/n of the
 *   input where the one-shot line kernel sends (n-1) times it, for a second
 *   hop; no barrier, no flag but the lines' own.
 * bulk (streamed two-shot, the bulk kernel of three or more ranks): rank j
 *   owns chunk j, and the stream's steps (stream.cuh) are laid over one
 *   chunk, so a warp's step covers the same units of every chunk. A warp
 *   pushes its input of a step of chunk j into rank j's scatter slot, for
 *   every peer j; as soon as the peers have signalled that step, it sums its
 *   own chunk's units in rank order and pushes the sums into every peer's
 *   gather slot; as soon as the peers have signalled their sums, it copies
 *   them out. Step i+1 is scattered before step i is summed, and step i-1
 *   gathered after it: no barrier, and every link carries the same load in
 *   both phases. Each rank sends 2(n-1)/n of the input: the minimum for an
 *   all-reduce.
 * Each is templated on its dtype (DTYPE: a tpc_dtype; launch.cu picks the
 * instantiation from a.dtype), so that the sums convert and round with the
 * dtype's instructions and test no dtype per value.
 * The stream and bulk kernels read only the input and registered buffers, so
 * captured graphs need no registration after capture; a lane touches the same
 * units in every phase, so in == out is safe.
 */
#ifndef TPCOMM_ALL_REDUCE_CUH
#define TPCOMM_ALL_REDUCE_CUH

#include "line.cuh"
#include "reduce.cuh"
#include "stream_sum.cuh"
#include "two_shot.cuh"

template <int DTYPE>
__global__ void tpc_all_reduce_packet_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const uint64_t units = a.nbytes / TPC_PACKET_DATA_BYTES;
  const uint2 *in = (const uint2 *)a.in;
  tpc_packet_start p;
  if (!tpc_packet_prologue(&a, units, [&](uint64_t u) { return in[u]; }, &p)) return;
  tpc_op &op = p.op;

  for (uint64_t u = p.span.first; u < units; u += p.span.stride) {
    const uint2 v = u == p.span.first ? p.v0 : in[u];
    tpc_packet_push(&a, op.epoch, u, [&](int) { return v; });
  }
  for (uint64_t u = p.span.first; u < units; u += p.span.stride) {
    const uint2 sum = tpc_sum_packet<DTYPE>(&op, &a, u == p.span.first ? p.v0 : in[u], u, p.folded);
    ((uint2 *)a.out)[u] = tpc_op_broken(&op) ? tpc_poison8(&a) : sum;
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

template <int DTYPE>
__global__ void tpc_all_reduce_line_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const tpc_lines l = tpc_lines_of(&a);
  uint4 v0;
  tpc_op op = tpc_line_begin(&a, &l, &v0);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  /* the header is checked in warp 0's first waits */

  for (uint64_t s = l.first; s < l.steps; s += l.stride) tpc_line_push(&op, &l, s, tpc_line_own(&l, a.in, s, v0));
  for (uint64_t s = l.first; s < l.steps; s += l.stride) {
    const uint4 sum = tpc_line_sum<DTYPE>(&op, &l, s, tpc_line_own(&l, a.in, s, v0), s == 0);
    const uint64_t u = tpc_line_unit(&l, s);
    if (u < l.units) tpc_store16((char *)a.out + u * 16, tpc_op_broken(&op) ? tpc_poison16(&a) : sum);
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* Slots: in rank p's buffer, sender q's slot holds q's lines of chunk p
 * (phase one) and q's sums of chunk q (phase two), disjoint lines, each
 * written once per op with the op's epoch as flag.
 * Reuse: every chunk has at least one step (the core checks), so no rank
 * finishes an op without a line from every peer; a peer that sent one in op
 * e+1 has finished op e, so, as with packets, a rank is at most one op ahead
 * and slots by epoch parity are never overwritten while read.
 * Headers: each rank checks every peer's in the first step of its chunk,
 * and the owner's in the first step of each chunk it gathers.
 * A warp that fails in phase one pushes no sums: its peers stop at the
 * record that failure sends them (tpc_record), never on stale sums.
 * in == out is safe: a step of another chunk is pushed and gathered by the
 * same warp in that order; a step of the own chunk is read before its sum is
 * written. */
template <int DTYPE>
__global__ void tpc_all_reduce_two_shot_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const tpc_lines l = tpc_lines_of(&a);
  const int n = a.world, me = a.rank;
  const uint64_t cb = tpc_line_chunk(l.steps, me, n), ce = tpc_line_chunk(l.steps, me + 1, n);
  const uint64_t others = l.steps - (ce - cb); /* steps of the other chunks, indexed t */
  auto step_of = [&](uint64_t t) { return t < cb ? t : t + (ce - cb); };
  uint4 v0 = make_uint4(0, 0, 0, 0);
  tpc_op op = tpc_op_begin(&a, [&] {
    if (l.first < others) v0 = tpc_line_load(&l, a.in, step_of(l.first));
  });
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);

  for (uint64_t t = l.first; t < others; t += l.stride) {
    const uint64_t s = step_of(t);
    tpc_line_put(&op, &l, s, t == l.first ? v0 : tpc_line_load(&l, a.in, s), tpc_line_chunk_of(l.steps, s, n));
  }
  for (uint64_t s = cb + l.first; s < ce; s += l.stride) {
    const uint4 sum = tpc_line_sum<DTYPE>(&op, &l, s, tpc_line_load(&l, a.in, s), s == cb);
    if (!tpc_op_broken(&op)) tpc_line_push(&op, &l, s, sum);
    tpc_line_store(&op, &l, a.out, tpc_line_unit(&l, s), sum);
  }
  for (uint64_t t = l.first; t < others; t += l.stride) {
    const uint64_t s = step_of(t);
    const int owner = tpc_line_chunk_of(l.steps, s, n);
    const uint4 v = tpc_line_wait(&op, &l, s, owner, s == tpc_line_chunk(l.steps, owner, n));
    tpc_line_store(&op, &l, a.out, tpc_line_unit(&l, s), v);
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* Each data warp pushes step i+1 before it waits for and sums step i, so the
 * link carries the next step while the warp reads the last; the own input of
 * the two steps stays in registers. in == out is safe: a lane writes only
 * units whose input it already holds. One block a multiprocessor, said
 * outright as for the bulk kernel below: without it ptxas aims the fp32
 * instantiation at two (96 registers) and spills. */
template <int DTYPE>
__global__ void __launch_bounds__(TPC_STREAM_MAX_THREADS, 1)
    tpc_all_reduce_stream_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const char *in = (const char *)a.in;
  uint4 cur[TPC_STREAM_UNITS], next[TPC_STREAM_UNITS];
  tpc_stream_op(
      &a,
      [&](tpc_op *op, const tpc_steps *s, uint32_t t) {
        if (t == 0) {
          tpc_stream_load(s, in, t, cur);
          tpc_stream_push(op, s, t, cur);
        } else {
          tpc_stream_load(s, in, t, next);
          tpc_stream_push(op, s, t, next);
        }
      },
      [&](tpc_op *op, const tpc_steps *s, uint32_t t) {
        tpc_stream_reduce<DTYPE>(op, s, t, cur, (char *)a.out);
        if (t + 1 < s->block_steps)
          for (int k = 0; k < TPC_STREAM_UNITS; ++k) cur[k] = next[k];
      });
}

/* It starts as tpc_stream_start does, with the steps over one chunk, its
 * part of the region, and 2S+1 as the control warp's last count (below).
 * Each data warp, over its block steps i = 0 .. S-1: scatters step 0, then
 * for each i scatters step i+1 (if any), sums step i and gathers step i-1;
 * after the loop it gathers step S-1. No barrier: each phase waits only for
 * the peers' counts of the steps it reads.
 *
 * Counts (tpc_stream_mark; one per warp, so the flags and the control warp
 * are the one-shot's): 1 after the scatter of step 0; in iteration i, 2i+2
 * after the scatter of step i+1 (also where there is none) and 2i+3 after
 * the sums of step i; the last is 2S+1. So the scatter of step j is covered
 * by a count of (j == 0 ? 1 : 2j) and the sums of step j by 2j+3, and the
 * sums of step i wait for the first, the gather of step i for the second.
 * The count only grows: each warp marks 1, 2, 3, ... in program order, and
 * the control warp sends the smallest over the block's warps, which only
 * grows too (tpc_stream_signal_all sends a larger one only).
 * No deadlock: every rank's warps run the same sequence of events, and each
 * wait needs only events of the peers that come strictly earlier in that
 * sequence than the wait itself (the sums of step i wait for a scatter of
 * step i, marked one event or more before it; the gather of step i-1 for
 * the sums of step i-1, marked before the scatter of step i+1). So by
 * induction over the sequence every warp of every rank passes every event:
 * the earliest event no warp passes would wait only for counts every warp
 * has marked, which the control warps send.
 *
 * Memory order: both phases are stream.cuh's chain. A warp's stores into a
 * peer's slots (scatter or sums) -> __syncwarp and the block-scope release
 * of its count -> the control warp's acquire of it and its system-scope
 * release of the peer's flag -> the peer warp's system-scope acquire of the
 * flag (tpc_stream_wait) -> its loads of the slot. Every slot unit is
 * written once per op, so within an op nothing is written after it was
 * read; across ops, tpc_bulk_acquire orders the peers' reads of the part of
 * the region an op takes before its writes.
 *
 * Results: only the owner sums its chunk, in rank order in fp32 from -0.0,
 * rounded once (tpc_add_rank, tpc_round: what every reducing kernel does,
 * reduce.cuh), and the other ranks copy its bits, so every rank has the same
 * bits.
 *
 * in == out is safe: a unit (o, x) is touched by one lane only, in every
 * phase: for a peer's chunk it reads in[o*C+x] (scatter of step j) before it
 * writes out[o*C+x] (gather of step j, later), for its own chunk it reads
 * in[me*C+x] before it writes out[me*C+x] (both in the sums of the step).
 *
 * At least one block a multiprocessor is all the launch needs; said outright,
 * since without it ptxas aims at two (96 registers) and spills. */
template <int DTYPE>
__global__ void __launch_bounds__(TPC_STREAM_MAX_THREADS, 1)
    tpc_all_reduce_bulk_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_op op = tpc_stream_op_begin(&a);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  const tpc_two_shot c = tpc_two_shot_of(&a);
  const tpc_steps s = tpc_stream_of(&a, tpc_bulk_acquire(&a, &op, c.use), c.chunk, c.use);
  tpc_two_shot_run<tpc_two_shot, tpc_two_shot_scatter, tpc_two_shot_reduce<DTYPE>, tpc_two_shot_gather>(&op, &s, &c);
  tpc_op_end(&a, &op, c.use);
}

#endif /* TPCOMM_ALL_REDUCE_CUH */
