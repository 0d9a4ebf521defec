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
 *   send (n-1) times the input, so larger worlds keep the two-shot.
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

#include "line.cuh"
#include "reduce.cuh"
#include "stream.cuh"

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
    const uint2 sum = tpc_sum_packet(&op, &a, u == p.span.first ? p.v0 : in[u], u, p.folded);
    ((uint2 *)a.out)[u] = tpc_op_broken(&op) ? tpc_poison8(&a) : sum;
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

__global__ void tpc_all_reduce_line_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const tpc_lines l = tpc_lines_of(&a);
  uint4 v0;
  tpc_op op = tpc_line_begin(&a, &l, &v0);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  /* the header is checked in warp 0's first waits */

  for (uint64_t s = l.first; s < l.steps; s += l.stride) tpc_line_push(&op, &l, s, tpc_line_own(&l, a.in, s, v0));
  for (uint64_t s = l.first; s < l.steps; s += l.stride) {
    const uint4 own = tpc_line_own(&l, a.in, s, v0);
    uint4 sum;
    if (a.world == 2) {
      sum = tpc_sum_pair16(own, tpc_line_wait(&op, &l, s, 1 - a.rank, s == 0), a.dtype);
    } else {
      float acc[8];
      tpc_line_accumulate(&op, &l, s, own, s == 0, acc);
      uint32_t w[4];
      tpc_round(acc, w, 4, a.dtype);
      sum = make_uint4(w[0], w[1], w[2], w[3]);
    }
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
    const uint4 sum = tpc_line_sum<true>(&op, &l, s, tpc_line_load(&l, a.in, s), s == cb);
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

/* The sum of step t in rank order (own values from `own`, the peers' from
 * this rank's slots, already waited for), or NaN once the op broke, into out.
 * Ranks are the outer loop so that a peer's TPC_STREAM_UNITS loads are in
 * flight together (summing unit by unit, with the rank loop inside, leaves
 * one load in flight, and the large ops wait on each). The slots are read
 * after tpc_stream_wait's acquire of the peer's flag, which the peer's
 * control warp released after these units landed (stream.cuh). */
TPC_DEVICE void tpc_stream_reduce(const tpc_op *op, const tpc_steps *s, uint32_t t,
                                  const uint4 own[TPC_STREAM_UNITS], char *out) {
  const tpc_kernel_args *a = op->args;
  if (a->world == 2) { /* the same bits in packed arithmetic: 16-bit sums cost as much as fp32 */
    const char *slot = tpc_stream_slot(a, s, a->rank, 1 - a->rank);
    uint4 v[TPC_STREAM_UNITS];
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
      const uint64_t u = tpc_stream_unit(s, t, k);
      v[k] = u < s->units ? tpc_load16_from_peer(slot + u * 16) : make_uint4(0, 0, 0, 0);
    }
    const int broken = tpc_op_broken(op);
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
      const uint64_t u = tpc_stream_unit(s, t, k);
      if (u < s->units) tpc_store16(out + u * 16, broken ? tpc_poison16(a) : tpc_sum_pair16(own[k], v[k], a->dtype));
    }
    return;
  }
  float acc[TPC_STREAM_UNITS][8];
  for (int q = 0; q < a->world; ++q) {
    const char *slot = q == a->rank ? NULL : tpc_stream_slot(a, s, a->rank, q);
    uint4 v[TPC_STREAM_UNITS];
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
      const uint64_t u = tpc_stream_unit(s, t, k);
      v[k] = !slot ? own[k] : u < s->units ? tpc_load16_from_peer(slot + u * 16) : make_uint4(0, 0, 0, 0);
    }
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
      const uint32_t words[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
      tpc_add_rank(acc[k], words, 4, a->dtype, q);
    }
  }
  const int broken = tpc_op_broken(op);
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t u = tpc_stream_unit(s, t, k);
    uint32_t w[4];
    tpc_round(acc[k], w, 4, a->dtype);
    if (u < s->units) tpc_store16(out + u * 16, broken ? tpc_poison16(a) : make_uint4(w[0], w[1], w[2], w[3]));
  }
}

/* Each data warp pushes step i+1 before it waits for and sums step i, so the
 * link carries the next step while the warp reads the last; the own input of
 * the two steps stays in registers. in == out is safe: a lane writes only
 * units whose input it already holds. */
__global__ void __launch_bounds__(TPC_STREAM_MAX_THREADS)
    tpc_all_reduce_stream_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  tpc_steps s;
  if (tpc_stream_start(&op, &s)) {
    const char *in = (const char *)a.in;
    uint4 cur[TPC_STREAM_UNITS], next[TPC_STREAM_UNITS];
    tpc_stream_load(&s, in, 0, cur);
    tpc_stream_push(&op, &s, 0, cur);
    tpc_stream_mark(&op, &s, 1);
    for (uint32_t i = 0; i < s.block_steps; ++i) {
      const int more = i + 1 < s.block_steps;
      if (more) {
        tpc_stream_load(&s, in, i + 1, next);
        tpc_stream_push(&op, &s, i + 1, next);
        tpc_stream_mark(&op, &s, i + 2);
      }
      tpc_stream_wait(&op, &s, i + 1, i == 0);
      tpc_stream_reduce(&op, &s, i, cur, (char *)a.out);
      if (more)
        for (int k = 0; k < TPC_STREAM_UNITS; ++k) cur[k] = next[k];
    }
  }
  tpc_op_end(&a, &op, TPC_BULK_HALF);
}

/* First 16-byte unit of rank j's chunk: chunks differ by at most one unit. */
static __device__ __forceinline__ uint64_t tpc_chunk_begin(uint64_t units, int j, int world) {
  return units * (uint64_t)j / (uint64_t)world;
}

__global__ void tpc_all_reduce_bulk_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  tpc_bulk_acquire(&a, &op, TPC_BULK_WHOLE);
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
  tpc_header_check(&a, &op, 0);
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
  tpc_op_end(&a, &op, TPC_BULK_WHOLE);
}

#endif /* TPCOMM_ALL_REDUCE_CUH */
