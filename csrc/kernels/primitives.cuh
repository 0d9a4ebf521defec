/*
 * Synchronisation building blocks shared by every collective: the op's epoch,
 * packets, the one bounded wait, the deferred release of bulk slots, error
 * recording, and the start every packet kernel shares (tpc_packet_prologue).
 */
#ifndef TPCOMM_PRIMITIVES_CUH
#define TPCOMM_PRIMITIVES_CUH

#include "../core/layout.h"
#include "data_ops.cuh"
#include "portability.cuh"

/* Every block is its data threads followed by one control warp. The control
 * warp of block 0 sends and checks the headers, so that the check waits beside
 * the data instead of after it. */
#define TPC_CONTROL_THREADS 32

/* Indices a data thread walks: first, first + stride, ... Control threads get
 * a start past any end, so every data loop skips them. */
typedef struct {
  uint64_t first, stride;
} tpc_span;

TPC_DEVICE tpc_span tpc_data_span(void) {
  const unsigned data_threads = blockDim.x - TPC_CONTROL_THREADS;
  tpc_span s;
  s.stride = (uint64_t)gridDim.x * data_threads;
  s.first = threadIdx.x < data_threads ? (uint64_t)blockIdx.x * data_threads + threadIdx.x
                                       : (~0ull >> 1);
  return s;
}

/* Polling loops look at the clock and the control slot once every this many
 * spins (a power of two): often enough that a stop is seen within a few
 * microseconds, rarely enough that the loop stays a load and a compare. */
#define TPC_WAIT_CHECK_SPINS 64u

/* The peer a control lane of block 0 talks to, or -1. */
TPC_DEVICE int tpc_control_peer(const tpc_kernel_args *a) {
  const int lane = (int)threadIdx.x - (int)(blockDim.x - TPC_CONTROL_THREADS);
  return (blockIdx.x == 0 && lane >= 0 && lane < a->world && lane != a->rank) ? lane : -1;
}

TPC_DEVICE tpc_signals *tpc_signals_of(const tpc_kernel_args *a, int rank) {
  return (tpc_signals *)a->bufs[rank];
}

/* Sender's header packet for an op in rank owner's signals (tpc_header_send). */
TPC_DEVICE uint64_t *tpc_header_slot(const tpc_kernel_args *a, int owner, uint32_t epoch, int sender) {
  return tpc_signals_of(a, owner)->header[epoch & (TPC_HEADER_SLOTS - 1)][sender];
}

/* Per-thread view of the op being run. */
typedef struct {
  const tpc_kernel_args *args;
  tpc_signals *sig;       /* this rank's signals */
  tpc_control *control;   /* never freed: safe to read after close */
  uint64_t deadline_ns;   /* waits past this give up; 0 until a wait is slow */
  uint64_t timeout_ns;
  uint32_t epoch;         /* this op's number; packet flag value */
  uint32_t refused;       /* the op must not run: TPC_ERR_CLOSED, or the earlier error's code */
  int failed;             /* this thread gave up, or learned that a peer did */
} tpc_op;

/* Defined below: tpc_op_begin is a template, so what it calls is declared first. */
TPC_COLD uint32_t tpc_refuse_for_peer(const tpc_kernel_args *a, uint32_t epoch, uint32_t stop);
TPC_DEVICE void tpc_epoch_advance(const tpc_op *op);
TPC_DEVICE void tpc_header_send(const tpc_kernel_args *a, const tpc_op *op);

/* The first lane of every block's control warp reads the control slot (one
 * 16-byte load, from memory that is never freed) and shares it with its block:
 *  - alive must be this communicator's id: otherwise it was closed and the
 *    buffers are gone (a graph replayed after close), and the op is refused;
 *  - failed must be 0: once an error is recorded every later op is refused,
 *    so it exits at once instead of waiting out its own timeout;
 *  - stopped must be 0: a peer that gave up an op told us so, and a rank that
 *    arrives late for that op must not return a result its peer does not
 *    have: the op is refused and the peer's error recorded here;
 *  - epoch is the previous op's number; this op's is the next. Graph replays
 *    and eager calls, in any order, each get the next number without the
 *    host knowing it.
 * A refused op touches no buffer: the kernel calls tpc_op_refuse and returns.
 *
 * All of this happens before tpc_grid_wait, while the previous kernel on the
 * stream may still run (programmatic dependent launch), so the epoch costs
 * nothing when tpcomm ops follow each other. That is safe because the epoch
 * is advanced before the dependents are released (tpc_epoch_advance): a
 * kernel that starts early can only see the number its predecessor left.
 * Every other thread waits for the previous kernel first (the input and the
 * buffers may still be written by it) and then runs `prefetch`, the
 * kernel's first input load, so that it overlaps the control load.
 *
 * Memory order: the control slot is read relaxed at GPU scope
 * (tpc_load_control). The epoch needs no more: it is written only by this
 * communicator's kernels on this GPU, and the previous one made its store
 * visible before it let this kernel start (tpc_epoch_advance). alive is
 * cleared by the host at close, long before a graph is replayed after it.
 * failed and stopped only make an op stop early: one that arrives after this
 * load is seen by the next bounded wait (tpc_wait_gives_up reads the slot
 * again). */
template <typename Prefetch>
TPC_DEVICE tpc_op tpc_op_begin(const tpc_kernel_args *a, Prefetch prefetch) {
  __shared__ uint32_t block_epoch, block_refused;
  const int control_warp = threadIdx.x >= blockDim.x - TPC_CONTROL_THREADS;
  const int lead = threadIdx.x == blockDim.x - TPC_CONTROL_THREADS;
  tpc_op op;
  op.args = a;
  op.sig = tpc_signals_of(a, a->rank);
  op.control = a->control;
  if (lead) {
    const uint4 c = tpc_load_control(a->control);
    uint32_t epoch = c.y + 1u;
    /* 0 means "never written" in every slot; skipping to 2 keeps the parity
     * alternating across the wrap. */
    if (epoch == 0) epoch = 2;
    uint32_t refused = c.x != a->alive_id ? (uint32_t)TPC_ERR_CLOSED : c.z;
    if (!refused && c.w) refused = tpc_refuse_for_peer(a, epoch, c.w);
    block_epoch = epoch;
    block_refused = refused;
  }
  /* The control warp hands the slot to the block without waiting for it
   * (tpc_block_handoff). The data threads first wait for the previous kernel
   * (the input and the buffers may still be written by it) and start loading
   * their input (prefetch): that load overlaps the control load when the
   * previous kernel has already finished. The handoff is one call site for
   * every thread, as AMD's wave-wide barrier needs. */
  if (control_warp) {
    tpc_warp_sync();
  } else {
    tpc_grid_wait();
    prefetch();
  }
  tpc_block_handoff(control_warp);
  op.epoch = block_epoch;
  op.refused = block_refused;
  if (control_warp) {
    /* The epoch is advanced before waiting for the previous kernel. The op
     * under the last epoch advances it only after the wrap (tpc_op_end) and
     * lets the next kernel start only when it has finished. */
    if (lead && !op.refused && op.epoch != TPC_EPOCH_LAST) tpc_epoch_advance(&op);
    /* The header goes out before the wait too, so that it is at the peer
     * before the data (tpc_header_send says why that is safe). */
    if (!op.refused) tpc_header_send(a, &op);
    tpc_grid_wait();
    /* Released only now, after the previous kernel: one kernel ahead is
     * enough to hide the epoch, and a deeper cascade of blocks that wait
     * holds multiprocessors the large ops need (docs/design.md). */
    if (lead && op.epoch != TPC_EPOCH_LAST) tpc_grid_release();
  }
  op.deadline_ns = 0; /* set by the first slow wait: no clock read on the fast path */
  op.timeout_ns = a->timeout_ns;
  op.failed = 0;
  return op;
}

TPC_DEVICE tpc_op tpc_op_begin(const tpc_kernel_args *a) {
  return tpc_op_begin(a, [] {});
}

/* The control lane of each block: once every block has read the epoch (the
 * last ticket drawn; one block needs no ticket), store this op's number,
 * make it visible at GPU scope, and only then (tpc_op_begin) release the
 * dependent kernel, whose first act is to read it. The ticket counter is
 * reset here too, before the release, since the next kernel draws its own.
 * Memory order: a block's lead draws its ticket only once its load of the
 * slot has returned (whether it draws one depends on the value loaded), so
 * the last ticket means every block has read the old epoch. __threadfence
 * (GPU scope) orders the store before griddepcontrol.launch_dependents, the
 * only way the next reader (a kernel on this GPU) can start before this one
 * ends; peers never read this word. */
TPC_DEVICE void tpc_epoch_advance(const tpc_op *op) {
  if (gridDim.x > 1) {
    if (atomicAdd(&op->sig->blocks_arrived, 1u) != gridDim.x - 1) return;
    op->sig->blocks_arrived = 0;
  }
  *(volatile uint32_t *)&op->control->epoch = op->epoch;
  __threadfence();
}

/* The NaN pattern for output word `index` (4-byte words of out). */
TPC_DEVICE uint32_t tpc_poison_word(const tpc_kernel_args *a, uint64_t index) {
  return (uint32_t)(index & 1u ? a->poison >> 32 : a->poison);
}

TPC_DEVICE uint2 tpc_poison8(const tpc_kernel_args *a) {
  return make_uint2(tpc_poison_word(a, 0), tpc_poison_word(a, 1));
}

TPC_DEVICE uint4 tpc_poison16(const tpc_kernel_args *a) {
  const uint2 p = tpc_poison8(a);
  return make_uint4(p.x, p.y, p.x, p.y);
}

/* First error wins; later ones (other threads timing out as a consequence)
 * leave the record alone. The claim is the control slot's failed word (device
 * memory: atomics on host-mapped memory are not available over every PCIe
 * root complex); once set, every later op of this communicator is refused at
 * its start. The record's code is written last, after a system fence, so the
 * host never sees a code with stale fields. The claimer then tells every
 * peer, whose waits for this rank end at once and whose next op is refused
 * too. `touch_buffers` is 0 for a closed communicator: its buffers are gone.
 * Memory order: the host polls code without synchronising with the device, so
 * the first system fence makes every other field visible before the code;
 * the second orders the code before everything this thread does next (the
 * peers' stop words, the NaN output), so a peer or host that sees those
 * finds the record complete. The stop words are system-scope releases for
 * the same reason. */
TPC_COLD void tpc_record_cold(const tpc_kernel_args *a, uint32_t epoch, uint32_t code, int peer,
                              int reported, uint32_t peer_bytes, uint32_t peer_kind, int touch_buffers) {
  if (atomicCAS(&a->control->failed, 0u, code) != 0u) return;
  volatile tpc_async_error *rec = a->err;
  rec->peer = peer;
  rec->epoch = epoch;
  rec->reported = reported;
  rec->peer_bytes = peer_bytes;
  rec->peer_kind = peer_kind;
  rec->own_bytes = (uint32_t)a->nbytes;
  rec->own_kind = a->kind;
  tpc_fence_system();
  rec->code = (int32_t)code;
  tpc_fence_system();
  if (!touch_buffers) return;
  for (int p = 0; p < a->world; ++p)
    if (p != a->rank) tpc_store_release(&a->peer_control[p]->stopped, code << 8 | (uint32_t)(a->rank + 1));
}

/* A peer's stop word was set before this op began: record the peer's error
 * here (naming it) and refuse the op with its code. The peers already know. */
TPC_COLD uint32_t tpc_refuse_for_peer(const tpc_kernel_args *a, uint32_t epoch, uint32_t stop) {
  tpc_record_cold(a, epoch, stop >> 8, (int)(stop & 0xffu) - 1, 1, 0, 0, 0);
  return stop >> 8;
}

/* Everything but the flag is out of line: it takes scalars and the kernel
 * parameter's address (a __grid_constant__, so no copy), never the op, which
 * would push the hot path's state into local memory. */
TPC_DEVICE void tpc_record(tpc_op *op, uint32_t code, int peer, int reported, uint32_t peer_bytes,
                           uint32_t peer_kind, int touch_buffers) {
  op->failed = 1;
  tpc_record_cold(op->args, op->epoch, code, peer, reported, peer_bytes, peer_kind, touch_buffers);
}

TPC_DEVICE void tpc_record_error(tpc_op *op, int code, int peer, uint32_t peer_bytes, uint32_t peer_kind) {
  tpc_record(op, (uint32_t)code, peer, 0, peer_bytes, peer_kind, 1);
}

/* A peer's stop word seen: this rank takes over its code, naming it. */
TPC_DEVICE void tpc_record_peer_stop(tpc_op *op, uint32_t stop) {
  tpc_record(op, stop >> 8, (int)(stop & 0xffu) - 1, 1, 0, 0, 1);
}

/* Nonzero once this thread must not produce output: it gave up a wait (its
 * own timeout, a mismatch, a peer's stop word or abort() seen while waiting). */
TPC_DEVICE int tpc_op_broken(const tpc_op *op) { return op->failed; }

/* NaN over the first `bytes` of out, written by every thread of the grid. */
TPC_DEVICE void tpc_poison_fill(const tpc_kernel_args *a, void *out, uint64_t bytes) {
  uint32_t *words = (uint32_t *)out;
  for (uint64_t w = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; w < bytes / 4;
       w += (uint64_t)gridDim.x * blockDim.x)
    words[w] = tpc_poison_word(a, w);
}

/* The op was refused at its start (`refused`: the reason): record why (a
 * closed communicator's first refused op), fill a floating-point output with
 * NaN and touch nothing else. Every thread of the grid takes part. */
TPC_COLD void tpc_op_refuse(const tpc_kernel_args *a, uint32_t refused, uint32_t epoch) {
  if (refused == TPC_ERR_CLOSED && blockIdx.x == 0 && threadIdx.x == 0)
    tpc_record_cold(a, epoch, TPC_ERR_CLOSED, -1, 0, 0, 0, 0);
  if (a->poison_out) tpc_poison_fill(a, a->out, a->out_bytes);
}

/* The one bound on waiting for a peer: called from every polling loop. Checks
 * the clock and the control slot (this communicator's failed word, the
 * peers' stop word) only every TPC_WAIT_CHECK_SPINS spins to keep the loop
 * tight. Returns nonzero when the wait must stop. */
TPC_DEVICE int tpc_wait_gives_up(tpc_op *op, int peer, uint32_t *spins) {
  if (op->failed) return 1;
  if ((++*spins & (TPC_WAIT_CHECK_SPINS - 1u)) != 0) return 0;
  const uint4 c = tpc_load_control(op->control);
  if (c.z != 0) {
    op->failed = 1; /* another thread recorded it, or abort() */
    return 1;
  }
  if (c.w != 0) {
    tpc_record_peer_stop(op, c.w);
    return 1;
  }
  const uint64_t now = tpc_clock_ns();
  if (op->deadline_ns == 0) op->deadline_ns = now + op->timeout_ns;
  if (now > op->deadline_ns) {
    tpc_record_error(op, TPC_ERR_TIMEOUT, peer, 0, 0);
    return 1;
  }
  return 0;
}

TPC_DEVICE uint64_t tpc_packet_half(uint32_t data, uint32_t flag) {
  return ((uint64_t)flag << 32) | data;
}

TPC_DEVICE void tpc_packet_put(void *slot, uint2 data, uint32_t flag) {
  tpc_store_packet((uint64_t *)slot, tpc_packet_half(data.x, flag), tpc_packet_half(data.y, flag));
}

TPC_DEVICE int tpc_packet_ready(uint64_t lo, uint64_t hi, uint32_t epoch) {
  return (uint32_t)(lo >> 32) == epoch && (uint32_t)(hi >> 32) == epoch;
}

/* One look at `peer`'s header for this op: 1 once it is in and agrees with
 * ours, 0 while it is not in yet; a header that disagrees is recorded as a
 * mismatch naming the peer (op->failed is then set). */
TPC_DEVICE int tpc_header_poll(tpc_op *op, int peer) {
  uint64_t lo, hi;
  tpc_load_packet(tpc_header_slot(op->args, op->args->rank, op->epoch, peer), &lo, &hi);
  if (!tpc_packet_ready(lo, hi, op->epoch)) return 0;
  if ((uint32_t)lo == (uint32_t)op->args->nbytes && (uint32_t)hi == op->args->kind) return 1;
  tpc_record_error(op, TPC_ERR_MISMATCH, peer, (uint32_t)lo, (uint32_t)hi);
  return 0;
}

/* Spins on a packet in this rank's own buffer until both halves carry the
 * flag. On giving up the data is zero and op->failed is set. Relaxed loads
 * are enough: each half is one single-copy-atomic 8-byte element holding its
 * data beside its flag (portability.cuh), so no other memory is published by
 * the flag and nothing needs acquiring.
 *
 * With check_header (folded headers: the first packet of thread 0, one per
 * peer) the peer's header is polled in the same loop, beside the data:
 * it costs no extra round trip, and a peer that runs another op, size,
 * algorithm, dtype or layout is named at once (its header arrives even when
 * the data never will) instead of timing out. */
TPC_DEVICE uint2 tpc_packet_wait(tpc_op *op, const void *slot, int peer, int check_header = 0) {
  uint64_t lo, hi;
  int header_ok = !check_header;
  uint32_t spins = 0;
  for (;;) {
    tpc_load_packet((const uint64_t *)slot, &lo, &hi);
    if (!header_ok) {
      header_ok = tpc_header_poll(op, peer);
      if (op->failed) return make_uint2(0, 0);
    }
    if (header_ok && tpc_packet_ready(lo, hi, op->epoch)) break;
    if (tpc_wait_gives_up(op, peer, &spins)) return make_uint2(0, 0);
  }
  return make_uint2((uint32_t)lo, (uint32_t)hi);
}

/* Until *flag == value, bounded. An acquire at system scope: the flag is a
 * peer's release (tpc_wrap_meet), and what this thread reads next is the
 * memory that release published. */
TPC_DEVICE void tpc_flag_wait(tpc_op *op, const uint32_t *flag, uint32_t value, int peer) {
  uint32_t spins = 0;
  while (tpc_load_acquire(flag) != value)
    if (tpc_wait_gives_up(op, peer, &spins)) return;
}

/* Packet slot [parity][sender] in rank `owner`'s buffer. Two parities: a peer
 * can be at most one op ahead (it needs our packets to finish an op), so the
 * slots it writes never hold packets we are still reading. */
TPC_DEVICE char *tpc_packet_slot(const tpc_kernel_args *a, int owner, uint32_t epoch, int sender) {
  const uint64_t index = (uint64_t)(epoch & 1u) * a->world + sender;
  return a->bufs[owner] + a->packet_off + index * a->packet_slot_bytes;
}

/* Packet unit u into every peer's slot for this sender, value_for(peer) the
 * 8 bytes that peer gets; peers in turn from the next rank on, so that ranks
 * start on different peers. Two ranks name the peer outright: the loop's
 * modulo would sit between the input load and the push, on the critical
 * path of the smallest ops (latency_probe.cu times it). */
template <typename ValueFor>
TPC_DEVICE void tpc_packet_push(const tpc_kernel_args *a, uint32_t epoch, uint64_t u, ValueFor value_for) {
  if (a->world == 2) {
    const int peer = 1 - a->rank;
    tpc_packet_put(tpc_packet_slot(a, peer, epoch, a->rank) + u * TPC_PACKET_BYTES, value_for(peer), epoch);
    return;
  }
  for (int i = 1; i < a->world; ++i) {
    const int peer = (a->rank + i) % a->world;
    tpc_packet_put(tpc_packet_slot(a, peer, epoch, a->rank) + u * TPC_PACKET_BYTES, value_for(peer), epoch);
  }
}

/* The other half: peer q's packet unit u of this op, from this rank's slot,
 * waited for; with `folded`, unit 0 also checks q's header (tpc_packet_wait). */
TPC_DEVICE uint2 tpc_packet_from(tpc_op *op, uint64_t u, int q, int folded) {
  const tpc_kernel_args *a = op->args;
  return tpc_packet_wait(op, tpc_packet_slot(a, a->rank, op->epoch, q) + u * TPC_PACKET_BYTES, q, folded && u == 0);
}

/* Every peer's packet unit u of this op (got[q], q != rank), waited for
 * together. Each round first loads the packet of every peer not yet in, all
 * the loads in flight at once, then looks at them: the wait ends about one
 * load after the last packet lands, where waiting for one peer after another
 * (tpc_packet_from in a loop) adds a load's latency for every peer after the
 * first (benchmarks/scale_probe.cu times both). With `folded`, unit 0 also
 * polls each peer's header until it is in (tpc_packet_wait), before it takes
 * that peer's data. The arrays are indexed by unrolled constants only, so
 * they stay in registers; a packet that is in is kept, not loaded again. On
 * giving up op->failed is set, the error names the lowest-ranked peer still
 * missing and got[] holds no meaning (callers poison their output). Relaxed
 * loads, as in tpc_packet_wait. */
TPC_DEVICE void tpc_packets_from_peers(tpc_op *op, uint64_t u, int folded, uint2 got[TPC_MAX_RANKS]) {
  const tpc_kernel_args *a = op->args;
  const uint32_t peers = ((1u << a->world) - 1u) & ~(1u << a->rank);
  uint32_t missing = peers, headers = folded && u == 0 ? peers : 0u, spins = 0;
  const char *slot = tpc_packet_slot(a, a->rank, op->epoch, 0) + u * TPC_PACKET_BYTES;
  uint64_t lo[TPC_MAX_RANKS] = {}, hi[TPC_MAX_RANKS] = {};
  for (;;) {
#pragma unroll
    for (int q = 0; q < TPC_MAX_RANKS; ++q)
      if (missing >> q & 1u) tpc_load_packet((const uint64_t *)(slot + (uint64_t)q * a->packet_slot_bytes), &lo[q], &hi[q]);
#pragma unroll
    for (int q = 0; q < TPC_MAX_RANKS; ++q) {
      if (!(missing >> q & 1u)) continue;
      if ((headers >> q & 1u) && tpc_header_poll(op, q)) headers &= ~(1u << q);
      if (!(headers >> q & 1u) && tpc_packet_ready(lo[q], hi[q], op->epoch)) missing &= ~(1u << q);
    }
    if (!missing || tpc_wait_gives_up(op, __ffs(missing) - 1, &spins)) break;
  }
#pragma unroll
  for (int q = 0; q < TPC_MAX_RANKS; ++q) got[q] = make_uint2((uint32_t)lo[q], (uint32_t)hi[q]);
}

/* Headers let peers that disagree on an op, its size, algorithm, dtype or
 * layout (the kind word, layout.h) fail with a clear record (and stop this
 * rank's other waits) instead of timing out.
 *
 * Block 0's control warp, one lane per peer, sends them in tpc_op_begin,
 * before the wait for the previous kernel, so that a header is never on the
 * path after the data. That is safe with TPC_HEADER_SLOTS (four) slots per
 * sender, by epoch: this op's control warp runs only once op e-2 has
 * completed here (op e-1 releases it after its own wait), so the peer has
 * sent its data of op e-2, so it had finished op e-3 and its check of the
 * header of op e-4, the last one this slot held.
 * Where they are checked depends on the op (each the faster of the two
 * places in latency_probe.cu):
 *  - one-block packet ops: the same control lanes wait for the peers' beside
 *    the data threads (tpc_header_check);
 *  - packet ops of several blocks (tpc_header_folded): thread 0 of block 0
 *    checks them inside its first data wait (tpc_packet_wait: header and
 *    data polled in the same loop), which frees block 0's control warp;
 *  - line ops: the first lane of warp 0 in its first waits;
 *  - streamed ops (every bulk kernel): every data warp in its first wait
 *    (stream.cuh).
 * Header packets are relaxed stores and loads, like data packets: the
 * header carries its own flag and publishes nothing else. */
TPC_DEVICE int tpc_header_folded(int packet) { return packet && gridDim.x > 1; }

TPC_DEVICE void tpc_header_send(const tpc_kernel_args *a, const tpc_op *op) {
  const int peer = tpc_control_peer(a);
  if (peer < 0) return;
  tpc_store_packet(tpc_header_slot(a, peer, op->epoch, a->rank), tpc_packet_half((uint32_t)a->nbytes, op->epoch),
                   tpc_packet_half(a->kind, op->epoch));
}

/* The control lanes' check, unless it is folded into the data waits. */
TPC_DEVICE void tpc_header_check(const tpc_kernel_args *a, tpc_op *op, int folded) {
  const int peer = folded ? -1 : tpc_control_peer(a);
  if (peer < 0) return;
  uint2 h = tpc_packet_wait(op, tpc_header_slot(a, a->rank, op->epoch, peer), peer);
  if (!op->failed && (h.x != (uint32_t)a->nbytes || h.y != a->kind))
    tpc_record_error(op, TPC_ERR_MISMATCH, peer, h.x, h.y);
}

/* The start every packet kernel shares (tpc_packet_prologue): the thread's
 * packet units, the op, and its first unit of the input, loaded beside the
 * control load (tpc_op_begin's `prefetch`). */
typedef struct {
  tpc_op op;
  tpc_span span;  /* this thread's units: span.first, span.first + span.stride, ... */
  uint2 v0;       /* input unit span.first, or 0 when that is past the input */
  int folded;     /* headers checked in thread 0's first data wait (tpc_header_folded) */
} tpc_packet_start;

/* What a kernel with no unit of its own to load first passes as `load`
 * (reduce_scatter pushes other ranks' chunks first; the fused norm walks
 * rows). */
struct tpc_no_prefetch {};

/* The op begins while the thread's first unit of the input is loaded. */
template <typename Load>
TPC_DEVICE void tpc_packet_begin_op(const tpc_kernel_args *a, uint64_t units, Load load, tpc_packet_start *p) {
  p->span = tpc_data_span();
  const uint64_t first = p->span.first;
  uint2 v0 = make_uint2(0, 0);
  p->op = tpc_op_begin(a, [&] {
    if (first < units) v0 = load(first);
  });
  p->v0 = v0;
}

/* Nothing to load: the span is taken once the op has begun and its headers
 * are checked (tpc_packet_span_after), so that it holds no registers across
 * them. */
TPC_DEVICE void tpc_packet_begin_op(const tpc_kernel_args *a, uint64_t, tpc_no_prefetch, tpc_packet_start *p) {
  p->op = tpc_op_begin(a);
  p->v0 = make_uint2(0, 0);
}

template <typename Load>
TPC_DEVICE void tpc_packet_span_after(Load, tpc_packet_start *) {}
TPC_DEVICE void tpc_packet_span_after(tpc_no_prefetch, tpc_packet_start *p) { p->span = tpc_data_span(); }

typedef void (*tpc_refuse_fn)(const tpc_kernel_args *a, uint32_t refused, uint32_t epoch);

/* Every packet kernel starts here, and the latency probe's packet variants
 * too: the thread's units, the op begun with the thread's first unit of the
 * input loaded beside the control load (`load(u)` returns the input's packet
 * unit u; it runs for the first unit only, when that is below `units`), a
 * refused op refused (`refuse`: tpc_op_refuse, or the fused norm's, which
 * also fills its second output; the thread then ends), and the headers
 * checked where tpc_header_folded says (unless `check_header` is 0: the
 * probe's variants leave the check out, to time it). Returns 1; 0 only where
 * the thread could not be ended here (HIP), on which the kernel returns at
 * once. */
template <typename Load>
TPC_DEVICE int tpc_packet_prologue(const tpc_kernel_args *a, uint64_t units, Load load, tpc_packet_start *p,
                                   tpc_refuse_fn refuse = tpc_op_refuse, int check_header = 1) {
  tpc_packet_begin_op(a, units, load, p);
  if (p->op.refused) {
    refuse(a, p->op.refused, p->op.epoch);
    tpc_thread_exit();
    return 0;
  }
  p->folded = tpc_header_folded(1);
  if (check_header) tpc_header_check(a, &p->op, p->folded);
  tpc_packet_span_after(load, p);
  return 1;
}

/* How a bulk op uses the data region (tpc_bulk_acquire, tpc_op_end). */
enum { TPC_NOT_BULK = 0, TPC_BULK_WHOLE = 1, TPC_BULK_HALF = 2 };

/* Bulk slots are reused by later bulk ops. Before writing into a peer's slots
 * we wait until that peer released the last bulk op that wrote the same
 * memory (it finished reading it). An op that uses one half (a streamed
 * kernel, by the parity of the bulk sequence number, returned here) need
 * not wait for the previous op when that one used only the other half: the
 * peer may still be reading it while this op already pushes, which takes the
 * release's round trip off the path from one op to the next.
 *
 * A rank releases a bulk op when its next bulk op starts (here, block 0,
 * after the wait for the previous kernel: every read of the slots is done),
 * not at that op's end, which would put a system-scope fence on the tail of
 * every op. Nothing waits for it sooner: a peer needs the release of op m
 * only for its op m+1 (whole) or m+2 (half), and neither can finish before
 * this rank has started op m+1. Counts are compared modulo 2^32. */
TPC_DEVICE uint32_t tpc_bulk_acquire(const tpc_kernel_args *a, tpc_op *op, int use) {
  const uint32_t seq = *(volatile uint32_t *)&op->sig->bulk_seq;
  const int t = threadIdx.x;
  if (t < a->world && t != a->rank) {
    /* A plain (volatile: relaxed, system scope) store, no fence: what it
     * announces, that op seq's reads of the slots are done, was ordered by
     * the previous kernel's completion (tpc_grid_wait). A release here would
     * put a system fence on block 0's path, and that fence also waits for the
     * header stores block 0's control warp has just sent: a round trip. */
    if (blockIdx.x == 0) *(volatile uint32_t *)&tpc_signals_of(a, t)->released[a->rank] = seq;
    const uint32_t last_whole = *(volatile uint32_t *)&op->sig->last_whole;
    const uint32_t need = use == TPC_BULK_HALF && last_whole != seq ? seq - 1u : seq;
    uint32_t spins = 0;
    /* An acquire at system scope: the peer's reads of the slots this op is
     * about to overwrite must be complete before its release is seen (a
     * write-after-read order; the closing bar.sync passes it to the block). */
    while ((int32_t)(tpc_load_acquire(&op->sig->released[t]) - need) < 0)
      if (tpc_wait_gives_up(op, t, &spins)) break;
  }
  if (__syncthreads_or(op->failed)) op->failed = 1;
  return seq;
}

/* One meeting of the wrap (tpc_wrap): tell every peer `w`, wait until each
 * told us. The fence and release order this thread's earlier stores (the
 * cleared flags, at the second meeting) before the peer sees `w`; the
 * acquire in tpc_flag_wait orders the peer's before ours that follow. */
TPC_DEVICE void tpc_wrap_meet(const tpc_kernel_args *a, tpc_op *op, uint32_t w, int second) {
  for (int t = 0; t < a->world; ++t) {
    if (t == a->rank) continue;
    tpc_signals *peer = tpc_signals_of(a, t);
    tpc_fence_system();
    tpc_store_release(second ? &peer->wrap_out[a->rank] : &peer->wrap_in[a->rank], w);
  }
  for (int t = 0; t < a->world; ++t)
    if (t != a->rank) tpc_flag_wait(op, second ? &op->sig->wrap_out[t] : &op->sig->wrap_in[t], w, t);
}

/* The op under the last epoch before the counter wraps (TPC_EPOCH_LAST),
 * run by thread 0 of its last block to finish: flags are equal to epochs, so
 * a flag left in a slot that was not written for 2^32 ops would match the
 * reused epoch. The ranks meet (every peer is done with the last epoch, so
 * nothing more is written into our buffer), each clears every flag-carrying
 * word of its own buffer, and they meet again before anyone runs the next op.
 * Once in 2^32 ops, so one thread does it (milliseconds); the waits are
 * bounded like every other. */
TPC_COLD void tpc_wrap(const tpc_kernel_args *a, tpc_op op_copy) {
  tpc_op *op = &op_copy;
  const uint32_t w = op->sig->wraps + 1u;
  tpc_wrap_meet(a, op, w, 0);
  char *begin = (char *)&op->sig->header[0][0][0];
  char *end = a->bufs[a->rank] + a->packet_off + 2 * (uint64_t)a->world * a->packet_slot_bytes;
  for (char *p = begin; p < end; p += 16) tpc_store16(p, make_uint4(0, 0, 0, 0));
  tpc_wrap_meet(a, op, w, 1);
  op->sig->wraps = w;
}

/* Called by every thread at the end. The epoch was advanced at the start
 * (tpc_epoch_advance), except under the last epoch: that op clears the flags
 * first (tpc_wrap). Bulk ops: the last block to finish counts the op done
 * (bulk_seq); the next bulk op releases it to the peers (tpc_bulk_acquire).
 * A failed bulk op is never counted, so never released: a peer that still
 * writes into its slots would overwrite data nobody reads, and the next op is
 * refused anyway. */
TPC_DEVICE void tpc_op_end(const tpc_kernel_args *a, tpc_op *op, int bulk /* TPC_NOT_BULK, _WHOLE, _HALF */) {
  const int wrap = op->epoch == TPC_EPOCH_LAST;
  if (!bulk && !wrap) return;
  /* Blocks count their completions and, in the high half of the same
   * atomic, their failures: the last block learns whether any block failed
   * without another load before it counts the op done. */
  const int block_failed = __syncthreads_or(op->failed);
  if (threadIdx.x != 0) return;
  uint32_t failed = (uint32_t)block_failed;
  if (gridDim.x > 1) { /* one block needs no count: it is the last */
    /* GPU scope: the last block acts for the whole grid (counts the op done,
     * or clears the flags at the wrap), so every block's accesses to the
     * buffer must be complete before its count is seen. */
    __threadfence();
    const uint32_t before = atomicAdd(&op->sig->blocks_done, block_failed ? 0x10001u : 1u);
    if ((before & 0xffffu) != gridDim.x - 1) return;
    failed += before >> 16;
    op->sig->blocks_done = 0;
  }
  if (failed) return;
  if (wrap) {
    tpc_wrap(a, *op);
    if (tpc_load_relaxed(&op->control->failed)) return;
    *(volatile uint32_t *)&op->control->epoch = op->epoch;
  }
  if (!bulk) return;
  const uint32_t seq = op->sig->bulk_seq + 1u;
  op->sig->bulk_seq = seq;
  if (bulk == TPC_BULK_WHOLE) op->sig->last_whole = seq;
}

#endif /* TPCOMM_PRIMITIVES_CUH */
