/*
 * The fused norm's FP8 epilogue (tpc_all_reduce_norm_quant): what the core
 * refuses and why, and the arguments the kernel gets.
 */
#include <math.h>

#include "harness.h"

#define ROW 256 /* bytes: 128 bf16 values, one TPC_FP8_GROUP */

static tpc_result quant_call(tpc_comm *c, int quant, const void *in, void *normed, void *codes, float *scales,
                             size_t row_stride, size_t group_stride, float floor_, size_t nbytes, size_t row_bytes) {
  unsigned char *res = scratch_in + MAX_BYTES, *weight = scratch_in + 2 * MAX_BYTES;
  unsigned char *res_out = scratch_out + MAX_BYTES;
  const tpc_norm_spec s = {TPC_PATTERN_ADD_NORM, weight, NULL, NULL, NULL, 1e-6f, 0.0f, 0.0f, 1.0f};
  return tpc_all_reduce_norm_quant(c, &s, (tpc_norm_quant)quant, in, res, normed, res_out, codes, scales, row_stride,
                                   group_stride, floor_, nbytes, row_bytes, TPC_BFLOAT16, STREAM_A);
}

void test_all_reduce_norm_quant(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[1];
  unsigned char *in = scratch_in, *normed = scratch_out;
  unsigned char *codes = scratch_out + 2 * MAX_BYTES;
  float *scales = (float *)(scratch_out + 3 * MAX_BYTES);
  const float floor_ = 1.0f / (448.0f * 512.0f);
  static const struct {
    int quant;
    size_t row_stride, group_stride;
    float floor_;
    size_t nbytes, row_bytes, codes_off, scales_off;
    const char *needle;
  } rules[] = {
      {4, 1, 1, 1e-6f, 512, ROW, 0, 0,
       "all_reduce_norm: unknown quant 4 (NONE 0, PER_TENSOR 1, PER_TOKEN 2 or PER_TOKEN_GROUP 3)"},
      {-1, 1, 1, 1e-6f, 512, ROW, 0, 0, "unknown quant -1"},
      /* 96 values a row: no whole group */
      {TPC_QUANT_PER_TOKEN_GROUP, 1, 1, 1e-6f, 384, 192, 0, 0,
       "all_reduce_norm: PER_TOKEN_GROUP needs rows of a multiple of 128 values, not 96"},
      {TPC_QUANT_PER_TOKEN, 0, 1, 1e-6f, 512, ROW, 0, 0, "all_reduce_norm: PER_TOKEN scales need nonzero strides (0, 1)"},
      {TPC_QUANT_PER_TOKEN_GROUP, 1, 0, 1e-6f, 512, ROW, 0, 0, "PER_TOKEN_GROUP scales need nonzero strides (1, 0)"},
      {TPC_QUANT_PER_TOKEN, 1, 1, 0.0f, 512, ROW, 0, 0, "all_reduce_norm: scale_floor 0 is not finite and > 0"},
      {TPC_QUANT_PER_TOKEN, 1, 1, -1.0f, 512, ROW, 0, 0, "scale_floor -1 is not finite and > 0"},
      {TPC_QUANT_PER_TOKEN_GROUP, 1, 1, 0.0f / 0.0f, 512, ROW, 0, 0, "is not finite and > 0"},
      {TPC_QUANT_PER_TOKEN, 1, 1, 1.0f / 0.0f, 512, ROW, 0, 0, "scale_floor inf is not finite and > 0"},
      {TPC_QUANT_PER_TOKEN, 1, 1, 1e-6f, 512, ROW, 0, 2, "all_reduce_norm: scales"},
      {TPC_QUANT_PER_TOKEN, 1, 1, 1e-6f, 512, ROW, 8, 0, "all_reduce_norm: every tensor must be 16-byte aligned"},
      /* the codes over the 16-bit normed output; the scales over the codes */
      {TPC_QUANT_PER_TOKEN, 1, 1, 1e-6f, 512, ROW, (size_t)-1, 0, "the codes or scales overlap another argument"},
      {TPC_QUANT_PER_TOKEN, 1, 1, 1e-6f, 512, ROW, 0, (size_t)-1, "the codes and the scales overlap"},
  };
  for (size_t i = 0; i < sizeof rules / sizeof rules[0]; ++i) {
    void *cp = rules[i].codes_off == (size_t)-1 ? (void *)(normed + 64) : (void *)(codes + rules[i].codes_off);
    float *sp = rules[i].scales_off == (size_t)-1 ? (float *)(codes + 16)
                                                  : (float *)((unsigned char *)scales + rules[i].scales_off);
    CHECK_RC(c, quant_call(c, rules[i].quant, in, normed, cp, sp, rules[i].row_stride, rules[i].group_stride,
                           rules[i].floor_, rules[i].nbytes, rules[i].row_bytes),
             TPC_ERR_INVALID_ARG);
    CHECK_MSG(c, rules[i].needle);
  }
  CHECK_RC(c, quant_call(c, TPC_QUANT_PER_TOKEN, in, normed, codes, NULL, 1, 1, floor_, 512, ROW), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "all_reduce_norm: NULL scales");
  CHECK_RC(c, quant_call(c, TPC_QUANT_PER_TOKEN, in, normed, NULL, scales, 1, 1, floor_, 512, ROW),
           TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "NULL input or output");
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_REDUCE_NORM], 0);
  /* the rules of the fused norm still hold */
  CHECK_RC(c, quant_call(c, TPC_QUANT_PER_TOKEN, in, normed, codes, scales, 1, 1, floor_, 512, 24),
           TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "a row of 24 bytes");

  /* PER_TOKEN_GROUP, column-major scales of 2 rows x 2 groups (leading dimension 4), no 16-bit normed output */
  CHECK_RC(c, quant_call(c, TPC_QUANT_PER_TOKEN_GROUP, in, NULL, codes, scales, 1, 4, floor_, 1024, 512), TPC_OK);
  CHECK_EQ(fake.last_op_entry, FK_LAUNCH_ALL_REDUCE_NORM);
  const tpc_kernel_args *a = &fake.last_args;
  CHECK_PTR(a->out, codes);
  CHECK_PTR(a->out3, NULL);
  CHECK_PTR(a->scales, scales);
  CHECK_EQ(a->quant, TPC_QUANT_PER_TOKEN_GROUP);
  CHECK_EQ(a->scale_row_stride, 1);
  CHECK_EQ(a->scale_group_stride, 4);
  CHECK(a->scale_floor == floor_);
  /* the codes are one byte a value, poisoned with e4m3's NaN; the 16-bit outputs with the dtype's */
  CHECK_EQ(a->out_bytes, 512);
  CHECK_EQ(a->poison, 0x7f7f7f7f7f7f7f7full);
  CHECK_EQ(a->poison_out, 1);
  CHECK_EQ(a->poison2, NAN_BF16);
  CHECK_EQ(a->pattern, TPC_PATTERN_ADD_NORM);
  /* the epilogue rides in the header's op byte: ranks quantizing differently mismatch */
  CHECK_EQ(a->kind, tpc_kind_word(TPC_KIND_NORM_QUANT_OP(TPC_OP_ALL_REDUCE_NORM, TPC_PATTERN_ADD_NORM,
                                                         TPC_QUANT_PER_TOKEN_GROUP),
                                  TPC_ALGO_PACKET, TPC_BFLOAT16, 512));
  CHECK_EQ(TPC_KIND_BASE_OP(a->kind), TPC_OP_ALL_REDUCE_NORM);
  CHECK_EQ(TPC_KIND_PATTERN(a->kind), TPC_PATTERN_ADD_NORM);
  CHECK_EQ(TPC_KIND_QUANT(a->kind), TPC_QUANT_PER_TOKEN_GROUP);

  /* PER_TENSOR reads its scale: no strides, no floor; NORM_ADD_NORM with the normed output too */
  unsigned char *res = scratch_in + MAX_BYTES, *weight = scratch_in + 2 * MAX_BYTES;
  unsigned char *next_weight = scratch_in + 3 * MAX_BYTES, *res_out = scratch_out + MAX_BYTES;
  const tpc_norm_spec sandwich = {TPC_PATTERN_NORM_ADD_NORM, weight, NULL, next_weight, NULL, 1e-6f, 1e-5f, 1.0f, 1.0f};
  CHECK_RC(c, tpc_all_reduce_norm_quant(c, &sandwich, TPC_QUANT_PER_TENSOR, in, res, normed, res_out, codes,
                                        scales + 1, 0, 0, 0.0f, 512, ROW, TPC_FLOAT16, STREAM_A),
           TPC_OK);
  CHECK_PTR(a->out3, normed);
  CHECK_PTR(a->scales, scales + 1); /* 4-byte alignment is enough for the scales */
  CHECK_EQ(a->quant, TPC_QUANT_PER_TENSOR);
  CHECK_EQ(a->scale_group_stride, 0);
  CHECK(a->scale_floor == 0.0f);
  CHECK_EQ(a->poison2, 0x7e007e007e007e00ull);
  CHECK_EQ(TPC_KIND_PATTERN(a->kind), TPC_PATTERN_NORM_ADD_NORM);
  CHECK_EQ(TPC_KIND_QUANT(a->kind), TPC_QUANT_PER_TENSOR);
  CHECK(a->weight_offset == 1.0f);
  /* PER_TOKEN: its group stride is not read, and left 0 */
  CHECK_RC(c, quant_call(c, TPC_QUANT_PER_TOKEN, in, normed, codes, scales, 1, 7, floor_, 512, ROW), TPC_OK);
  CHECK_EQ(a->scale_group_stride, 0);
  /* a LayerNorm's epilogue; its bias must not lie under the codes either */
  unsigned char *bias = weight + MAX_BYTES / 2; /* past the weight's row, in its slot */
  const tpc_norm_spec ln = {TPC_PATTERN_LAYER_NORM_ADD, NULL, bias, NULL, NULL, 1e-6f, 0.0f, 0.0f, 0.25f};
  CHECK_RC(c, tpc_all_reduce_norm_quant(c, &ln, TPC_QUANT_PER_TOKEN, in, res, NULL, res_out, codes, scales, 1, 1,
                                        floor_, 512, ROW, TPC_BFLOAT16, STREAM_A),
           TPC_OK);
  CHECK_PTR(a->bias, bias);
  CHECK(a->residual_scale == 0.25f);
  CHECK_EQ(TPC_KIND_PATTERN(a->kind), TPC_PATTERN_LAYER_NORM_ADD);
  CHECK_EQ(TPC_KIND_QUANT(a->kind), TPC_QUANT_PER_TOKEN);
  const tpc_norm_spec under = {TPC_PATTERN_LAYER_NORM_ADD, NULL, codes + 16, NULL, NULL, 1e-6f, 0.0f, 0.0f, 1.0f};
  CHECK_RC(c, tpc_all_reduce_norm_quant(c, &under, TPC_QUANT_PER_TOKEN, in, res, NULL, res_out, codes, scales, 1, 1,
                                        floor_, 512, ROW, TPC_BFLOAT16, STREAM_A),
           TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "the codes or scales overlap another argument");
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_REDUCE_NORM], 4);
  /* NONE through the new call is tpc_all_reduce_norm: the epilogue's fields stay empty */
  CHECK_RC(c, quant_call(c, TPC_QUANT_NONE, in, normed, codes, scales, 1, 1, floor_, 512, ROW), TPC_OK);
  CHECK_EQ(a->quant, 0);
  CHECK_PTR(a->out, normed);
  CHECK_PTR(a->scales, NULL);
  CHECK_EQ(a->poison2, 0);
  CHECK_EQ(a->kind, tpc_kind_word(TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, TPC_BFLOAT16, ROW));
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* The epilogue's rules alone: ROCm refuses it, NONE needs nothing. */
void test_norm_quant_check(void) {
  char why[256];
  CHECK_EQ(tpc_norm_quant_check(TPC_QUANT_PER_TOKEN, 128, 1, 0, 1e-6f, 1, why, sizeof why), TPC_ERR_INVALID_ARG);
  CHECK(strstr(why, "the FP8 epilogue (PER_TOKEN) is built for CUDA only") != NULL);
  CHECK_EQ(tpc_norm_quant_check(TPC_QUANT_NONE, 96, 0, 0, 0.0f, 1, why, sizeof why), TPC_OK);
  CHECK_EQ(tpc_norm_quant_check(TPC_QUANT_PER_TENSOR, 96, 0, 0, 0.0f, 0, why, sizeof why), TPC_OK);
  CHECK_EQ(tpc_norm_quant_check(TPC_QUANT_PER_TOKEN_GROUP, 256, 2, 1, 3.4028234663852886e38f, 0, why, sizeof why),
           TPC_OK);
}
