/*
 * How fast can SM threads move data over NVLink, and how should the bulk
 * kernels do it? Both GPUs move `bytes` to each other at once, as a
 * collective's phase does, with one of:
 *   push, U in flight: load U 16-byte units of the local source, then store them into
 *            the peer's buffer (what tpcomm's bulk kernels do: U = 1 in the two-shot
 *            phases, TPC_STREAM_UNITS in the streamed kernels);
 *   pull, U in flight: load U units from the peer's buffer, store them locally (what
 *            torch's two-shot does);
 * over a range of grid sizes, beside the copy engine (cudaMemcpyPeerAsync),
 * and the copy engine of GPU 0 alone ("copy-eng-1way": the link one way,
 * what a plain peer copy measures). Sizes up to 64 MiB each way: the
 * two-rank bulk all-reduce of S bytes sends S each way, so these rows are
 * its floor.
 * The time of one transfer is the median over reps of (both GPUs' events
 * around K back-to-back launches) / K, the slower GPU's.
 *   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/bandwidth_probe.cu -o /tmp/bw && /tmp/bw
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

static const int K = 10, REPS = 15;

/* Thread t handles units t, t + T, ..., U of them per step (T = threads in
 * the grid), so every warp access stays coalesced: it loads U units, then
 * stores them. Push: from the local source into the peer's buffer; pull:
 * from the peer's buffer (through L2, as a peer's data must be read) into a
 * local one. */
template <int U, bool Pull>
__global__ void move(const uint4 *__restrict__ from, uint4 *__restrict__ to, size_t units) {
  const size_t T = (size_t)gridDim.x * blockDim.x;
  for (size_t base = (size_t)blockIdx.x * blockDim.x + threadIdx.x; base < units; base += U * T) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (base + k * T < units) v[k] = Pull ? __ldcg(from + base + k * T) : from[base + k * T];
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (base + k * T < units) to[base + k * T] = v[k];
  }
}

typedef void (*kernel_t)(const uint4 *, uint4 *, size_t);

struct Gpu {
  uint4 *src, *dst;  // dst: what the peer writes into (push) or reads from (pull)
  cudaStream_t stream;
  cudaEvent_t start, end;
};
static Gpu g[2];

template <typename Launch>
static double time_us(Launch launch) {
  std::vector<double> t;
  for (int rep = 0; rep < REPS + 2; ++rep) {
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaDeviceSynchronize());
    }
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaEventRecord(g[d].start, g[d].stream));
      for (int k = 0; k < K; ++k) launch(d);
      CHECK(cudaEventRecord(g[d].end, g[d].stream));
    }
    double worst = 0;
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaEventSynchronize(g[d].end));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, g[d].start, g[d].end));
      worst = std::max(worst, ms * 1000.0 / K);
    }
    if (rep >= 2) t.push_back(worst);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static void row(const char *name, int blocks, int threads, size_t bytes, double us) {
  printf("%-13s %4d x %4d  %6zu KiB  %8.2f us  %6.1f GB/s\n", name, blocks, threads, bytes >> 10, us,
         bytes / us / 1e3);
}

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) {
    printf("needs 2 GPUs\n");
    return 0;
  }
  const size_t max_bytes = (size_t)64 << 20;
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CHECK(cudaMalloc(&g[d].src, max_bytes));
    CHECK(cudaMalloc(&g[d].dst, max_bytes));
    CHECK(cudaMemset(g[d].src, d + 1, max_bytes));
    CHECK(cudaStreamCreateWithFlags(&g[d].stream, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&g[d].start));
    CHECK(cudaEventCreate(&g[d].end));
  }
  struct Variant {
    const char *name;
    kernel_t k;
    int is_pull;
  } variants[] = {{"push1", move<1, false>, 0}, {"push2", move<2, false>, 0}, {"push4", move<4, false>, 0},
                  {"push8", move<8, false>, 0}, {"pull1", move<1, true>, 1},  {"pull2", move<2, true>, 1},
                  {"pull4", move<4, true>, 1},  {"pull8", move<8, true>, 1}};
  const int grids[][2] = {{64, 512}, {128, 512}, {132, 512}, {132, 1024}, {264, 512}, {528, 256}};
  for (size_t bytes : {(size_t)2 << 20, (size_t)8 << 20, (size_t)16 << 20, (size_t)64 << 20}) {
    const size_t units = bytes / 16;
    double ce = time_us([&](int d) {
      CHECK(cudaMemcpyPeerAsync(g[1 - d].dst, 1 - d, g[d].src, d, bytes, g[d].stream));
    });
    row("copy-eng", 0, 0, bytes, ce);
    double one_way = time_us([&](int d) {
      if (d == 0) CHECK(cudaMemcpyPeerAsync(g[1].dst, 1, g[0].src, 0, bytes, g[0].stream));
    });
    row("copy-eng-1way", 0, 0, bytes, one_way);
    for (const Variant &v : variants)
      for (const auto &grid : grids) {
        cudaFuncAttributes attr;
        CHECK(cudaFuncGetAttributes(&attr, v.k));
        if (attr.maxThreadsPerBlock < grid[1]) continue;  // too many registers for that block size
        double us = time_us([&](int d) {
          if (v.is_pull) v.k<<<grid[0], grid[1], 0, g[d].stream>>>(g[1 - d].dst, g[d].src, units);
          else v.k<<<grid[0], grid[1], 0, g[d].stream>>>(g[d].src, g[1 - d].dst, units);
        });
        CHECK(cudaGetLastError());
        row(v.name, grid[0], grid[1], bytes, us);
      }
  }
  return 0;
}
