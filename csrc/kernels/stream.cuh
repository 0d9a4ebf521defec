/*
 * Streamed bulk transfers: data warps push without ever waiting for their
 * own stores, and a peer reads each step as soon as it has landed.
 *
 * The op's 16-byte units (one rank's input; one rank's chunk of it in the
 * two-shot all-reduce, all_reduce.cuh, and in reduce-scatter,
 * reduce_scatter.cuh) are cut into warp steps of TPC_STREAM_STEP_UNITS
 * (each lane moves TPC_STREAM_UNITS of them, 512 contiguous bytes a warp per
 * store) and block steps of one warp step per data warp; block b takes block
 * steps b, b + B, b + 2B, ... (B blocks). The grid is a function of the size
 * and the world only, so block b of every rank takes the same steps.
 *
 * Signalling. A data warp pushes a step into every peer's slot and tells its
 * block's control warp (a release at block scope in shared memory), then
 * goes on: it marks a count that only grows, the steps it pushed (the
 * two-shot all-reduce pushes twice a step and counts both: all_reduce.cuh).
 * The control warp takes the smallest count all data warps have reached and
 * stores it in each peer's flag for this block: one 64-bit word per
 * [block][sender], (epoch << 32 | count), a release at system scope, which
 * is cumulative over the data warps' stores it acquired. That release is
 * the only system fence, and it stalls only the control warp: a system
 * fence waits for all of its multiprocessor's stores in flight, so one per
 * data warp and step would stall every warp after each step and leave the
 * link idle for a round trip (docs/design.md). A peer's warp acquires the
 * count before it reads a step. The flag carries the epoch, so an old op's
 * count never passes for this op's.
 *
 * Memory order, end to end: data warp's stores into the peer's slot
 * -> __syncwarp -> its lane 0's release (block scope) of pushed[warp]
 * -> the control warp's acquire of it -> the control warp's release (system
 * scope) of the peer's flag -> the peer warp's acquire of the flag -> its
 * loads of the slot. Each link is a release read by an acquire, or program
 * order, so the chain is a causality order and the peer reads what was
 * pushed. The block-scope pair is enough for its link because both warps are
 * in one block; the system-scope pair is needed because the reader is
 * another GPU.
 *
 * The push counts (pushed[], shared) are zeroed by the control warp before
 * tpc_op_begin's handoff (tpc_stream_op_begin), which orders the zeroing
 * before every access of the data warps; the control warp's own reads follow
 * it in program order. compute-sanitizer racecheck reports the handoff
 * itself: a data warp's release of its count (tpc_stream_mark) against the
 * control warp's acquires of it (tpc_stream_signal_all). Both are strong
 * operations at block scope on the same aligned word, which the PTX memory
 * model never counts as a data race; racecheck models barriers, not
 * release/acquire pairs, and reports every such pair (scripts/sanitize.sh
 * accepts these and nothing else). Zeroing the counts by data threads after
 * the handoff instead draws reports of the zeroing against the control
 * warp's first acquire too, although the block
 * barrier in tpc_bulk_acquire orders the two: racecheck makes them where a
 * lane of the zeroing warp reaches that barrier after the rest of its warp
 * (the wait for a peer's release) in a block whose control warp passed the
 * handoff with bar.arrive. benchmarks/racecheck_stream_start.cu reproduces
 * both starts.
 *
 * Slots and flags come in two halves, by the parity of the bulk sequence
 * number: a peer may start the next streamed op while this rank still reads
 * the current one (tpc_bulk_acquire waits only for the op before that), so
 * the next op writes the other half, and within one half the counts only
 * grow. A half holds n-1 slots of one rank's input (one per peer, none for
 * the owner; reduce-scatter: of one chunk, which always fit in a half:
 * reduce_scatter.cuh); the two-shot all-reduce holds there, per peer, a
 * scatter slot and a gather slot of one rank's chunk, and where those do
 * not fit in a half it takes the whole region (its flags still by parity),
 * for which tpc_bulk_acquire waits until the peers released every earlier
 * op.
 *
 * Headers: block 0's control warp sends them; each data warp checks them in
 * its first wait (tpc_header_poll), before it reads any data, so a peer that
 * runs another op is named and no warp sums what that op pushed.
 */
#ifndef TPCOMM_STREAM_CUH
#define TPCOMM_STREAM_CUH

#include "bulk.cuh"

#define TPC_STREAM_LANES 32 /* a warp on CUDA; on AMD half a wavefront, which runs in lockstep */
#define TPC_STREAM_UNITS 4  /* 16-byte units per lane per step: 4 loads in flight */
#define TPC_STREAM_STEP_UNITS (TPC_STREAM_LANES * TPC_STREAM_UNITS)
#define TPC_STREAM_WARPS_PER_BLOCK 8 /* the most the launch uses (launch.cu) */
#define TPC_STREAM_MAX_THREADS (TPC_STREAM_WARPS_PER_BLOCK * TPC_STREAM_LANES + TPC_CONTROL_THREADS)

typedef struct {
  char *slots;           /* the part of this rank's bulk region this op uses (tpc_stream_region) */
  uint32_t parity;       /* which half of the flags (and of the slots, for a half) this op uses */
  uint32_t block_steps;  /* block steps this block takes */
  uint64_t units;        /* 16-byte units the steps cover: one rank's input, or one rank's chunk (two-shot,
                            reduce-scatter) */
  uint32_t warp;         /* data warp index in the block; data_warps for the control warp */
  uint32_t data_warps;
  uint32_t lane;
} tpc_steps;

/* Bytes of one half of the bulk region (16-byte aligned). */
TPC_DEVICE uint64_t tpc_stream_half_bytes(const tpc_kernel_args *a) { return a->data_bytes / 32 * 16; }

/* The part of rank `owner`'s bulk region an op uses: half `parity`
 * (TPC_BULK_HALF) or all of it (TPC_BULK_WHOLE). */
TPC_DEVICE char *tpc_stream_region(const tpc_kernel_args *a, int owner, uint32_t parity, int use) {
  return a->bufs[owner] + a->data_off + (use == TPC_BULK_HALF ? (uint64_t)parity * tpc_stream_half_bytes(a) : 0);
}

/* `seq`: the bulk ops completed before this one (tpc_bulk_acquire); `units`:
 * the 16-byte units the steps cover; `use`: the part of the region the op
 * takes (tpc_stream_region). */
TPC_DEVICE tpc_steps tpc_stream_of(const tpc_kernel_args *a, uint32_t seq, uint64_t units, int use) {
  tpc_steps s;
  s.units = units;
  s.data_warps = (blockDim.x - TPC_CONTROL_THREADS) / TPC_STREAM_LANES;
  const uint64_t step_units = (uint64_t)s.data_warps * TPC_STREAM_STEP_UNITS;
  const uint64_t all = (s.units + step_units - 1) / step_units;
  s.block_steps = blockIdx.x < all ? (uint32_t)((all - blockIdx.x + gridDim.x - 1) / gridDim.x) : 0;
  const unsigned w = threadIdx.x / TPC_STREAM_LANES;
  s.warp = w < s.data_warps ? w : s.data_warps;
  s.lane = threadIdx.x % TPC_STREAM_LANES;
  s.parity = seq & 1u;
  s.slots = tpc_stream_region(a, a->rank, s.parity, use);
  return s;
}

/* The unit lane `s->lane` of a data warp moves as its k-th of the block's
 * i-th block step. */
TPC_DEVICE uint64_t tpc_stream_unit(const tpc_steps *s, uint32_t i, int k) {
  const uint64_t step = ((uint64_t)i * gridDim.x + blockIdx.x) * s->data_warps + s->warp;
  return step * TPC_STREAM_STEP_UNITS + (uint64_t)k * TPC_STREAM_LANES + s->lane;
}

/* Flag [parity][block][sender] in rank `owner`'s buffer. */
TPC_DEVICE uint64_t *tpc_stream_flag(const tpc_kernel_args *a, int owner, const tpc_steps *s, int sender) {
  const uint64_t index = ((uint64_t)s->parity * TPC_MAX_BLOCKS + blockIdx.x) * TPC_MAX_RANKS + sender;
  return (uint64_t *)(a->bufs[owner] + TPC_SIGNALS_BYTES) + index;
}

/* Sender q's slot in this op's half of rank `owner`'s buffer: a->nbytes
 * (one rank's input; reduce-scatter: one chunk), packed (the owner has
 * none). */
TPC_DEVICE char *tpc_stream_slot(const tpc_kernel_args *a, const tpc_steps *s, int owner, int sender) {
  const char *half = owner == a->rank ? s->slots : tpc_stream_region(a, owner, s->parity, TPC_BULK_HALF);
  return (char *)half + (uint64_t)(sender - (sender > owner)) * a->nbytes;
}

/* The count each data warp of the block has marked: lane 0 of data warp w
 * alone writes word w (tpc_stream_mark), the control warp reads them all.
 * Zeroed by the control warp before the handoff (the note above). */
TPC_DEVICE uint32_t *tpc_stream_pushed(void) {
  __shared__ uint32_t pushed[TPC_STREAM_WARPS_PER_BLOCK];
  return pushed;
}

/* The op begins (tpc_op_begin) with the counts zeroed by the control warp's
 * first lanes before its handoff to the block. */
TPC_DEVICE tpc_op tpc_stream_op_begin(const tpc_kernel_args *a) {
  return tpc_op_begin(a, [] {}, [] {
    const unsigned lane = threadIdx.x % TPC_STREAM_LANES;
    if (lane < TPC_STREAM_WARPS_PER_BLOCK) tpc_stream_pushed()[lane] = 0;
  });
}

/* Step t of the 16-byte units at `in` (this rank's input, or a part of it)
 * into registers; units from `limit` on read as 0. */
TPC_DEVICE void tpc_stream_load_below(const tpc_steps *s, const char *in, uint32_t t, uint64_t limit,
                                      uint4 v[TPC_STREAM_UNITS]) {
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t u = tpc_stream_unit(s, t, k);
    v[k] = u < limit ? tpc_load16(in + u * 16) : make_uint4(0, 0, 0, 0);
  }
}

/* Step t of this rank's input into registers (units past the end read as 0). */
TPC_DEVICE void tpc_stream_load(const tpc_steps *s, const char *in, uint32_t t, uint4 v[TPC_STREAM_UNITS]) {
  tpc_stream_load_below(s, in, t, s->units, v);
}

/* The same from a slot of this rank's that peers wrote: read after the
 * acquire of their flag, past the L1 (tpc_load16_from_peer). */
TPC_DEVICE void tpc_stream_load_slot(const tpc_steps *s, const char *slot, uint32_t t, uint64_t limit,
                                     uint4 v[TPC_STREAM_UNITS]) {
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t u = tpc_stream_unit(s, t, k);
    v[k] = u < limit ? tpc_load16_from_peer(slot + u * 16) : make_uint4(0, 0, 0, 0);
  }
}

/* Step t's units below `limit` from registers to the 16-byte units at `to`. */
TPC_DEVICE void tpc_stream_store(const tpc_steps *s, char *to, uint32_t t, uint64_t limit,
                                 const uint4 v[TPC_STREAM_UNITS]) {
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t u = tpc_stream_unit(s, t, k);
    if (u < limit) tpc_store16(to + u * 16, v[k]);
  }
}

/* Step t into this rank's slot in every peer, starting at a different peer
 * on every rank. Nothing is written once the op failed: after a failed
 * acquire a peer may still be reading its slots. */
TPC_DEVICE void tpc_stream_push(const tpc_op *op, const tpc_steps *s, uint32_t t, const uint4 v[TPC_STREAM_UNITS]) {
  const tpc_kernel_args *a = op->args;
  if (op->failed) return;
  for (int i = 1; i < a->world; ++i)
    tpc_stream_store(s, tpc_stream_slot(a, s, (a->rank + i) % a->world, a->rank), t, s->units, v);
}

TPC_DEVICE uint64_t tpc_stream_tag(uint32_t epoch, uint32_t done) { return (uint64_t)epoch << 32 | done; }

/* Step t of every peer o's chunk of this rank's input, the chunk_bytes at
 * in + o * chunk_bytes (units from limit_of(o) on are left out), into
 * slot_of(o), this rank's slot in o's region, starting at a different peer
 * on every rank: the scatter of reduce-scatter and of the two-shot
 * all-reduce. Nothing is written once the op failed (tpc_stream_push says
 * why). */
template <typename LimitOf, typename SlotOf>
TPC_DEVICE void tpc_stream_scatter(const tpc_op *op, const tpc_steps *s, uint32_t t, uint64_t chunk_bytes,
                                   LimitOf limit_of, SlotOf slot_of) {
  const tpc_kernel_args *a = op->args;
  if (op->failed) return;
  for (int i = 1; i < a->world; ++i) {
    const int o = (a->rank + i) % a->world;
    const uint64_t limit = limit_of(o);
    uint4 v[TPC_STREAM_UNITS];
    tpc_stream_load_below(s, (const char *)a->in + (uint64_t)o * chunk_bytes, t, limit, v);
    tpc_stream_store(s, slot_of(o), t, limit, v);
  }
}

/* A data warp has pushed all that count `done` covers (`done` of its
 * block's steps; the two-shot's counts: all_reduce.cuh). Once any of its
 * lanes failed (and so skipped its pushes) the warp stops counting, so the
 * control warp never signals data that was not pushed. The release (block
 * scope) publishes the whole warp's pushes: __syncwarp first orders the
 * other lanes' stores before lane 0's release, which is cumulative over
 * them. */
TPC_DEVICE void tpc_stream_mark(const tpc_op *op, const tpc_steps *s, uint32_t done) {
  tpc_warp_sync(); /* orders the lanes' stores before lane 0's release */
  if (!tpc_warp_any(op->failed) && s->lane == 0) tpc_store_release_block(&tpc_stream_pushed()[s->warp], done);
}

/* The control warp: until the data warps' last count, `last`, is signalled
 * (the block steps, for a kernel that marks once a step), tell every peer
 * (one lane per peer) the count all data warps have reached. It gives up
 * only once the op failed (a data warp's bounded wait records why),
 * checked every TPC_WAIT_CHECK_SPINS spins like every wait. Each lane
 * acquires every count itself, so its own system-scope release is
 * cumulative over all the data warps' pushes it signals. */
TPC_DEVICE void tpc_stream_signal_all(tpc_op *op, const tpc_steps *s, uint32_t last) {
  const tpc_kernel_args *a = op->args;
  const int peer = (int)s->lane;
  const uint32_t *pushed = tpc_stream_pushed();
  uint32_t signalled = 0, spins = 0;
  while (signalled < last && !op->failed) {
    uint32_t done = ~0u;
    for (uint32_t w = 0; w < s->data_warps; ++w) {
      const uint32_t p = tpc_load_acquire_block(&pushed[w]);
      done = p < done ? p : done;
    }
    if (done > signalled) {
      if (peer < a->world && peer != a->rank)
        tpc_store_release64(tpc_stream_flag(a, peer, s, a->rank), tpc_stream_tag(op->epoch, done));
      signalled = done;
    } else if ((++spins & (TPC_WAIT_CHECK_SPINS - 1u)) == 0) {
      const uint4 c = tpc_load_control(op->control);
      if (c.z != 0 || c.w != 0) return;
    }
  }
}

/* What a streamed kernel over a->nbytes (one rank's input; reduce-scatter:
 * one chunk) does between tpc_stream_op_begin and its data loop: acquire
 * this op's half and run the control warp's signalling. Nonzero for a data
 * warp with steps to take. (The two-shot all-reduce starts the same way with
 * its own units, part of the region and last count: all_reduce.cuh.) */
TPC_DEVICE int tpc_stream_start(tpc_op *op, tpc_steps *s) {
  *s = tpc_stream_of(op->args, tpc_bulk_acquire(op->args, op, TPC_BULK_HALF), op->args->nbytes / 16, TPC_BULK_HALF);
  if (s->warp == s->data_warps) {
    tpc_stream_signal_all(op, s, s->block_steps);
    return 0;
  }
  return s->block_steps != 0;
}

/* Until every peer's block has marked `done` (pushed what it stands for
 * into this rank's slots); with check_header, also until the peer's header
 * for this op is in and agrees. Bounded like every wait; on giving up
 * op->failed is set. The flag is acquired at system scope: it is the peer
 * control warp's release, and the loads of the slots that follow must see
 * what it published. */
TPC_DEVICE void tpc_stream_wait(tpc_op *op, const tpc_steps *s, uint32_t done, int check_header) {
  const tpc_kernel_args *a = op->args;
  for (int i = 1; i < a->world && !op->failed; ++i) {
    const int q = (a->rank + i) % a->world;
    const uint64_t *flag = tpc_stream_flag(a, a->rank, s, q);
    int header_ok = !check_header;
    uint32_t spins = 0;
    for (;;) {
      if (!header_ok) {
        header_ok = tpc_header_poll(op, q);
        if (op->failed) return;
      }
      const uint64_t v = tpc_load_acquire64(flag);
      if (header_ok && (uint32_t)(v >> 32) == op->epoch && (uint32_t)v >= done) break;
      if (tpc_wait_gives_up(op, q, &spins)) return;
    }
  }
}

/* A whole one-phase streamed op in its kernel (the one-shot all-reduce,
 * all-gather, reduce-scatter): the op begins (or is refused), the control warp
 * signals, and each data warp with steps runs them: push(op, s, t) sends
 * step t to the peers, use(op, s, t) takes what the peers sent of it. Step
 * i+1 is pushed and marked before the wait for the peers' step i, so the
 * link carries the next step while the warp reads the last. */
template <typename Push, typename Use>
TPC_DEVICE void tpc_stream_op(const tpc_kernel_args *a, Push push, Use use) {
  tpc_op op = tpc_stream_op_begin(a);
  if (op.refused) return tpc_op_refuse(a, op.refused, op.epoch);
  tpc_steps s;
  if (tpc_stream_start(&op, &s)) {
    push(&op, &s, 0u);
    tpc_stream_mark(&op, &s, 1);
    for (uint32_t i = 0; i < s.block_steps; ++i) {
      if (i + 1 < s.block_steps) {
        push(&op, &s, i + 1);
        tpc_stream_mark(&op, &s, i + 2);
      }
      tpc_stream_wait(&op, &s, i + 1, i == 0);
      use(&op, &s, i);
    }
  }
  tpc_op_end(a, &op, TPC_BULK_HALF);
}

#endif /* TPCOMM_STREAM_CUH */
