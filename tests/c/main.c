/*
 * Tests of the C core (csrc/core: life cycle, ops, errors, registry) over the
 * fake runtime: no CUDA, no GPU. Several fake ranks live in this one process
 * and open each other's buffers. The tests share the process's registry
 * (ids, control pool chunks), so they run in one fixed order.
 */
#include "harness.h"

#define RUN(fn)              \
  do {                       \
    current_test = #fn;      \
    fn();                    \
  } while (0)

int main(void) {
  const int missing = fake_runtime_missing_entry();
  if (missing >= 0) {
    printf("tests/c/fake_runtime.c does not implement entry %d of tpc_runtime "
           "(csrc/core/runtime.h grew): add it\n0 passed, 1 failed\n", missing);
    return 1;
  }
  scratch_in = aligned_alloc(64, SCRATCH_BYTES);
  scratch_out = aligned_alloc(64, SCRATCH_BYTES);
  if (!scratch_in || !scratch_out) return 2;
  memset(scratch_in, 0, SCRATCH_BYTES);
  memset(scratch_out, 0, SCRATCH_BYTES);

  RUN(test_result_strings);
  RUN(test_layout);
  RUN(test_config_validation);
  RUN(test_create_destroy);
  RUN(test_create_failures);
  RUN(test_open_peer);
  RUN(test_open_peer_bad_offset);
  RUN(test_destroy_failures);
  RUN(test_probe);
  RUN(test_all_reduce_validation);
  RUN(test_reduce_scatter);
  RUN(test_reduce_scatter_f32);
  RUN(test_all_reduce_norm);
  RUN(test_all_reduce_norm_quant);
  RUN(test_norm_quant_check);
  RUN(test_all_reduce_algo_and_args);
  RUN(test_quantized_validation);
  RUN(test_all_gather);
  RUN(test_async_error);
  RUN(test_describe);
  RUN(test_ids);
  RUN(test_pool_chunks);
  RUN(test_acquire);
  RUN(test_id_all_reduce);
  RUN(test_destroy_control_slot);
  RUN(test_abort);
  RUN(test_args_control);
  RUN(test_export_blob);
  RUN(test_peer_control);
  RUN(test_shared_chunk);
  RUN(test_debug_set_epoch);
  RUN(test_acquire_threads);
  RUN(test_stream_switch);
  RUN(test_launch_device);
  RUN(test_no_leaks_under_failures);

  free(scratch_in);
  free(scratch_out);
  printf("%d passed, %d failed\n", n_pass, n_fail);
  return n_fail ? 1 : 0;
}
