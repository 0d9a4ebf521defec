/*
 * Line transfers: 128-byte lines that carry 112 bytes of data and their own
 * flag, for the sizes between the packet and the bulk kernels (64 KiB to a
 * few MiB a rank).
 *
 * A packet (packet.cuh) puts a 4-byte flag beside every 4 data bytes:
 * each 8-byte half is one single-copy-atomic store, so the protocol holds by
 * the memory model alone, but half of what crosses the link is flags, and at
 * 1 MiB the link is what the op waits for. A line is written by 8 lanes of a
 * warp in one store instruction (16 bytes each, 128 contiguous, aligned
 * bytes); lanes 0-6 carry data, lane 7 the epoch. NVLink carries such a store
 * as one 128-byte write that lands whole, so once a reader sees the flag, a
 * load it issues next sees the data too (tpc_line_wait). This is NCCL's
 * LL128 protocol, on by default over NVLink on Volta to Hopper; the memory
 * model does not promise it, the hardware does. It is therefore a backend of its
 * own ("line"), chosen by the routing table only where it was measured and
 * checked bit for bit (python -m tpcomm.tune), never on ROCm.
 *
 * Layout: line L of a sender's packet slot holds its input's 16-byte units
 * 7L .. 7L+6 (zeros past the end) and the flag. A warp step is one line per 8
 * lanes (4 lines a warp); data warp w of the grid takes steps w, w + W, ...
 * (W data warps), the same on every rank. Loops over steps are warp-uniform,
 * so the warp votes of the wait see every lane.
 *
 * Slots are the packet slots, by epoch parity, and flags are epochs, so the
 * packets' reasoning carries over: a peer is at most one op ahead, no flag of
 * an older op matches, and the wrap clears them (tpc_wrap).
 */
#ifndef TPCOMM_LINE_CUH
#define TPCOMM_LINE_CUH

#include "lifecycle.cuh"

#define TPC_LINE_BYTES 128
#define TPC_LINE_LANES 8       /* 16 bytes each */
#define TPC_LINE_UNITS 7       /* 16-byte data units of a line; the last lane holds the flag */
#define TPC_LINE_DATA_BYTES (TPC_LINE_UNITS * 16)
#ifndef TPC_HIP /* line kernels run on CUDA only, where a warp is 32 lanes (a compile-time constant) */
/* A warp step is TPC_WARP_LANES / TPC_LINE_LANES lines: the data bytes the
 * core's and routing's two_shot rule counts in (tpcomm.h). */
static_assert(TPC_LINE_STEP_BYTES == TPC_LINE_DATA_BYTES * (TPC_WARP_LANES / TPC_LINE_LANES),
              "TPC_LINE_STEP_BYTES must be a warp step's data bytes");
#endif

typedef struct {
  uint64_t units;   /* 16-byte units of one rank's input */
  uint64_t lines;
  uint64_t steps;   /* warp steps */
  uint64_t first;   /* this warp's first step; past `steps` for the control warp */
  uint64_t stride;  /* data warps of the grid */
  uint32_t lane;    /* within the warp */
} tpc_lines;

TPC_DEVICE tpc_lines tpc_lines_of(const tpc_kernel_args *a) {
  tpc_lines l;
  const uint64_t lines_per_step = TPC_WARP_LANES / TPC_LINE_LANES;
  l.units = a->nbytes / 16;
  l.lines = (l.units + TPC_LINE_UNITS - 1) / TPC_LINE_UNITS;
  l.steps = (l.lines + lines_per_step - 1) / lines_per_step;
  const unsigned data_warps = (blockDim.x - TPC_CONTROL_THREADS) / TPC_WARP_LANES;
  const unsigned warp = threadIdx.x / TPC_WARP_LANES;
  l.stride = (uint64_t)gridDim.x * data_warps;
  l.first = warp < data_warps ? (uint64_t)blockIdx.x * data_warps + warp : ~0ull >> 1;
  l.lane = threadIdx.x % TPC_WARP_LANES;
  return l;
}

/* The line this lane writes or reads in step s, and its place in it. */
TPC_DEVICE uint64_t tpc_line_index(const tpc_lines *l, uint64_t s) {
  return s * (TPC_WARP_LANES / TPC_LINE_LANES) + l->lane / TPC_LINE_LANES;
}

TPC_DEVICE int tpc_line_flag_lane(const tpc_lines *l) { return l->lane % TPC_LINE_LANES == TPC_LINE_UNITS; }

/* The input unit this lane carries in step s, or past the end (flag lanes,
 * lanes of a last line beyond the input, lanes past the last line). */
TPC_DEVICE uint64_t tpc_line_unit(const tpc_lines *l, uint64_t s) {
  if (tpc_line_flag_lane(l)) return ~0ull;
  return tpc_line_index(l, s) * TPC_LINE_UNITS + l->lane % TPC_LINE_LANES;
}

/* This lane's 16 bytes of step s's line from 16-byte units `src` (zeros
 * past the end, where the flag lane's part of the line is filled in later). */
TPC_DEVICE uint4 tpc_line_load(const tpc_lines *l, const void *src, uint64_t s) {
  const uint64_t u = tpc_line_unit(l, s);
  return u < l->units ? tpc_load16((const char *)src + u * 16) : make_uint4(0, 0, 0, 0);
}

/* The line kernels' start: the op begins while the first step's unit of
 * the input is loaded (`first`). */
TPC_DEVICE tpc_op tpc_line_begin(const tpc_kernel_args *a, const tpc_lines *l, uint4 *first) {
  uint4 v0 = make_uint4(0, 0, 0, 0);
  tpc_op op = tpc_op_begin(a, [&] {
    if (l->first < l->steps) v0 = tpc_line_load(l, a->in, l->first);
  });
  *first = v0;
  return op;
}

/* This lane's input for step s: the first step's was loaded at the start. */
TPC_DEVICE uint4 tpc_line_own(const tpc_lines *l, const void *in, uint64_t s, uint4 first) {
  return s == l->first ? first : tpc_line_load(l, in, s);
}

/* Line L of `sender`'s slot in `owner`'s buffer, at this lane's 16 bytes. */
TPC_DEVICE char *tpc_line_at(const tpc_kernel_args *a, const tpc_op *op, const tpc_lines *l, int owner,
                             int sender, uint64_t s) {
  return tpc_packet_slot(a, owner, op->epoch, sender) + tpc_line_index(l, s) * TPC_LINE_BYTES +
         (l->lane % TPC_LINE_LANES) * 16;
}

/* Step s's line into `owner`'s slot for this sender: one store instruction,
 * so the line leaves whole. `v` is the lane's data (ignored in flag lanes). */
TPC_DEVICE void tpc_line_put(const tpc_op *op, const tpc_lines *l, uint64_t s, uint4 v, int owner) {
  const tpc_kernel_args *a = op->args;
  if (tpc_line_index(l, s) >= l->lines) return; /* the whole line: its 8 lanes agree */
  const int flag = tpc_line_flag_lane(l);
  const uint64_t lo = flag ? tpc_packet_half(op->epoch, op->epoch) : (uint64_t)v.y << 32 | v.x;
  const uint64_t hi = flag ? tpc_packet_half(op->epoch, op->epoch) : (uint64_t)v.w << 32 | v.z;
  tpc_store_packet((uint64_t *)tpc_line_at(a, op, l, owner, a->rank, s), lo, hi);
}

/* Step s's lines into every peer's slot: one store instruction per peer, so
 * each line leaves whole. `v` is the lane's data (ignored in flag lanes). */
TPC_DEVICE void tpc_line_push(const tpc_op *op, const tpc_lines *l, uint64_t s, uint4 v) {
  const tpc_kernel_args *a = op->args;
  if (tpc_line_index(l, s) >= l->lines) return; /* the whole line: its 8 lanes agree */
  const int flag = tpc_line_flag_lane(l);
  const uint64_t lo = flag ? tpc_packet_half(op->epoch, op->epoch) : (uint64_t)v.y << 32 | v.x;
  const uint64_t hi = flag ? tpc_packet_half(op->epoch, op->epoch) : (uint64_t)v.w << 32 | v.z;
  for (int i = 1; i < a->world; ++i) {
    const int peer = (a->rank + i) % a->world; /* ranks start on different peers */
    tpc_store_packet((uint64_t *)tpc_line_at(a, op, l, peer, a->rank, s), lo, hi);
  }
}

/* Sender `peer`'s line of step s in this rank's slot, once every line of the
 * warp's step has its flag: the warp polls together and leaves together.
 * The data is loaded again after the flags are in: one load instruction is
 * served sector by sector, so the load that saw a line's flag may hold data
 * sectors read before the line landed (observed on H200 as stale data in
 * back-to-back chains of ops without the second load). The line lands whole,
 * so a load issued after its flag was seen sees all of it. Both loads are
 * relaxed: the flag publishes only its own line, which the hardware delivers
 * whole, so there is nothing for an acquire to order.
 * With check_header the first lane also polls the peer's header
 * (tpc_header_poll), so a peer that runs another op is named before any of
 * its data is used. On giving up (the bound of tpc_wait_gives_up, in any
 * lane) the whole warp fails and the data is zero. */
TPC_DEVICE uint4 tpc_line_wait(tpc_op *op, const tpc_lines *l, uint64_t s, int peer, int check_header) {
  const tpc_kernel_args *a = op->args;
  const int here = tpc_line_index(l, s) < l->lines;
  const uint64_t *p = (const uint64_t *)tpc_line_at(a, op, l, a->rank, peer, s);
  const int flag = tpc_line_flag_lane(l);
  int header_ok = !(check_header && l->lane == 0);
  uint64_t lo = 0, hi = 0;
  uint32_t spins = 0;
  for (;;) {
    if (here) tpc_load_packet(p, &lo, &hi);
    if (!header_ok) header_ok = tpc_header_poll(op, peer);
    const int ready = header_ok && (!here || !flag || tpc_packet_ready(lo, hi, op->epoch));
    if (tpc_warp_all(ready)) break;
    if (tpc_warp_any(tpc_wait_gives_up(op, peer, &spins))) {
      op->failed = 1;
      return make_uint4(0, 0, 0, 0);
    }
  }
  if (here && !flag) tpc_load_packet(p, &lo, &hi);
  return make_uint4((uint32_t)lo, (uint32_t)(lo >> 32), (uint32_t)hi, (uint32_t)(hi >> 32));
}

/* Every peer's line of step s (v[q], q != rank), polled together: each
 * round first loads the line of every peer not yet in, all the loads in
 * flight at once, then the warp votes on each, so the wait ends about one
 * load after the last line lands, where waiting for one peer after another
 * (tpc_line_wait in a loop) adds a load's latency for every peer after the
 * first. Once every flag is in, the data is loaded again (tpc_line_wait says
 * why), all peers at once. Bounded like every wait, naming the
 * lowest-ranked peer still missing; with check_header the first lane also
 * checks every peer's header before any of its data is used. On giving up
 * the lines are zero. The arrays are indexed by unrolled constants only, so
 * they stay in registers. */
TPC_DEVICE void tpc_lines_from_peers(tpc_op *op, const tpc_lines *l, uint64_t s, int check_header,
                                     uint4 v[TPC_MAX_RANKS]) {
  const tpc_kernel_args *a = op->args;
  const int here = tpc_line_index(l, s) < l->lines;
  const int flag = tpc_line_flag_lane(l);
  uint32_t missing = ((1u << a->world) - 1u) & ~(1u << a->rank); /* warp-uniform */
  uint32_t headers = check_header && l->lane == 0 ? missing : 0u;
  uint32_t spins = 0;
  uint64_t lo[TPC_MAX_RANKS] = {}, hi[TPC_MAX_RANKS] = {};
  while (missing) {
#pragma unroll
    for (int q = 0; q < TPC_MAX_RANKS; ++q)
      if ((missing >> q & 1u) && here)
        tpc_load_packet((const uint64_t *)tpc_line_at(a, op, l, a->rank, q, s), &lo[q], &hi[q]);
#pragma unroll
    for (int q = 0; q < TPC_MAX_RANKS; ++q) {
      if (!(missing >> q & 1u)) continue;
      if (headers >> q & 1u && tpc_header_poll(op, q)) headers &= ~(1u << q);
      const int ready = !(headers >> q & 1u) && (!here || !flag || tpc_packet_ready(lo[q], hi[q], op->epoch));
      if (tpc_warp_all(ready)) missing &= ~(1u << q);
    }
    if (missing && tpc_warp_any(tpc_wait_gives_up(op, __ffs(missing) - 1, &spins))) {
      op->failed = 1;
      break;
    }
  }
#pragma unroll
  for (int q = 0; q < TPC_MAX_RANKS; ++q) {
    lo[q] = hi[q] = 0;
    if (q < a->world && q != a->rank && here && !flag && !op->failed)
      tpc_load_packet((const uint64_t *)tpc_line_at(a, op, l, a->rank, q, s), &lo[q], &hi[q]);
    v[q] = make_uint4((uint32_t)lo[q], (uint32_t)(lo[q] >> 32), (uint32_t)hi[q], (uint32_t)(hi[q] >> 32));
  }
}

/* Step s's line summed in rank order, in fp32 and not rounded (acc: 8
 * values of a 16-bit dtype, 4 of fp32): this rank's values from `own`, each
 * peer's from its line in this rank's slot (tpc_lines_from_peers). Flag
 * lanes sum flags: their result is never used. DTYPE: a tpc_dtype, the
 * kernel's. */
template <int DTYPE>
TPC_DEVICE void tpc_line_accumulate(tpc_op *op, const tpc_lines *l, uint64_t s, uint4 own, int check_header,
                                    float acc[8]) {
  const tpc_kernel_args *a = op->args;
  uint4 v[TPC_MAX_RANKS];
  tpc_lines_from_peers(op, l, s, check_header, v);
#pragma unroll
  for (int q = 0; q < TPC_MAX_RANKS; ++q) {
    const uint4 x = q == a->rank ? own : v[q];
    const uint32_t words[4] = {x.x, x.y, x.z, x.w};
    if (q < a->world) tpc_add_rank(acc, words, 4, DTYPE, q);
  }
}

/* The same sum rounded once to the dtype; two ranks add in the dtype's
 * packed arithmetic, which gives the same bits (docs/design.md). */
template <int DTYPE>
TPC_DEVICE uint4 tpc_line_sum(tpc_op *op, const tpc_lines *l, uint64_t s, uint4 own, int check_header) {
  const tpc_kernel_args *a = op->args;
  if (a->world == 2) return tpc_sum_pair16(own, tpc_line_wait(op, l, s, 1 - a->rank, check_header), DTYPE);
  float acc[8];
  tpc_line_accumulate<DTYPE>(op, l, s, own, check_header, acc);
  uint32_t w[4];
  tpc_round(acc, w, 4, DTYPE);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* Chunks of the two-phase kernels: chunk j is warp steps
 * [tpc_line_chunk(steps, j, n), tpc_line_chunk(steps, j + 1, n)); sizes
 * differ by at most one step. */
TPC_DEVICE uint64_t tpc_line_chunk(uint64_t steps, int j, int n) { return steps * (uint64_t)j / (uint64_t)n; }

/* The chunk holding step s: the largest j with steps * j / n <= s. */
TPC_DEVICE int tpc_line_chunk_of(uint64_t steps, uint64_t s, int n) {
  return (int)(((s + 1) * (uint64_t)n - 1) / steps);
}

/* Store 16 bytes of a line step's result at unit u of out, unless u is past
 * the end (flag lanes, the last line's padding); NaN once the op broke. */
TPC_DEVICE void tpc_line_store(const tpc_op *op, const tpc_lines *l, void *out, uint64_t u, uint4 v) {
  if (u < l->units) tpc_store16((char *)out + u * 16, tpc_op_broken(op) ? tpc_poison16(op->args) : v);
}

#endif /* TPCOMM_LINE_CUH */
