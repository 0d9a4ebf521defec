/*
 * One op as every kernel's threads see it: its state (tpc_op), the threads a
 * block is made of, how it fails (the error record, the stop words, the NaN
 * poison of its output) and the one bounded wait for a peer. How an op begins
 * and ends is lifecycle.cuh; packets and headers, packet.cuh.
 */
#ifndef TPCOMM_OP_CUH
#define TPCOMM_OP_CUH

#include "../core/layout.h"
#include "data_ops.cuh"
#include "portability.cuh"

/* Every block is its data threads followed by one control warp. The control
 * warp of block 0 sends and checks the headers, so that the check waits beside
 * the data instead of after it. */
#define TPC_CONTROL_THREADS 32

/* The block's data warps: its data threads are a whole number of warps. */
TPC_DEVICE unsigned tpc_data_warps(void) { return (blockDim.x - TPC_CONTROL_THREADS) / TPC_WARP_LANES; }

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

/* Until *flag == value, bounded. An acquire at system scope: the flag is a
 * peer's release (tpc_wrap_meet), and what this thread reads next is the
 * memory that release published. */
TPC_DEVICE void tpc_flag_wait(tpc_op *op, const uint32_t *flag, uint32_t value, int peer) {
  uint32_t spins = 0;
  while (tpc_load_acquire(flag) != value)
    if (tpc_wait_gives_up(op, peer, &spins)) return;
}

#endif /* TPCOMM_OP_CUH */
