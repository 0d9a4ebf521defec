/*
 * Errors: result strings, the device's error record, and the messages
 * describe() builds from it.
 */
#include "harness.h"

void test_result_strings(void) {
  const char *seen[9];
  for (int code = 0; code <= TPC_ERR_CLOSED; ++code) {
    const char *s = tpc_result_string((tpc_result)code);
    CHECK(s != NULL && s[0] != '\0');
    for (int j = 0; j < code; ++j) CHECK(s && strcmp(s, seen[j]) != 0);
    seen[code] = s;
  }
  CHECK(strstr(tpc_result_string((tpc_result)99), "unknown") != NULL);
  CHECK(strstr(tpc_result_string(TPC_ERR_TIMEOUT), "time") != NULL);
  CHECK_EQ(TPC_ERR_CLOSED, 8);
  CHECK(strstr(tpc_result_string(TPC_ERR_CLOSED), "closed") != NULL);
}

void test_async_error(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[0];
  unsigned char *in = scratch_in, *out = scratch_out;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);

  /* the device records a timeout waiting for peer 1 */
  volatile tpc_async_error *rec = w.err_host[0];
  rec->peer = 1;
  rec->epoch = 7;
  rec->reported = 0;
  rec->code = TPC_ERR_TIMEOUT;
  tpc_async_error e;
  memset(&e, 0, sizeof e);
  CHECK_RC(c, tpc_comm_async_error(c, &e), TPC_ERR_TIMEOUT);
  CHECK_EQ(e.code, TPC_ERR_TIMEOUT);
  CHECK_EQ(e.peer, 1);
  CHECK_EQ(e.epoch, 7);
  CHECK_EQ(e.reported, 0);
  CHECK_MSG(c, "peer 1");
  CHECK_MSG(c, "rank 0");
  CHECK_MSG(c, "2.000 s");
  CHECK_MSG(c, "op #7");
  CHECK_RC(c, tpc_comm_async_error(c, NULL), TPC_ERR_TIMEOUT);

  /* the communicator refuses further work, without launching */
  const int launches = fake.launches;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_TIMEOUT);
  CHECK_MSG(c, "peer 1");
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_ERR_TIMEOUT);
  CHECK_EQ(fake.launches, launches);
  /* and keeps refusing even if the record is cleared: the failure is sticky */
  rec->code = TPC_OK;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_STATE);
  CHECK_MSG(c, "failed earlier");
  CHECK_EQ(fake.launches, launches);

  /* the other rank is unaffected */
  CHECK_RC(w.comm[1], tpc_all_reduce(w.comm[1], in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_RC(w.comm[1], tpc_comm_async_error(w.comm[1], &e), TPC_OK);
  CHECK_EQ(e.code, TPC_OK);

  /* a mismatch names the peer and the size it sent */
  rec = w.err_host[1];
  rec->peer = 0;
  rec->epoch = 3;
  rec->peer_bytes = 96;
  rec->own_bytes = 64;
  rec->peer_kind = tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0, 96);
  rec->own_kind = tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0, 64);
  rec->code = TPC_ERR_MISMATCH;
  CHECK_RC(w.comm[1], tpc_all_gather(w.comm[1], in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_ERR_MISMATCH);
  CHECK_MSG(w.comm[1], "peer 0");
  CHECK_MSG(w.comm[1], "96 bytes");
  CHECK_MSG(w.comm[1], "op #3");
  CHECK_MSG(w.comm[1], "the size differs");
  CHECK_RC(w.comm[1], tpc_comm_async_error(w.comm[1], &e), TPC_ERR_MISMATCH);
  CHECK_EQ(e.peer_bytes, 96);
  CHECK_EQ(e.own_bytes, 64);
  CHECK_EQ(e.peer_kind, tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0, 96));
  CHECK_EQ(e.own_kind, tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0, 64));
  CHECK_RC(NULL, tpc_comm_async_error(NULL, &e), TPC_ERR_INVALID_ARG);
  destroy_world(&w);
  CHECK_ALL_RELEASED();

  /* any other device code is passed through */
  CHECK(make_world(&w, 2, 1));
  rec = w.err_host[1];
  rec->peer = 0;
  rec->code = TPC_ERR_PEER;
  CHECK_RC(w.comm[1], tpc_comm_async_error(w.comm[1], &e), TPC_ERR_PEER);
  CHECK_MSG(w.comm[1], "device error 3 involving peer 0");
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* describe(): the message of every kind of device record, read through the
 * communicator (tpc_comm_async_error) and through its id (tpc_id_async_error,
 * message in tpc_comm_last_error(NULL)). */
static void fill_record(volatile tpc_async_error *rec, int code, int peer, uint32_t epoch,
                        int reported, uint32_t peer_bytes, uint32_t peer_kind, uint32_t own_bytes,
                        uint32_t own_kind) {
  rec->peer = peer;
  rec->epoch = epoch;
  rec->reported = reported;
  rec->peer_bytes = peer_bytes;
  rec->peer_kind = peer_kind;
  rec->own_bytes = own_bytes;
  rec->own_kind = own_kind;
  rec->code = code; /* last, like the device */
}

void test_describe(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 3, 1));
  const int r = 2;
  tpc_comm *c = w.comm[r];
  volatile tpc_async_error *rec = w.err_host[r];
  char id_text[64];
  snprintf(id_text, sizeof id_text, "comm_id %" PRIu64, w.comm_id[r]);
  const uint32_t ar_pk_f32 = tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, TPC_FLOAT32, 256);
  const uint32_t ar_bk_f32 = tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_BULK, TPC_FLOAT32, 256);
  const uint32_t ar_ln_f32 = tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_LINE, TPC_FLOAT32, 256);
  const uint32_t ar_pk_bf16 = tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, TPC_BFLOAT16, 256);
  const uint32_t ag_pk_256 = tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0, 256);
  const uint32_t ag_pk_64 = tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0, 64);
  const uint32_t norm_bf16 = tpc_kind_word(TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, TPC_BFLOAT16, 256);
  const uint32_t norm_add_bf16 = tpc_kind_word(TPC_KIND_NORM_OP(TPC_OP_ALL_REDUCE_NORM, TPC_PATTERN_NORM_ADD),
                                               TPC_ALGO_PACKET, TPC_BFLOAT16, 256);
  const uint32_t norm_fp8_bf16 = tpc_kind_word(
      TPC_KIND_NORM_QUANT_OP(TPC_OP_ALL_REDUCE_NORM, TPC_PATTERN_ADD_NORM, TPC_QUANT_PER_TOKEN_GROUP), TPC_ALGO_PACKET,
      TPC_BFLOAT16, 256);
  const uint32_t layer_fp8_bf16 = tpc_kind_word(
      TPC_KIND_NORM_QUANT_OP(TPC_OP_ALL_REDUCE_NORM, TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM, TPC_QUANT_PER_TOKEN),
      TPC_ALGO_PACKET, TPC_BFLOAT16, 256);

  static const struct {
    int code, peer, reported;
    uint32_t epoch;
    int peer_bytes_, own_bytes_;
    int kinds; /* which pair of kind words, see below */
    const char *needles[4];
  } cases[] = {
      /* this rank waited for peer 1 */
      {TPC_ERR_TIMEOUT, 1, 0, 11, 0, 0, 0, {"rank 2: peer 1 did not arrive within 2.000 s", "op #11", "abort() or close()", NULL}},
      /* peer 0 gave up and told this rank */
      {TPC_ERR_TIMEOUT, 0, 1, 12, 0, 0, 0, {"peer 0 gave up op #12", "2.000 s", "NaN", NULL}},
      /* mismatches name the first differing field */
      {TPC_ERR_MISMATCH, 1, 0, 13, 256, 256, 1, {"the op differs", "peer: all_gather packet of 256 bytes", "this rank: all_reduce packet of 256 bytes", "op #13"}},
      {TPC_ERR_MISMATCH, 1, 0, 14, 512, 256, 2, {"the size differs", "of 512 bytes", "of 256 bytes", NULL}},
      {TPC_ERR_MISMATCH, 0, 0, 15, 256, 256, 3, {"the algorithm differs", "peer: all_reduce bulk", "this rank: all_reduce packet", NULL}},
      {TPC_ERR_MISMATCH, 0, 0, 15, 256, 256, 6, {"the algorithm differs", "peer: all_reduce line", "this rank: all_reduce packet", NULL}},
      {TPC_ERR_MISMATCH, 0, 0, 16, 256, 256, 4, {"the dtype differs", "peer 0", NULL, NULL}},
      {TPC_ERR_MISMATCH, 0, 0, 17, 256, 256, 5, {"the layout (all_gather dim) differs", NULL, NULL, NULL}},
      {TPC_ERR_MISMATCH, 1, 0, 17, 256, 256, 7,
       {"the op differs", "peer: all_reduce_norm ADD_NORM packet of 256 bytes", "this rank: all_reduce packet", NULL}},
      /* ranks that call different fusion patterns of one shape */
      {TPC_ERR_MISMATCH, 1, 0, 17, 256, 256, 8,
       {"the op differs", "peer: all_reduce_norm NORM_ADD packet", "this rank: all_reduce_norm ADD_NORM packet", NULL}},
      /* ranks that quantize the normed output differently (the FP8 epilogue) */
      {TPC_ERR_MISMATCH, 1, 0, 17, 256, 256, 9,
       {"the op differs", "peer: all_reduce_norm ADD_NORM fp8 PER_TOKEN_GROUP packet",
        "this rank: all_reduce_norm ADD_NORM packet", NULL}},
      /* a LayerNorm pattern (the op byte's third pattern bit) against an RMS one */
      {TPC_ERR_MISMATCH, 1, 0, 17, 256, 256, 10,
       {"the op differs", "peer: all_reduce_norm LAYER_NORM_ADD_LAYER_NORM fp8 PER_TOKEN packet",
        "this rank: all_reduce_norm NORM_ADD packet", NULL}},
      /* a peer found the mismatch and told this rank */
      {TPC_ERR_MISMATCH, 1, 1, 18, 0, 0, 0, {"peer 1 found that the ranks called different ops at op #18", NULL, NULL, NULL}},
      /* a peer aborted */
      {TPC_ERR_CLOSED, 0, 1, 19, 0, 0, 0, {"peer 0 aborted", "noticed at op #19", NULL, NULL}},
      /* an op (a replayed graph) ran after close */
      {TPC_ERR_CLOSED, 0, 0, 20, 0, 0, 0, {"ran after it was closed", "CUDA graph", "NaN", NULL}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    uint32_t peer_kind = 0, own_kind = 0;
    switch (cases[i].kinds) {
      case 1: peer_kind = ag_pk_256; own_kind = ar_pk_f32; break;
      case 2: peer_kind = ar_pk_f32; own_kind = ar_pk_f32; break;
      case 3: peer_kind = ar_bk_f32; own_kind = ar_pk_f32; break;
      case 4: peer_kind = ar_pk_bf16; own_kind = ar_pk_f32; break;
      case 5: peer_kind = ag_pk_64; own_kind = ag_pk_256; break;
      case 6: peer_kind = ar_ln_f32; own_kind = ar_pk_f32; break;
      case 7: peer_kind = norm_bf16; own_kind = ar_pk_bf16; break;
      case 8: peer_kind = norm_add_bf16; own_kind = norm_bf16; break;
      case 9: peer_kind = norm_fp8_bf16; own_kind = norm_bf16; break;
      case 10: peer_kind = layer_fp8_bf16; own_kind = norm_add_bf16; break;
    }
    fill_record(rec, cases[i].code, cases[i].peer, cases[i].epoch, cases[i].reported,
                (uint32_t)cases[i].peer_bytes_, peer_kind, (uint32_t)cases[i].own_bytes_, own_kind);
    tpc_async_error e;
    memset(&e, 0, sizeof e);
    CHECK_RC(c, tpc_comm_async_error(c, &e), (tpc_result)cases[i].code);
    CHECK_EQ(e.code, cases[i].code);
    CHECK_EQ(e.epoch, cases[i].epoch);
    CHECK_EQ(e.reported, cases[i].reported);
    CHECK_EQ(e.peer_kind, peer_kind);
    CHECK_EQ(e.own_kind, own_kind);
    CHECK_MSG(c, id_text);
    for (int k = 0; k < 4 && cases[i].needles[k]; ++k) CHECK_MSG(c, cases[i].needles[k]);
    /* the same message through the id */
    memset(&e, 0, sizeof e);
    CHECK_RC(NULL, tpc_id_async_error(w.comm_id[r], &e), (tpc_result)cases[i].code);
    CHECK_EQ(e.code, cases[i].code);
    CHECK_EQ(e.peer, cases[i].peer);
    CHECK_EQ(strcmp(tpc_comm_last_error(NULL), tpc_comm_last_error(c)), 0);
  }
  /* the layout field is reached only when op, size, algorithm and dtype agree,
   * and the row fold really differs for those two rows */
  CHECK(ag_pk_64 != ag_pk_256);
  CHECK_EQ(ag_pk_64 & 0xffffffu, ag_pk_256 & 0xffffffu);

  /* a closed communicator's record is still read through its id: a graph
   * replayed after close records TPC_ERR_CLOSED there */
  const uint64_t id = w.comm_id[r];
  volatile tpc_async_error *closed_rec = rec;
  memset((void *)closed_rec, 0, sizeof *closed_rec);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
  tpc_async_error e;
  memset(&e, 0x5a, sizeof e);
  CHECK_RC(NULL, tpc_id_async_error(id, &e), TPC_ERR_CLOSED);
  CHECK_EQ(e.code, TPC_OK); /* a clean record */
  CHECK_MSG(NULL, "is closed");
  fill_record(closed_rec, TPC_ERR_CLOSED, 0, 21, 0, 0, 0, 0, 0);
  CHECK_RC(NULL, tpc_id_async_error(id, &e), TPC_ERR_CLOSED);
  CHECK_EQ(e.code, TPC_ERR_CLOSED);
  CHECK_MSG(NULL, "after it was closed");
  CHECK_MSG(NULL, "rank 2"); /* the rank is remembered past the communicator */
  CHECK_MSG(NULL, id_text);
  /* a timeout recorded before close is still told as a timeout */
  fill_record(closed_rec, TPC_ERR_TIMEOUT, 1, 22, 0, 0, 0, 0, 0);
  CHECK_RC(NULL, tpc_id_async_error(id, NULL), TPC_ERR_TIMEOUT);
  CHECK_MSG(NULL, "peer 1 did not arrive within 2.000 s");
}
