/*
 * The collectives: each op checks, in one function, what memory safety and
 * the kernel it was told to run need (sizes against the registered buffers,
 * alignment, multiples), fills the kernels' argument block and launches on
 * the communicator's device. Which kernel runs is the caller's choice
 * (tpcomm.routing): the core never picks or switches one.
 */
#include <string.h>

#include "comm_internal.h"

/* Shared preconditions of every op: usable communicator, async errors surfaced,
 * and ops of one communicator serialised even across streams. */
static tpc_result begin_op(tpc_comm *comm, const void *in, void *out, void *stream) {
  if (!comm) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  if (!comm->ready) return tpc_fail(comm, TPC_ERR_STATE, "communicator is not ready (peers not opened)");
  tpc_result r = tpc_comm_async_error(comm, NULL);
  if (r != TPC_OK) return r;
  if (comm->failed) return tpc_fail(comm, TPC_ERR_STATE, "communicator failed earlier: %s", comm->last_error);
  if (!in || !out) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "NULL input or output");
  /* One op in flight per communicator: its buffers and epoch are shared, so
   * an op on a new stream must not overlap the previous stream's op. On the
   * previous op's stream (the common case) nothing needs waiting for, captured
   * or not, so the capture query (a driver call) is made only when the stream
   * changed: one call fewer on the host path of every op. */
  if (comm->have_last_stream && comm->last_stream == stream) return TPC_OK;
  int capturing = 0;
  int code = comm->rt->stream_is_capturing(stream, &capturing);
  if (code) return tpc_runtime_fail(comm, comm->rt, code, "querying the stream's capture state");
  if (!capturing) {
    if (comm->have_last_stream) {
      code = comm->rt->stream_synchronize(comm->last_stream);
      if (code) return tpc_runtime_fail(comm, comm->rt, code, "waiting for the previous stream");
    }
    comm->last_stream = stream;
    comm->have_last_stream = 1;
  }
  return TPC_OK;
}

static void fill_args(const tpc_comm *comm, tpc_kernel_args *a, const void *in, void *out,
                      size_t nbytes, size_t out_bytes, size_t row_bytes, int dtype, int op,
                      int algo, uint64_t nan_pattern) {
  memset(a, 0, sizeof *a);
  for (int p = 0; p < comm->cfg.world_size; ++p) a->bufs[p] = comm->bufs[p];
  a->control = comm->entry->control;
  for (int p = 0; p < comm->cfg.world_size; ++p)
    if (p != comm->cfg.rank) a->peer_control[p] = comm->peer_control[p];
  a->err = comm->entry->record_device;
  a->alive_id = (uint32_t)comm->entry->comm_id;
  a->kind = tpc_kind_word(op, algo, dtype, row_bytes);
  a->poison = nan_pattern;
  a->poison_out = nan_pattern != 0;
  a->in = in;
  a->out = out;
  a->nbytes = nbytes;
  a->out_bytes = out_bytes;
  a->row_bytes = row_bytes;
  a->timeout_ns = comm->cfg.timeout_ns;
  a->packet_off = comm->layout.packet_off;
  a->packet_slot_bytes = comm->layout.packet_slot_bytes;
  a->data_off = comm->layout.data_off;
  a->data_bytes = comm->layout.data_bytes;
  a->rank = comm->cfg.rank;
  a->world = comm->cfg.world_size;
  a->dtype = dtype;
  a->op = op;
  a->max_blocks = comm->multiprocessors;
}

/* Launches on the communicator's device whatever the caller's current device
 * is, and puts the caller's back: the binding needs no device guard. */
static tpc_result launch_on_device(tpc_comm *comm, int op, const tpc_kernel_args *a, int algo,
                                   void *stream) {
  const tpc_runtime *rt = comm->rt;
  int current = -1;
  int code = rt->get_device(&current);
  if (code) return tpc_runtime_fail(comm, rt, code, "reading the current device");
  if (current != comm->cfg.device && (code = rt->set_device(comm->cfg.device)) != 0)
    return tpc_runtime_fail(comm, rt, code, "selecting the communicator's device");
  const char *what = "launching reduce_scatter";
  if (op == TPC_OP_ALL_REDUCE_NORM) {
    code = rt->launch_all_reduce_norm(a, stream);
    what = "launching all_reduce_add_rms_norm";
  } else if (op == TPC_OP_ALL_REDUCE) {
    code = rt->launch_all_reduce(a, algo, stream);
    what = "launching all_reduce";
  } else if (op == TPC_OP_ALL_GATHER) {
    code = rt->launch_all_gather(a, algo, stream);
    what = "launching all_gather";
  } else {
    code = rt->launch_reduce_scatter(a, algo, stream);
  }
  if (current != comm->cfg.device) rt->set_device(current);
  return code ? tpc_runtime_fail(comm, rt, code, what) : TPC_OK;
}

static int misaligned(const void *p, size_t to) { return ((uintptr_t)p % to) != 0; }

/* NaN of each reducible dtype, repeated over 8 bytes, and its name: indexed by tpc_dtype. */
static const uint64_t reduce_nan[] = {0x7fc000007fc00000ull, 0x7e007e007e007e00ull, 0x7fc07fc07fc07fc0ull};
static const char *const dtype_names[] = {"float32", "float16", "bfloat16"};

static int reducible(tpc_dtype dtype) {
  return dtype == TPC_FLOAT32 || dtype == TPC_FLOAT16 || dtype == TPC_BFLOAT16;
}

static const char *dtype_name(tpc_dtype dtype) { return reducible(dtype) ? dtype_names[dtype] : "no tpc_dtype"; }

static int quantized(tpc_algo algo) {
  return algo == TPC_ALGO_QUANTIZED_FP8 || algo == TPC_ALGO_QUANTIZED_INT8 || algo == TPC_ALGO_QUANTIZED_INT4;
}

/* The kernel the caller chose, one of the four: the core never picks one. */
static tpc_result check_algo(tpc_comm *comm, const char *name, tpc_algo algo) {
  if (algo == TPC_ALGO_PACKET || algo == TPC_ALGO_BULK || algo == TPC_ALGO_LINE || algo == TPC_ALGO_TWO_SHOT ||
      quantized(algo))
    return TPC_OK;
  return tpc_fail(comm, TPC_ERR_INVALID_ARG,
                  "%s: unknown algorithm %d (packet %d, bulk %d, line %d, two_shot %d or quantized_fp8/int8/int4 %d-%d)",
                  name, (int)algo, TPC_ALGO_PACKET, TPC_ALGO_BULK, TPC_ALGO_LINE, TPC_ALGO_TWO_SHOT,
                  TPC_ALGO_QUANTIZED_FP8, TPC_ALGO_QUANTIZED_INT4);
}

/* The quantized all-reduce (all_reduce_quant.cuh): all_reduce of a 16-bit
 * float only (its codecs read 8 such values a unit), its slots in the bulk
 * region, so within the bulk cap. */
static tpc_result check_quantized(tpc_comm *comm, int op, const char *name, tpc_dtype dtype, tpc_algo algo) {
  if (!quantized(algo)) return TPC_OK;
  if (op != TPC_OP_ALL_REDUCE) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s has no quantized kernel", name);
  if (dtype != TPC_FLOAT16 && dtype != TPC_BFLOAT16)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "quantized all_reduce: dtype %d (%s) is not float16 or bfloat16",
                    (int)dtype, dtype_name(dtype));
  return TPC_OK;
}

/* all_reduce and reduce_scatter: `nbytes` is what each rank reduces per
 * chunk, the input holds `parts` of them (all_reduce 1, reduce_scatter one
 * per rank); out_f32: out takes the fp32 sums (reduce_scatter only). Checks
 * what the chosen kernel needs, launches. */
static tpc_result reduce_op(tpc_comm *comm, int op, const char *name, const void *in, void *out,
                            size_t nbytes, size_t parts, tpc_dtype dtype, tpc_algo algo, int out_f32,
                            void *stream) {
  tpc_result r = begin_op(comm, in, out, stream);
  if (r == TPC_OK) r = check_algo(comm, name, algo);
  if (r != TPC_OK) return r;
  if (!reducible(dtype))
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s: dtype %d (%s) is not float32, float16 or bfloat16", name,
                    (int)dtype, dtype_name(dtype));
  if (nbytes == 0 || nbytes % 16)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s of %zu bytes: a positive multiple of 16 is needed", name, nbytes);
  if (misaligned(in, 16) || misaligned(out, 16))
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s input and output must be 16-byte aligned", name);
  if (algo == TPC_ALGO_TWO_SHOT && op != TPC_OP_ALL_REDUCE)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s has no two_shot kernel", name);
  r = check_quantized(comm, op, name, dtype, algo);
  if (r != TPC_OK) return r;
  /* every rank owns a non-empty chunk, a warp step of lines (world steps of
   * TPC_LINE_STEP_BYTES, the last one partly filled): otherwise a rank could
   * finish an op without a line from every peer and run two ops ahead of one
   * (all_reduce.cuh) */
  if (algo == TPC_ALGO_TWO_SHOT && nbytes <= (size_t)TPC_LINE_STEP_BYTES * (size_t)(comm->cfg.world_size - 1))
    return tpc_fail(comm, TPC_ERR_INVALID_ARG,
                    "two_shot all_reduce of %zu bytes: more than %d bytes (a warp step of lines per rank) are needed",
                    nbytes, TPC_LINE_STEP_BYTES * (comm->cfg.world_size - 1));
  /* lines live in the packet slots: 112 data bytes in 128, within the cap */
  const int bulk_slots = algo == TPC_ALGO_BULK || quantized(algo);
  if (!bulk_slots && nbytes > comm->cfg.packet_max_bytes)
    return tpc_fail(comm, TPC_ERR_TOO_LARGE, "%s of %zu bytes is over the packet cap of %zu", name, nbytes,
                    comm->cfg.packet_max_bytes);
  /* compared as nbytes against cap / parts: nbytes * parts could overflow */
  if (bulk_slots && nbytes > comm->cfg.max_bytes / parts)
    return tpc_fail(comm, TPC_ERR_TOO_LARGE, "%s of %zu x %zu bytes is over the cap of %zu", name, parts, nbytes,
                    comm->cfg.max_bytes);
  /* fp32 sums take 4 bytes a value: twice the chunk of a 16-bit dtype */
  const size_t out_bytes = out_f32 && dtype != TPC_FLOAT32 ? 2 * nbytes : nbytes;
  tpc_kernel_args a;
  fill_args(comm, &a, in, out, nbytes, out_bytes, nbytes, dtype, op, algo,
            reduce_nan[out_f32 ? TPC_FLOAT32 : dtype]);
  a.out_f32 = out_f32;
  return launch_on_device(comm, op, &a, algo, stream);
}

tpc_result tpc_all_reduce(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          tpc_dtype dtype, tpc_algo algo, void *stream) {
  return reduce_op(comm, TPC_OP_ALL_REDUCE, "all_reduce", in, out, nbytes, 1, dtype, algo, 0, stream);
}

tpc_result tpc_id_all_reduce(uint64_t comm_id, const void *in, void *out, size_t nbytes, tpc_dtype dtype,
                             tpc_algo algo, void *stream) {
  tpc_comm *comm = NULL;
  tpc_result r = tpc_comm_acquire(comm_id, &comm);
  if (r != TPC_OK) return r;
  r = tpc_to_thread_slot(comm, tpc_all_reduce(comm, in, out, nbytes, dtype, algo, stream));
  tpc_comm_release(comm);
  return r;
}

static tpc_result reduce_scatter(tpc_comm *comm, const void *in, void *out, size_t chunk_bytes,
                                 tpc_dtype dtype, tpc_algo algo, int out_f32, void *stream) {
  const size_t world = comm ? (size_t)comm->cfg.world_size : 1;
  return reduce_op(comm, TPC_OP_REDUCE_SCATTER, "reduce_scatter", in, out, chunk_bytes, world, dtype, algo,
                   out_f32, stream);
}

tpc_result tpc_reduce_scatter(tpc_comm *comm, const void *in, void *out, size_t chunk_bytes,
                              tpc_dtype dtype, tpc_algo algo, void *stream) {
  return reduce_scatter(comm, in, out, chunk_bytes, dtype, algo, 0, stream);
}

tpc_result tpc_reduce_scatter_f32(tpc_comm *comm, const void *in, float *out, size_t chunk_bytes,
                                  tpc_dtype dtype, tpc_algo algo, void *stream) {
  return reduce_scatter(comm, in, out, chunk_bytes, dtype, algo, 1, stream);
}

tpc_result tpc_all_reduce_add_rms_norm(tpc_comm *comm, const void *in, const void *residual, const void *weight,
                                       void *normed, void *residual_out, size_t nbytes, size_t row_bytes,
                                       tpc_dtype dtype, float eps, void *stream) {
  static const char name[] = "all_reduce_add_rms_norm";
  tpc_result r = begin_op(comm, in, normed, stream);
  if (r != TPC_OK) return r;
  if (!residual || !weight || !residual_out)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s: NULL residual, weight or residual output", name);
  if (dtype != TPC_FLOAT16 && dtype != TPC_BFLOAT16)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s: dtype %d (%s) is not float16 or bfloat16", name, (int)dtype,
                    dtype_name(dtype));
  if (row_bytes == 0 || row_bytes % 16 || row_bytes > TPC_NORM_MAX_ROW_BYTES)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s: a row of %zu bytes: a multiple of 16 up to %d is needed", name,
                    row_bytes, TPC_NORM_MAX_ROW_BYTES);
  if (nbytes == 0 || nbytes % row_bytes)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s of %zu bytes: a positive number of %zu-byte rows is needed", name,
                    nbytes, row_bytes);
  if (nbytes > comm->cfg.packet_max_bytes)
    return tpc_fail(comm, TPC_ERR_TOO_LARGE, "%s of %zu bytes is over the packet cap of %zu", name, nbytes,
                    comm->cfg.packet_max_bytes);
  if (misaligned(in, 16) || misaligned(residual, 16) || misaligned(weight, 16) || misaligned(normed, 16) ||
      misaligned(residual_out, 16))
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s: every tensor must be 16-byte aligned", name);
  if (!(eps >= 0.0f) || eps > 1.0f)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s: eps %g is not in [0, 1]", name, (double)eps);
  tpc_kernel_args a;
  fill_args(comm, &a, in, normed, nbytes, nbytes, row_bytes, dtype, TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET,
            reduce_nan[dtype]);
  a.residual = residual;
  a.weight = weight;
  a.out2 = residual_out;
  a.eps = eps;
  return launch_on_device(comm, TPC_OP_ALL_REDUCE_NORM, &a, TPC_ALGO_PACKET, stream);
}

tpc_result tpc_all_gather(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          size_t row_bytes, tpc_algo algo, uint64_t nan_pattern, void *stream) {
  static const char name[] = "all_gather";
  tpc_result r = begin_op(comm, in, out, stream);
  if (r == TPC_OK) r = check_algo(comm, name, algo);
  if (r != TPC_OK) return r;
  if (algo == TPC_ALGO_TWO_SHOT) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_gather has no two_shot kernel");
  if (quantized(algo)) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_gather has no quantized kernel");
  if (nbytes == 0 || nbytes % 4)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_gather of %zu bytes: a positive multiple of 4 is needed", nbytes);
  if (row_bytes == 0 || row_bytes % 4 || nbytes % row_bytes)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "row of %zu bytes must be a positive multiple of 4 dividing %zu",
                    row_bytes, nbytes);
  /* every kernel variant is chosen by shape; none may depend on a pointer */
  if (misaligned(in, 16) || misaligned(out, 16))
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned");
  const size_t world = (size_t)comm->cfg.world_size;
  if (algo != TPC_ALGO_PACKET && (nbytes % 16 || row_bytes % 16)) /* line and bulk move 16-byte units */
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "%s all_gather needs 16-byte sizes and rows",
                    algo == TPC_ALGO_BULK ? "bulk" : "line");
  const int bulk_slots = algo == TPC_ALGO_BULK || quantized(algo);
  if (!bulk_slots && nbytes > comm->cfg.packet_max_bytes)
    return tpc_fail(comm, TPC_ERR_TOO_LARGE, "all_gather of %zu bytes per rank is over the packet cap of %zu",
                    nbytes, comm->cfg.packet_max_bytes);
  /* compared as nbytes against cap / world: nbytes * world could overflow */
  if (algo == TPC_ALGO_BULK && nbytes > comm->cfg.max_bytes / world)
    return tpc_fail(comm, TPC_ERR_TOO_LARGE, "all_gather output of %zu x %zu bytes is over the cap of %zu", world,
                    nbytes, comm->cfg.max_bytes);
  /* within a cap now: the packet cap is at most 2 GiB and world at most 8 */
  const size_t out_bytes = nbytes * world;
  tpc_kernel_args a;
  fill_args(comm, &a, in, out, nbytes, out_bytes, row_bytes, 0, TPC_OP_ALL_GATHER, algo, nan_pattern);
  return launch_on_device(comm, TPC_OP_ALL_GATHER, &a, algo, stream);
}
