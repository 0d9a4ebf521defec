/*
 * How an op begins and ends, in every kernel: the control load, the epoch and
 * its wrap, the handoff from the control warp to the block, the start every
 * packet kernel shares (tpc_packet_prologue), and the end that counts a bulk
 * op done.
 */
#ifndef TPCOMM_LIFECYCLE_CUH
#define TPCOMM_LIFECYCLE_CUH

#include "packet.cuh"

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
template <typename Prefetch, typename ControlSetup>
TPC_DEVICE tpc_op tpc_op_begin(const tpc_kernel_args *a, Prefetch prefetch, ControlSetup control_setup) {
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
    uint32_t refused = c.x != a->comm_id ? (uint32_t)TPC_ERR_CLOSED : c.z;
    if (!refused && c.w) refused = tpc_refuse_for_peer(a, epoch, c.w);
    block_epoch = epoch;
    block_refused = refused;
  }
  /* The control warp hands the slot to the block without waiting for it
   * (tpc_block_handoff), and with it whatever block state `control_setup`
   * set (the streamed kernels' push counts, stream.cuh): the handoff orders
   * those stores before every access of the data threads after it, as it
   * does block_epoch's. The data threads first wait for the previous kernel
   * (the input and the buffers may still be written by it) and start loading
   * their input (prefetch): that load overlaps the control load when the
   * previous kernel has already finished. The handoff is one call site for
   * every thread, as AMD's wave-wide barrier needs. */
  if (control_warp) {
    control_setup();
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

template <typename Prefetch>
TPC_DEVICE tpc_op tpc_op_begin(const tpc_kernel_args *a, Prefetch prefetch) {
  return tpc_op_begin(a, prefetch, [] {});
}

TPC_DEVICE tpc_op tpc_op_begin(const tpc_kernel_args *a) {
  return tpc_op_begin(a, [] {}, [] {});
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

#endif /* TPCOMM_LIFECYCLE_CUH */
