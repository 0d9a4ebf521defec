/*
 * What one GPU can time of the quantized all-reduce (all_reduce_quant.cuh):
 * its local work, run by the kernel's own step functions as the kernel
 * instantiates them for bf16 (tpc_quant_encode_jobs, tpc_quant_sum_step,
 * tpc_unit_of_floats<TPC_BFLOAT16>), beside a device-to-device copy.
 *
 *   read           quantize's loads alone (its grid, steps and loads, no
 *                  arithmetic, no stores): the time its 16 MiB read takes
 *   quantize       a rank's 16 MiB bf16 input into codes and scales: the
 *                  scatter's work (reads 16 MiB, writes 9 MiB: fp8/int8,
 *                  5 MiB: int4)
 *   dequant-sum n  n ranks' codes of 16 MiB decoded and summed in fp32 in
 *                  rank order, rounded to bf16: the sums' and the gather's
 *                  decoding (reads n x 9 or 5 MiB, writes 16 MiB)
 *
 * The steps are the kernel's (tpc_stream_unit over tpc_steps), every warp of
 * the grid a data warp, from and into plain device memory instead of peers'
 * slots; so this times the codecs and their memory traffic, not the link.
 * Each kernel's grid is one wave in which every block takes the same number
 * of steps (ql_grid): a grid of more blocks than fit at once, or of steps
 * that do not divide evenly, times a tail of idle multiprocessors instead.
 * (The grid is the benchmark's: the all-reduce's is sized for the link.)
 *
 * Each is reported as its bytes read and written per second, and as the
 * fraction of the bandwidth of cudaMemcpyAsync (device to device) of 16 MiB
 * in the same run (its 16 MiB read and 16 MiB written per second), marked
 * where it is below the target of 90 % (the copy and the read are
 * yardsticks, not held to it). Medians of 50 timed runs after 5
 * untimed, each run after twice the L2 is read (ql_flush: the 16 MiB and
 * its copy would otherwise stay in an H100's 50 MB L2). Checks: every
 * group decoded and each value held to quant.cuh's bound, |v - decode| <=
 * c A (+ 2^-64), after quantize; every unit of a dequant-sum's output the
 * bits of its n decodes summed unit by unit. A value past the bound or a
 * sum that differs exits 1.
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/quant_local.cu -o /tmp/quant_local && /tmp/quant_local
 *   /tmp/quant_local 8      every kernel on 8 blocks an SM instead of its own grid (below)
 *   /tmp/quant_local list   prints the rows it times, without a GPU
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/quant_steps.cuh"
#include "probe_check.h"

#define QL_BYTES (16u << 20)
#define QL_UNITS (QL_BYTES / 16u)
#define QL_MAX_RANKS 8
#define QL_THREADS 256
#define QL_DTYPE TPC_BFLOAT16
#define QL_TARGET 0.90 /* of the copy's rate: the local work should keep up with memory */

static const int ql_modes[] = {TPC_QUANT_FP8, TPC_QUANT_INT8, TPC_QUANT_INT4};
static const char *const ql_names[] = {"", "fp8", "int8", "int4"};

/* The kernel's steps over QL_UNITS (tpc_stream_of's, with every warp of the
 * block a data warp and no region): block b takes block steps b, b + B, ...
 * QL_UNITS is a multiple of a step, so every lane runs every shuffle. */
TPC_DEVICE tpc_steps ql_steps(void) {
  tpc_steps s = {};
  s.units = QL_UNITS;
  s.data_warps = blockDim.x / TPC_STREAM_LANES;
  const uint64_t step_units = (uint64_t)s.data_warps * TPC_STREAM_STEP_UNITS;
  const uint64_t all = (s.units + step_units - 1) / step_units;
  s.block_steps = blockIdx.x < all ? (uint32_t)((all - blockIdx.x + gridDim.x - 1) / gridDim.x) : 0;
  s.warp = threadIdx.x / TPC_STREAM_LANES;
  s.lane = threadIdx.x % TPC_STREAM_LANES;
  return s;
}

/* The scatter's work on every step: each unit quantized with its group, by
 * the kernel's tpc_quant_encode_jobs, a job a step (step t+1's loads in
 * flight while step t is quantized, as the kernel's peer i+1's are while
 * peer i's are). Registers capped for 5 resident blocks an SM (ptxas -v: 48,
 * no spill), so that many warps keep two steps' loads in flight. */
template <int mode>
__global__ void __launch_bounds__(QL_THREADS, 5) ql_quantize(const uint4 *in, char *payload, float *scales) {
  const tpc_steps s = ql_steps();
  if (s.block_steps == 0) return;
  tpc_quant_encode_jobs<QL_DTYPE, mode>(&s, (int)s.block_steps, [&](int t) {
    return tpc_quant_job{(uint32_t)t, (const char *)in, QL_UNITS, tpc_quant_at{payload, scales}};
  });
}

/* Quantize's loads alone, on its grid and steps (tpc_quant_walk_jobs, two
 * steps in flight): the time its 16 MiB read takes with no arithmetic and
 * no stores. The sink is written only on a value the input never xors to,
 * so the loads stay. */
__global__ void __launch_bounds__(QL_THREADS, 5) ql_read_in(const uint4 *in, unsigned *sink) {
  const tpc_steps s = ql_steps();
  if (s.block_steps == 0) return;
  unsigned acc = 0;
  tpc_quant_walk_jobs(
      &s, (int)s.block_steps, [&](int t) { return tpc_quant_job{(uint32_t)t, (const char *)in, QL_UNITS, {}}; },
      [&](const tpc_quant_job &, const uint4 *v) {
#pragma unroll
        for (int k = 0; k < TPC_STREAM_UNITS; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
      });
  if (acc == 0x9e3779b9u) *sink = acc;
}

/* n ranks' codes of every step (rank q's at q times the strides), summed
 * in rank order by the kernel's tpc_quant_sum_step (rank q+1's loads in
 * flight while rank q's codes are decoded) and rounded to bf16. Registers
 * capped for 3 resident blocks an SM, so that many warps keep their steps'
 * loads in flight (ptxas -v shows no spill). */
template <int mode>
__global__ void __launch_bounds__(QL_THREADS, 3)
    ql_dequant_sum(char *payload, float *scales, uint64_t payload_stride, uint64_t scale_stride, int n, uint4 *out) {
  const tpc_steps s = ql_steps();
  for (uint32_t t = 0; t < s.block_steps; ++t) {
    float acc[TPC_STREAM_UNITS][8];
    tpc_quant_sum_step<QL_DTYPE, mode>(
        &s, t, QL_UNITS, n, -1, nullptr,
        [&](int q) { return tpc_quant_at{payload + q * payload_stride, scales + q * scale_stride}; }, acc);
#pragma unroll
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) tpc_store16(out + tpc_stream_unit(&s, t, k), tpc_unit_of_floats<QL_DTYPE>(acc[k]));
  }
}

/* Every value of `in` against its decode (n = 1 of the sum, in fp32 before
 * the rounding): counts those past the bound. */
template <int mode>
__global__ void ql_check(const uint4 *in, const char *payload, const float *scales, unsigned *bad) {
  const float c = mode == TPC_QUANT_FP8 ? 0.0625f + 3.814697265625e-6f /* 2^-4 + 2^-18 */
                                        : 0.5f / tpc_quant_qmax(mode) + 4.76837158203125e-7f; /* + 2^-21 */
  for (uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; u < QL_UNITS;
       u += (uint64_t)gridDim.x * blockDim.x) {
    float f[8], d[8];
    tpc_unit_floats<QL_DTYPE>(in[u], f);
    const float absmax = tpc_group_absmax(f);
    const uint2 v = tpc_quant_unit_bytes(mode) == 8 ? ((const uint2 *)payload)[u]
                                                    : make_uint2(((const uint32_t *)payload)[u], 0u);
    tpc_quant_decode<mode>(v, scales[u / TPC_QUANT_LANES], d);
    for (int i = 0; i < 8; ++i)
      if (!(fabsf(f[i] - d[i]) <= c * absmax * 1.0000001f + TPC_QUANT_TINY)) atomicAdd(bad, 1u);
  }
}

/* Every unit of out against n ranks' codes decoded and summed unit by unit
 * (every rank's codes are rank 0's): counts the units whose bits differ. */
template <int mode>
__global__ void ql_sum_check(const char *payload, const float *scales, int n, const uint4 *out, unsigned *bad) {
  for (uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; u < QL_UNITS;
       u += (uint64_t)gridDim.x * blockDim.x) {
    const uint2 v = tpc_quant_unit_bytes(mode) == 8 ? ((const uint2 *)payload)[u]
                                                    : make_uint2(((const uint32_t *)payload)[u], 0u);
    float d[8], acc[8];
    tpc_quant_decode<mode>(v, scales[u / TPC_QUANT_LANES], d);
    for (int q = 0; q < n; ++q) tpc_quant_add(acc, d, q == 0);
    const uint4 w = tpc_unit_of_floats<QL_DTYPE>(acc), o = out[u];
    if (w.x != o.x || w.y != o.y || w.z != o.z || w.w != o.w) atomicAdd(bad, 1u);
  }
}

/* bf16 values: normal-ish, with every 37th group a hundred times larger. */
__global__ void ql_fill(uint16_t *x) {
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < QL_BYTES / 2;
       i += (uint64_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    float v = ((float)(h & 0xffffu) / 65536.0f - 0.5f) * 4.0f;
    if ((i / 32) % 37 == 0) v *= 100.0f;
    x[i] = tpc_float_to_bf16(v);
  }
}

/* Kernel k's grid: per_sm blocks an SM where given; else as many blocks as
 * are resident at once (one wave), fewer where that evens out the steps, so
 * that every block takes ceil(steps / resident blocks) of the 16 MiB's
 * steps and none waits on another's last one. */
static unsigned ql_grid(const void *k, int sms, int per_sm) {
  if (per_sm) return (unsigned)(sms * per_sm);
  int resident = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, k, QL_THREADS, 0));
  const unsigned steps = QL_UNITS / (QL_THREADS / TPC_STREAM_LANES * TPC_STREAM_STEP_UNITS);
  const unsigned slots = (unsigned)(resident * sms), per_block = (steps + slots - 1) / slots;
  return (steps + per_block - 1) / per_block;
}

typedef struct {
  std::string name;
  double read, written; /* bytes */
  bool reference;       /* a yardstick, not held to the target */
} ql_row;

static std::vector<ql_row> ql_rows() {
  std::vector<ql_row> rows;
  rows.push_back({"copy 16 MiB (cudaMemcpyAsync)", (double)QL_BYTES, (double)QL_BYTES, true});
  rows.push_back({"read 16 MiB (quantize's loads)", (double)QL_BYTES, 0.0, true});
  for (int m : ql_modes) {
    const double coded = (double)QL_UNITS * tpc_quant_unit_bytes(m) + QL_UNITS / TPC_QUANT_LANES * 4.0; /* + scales */
    rows.push_back({std::string("quantize ") + ql_names[m], (double)QL_BYTES, coded, false});
    for (int n : {2, 4, 8})
      rows.push_back({std::string("dequant-sum ") + ql_names[m] + " n=" + std::to_string(n), n * coded,
                      (double)QL_BYTES, false});
  }
  return rows;
}

/* f(mode) with the mode as a compile-time constant (the kernels' templates). */
template <typename F>
static void ql_for_mode(int m, F f) {
  if (m == TPC_QUANT_FP8) f(std::integral_constant<int, TPC_QUANT_FP8>());
  else if (m == TPC_QUANT_INT8) f(std::integral_constant<int, TPC_QUANT_INT8>());
  else f(std::integral_constant<int, TPC_QUANT_INT4>());
}

/* The L2 flush before each timed launch: twice the L2's size read, so that
 * no launch finds its inputs cached by the one before (16 MiB and its copy
 * fit in an H100's 50 MB L2, where a copy reads and writes faster than HBM
 * allows). Read, not written: a written flush leaves the L2 full of dirty
 * lines, whose write-back would fall inside the timed launch. */
typedef struct {
  uint4 *buffer;
  size_t bytes;
  unsigned *sink;
  int blocks; /* 4 an SM */
} ql_flush;

/* Reads every 16 bytes of the flush buffer; the sink is written only on a
 * value the buffer (zeros) never sums to, so the loads stay. */
__global__ void ql_read_over(const uint4 *buffer, size_t units, unsigned *sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < units; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = buffer[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

/* Median of 50 launches, each after a flush and between two events: the
 * launch is queued behind the flush, so its host cost is not timed. */
template <typename Launch>
static double ql_time_us(Launch launch, cudaStream_t s, ql_flush flush) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) launch();
  std::vector<float> ms;
  for (int i = 0; i < 50; ++i) {
    ql_read_over<<<flush.blocks, 512, 0, s>>>(flush.buffer, flush.bytes / sizeof(uint4), flush.sink);
    CHECK(cudaEventRecord(a, s));
    launch();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[ms.size() / 2];
}

int main(int argc, char **argv) {
  const std::vector<ql_row> rows = ql_rows();
  if (argc > 1 && !strcmp(argv[1], "list")) {
    for (const ql_row &r : rows) printf("%s\n", r.name.c_str());
    return 0;
  }
  const int per_sm = argc > 1 ? atoi(argv[1]) : 0; /* 0: each kernel's own grid (ql_grid) */
  if (argc > 1 && (per_sm < 1 || per_sm > 64)) {
    fprintf(stderr, "usage: %s [list | BLOCKS_PER_SM (1..64; default: one even wave a kernel)]\n", argv[0]);
    return 2;
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const unsigned blocks = (unsigned)(sms * 8); /* the fills' and checks' (untimed) */
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  uint4 *in, *out, *copy;
  char *payload;
  float *scales;
  unsigned *bad;
  const uint64_t payload_stride = (uint64_t)QL_UNITS * 8, scale_stride = QL_UNITS / TPC_QUANT_LANES;
  CHECK(cudaMalloc(&in, QL_BYTES));
  CHECK(cudaMalloc(&out, QL_BYTES));
  CHECK(cudaMalloc(&copy, QL_BYTES));
  CHECK(cudaMalloc(&payload, QL_MAX_RANKS * payload_stride));
  CHECK(cudaMalloc(&scales, QL_MAX_RANKS * scale_stride * sizeof(float)));
  CHECK(cudaMalloc(&bad, sizeof(unsigned)));
  ql_fill<<<blocks, QL_THREADS, 0, s>>>((uint16_t *)in);

  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  ql_flush flush = {nullptr, 2 * (size_t)std::max(prop.l2CacheSize, 1 << 20), nullptr, 4 * sms};
  CHECK(cudaMalloc(&flush.buffer, flush.bytes));
  CHECK(cudaMalloc(&flush.sink, sizeof(unsigned)));
  CHECK(cudaMemset(flush.buffer, 0, flush.bytes));
  printf("%s, %d SMs, %d MB L2 (flushed before each timed launch); 16 MiB bf16 inputs; blocks of %d threads, %s\n",
         prop.name, sms, prop.l2CacheSize >> 20, QL_THREADS, per_sm ? "as many an SM as given" : "one even wave a kernel");
  printf("%-34s %10s %12s %10s %8s\n", "what", "us", "GB/s", "of copy", "blocks");
  double copy_rate = 0;
  size_t row = 0;
  int below = 0;
  auto report = [&](double us, unsigned grid) {
    const ql_row &r = rows[row++];
    const double rate = (r.read + r.written) / (us * 1e3);
    if (copy_rate == 0) copy_rate = rate;
    const bool short_of = !r.reference && rate < QL_TARGET * copy_rate;
    below += short_of;
    printf("%-34s %10.2f %12.1f %9.1f%% %8s%s\n", r.name.c_str(), us, rate, 100.0 * rate / copy_rate,
           grid ? std::to_string(grid).c_str() : "", short_of ? "  below the target" : "");
  };
  report(ql_time_us([&] { CHECK(cudaMemcpyAsync(copy, in, QL_BYTES, cudaMemcpyDeviceToDevice, s)); }, s, flush), 0);
  {
    const unsigned grid = ql_grid((const void *)ql_quantize<TPC_QUANT_FP8>, sms, per_sm); /* quantize's */
    report(ql_time_us([&] { ql_read_in<<<grid, QL_THREADS, 0, s>>>(in, flush.sink); }, s, flush), grid);
  }
  int failed = 0;
  for (int m : ql_modes) {
    unsigned grid = 0;
    ql_for_mode(m, [&](auto mode) { grid = ql_grid((const void *)ql_quantize<mode()>, sms, per_sm); });
    report(ql_time_us([&] { ql_for_mode(m, [&](auto mode) { ql_quantize<mode()><<<grid, QL_THREADS, 0, s>>>(in, payload, scales); }); }, s, flush),
           grid);
    CHECK(cudaMemsetAsync(bad, 0, sizeof(unsigned), s));
    ql_for_mode(m, [&](auto mode) { ql_check<mode()><<<blocks, QL_THREADS, 0, s>>>(in, payload, scales, bad); });
    unsigned nbad = 0;
    CHECK(cudaMemcpyAsync(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    if (nbad) {
      fprintf(stderr, "%s: %u values past the bound\n", ql_names[m], nbad);
      failed = 1;
    }
    for (int q = 1; q < QL_MAX_RANKS; ++q) { /* every rank's codes: rank 0's */
      CHECK(cudaMemcpyAsync(payload + q * payload_stride, payload, payload_stride, cudaMemcpyDeviceToDevice, s));
      CHECK(cudaMemcpyAsync(scales + q * scale_stride, scales, scale_stride * sizeof(float),
                            cudaMemcpyDeviceToDevice, s));
    }
    ql_for_mode(m, [&](auto mode) { grid = ql_grid((const void *)ql_dequant_sum<mode()>, sms, per_sm); });
    for (int n : {2, 4, 8}) {
      report(ql_time_us(
          [&] {
            ql_for_mode(m, [&](auto mode) {
              ql_dequant_sum<mode()><<<grid, QL_THREADS, 0, s>>>(payload, scales, payload_stride, scale_stride, n, out);
            });
          },
          s, flush),
          grid);
      CHECK(cudaMemsetAsync(bad, 0, sizeof(unsigned), s));
      ql_for_mode(m, [&](auto mode) { ql_sum_check<mode()><<<blocks, QL_THREADS, 0, s>>>(payload, scales, n, out, bad); });
      CHECK(cudaMemcpyAsync(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost, s));
      CHECK(cudaStreamSynchronize(s));
      if (nbad) {
        fprintf(stderr, "dequant-sum %s n=%d: %u units differ from their sums\n", ql_names[m], n, nbad);
        failed = 1;
      }
    }
  }
  CHECK(cudaStreamSynchronize(s));
  printf("target: every row >= %.0f %% of the copy: %s (%d of %zu below)\n", 100 * QL_TARGET, below ? "not met" : "met",
         below, (size_t)std::count_if(rows.begin(), rows.end(), [](const ql_row &r) { return !r.reference; }));
  printf(failed ? "check: FAILED\n" : "check: every value within the bound, every sum as decoded unit by unit\n");
  return failed;
}
