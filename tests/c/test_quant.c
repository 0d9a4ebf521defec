/*
 * The quantized all-reduce (TPC_ALGO_QUANTIZED_FP8, _INT8, _INT4): what the core
 * refuses (other dtypes and ops, the bulk cap, sizes and alignment) and the
 * arguments the kernel gets.
 */
#include "harness.h"

void test_quantized_validation(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 3, 1));
  tpc_comm *c = w.comm[2];
  unsigned char *in = scratch_in, *out = scratch_out;
  static const struct {
    size_t nbytes;
    size_t in_off;
    int dtype;
    int algo;
    tpc_result want;
    const char *needle;
  } cases[] = {
      {64, 0, TPC_FLOAT32, TPC_ALGO_QUANTIZED_INT8, TPC_ERR_INVALID_ARG,
       "all_reduce: dtype 0 (float32) is not float16 or bfloat16"},
      {64, 0, 5, TPC_ALGO_QUANTIZED_FP8, TPC_ERR_INVALID_ARG, "dtype 5 (no tpc_dtype)"},
      {40, 0, TPC_BFLOAT16, TPC_ALGO_QUANTIZED_INT4, TPC_ERR_INVALID_ARG, "all_reduce of 40 bytes: a positive multiple of 16"},
      {0, 0, TPC_FLOAT16, TPC_ALGO_QUANTIZED_INT4, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {64, 8, TPC_BFLOAT16, TPC_ALGO_QUANTIZED_FP8, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      /* its slots are in the bulk region: the bulk cap, not the packet cap */
      {MAX_BYTES + 16, 0, TPC_BFLOAT16, TPC_ALGO_QUANTIZED_INT8, TPC_ERR_TOO_LARGE, "all_reduce of 4112 bytes is over max_bytes 4096"},
      {64, 0, TPC_BFLOAT16, TPC_ALGO_BULK_ONE_SHOT + 1, TPC_ERR_INVALID_ARG,
       "all_reduce: unknown algorithm 9 (packet 1, bulk 2, line 3, two_shot 4, quantized_fp8/int8/int4 5-7 or bulk_one_shot 8)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    CHECK_RC(c, tpc_all_reduce(c, in + cases[i].in_off, out, cases[i].nbytes, (tpc_dtype)cases[i].dtype,
                               (tpc_algo)cases[i].algo, STREAM_A),
             cases[i].want);
    CHECK_MSG(c, cases[i].needle);
  }
  /* only all_reduce has the kernel */
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, 64, TPC_BFLOAT16, TPC_ALGO_QUANTIZED_INT8, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "reduce_scatter has no quantized_int8 kernel");
  CHECK_RC(c, tpc_reduce_scatter_f32(c, in, (float *)out, 64, TPC_BFLOAT16, TPC_ALGO_QUANTIZED_FP8, STREAM_A),
           TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "reduce_scatter has no quantized_fp8 kernel");
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_QUANTIZED_INT4, 0, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "all_gather has no quantized_int4 kernel");
  CHECK_EQ(fake.launches, 0); /* nothing invalid reached a kernel */

  /* every mode and 16-bit dtype runs, over the packet cap and up to the bulk
   * cap, in place too; the kind word carries the mode, so peers that run
   * another mode fail with a mismatch naming it */
  const int algos[] = {TPC_ALGO_QUANTIZED_FP8, TPC_ALGO_QUANTIZED_INT8, TPC_ALGO_QUANTIZED_INT4};
  const int dtypes[] = {TPC_FLOAT16, TPC_BFLOAT16};
  int launches = 0;
  for (int a = 0; a < 3; ++a)
    for (int d = 0; d < 2; ++d) {
      CHECK_RC(c, tpc_all_reduce(c, in, a == 1 ? in : out, MAX_BYTES, (tpc_dtype)dtypes[d], (tpc_algo)algos[a],
                                 STREAM_A),
               TPC_OK);
      CHECK_EQ(fake.last_algo, algos[a]);
      CHECK_EQ(fake.last_args.kind, tpc_kind_word(TPC_OP_ALL_REDUCE, algos[a], dtypes[d], MAX_BYTES));
      CHECK_EQ(fake.last_args.nbytes, MAX_BYTES);
      CHECK_EQ(fake.last_args.out_bytes, MAX_BYTES);
      CHECK_EQ(fake.last_args.poison, dtypes[d] == TPC_BFLOAT16 ? 0x7fc07fc07fc07fc0ull : 0x7e007e007e007e00ull);
      CHECK_EQ(fake.last_args.world, 3);
      CHECK_EQ(fake.last_args.rank, 2);
      ++launches;
    }
  CHECK_RC(c, tpc_all_reduce(c, in, out, 16, TPC_BFLOAT16, TPC_ALGO_QUANTIZED_INT4, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launches, launches + 1);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}
