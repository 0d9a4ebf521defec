/*
 * compute-sanitizer racecheck on the streamed kernels' start, with the push
 * counts (pushed[], stream.cuh) zeroed either way:
 *   control: by the control warp before tpc_op_begin's handoff
 *            (tpc_stream_op_begin: what the kernels do);
 *   data:    by data threads 0..7 after the handoff, before the block barrier
 *            in tpc_bulk_acquire (the other order).
 * Everything else is the kernels' own code: the op begins (the control warp
 * hands the control slot to the block with bar.arrive), tpc_bulk_acquire
 * waits for the peer's release (one lane of warp 0 polls, then the block
 * barrier), the control warp signals (acquires of the counts), the data warps
 * mark their steps (releases of them) and the op ends. Rank 0 of two runs
 * alone: the peer's release is set in advance, and no data is pushed or
 * waited for. Both ways are correct (the block barrier orders the data
 * threads' zeroing before the control warp's first read); what racecheck
 * reports on each is in docs/testing.md.
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90 -lineinfo -Icsrc benchmarks/racecheck_stream_start.cu -o rs
 *   compute-sanitizer --tool racecheck --racecheck-report hazard ./rs {control|data}
 */
#include <cstddef>

#include "probe_ranks.h"

template <int DATA_ZEROES>
__global__ void __launch_bounds__(TPC_STREAM_MAX_THREADS)
    probe_stream_start(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_op op = DATA_ZEROES ? tpc_op_begin(&a) : tpc_stream_op_begin(&a);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  if (DATA_ZEROES && threadIdx.x < TPC_STREAM_WARPS_PER_BLOCK) tpc_stream_pushed()[threadIdx.x] = 0;
  const tpc_steps s = tpc_stream_of(&a, tpc_bulk_acquire(&a, &op, TPC_BULK_HALF), a.nbytes / 16, TPC_BULK_HALF);
  if (s.warp == s.data_warps) {
    tpc_stream_signal_all(&op, &s, s.block_steps);
  } else {
    for (uint32_t i = 0; i < s.block_steps; ++i) tpc_stream_mark(&op, &s, i + 1);
  }
  tpc_op_end(&a, &op, TPC_BULK_HALF);
}

int main(int argc, char **argv) {
  const char *way = argc > 1 ? argv[1] : "";
  const int data_zeroes = strcmp(way, "data") == 0;
  if (!data_zeroes && strcmp(way, "control") != 0) {
    fprintf(stderr, "usage: %s {control|data}\n", argv[0]);
    return 2;
  }
  const uint64_t sizes[] = {64 << 10, 4 << 20}; /* blocks of 4 data warps, one step; of 8, several */
  open_ranks(2, sizes[1], false);
  /* The peer released every earlier bulk op, so tpc_bulk_acquire's wait
   * ends at its first load (still a lane of warp 0 on its own). */
  const uint32_t released = 1u << 30;
  CHECK(cudaMemcpy(ranks[0].buf + offsetof(tpc_signals, released) + sizeof(uint32_t), &released, sizeof released,
                   cudaMemcpyHostToDevice));
  const tpc_kernel kernel = data_zeroes ? probe_stream_start<1> : probe_stream_start<0>;
  int launches = 0;
  for (uint64_t nbytes : sizes) {
    set_size(nbytes, TPC_OP_ALL_REDUCE);
    for (int i = 0; i < 2; ++i, ++launches)
      CHECK((cudaError_t)tpc_launch(kernel, tpc_stream_geometry(nbytes / 16), &ranks[0].args, ranks[0].stream));
  }
  CHECK(cudaStreamSynchronize(ranks[0].stream));
  exit_on_recorded_error(0);
  printf("%s zeroes the counts: %d launches, no error recorded\n", data_zeroes ? "data threads" : "the control warp",
         launches);
  return 0;
}
