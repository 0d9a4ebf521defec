/*
 * The collectives: what each op refuses and why, the kernel it is told to
 * run, and the arguments that kernel gets; stream and device handling.
 */
#include <math.h>

#include "harness.h"

/* reduce_scatter: the checks of all_reduce on the chunk (packet cap on one
 * chunk, bulk cap on the whole input of world chunks), and the arguments its
 * kernels get. */
void test_reduce_scatter(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 4, 1));
  tpc_comm *c = w.comm[1];
  unsigned char *in = scratch_in, *out = scratch_out;
  static const struct {
    size_t chunk;
    size_t in_off, out_off;
    int dtype;
    int algo;
    tpc_result want;
    const char *needle;
  } cases[] = {
      {0, 0, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "reduce_scatter of 0 bytes"},
      {40, 0, 0, TPC_FLOAT16, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {64, 4, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "reduce_scatter input and output must be 16-byte"},
      {64, 0, 0, 7, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "reduce_scatter: dtype 7 (no tpc_dtype) is not float32"},
      /* 4 chunks of 1040 bytes: over the 4096-byte cap in bulk, over the packet cap alone */
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "over the packet cap of 1024"},
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_BULK, TPC_ERR_TOO_LARGE, "reduce_scatter of 4 x 1040 bytes is over max_bytes 4096"},
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_LINE, TPC_ERR_TOO_LARGE, "over the packet cap of 1024"},
      {64, 0, 0, TPC_FLOAT32, TPC_ALGO_TWO_SHOT, TPC_ERR_INVALID_ARG, "reduce_scatter has no two_shot kernel"},
      {64, 0, 0, TPC_FLOAT32, 9, TPC_ERR_INVALID_ARG,
       "reduce_scatter: unknown algorithm 9 (packet 1, bulk 2, line 3, two_shot 4, quantized_fp8/int8/int4 5-7 or bulk_one_shot 8)"},
      {64, 0, 0, TPC_FLOAT32, 0, TPC_ERR_INVALID_ARG, "reduce_scatter: unknown algorithm 0"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    CHECK_RC(c, tpc_reduce_scatter(c, in + cases[i].in_off, out + cases[i].out_off, cases[i].chunk,
                                   (tpc_dtype)cases[i].dtype, (tpc_algo)cases[i].algo, STREAM_A),
             cases[i].want);
    CHECK_MSG(c, cases[i].needle);
  }
  CHECK_EQ(fake.calls[FK_LAUNCH_REDUCE_SCATTER], 0);
  /* the kernel asked for runs: packet at the packet cap, bulk with the whole input within the cap */
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, 512, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_op_entry, FK_LAUNCH_REDUCE_SCATTER);
  check_args(&w, 1, in, out, 512, 512, TPC_BFLOAT16, TPC_OP_REDUCE_SCATTER, TPC_ALGO_PACKET, NAN_BF16);
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, 528, TPC_FLOAT16, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  check_args(&w, 1, in, out, 528, 528, TPC_FLOAT16, TPC_OP_REDUCE_SCATTER, TPC_ALGO_BULK, NAN_F16);
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, MAX_BYTES / 4, TPC_FLOAT32, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  check_args(&w, 1, in, out, MAX_BYTES / 4, MAX_BYTES / 4, TPC_FLOAT32, TPC_OP_REDUCE_SCATTER, TPC_ALGO_BULK, NAN_F32);
  /* line: the packet cap on one chunk */
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, PACKET_MAX, TPC_FLOAT16, TPC_ALGO_LINE, STREAM_A), TPC_OK);
  check_args(&w, 1, in, out, PACKET_MAX, PACKET_MAX, TPC_FLOAT16, TPC_OP_REDUCE_SCATTER, TPC_ALGO_LINE, NAN_F16);
  CHECK_EQ(fake.calls[FK_LAUNCH_REDUCE_SCATTER], 4);
  /* a failing launch is reported as such */
  fake_fail_nth(FK_LAUNCH_REDUCE_SCATTER, 1, 77);
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching reduce_scatter failed");
  CHECK_RC(NULL, tpc_reduce_scatter(NULL, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_INVALID_ARG);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* reduce_scatter_f32: the checks of reduce_scatter, and kernels told to
 * write fp32 sums over twice a 16-bit chunk's bytes (fp32 NaN on failure). */
void test_reduce_scatter_f32(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[0];
  float *out = (float *)scratch_out;
  CHECK_RC(c, tpc_reduce_scatter_f32(c, scratch_in, out, 40, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A),
           TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "multiple of 16");
  CHECK_RC(c, tpc_reduce_scatter_f32(c, scratch_in, (float *)(scratch_out + 8), 64, TPC_BFLOAT16, TPC_ALGO_PACKET,
                                     STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "16-byte aligned");
  CHECK_RC(c, tpc_reduce_scatter_f32(c, scratch_in, out, MAX_BYTES, TPC_BFLOAT16, TPC_ALGO_BULK, STREAM_A),
           TPC_ERR_TOO_LARGE);
  CHECK_EQ(fake.calls[FK_LAUNCH_REDUCE_SCATTER], 0);
  const tpc_kernel_args *a = &fake.last_args;
  CHECK_RC(c, tpc_reduce_scatter_f32(c, scratch_in, out, 512, TPC_BFLOAT16, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_op_entry, FK_LAUNCH_REDUCE_SCATTER);
  CHECK_EQ(a->out_f32, 1);
  CHECK_EQ(a->nbytes, 512);
  CHECK_EQ(a->out_bytes, 1024);  /* 256 bf16 sums as 256 floats */
  CHECK_EQ(a->poison, NAN_F32);
  CHECK_EQ(a->kind, tpc_kind_word(TPC_OP_REDUCE_SCATTER, TPC_ALGO_BULK, TPC_BFLOAT16, 512)); /* peers see a reduce_scatter */
  CHECK_RC(c, tpc_reduce_scatter_f32(c, scratch_in, out, 256, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(a->out_f32, 1);
  CHECK_EQ(a->out_bytes, 256);   /* fp32 in, fp32 out */
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  /* the plain reduce_scatter after it rounds again */
  CHECK_RC(c, tpc_reduce_scatter(c, scratch_in, out, 256, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(a->out_f32, 0);
  CHECK_EQ(a->poison, NAN_BF16);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* A norm without biases and with residual scale 1 */
static tpc_norm_spec rms_spec(int pattern, const void *weight, const void *next_weight, float eps, float next_eps,
                              float offset) {
  const tpc_norm_spec s = {(tpc_norm_pattern)pattern, weight, NULL, next_weight, NULL, eps, next_eps, offset, 1.0f};
  return s;
}

/* tpc_all_reduce_norm with pattern ADD_NORM, weight offset 0 and no next_weight */
static tpc_result add_norm(tpc_comm *c, const void *in, const void *res, const void *weight, void *normed,
                           void *res_out, size_t nbytes, size_t row_bytes, tpc_dtype dtype, float eps) {
  const tpc_norm_spec s = rms_spec(TPC_PATTERN_ADD_NORM, weight, NULL, eps, 0.0f, 0.0f);
  return tpc_all_reduce_norm(c, &s, in, res, normed, res_out, nbytes, row_bytes, dtype, STREAM_A);
}

void test_all_reduce_norm(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[1];
  unsigned char *in = scratch_in, *res = scratch_in + MAX_BYTES, *weight = scratch_in + 2 * MAX_BYTES;
  unsigned char *next_weight = scratch_in + 3 * MAX_BYTES;
  unsigned char *normed = scratch_out, *res_out = scratch_out + MAX_BYTES;
  static const struct {
    size_t nbytes, row_bytes;
    int dtype;
    size_t misalign; /* added to the weight pointer */
    float eps;
    tpc_result want;
    const char *needle;
  } cases[] = {
      {64, 64, TPC_FLOAT32, 0, 1e-6f, TPC_ERR_INVALID_ARG, "all_reduce_norm: dtype 0 (float32) is not float16 or bfloat16"},
      {64, 24, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG, "a row of 24 bytes: the packet kernel needs a positive multiple of 16 up to 32768"},
      {64, 0, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG, "a row of 0 bytes"},
      {TPC_NORM_MAX_ROW_BYTES + 16, TPC_NORM_MAX_ROW_BYTES + 16, TPC_FLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG,
       "up to 32768"},
      {96, 64, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG, "a row of 64 bytes: the packet kernel needs a positive multiple of 16 up to 32768 dividing 96"},
      {0, 64, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG, "of 0 bytes"},
      {PACKET_MAX + 64, 64, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_TOO_LARGE, "of 1088 bytes is over the packet cap of 1024"},
      {64, 64, TPC_BFLOAT16, 8, 1e-6f, TPC_ERR_INVALID_ARG, "every tensor must be 16-byte aligned"},
      {64, 64, TPC_BFLOAT16, 0, -1.0f, TPC_ERR_INVALID_ARG, "all_reduce_norm: eps -1 is not in [0, 1]"},
      {64, 64, TPC_BFLOAT16, 0, 0.0f / 0.0f, TPC_ERR_INVALID_ARG, "is not in [0, 1]"},
      {64, 64, TPC_BFLOAT16, 0, 1.0f / 0.0f, TPC_ERR_INVALID_ARG, "eps inf is not in [0, 1]"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    CHECK_RC(c, add_norm(c, in, res, weight + cases[i].misalign, normed, res_out, cases[i].nbytes, cases[i].row_bytes,
                         (tpc_dtype)cases[i].dtype, cases[i].eps),
             cases[i].want);
    CHECK_MSG(c, cases[i].needle);
  }
  CHECK_RC(c, add_norm(c, in, NULL, weight, normed, res_out, 64, 64, TPC_BFLOAT16, 1e-6f), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "NULL residual or stream output");
  CHECK_RC(c, tpc_all_reduce_norm(c, NULL, in, res, normed, res_out, 64, 64, TPC_BFLOAT16, STREAM_A),
           TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "all_reduce_norm: NULL norm");
  /* the family's own rules (tpc_norm_check): the pattern, which vectors it takes (aligned), the
   * scalars. Vectors: 0 absent, 1 given, 2 given 8 bytes off. */
  static const struct {
    int pattern, weight, bias, next, next_bias;
    float next_eps, offset, scale;
    const char *needle;
  } rules[] = {
      {6, 1, 0, 0, 0, 0.0f, 0.0f, 1.0f, "all_reduce_norm: unknown pattern 6 (0 to 5: ADD_NORM to LAYER_NORM_ADD_LAYER_NORM)"},
      {-1, 1, 0, 0, 0, 0.0f, 0.0f, 1.0f, "unknown pattern -1"},
      {TPC_PATTERN_ADD_NORM, 1, 0, 1, 0, 0.0f, 0.0f, 1.0f, "all_reduce_norm: pattern ADD_NORM takes no next_weight or next_bias"},
      {TPC_PATTERN_NORM_ADD, 1, 0, 1, 0, 0.0f, 0.0f, 1.0f, "pattern NORM_ADD takes no next_weight or next_bias"},
      {TPC_PATTERN_NORM_ADD_NORM, 1, 0, 0, 0, 0.0f, 0.0f, 1.0f, "all_reduce_norm: pattern NORM_ADD_NORM takes a next_weight"},
      {TPC_PATTERN_NORM_ADD_NORM, 1, 0, 1, 0, 2.0f, 0.0f, 1.0f, "all_reduce_norm: next_eps 2 is not in [0, 1]"},
      {TPC_PATTERN_NORM_ADD_NORM, 1, 0, 1, 0, 0.0f / 0.0f, 0.0f, 1.0f, "nan is not in [0, 1]"},
      {TPC_PATTERN_NORM_ADD_NORM, 1, 0, 2, 0, 1e-6f, 0.0f, 1.0f, "all_reduce_norm: every tensor must be 16-byte aligned"},
      {TPC_PATTERN_NORM_ADD, 1, 0, 0, 0, 0.0f, 0.5f, 1.0f, "all_reduce_norm: weight_offset 0.5 is not 0 or 1"},
      {TPC_PATTERN_ADD_NORM, 1, 0, 0, 0, 0.0f, -1.0f, 1.0f, "weight_offset -1 is not 0 or 1"},
      {TPC_PATTERN_ADD_NORM, 0, 0, 0, 0, 0.0f, 0.0f, 1.0f, "all_reduce_norm: pattern ADD_NORM (an RMSNorm) takes a weight"},
      {TPC_PATTERN_NORM_ADD, 1, 1, 0, 0, 0.0f, 0.0f, 1.0f, "pattern NORM_ADD is an RMSNorm: it takes no bias"},
      {TPC_PATTERN_NORM_ADD_NORM, 1, 0, 1, 1, 0.0f, 0.0f, 1.0f, "pattern NORM_ADD_NORM is an RMSNorm: it takes no bias"},
      {TPC_PATTERN_ADD_LAYER_NORM, 1, 1, 0, 1, 0.0f, 0.0f, 1.0f, "pattern ADD_LAYER_NORM takes no next_weight or next_bias"},
      {TPC_PATTERN_LAYER_NORM_ADD, 0, 0, 1, 0, 0.0f, 0.0f, 1.0f, "pattern LAYER_NORM_ADD takes no next_weight or next_bias"},
      {TPC_PATTERN_ADD_LAYER_NORM, 0, 1, 0, 0, 0.0f, 1.0f, 1.0f, "weight_offset 1 needs every norm's weight"},
      {TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM, 1, 0, 0, 1, 0.0f, 1.0f, 1.0f, "weight_offset 1 needs every norm's weight"},
      {TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM, 0, 0, 0, 0, -1.0f, 0.0f, 1.0f, "next_eps -1 is not in [0, 1]"},
      {TPC_PATTERN_ADD_LAYER_NORM, 0, 2, 0, 0, 0.0f, 0.0f, 1.0f, "every tensor must be 16-byte aligned"},
      {TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM, 1, 1, 1, 2, 0.0f, 0.0f, 1.0f, "every tensor must be 16-byte aligned"},
      {TPC_PATTERN_LAYER_NORM_ADD, 1, 1, 0, 0, 0.0f, 0.0f, 1.0f / 0.0f, "all_reduce_norm: residual_scale inf is not finite"},
      {TPC_PATTERN_ADD_NORM, 1, 0, 0, 0, 0.0f, 0.0f, 0.0f / 0.0f, "residual_scale nan is not finite"},
  };
  /* the biases lie past the weights' rows in their scratch slots */
  unsigned char *bias = weight + MAX_BYTES / 2, *next_bias = next_weight + MAX_BYTES / 2;
  for (size_t i = 0; i < sizeof rules / sizeof rules[0]; ++i) {
#define VEC(given, base) ((given) ? (const void *)((base) + ((given) == 2 ? 8 : 0)) : NULL)
    const tpc_norm_spec s = {(tpc_norm_pattern)rules[i].pattern, VEC(rules[i].weight, weight), VEC(rules[i].bias, bias),
                             VEC(rules[i].next, next_weight), VEC(rules[i].next_bias, next_bias), 1e-6f,
                             rules[i].next_eps, rules[i].offset, rules[i].scale};
#undef VEC
    CHECK_RC(c, tpc_all_reduce_norm(c, &s, in, res, normed, res_out, 64, 64, TPC_BFLOAT16, STREAM_A),
             TPC_ERR_INVALID_ARG);
    CHECK_MSG(c, rules[i].needle);
  }
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_REDUCE_NORM], 0);
  /* 16 rows of 64 bytes (32 bf16 values), the packet cap exactly; in place */
  CHECK_RC(c, add_norm(c, in, res, weight, in, res, PACKET_MAX, 64, TPC_BFLOAT16, 1e-5f), TPC_OK);
  CHECK_EQ(fake.last_op_entry, FK_LAUNCH_ALL_REDUCE_NORM);
  check_args(&w, 1, in, in, PACKET_MAX, 64, TPC_BFLOAT16, TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, NAN_BF16);
  CHECK_PTR(fake.last_args.residual, res);
  CHECK_PTR(fake.last_args.weight, weight);
  CHECK_PTR(fake.last_args.out2, res);
  CHECK_PTR(fake.last_args.next_weight, NULL);
  CHECK(fake.last_args.eps == 1e-5f);
  CHECK_EQ(fake.last_args.pattern, TPC_PATTERN_ADD_NORM);
  /* offset 0 is passed as -0.0f: -0 + w is w, signed zeros included */
  CHECK(fake.last_args.weight_offset == 0.0f && signbit(fake.last_args.weight_offset));
  CHECK_RC(c, add_norm(c, in, res, weight, normed, res_out, 128, 128, TPC_FLOAT16, 0.0f), TPC_OK);
  check_args(&w, 1, in, normed, 128, 128, TPC_FLOAT16, TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, NAN_F16);
  CHECK_PTR(fake.last_args.out2, res_out);
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_REDUCE_NORM], 2);
  /* NORM_ADD with weight 1 + w; next_eps out of range is not its concern */
  tpc_norm_spec s = rms_spec(TPC_PATTERN_NORM_ADD, weight, NULL, 1e-6f, 5.0f, 1.0f);
  CHECK_RC(c, tpc_all_reduce_norm(c, &s, in, res, normed, res_out, 128, 64, TPC_BFLOAT16, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_args.pattern, TPC_PATTERN_NORM_ADD);
  CHECK(fake.last_args.weight_offset == 1.0f);
  CHECK(fake.last_args.next_eps == 0.0f);
  CHECK_PTR(fake.last_args.next_weight, NULL);
  /* the pattern rides in the header's op byte: ranks calling different patterns mismatch */
  CHECK_EQ(fake.last_args.kind, tpc_kind_word(TPC_KIND_NORM_OP(TPC_OP_ALL_REDUCE_NORM, TPC_PATTERN_NORM_ADD),
                                              TPC_ALGO_PACKET, TPC_BFLOAT16, 64));
  s = rms_spec(TPC_PATTERN_NORM_ADD_NORM, weight, next_weight, 1e-6f, 1e-5f, 0.0f);
  s.residual_scale = -0.5f;
  CHECK_RC(c, tpc_all_reduce_norm(c, &s, in, res, in, res, 128, 128, TPC_FLOAT16, STREAM_A), TPC_OK);
  CHECK(fake.last_args.residual_scale == -0.5f);
  CHECK_PTR(fake.last_args.bias, NULL);
  CHECK_EQ(fake.last_args.pattern, TPC_PATTERN_NORM_ADD_NORM);
  CHECK_PTR(fake.last_args.next_weight, next_weight);
  CHECK(fake.last_args.next_eps == 1e-5f);
  CHECK(fake.last_args.eps == 1e-6f);
  CHECK_PTR(fake.last_args.out, in);
  CHECK_PTR(fake.last_args.out2, res);
  CHECK_EQ(TPC_KIND_PATTERN(fake.last_args.kind), TPC_PATTERN_NORM_ADD_NORM);
  CHECK_EQ(TPC_KIND_BASE_OP(fake.last_args.kind), TPC_OP_ALL_REDUCE_NORM);
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_REDUCE_NORM], 4);
  /* the LayerNorm patterns: every vector optional, each passed as given */
  const tpc_norm_spec ln = {TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM, weight, bias, next_weight, next_bias, 1e-5f, 1e-3f,
                            1.0f, 2.0f};
  CHECK_RC(c, tpc_all_reduce_norm(c, &ln, in, res, normed, res_out, 128, 64, TPC_BFLOAT16, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_args.pattern, TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM);
  CHECK_PTR(fake.last_args.weight, weight);
  CHECK_PTR(fake.last_args.bias, bias);
  CHECK_PTR(fake.last_args.next_weight, next_weight);
  CHECK_PTR(fake.last_args.next_bias, next_bias);
  CHECK(fake.last_args.eps == 1e-5f && fake.last_args.next_eps == 1e-3f && fake.last_args.weight_offset == 1.0f);
  CHECK(fake.last_args.residual_scale == 2.0f);
  /* pattern 5 needs the op byte's three pattern bits: it stays apart from every other pattern */
  CHECK_EQ(TPC_KIND_PATTERN(fake.last_args.kind), TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM);
  CHECK_EQ(TPC_KIND_BASE_OP(fake.last_args.kind), TPC_OP_ALL_REDUCE_NORM);
  CHECK_EQ(TPC_KIND_QUANT(fake.last_args.kind), TPC_QUANT_NONE);
  for (int p = 0; p < 6; ++p)
    for (int q = 0; q < 4; ++q) {
      const uint32_t op = TPC_KIND_NORM_QUANT_OP(TPC_OP_ALL_REDUCE_NORM, p, q);
      CHECK(op <= 0xffu && TPC_KIND_PATTERN(op) == (uint32_t)p && TPC_KIND_QUANT(op) == (uint32_t)q &&
            TPC_KIND_BASE_OP(op) == TPC_OP_ALL_REDUCE_NORM);
    }
  const tpc_norm_spec bare = {TPC_PATTERN_LAYER_NORM_ADD, NULL, NULL, NULL, NULL, 1e-5f, 7.0f, 0.0f, 1.0f};
  CHECK_RC(c, tpc_all_reduce_norm(c, &bare, in, res, normed, res_out, 128, 64, TPC_FLOAT16, STREAM_A), TPC_OK);
  CHECK_PTR(fake.last_args.weight, NULL);
  CHECK_PTR(fake.last_args.bias, NULL);
  CHECK(fake.last_args.next_eps == 0.0f); /* not its concern: no second norm */
  CHECK(fake.last_args.residual_scale == 1.0f);
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_REDUCE_NORM], 6);
  /* the other ops leave the norm's fields empty */
  CHECK_RC(c, tpc_all_reduce(c, in, normed, 64, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_PTR(fake.last_args.residual, NULL);
  CHECK_PTR(fake.last_args.out2, NULL);
  CHECK_PTR(fake.last_args.next_weight, NULL);
  CHECK_PTR(fake.last_args.bias, NULL);
  CHECK_PTR(fake.last_args.next_bias, NULL);
  CHECK_EQ(fake.last_args.pattern, 0);
  fake_fail_nth(FK_LAUNCH_ALL_REDUCE_NORM, 1, 78);
  CHECK_RC(c, add_norm(c, in, res, weight, normed, res_out, 64, 64, TPC_BFLOAT16, 1e-6f), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching all_reduce_norm failed");
  CHECK_RC(NULL, add_norm(NULL, in, res, weight, normed, res_out, 64, 64, TPC_BFLOAT16, 1e-6f), TPC_ERR_INVALID_ARG);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

void test_all_reduce_validation(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 0));
  tpc_comm *c = w.comm[0];
  unsigned char *in = scratch_in, *out = scratch_out;

  /* not ready */
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_STATE);
  CHECK_MSG(c, "not ready");
  CHECK_RC(NULL, tpc_all_reduce(NULL, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A),
           TPC_ERR_INVALID_ARG);
  destroy_world(&w);

  CHECK(make_world(&w, 2, 1));
  c = w.comm[0];
  static const struct {
    size_t nbytes;
    size_t in_off, out_off;
    int dtype;
    int algo;
    tpc_result want;
    const char *needle;
  } cases[] = {
      {0, 0, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {24, 0, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "all_reduce of 24 bytes"},
      {72, 0, 0, TPC_FLOAT16, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {64, 4, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      {64, 0, 8, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      {64, 2, 2, TPC_BFLOAT16, TPC_ALGO_BULK_ONE_SHOT, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      {64, 0, 0, 3, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "all_reduce: dtype 3 (no tpc_dtype) is not float32"},
      {64, 0, 0, -1, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "dtype -1"},
      {MAX_BYTES + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_BULK_ONE_SHOT, TPC_ERR_TOO_LARGE, "all_reduce of 4112 bytes is over max_bytes 4096"},
      /* bulk: the one-shot stream at two ranks, the streamed two-shot from three on (limits.c) */
      {64, 0, 0, TPC_FLOAT32, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "all_reduce: the bulk kernel does not run at this world size"},
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "over the packet cap of 1024"},
      /* lines live in the packet slots: the packet cap, 16-byte sizes and pointers */
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_LINE, TPC_ERR_TOO_LARGE, "over the packet cap of 1024"},
      {40, 0, 0, TPC_BFLOAT16, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {64, 8, 0, TPC_BFLOAT16, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      /* two_shot: the line rules, and a warp step of lines (448 bytes) for each of the 2 ranks */
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_TWO_SHOT, TPC_ERR_TOO_LARGE, "over the packet cap of 1024"},
      {40, 0, 0, TPC_BFLOAT16, TPC_ALGO_TWO_SHOT, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {448, 0, 0, TPC_BFLOAT16, TPC_ALGO_TWO_SHOT, TPC_ERR_INVALID_ARG,
       "two_shot all_reduce of 448 bytes: more than 448 bytes (a warp step of lines per rank) are needed"},
      {64, 0, 0, TPC_BFLOAT16, TPC_ALGO_TWO_SHOT, TPC_ERR_INVALID_ARG, "two_shot all_reduce of 64 bytes"},
      /* the caller picks the kernel: 0 (no choice) and unknown values are refused, naming them */
      {64, 0, 0, TPC_FLOAT32, 0, TPC_ERR_INVALID_ARG,
       "all_reduce: unknown algorithm 0 (packet 1, bulk 2, line 3, two_shot 4, quantized_fp8/int8/int4 5-7 or bulk_one_shot 8)"},
      {64, 0, 0, TPC_FLOAT32, 9, TPC_ERR_INVALID_ARG, "all_reduce: unknown algorithm 9"},
      {64, 0, 0, TPC_FLOAT32, -2, TPC_ERR_INVALID_ARG, "all_reduce: unknown algorithm -2"},
      /* the algorithm is checked before the sizes: its message is the one given */
      {24, 0, 0, TPC_FLOAT32, 9, TPC_ERR_INVALID_ARG, "unknown algorithm 9"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    CHECK_RC(c, tpc_all_reduce(c, in + cases[i].in_off, out + cases[i].out_off, cases[i].nbytes,
                               (tpc_dtype)cases[i].dtype, (tpc_algo)cases[i].algo, STREAM_A),
             cases[i].want);
    CHECK_MSG(c, cases[i].needle);
  }
  CHECK_RC(c, tpc_all_reduce(c, NULL, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_RC(c, tpc_all_reduce(c, in, NULL, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_EQ(fake.launches, 0); /* nothing invalid reached a kernel */

  /* the limits themselves are fine; in == out is allowed */
  CHECK_RC(c, tpc_all_reduce(c, in, in, MAX_BYTES, TPC_BFLOAT16, TPC_ALGO_BULK_ONE_SHOT, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK_ONE_SHOT);
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX, TPC_FLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in + 16, out + 48, 16, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in, in, PACKET_MAX, TPC_BFLOAT16, TPC_ALGO_LINE, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_LINE);
  CHECK_EQ(fake.last_args.kind, tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_LINE, TPC_BFLOAT16, PACKET_MAX));
  CHECK_RC(c, tpc_all_reduce(c, in, in, 464, TPC_BFLOAT16, TPC_ALGO_TWO_SHOT, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_TWO_SHOT);
  CHECK_EQ(fake.last_args.kind, tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_TWO_SHOT, TPC_BFLOAT16, 464));
  CHECK_EQ(fake.launches, 5);
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_GATHER], 0);

  /* a launch the runtime refuses */
  fake_fail_nth(FK_LAUNCH_ALL_REDUCE, 1, 98);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching all_reduce failed: fake error 98");
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

void test_all_reduce_algo_and_args(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 4, 1));
  const int r = 2;
  tpc_comm *c = w.comm[r];
  unsigned char *in = scratch_in, *out = scratch_out;

  /* the kernel asked for runs, whatever the size (within its cap) */
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 16, TPC_FLOAT32, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, MAX_BYTES, TPC_FLOAT32, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  /* the one-shot stream runs at two ranks only; no other op has it */
  CHECK_RC(c, tpc_all_reduce(c, in, out, 16, TPC_FLOAT32, TPC_ALGO_BULK_ONE_SHOT, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "all_reduce: the bulk_one_shot kernel does not run at this world size");
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, 16, TPC_FLOAT32, TPC_ALGO_BULK_ONE_SHOT, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "reduce_scatter has no bulk_one_shot kernel");
  CHECK_RC(c, tpc_all_reduce(c, in, out, 512, TPC_FLOAT32, TPC_ALGO_LINE, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_LINE);
  /* two_shot needs more than 448 bytes for each of 3 peers: the packet cap of 1024 is too small at 4 ranks */
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX, TPC_FLOAT32, TPC_ALGO_TWO_SHOT, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "two_shot all_reduce of 1024 bytes: more than 1344 bytes");
  /* past the packet cap the packet kernel is refused, never switched to bulk */
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX + 16, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A),
           TPC_ERR_TOO_LARGE);
  CHECK_EQ(fake.last_algo, TPC_ALGO_LINE);

  /* what the kernel is given */
  const int launches = fake.launches;
  CHECK_RC(c, tpc_all_reduce(c, in + 32, out + 64, 96, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launches, launches + 1);
  CHECK_EQ(fake.last_op_entry, FK_LAUNCH_ALL_REDUCE);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  CHECK_PTR(fake.last_stream, STREAM_A);
  check_args(&w, r, in + 32, out + 64, 96, 96, TPC_BFLOAT16, TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, NAN_BF16);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 2048, TPC_FLOAT32, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  check_args(&w, r, in, out, 2048, 2048, TPC_FLOAT32, TPC_OP_ALL_REDUCE, TPC_ALGO_BULK, NAN_F32);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 48, TPC_FLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  check_args(&w, r, in, out, 48, 48, TPC_FLOAT16, TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, NAN_F16);

  /* every rank gets the same table of buffers, and its own rank */
  for (int q = 0; q < 4; ++q) {
    CHECK_RC(w.comm[q], tpc_all_reduce(w.comm[q], in, out, 4096, TPC_FLOAT16, TPC_ALGO_BULK, STREAM_B), TPC_OK);
    CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
    check_args(&w, q, in, out, 4096, 4096, TPC_FLOAT16, TPC_OP_ALL_REDUCE, TPC_ALGO_BULK, NAN_F16);
  }
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

void test_all_gather(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 0));
  tpc_comm *c = w.comm[1];
  unsigned char *in = scratch_in, *out = scratch_out;
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_ERR_STATE);
  destroy_world(&w);

  CHECK(make_world(&w, 2, 1));
  c = w.comm[1];
  static const struct {
    size_t nbytes, row;
    size_t in_off, out_off;
    int algo;
    tpc_result want;
    const char *needle;
  } cases[] = {
      {0, 4, 0, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "all_gather of 0 bytes"},
      {6, 6, 0, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "multiple of 4"},
      {64, 0, 0, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "row of 0 bytes"},
      {64, 6, 0, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "row of 6 bytes"},
      {48, 32, 0, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "dividing 48"},
      {64, 128, 0, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "dividing 64"},
      /* every kernel takes 16-byte aligned pointers only, packet too: which
       * variant runs must not depend on a pointer */
      {64, 64, 2, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      {64, 64, 0, 2, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      {64, 64, 8, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      {120, 12, 4, 8, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      /* bulk needs 16-byte sizes, rows and pointers */
      {20, 20, 0, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "all_gather of 20 bytes: a positive multiple of 16 is needed (bulk kernel)"},
      {64, 8, 0, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "all_gather: a row of 8 bytes: the bulk kernel needs a positive multiple of 16 dividing 64"},
      {64, 64, 4, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      {64, 64, 0, 8, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      /* caps: bulk on the output (world * nbytes), packet on the input */
      {MAX_BYTES / 2 + 16, 16, 0, 0, TPC_ALGO_BULK, TPC_ERR_TOO_LARGE, "output of 2 x 2064 bytes is over max_bytes 4096"},
      {PACKET_MAX + 4, 4, 0, 0, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "1028 bytes per rank is over the packet cap of 1024"},
      {PACKET_MAX + 8, 8, 0, 0, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "over the packet cap"},
      /* line: 16-byte sizes, rows and pointers, up to the packet cap */
      {20, 20, 0, 0, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "all_gather of 20 bytes: a positive multiple of 16 is needed (line kernel)"},
      {64, 8, 0, 0, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "all_gather: a row of 8 bytes: the line kernel needs a positive multiple of 16 dividing 64"},
      {64, 64, 0, 8, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      {PACKET_MAX + 16, 16, 0, 0, TPC_ALGO_LINE, TPC_ERR_TOO_LARGE, "1040 bytes per rank is over the packet cap of 1024"},
      {64, 64, 0, 0, TPC_ALGO_TWO_SHOT, TPC_ERR_INVALID_ARG, "all_gather has no two_shot kernel"},
      {64, 64, 0, 0, 9, TPC_ERR_INVALID_ARG,
       "all_gather: unknown algorithm 9 (packet 1, bulk 2, line 3, two_shot 4, quantized_fp8/int8/int4 5-7 or bulk_one_shot 8)"},
      {64, 64, 0, 0, 0, TPC_ERR_INVALID_ARG, "all_gather: unknown algorithm 0"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    CHECK_RC(c, tpc_all_gather(c, in + cases[i].in_off, out + cases[i].out_off, cases[i].nbytes,
                               cases[i].row, (tpc_algo)cases[i].algo, 0, STREAM_A),
             cases[i].want);
    CHECK_MSG(c, cases[i].needle);
  }
  CHECK_RC(c, tpc_all_gather(c, NULL, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_EQ(fake.launches, 0);

  /* the kernel asked for runs: the core never switches one for another */
  struct {
    size_t nbytes, row;
    int algo;
  } chosen[] = {
      {64, 64, TPC_ALGO_PACKET},       {80, 80, TPC_ALGO_BULK},   {80, 16, TPC_ALGO_BULK},
      {MAX_BYTES / 2, MAX_BYTES / 2, TPC_ALGO_BULK}, /* output exactly max_bytes */
      {128, 8, TPC_ALGO_PACKET},       {132, 132, TPC_ALGO_PACKET}, {PACKET_MAX, 4, TPC_ALGO_PACKET},
      {PACKET_MAX, 16, TPC_ALGO_LINE}, {16, 16, TPC_ALGO_BULK},
  };
  for (size_t i = 0; i < sizeof chosen / sizeof chosen[0]; ++i) {
    const int before = fake.launches;
    CHECK_RC(c, tpc_all_gather(c, in, out, chosen[i].nbytes, chosen[i].row, (tpc_algo)chosen[i].algo, 0, STREAM_A),
             TPC_OK);
    CHECK_EQ(fake.launches, before + 1);
    CHECK_EQ(fake.last_op_entry, FK_LAUNCH_ALL_GATHER);
    CHECK_EQ(fake.last_algo, chosen[i].algo);
    CHECK_EQ(fake.last_args.nbytes, chosen[i].nbytes);
    CHECK_EQ(fake.last_args.row_bytes, chosen[i].row);
  }
  CHECK_EQ(fake.last_args.kind, tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_BULK, 0, 16));

  /* arguments */
  CHECK_RC(c, tpc_all_gather(c, in + 16, out + 32, 120, 12, TPC_ALGO_PACKET, 0, STREAM_C), TPC_OK);
  CHECK_PTR(fake.last_stream, STREAM_C);
  check_args(&w, 1, in + 16, out + 32, 120, 12, 0, TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0);
  CHECK_RC(c, tpc_all_gather(c, in, out, 2048, 2048, TPC_ALGO_BULK, 0, STREAM_C), TPC_OK);
  check_args(&w, 1, in, out, 2048, 2048, 0, TPC_OP_ALL_GATHER, TPC_ALGO_BULK, 0);
  /* the caller's NaN pattern is passed through as given (all_gather has no dtype) */
  CHECK_RC(c, tpc_all_gather(c, in, out, 2048, 512, TPC_ALGO_BULK, NAN_BF16, STREAM_C), TPC_OK);
  check_args(&w, 1, in, out, 2048, 512, 0, TPC_OP_ALL_GATHER, TPC_ALGO_BULK, NAN_BF16);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 16, TPC_ALGO_PACKET, NAN_F16, STREAM_C), TPC_OK);
  check_args(&w, 1, in, out, 64, 16, 0, TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, NAN_F16);
  /* the row length is folded into the kind word: another row, another kind */
  const uint32_t kind_row16 = fake.last_args.kind;
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 32, TPC_ALGO_PACKET, 0, STREAM_C), TPC_OK);
  CHECK(fake.last_args.kind != kind_row16);

  fake_fail_nth(FK_LAUNCH_ALL_GATHER, 1, 97);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_C), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching all_gather failed: fake error 97");
  destroy_world(&w);
  CHECK_ALL_RELEASED();

  /* world 8: 1024 bytes per rank is within the packet cap but its 8192-byte
   * output is over max_bytes: packet runs, bulk is too large */
  CHECK(make_world(&w, 8, 1));
  c = w.comm[5];
  CHECK_RC(c, tpc_all_gather(c, in, out, 512, 512, TPC_ALGO_BULK, 0, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK); /* 4096 bytes out: fits */
  CHECK_RC(c, tpc_all_gather(c, in, out, 1024, 1024, TPC_ALGO_PACKET, 0, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  check_args(&w, 5, in, out, 1024, 1024, 0, TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0);
  CHECK_RC(c, tpc_all_gather(c, in, out, 1024, 1024, TPC_ALGO_BULK, 0, STREAM_A), TPC_ERR_TOO_LARGE);
  CHECK_MSG(c, "output of 8 x 1024 bytes");
  /* sizes whose product with the world size overflows are refused, not wrapped */
  const size_t huge = (SIZE_MAX / 4 + 1) & ~(size_t)15; /* times 8 wraps to 0 */
  CHECK_RC(c, tpc_all_gather(c, in, out, huge, 16, TPC_ALGO_BULK, 0, STREAM_A), TPC_ERR_TOO_LARGE);
  CHECK_RC(c, tpc_all_gather(c, in, out, huge, 16, TPC_ALGO_PACKET, 0, STREAM_A), TPC_ERR_TOO_LARGE);
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, huge, TPC_FLOAT32, TPC_ALGO_BULK, STREAM_A), TPC_ERR_TOO_LARGE);
  CHECK_MSG(c, "reduce_scatter of 8 x ");
  CHECK_RC(c, tpc_reduce_scatter(c, in, out, huge, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_TOO_LARGE);
  CHECK_EQ(fake.last_args.nbytes, 1024); /* nothing launched since the packet all_gather above */
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

void test_stream_switch(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[0];
  unsigned char *in = scratch_in, *out = scratch_out;

  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 0); /* same stream: nothing to wait for */

  /* a new stream: the previous stream's op must finish first */
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_B), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 1);
  CHECK_PTR(fake.last_synced_stream, STREAM_A);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_B), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 1);
  /* the same stream again: no capture query (a driver call per op) */
  const int queries = fake.calls[FK_STREAM_IS_CAPTURING];
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_B), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_IS_CAPTURING], queries);

  /* while capturing: no synchronisation (illegal during capture), and the
   * captured stream does not become the eager one */
  fake.capturing = 1;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_C), TPC_OK);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 1);
  fake.capturing = 0;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_B), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 1); /* B was the last eager stream */
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_C), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 2);
  CHECK_PTR(fake.last_synced_stream, STREAM_B);

  /* failures of the stream queries are reported and nothing is launched */
  int launches = fake.launches;
  fake_fail_nth(FK_STREAM_SYNCHRONIZE, 1, 81);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "waiting for the previous stream failed: fake error 81");
  fake_fail_nth(FK_STREAM_IS_CAPTURING, 1, 82);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "capture state failed: fake error 82");
  CHECK_EQ(fake.launches, launches);
  destroy_world(&w);
  CHECK_ALL_RELEASED();

  /* torch's default stream is the NULL stream, and its side streams are
   * created non-blocking: an op on the default stream followed by one on a
   * side stream must wait for the default stream too. */
  fake_reset();
  CHECK(make_world(&w, 2, 1));
  c = w.comm[0];
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, NULL), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  /* the NULL stream is synchronised too: "no previous op" is have_last_stream,
   * not last_stream == NULL */
  CHECK(fake.calls[FK_STREAM_SYNCHRONIZE] == 1 && fake.last_synced_stream == NULL);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, NULL), TPC_OK);
  CHECK_PTR(fake.last_synced_stream, STREAM_A); /* the other direction works */
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* Ops launch on the communicator's device, whatever the caller's current
 * device is, and leave the caller's current device as it was. */
void test_launch_device(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1)); /* devices 0 and 1 */
  unsigned char *in = scratch_in, *out = scratch_out;
  tpc_comm *c = w.comm[1];

  fake.current_device = 6;
  int set_calls = fake.calls[FK_SET_DEVICE];
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launch_device, 1);
  CHECK_EQ(fake.current_device, 6);
  CHECK_EQ(fake.calls[FK_SET_DEVICE] - set_calls, 2);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launch_device, 1);
  CHECK_EQ(fake.current_device, 6);

  /* already on the right device: no switching */
  fake.current_device = 1;
  set_calls = fake.calls[FK_SET_DEVICE];
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launch_device, 1);
  CHECK_EQ(fake.calls[FK_SET_DEVICE], set_calls);

  /* the other rank's communicator goes to its own device */
  CHECK_RC(w.comm[0], tpc_all_reduce(w.comm[0], in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_B), TPC_OK);
  CHECK_EQ(fake.launch_device, 0);
  CHECK_EQ(fake.current_device, 1);

  /* failures: nothing launched, the caller's device kept */
  fake.current_device = 4;
  int launches = fake.launches;
  fake_fail_nth(FK_GET_DEVICE, 1, 61);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "fake error 61");
  fake_fail_nth(FK_SET_DEVICE, 1, 62);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "fake error 62");
  CHECK_EQ(fake.launches, launches);
  CHECK_EQ(fake.current_device, 4);
  /* a failed launch still puts the caller's device back */
  fake_fail_nth(FK_LAUNCH_ALL_REDUCE, 1, 63);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching all_reduce failed: fake error 63");
  CHECK_EQ(fake.current_device, 4);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* tpc_id_all_reduce: acquire, the op, release, with every failure's message
 * in the thread's slot. */
void test_id_all_reduce(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  unsigned char *in = scratch_in, *out = scratch_out;
  const uint64_t id = w.comm_id[0];

  /* an open id: one launch, with that communicator's arguments, and released */
  int launches = fake.launches;
  CHECK_RC(NULL, tpc_id_all_reduce(id, in, out, 64, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launches, launches + 1);
  CHECK_EQ(fake.last_args.comm_id, (uint32_t)id);
  CHECK_EQ(fake.last_args.rank, 0);
  CHECK_EQ(fake.last_args.nbytes, 64);
  CHECK_EQ(entry_of(id)->in_use, 0);

  /* the op refuses: its message moves to the thread's slot, the id is released */
  launches = fake.launches;
  CHECK_RC(NULL, tpc_id_all_reduce(id, in, out, 40, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A),
           TPC_ERR_INVALID_ARG);
  CHECK_MSG(NULL, "all_reduce of 40 bytes: a positive multiple of 16 is needed");
  CHECK_EQ(fake.launches, launches);
  CHECK_EQ(entry_of(id)->in_use, 0);

  /* held by another op: refused without touching it */
  tpc_comm *got = NULL;
  CHECK_RC(NULL, tpc_comm_acquire(id, &got), TPC_OK);
  CHECK_RC(NULL, tpc_id_all_reduce(id, in, out, 64, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_STATE);
  CHECK_MSG(NULL, "running an op (from another thread?)");
  CHECK_EQ(entry_of(id)->in_use, 1);
  CHECK_EQ(fake.launches, launches);
  tpc_comm_release(got);

  /* closed and unknown ids */
  destroy_world(&w);
  CHECK_RC(NULL, tpc_id_all_reduce(id, in, out, 64, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_CLOSED);
  CHECK_MSG(NULL, "closed");
  CHECK_RC(NULL, tpc_id_all_reduce(0, in, out, 64, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_CLOSED);
  CHECK_MSG(NULL, "id 0 is unknown");
  CHECK_EQ(fake.launches, launches);
  CHECK_ALL_RELEASED();
}

/* The kernel arguments name the control slot and its id; a slot that is dead
 * (after close) no longer matches them. */
void test_args_control(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  unsigned char *in = scratch_in, *out = scratch_out;
  for (int r = 0; r < 2; ++r) {
    CHECK_RC(w.comm[r], tpc_all_reduce(w.comm[r], in, out, 32, TPC_FLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
    check_args(&w, r, in, out, 32, 32, TPC_FLOAT16, TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, NAN_F16);
    CHECK_RC(w.comm[r], tpc_all_gather(w.comm[r], in, out, 256, 64, TPC_ALGO_BULK, NAN_F32, STREAM_A), TPC_OK);
    check_args(&w, r, in, out, 256, 64, 0, TPC_OP_ALL_GATHER, TPC_ALGO_BULK, NAN_F32);
  }
  CHECK(w.control[0] != w.control[1]);
  CHECK(w.err_device[0] != w.err_device[1]);
  const tpc_kernel_args saved = fake.last_args; /* rank 1's, as a captured graph keeps them */
  destroy_world(&w);
  CHECK_EQ(saved.control->alive, 0);
  CHECK(saved.control->alive != saved.comm_id);
  CHECK_ALL_RELEASED();
}
