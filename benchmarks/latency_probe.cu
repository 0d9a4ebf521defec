/*
 * Where the time of a small collective goes: tpcomm's real kernels
 * (launch.cu, included) beside stripped variants, on two ranks of one GPU
 * each, timed as probe_ranks.h times them (as the benchmark does).
 *
 * One process drives both GPUs (peer access, no IPC), so no torch is needed:
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/latency_probe.cu -o /tmp/probe && /tmp/probe
 * `/tmp/probe quick` leaves out 256 KiB; `/tmp/probe bulk` times only the
 * two-rank bulk all_reduce at 4 and 16 MiB over other grids than launch.cu's;
 * `/tmp/probe geom` the packet and line kernels at 64 B - 64 KiB over other
 * block sizes; `/tmp/probe host` the host cost of one eager launch (how
 * tpcomm launches, and plainer launches beside it). `list` (or `list quick`)
 * prints the rows the default (or quick) run times, without a GPU.
 * Stages are placed by difference (variants that leave one stage out), not by
 * in-kernel clocks, which would perturb what they measure.
 */
#include <chrono>
#include <string>

#include "probe_ranks.h"

/* ------------------------------------------------------------ variants */

/* The floor of a graph kernel node. */
__global__ void probe_empty(const __grid_constant__ tpc_kernel_args a) {}

/* A kernel without parameters: the launch with the least to copy. */
__global__ void probe_no_params() {}

/* The floor with programmatic dependent launch, as tpcomm launches. */
__global__ void probe_empty_pdl(const __grid_constant__ tpc_kernel_args a) {
  tpc_grid_wait();
  tpc_grid_release();
}

/* + the device epoch: read the control slot, advance it (tpc_op_begin also
 * sends the header, unchecked here). */
__global__ void probe_epoch(const __grid_constant__ tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  tpc_op_end(&a, &op, 0);
}

/* + one packet to the peer and the wait for the peer's (lane 0 only). */
__global__ void probe_ping(const __grid_constant__ tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  if (threadIdx.x == 0) {
    const int peer = 1 - a.rank;
    tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, a.rank), make_uint2(1, 2), op.epoch);
    tpc_packet_from(&op, 0, peer, 0);
  }
  tpc_op_end(&a, &op, 0);
}

/* + the input: thread 0 loads its unit of the input (after the wait for the
 * previous kernel, as every real kernel must) and sends it. */
__global__ void probe_ping_load(const __grid_constant__ tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  if (threadIdx.x == 0) {
    const int peer = 1 - a.rank;
    tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, a.rank), *(const uint2 *)a.in, op.epoch);
    const uint2 v = tpc_packet_from(&op, 0, peer, 0);
    *(uint2 *)a.out = v;
  }
  tpc_op_end(&a, &op, 0);
}

/* The epoch drawn with one atomic add by the control warp's lead (single
 * block), the dependents released as soon as it returns: no separate load,
 * store and fence. Ping: with one packet each way, its input loaded and the
 * peer's stored, as probe_ping_load. */
template <bool Ping>
__global__ void probe_epoch_atomic(const __grid_constant__ tpc_kernel_args a) {
  __shared__ uint32_t shared_epoch;
  const int control = threadIdx.x >= blockDim.x - TPC_CONTROL_THREADS;
  uint2 v = make_uint2(0, 0);
  if (control) {
    if (threadIdx.x == blockDim.x - TPC_CONTROL_THREADS) {
      const uint32_t e = atomicAdd(&a.control->epoch, 1u) + 1u;
      shared_epoch = e;
      if (e != 0u) tpc_grid_release(); /* a branch on the result: only once the add returned */
    }
    tpc_warp_sync();
  } else {
    tpc_grid_wait();
    if (Ping && threadIdx.x == 0) v = *(const uint2 *)a.in;
  }
  tpc_block_handoff(control);
  tpc_op op;
  op.args = &a;
  op.sig = tpc_signals_of(&a, a.rank);
  op.control = a.control;
  op.epoch = shared_epoch;
  op.deadline_ns = 0;
  op.timeout_ns = a.timeout_ns;
  op.failed = 0;
  if (control) tpc_grid_wait();
  if (Ping && threadIdx.x == 0) {
    const int peer = 1 - a.rank;
    tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, a.rank), v, op.epoch);
    *(uint2 *)a.out = tpc_packet_from(&op, 0, peer, 0);
  }
}

/* The packet variants below start as the real packet kernels do
 * (tpc_packet_prologue: the op, with this thread's first 8-byte unit of the
 * input loaded beside the control load), without the header check, which
 * they leave out or place themselves. */
#define PROBE_PACKET_START(units)                                                                        \
  tpc_packet_start start;                                                                                \
  if (!tpc_packet_prologue(&a, units, [&](uint64_t u) { return ((const uint2 *)a.in)[u]; }, &start,     \
                           tpc_op_refuse, 0))                                                            \
    return;                                                                                              \
  tpc_op &op = start.op;                                                                                 \
  const tpc_span span = start.span;                                                                      \
  const uint2 v0 = start.v0

/* The packet all_reduce without its header check (tpc_op_begin still sends
 * the header): what the mismatch check costs (the real kernel is the row
 * above it). */
__global__ void probe_packet_no_header(const __grid_constant__ tpc_kernel_args a) {
  const uint64_t units = a.nbytes / TPC_PACKET_DATA_BYTES;
  const uint2 *in = (const uint2 *)a.in;
  PROBE_PACKET_START(units);
  for (uint64_t u = span.first; u < units; u += span.stride) {
    const uint2 v = u == span.first ? v0 : in[u];
    tpc_packet_push(&a, op.epoch, u, [&](int) { return v; });
  }
  for (uint64_t u = span.first; u < units; u += span.stride)
    ((uint2 *)a.out)[u] = tpc_sum_packet<PROBE_DTYPE>(&op, &a, u == span.first ? v0 : in[u], u, 0);
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* The data path of the packet all_reduce without its arithmetic: every data
 * thread loads its unit, pushes it, waits for the peer's and stores that. */
__global__ void probe_packets_no_sum(const __grid_constant__ tpc_kernel_args a) {
  const uint64_t units = a.nbytes / TPC_PACKET_DATA_BYTES;
  PROBE_PACKET_START(units);
  const int peer = 1 - a.rank;
  if (span.first < units) {
    tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, a.rank) + span.first * TPC_PACKET_BYTES, v0, op.epoch);
    ((uint2 *)a.out)[span.first] = tpc_packet_from(&op, span.first, peer, 0);
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* probe_packets_no_sum's straight line in the real kernel's two loops: every
 * push first, then every wait; with Sum, the two ranks' values added in
 * packed bf16 (tpc_add2) where the real kernel runs its general sum. */
template <bool Sum>
__global__ void probe_packets_two_loops(const __grid_constant__ tpc_kernel_args a) {
  const uint64_t units = a.nbytes / TPC_PACKET_DATA_BYTES;
  const uint2 *in = (const uint2 *)a.in;
  PROBE_PACKET_START(units);
  const int peer = 1 - a.rank;
  for (uint64_t u = span.first; u < units; u += span.stride)
    tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, a.rank) + u * TPC_PACKET_BYTES, u == span.first ? v0 : in[u],
                   op.epoch);
  for (uint64_t u = span.first; u < units; u += span.stride) {
    const uint2 p = tpc_packet_from(&op, u, peer, 0);
    if (Sum) {
      const uint2 own = u == span.first ? v0 : in[u];
      ((uint2 *)a.out)[u] = make_uint2(tpc_add2(own.x, p.x, 1), tpc_add2(own.y, p.y, 1));
    } else {
      ((uint2 *)a.out)[u] = p;
    }
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* The packet all_gather of two ranks at a dim-0 output (no index arithmetic),
 * with its header check in thread 0's first wait (Header = 1, as the real
 * kernel in several blocks; one block has its control warp check it) or
 * without it (0; tpc_op_begin still sends the header). */
template <int Header>
__global__ void probe_gather(const __grid_constant__ tpc_kernel_args a) {
  const uint64_t units = a.nbytes / 8;
  const uint2 *in = (const uint2 *)a.in;
  uint2 *out = (uint2 *)a.out;
  PROBE_PACKET_START(units);
  const int me = a.rank, peer = 1 - a.rank;
  for (uint64_t u = span.first; u < units; u += span.stride) {
    const uint2 v = u == span.first ? v0 : in[u];
    tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, me) + u * TPC_PACKET_BYTES, v, op.epoch);
    out[me * units + u] = v;
  }
  for (uint64_t u = span.first; u < units; u += span.stride) {
    const uint2 v = tpc_packet_from(&op, u, peer, Header);
    out[peer * units + u] = tpc_op_broken(&op) ? tpc_poison8(&a) : v;
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

/* ------------------------------------------------------------ host cost */

/* Host microseconds per eager launch on rank 0's stream: median over rounds
 * of 500 launches, the stream drained between rounds (500 launches fit in
 * the queue, so the host never waits for the GPU inside a round). */
static void report_host(const char *name, const std::function<void()> &launch) {
  CHECK(cudaSetDevice(0));
  std::vector<double> per_call;
  for (int round = 0; round < 25; ++round) {
    CHECK(cudaStreamSynchronize(ranks[0].stream));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 500; ++i) launch();
    const auto t1 = std::chrono::steady_clock::now();
    if (round >= 5) per_call.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / 500);
  }
  CHECK(cudaStreamSynchronize(ranks[0].stream));
  std::sort(per_call.begin(), per_call.end());
  printf("%-52s %7.3f us per call (host)\n", name, per_call[per_call.size() / 2]);
  fflush(stdout);
}

int main(int argc, char **argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  listing = mode == "list";
  const int quick = mode == "quick" || (listing && argc > 2 && std::string(argv[2]) == "quick");
  const int bulk_sweep = mode == "bulk";
  const int geom_sweep = mode == "geom";
  if (!listing) open_ranks(2, bulk_sweep ? (size_t)16 << 20 : (size_t)1 << 20, true);

  if (mode == "host") {
    const tpc_geometry one = {1, 64};
    cudaStream_t st = ranks[0].stream;
    printf("tpc_kernel_args: %zu bytes\n", sizeof(tpc_kernel_args));
    report_host("<<<>>> of a kernel without parameters", [&] { probe_no_params<<<1, 64, 0, st>>>(); });
    report_host("<<<>>> of a kernel taking tpc_kernel_args", [&] { probe_empty<<<1, 64, 0, st>>>(ranks[0].args); });
    report_host("cudaLaunchKernelEx, PDL off", [&] { launch_pdl(probe_empty, one, 0, 0); });
    report_host("cudaLaunchKernelEx, PDL on (as tpcomm launches)", [&] { launch_pdl(probe_empty_pdl, one, 0, 1); });
    report_host("  + cudaGetDevice, as the C core does", [&] {
      int device;
      CHECK(cudaGetDevice(&device));
      launch_pdl(probe_empty_pdl, one, 0, 1);
    });
    return 0;
  }

  if (bulk_sweep) {
    /* The two-rank bulk all_reduce (the streamed kernel) over grids other
     * than the one launch.cu picks: blocks x data warps. */
    for (uint64_t n : {(uint64_t)4 << 20, (uint64_t)16 << 20}) {
      set_size(n, TPC_OP_ALL_REDUCE);
      report("all_reduce bulk (tpcomm's grid)", n,
             [&](int r) { CHECK((cudaError_t)tpc_launch_all_reduce(&ranks[r].args, TPC_ALGO_BULK_ONE_SHOT, ranks[r].stream)); });
      check_all_reduce(n);
      for (unsigned warps : {4u, 8u})
        for (unsigned blocks : {32u, 64u, 96u, 128u}) {
          const tpc_geometry g = {blocks, warps * TPC_STREAM_LANES + TPC_CONTROL_THREADS};
          char name[64];
          snprintf(name, sizeof name, "  %u blocks x %u warps", blocks, warps);
          report(name, n, [&](int r) { launch_pdl(tpc_all_reduce_stream_kernel<PROBE_DTYPE>, g, r, 1); });
          check_all_reduce(n);
        }
    }
    return 0;
  }

  if (geom_sweep) {
    /* The packet and line kernels of both ops over other block sizes than
     * launch.cu's: data threads per block, blocks as many as the items need
     * (up to one per multiprocessor). */
    const unsigned sms = (unsigned)ranks[0].args.max_blocks;
    for (uint64_t n : {(uint64_t)64, (uint64_t)2048, (uint64_t)4096, (uint64_t)16384, (uint64_t)65536}) {
      const uint64_t lines = (n / 16 + TPC_LINE_UNITS - 1) / TPC_LINE_UNITS;
      const struct {
        const char *name;
        int op;
        tpc_kernel kernel;
        uint64_t items;
      } kinds[] = {
          {"all_reduce packet", TPC_OP_ALL_REDUCE, tpc_all_reduce_packet_kernel<PROBE_DTYPE>, n / TPC_PACKET_DATA_BYTES},
          {"all_gather packet", TPC_OP_ALL_GATHER, tpc_all_gather_packet_kernel, (n / 4 + 1) / 2},
          {"all_reduce line", TPC_OP_ALL_REDUCE, tpc_all_reduce_line_kernel<PROBE_DTYPE>, (lines + 3) / 4 * 32},
          {"all_gather line", TPC_OP_ALL_GATHER, tpc_all_gather_line_kernel, (lines + 3) / 4 * 32},
      };
      for (const auto &k : kinds) {
        set_size(n, k.op);
        const tpc_geometry mine = tpc_packet_geometry(&ranks[0].args, k.items);
        char name[80];
        snprintf(name, sizeof name, "%s (tpcomm: %ux%u)", k.name, mine.blocks, mine.threads);
        report(name, n, [&](int r) { launch_pdl(k.kernel, mine, r, 1); });
        check(k.op, n);
        for (unsigned t : {32u, 64u, 128u, 256u, 512u}) {
          const uint64_t want = (k.items + t - 1) / t;
          tpc_geometry g;
          g.blocks = (unsigned)(want < sms ? want : sms);
          g.threads = (g.blocks == 1 ? (unsigned)((k.items + 31) / 32 * 32) : t) + TPC_CONTROL_THREADS;
          if (g.blocks == mine.blocks && g.threads == mine.threads) continue;
          if (g.blocks == 1 && t > 32 && k.items <= t / 2) continue; /* the same one block as a smaller t */
          snprintf(name, sizeof name, "  %u blocks x %u threads", g.blocks, g.threads);
          report(name, n, [&](int r) { launch_pdl(k.kernel, g, r, 1); });
          check(k.op, n);
        }
      }
    }
    return 0;
  }

  const tpc_geometry one = {1, 64};
  set_size(64, TPC_OP_ALL_REDUCE);
  report("empty kernel", 0, [&](int r) { launch_pdl(probe_empty, one, r, 0); });
  report("empty kernel, PDL", 0, [&](int r) { launch_pdl(probe_empty_pdl, one, r, 1); });
  report("+ device epoch, header sent", 0, [&](int r) { launch_pdl(probe_epoch, one, r, 1); });
  report("+ one packet each way", 0, [&](int r) { launch_pdl(probe_ping, one, r, 1); });
  report("+ its input loaded, output stored", 0, [&](int r) { launch_pdl(probe_ping_load, one, r, 1); });
  report("epoch by atomic add", 0, [&](int r) { launch_pdl(probe_epoch_atomic<false>, one, r, 1); });
  report("  + one packet, input and output", 0, [&](int r) { launch_pdl(probe_epoch_atomic<true>, one, r, 1); });

  const uint64_t sizes[] = {64, 2048, 16384, 65536, 262144, 1048576};
  for (uint64_t n : sizes) {
    if (quick && n == 262144) continue;
    set_size(n, TPC_OP_ALL_REDUCE);
    const uint64_t items = n / TPC_PACKET_DATA_BYTES;
    const tpc_geometry g = tpc_packet_geometry(&ranks[0].args, items);
    report("all_reduce packet (tpcomm)", n,
           [&](int r) { CHECK((cudaError_t)tpc_launch_all_reduce(&ranks[r].args, TPC_ALGO_PACKET, ranks[r].stream)); });
    check_all_reduce(n);
    report("  without the header check", n, [&](int r) { launch_pdl(probe_packet_no_header, g, r, 1); });
    check_all_reduce(n);
    if (n <= TPC_PACKET_DATA_BYTES * (g.threads - TPC_CONTROL_THREADS) * (uint64_t)g.blocks && g.blocks == 1)
      report("  ... and without the sum", n, [&](int r) { launch_pdl(probe_packets_no_sum, g, r, 1); });
    report("  ... in two loops (push all, then wait)", n,
           [&](int r) { launch_pdl(probe_packets_two_loops<false>, g, r, 1); });
    report("  ... with a packed bf16 sum", n, [&](int r) { launch_pdl(probe_packets_two_loops<true>, g, r, 1); });
    check_all_reduce(n);
    check_all_reduce(n);
    report("  without PDL", n, [&](int r) { launch_pdl(tpc_all_reduce_packet_kernel<PROBE_DTYPE>, g, r, 0); });
    report("  after an ordinary kernel", n, [&](int r) {
      launch_pdl(probe_empty, one, r, 0);
      CHECK((cudaError_t)tpc_launch_all_reduce(&ranks[r].args, TPC_ALGO_PACKET, ranks[r].stream));
    });
    report("all_reduce bulk (tpcomm)", n,
           [&](int r) { CHECK((cudaError_t)tpc_launch_all_reduce(&ranks[r].args, TPC_ALGO_BULK_ONE_SHOT, ranks[r].stream)); });
    check_all_reduce(n);
    set_size(n, TPC_OP_ALL_GATHER);
    report("all_gather packet (tpcomm)", n,
           [&](int r) { CHECK((cudaError_t)tpc_launch_all_gather(&ranks[r].args, TPC_ALGO_PACKET, ranks[r].stream)); });
    check_all_gather(n);
    {
      const tpc_geometry ga = tpc_packet_geometry(&ranks[0].args, n / 8);
      report("  the general kernel (any dim)", n, [&](int r) { launch_pdl(tpc_all_gather_packet_kernel, ga, r, 1); });
      check_all_gather(n);
      report("  dim 0, header in thread 0's wait", n, [&](int r) { launch_pdl(probe_gather<1>, ga, r, 1); });
      check_all_gather(n);
      report("  without the header check", n, [&](int r) { launch_pdl(probe_gather<0>, ga, r, 1); });
      check_all_gather(n);
    }
    report("all_gather bulk (tpcomm)", n,
           [&](int r) { CHECK((cudaError_t)tpc_launch_all_gather(&ranks[r].args, TPC_ALGO_BULK, ranks[r].stream)); });
    check_all_gather(n);
  }
  return 0;
}
