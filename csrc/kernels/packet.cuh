/*
 * Packets (8 data bytes, each 4 beside a 4-byte flag that is the op's epoch)
 * and the header packets that let peers that disagree on an op name each
 * other: the slots, the pushes, the waits.
 */
#ifndef TPCOMM_PACKET_CUH
#define TPCOMM_PACKET_CUH

#include "op.cuh"

TPC_DEVICE uint64_t tpc_packet_half(uint32_t data, uint32_t flag) {
  return ((uint64_t)flag << 32) | data;
}

TPC_DEVICE void tpc_packet_put(void *slot, uint2 data, uint32_t flag) {
  tpc_store_packet((uint64_t *)slot, tpc_packet_half(data.x, flag), tpc_packet_half(data.y, flag));
}

TPC_DEVICE int tpc_packet_ready(uint64_t lo, uint64_t hi, uint32_t epoch) {
  return (uint32_t)(lo >> 32) == epoch && (uint32_t)(hi >> 32) == epoch;
}

/* Sender's header packet for an op in rank owner's signals (tpc_header_send). */
TPC_DEVICE uint64_t *tpc_header_slot(const tpc_kernel_args *a, int owner, uint32_t epoch, int sender) {
  return tpc_signals_of(a, owner)->header[epoch & (TPC_HEADER_SLOTS - 1)][sender];
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

#endif /* TPCOMM_PACKET_CUH */
