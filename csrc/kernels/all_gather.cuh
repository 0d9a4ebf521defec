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
 * line (line.cuh): the packet scheme with 128-byte lines of 112 data bytes
 *   and one flag; 16-byte rows and sizes.
 * bulk (streamed, stream.cuh): every warp pushes its steps of the input into
 *   every peer's bulk slot and copies them to its own output, and places a
 *   peer's step as soon as that peer has signalled it: step i+1 is pushed
 *   before step i is waited for. Peers release the slots at the end
 *   (tpc_bulk_acquire).
 */
#ifndef TPCOMM_ALL_GATHER_CUH
#define TPCOMM_ALL_GATHER_CUH

#include "data_ops.cuh"
#include "line.cuh"
#include "lifecycle.cuh"
#include "stream.cuh"

/* Position in the output of element `index` of rank q's input, in units of
 * the element (4 bytes for packets, 16 for bulk); row is in the same units.
 * Indices fit 32 bits (the caps keep buffers under 4 GiB), so the division is
 * a 32-bit one; dim 0 (a single row) needs none. */
static __device__ __forceinline__ uint64_t tpc_gather_index(uint64_t index, uint64_t row, int q, int n) {
  if (index < row) return (uint64_t)q * row + index;
  const uint32_t i = (uint32_t)index, r = (uint32_t)row;
  return (uint64_t)(i / r) * (uint64_t)n * row + (uint64_t)q * row + (i % r);
}

/* Packet unit u (words 2u, 2u+1) of this rank's input; past the end of an
 * odd number of words, 0. `wide`: sizes, rows and both pointers are 8-byte
 * multiples, so a unit is one 8-byte load and lands as one 8-byte store
 * instead of two 4-byte ones (latency_probe.cu times the difference). */
TPC_DEVICE uint2 tpc_gather_load(const tpc_kernel_args *a, uint64_t u, int wide) {
  const uint32_t *in = (const uint32_t *)a->in;
  if (wide) return ((const uint2 *)in)[u];
  return make_uint2(in[2 * u], 2 * u + 1 < a->nbytes / 4 ? in[2 * u + 1] : 0u);
}

/* Unit u of rank q's input, v, into its place in the output; with `broken`,
 * NaN there instead where the output is floating, nothing where not. */
TPC_DEVICE void tpc_gather_store(const tpc_kernel_args *a, uint64_t u, int q, uint2 v, int wide, int broken) {
  const uint64_t row = a->row_bytes / 4, w = 2 * u;
  uint32_t *out = (uint32_t *)a->out;
  const uint64_t o = tpc_gather_index(w, row, q, a->world);
  if (wide) { /* o is even: rows hold whole units */
    if (broken && !a->poison_out) return;
    *(uint2 *)(out + o) = broken ? tpc_poison8(a) : v;
    return;
  }
  const uint64_t o1 = tpc_gather_index(w + 1, row, q, a->world);
  if (broken) {
    if (!a->poison_out) return;
    v = make_uint2(tpc_poison_word(a, o), tpc_poison_word(a, o1));
  }
  out[o] = v.x;
  if (w + 1 < a->nbytes / 4) out[o1] = v.y;
}

/* Unit u of peer q, waited for, into its place. */
TPC_DEVICE void tpc_gather_place(tpc_op *op, const tpc_kernel_args *a, uint64_t u, int q, int folded, int wide) {
  const uint2 v = tpc_packet_from(op, u, q, folded); /* before tpc_op_broken: the wait may set it */
  tpc_gather_store(a, u, q, v, wide, tpc_op_broken(op));
}

__global__ void tpc_all_gather_packet_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const int n = a.world, me = a.rank;
  const uint64_t units = (a.nbytes / 4 + 1) / 2; /* a packet carries two words */
  const int wide = ((a.nbytes | a.row_bytes | (uint64_t)(uintptr_t)a.in | (uint64_t)(uintptr_t)a.out) & 7) == 0;
  tpc_packet_start p;
  if (!tpc_packet_prologue(&a, units, [&](uint64_t u) { return tpc_gather_load(&a, u, wide); }, &p)) return;
  tpc_op &op = p.op;

  for (uint64_t u = p.span.first; u < units; u += p.span.stride) {
    const uint2 v = u == p.span.first ? p.v0 : tpc_gather_load(&a, u, wide);
    tpc_packet_push(&a, op.epoch, u, [&](int) { return v; });
    tpc_gather_store(&a, u, me, v, wide, 0);
  }
  for (uint64_t u = p.span.first; u < units; u += p.span.stride) {
    /* Two ranks in straight-line code, as tpc_packet_push. */
    if (n == 2) {
      tpc_gather_place(&op, &a, u, 1 - me, p.folded, wide);
    } else {
      uint2 got[TPC_MAX_RANKS];
      tpc_packets_from_peers(&op, u, p.folded, got);
      const int broken = tpc_op_broken(&op); /* after the wait: it may set it */
#pragma unroll
      for (int q = 0; q < TPC_MAX_RANKS; ++q)
        if (q < n && q != me) tpc_gather_store(&a, u, q, got[q], wide, broken);
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* The packet all-gather in its common case: the output is the inputs one
 * after the other (dim 0) and every unit is one 8-byte word pair (the size
 * a multiple of 8; the C core passes 16-byte aligned pointers), so a unit
 * goes to out[q * units + u] with no index arithmetic and no per-unit layout
 * branches. launch.cu picks it for those calls. The general kernel above is
 * twice its machine code, and slower at every packet size
 * (benchmarks/latency_probe.cu: "all_gather packet" against "the general
 * kernel"). */
__global__ void tpc_all_gather_packet_flat_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const uint64_t units = a.nbytes / 8;
  const uint2 *in = (const uint2 *)a.in;
  uint2 *out = (uint2 *)a.out;
  tpc_packet_start p;
  if (!tpc_packet_prologue(&a, units, [&](uint64_t u) { return in[u]; }, &p)) return;
  tpc_op &op = p.op;
  const int n = a.world, me = a.rank;

  for (uint64_t u = p.span.first; u < units; u += p.span.stride) {
    const uint2 v = u == p.span.first ? p.v0 : in[u];
    tpc_packet_push(&a, op.epoch, u, [&](int) { return v; });
    out[me * units + u] = v;
  }
  /* Peer q's unit u into its place; poison once the op is broken. */
  auto place = [&](uint64_t u, int q, uint2 v, int broken) {
    if (!broken)
      out[q * units + u] = v;
    else if (a.poison_out)
      out[q * units + u] = tpc_poison8(&a);
  };
  for (uint64_t u = p.span.first; u < units; u += p.span.stride) {
    /* Two ranks in straight-line code, as tpc_packet_push. */
    if (n == 2) {
      const uint2 v = tpc_packet_from(&op, u, 1 - me, p.folded);
      place(u, 1 - me, v, tpc_op_broken(&op)); /* after the wait: it may set it */
    } else {
      uint2 got[TPC_MAX_RANKS];
      tpc_packets_from_peers(&op, u, p.folded, got);
      const int broken = tpc_op_broken(&op);
#pragma unroll
      for (int q = 0; q < TPC_MAX_RANKS; ++q)
        if (q < n && q != me) place(u, q, got[q], broken);
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

__global__ void tpc_all_gather_line_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  const int n = a.world, me = a.rank;
  const uint64_t row = a.row_bytes / 16;
  char *out = (char *)a.out;
  const tpc_lines l = tpc_lines_of(&a);
  uint4 v0;
  tpc_op op = tpc_line_begin(&a, &l, &v0);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  /* the header is checked in warp 0's first waits */

  for (uint64_t s = l.first; s < l.steps; s += l.stride) {
    const uint4 v = tpc_line_own(&l, a.in, s, v0);
    tpc_line_push(&op, &l, s, v);
    const uint64_t u = tpc_line_unit(&l, s);
    if (u < l.units) tpc_store16(out + tpc_gather_index(u, row, me, n) * 16, v);
  }
  /* Peer q's line of the step into its place; poison once the op is broken. */
  auto place = [&](uint64_t u, int q, uint4 v) {
    if (u >= l.units) return;
    if (tpc_op_broken(&op)) {
      if (!a.poison_out) return;
      v = tpc_poison16(&a);
    }
    tpc_store16(out + tpc_gather_index(u, row, q, n) * 16, v);
  };
  for (uint64_t s = l.first; s < l.steps; s += l.stride) {
    const uint64_t u = tpc_line_unit(&l, s);
    if (n == 2) {
      place(u, 1 - me, tpc_line_wait(&op, &l, s, 1 - me, s == 0));
    } else {
      uint4 v[TPC_MAX_RANKS];
      tpc_lines_from_peers(&op, &l, s, s == 0, v);
#pragma unroll
      for (int q = 0; q < TPC_MAX_RANKS; ++q)
        if (q < n && q != me) place(u, q, v[q]);
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* Step t of rank q's input, in w, to q's place in out. */
TPC_DEVICE void tpc_stream_place(const tpc_kernel_args *a, const tpc_steps *s, uint32_t t, int q,
                                 const uint4 w[TPC_STREAM_UNITS]) {
  const uint64_t row = a->row_bytes / 16;
  char *out = (char *)a->out;
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t u = tpc_stream_unit(s, t, k);
    if (u < s->units) tpc_store16(out + tpc_gather_index(u, row, q, a->world) * 16, w[k]);
  }
}

/* Pushes step t of the input and places this rank's own copy of it. */
TPC_DEVICE void tpc_stream_gather_step(const tpc_op *op, const tpc_steps *s, uint32_t t) {
  uint4 v[TPC_STREAM_UNITS];
  tpc_stream_load(s, (const char *)op->args->in, t, v);
  tpc_stream_push(op, s, t, v);
  tpc_stream_place(op->args, s, t, op->args->rank, v);
}

/* Places step t of peer q from this rank's slot (every load first), or NaN. */
TPC_DEVICE void tpc_stream_place_peer(const tpc_kernel_args *a, const tpc_steps *s, uint32_t t, int q, int poison) {
  const char *slot = tpc_stream_slot(a, s, a->rank, q);
  uint4 w[TPC_STREAM_UNITS];
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t u = tpc_stream_unit(s, t, k);
    w[k] = poison ? tpc_poison16(a) : u < s->units ? tpc_load16_from_peer(slot + u * 16) : make_uint4(0, 0, 0, 0);
  }
  tpc_stream_place(a, s, t, q, w);
}

__global__ void __launch_bounds__(TPC_STREAM_MAX_THREADS)
    tpc_all_gather_bulk_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_stream_op(
      &a, [&](tpc_op *op, const tpc_steps *s, uint32_t t) { tpc_stream_gather_step(op, s, t); },
      [&](tpc_op *op, const tpc_steps *s, uint32_t t) {
        const int broken = tpc_op_broken(op);
        for (int j = 1; j < a.world && (!broken || a.poison_out); ++j)
          tpc_stream_place_peer(&a, s, t, (a.rank + j) % a.world, broken);
      });
}

#endif /* TPCOMM_ALL_GATHER_CUH */
