/*
 * The release of bulk slots between ops: a rank may overwrite a peer's slots
 * only once that peer has read what the last op put there (stream.cuh's
 * kernels call tpc_bulk_acquire at their start; tpc_op_end counts an op done).
 */
#ifndef TPCOMM_BULK_CUH
#define TPCOMM_BULK_CUH

#include "lifecycle.cuh"

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

#endif /* TPCOMM_BULK_CUH */
