/*
 * Where everything lives inside one rank's registered buffer, and the
 * argument block every kernel receives. Shared by the C core and the CUDA
 * kernels, so it is plain C.
 *
 *   [0, TPC_SIGNALS_BYTES)     tpc_signals: epoch, barrier flags, headers
 *   [packet_off, +2*n*slot)    packet slots, [parity][sender], written by peers
 *   [data_off, +data_bytes)    bulk slots, written by peers between barriers
 */
#ifndef TPCOMM_LAYOUT_H
#define TPCOMM_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "../tpcomm.h"

#define TPC_SIGNALS_BYTES 16384
/* One packet: 16 bytes holding two {4 data bytes, 4 flag bytes} halves. */
#define TPC_PACKET_BYTES 16
#define TPC_PACKET_DATA_BYTES 8

/* Lives at offset 0 of every registered buffer. Fields marked "local" are
 * only touched by this rank; the others are written by peers. */
typedef struct {
  uint32_t epoch;            /* local: ops completed on this communicator */
  uint32_t blocks_done;      /* local: blocks of the current bulk op that finished */
  uint32_t blocks_arrived;   /* local: blocks of the current packet op that started */
  uint32_t abort_epoch;      /* local: an op that failed; its waits stop */
  uint32_t bulk_seq;         /* local: bulk ops completed */
  uint32_t error_claimed;    /* local: a thread of this GPU owns the error record */
  uint32_t pad_[2];
  uint32_t probe[TPC_MAX_RANKS];     /* peers: P2P probe tokens */
  uint32_t released[TPC_MAX_RANKS];  /* peers: bulk op they finished reading */
  uint32_t barrier_in[TPC_MAX_BLOCKS][TPC_MAX_RANKS];   /* peers: data pushed */
  uint32_t barrier_out[TPC_MAX_BLOCKS][TPC_MAX_RANKS];  /* peers: phase done */
  /* peers: one header packet per [parity][sender], says the op and its size */
  uint64_t header[2][TPC_MAX_RANKS][2];
} tpc_signals;

/* Packets are stored as 16-byte vectors: the header array must be aligned. */
#ifdef __cplusplus
static_assert(offsetof(tpc_signals, header) % 16 == 0, "header packets must be 16-byte aligned");
static_assert(sizeof(tpc_signals) <= TPC_SIGNALS_BYTES, "signals overflow their region");
#else
_Static_assert(offsetof(tpc_signals, header) % 16 == 0, "header packets must be 16-byte aligned");
_Static_assert(sizeof(tpc_signals) <= TPC_SIGNALS_BYTES, "signals overflow their region");
#endif

typedef struct {
  size_t packet_off;
  size_t packet_slot_bytes;  /* one sender's packets for one parity */
  size_t data_off;
  size_t data_bytes;
  size_t total_bytes;
} tpc_layout;

/* What kind of op a header packet announces; peers must agree. */
enum { TPC_OP_ALL_REDUCE = 1, TPC_OP_ALL_GATHER = 2 };

typedef struct {
  char *bufs[TPC_MAX_RANKS];  /* every rank's registered buffer, own included */
  tpc_async_error *err;       /* host-mapped error record (device address) */
  const void *in;
  void *out;
  uint64_t nbytes;            /* input bytes per rank */
  uint64_t row_bytes;         /* all-gather: contiguous run per rank in out */
  uint64_t timeout_ns;
  uint64_t packet_off;
  uint64_t packet_slot_bytes;
  uint64_t data_off;
  int32_t rank;
  int32_t world;
  int32_t dtype;              /* tpc_dtype, all-reduce only */
  int32_t op;                 /* TPC_OP_* */
} tpc_kernel_args;

static inline size_t tpc_round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* Bytes one parity of one sender's packet slot needs for packet_max_bytes
 * of input: a 16-byte packet carries 8 data bytes. */
static inline tpc_layout tpc_layout_for(int world, size_t max_bytes, size_t packet_max_bytes) {
  tpc_layout l;
  l.packet_off = TPC_SIGNALS_BYTES;
  l.packet_slot_bytes = tpc_round_up(packet_max_bytes * 2, 4096);
  l.data_off = l.packet_off + 2 * (size_t)world * l.packet_slot_bytes;
  /* all-reduce bulk: n scatter slots of ceil(units/n) 16-byte units, then
   * the gathered result; all-gather bulk: n slots of one rank's input. */
  l.data_bytes = tpc_round_up(2 * max_bytes + 16 * (size_t)world, 4096);
  l.total_bytes = l.data_off + l.data_bytes;
  return l;
}

#endif /* TPCOMM_LAYOUT_H */
