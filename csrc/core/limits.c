/*
 * What each kernel takes: the one statement of the kernels' rules (sizes,
 * multiples, caps, alignment, dtypes, world sizes, platforms). ops.c checks
 * every call against tpc_kernel_limits_of's answer with tpc_kernel_check;
 * tpcomm.routing reads the same answer once per communicator (through
 * ctypes) and refuses what it refuses, so a rule added here reaches both.
 */
#include <stdarg.h>
#include <stdio.h>

#include "comm_internal.h"

#define NO_CAP UINT64_MAX
#define REDUCIBLE ((1u << TPC_FLOAT32) | (1u << TPC_FLOAT16) | (1u << TPC_BFLOAT16))
#define HALVES ((1u << TPC_FLOAT16) | (1u << TPC_BFLOAT16))

static int known_op(int op) {
  return op == TPC_OP_ALL_REDUCE || op == TPC_OP_ALL_GATHER || op == TPC_OP_REDUCE_SCATTER ||
         op == TPC_OP_ALL_REDUCE_NORM;
}

static int quantized(int algo) {
  return algo == TPC_ALGO_QUANTIZED_FP8 || algo == TPC_ALGO_QUANTIZED_INT8 || algo == TPC_ALGO_QUANTIZED_INT4;
}

static int known_algo(int algo) {
  return algo == TPC_ALGO_PACKET || algo == TPC_ALGO_BULK || algo == TPC_ALGO_LINE || algo == TPC_ALGO_TWO_SHOT ||
         algo == TPC_ALGO_BULK_ONE_SHOT || quantized(algo);
}

tpc_result tpc_kernel_limits_of(int op, int algo, int world, size_t max_bytes, size_t packet_max_bytes,
                                int platform, tpc_kernel_limits *out) {
  if (!out || !known_op(op) || !known_algo(algo) || world < 2 || world > TPC_MAX_RANKS ||
      (platform != TPC_PLATFORM_CUDA && platform != TPC_PLATFORM_ROCM))
    return TPC_ERR_INVALID_ARG;
  const int gather = op == TPC_OP_ALL_GATHER, lines = algo == TPC_ALGO_LINE || algo == TPC_ALGO_TWO_SHOT;
  /* the streamed kernels, the quantized all-reduce among them, keep their data in the bulk slots */
  const int bulk = algo == TPC_ALGO_BULK || algo == TPC_ALGO_BULK_ONE_SHOT || quantized(algo);
  tpc_kernel_limits l;
  l.refused = TPC_KERNEL_TAKES;
  /* all_gather moves bytes; the reductions sum fp32/fp16/bf16 in fp32; the
   * fused norm's rows of 16-bit values sit in registers */
  l.dtypes = gather ? 0u : op == TPC_OP_ALL_REDUCE_NORM ? HALVES : REDUCIBLE;
  /* the quantized all-reduce's codecs read 8 16-bit floats a unit */
  if (quantized(algo)) l.dtypes = HALVES;
  /* packets carry 8 bytes of 4-byte units (all_gather) or of 16-byte
   * vectors; lines and streamed copies move 16-byte units */
  l.multiple = gather && algo == TPC_ALGO_PACKET ? 4 : 16;
  l.more_than = 0;
  /* every kernel but the streamed ones keeps its data in the packet slots
   * (lines: 112 data bytes in 128), sized for packet_max_bytes per rank */
  l.packet_cap = bulk ? NO_CAP : packet_max_bytes;
  /* the bulk slots hold one op's output (all_gather: world chunks) or
   * input (reduce_scatter: world parts); a reduction's input is held to
   * max_bytes on every kernel */
  l.chunks = op == TPC_OP_ALL_REDUCE || op == TPC_OP_ALL_REDUCE_NORM ? 1u : (uint64_t)world;
  l.max_bytes = max_bytes;
  l.cap = gather && !bulk ? NO_CAP : max_bytes / l.chunks;
  l.max_row = op == TPC_OP_ALL_REDUCE_NORM ? TPC_NORM_MAX_ROW_BYTES : NO_CAP;
  /* 16-byte vector loads; every variant is chosen by shape, none by a pointer */
  l.align = 16;
  if (op == TPC_OP_ALL_REDUCE_NORM ? algo != TPC_ALGO_PACKET
                                   : (algo == TPC_ALGO_TWO_SHOT || algo == TPC_ALGO_BULK_ONE_SHOT || quantized(algo)) &&
                                         op != TPC_OP_ALL_REDUCE)
    l.refused = TPC_KERNEL_NO_OP;
  /* the line protocol rests on NVLink's whole 128-byte stores; the
   * quantized all-reduce is built for CUDA only */
  else if ((lines || quantized(algo)) && platform != TPC_PLATFORM_CUDA)
    l.refused = TPC_KERNEL_NO_PLATFORM;
  /* the one-shot stream sums every peer's whole input: as much traffic as
   * the two-shot at two ranks and one phase fewer; from three ranks on the
   * two-shot moves less */
  else if (op == TPC_OP_ALL_REDUCE && (algo == TPC_ALGO_BULK_ONE_SHOT ? world != 2 : algo == TPC_ALGO_BULK && world == 2))
    l.refused = TPC_KERNEL_NO_WORLD;
  /* every rank owns a non-empty chunk, a warp step of lines (world steps of
   * TPC_LINE_STEP_BYTES, the last one partly filled): otherwise a rank could
   * finish an op without a line from every peer and run two ops ahead of one
   * (all_reduce.cuh) */
  if (algo == TPC_ALGO_TWO_SHOT) l.more_than = (uint64_t)TPC_LINE_STEP_BYTES * (uint64_t)(world - 1);
  *out = l;
  return TPC_OK;
}

static const char *op_name(int op) {
  switch (op) {
    case TPC_OP_ALL_REDUCE: return "all_reduce";
    case TPC_OP_ALL_GATHER: return "all_gather";
    case TPC_OP_REDUCE_SCATTER: return "reduce_scatter";
    default: return "all_reduce_norm";
  }
}

static const char *algo_name(int algo) {
  switch (algo) {
    case TPC_ALGO_PACKET: return "packet";
    case TPC_ALGO_BULK: return "bulk";
    case TPC_ALGO_LINE: return "line";
    case TPC_ALGO_TWO_SHOT: return "two_shot";
    case TPC_ALGO_BULK_ONE_SHOT: return "bulk_one_shot";
    case TPC_ALGO_QUANTIZED_FP8: return "quantized_fp8";
    case TPC_ALGO_QUANTIZED_INT8: return "quantized_int8";
    case TPC_ALGO_QUANTIZED_INT4: return "quantized_int4";
    default: return "unknown";
  }
}

static const char *const dtype_names[] = {"float32", "float16", "bfloat16"};

static tpc_result refuse(tpc_result code, char *why, size_t len, const char *fmt, ...) {
  if (why && len) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
  }
  return code;
}

tpc_result tpc_kernel_check(const tpc_kernel_limits *l, int op, int algo, int dtype, size_t chunk, size_t row,
                            const void *const *ptrs, int n, char *why, size_t len) {
  const char *name = op_name(op), *kernel = algo_name(algo);
  if (l->refused == TPC_KERNEL_NO_OP) return refuse(TPC_ERR_INVALID_ARG, why, len, "%s has no %s kernel", name, kernel);
  if (l->refused == TPC_KERNEL_NO_PLATFORM)
    return refuse(TPC_ERR_INVALID_ARG, why, len, "%s: the %s kernel is not in this build (CUDA only)", name, kernel);
  if (l->refused != TPC_KERNEL_TAKES)
    return refuse(TPC_ERR_INVALID_ARG, why, len, "%s: the %s kernel does not run at this world size", name, kernel);
  if (l->dtypes && (dtype < 0 || dtype > TPC_BFLOAT16 || !(l->dtypes >> dtype & 1u))) {
    char names[64] = "";
    size_t at = 0;
    for (int d = TPC_FLOAT32, left = __builtin_popcount(l->dtypes); d <= TPC_BFLOAT16; ++d) {
      if (!(l->dtypes >> d & 1u)) continue;
      --left;
      at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", dtype_names[d],
                             left > 1 ? ", " : left == 1 ? " or " : "");
    }
    return refuse(TPC_ERR_INVALID_ARG, why, len, "%s: dtype %d (%s) is not %s", name, dtype,
                  dtype >= 0 && dtype <= TPC_BFLOAT16 ? dtype_names[dtype] : "no tpc_dtype", names);
  }
  if (chunk == 0 || chunk % l->multiple)
    return refuse(TPC_ERR_INVALID_ARG, why, len, "%s of %zu bytes: a positive multiple of %llu is needed (%s kernel)",
                  name, chunk, (unsigned long long)l->multiple, kernel);
  if (op == TPC_OP_ALL_GATHER || op == TPC_OP_ALL_REDUCE_NORM) {
    if (row == 0 || row % l->multiple || row > l->max_row || chunk % row) {
      if (l->max_row == NO_CAP)
        return refuse(TPC_ERR_INVALID_ARG, why, len,
                      "%s: a row of %zu bytes: the %s kernel needs a positive multiple of %llu dividing %zu", name, row,
                      kernel, (unsigned long long)l->multiple, chunk);
      return refuse(TPC_ERR_INVALID_ARG, why, len,
                    "%s: a row of %zu bytes: the %s kernel needs a positive multiple of %llu up to %llu dividing %zu",
                    name, row, kernel, (unsigned long long)l->multiple, (unsigned long long)l->max_row, chunk);
    }
  }
  for (int i = 0; i < n; ++i)
    if ((uintptr_t)ptrs[i] % l->align)
      return refuse(TPC_ERR_INVALID_ARG, why, len,
                    n == 2 ? "%s input and output must be %llu-byte aligned" : "%s: every tensor must be %llu-byte aligned",
                    name, (unsigned long long)l->align);
  if (chunk <= l->more_than)
    return refuse(TPC_ERR_INVALID_ARG, why, len,
                  "%s %s of %zu bytes: more than %llu bytes (a warp step of lines per rank) are needed", kernel, name,
                  chunk, (unsigned long long)l->more_than);
  if (chunk > l->packet_cap)
    return refuse(TPC_ERR_TOO_LARGE, why, len, "%s of %zu bytes%s is over the packet cap of %llu", name, chunk,
                  op == TPC_OP_ALL_GATHER ? " per rank" : "", (unsigned long long)l->packet_cap);
  /* compared as chunk against cap = max_bytes / chunks: chunk * chunks could overflow */
  if (chunk > l->cap)
  {
    char chunks[32] = "";
    if (l->chunks > 1) snprintf(chunks, sizeof chunks, "%llu x ", (unsigned long long)l->chunks);
    return refuse(TPC_ERR_TOO_LARGE, why, len, "%s%s of %s%zu bytes is over max_bytes %llu", name,
                  op == TPC_OP_ALL_GATHER ? " output" : "", chunks, chunk, (unsigned long long)l->max_bytes);
  }
  return TPC_OK;
}

static const char *const pattern_names[] = {"ADD_NORM",       "NORM_ADD",       "NORM_ADD_NORM",
                                            "ADD_LAYER_NORM", "LAYER_NORM_ADD", "LAYER_NORM_ADD_LAYER_NORM"};

tpc_result tpc_norm_check(const tpc_norm_spec *norm, char *why, size_t len) {
  if (!norm) return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: NULL norm");
  const int pattern = (int)norm->pattern;
  if (pattern < TPC_PATTERN_ADD_NORM || pattern > TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM)
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: unknown pattern %d (%d to %d: ADD_NORM to %s)",
                  pattern, TPC_PATTERN_ADD_NORM, TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM,
                  pattern_names[TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM]);
  const char *name = pattern_names[pattern];
  const int layer = pattern >= TPC_PATTERN_ADD_LAYER_NORM;
  const int second = pattern == TPC_PATTERN_NORM_ADD_NORM || pattern == TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM;
  /* an RMSNorm always has a weight; a LayerNorm's weight and bias are optional */
  if (!layer && !norm->weight)
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: pattern %s (an RMSNorm) takes a weight", name);
  if (!layer && (norm->bias || norm->next_bias))
    return refuse(TPC_ERR_INVALID_ARG, why, len,
                  "all_reduce_norm: pattern %s is an RMSNorm: it takes no bias (a LayerNorm pattern does)", name);
  if (!second && (norm->next_weight || norm->next_bias))
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: pattern %s takes no next_weight or next_bias",
                  name);
  if (pattern == TPC_PATTERN_NORM_ADD_NORM && !norm->next_weight)
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: pattern %s takes a next_weight", name);
  /* written as negations so that NaN fails them too */
  if (!(norm->eps >= 0.0f && norm->eps <= 1.0f))
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: eps %g is not in [0, 1]", (double)norm->eps);
  if (second && !(norm->next_eps >= 0.0f && norm->next_eps <= 1.0f))
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: next_eps %g is not in [0, 1]",
                  (double)norm->next_eps);
  /* the weight is w or 1 + w (Gemma's convention): nothing else is a convention anyone uses */
  if (norm->weight_offset != 0.0f && norm->weight_offset != 1.0f)
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: weight_offset %g is not 0 or 1",
                  (double)norm->weight_offset);
  /* 1 + w of no w would be a weight of ones the caller did not give */
  if (norm->weight_offset != 0.0f && (!norm->weight || (second && !norm->next_weight)))
    return refuse(TPC_ERR_INVALID_ARG, why, len,
                  "all_reduce_norm: weight_offset %g needs every norm's weight; a LayerNorm without weight takes 0",
                  (double)norm->weight_offset);
  /* m - m is 0 for every finite m, NaN for inf and NaN */
  if (!(norm->residual_scale - norm->residual_scale == 0.0f))
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: residual_scale %g is not finite",
                  (double)norm->residual_scale);
  return TPC_OK;
}

static const char *const quant_names[] = {"NONE", "PER_TENSOR", "PER_TOKEN", "PER_TOKEN_GROUP"};

tpc_result tpc_norm_quant_check(int quant, size_t row_values, size_t scale_row_stride, size_t scale_group_stride,
                                float scale_floor, int rocm, char *why, size_t len) {
  if (quant < TPC_QUANT_NONE || quant > TPC_QUANT_PER_TOKEN_GROUP)
    return refuse(TPC_ERR_INVALID_ARG, why, len,
                  "all_reduce_norm: unknown quant %d (NONE %d, PER_TENSOR %d, PER_TOKEN %d or PER_TOKEN_GROUP %d)",
                  quant, TPC_QUANT_NONE, TPC_QUANT_PER_TENSOR, TPC_QUANT_PER_TOKEN, TPC_QUANT_PER_TOKEN_GROUP);
  if (quant == TPC_QUANT_NONE) return TPC_OK;
  /* ROCm's FP8 is e4m3fnuz on MI300 (another NaN, another bias): the epilogue is e4m3fn's */
  if (rocm)
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: the FP8 epilogue (%s) is built for CUDA only",
                  quant_names[quant]);
  if (quant == TPC_QUANT_PER_TOKEN_GROUP && row_values % TPC_FP8_GROUP != 0)
    return refuse(TPC_ERR_INVALID_ARG, why, len,
                  "all_reduce_norm: PER_TOKEN_GROUP needs rows of a multiple of %d values, not %zu", TPC_FP8_GROUP,
                  row_values);
  if (quant == TPC_QUANT_PER_TENSOR) return TPC_OK; /* the given scale is read: no stride, no floor */
  if (scale_row_stride == 0 || (quant == TPC_QUANT_PER_TOKEN_GROUP && scale_group_stride == 0))
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: %s scales need nonzero strides (%zu, %zu)",
                  quant_names[quant], scale_row_stride, scale_group_stride);
  /* written as a negation so that NaN fails it too; inf would make every code 0 */
  if (!(scale_floor > 0.0f && scale_floor <= 3.4028234663852886e38f))
    return refuse(TPC_ERR_INVALID_ARG, why, len, "all_reduce_norm: scale_floor %g is not finite and > 0",
                  (double)scale_floor);
  return TPC_OK;
}
