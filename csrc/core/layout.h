/*
 * Where everything lives inside one rank's registered buffer, the control
 * slot that outlives it, and the argument block every kernel receives. Shared
 * by the C core and the CUDA kernels, so it is plain C.
 *
 *   [0, TPC_SIGNALS_BYTES)     tpc_signals: counters, probe, release and wrap words, headers
 *   [TPC_SIGNALS_BYTES, +TPC_STREAM_FLAGS_BYTES)
 *                              stream flags, [parity][block][sender], written by peers
 *   [packet_off, +2*n*slot)    packet slots, [parity][sender], written by peers
 *   [data_off, +data_bytes)    bulk slots, written by peers: one half of the
 *                              region by the op's parity, or the whole (the
 *                              two-shot all-reduce where a half is too small)
 *
 * The words a kernel must read before it may touch that buffer (is the
 * communicator still open, has it or a peer failed, which op is next) live
 * apart from it, in a tpc_control slot from a pool that is never freed
 * (registry.c): a CUDA graph replayed after close() reads them safely and
 * stops there.
 */
#ifndef TPCOMM_LAYOUT_H
#define TPCOMM_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "../tpcomm.h"

#define TPC_SIGNALS_BYTES 16384
/* Streamed bulk kernels (stream.cuh) signal per block: one 64-bit flag per
 * [parity][block][sender]. */
#define TPC_STREAM_FLAGS_BYTES (2 * TPC_MAX_BLOCKS * TPC_MAX_RANKS * 8)
/* One packet: 16 bytes holding two {4 data bytes, 4 flag bytes} halves. */
#define TPC_PACKET_BYTES 16
#define TPC_PACKET_DATA_BYTES 8
/* The last epoch before the counter wraps: the op that runs under it clears
 * every flag peers wrote, so no flag older than 2^32 ops can match again. */
#define TPC_EPOCH_LAST 0xffffffffu

/* Device memory, 16 bytes, one per communicator ever created in the process;
 * never freed, never reused (registry.c). Read by thread 0 of every block
 * in one 16-byte load before anything else. */
typedef struct {
  uint32_t alive;   /* the communicator's comm_id (low 32 bits) while open; 0 once closed */
  uint32_t epoch;   /* the last op's number; advanced by the device */
  uint32_t failed;  /* 0, or the first error's tpc_result: later ops exit at once */
  /* Written by peers (the pool chunk is IPC-mapped by every peer): nonzero
   * once a peer failed, (its tpc_result << 8) | (its rank + 1). Read in the
   * same load as the rest, so a rank that arrives after its peer gave up an
   * op refuses it instead of returning a result its peer does not have. */
  uint32_t stopped;
} tpc_control;

#define TPC_HEADER_SLOTS 4 /* a power of two */

/* Lives at offset 0 of every registered buffer. Fields marked "local" are
 * only touched by this rank; the others are written by peers. */
typedef struct {
  uint32_t blocks_done;      /* local: blocks of the current op that finished */
  uint32_t blocks_arrived;   /* local: blocks of the current op that read its epoch */
  uint32_t bulk_seq;         /* local: bulk ops completed */
  uint32_t wraps;            /* local: epoch wraps completed */
  uint32_t last_whole;       /* local: bulk_seq after the last bulk op that used the whole data region */
  uint32_t pad_[3];
  uint32_t probe[TPC_MAX_RANKS];     /* peers: P2P probe tokens */
  uint32_t released[TPC_MAX_RANKS];  /* peers: bulk ops they finished reading (sent as their next one starts) */
  uint32_t wrap_in[TPC_MAX_RANKS];   /* peers: done with the last epoch before the wrap */
  uint32_t wrap_out[TPC_MAX_RANKS];  /* peers: cleared their flags at the wrap */
  /* Everything from here to the end of the packet slots (the stream flags
   * included) carries epoch flags and is cleared at the wrap. */
  /* peers: one header packet per [epoch % TPC_HEADER_SLOTS][sender], says
   * the op and its size (four slots: sent early, packet.cuh) */
  uint64_t header[TPC_HEADER_SLOTS][TPC_MAX_RANKS][2];
} tpc_signals;

/* Packets are stored as 16-byte vectors, and the wrap clears from the
 * header array on in 16-byte units: it must be aligned. */
#ifdef __cplusplus
static_assert(offsetof(tpc_signals, header) % 16 == 0, "header packets must be 16-byte aligned");
static_assert(sizeof(tpc_signals) <= TPC_SIGNALS_BYTES, "signals overflow their region");
static_assert(sizeof(tpc_control) == 16, "the control slot is read in one 16-byte load");
#else
_Static_assert(offsetof(tpc_signals, header) % 16 == 0, "header packets must be 16-byte aligned");
_Static_assert(sizeof(tpc_signals) <= TPC_SIGNALS_BYTES, "signals overflow their region");
_Static_assert(sizeof(tpc_control) == 16, "the control slot is read in one 16-byte load");
#endif

typedef struct {
  size_t packet_off;
  size_t packet_slot_bytes;  /* one sender's packets for one parity */
  size_t data_off;
  size_t data_bytes;
  size_t total_bytes;
} tpc_layout;

/* The header's kind word: op, algorithm, dtype and a fold of the row length,
 * a byte each (low to high), so peers that disagree on any of them fail with
 * a CollectiveMismatch that names the field. */
static inline uint32_t tpc_kind_word(int op, int algo, int dtype, uint64_t row_bytes) {
  const uint32_t row_fold = (uint32_t)(row_bytes ^ (row_bytes >> 8) ^ (row_bytes >> 16) ^ (row_bytes >> 24)) & 0xffu;
  return (uint32_t)(op & 0xff) | (uint32_t)(algo & 0xff) << 8 | (uint32_t)(dtype & 0xff) << 16 | row_fold << 24;
}
#define TPC_KIND_OP(kind) ((kind) & 0xffu)
/* The fused norm's op byte also carries its tpc_norm_pattern in bits 3 to 5
 * (the ops fit in the low three: tpc_collective), so ranks that call
 * different patterns fail as a mismatch of the op instead of computing
 * different outputs from the same sums. */
#define TPC_KIND_NORM_OP(op, pattern) ((op) | (pattern) << 3)
/* ... and its tpc_norm_quant in the top two bits */
#define TPC_KIND_NORM_QUANT_OP(op, pattern, quant) (TPC_KIND_NORM_OP(op, pattern) | (quant) << 6)
#define TPC_KIND_BASE_OP(kind) ((kind) & 0x07u)
#define TPC_KIND_PATTERN(kind) (((kind) >> 3) & 0x07u)
#define TPC_KIND_QUANT(kind) (((kind) >> 6) & 0x03u)
#define TPC_KIND_ALGO(kind) (((kind) >> 8) & 0xffu)
#define TPC_KIND_DTYPE(kind) (((kind) >> 16) & 0xffu)

typedef struct {
  char *bufs[TPC_MAX_RANKS];  /* every rank's registered buffer, own included */
  tpc_control *control;       /* this communicator's control slot (never freed) */
  tpc_control *peer_control[TPC_MAX_RANKS]; /* the peers' slots, mapped: their stop words */
  tpc_async_error *err;       /* its host-mapped error record (device address, never freed) */
  const void *in;
  void *out;
  uint64_t nbytes;            /* input bytes per rank (reduce_scatter: one chunk, the output) */
  uint64_t out_bytes;         /* bytes of out: poisoned when the op cannot run */
  uint64_t row_bytes;         /* all-gather: contiguous run per rank in out */
  uint64_t timeout_ns;
  uint64_t packet_off;
  uint64_t packet_slot_bytes;
  uint64_t data_off;
  uint64_t data_bytes;        /* the bulk region; streamed kernels use one half of it */
  uint64_t poison;            /* 8-byte NaN pattern of out's dtype, written as 4-byte words */
  uint32_t comm_id;           /* the communicator's comm_id, low 32 bits: control->alive must equal it while open */
  uint32_t kind;              /* tpc_kind_word of this op */
  int32_t rank;
  int32_t world;
  int32_t dtype;              /* tpc_dtype, all-reduce only */
  int32_t op;                 /* TPC_OP_* */
  int32_t poison_out;         /* out is floating point: fill it with NaN on failure */
  int32_t max_blocks;         /* multiprocessors of the device: packet kernels spread over at most this many */
  /* the fused norm family (tpc_all_reduce_norm) only: out is the normed output */
  const void *residual;       /* added to the sum; read before out2 is written (may alias it) */
  const void *weight;         /* the (first) norm's weight, one row */
  void *out2;                 /* the stream output: z (ADD_NORM) or o */
  float eps;
  int32_t out_f32;            /* reduce_scatter: out holds the fp32 sums, not rounded to the dtype */
  /* After every other kernel's fields: their parameter offsets do not
   * depend on the fused norm's. */
  const void *next_weight;    /* NORM_ADD_NORM: the second norm's weight, one row; NULL otherwise */
  float next_eps;             /* NORM_ADD_NORM: the second norm's eps */
  int32_t pattern;            /* a tpc_norm_pattern: the launch picks the kernel's instantiation by it */
  float weight_offset;        /* added to every weight value in fp32: 1.0f, or -0.0f for none (-0 + w is w,
                                 -0.0 included, so offset 0 leaves ADD_NORM's bits as they were) */
  /* The FP8 epilogue (tpc_all_reduce_norm_quant; quant 0 elsewhere): out holds the e4m3 codes */
  int32_t quant;              /* a tpc_norm_quant: the launch picks the instantiation by it */
  float scale_floor;          /* the dynamic scales' lower bound */
  void *out3;                 /* the 16-bit normed output, or NULL: not written */
  float *scales;              /* PER_TENSOR: read (scales[0]); else written */
  uint64_t scale_row_stride;  /* floats between two rows' scales */
  uint64_t scale_group_stride; /* floats between two groups' scales of a row */
  uint64_t poison2;           /* the input dtype's 8-byte NaN: out2 and out3 on failure (poison is e4m3's) */
  /* The LayerNorm patterns and the residual scale (tpc_norm_spec) */
  const void *bias;           /* the (first) norm's bias, one row, or NULL: no add (LayerNorm only) */
  const void *next_bias;      /* the second norm's (LAYER_NORM_ADD_LAYER_NORM), or NULL */
  float residual_scale;       /* m: the term added to the residual is m times it; 1.0f elsewhere */
} tpc_kernel_args;

static inline size_t tpc_round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* Bytes one parity of one sender's packet slot needs for packet_max_bytes
 * of input: a 16-byte packet carries 8 data bytes. */
static inline tpc_layout tpc_layout_for(int world, size_t max_bytes, size_t packet_max_bytes) {
  tpc_layout l;
  l.packet_off = TPC_SIGNALS_BYTES + TPC_STREAM_FLAGS_BYTES;
  l.packet_slot_bytes = tpc_round_up(packet_max_bytes * 2, 4096);
  l.data_off = l.packet_off + 2 * (size_t)world * l.packet_slot_bytes;
  /* streamed all-reduce of two ranks and all-gather: n-1 slots of one
   * rank's input in either half; reduce-scatter: n-1 slots of one chunk in
   * either half (its cap keeps them there: reduce_scatter.cuh); all-reduce
   * of more ranks (the streamed two-shot): 2(n-1) slots of ceil(units/n)
   * 16-byte units, in one half where they fit, else in the whole
   * (all_reduce.cuh shows they always fit there). */
  l.data_bytes = tpc_round_up(2 * max_bytes + 16 * (size_t)world, 4096);
  l.total_bytes = l.data_off + l.data_bytes;
  return l;
}

#endif /* TPCOMM_LAYOUT_H */
