/*
 * How tpcomm's kernels scale with the world size: at N ranks (default: one
 * per GPU present, up to 8), the floor of a small collective, one packet
 * exchanged with one peer (a ring: each rank sends one and waits for one)
 * and with every one of the N-1 peers (flags travel in parallel, so this
 * should cost close to the one-peer exchange), then tpcomm's real kernels
 * (launch.cu's entry points) for every op and algorithm that takes the size,
 * each result checked against the known sum or gather (probe_ranks.h), and
 * up to 64 KiB the packet all_reduce waiting for its peers' packets one
 * after another (a variant: what the real kernel's wait, every peer's packet
 * polled together, saves).
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/scale_probe.cu -o /tmp/scale && /tmp/scale [N]
 *
 * With more ranks than GPUs the ranks share them (one H200 runs N = 3..8):
 * every result is still checked, the times mean nothing, and the bulk
 * kernels are left out (their fixed grid needs a GPU a rank). `list [N]`
 * prints the rows a run at N ranks times, without a GPU.
 */
#include <string>

#include "probe_ranks.h"

/* One packet to the next rank, the wait for the previous rank's (lane 0). */
__global__ void probe_ping_ring(const __grid_constant__ tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  if (threadIdx.x == 0) {
    const int next = (a.rank + 1) % a.world, prev = (a.rank + a.world - 1) % a.world;
    tpc_packet_put(tpc_packet_slot(&a, next, op.epoch, a.rank), make_uint2(1, 2), op.epoch);
    tpc_packet_from(&op, 0, prev, 0);
  }
  tpc_op_end(&a, &op, 0);
}

/* One packet to every peer and the wait for every peer's: lane p talks to
 * rank p, all at once. */
__global__ void probe_ping_all(const __grid_constant__ tpc_kernel_args a) {
  tpc_op op = tpc_op_begin(&a);
  const int peer = (int)threadIdx.x;
  if (peer < a.world && peer != a.rank) {
    tpc_packet_put(tpc_packet_slot(&a, peer, op.epoch, a.rank), make_uint2(1, 2), op.epoch);
    tpc_packet_from(&op, 0, peer, 0);
  }
  tpc_op_end(&a, &op, 0);
}

/* The packet all_reduce waiting for one peer after another, each peer's
 * packet only once the previous one is in, where the real kernel polls every
 * peer's together (tpc_packets_from_peers): beside the real kernel's row it
 * shows what polling together saves at N ranks. Without the header check
 * (tpc_op_begin still sends the header). */
__global__ void probe_packet_in_turn(const __grid_constant__ tpc_kernel_args a) {
  const uint64_t units = a.nbytes / TPC_PACKET_DATA_BYTES;
  const uint2 *in = (const uint2 *)a.in;
  tpc_packet_start p;
  if (!tpc_packet_prologue(&a, units, [&](uint64_t u) { return in[u]; }, &p, tpc_op_refuse, 0)) return;
  tpc_op &op = p.op;
  for (uint64_t u = p.span.first; u < units; u += p.span.stride) {
    const uint2 v = u == p.span.first ? p.v0 : in[u];
    tpc_packet_push(&a, op.epoch, u, [&](int) { return v; });
  }
  for (uint64_t u = p.span.first; u < units; u += p.span.stride) {
    const uint2 own = u == p.span.first ? p.v0 : in[u];
    float acc[4];
    for (int q = 0; q < a.world; ++q) {
      const uint2 v = q == a.rank ? own : tpc_packet_from(&op, u, q, 0);
      const uint32_t words[2] = {v.x, v.y};
      tpc_add_rank(acc, words, 2, PROBE_DTYPE, q);
    }
    uint32_t sum[2];
    tpc_round(acc, sum, 2, PROBE_DTYPE);
    ((uint2 *)a.out)[u] = tpc_op_broken(&op) ? tpc_poison8(&a) : make_uint2(sum[0], sum[1]);
  }
  tpc_op_end(&a, &op, TPC_NOT_BULK);
}

typedef int (*probe_entry)(const tpc_kernel_args *, int, void *);

struct Kernel {
  const char *name;
  int op;
  probe_entry launch;
  int algo;
};

/* Whether tpcomm's kernel takes `nbytes` (input per rank; reduce_scatter:
 * one part) at this world size: tpcomm.routing's rules for these sizes. */
static bool takes(const Kernel &k, uint64_t nbytes, uint64_t packet_cap, bool shared) {
  if (k.algo == TPC_ALGO_BULK || k.algo == TPC_ALGO_BULK_ONE_SHOT) return !shared;
  if (nbytes > packet_cap) return false;
  if (k.algo == TPC_ALGO_TWO_SHOT) return nbytes > (uint64_t)TPC_LINE_STEP_BYTES * (world - 1);
  return true;
}

int main(int argc, char **argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  listing = mode == "list";
  const char *count = listing ? (argc > 2 ? argv[2] : nullptr) : (argc > 1 ? argv[1] : nullptr);
  int n = count ? atoi(count) : 0;
  if (!count && !listing) {
    CHECK(cudaGetDeviceCount(&n));
    n = std::min(n, TPC_MAX_RANKS);
  }
  if (n < 2 || n > TPC_MAX_RANKS) {
    fprintf(stderr, "usage: scale_probe [list] [N]   (N ranks, 2..%d; default: the GPUs present)\n", TPC_MAX_RANKS);
    return 2;
  }
  const uint64_t max_bytes = (uint64_t)4 << 20; /* a reduce_scatter's N parts of up to 512 KiB */
  if (listing) world = n, gpus = n;
  else open_ranks(n, max_bytes, false);
  const bool shared = probe_ranks_share_gpus();
  const uint64_t packet_cap = (uint64_t)1 << 20;

  const tpc_geometry one = {1, 64};
  set_size(64, TPC_OP_ALL_REDUCE);
  report("one packet, one peer (ring)", 0, [&](int r) { launch_pdl(probe_ping_ring, one, r, 1); });
  report("one packet, every peer", 0, [&](int r) { launch_pdl(probe_ping_all, one, r, 1); });

  const Kernel kernels[] = {
      {"all_reduce packet", TPC_OP_ALL_REDUCE, tpc_launch_all_reduce, TPC_ALGO_PACKET},
      {"all_reduce line", TPC_OP_ALL_REDUCE, tpc_launch_all_reduce, TPC_ALGO_LINE},
      {"all_reduce two_shot", TPC_OP_ALL_REDUCE, tpc_launch_all_reduce, TPC_ALGO_TWO_SHOT},
      /* routing's bulk all_reduce: the one-shot at two ranks, the streamed two-shot from three on */
      {"all_reduce bulk", TPC_OP_ALL_REDUCE, tpc_launch_all_reduce, world == 2 ? TPC_ALGO_BULK_ONE_SHOT : TPC_ALGO_BULK},
      {"reduce_scatter packet", TPC_OP_REDUCE_SCATTER, tpc_launch_reduce_scatter, TPC_ALGO_PACKET},
      {"reduce_scatter line", TPC_OP_REDUCE_SCATTER, tpc_launch_reduce_scatter, TPC_ALGO_LINE},
      {"reduce_scatter bulk", TPC_OP_REDUCE_SCATTER, tpc_launch_reduce_scatter, TPC_ALGO_BULK},
      {"all_gather packet", TPC_OP_ALL_GATHER, tpc_launch_all_gather, TPC_ALGO_PACKET},
      {"all_gather line", TPC_OP_ALL_GATHER, tpc_launch_all_gather, TPC_ALGO_LINE},
      {"all_gather bulk", TPC_OP_ALL_GATHER, tpc_launch_all_gather, TPC_ALGO_BULK},
  };
  /* sizes per rank (reduce_scatter: per part), each a multiple of 16 bytes */
  const uint64_t sizes[] = {64, 2048, 16384, 65536, 262144, 524288};
  for (const Kernel &k : kernels)
    for (uint64_t size : sizes) {
      if (!takes(k, size, packet_cap, shared)) continue;
      set_size(size, k.op);
      report(k.name, size, [&](int r) { CHECK((cudaError_t)k.launch(&ranks[r].args, k.algo, ranks[r].stream)); });
      check(k.op, size);
      if (k.op == TPC_OP_ALL_REDUCE && k.algo == TPC_ALGO_PACKET && size <= 65536) {
        const tpc_geometry g = tpc_packet_geometry(&ranks[0].args, size / TPC_PACKET_DATA_BYTES);
        report("  peers waited in turn", size, [&](int r) { launch_pdl(probe_packet_in_turn, g, r, 1); });
        check(k.op, size);
      }
    }
  return 0;
}
