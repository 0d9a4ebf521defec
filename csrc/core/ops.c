/*
 * The collectives: each op checks the kernel it was told to run against that
 * kernel's rules (limits.c: sizes against the registered buffers, alignment,
 * multiples, dtypes), fills the kernels' argument block and launches on
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
  a->comm_id = (uint32_t)comm->entry->comm_id;
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
    what = "launching all_reduce_norm";
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

/* NaN of each reducible dtype, repeated over 8 bytes: indexed by tpc_dtype. */
static const uint64_t reduce_nan[] = {0x7fc000007fc00000ull, 0x7e007e007e007e00ull, 0x7fc07fc07fc07fc0ull};

#if defined(USE_ROCM)
#define TPC_BUILD_PLATFORM TPC_PLATFORM_ROCM
#else
#define TPC_BUILD_PLATFORM TPC_PLATFORM_CUDA
#endif

/* The kernel the caller chose (the core never picks one) against its rules
 * (limits.c): known, serving this op at this world size in this build, and
 * taking this dtype, chunk, row and these pointers. */
static tpc_result check_kernel(tpc_comm *comm, int op, tpc_algo algo, int dtype, size_t chunk, size_t row,
                               const void *const *ptrs, int n) {
  tpc_kernel_limits limits;
  if (tpc_kernel_limits_of(op, (int)algo, comm->cfg.world_size, comm->cfg.max_bytes, comm->cfg.packet_max_bytes,
                           TPC_BUILD_PLATFORM, &limits) != TPC_OK)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG,
                    "%s: unknown algorithm %d (packet %d, bulk %d, line %d, two_shot %d, quantized_fp8/int8/int4 %d-%d "
                    "or bulk_one_shot %d)",
                    op == TPC_OP_ALL_REDUCE ? "all_reduce" : op == TPC_OP_ALL_GATHER ? "all_gather" : "reduce_scatter",
                    (int)algo, TPC_ALGO_PACKET, TPC_ALGO_BULK, TPC_ALGO_LINE, TPC_ALGO_TWO_SHOT,
                    TPC_ALGO_QUANTIZED_FP8, TPC_ALGO_QUANTIZED_INT4, TPC_ALGO_BULK_ONE_SHOT);
  char why[256];
  tpc_result r = tpc_kernel_check(&limits, op, (int)algo, dtype, chunk, row, ptrs, n, why, sizeof why);
  return r == TPC_OK ? TPC_OK : tpc_fail(comm, r, "%s", why);
}

/* all_reduce and reduce_scatter: `nbytes` is what each rank reduces per
 * chunk, the input holds one (all_reduce) or one per rank (reduce_scatter);
 * out_f32: out takes the fp32 sums (reduce_scatter only). Checks what the
 * chosen kernel needs, launches. */
static tpc_result reduce_op(tpc_comm *comm, int op, const void *in, void *out, size_t nbytes,
                            tpc_dtype dtype, tpc_algo algo, int out_f32,
                            void *stream) {
  tpc_result r = begin_op(comm, in, out, stream);
  const void *const ptrs[] = {in, out};
  if (r == TPC_OK) r = check_kernel(comm, op, algo, (int)dtype, nbytes, 0, ptrs, 2);
  if (r != TPC_OK) return r;
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
  return reduce_op(comm, TPC_OP_ALL_REDUCE, in, out, nbytes, dtype, algo, 0, stream);
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
  return reduce_op(comm, TPC_OP_REDUCE_SCATTER, in, out, chunk_bytes, dtype, algo, out_f32, stream);
}

tpc_result tpc_reduce_scatter(tpc_comm *comm, const void *in, void *out, size_t chunk_bytes,
                              tpc_dtype dtype, tpc_algo algo, void *stream) {
  return reduce_scatter(comm, in, out, chunk_bytes, dtype, algo, 0, stream);
}

tpc_result tpc_reduce_scatter_f32(tpc_comm *comm, const void *in, float *out, size_t chunk_bytes,
                                  tpc_dtype dtype, tpc_algo algo, void *stream) {
  return reduce_scatter(comm, in, out, chunk_bytes, dtype, algo, 1, stream);
}

/* Whether [a, a + an) and [b, b + bn) share a byte (either NULL: no). */
static int overlap(const void *a, size_t an, const void *b, size_t bn) {
  const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return a && b && x < y + bn && y < x + an;
}

/* The fused norm family, with the FP8 epilogue or without (quant NONE: tpc_all_reduce_norm). */
tpc_result tpc_all_reduce_norm_quant(tpc_comm *comm, const tpc_norm_spec *norm, tpc_norm_quant quant,
                                     const void *in, const void *residual, void *normed, void *stream_out,
                                     void *codes, float *scales, size_t scale_row_stride, size_t scale_group_stride,
                                     float scale_floor, size_t nbytes, size_t row_bytes, tpc_dtype dtype,
                                     void *stream) {
  const int quantizing = quant != TPC_QUANT_NONE;
  /* the first output: the codes when quantizing (normed may then be NULL) */
  void *out = quantizing ? codes : normed;
  tpc_result r = begin_op(comm, in, out, stream);
  if (r != TPC_OK) return r;
  if (!residual || !stream_out)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_reduce_norm: NULL residual or stream output");
  char why[256];
  r = tpc_norm_check(norm, why, sizeof why);
  const size_t element = dtype == TPC_FLOAT32 ? 4 : 2;
  if (r == TPC_OK)
    r = tpc_norm_quant_check((int)quant, row_bytes / element, scale_row_stride, scale_group_stride, scale_floor,
                             TPC_BUILD_PLATFORM == TPC_PLATFORM_ROCM, why, sizeof why);
  if (r != TPC_OK) return tpc_fail(comm, r, "%s", why);
  const tpc_norm_pattern pattern = norm->pattern;
  const int second = pattern == TPC_PATTERN_NORM_ADD_NORM || pattern == TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM;
  if (quantizing) {
    if (!scales) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_reduce_norm: NULL scales");
    if ((uintptr_t)scales % 4 != 0)
      return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_reduce_norm: scales %p is not 4-byte aligned", (void *)scales);
    /* the codes and the written scales are new outputs: one launch spreads its
     * pushes over blocks, so an output over an input (or another output) could
     * be written before it is read */
    const size_t rows = row_bytes ? nbytes / row_bytes : 0, groups = row_bytes / element / TPC_FP8_GROUP;
    const size_t scale_bytes =
        quant == TPC_QUANT_PER_TENSOR
            ? 4
            : 4 * (1 + (rows ? rows - 1 : 0) * scale_row_stride +
                   (quant == TPC_QUANT_PER_TOKEN_GROUP && groups ? groups - 1 : 0) * scale_group_stride);
    const void *args[] = {in, residual, norm->weight, norm->next_weight, normed, stream_out, norm->bias,
                          norm->next_bias};
    const size_t sizes[] = {nbytes, nbytes, row_bytes, row_bytes, nbytes, nbytes, row_bytes, row_bytes};
    for (int i = 0; i < 8; ++i)
      if (overlap(codes, nbytes / element, args[i], sizes[i]) ||
          (quant != TPC_QUANT_PER_TENSOR && overlap(scales, scale_bytes, args[i], sizes[i])))
        return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_reduce_norm: the codes or scales overlap another argument");
    if (overlap(codes, nbytes / element, scales, scale_bytes))
      return tpc_fail(comm, TPC_ERR_INVALID_ARG, "all_reduce_norm: the codes and the scales overlap");
  }
  /* NULL (an absent vector, normed where not written) is aligned: it passes */
  const void *const ptrs[] = {in,          residual,         norm->weight,   out, stream_out, norm->next_weight,
                              norm->bias, norm->next_bias, quantizing ? normed : NULL};
  r = check_kernel(comm, TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, (int)dtype, nbytes, row_bytes, ptrs, 9);
  if (r != TPC_OK) return r;
  tpc_kernel_args a;
  /* the codes take one byte a value: e4m3's NaN bytes poison them, the dtype's NaN the rest */
  fill_args(comm, &a, in, out, nbytes, quantizing ? nbytes / element : nbytes, row_bytes, dtype,
            TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, quantizing ? TPC_E4M3_NAN_BYTES : reduce_nan[dtype]);
  a.residual = residual;
  a.weight = norm->weight;
  a.bias = norm->bias;
  a.out2 = stream_out;
  a.eps = norm->eps;
  a.next_weight = norm->next_weight;
  a.next_bias = norm->next_bias;
  a.next_eps = second ? norm->next_eps : 0.0f;
  a.residual_scale = norm->residual_scale;
  a.pattern = (int32_t)pattern;
  a.kind = tpc_kind_word(TPC_KIND_NORM_QUANT_OP(TPC_OP_ALL_REDUCE_NORM, (int)pattern, (int)quant), TPC_ALGO_PACKET,
                         dtype, row_bytes);
  /* -0 + w is w exactly (signed zeros included): offset 0 computes what the kernel did before it had one */
  a.weight_offset = norm->weight_offset == 1.0f ? 1.0f : -0.0f;
  if (quantizing) {
    a.quant = (int32_t)quant;
    a.out3 = normed;
    a.scales = scales;
    a.scale_row_stride = scale_row_stride;
    a.scale_group_stride = quant == TPC_QUANT_PER_TOKEN_GROUP ? scale_group_stride : 0;
    a.scale_floor = quant == TPC_QUANT_PER_TENSOR ? 0.0f : scale_floor;
    a.poison2 = reduce_nan[dtype];
  }
  return launch_on_device(comm, TPC_OP_ALL_REDUCE_NORM, &a, TPC_ALGO_PACKET, stream);
}

tpc_result tpc_all_reduce_norm(tpc_comm *comm, const tpc_norm_spec *norm, const void *in, const void *residual,
                               void *normed, void *stream_out, size_t nbytes, size_t row_bytes, tpc_dtype dtype,
                               void *stream) {
  return tpc_all_reduce_norm_quant(comm, norm, TPC_QUANT_NONE, in, residual, normed, stream_out, NULL, NULL, 0, 0,
                                   0.0f, nbytes, row_bytes, dtype, stream);
}

tpc_result tpc_all_gather(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          size_t row_bytes, tpc_algo algo, uint64_t nan_pattern, void *stream) {
  tpc_result r = begin_op(comm, in, out, stream);
  const void *const ptrs[] = {in, out};
  if (r == TPC_OK) r = check_kernel(comm, TPC_OP_ALL_GATHER, algo, 0, nbytes, row_bytes, ptrs, 2);
  if (r != TPC_OK) return r;
  const size_t world = (size_t)comm->cfg.world_size;
  /* within a cap now: the packet cap is at most 2 GiB and world at most 8 */
  const size_t out_bytes = nbytes * world;
  tpc_kernel_args a;
  fill_args(comm, &a, in, out, nbytes, out_bytes, row_bytes, 0, TPC_OP_ALL_GATHER, algo, nan_pattern);
  return launch_on_device(comm, TPC_OP_ALL_GATHER, &a, algo, stream);
}
