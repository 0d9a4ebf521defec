/*
 * Synchronisation building blocks shared by every collective: the op's epoch,
 * packets, the one bounded wait, per-block barriers, the deferred release of
 * bulk slots, and error recording.
 */
#ifndef TPCOMM_PRIMITIVES_CUH
#define TPCOMM_PRIMITIVES_CUH

#include "../core/layout.h"
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
  tpc_signals *sig;       /* this rank's signals */
  tpc_async_error *err;   /* host-mapped */
  uint64_t deadline_ns;   /* waits past this give up; 0 until a wait is slow */
  uint64_t timeout_ns;
  uint32_t epoch;         /* this op's number; packet flag value */
  uint32_t ticket;        /* thread 0: order in which this block arrived */
  int failed;             /* this thread gave up a wait */
} tpc_op;

/* Thread 0 of every block reads the epoch the previous op left and shares it
 * with its block; one block advances it for the next op (tpc_op_end), so graph
 * replays and eager calls, in any order, each get the next number without the
 * host knowing it.
 *
 * Which block advances it: for packet ops the last block to *arrive* (each
 * block takes a ticket whose operand depends on the epoch it read, so when the
 * last ticket is drawn every block has read it; a dependency, not a fence,
 * which would stall the whole block). The atomic's latency then
 * hides behind the block's data work instead of adding a round trip at the
 * end. Bulk ops count *completions* instead (tpc_op_end), because they also
 * release their slots to the peers, which needs every block done reading. */
TPC_DEVICE tpc_op tpc_op_begin(const tpc_kernel_args *a, int count_arrival) {
  __shared__ uint32_t block_epoch;
  tpc_grid_wait();    /* the previous kernel's writes (epoch, input) are visible */
  tpc_grid_release(); /* and the next kernel may start launching behind us */
  tpc_op op;
  op.sig = tpc_signals_of(a, a->rank);
  op.err = a->err;
  op.ticket = 0;
  if (threadIdx.x == 0) {
    uint32_t epoch = *(volatile uint32_t *)&op.sig->epoch + 1u;
    /* 0 means "never written" in every slot; skipping to 2 keeps the parity
     * alternating across the wrap. */
    if (epoch == 0) epoch = 2;
    block_epoch = epoch;
    if (count_arrival && gridDim.x > 1)
      op.ticket = atomicAdd(&op.sig->blocks_arrived, 1u + tpc_zero_after(epoch));
  }
  __syncthreads();
  op.epoch = block_epoch;
  op.deadline_ns = 0; /* set by the first slow wait: no clock read on the fast path */
  op.timeout_ns = a->timeout_ns;
  op.failed = 0;
  return op;
}

/* First error wins; later ones (other threads timing out as a consequence)
 * leave the record alone. The claim is a device-memory atomic: atomics on
 * host-mapped memory are not available over every PCIe root complex. The
 * record's code is written last, after a system fence, so the host never sees
 * a code with stale peer/epoch fields. The abort word stops this rank's other
 * waits. */
TPC_DEVICE void tpc_record_error(tpc_op *op, int code, int peer, uint32_t detail) {
  op->failed = 1;
  if (atomicCAS(&op->sig->error_claimed, 0u, 1u) == 0u) {
    volatile tpc_async_error *rec = op->err;
    rec->peer = peer;
    rec->epoch = op->epoch;
    rec->detail = detail;
    tpc_fence_system();
    rec->code = code;
    tpc_fence_system();
  }
  atomicExch(&op->sig->abort_epoch, op->epoch);
}

/* The one bound on waiting for a peer: called from every polling loop. Checks
 * the clock and the abort word only every 64 spins to keep the loop tight.
 * Returns nonzero when the wait must stop. */
TPC_DEVICE int tpc_wait_gives_up(tpc_op *op, int peer, uint32_t *spins) {
  if (op->failed) return 1;
  if ((++*spins & 63u) != 0) return 0;
  if (tpc_load_relaxed(&op->sig->abort_epoch) == op->epoch) {
    op->failed = 1;
    return 1;
  }
  const uint64_t now = tpc_clock_ns();
  if (op->deadline_ns == 0) op->deadline_ns = now + op->timeout_ns;
  if (now > op->deadline_ns) {
    tpc_record_error(op, TPC_ERR_TIMEOUT, peer, 0);
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

/* Spins on a packet in this rank's own buffer until both halves carry the
 * flag. On giving up the data is zero and op->failed is set. */
TPC_DEVICE uint2 tpc_packet_wait(tpc_op *op, const void *slot, int peer) {
  uint64_t lo, hi;
  uint32_t spins = 0;
  for (;;) {
    tpc_load_packet((const uint64_t *)slot, &lo, &hi);
    if ((uint32_t)(lo >> 32) == op->epoch && (uint32_t)(hi >> 32) == op->epoch) break;
    if (tpc_wait_gives_up(op, peer, &spins)) return make_uint2(0, 0);
  }
  return make_uint2((uint32_t)lo, (uint32_t)hi);
}

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

/* Headers let peers that disagree on an op or its size fail with a clear
 * record (and stop this rank's other waits) instead of timing out. The control
 * warp of block 0 sends them and waits for the peers' while the data threads
 * work, so the check adds nothing to the op's latency. */
TPC_DEVICE void tpc_header_send(const tpc_kernel_args *a, const tpc_op *op) {
  const int peer = tpc_control_peer(a);
  if (peer < 0) return;
  uint64_t *slot = tpc_signals_of(a, peer)->header[op->epoch & 1u][a->rank];
  tpc_store_packet(slot, tpc_packet_half((uint32_t)a->nbytes, op->epoch),
                   tpc_packet_half((uint32_t)a->op, op->epoch));
}

TPC_DEVICE void tpc_header_check(const tpc_kernel_args *a, tpc_op *op) {
  const int peer = tpc_control_peer(a);
  if (peer < 0) return;
  uint2 h = tpc_packet_wait(op, op->sig->header[op->epoch & 1u][peer], peer);
  if (!op->failed && (h.x != (uint32_t)a->nbytes || h.y != (uint32_t)a->op))
    tpc_record_error(op, TPC_ERR_MISMATCH, peer, h.x);
}

/* Block b of every rank meets block b of every other rank. Blocks of one op
 * cover the same index ranges on every rank, so this orders exactly the data
 * they exchange. Flags are equal to the epoch: never reused within 2^32 ops. */
TPC_DEVICE void tpc_block_barrier(const tpc_kernel_args *a, tpc_op *op, int second) {
  /* bar.sync makes the block's earlier stores visible to the signalling
   * threads; their system fence then orders all of them before the flag (the
   * cumulative release pattern of cooperative groups' grid sync, at system
   * scope). One fence per peer instead of one per thread. */
  __syncthreads();
  const int t = threadIdx.x;
  if (t < a->world && t != a->rank) {
    tpc_fence_system();
    tpc_signals *peer = tpc_signals_of(a, t);
    uint32_t *mine = second ? &peer->barrier_out[blockIdx.x][a->rank]
                            : &peer->barrier_in[blockIdx.x][a->rank];
    tpc_store_release(mine, op->epoch);
    const uint32_t *theirs = second ? &op->sig->barrier_out[blockIdx.x][t]
                                    : &op->sig->barrier_in[blockIdx.x][t];
    tpc_flag_wait(op, theirs, op->epoch, t);
  }
  __syncthreads();
}

/* Bulk slots are reused by every bulk op. Before writing into a peer's slots
 * we wait until that peer released the previous bulk op (it finished reading
 * them); the release is sent by its last block, so no barrier is spent at the
 * end of the op. Usually already satisfied when checked. */
TPC_DEVICE void tpc_bulk_acquire(const tpc_kernel_args *a, tpc_op *op) {
  const int t = threadIdx.x;
  if (t < a->world && t != a->rank) {
    const uint32_t done = *(volatile uint32_t *)&op->sig->bulk_seq;
    tpc_flag_wait(op, &op->sig->released[t], done, t);
  }
  __syncthreads();
}

/* Called by every block at the end. One block per op advances the epoch (the
 * next kernel on the stream sees it: kernel boundary). Packet ops: the last
 * block to arrive (see tpc_op_begin), no waiting. Bulk ops: the last block to
 * finish, which also tells peers their slots in our buffer are free again;
 * the fences order every block's reads of those slots before that release. */
TPC_DEVICE void tpc_op_end(const tpc_kernel_args *a, tpc_op *op, int bulk) {
  if (!bulk) {
    if (threadIdx.x != 0) return;
    if (gridDim.x > 1) {
      if (op->ticket != gridDim.x - 1) return;
      op->sig->blocks_arrived = 0;
    }
    *(volatile uint32_t *)&op->sig->epoch = op->epoch;
    return;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (gridDim.x > 1) { /* one block needs no count: it is the last */
    __threadfence();
    const uint32_t finished = atomicAdd(&op->sig->blocks_done, 1u);
    if (finished != gridDim.x - 1) return;
    op->sig->blocks_done = 0;
  }
  *(volatile uint32_t *)&op->sig->epoch = op->epoch;
  __threadfence();
  const uint32_t seq = op->sig->bulk_seq + 1u;
  op->sig->bulk_seq = seq;
  for (int p = 0; p < a->world; ++p)
    if (p != a->rank) tpc_store_release(&tpc_signals_of(a, p)->released[a->rank], seq);
}

#endif /* TPCOMM_PRIMITIVES_CUH */
