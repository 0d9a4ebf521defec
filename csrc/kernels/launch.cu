/*
 * Entry points the C core calls (through its runtime table): pick the launch
 * geometry for the size and launch. Kernels themselves live in the .cuh files.
 */
#include "all_gather.cuh"
#include "all_reduce.cuh"
#include "all_reduce_norm.cuh"
#ifndef TPC_HIP
#include "all_reduce_quant.cuh" /* CUDA only: ROCm refuses the quantized algorithms */
#endif
#include "reduce_scatter.cuh"

#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
#define TPC_LAUNCH_ERROR() ((int)hipGetLastError())
typedef hipStream_t tpc_stream; /* spelled out: a direct hipcc build has no cudaStream_t */
#else
#define TPC_LAUNCH_ERROR() ((int)cudaGetLastError())
typedef cudaStream_t tpc_stream;
#endif

/* Packet kernels use no per-block flags, so they may spread over one block per
 * multiprocessor of the device (132 on an H100/H200, 304 compute units on an
 * MI300X, 110 on an MI250X die: read at communicator creation), whatever
 * TPC_MAX_BLOCKS is; bulk kernels are bounded by the flag arrays. */
#define TPC_PACKET_BLOCKS_FALLBACK 132 /* a device that reported no count */
#define TPC_PACKET_BLOCKS_CEILING 1024

static unsigned tpc_packet_max_blocks(const tpc_kernel_args *args) {
  const int n = args->max_blocks;
  if (n <= 0) return TPC_PACKET_BLOCKS_FALLBACK;
  return n < TPC_PACKET_BLOCKS_CEILING ? (unsigned)n : TPC_PACKET_BLOCKS_CEILING;
}
#define TPC_SINGLE_BLOCK_ITEMS 256 /* up to here one block: no cross-block count */
/* Remote stores from one SM saturate early: small packet ops spread thin
 * blocks over many SMs; large ones use fat blocks to keep more in flight. */
#define TPC_PACKET_THIN_THREADS 128
#define TPC_PACKET_FAT_THREADS TPC_BLOCK_THREADS
/* The fused norm kernel's rows are sized by the same block (tpcomm.h). */
static_assert(TPC_NORM_THREADS == TPC_BLOCK_THREADS, "the norm kernel's block is TPC_BLOCK_THREADS data threads");

/* CUDA's limit on a kernel's parameters; every kernel takes one tpc_kernel_args. */
static_assert(sizeof(tpc_kernel_args) <= 4096, "the kernels' argument block fits the kernel parameter limit");

typedef struct {
  unsigned blocks, threads;
} tpc_geometry;

/* One work item per data thread where possible, plus the control warp of
 * every block. Small ops get a single block; larger ones spread over many
 * blocks so that many SMs push over NVLink at once. */
static tpc_geometry tpc_geometry_for(uint64_t items, unsigned threads, unsigned max_blocks) {
  tpc_geometry g;
  if (items <= TPC_SINGLE_BLOCK_ITEMS) {
    g.blocks = 1;
    g.threads = (unsigned)((items + 31) / 32 * 32);
    if (g.threads < 32) g.threads = 32;
    g.threads += TPC_CONTROL_THREADS;
    return g;
  }
  uint64_t blocks = (items + threads - 1) / threads;
  g.blocks = (unsigned)(blocks < max_blocks ? blocks : max_blocks);
  g.threads = threads + TPC_CONTROL_THREADS;
  return g;
}

static unsigned tpc_packet_threads(uint64_t items, unsigned max_blocks) {
  return items <= (uint64_t)max_blocks * TPC_PACKET_THIN_THREADS ? TPC_PACKET_THIN_THREADS : TPC_PACKET_FAT_THREADS;
}

static tpc_geometry tpc_packet_geometry(const tpc_kernel_args *args, uint64_t items) {
  const unsigned max_blocks = tpc_packet_max_blocks(args);
  return tpc_geometry_for(items, tpc_packet_threads(items, max_blocks), max_blocks);
}

/* Line kernels (line.cuh): one warp step (4 lines of 8 lanes) per 32 data
 * threads, for `chunks` times the steps of nbytes (reduce_scatter pushes
 * world - 1 chunks of nbytes), spread as the packet kernels are. */
static tpc_geometry tpc_line_geometry(const tpc_kernel_args *args, uint64_t chunks) {
  const uint64_t lines = (args->nbytes / 16 + TPC_LINE_UNITS - 1) / TPC_LINE_UNITS;
  const uint64_t lines_per_step = 32 / TPC_LINE_LANES;
  return tpc_packet_geometry(args, chunks * ((lines + lines_per_step - 1) / lines_per_step) * 32);
}

/* The line protocol rests on NVLink delivering a warp's 128-byte store whole
 * (line.cuh); AMD's fabric makes no such promise, so there it is refused. */
#ifdef TPC_HIP
#define TPC_LINE_UNSUPPORTED() return (int)hipErrorNotSupported
#else
#define TPC_LINE_UNSUPPORTED() (void)0
#endif

/* Streamed kernels (stream.cuh), over `units` (one rank's input; its chunk
 * in the two-shot all-reduce and in reduce-scatter): as many blocks as
 * there are block steps, up to TPC_MAX_BLOCKS, of 4 data warps; 8 once
 * 4-warp blocks would take more than one step each (above 1 MiB), so that
 * a multiprocessor keeps more in flight. */
static tpc_geometry tpc_stream_geometry(uint64_t units) {
  const uint64_t steps = (units + TPC_STREAM_STEP_UNITS - 1) / TPC_STREAM_STEP_UNITS;
  const uint64_t warps_per_block = steps > TPC_MAX_BLOCKS * 4ull ? TPC_STREAM_WARPS_PER_BLOCK : TPC_STREAM_WARPS_PER_BLOCK / 2;
  const uint64_t blocks = (steps + warps_per_block - 1) / warps_per_block;
  tpc_geometry g;
  g.blocks = (unsigned)(blocks < TPC_MAX_BLOCKS ? blocks : TPC_MAX_BLOCKS);
  g.threads = (unsigned)(warps_per_block * TPC_STREAM_LANES) + TPC_CONTROL_THREADS;
  return g;
}

typedef void (*tpc_kernel)(const tpc_kernel_args);

/* The reducing kernels are templated on the dtype (all_reduce.cuh,
 * reduce_scatter.cuh): their instantiations in a table indexed by
 * args->dtype, which the core checked is one of the three. */
static_assert(TPC_FLOAT32 == 0 && TPC_FLOAT16 == 1 && TPC_BFLOAT16 == 2, "the dtype indexes the kernel tables");
#define TPC_DTYPES(K) {K<TPC_FLOAT32>, K<TPC_FLOAT16>, K<TPC_BFLOAT16>}
/* reduce-scatter's, by a.out_f32, then the dtype */
#define TPC_DTYPES_OUT(K)                                      \
  {{K<TPC_FLOAT32, 0>, K<TPC_FLOAT16, 0>, K<TPC_BFLOAT16, 0>}, \
   {K<TPC_FLOAT32, 1>, K<TPC_FLOAT16, 1>, K<TPC_BFLOAT16, 1>}}

/* Launches with programmatic stream serialisation where CUDA has it: the
 * kernel may begin while the previous one finishes and waits for it in
 * tpc_grid_wait (see portability.cuh). */
static int tpc_launch(tpc_kernel kernel, tpc_geometry g, const tpc_kernel_args *args, void *stream) {
#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
  kernel<<<g.blocks, g.threads, 0, (tpc_stream)stream>>>(*args);
  return TPC_LAUNCH_ERROR();
#else
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(g.blocks);
  cfg.blockDim = dim3(g.threads);
  cfg.stream = (tpc_stream)stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, kernel, *args);
#endif
}

extern "C" int tpc_launch_all_reduce(const tpc_kernel_args *args, int algo, void *stream) {
  const int d = args->dtype;
  if (algo == TPC_ALGO_PACKET) {
    static const tpc_kernel packet[3] = TPC_DTYPES(tpc_all_reduce_packet_kernel);
    const uint64_t items = args->nbytes / TPC_PACKET_DATA_BYTES;
    return tpc_launch(packet[d] /* a tpc_all_reduce_packet_kernel */, tpc_packet_geometry(args, items), args, stream);
  }
  if (algo == TPC_ALGO_LINE) {
    TPC_LINE_UNSUPPORTED();
    static const tpc_kernel line[3] = TPC_DTYPES(tpc_all_reduce_line_kernel);
    return tpc_launch(line[d] /* a tpc_all_reduce_line_kernel */, tpc_line_geometry(args, 1), args, stream);
  }
  if (algo == TPC_ALGO_TWO_SHOT) { /* a warp a step: the pushes and gathers cover (n-1)/n of them */
    TPC_LINE_UNSUPPORTED();
    static const tpc_kernel two_shot[3] = TPC_DTYPES(tpc_all_reduce_two_shot_kernel);
    return tpc_launch(two_shot[d] /* a tpc_all_reduce_two_shot_kernel */, tpc_line_geometry(args, 1), args, stream);
  }
  if (algo == TPC_ALGO_QUANTIZED_FP8 || algo == TPC_ALGO_QUANTIZED_INT8 || algo == TPC_ALGO_QUANTIZED_INT4) {
#ifdef TPC_HIP
    return (int)hipErrorNotSupported;
#else /* the dtype (fp16 or bf16: the core checked it) and the mode pick the instantiation; the streamed
       * two-shot's grid, over one chunk */
#define TPC_QUANT_MODES(D)                                                                        \
  {tpc_all_reduce_quant_kernel<D, TPC_QUANT_FP8>, tpc_all_reduce_quant_kernel<D, TPC_QUANT_INT8>, \
   tpc_all_reduce_quant_kernel<D, TPC_QUANT_INT4>}
    static const tpc_kernel kernels[2][3] = {TPC_QUANT_MODES(TPC_FLOAT16), TPC_QUANT_MODES(TPC_BFLOAT16)};
#undef TPC_QUANT_MODES
    const tpc_kernel kernel = kernels[args->dtype == TPC_BFLOAT16][tpc_quant_mode(algo) - TPC_QUANT_FP8];
    return tpc_launch(kernel /* a tpc_all_reduce_quant_kernel */,
                      tpc_stream_geometry(tpc_quant_chunk(args->nbytes / 16, args->world)), args, stream);
#endif
  }
  /* the one-shot stream (two ranks: limits.c) */
  if (algo == TPC_ALGO_BULK_ONE_SHOT) {
    static const tpc_kernel one_shot[3] = TPC_DTYPES(tpc_all_reduce_stream_kernel);
    return tpc_launch(one_shot[d] /* a tpc_all_reduce_stream_kernel */, tpc_stream_geometry(args->nbytes / 16), args,
                      stream);
  }
  /* the streamed two-shot (three ranks or more), its steps laid over one rank's chunk */
  static const tpc_kernel bulk[3] = TPC_DTYPES(tpc_all_reduce_bulk_kernel);
  return tpc_launch(bulk[d] /* a tpc_all_reduce_bulk_kernel */,
                    tpc_stream_geometry(tpc_two_shot_chunk(args->nbytes / 16, args->world)), args, stream);
}

extern "C" int tpc_launch_all_gather(const tpc_kernel_args *args, int algo, void *stream) {
  if (algo == TPC_ALGO_PACKET) {
    const uint64_t items = (args->nbytes / 4 + 1) / 2;
    /* dim 0 in whole 8-byte units: the flat kernel (all_gather.cuh). The
     * core only takes 16-byte aligned pointers, so the shape alone decides
     * and every rank runs the same variant. */
    const int flat = args->row_bytes == args->nbytes && args->nbytes % 8 == 0;
    return tpc_launch(flat ? tpc_all_gather_packet_flat_kernel : tpc_all_gather_packet_kernel,
                      tpc_packet_geometry(args, items), args, stream);
  }
  if (algo == TPC_ALGO_LINE) {
    TPC_LINE_UNSUPPORTED();
    return tpc_launch(tpc_all_gather_line_kernel, tpc_line_geometry(args, 1), args, stream);
  }
  return tpc_launch(tpc_all_gather_bulk_kernel, tpc_stream_geometry(args->nbytes / 16), args, stream);
}

extern "C" int tpc_launch_reduce_scatter(const tpc_kernel_args *args, int algo, void *stream) {
  const int f = args->out_f32 != 0, d = args->dtype;
  if (algo == TPC_ALGO_PACKET) {
    static const tpc_kernel packet[2][3] = TPC_DTYPES_OUT(tpc_reduce_scatter_packet_kernel);
    const uint64_t items = args->nbytes / TPC_PACKET_DATA_BYTES;
    return tpc_launch(packet[f][d] /* a tpc_reduce_scatter_packet_kernel */, tpc_packet_geometry(args, items), args,
                      stream);
  }
  if (algo == TPC_ALGO_LINE) { /* a warp for each step of the n-1 chunks it pushes */
    TPC_LINE_UNSUPPORTED();
    static const tpc_kernel line[2][3] = TPC_DTYPES_OUT(tpc_reduce_scatter_line_kernel);
    return tpc_launch(line[f][d] /* a tpc_reduce_scatter_line_kernel */,
                      tpc_line_geometry(args, (uint64_t)args->world - 1), args, stream);
  }
  /* streamed, its steps laid over one rank's chunk */
  static const tpc_kernel bulk[2][3] = TPC_DTYPES_OUT(tpc_reduce_scatter_bulk_kernel);
  return tpc_launch(bulk[f][d] /* a tpc_reduce_scatter_bulk_kernel */, tpc_stream_geometry(args->nbytes / 16), args,
                    stream);
}

/* The fused norm family: one block per row, up to one per multiprocessor; as many data threads as
 * the row has packet units (a multiple of 32, at most TPC_NORM_THREADS: the
 * rest is looped over, TPC_NORM_UNITS per thread at most). Few rows, written
 * out of place, get as many blocks as the packet all-reduce would use to push
 * them (one per TPC_PACKET_THIN_THREADS units): the kernel's "spread" mode. */
extern "C" int tpc_launch_all_reduce_norm(const tpc_kernel_args *args, void *stream) {
  const uint64_t rows = args->nbytes / args->row_bytes;
  const uint64_t row_units = args->row_bytes / TPC_PACKET_DATA_BYTES;
  const unsigned max_blocks = tpc_packet_max_blocks(args);
  const uintptr_t in = (uintptr_t)args->in, out = (uintptr_t)args->out, out2 = (uintptr_t)args->out2,
                  out3 = (uintptr_t)args->out3;
  const uint64_t n = args->nbytes;
  const int apart = (in + n <= out || out + n <= in) && (in + n <= out2 || out2 + n <= in) &&
                    (!out3 || in + n <= out3 || out3 + n <= in);
  const uint64_t pushers = apart ? (rows * row_units + TPC_PACKET_THIN_THREADS - 1) / TPC_PACKET_THIN_THREADS : 0;
  const uint64_t wanted = pushers > rows ? pushers : rows;
  tpc_geometry g;
  g.blocks = (unsigned)(wanted < max_blocks ? wanted : max_blocks);
  g.threads = (unsigned)(row_units < TPC_NORM_THREADS ? (row_units + 31) / 32 * 32 : TPC_NORM_THREADS) +
              TPC_CONTROL_THREADS;
  /* the dtype (fp16 or bf16), the pattern, the FP8 epilogue and the units a thread holds pick the
   * instantiation (all_reduce_norm.cuh says why templates); the core checked the ranges */
  const uint64_t data_threads = g.threads - TPC_CONTROL_THREADS;
  const int few = (row_units + data_threads - 1) / data_threads <= TPC_NORM_FEW_UNITS;
#define TPC_NORM_UNITS_OF(D, P, Q) \
  {tpc_all_reduce_norm_kernel<D, P, Q, TPC_NORM_UNITS>, tpc_all_reduce_norm_kernel<D, P, Q, TPC_NORM_FEW_UNITS>}
#define TPC_NORM_QUANTS(D, P)                                                                     \
  {TPC_NORM_UNITS_OF(D, P, TPC_QUANT_NONE), TPC_NORM_UNITS_OF(D, P, TPC_QUANT_PER_TENSOR),      \
   TPC_NORM_UNITS_OF(D, P, TPC_QUANT_PER_TOKEN), TPC_NORM_UNITS_OF(D, P, TPC_QUANT_PER_TOKEN_GROUP)}
#define TPC_NORM_PATTERNS(D)                                                                  \
  {TPC_NORM_QUANTS(D, TPC_PATTERN_ADD_NORM),       TPC_NORM_QUANTS(D, TPC_PATTERN_NORM_ADD),        \
   TPC_NORM_QUANTS(D, TPC_PATTERN_NORM_ADD_NORM),  TPC_NORM_QUANTS(D, TPC_PATTERN_ADD_LAYER_NORM),  \
   TPC_NORM_QUANTS(D, TPC_PATTERN_LAYER_NORM_ADD), TPC_NORM_QUANTS(D, TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM)}
  static const tpc_kernel kernels[2][6][4][2] = {TPC_NORM_PATTERNS(TPC_FLOAT16), TPC_NORM_PATTERNS(TPC_BFLOAT16)};
#undef TPC_NORM_PATTERNS
#undef TPC_NORM_QUANTS
#undef TPC_NORM_UNITS_OF
  return tpc_launch(kernels[args->dtype == TPC_BFLOAT16][args->pattern][args->quant][few] /* a tpc_all_reduce_norm_kernel */,
                    g, args, stream);
}
