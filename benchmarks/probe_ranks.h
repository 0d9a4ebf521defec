/*
 * The standalone probes' ranks: one process drives every rank (peer access,
 * no IPC), each rank with the buffer, control slot, input and stream its
 * communicator would hold, and times kernels the way the benchmark does: a
 * CUDA graph of PROBE_OPS launches per rank, every rank replayed together,
 * the median over replays of the slowest rank, per op.
 *
 * Rank r runs on GPU r % (GPUs present). Where ranks share a GPU (more ranks
 * than GPUs) their kernels run side by side in one context, so each rank is
 * given a share of the multiprocessors (max_blocks, halved again for the
 * blocks of the kernel that starts early): every rank's blocks fit at once,
 * which kernels that wait for each other need. Results are checked
 * then, times mean nothing; the bulk kernels, whose grid is fixed, are for one
 * GPU a rank only (probe_ranks_share_gpus()).
 *
 * Inputs: rank r's input is bf16 (r + 1) throughout, so every op's result is
 * known: an all_reduce gives world (world + 1) / 2 (exact in bf16 up to 8
 * ranks), an all_gather rank q's part q + 1.
 */
#ifndef TPCOMM_PROBE_RANKS_H
#define TPCOMM_PROBE_RANKS_H

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "../csrc/kernels/launch.cu"
#include "probe_check.h"

static const int PROBE_OPS = 50, PROBE_REPLAYS = 40, PROBE_WARMUP = 5;
/* The inputs' dtype: a probe that launches a kernel template itself takes this instantiation. */
#define PROBE_DTYPE TPC_BFLOAT16

struct Rank {
  char *buf;
  tpc_control *control;
  tpc_async_error *err;
  char *in, *out;
  cudaStream_t stream;
  tpc_kernel_args args;
};
static Rank ranks[TPC_MAX_RANKS];
static tpc_layout layout;
static int world = 2;
static int gpus = 1;

static int device_of(int r) { return r % gpus; }
static bool probe_ranks_share_gpus() { return world > gpus; }

/* bf16 bits of a small integer (exact: the top half of its fp32 bits). */
static uint16_t probe_bf16(int v) {
  const float f = (float)v;
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  return (uint16_t)(bits >> 16);
}

typedef std::function<void(int rank)> Launcher;

/* `list` mode: rows are named, nothing is launched or checked. */
static bool listing = false;
/* Set by a probe that times ranks sharing a GPU on purpose (norm_fp8_probe.cu):
 * its times are every rank's kernels side by side on the GPU. */
static bool timing_shared = false;

/* `n` ranks over the GPUs present, inputs of max_bytes a rank (outputs of
 * n times that). With require_gpus, one GPU a rank is needed. */
static void open_ranks(int n, size_t max_bytes, bool require_gpus) {
  CHECK(cudaGetDeviceCount(&gpus));
  world = n;
  if (gpus < 1 || (require_gpus && gpus < n)) {
    fprintf(stderr, "needs %d GPUs (found %d)\n", require_gpus ? n : 1, gpus);
    exit(1);
  }
  if (gpus > n) gpus = n;
  layout = tpc_layout_for(world, max_bytes, max_bytes);
  for (int d = 0; d < gpus; ++d) {
    CHECK(cudaSetDevice(d));
    for (int p = 0; p < gpus; ++p)
      if (p != d) CHECK(cudaDeviceEnablePeerAccess(p, 0));
  }
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device_of(r)));
    Rank &k = ranks[r];
    CHECK(cudaMalloc(&k.buf, layout.total_bytes));
    CHECK(cudaMemset(k.buf, 0, layout.total_bytes));
    CHECK(cudaMalloc(&k.control, sizeof(tpc_control)));
    tpc_control c = {1u, 0u, 0u, 0u};
    CHECK(cudaMemcpy(k.control, &c, sizeof c, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&k.err, sizeof(tpc_async_error)));
    CHECK(cudaMemset(k.err, 0, sizeof(tpc_async_error)));
    CHECK(cudaMalloc(&k.in, max_bytes));
    CHECK(cudaMalloc(&k.out, max_bytes * world));
    std::vector<uint16_t> v(max_bytes / 2, probe_bf16(r + 1));
    CHECK(cudaMemcpy(k.in, v.data(), max_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
  }
  const int per_gpu = (world + gpus - 1) / gpus;
  for (int r = 0; r < world; ++r) {
    tpc_kernel_args &a = ranks[r].args;
    memset(&a, 0, sizeof a);
    for (int p = 0; p < world; ++p) {
      a.bufs[p] = ranks[p].buf;
      a.peer_control[p] = ranks[p].control;
    }
    a.control = ranks[r].control;
    a.err = ranks[r].err;
    a.in = ranks[r].in;
    a.out = ranks[r].out;
    a.timeout_ns = 2000000000ull;
    a.packet_off = layout.packet_off;
    a.packet_slot_bytes = layout.packet_slot_bytes;
    a.data_off = layout.data_off;
    a.data_bytes = layout.data_bytes;
    a.poison = 0x7fc000007fc00000ull;
    a.comm_id = 1;
    a.rank = r;
    a.world = world;
    a.dtype = PROBE_DTYPE;
    a.poison_out = 1;
    CHECK(cudaDeviceGetAttribute(&a.max_blocks, cudaDevAttrMultiProcessorCount, device_of(r)));
    /* every rank of a shared GPU resident at once, each with room for the
     * next kernel's blocks, which programmatic dependent launch starts early */
    if (per_gpu > 1) a.max_blocks /= 2 * per_gpu;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const char *shared = !probe_ranks_share_gpus() ? ""
                       : timing_shared          ? " (shared: times are every rank's kernels side by side)"
                                                : " (shared: results checked, times meaningless)";
  printf("%s, %d ranks on %d GPUs%s, %d graph nodes per replay, median of %d replays, slowest rank, us per op\n",
         prop.name, world, gpus, shared, PROBE_OPS, PROBE_REPLAYS);
}

static void launch_pdl(tpc_kernel k, tpc_geometry g, int r, int pdl) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(g.blocks);
  cfg.blockDim = dim3(g.threads);
  cfg.stream = ranks[r].stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&cfg, k, ranks[r].args));
}

/* nbytes: the input per rank (all_gather, all_reduce) or one part
 * (reduce_scatter, whose input is world parts). */
static void set_size(uint64_t nbytes, int op) {
  for (int r = 0; r < world; ++r) {
    tpc_kernel_args &a = ranks[r].args;
    a.nbytes = nbytes;
    a.out_bytes = op == TPC_OP_ALL_GATHER ? nbytes * world : nbytes;
    a.row_bytes = nbytes;
    a.op = op;
    a.kind = tpc_kind_word(op, TPC_ALGO_PACKET, PROBE_DTYPE, nbytes);
  }
}

/* Stops the probe when rank r's kernels recorded an error (a timeout, a
 * mismatch): its results would be NaN. */
static void exit_on_recorded_error(int r) {
  tpc_control c;
  CHECK(cudaMemcpy(&c, ranks[r].control, sizeof c, cudaMemcpyDeviceToHost));
  if (c.failed) {
    fprintf(stderr, "rank %d recorded error %u\n", r, c.failed);
    exit(1);
  }
}

/* Median over replays of the slowest rank, microseconds per op. */
static double time_us(const Launcher &launch) {
  cudaGraphExec_t exec[TPC_MAX_RANKS];
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device_of(r)));
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(ranks[r].stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < PROBE_OPS; ++i) launch(r);
    CHECK(cudaStreamEndCapture(ranks[r].stream, &graph));
    CHECK(cudaGraphInstantiate(&exec[r], graph, 0));
    CHECK(cudaGraphDestroy(graph));
  }
  cudaEvent_t start[TPC_MAX_RANKS], stop[TPC_MAX_RANKS];
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device_of(r)));
    CHECK(cudaEventCreate(&start[r]));
    CHECK(cudaEventCreate(&stop[r]));
  }
  std::vector<double> per_op;
  for (int rep = 0; rep < PROBE_WARMUP + PROBE_REPLAYS; ++rep) {
    for (int r = 0; r < world; ++r) {
      CHECK(cudaSetDevice(device_of(r)));
      CHECK(cudaEventRecord(start[r], ranks[r].stream));
      CHECK(cudaGraphLaunch(exec[r], ranks[r].stream));
      CHECK(cudaEventRecord(stop[r], ranks[r].stream));
    }
    double worst = 0;
    for (int r = 0; r < world; ++r) {
      CHECK(cudaSetDevice(device_of(r)));
      CHECK(cudaEventSynchronize(stop[r]));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, start[r], stop[r]));
      worst = std::max(worst, (double)ms * 1000.0 / PROBE_OPS);
    }
    if (rep >= PROBE_WARMUP) per_op.push_back(worst);
  }
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device_of(r)));
    CHECK(cudaGraphExecDestroy(exec[r]));
    CHECK(cudaEventDestroy(start[r]));
    CHECK(cudaEventDestroy(stop[r]));
    exit_on_recorded_error(r);
  }
  std::sort(per_op.begin(), per_op.end());
  return per_op[per_op.size() / 2];
}

/* Where ranks share a GPU: `launch` PROBE_OPS times on every rank, back to
 * back on its stream (slots reused by epoch parity), untimed; any error a
 * rank recorded stops the probe. */
static void run_untimed(const Launcher &launch) {
  for (int i = 0; i < PROBE_OPS; ++i)
    for (int r = 0; r < world; ++r) {
      CHECK(cudaSetDevice(device_of(r)));
      launch(r);
    }
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device_of(r)));
    CHECK(cudaStreamSynchronize(ranks[r].stream));
    exit_on_recorded_error(r);
  }
}

static void report(const char *name, uint64_t nbytes, const Launcher &launch) {
  if (listing) {
    printf("%-34s %8llu B\n", name, (unsigned long long)nbytes);
    return;
  }
  if (probe_ranks_share_gpus()) {
    run_untimed(launch);
    printf("%-34s %8llu B  ran %d times (shared GPU: untimed)\n", name, (unsigned long long)nbytes, PROBE_OPS);
  } else {
    printf("%-34s %8llu B  %7.3f us\n", name, (unsigned long long)nbytes, time_us(launch));
  }
  fflush(stdout);
}

/* Every 16-bit word of rank r's first `bytes` of output is want(r, word). */
static void check_output(const char *what, uint64_t nbytes, uint64_t bytes,
                         const std::function<uint16_t(int, size_t)> &want) {
  if (listing) return;
  std::vector<uint16_t> host(bytes / 2);
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device_of(r)));
    CHECK(cudaMemcpy(host.data(), ranks[r].out, bytes, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < host.size(); ++i)
      if (host[i] != want(r, i)) {
        fprintf(stderr, "%s %llu B: rank %d word %zu is %04x, not %04x\n", what, (unsigned long long)nbytes, r, i,
                host[i], want(r, i));
        exit(1);
      }
  }
}

/* all_reduce and reduce_scatter: every value the sum of 1 .. world. */
static void check_sum(const char *what, uint64_t nbytes) {
  const uint16_t sum = probe_bf16(world * (world + 1) / 2);
  check_output(what, nbytes, nbytes, [&](int, size_t) { return sum; });
}

static void check_all_reduce(uint64_t nbytes) { check_sum("all_reduce", nbytes); }

/* rank q's part is q + 1 on every rank */
static void check_all_gather(uint64_t nbytes) {
  check_output("all_gather", nbytes, nbytes * world,
               [&](int, size_t i) { return probe_bf16((int)(i / (nbytes / 2)) + 1); });
}

static void check(int op, uint64_t nbytes) {
  if (op == TPC_OP_ALL_REDUCE) check_all_reduce(nbytes);
  else if (op == TPC_OP_REDUCE_SCATTER) check_sum("reduce_scatter", nbytes);
  else check_all_gather(nbytes);
}

#endif /* TPCOMM_PROBE_RANKS_H */
