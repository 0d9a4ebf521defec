/*
 * tpcomm public C API.
 *
 * One communicator per tensor-parallel group and GPU. Its life cycle:
 *
 *   tpc_comm_create      allocate this rank's registered buffer (signals, packet
 *                        slots, bulk data slots) and its host-mapped error record
 *   tpc_comm_export      write the IPC handles of that buffer and of the control
 *                        slot peers write their stop word into (TPC_IPC_HANDLE_BYTES)
 *   tpc_comm_open_peer   open a peer's handle, once for every other rank, in any order
 *   tpc_comm_ready       check every peer is open and upload the peer table
 *   tpc_all_reduce / tpc_all_gather / tpc_reduce_scatter   enqueue collectives on a stream
 *   tpc_comm_destroy     close every opened handle, free every buffer
 *   tpc_comm_abort       non-blocking: stop this communicator's device work now
 *                        (queued ops and graph replays exit), tell the peers,
 *                        and leave the GPU memory mapped (a kernel may still run)
 *
 * Every communicator has a process-unique comm_id that is never reused. The torch
 * ops take that comm_id, not a pointer: tpc_comm_acquire looks it up, so a closed or
 * unknown comm_id is an error naming it, never a dangling pointer. Kernels check a
 * per-communicator "alive" word kept in memory that is never freed before they
 * touch any buffer, so a CUDA graph replayed after destroy records
 * TPC_ERR_CLOSED and writes nothing.
 *
 * Once an error is recorded on the device, every later op of that
 * communicator exits at once, writes nothing to peers and fills a
 * floating-point output with NaN; peers are told, so a late rank does not
 * complete an op its peer gave up.
 *
 * Every function returns a tpc_result; tpc_comm_last_error() gives the
 * human-readable reason of the last failure on that communicator (or, for a
 * NULL communicator, of the last failed create on this thread). Errors that
 * happen on the device after a call returned (a peer that never arrived, peers
 * that disagree on the size of an op) are recorded in host-mapped memory and
 * read by tpc_comm_async_error() without synchronising; a communicator with an
 * async error refuses further work.
 */
#ifndef TPCOMM_H
#define TPCOMM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TPC_MAX_RANKS 8
/* What tpc_comm_export writes: the IPC handles of this rank's buffer and of
 * its control slot's pool chunk, and the slot's offset in that chunk. */
#define TPC_IPC_HANDLE_BYTES 144
/* Largest tpc_config.max_bytes: an op's size travels in 32-bit header words. */
#define TPC_MAX_BYTES_LIMIT 4294967296
/* Largest tpc_config.packet_max_bytes: a packet carries 8 data bytes in 16,
 * so a sender's packet slot (twice the cap) stays within 4 GiB. */
#define TPC_PACKET_MAX_BYTES_LIMIT 2147483648
/* Most blocks a bulk launch uses; sizes the per-block stream flag arrays. */
#define TPC_MAX_BLOCKS 128
/* Data threads of the largest block a kernel is launched with (the packet
 * kernels' wide blocks, the fused norm kernel); one control warp of 32
 * threads comes on top. */
#define TPC_BLOCK_THREADS 512
/* Longest row (bytes of the last dimension) tpc_all_reduce_norm takes:
 * TPC_BLOCK_THREADS threads x 8 packet units of 8 bytes, held in registers. */
#define TPC_NORM_MAX_ROW_BYTES 32768

typedef struct tpc_comm tpc_comm;

typedef enum {
  TPC_OK = 0,
  TPC_ERR_INVALID_ARG = 1,  /* bad pointer, size, dtype, alignment, rank   */
  TPC_ERR_RUNTIME = 2,      /* the CUDA/HIP runtime refused a call         */
  TPC_ERR_PEER = 3,         /* a peer's handle could not be opened         */
  TPC_ERR_STATE = 4,        /* not ready, already failed, or being misused */
  TPC_ERR_TIMEOUT = 5,      /* device: a peer did not arrive in time       */
  TPC_ERR_MISMATCH = 6,     /* device: peers disagree on the op or size    */
  TPC_ERR_TOO_LARGE = 7,    /* larger than the registered buffers take     */
  TPC_ERR_CLOSED = 8        /* closed, aborted, unknown comm_id, or a graph replayed after close */
} tpc_result;

typedef enum { TPC_FLOAT32 = 0, TPC_FLOAT16 = 1, TPC_BFLOAT16 = 2 } tpc_dtype;

/* Which kernel runs an op: the caller decides (tpcomm.routing), the core runs
 * it. Any other value is refused with TPC_ERR_INVALID_ARG naming it. */
typedef enum {
  TPC_ALGO_PACKET = 1,     /* barrier-free: data and epoch flag in one store */
  TPC_ALGO_BULK = 2,       /* 16-byte copies, streamed (stream.cuh)          */
  TPC_ALGO_LINE = 3,       /* 128-byte lines of data and flag (NVLink only):
                              every op, up to the packet cap */
  TPC_ALGO_TWO_SHOT = 4,   /* all_reduce in lines, in two phases (reduce-scatter,
                              then all-gather), up to the packet cap, at least
                              one warp step of lines per rank: more than
                              TPC_LINE_STEP_BYTES * (world - 1) bytes */
  /* all_reduce of float16/bfloat16 only, streamed in two phases with
     quantized values on the wire (all_reduce_quant.cuh): groups of
     TPC_QUANT_GROUP elements, one fp32 scale each; up to the bulk cap.
     Not exact: docs/design.md bounds the error. CUDA builds only. */
  TPC_ALGO_QUANTIZED_FP8 = 5,  /* e4m3 values */
  TPC_ALGO_QUANTIZED_INT8 = 6, /* int8 values in [-127, 127] */
  TPC_ALGO_QUANTIZED_INT4 = 7, /* int4 values in [-7, 7], two a byte */
  TPC_ALGO_BULK_ONE_SHOT = 8  /* all_reduce of two ranks, streamed in one phase
                              (each rank sums both inputs); TPC_ALGO_BULK's
                              all_reduce is the streamed two-shot of 3+ ranks */
} tpc_algo;

/* Elements of one quantization group (one fp32 scale each). */
#define TPC_QUANT_GROUP 32

/* The collectives, as the kind word of a header names them (layout.h). */
typedef enum { TPC_OP_ALL_REDUCE = 1, TPC_OP_ALL_GATHER = 2, TPC_OP_REDUCE_SCATTER = 3, TPC_OP_ALL_REDUCE_NORM = 4 } tpc_collective;

/* What tpc_all_reduce_norm computes around the all-reduce s (fp32, rank
 * order) with residual r and residual scale m, all in fp32:
 *   norm_w(v)     = v * rsqrt(mean(v^2) + eps) * (w + weight_offset)                (RMSNorm)
 *   ln_w,b(v)     = (v - mean(v)) * rsqrt(mean((v - mean(v))^2) + eps) * (w + weight_offset) + b
 * (LayerNorm, biased variance; no w: no multiply, no b: no add). Returns
 * (normed, stream_out). tpcomm.norm_patterns.Pattern is this enum. */
typedef enum {
  TPC_PATTERN_ADD_NORM = 0,                  /* z = r + m*s: (norm_w(z), z) */
  TPC_PATTERN_NORM_ADD = 1,                  /* o = r + m*norm_w(s): (o, o) */
  TPC_PATTERN_NORM_ADD_NORM = 2,             /* o as NORM_ADD: (norm_next_w(o) with next_eps, o) */
  TPC_PATTERN_ADD_LAYER_NORM = 3,            /* z = r + m*s: (ln_w,b(z), z) */
  TPC_PATTERN_LAYER_NORM_ADD = 4,            /* o = r + m*ln_w,b(s): (o, o) */
  TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM = 5  /* o as LAYER_NORM_ADD: (ln_next_w,next_b(o) with next_eps, o) */
} tpc_norm_pattern;

/* The FP8 epilogue of the fused norm (tpc_all_reduce_norm_quant). x is the
 * normed output rounded to the input's dtype, exactly as tpc_all_reduce_norm
 * writes it, read back in fp32; e4m3(v) rounds to nearest even to e4m3 ("fn":
 * torch.float8_e4m3fn), saturating at +-448, NaN to NaN (0x7f). Every division
 * is fp32's, correctly rounded. tpcomm.fp8.Quant is this enum. */
typedef enum {
  TPC_QUANT_NONE = 0,           /* the normed output in the input's dtype */
  TPC_QUANT_PER_TENSOR = 1,     /* q = e4m3(x / scale), scale given (one float) */
  TPC_QUANT_PER_TOKEN = 2,      /* s = max(amax_row(|x|) / 448, floor), q = e4m3(x / s) */
  TPC_QUANT_PER_TOKEN_GROUP = 3 /* the same over each TPC_FP8_GROUP values of a row */
} tpc_norm_quant;

/* e4m3fn's NaN code in every byte of a word: what a failed or refused FP8 epilogue leaves in its codes */
#define TPC_E4M3_NAN_BYTES 0x7f7f7f7f7f7f7f7full

/* Values of a row per scale of TPC_QUANT_PER_TOKEN_GROUP (DeepSeek-V3's block FP8). */
#define TPC_FP8_GROUP 128

/* Which GPUs a build runs on: the line protocol rests on NVLink delivering
 * a warp's 128-byte store whole, which AMD's fabric does not promise. */
typedef enum { TPC_PLATFORM_CUDA = 0, TPC_PLATFORM_ROCM = 1 } tpc_platform;

/* Why a kernel takes no call of an op at all (tpc_kernel_limits.refused). */
typedef enum {
  TPC_KERNEL_TAKES = 0,
  TPC_KERNEL_NO_OP = 1,       /* the kernel has no variant for the op */
  TPC_KERNEL_NO_PLATFORM = 2, /* not in this platform's build */
  TPC_KERNEL_NO_WORLD = 3     /* not at this world size */
} tpc_kernel_refusal;

/* What one kernel takes for one op: the only statement of the kernels'
 * rules. The C core validates every op against it (ops.c) and
 * tpcomm.routing derives its refusals from it, so a new constraint is one
 * edit in limits.c. The chunk is what one rank sends of the op: the input
 * of all_reduce and all_gather, one part of reduce_scatter's input. */
typedef struct {
  int32_t refused;     /* a tpc_kernel_refusal: TPC_KERNEL_TAKES, or why no call runs */
  uint32_t dtypes;     /* bit 1 << d for each tpc_dtype d it reduces; 0: any (it moves bytes) */
  uint64_t multiple;   /* chunk (and all_gather's row) a positive multiple of this many bytes */
  uint64_t more_than;  /* chunk more than this many bytes (two_shot: a warp step of lines per rank) */
  uint64_t packet_cap; /* chunk at most this (data in the packet slots); UINT64_MAX: no such cap */
  uint64_t chunks;     /* chunks of one op that share the bulk slots (max_bytes) */
  uint64_t max_bytes;  /* the communicator's cap on the bulk slots */
  uint64_t cap;        /* chunk at most this (max_bytes / chunks); UINT64_MAX: no such cap */
  uint64_t max_row;    /* row (all_gather, the fused norm) at most this; UINT64_MAX: any */
  uint64_t align;      /* every pointer aligned to this many bytes */
} tpc_kernel_limits;

/* The limits of kernel `algo` for `op` in a communicator of `world` ranks
 * with these caps, on `platform`. TPC_ERR_INVALID_ARG for an unknown op,
 * algorithm or platform, or a world outside 2 .. TPC_MAX_RANKS. */
tpc_result tpc_kernel_limits_of(int op, int algo, int world, size_t max_bytes, size_t packet_max_bytes,
                                int platform, tpc_kernel_limits *out);

/* Checks one call against limits: dtype (ignored where limits->dtypes is
 * 0), chunk and row bytes (row: all_gather and the fused norm; 0 elsewhere),
 * the pointers in `ptrs` (n of them). TPC_OK, or TPC_ERR_INVALID_ARG /
 * TPC_ERR_TOO_LARGE with a sentence naming the rule and the numbers in
 * why[0 .. why_len). */
tpc_result tpc_kernel_check(const tpc_kernel_limits *limits, int op, int algo, int dtype, size_t chunk,
                            size_t row, const void *const *ptrs, int n, char *why, size_t why_len);

/* Data bytes of one warp step of the line kernels: 4 lines of 112. */
#define TPC_LINE_STEP_BYTES 448

typedef struct {
  int rank;
  int world_size;          /* 2 .. TPC_MAX_RANKS */
  int device;              /* CUDA device ordinal this rank runs on */
  size_t max_bytes;        /* cap on the output bytes of one op (bulk slots) */
  size_t packet_max_bytes; /* cap on the input bytes per rank of packet kernels */
  uint64_t timeout_ns;     /* bound on every device-side wait for a peer */
} tpc_config;

/* What the device recorded when an op failed on it. */
typedef struct {
  int32_t code;            /* a tpc_result, TPC_OK when nothing happened */
  int32_t peer;            /* the rank that did not arrive, disagreed, or gave up */
  uint32_t epoch;          /* the op's sequence number on this communicator */
  int32_t reported;        /* 1: `peer` gave up (with `code`); this rank only learned of it */
  uint32_t peer_bytes;     /* TPC_ERR_MISMATCH: what the peer announced */
  uint32_t peer_kind;
  uint32_t own_bytes;      /* TPC_ERR_MISMATCH: what this rank ran */
  uint32_t own_kind;       /* kind words: op | algo << 8 | dtype << 16 | row fold << 24 */
} tpc_async_error;

tpc_result tpc_comm_create(const tpc_config *config, tpc_comm **comm_out);
tpc_result tpc_comm_export(tpc_comm *comm, void *handle_out);
tpc_result tpc_comm_open_peer(tpc_comm *comm, int peer, const void *handle);
tpc_result tpc_comm_ready(tpc_comm *comm);
tpc_result tpc_comm_destroy(tpc_comm *comm);
/* Never blocks and needs no peer: marks the communicator failed on the device
 * (its queued ops and graph replays exit; peers are told), retires its comm_id and
 * frees the host state. The registered buffer stays allocated and mapped,
 * because kernels may still be running on it: it is released when the process
 * exits. */
tpc_result tpc_comm_abort(tpc_comm *comm);

/* The process-unique comm_id of a communicator (never 0, never reused). */
uint64_t tpc_comm_id(const tpc_comm *comm);
/* Looks up an open communicator by comm_id and claims it for one op from this
 * thread: another thread that acquires it before tpc_comm_release gets
 * TPC_ERR_STATE; a closed or unknown comm_id gets TPC_ERR_CLOSED naming it. The
 * message of a failed acquire is read with tpc_comm_last_error(NULL). */
tpc_result tpc_comm_acquire(uint64_t comm_id, tpc_comm **comm_out);
void tpc_comm_release(tpc_comm *comm);
/* The device error record of any comm_id ever created, open or closed (a graph
 * replayed after close records TPC_ERR_CLOSED there). Returns the record's
 * code, with its message in tpc_comm_last_error(NULL); TPC_ERR_CLOSED with a
 * clean record for a closed comm_id; TPC_ERR_INVALID_ARG for an unknown one. */
tpc_result tpc_id_async_error(uint64_t comm_id, tpc_async_error *out);

/* Real P2P check: write a token into every peer's buffer, then (after the
 * caller's host barrier) read which peers' tokens arrived in ours. */
tpc_result tpc_comm_probe_write(tpc_comm *comm);
tpc_result tpc_comm_probe_read(tpc_comm *comm, uint32_t *arrived_mask);

/* Sum in fp32, in rank order 0..n-1, rounded once: identical bits on every rank.
 * nbytes is the byte size of input and output; a multiple of 16; in and out
 * 16-byte aligned (the torch binding copies misaligned views: routing never
 * depends on a pointer). in == out is allowed. */
tpc_result tpc_all_reduce(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          tpc_dtype dtype, tpc_algo algo, void *stream);

/* tpc_all_reduce on the communicator of a comm_id, claimed for the call
 * (tpc_comm_acquire) and released after it: the eager fast path's one call
 * per op. Any failure's message, the acquire's or the op's, is in
 * tpc_comm_last_error(NULL). */
tpc_result tpc_id_all_reduce(uint64_t comm_id, const void *in, void *out, size_t nbytes, tpc_dtype dtype,
                             tpc_algo algo, void *stream);

/* The norm of a tpc_all_reduce_norm call: its pattern and what the pattern
 * reads (tpc_norm_check states the rules). Vectors are one row (row_bytes)
 * of the input's dtype, 16-byte aligned, or NULL:
 *   weight       the (first) norm's; required by the RMS patterns; NULL for
 *                a LayerNorm: no multiply (weight_offset then 0)
 *   bias         the LayerNorm patterns' (NULL: no add); NULL for RMS
 *   next_weight  the second norm's: required by NORM_ADD_NORM, optional for
 *                LAYER_NORM_ADD_LAYER_NORM, NULL for the others
 *   next_bias    LAYER_NORM_ADD_LAYER_NORM's second bias, optional; NULL elsewhere
 * eps (next_eps: the second norm's, read only by the patterns that have one)
 * in [0, 1]; weight_offset 0 or 1 (Gemma's 1 + w), added to every weight;
 * residual_scale m, finite, multiplies the term added to the residual. */
typedef struct {
  tpc_norm_pattern pattern;
  const void *weight, *bias, *next_weight, *next_bias;
  float eps, next_eps, weight_offset, residual_scale;
} tpc_norm_spec;

/* The fused all-reduce + residual add + norm family, one launch of the
 * packet kernel for every tpc_norm_pattern, over the rows of a 16-bit tensor
 * (the last dimension, row_bytes long, is a row; nbytes is the whole input).
 * With s = the sum over ranks in fp32, in rank order, r = residual, m =
 * residual_scale and norm the pattern's (tpc_norm_pattern), all in fp32
 * (nothing rounded in between):
 *   ADD_NORM, ADD_LAYER_NORM   z = r + m*s;  normed = round(norm(z)), stream_out = round(z)
 *   NORM_ADD, LAYER_NORM_ADD   o = r + m*norm(s);  normed = stream_out = round(o)
 *   NORM_ADD_NORM, LAYER_NORM_ADD_LAYER_NORM
 *                              o as above;  normed = round(norm_next(o)), stream_out = round(o)
 * identical bits on every rank whose residual is the same. Float16 or
 * bfloat16; row_bytes a multiple of 16 up to TPC_NORM_MAX_ROW_BYTES dividing
 * nbytes, nbytes up to the packet cap; every pointer 16-byte aligned. normed
 * may be in and stream_out may be residual. */
tpc_result tpc_all_reduce_norm(tpc_comm *comm, const tpc_norm_spec *norm, const void *in, const void *residual,
                               void *normed, void *stream_out, size_t nbytes, size_t row_bytes, tpc_dtype dtype,
                               void *stream);

/* tpc_all_reduce_norm with an FP8 epilogue (tpc_norm_quant): the normed
 * output also quantized to e4m3 codes (one byte a value, the input's shape).
 * normed (the 16-bit normed output) may be NULL when quant is not NONE: then
 * it is not written. scales: TPC_QUANT_PER_TENSOR reads scales[0];
 * PER_TOKEN writes scales[row * scale_row_stride] and PER_TOKEN_GROUP
 * scales[row * scale_row_stride + g * scale_group_stride] (g the row's group:
 * row-major or column-major scales alike), strides in floats; the row's
 * values a multiple of TPC_FP8_GROUP for PER_TOKEN_GROUP. scale_floor, finite
 * and > 0, bounds the dynamic scales from below. codes 16-byte aligned,
 * scales 4-byte; neither may overlap another argument. CUDA builds only. */
tpc_result tpc_all_reduce_norm_quant(tpc_comm *comm, const tpc_norm_spec *norm, tpc_norm_quant quant,
                                     const void *in, const void *residual, void *normed, void *stream_out,
                                     void *codes, float *scales, size_t scale_row_stride, size_t scale_group_stride,
                                     float scale_floor, size_t nbytes, size_t row_bytes, tpc_dtype dtype,
                                     void *stream);

/* The FP8 epilogue's own rules (limits.c), apart from the pointers and the
 * kernel's sizes: quant known and built for this platform (rocm nonzero:
 * refused), the row (row_values values) a multiple of TPC_FP8_GROUP for
 * PER_TOKEN_GROUP, strides nonzero where scales are written, the floor
 * finite and > 0 for the dynamic scales. */
tpc_result tpc_norm_quant_check(int quant, size_t row_values, size_t scale_row_stride,
                                size_t scale_group_stride, float scale_floor, int rocm, char *why, size_t why_len);

/* The fused norm's own rules (limits.c), apart from the kernel's sizes and
 * alignment: norm not NULL, pattern known, which vectors the pattern takes
 * (tpc_norm_spec), eps (and next_eps where it is used) in [0, 1],
 * weight_offset 0 or 1 and 0 where a norm has no weight, residual_scale
 * finite. TPC_OK or TPC_ERR_INVALID_ARG with a sentence in why[0 .. why_len). */
tpc_result tpc_norm_check(const tpc_norm_spec *norm, char *why, size_t why_len);

/* Gather nbytes from every rank. The output is the concatenation along a
 * dimension whose contiguous run per rank is row_bytes (nbytes for dim 0):
 * rank q's byte b lands at (b / row_bytes) * n * row_bytes + q * row_bytes
 * + b % row_bytes. nbytes and row_bytes are multiples of 4 (of 16 for the
 * line and bulk kernels); in and out 16-byte aligned, so which packet kernel
 * runs depends on the shape alone (the torch binding copies misaligned
 * views). nan_pattern: 8
 * bytes of the output dtype's NaN (0x7fc07fc07fc07fc0 for bfloat16), written
 * over the output when the op cannot produce it; 0 for dtypes without NaN
 * (the output is then left as is). all_reduce derives it from its dtype. */
tpc_result tpc_all_gather(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          size_t row_bytes, tpc_algo algo, uint64_t nan_pattern, void *stream);

/* Rank r's output is the sum over ranks of chunk r of their input: `in`
 * holds world_size chunks of chunk_bytes each (the layout of NCCL's
 * reduce_scatter_tensor), `out` one chunk. Sums in fp32 in rank order, as
 * all_reduce. chunk_bytes is a multiple of 16; in and out 16-byte aligned.
 * The packet cap applies to the chunk, the bulk cap to the whole input. */
tpc_result tpc_reduce_scatter(tpc_comm *comm, const void *in, void *out, size_t chunk_bytes,
                              tpc_dtype dtype, tpc_algo algo, void *stream);

/* The same sums, written as fp32 and not rounded: out holds chunk_bytes /
 * (element size) floats, 16-byte aligned. For the bulk path of
 * the fused norm's "split" route, which adds the residual before it rounds. A failed
 * op fills out with fp32 NaN. */
tpc_result tpc_reduce_scatter_f32(tpc_comm *comm, const void *in, float *out, size_t chunk_bytes,
                                  tpc_dtype dtype, tpc_algo algo, void *stream);

/* Reads the device-side error record (no synchronisation). */
tpc_result tpc_comm_async_error(tpc_comm *comm, tpc_async_error *out);

/* Test hook: sets the device epoch (the next op runs under epoch + 1), to
 * run tests across the 2^32 wrap. Synchronises the device first. */
tpc_result tpc_comm_debug_set_epoch(tpc_comm *comm, uint32_t epoch);

const char *tpc_result_string(tpc_result result);
const char *tpc_comm_last_error(const tpc_comm *comm);

int tpc_comm_world_size(const tpc_comm *comm);
int tpc_comm_rank(const tpc_comm *comm);
int tpc_comm_device(const tpc_comm *comm);

/* Layout facts, for tests and diagnostics. */
size_t tpc_comm_buffer_bytes(const tpc_comm *comm);
int tpc_comm_open_peer_count(const tpc_comm *comm);

#ifdef __cplusplus
}
#endif
#endif /* TPCOMM_H */
