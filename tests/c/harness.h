/*
 * What every C test file of the core shares: the CHECK macros and their
 * counters, the fake ranks ("worlds") the tests build, and the test
 * functions main.c runs, one group per file:
 *   test_lifecycle.c  config, create, peers, export, destroy, probe, epoch
 *   test_ops.c        each collective's checks and the arguments its kernels get
 *   test_errors.c     result strings, the device error record and its messages
 *   test_registry.c   ids, control pool, acquire/release (threads too), abort
 * Prints every failed check as file:line, then exactly one line
 * "N passed, M failed"; exits 1 when M > 0.
 */
#ifndef TPCOMM_TESTS_HARNESS_H
#define TPCOMM_TESTS_HARNESS_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/tpcomm.h"
#include "fake_runtime.h"
#include "layout.h"
#include "registry.h"

/* ------------------------------------------------------------ checking */

extern int n_pass, n_fail;
extern const char *current_test;
void failed(const char *file, int line, const char *what);

#define CHECK(cond)                                     \
  do {                                                  \
    if (cond)                                           \
      n_pass++;                                         \
    else                                                \
      failed(__FILE__, __LINE__, #cond);                \
  } while (0)

#define CHECK_EQ(a, b)                                                                    \
  do {                                                                                    \
    long long va_ = (long long)(a), vb_ = (long long)(b);                                 \
    if (va_ == vb_) {                                                                     \
      n_pass++;                                                                           \
    } else {                                                                              \
      char msg_[512];                                                                     \
      snprintf(msg_, sizeof msg_, "%s == %s (%lld != %lld)", #a, #b, va_, vb_);           \
      failed(__FILE__, __LINE__, msg_);                                                   \
    }                                                                                     \
  } while (0)

#define CHECK_PTR(a, b)                                                                   \
  do {                                                                                    \
    const void *pa_ = (const void *)(a), *pb_ = (const void *)(b);                        \
    if (pa_ == pb_) {                                                                     \
      n_pass++;                                                                           \
    } else {                                                                              \
      char msg_[512];                                                                     \
      snprintf(msg_, sizeof msg_, "%s == %s (%p != %p)", #a, #b, pa_, pb_);               \
      failed(__FILE__, __LINE__, msg_);                                                   \
    }                                                                                     \
  } while (0)

/* A call returns `code`; on a mismatch the core's message is printed. */
#define CHECK_RC(comm, expr, code)                                                        \
  do {                                                                                    \
    tpc_result got_ = (expr);                                                             \
    if (got_ == (code)) {                                                                 \
      n_pass++;                                                                           \
    } else {                                                                              \
      char msg_[1024];                                                                    \
      snprintf(msg_, sizeof msg_, "%s returned %d (%s), expected %s; last error: %s",     \
               #expr, (int)got_, tpc_result_string(got_), #code,                          \
               tpc_comm_last_error(comm));                                                \
      failed(__FILE__, __LINE__, msg_);                                                   \
    }                                                                                     \
  } while (0)

/* The last error of `comm` (NULL: of the last failed create) contains `needle`. */
#define CHECK_MSG(comm, needle)                                                           \
  do {                                                                                    \
    const char *err_ = tpc_comm_last_error(comm);                                         \
    if (err_ && strstr(err_, (needle))) {                                                 \
      n_pass++;                                                                           \
    } else {                                                                              \
      char msg_[1024];                                                                    \
      snprintf(msg_, sizeof msg_, "last error \"%s\" does not contain \"%s\"",            \
               err_ ? err_ : "(null)", (needle));                                         \
      failed(__FILE__, __LINE__, msg_);                                                   \
    }                                                                                     \
  } while (0)

/* ------------------------------------------------------------- helpers */

#define MAX_BYTES 4096
#define PACKET_MAX 1024
#define TIMEOUT_NS 2000000000ull

#define STREAM_A ((void *)(uintptr_t)0x1000)
#define STREAM_B ((void *)(uintptr_t)0x2000)
#define STREAM_C ((void *)(uintptr_t)0x3000)

/* Devices only one test creates communicators on, so its control pool chunk
 * is fresh there (ordinary worlds use devices 0..7). */
#define EXPORT_DEVICE 40
#define SHARED_CHUNK_DEVICE 44 /* 44, 45, 46 */
#define FRESH_POOL_DEVICE 50
#define CHUNK_DEVICE 60

/* NaN patterns of the all-reduce dtypes, 8 bytes each. */
#define NAN_F32 0x7fc000007fc00000ull
#define NAN_F16 0x7e007e007e007e00ull
#define NAN_BF16 0x7fc07fc07fc07fc0ull

tpc_config config(int rank, int world_size);

/* A group of fake ranks in this process. */
typedef struct {
  int n;
  tpc_comm *comm[TPC_MAX_RANKS];
  char *buf[TPC_MAX_RANKS];                /* each rank's registered buffer */
  uint64_t comm_id[TPC_MAX_RANKS];
  tpc_control *control[TPC_MAX_RANKS];     /* each rank's control slot */
  void *chunk[TPC_MAX_RANKS];              /* the pool chunk it lies in */
  tpc_async_error *err_host[TPC_MAX_RANKS];
  void *err_device[TPC_MAX_RANKS];
  unsigned char handle[TPC_MAX_RANKS][TPC_IPC_HANDLE_BYTES];
} world;

/* The registry entry of an id (never moves once handed out), or NULL. */
tpc_entry *entry_of(uint64_t id);

/* Creates and exports n ranks; opens peers and readies them when `connect`.
 * Rank r is on device world_device_base + r. Returns 1 on success. */
extern int quiet_make_world; /* failures are expected: do not print them */
extern int world_device_base;
int make_world(world *w, int n, int connect);
void destroy_world(world *w);

/* Everything the fake handed out was given back, and nothing bogus was freed. */
void check_all_released(const char *file, int line);
#define CHECK_ALL_RELEASED() check_all_released(__FILE__, __LINE__)

/* 64-byte aligned scratch memory the ops are pointed at (never touched by the
 * fake launches); main.c allocates it. */
extern unsigned char *scratch_in, *scratch_out;
#define SCRATCH_BYTES (4 * MAX_BYTES)

/* The blob tpc_comm_export writes (TPC_IPC_HANDLE_BYTES): [0, 64) the
 * buffer's handle, [64, 128) the control chunk's, [128, 136) the control
 * slot's byte offset in that chunk (uint64), the rest zero. */
#define BLOB_CHUNK_AT TPC_ALLOC_HANDLE_BYTES
#define BLOB_OFFSET_AT (2 * TPC_ALLOC_HANDLE_BYTES)
#define BLOB_USED (BLOB_OFFSET_AT + 8)
void *blob_buffer(const unsigned char *blob);
void *blob_chunk(const unsigned char *blob);
uint64_t blob_offset(const unsigned char *blob);
void blob_set_offset(unsigned char *blob, uint64_t offset);

/* The recorded launch got this world's buffers, keyed by rank, the layout,
 * the rank's control slot and id, the op's kind word and its NaN pattern. */
void check_args(const world *w, int rank, const void *in, void *out, size_t nbytes, size_t row_bytes, int dtype,
                int op, int algo, uint64_t poison);

/* ------------------------------------------------------------- the tests */

/* test_lifecycle.c */
void test_layout(void);
void test_config_validation(void);
void test_create_destroy(void);
void test_create_failures(void);
void test_open_peer(void);
void test_open_peer_bad_offset(void);
void test_destroy_failures(void);
void test_probe(void);
void test_no_leaks_under_failures(void);
void test_export_blob(void);
void test_peer_control(void);
void test_shared_chunk(void);
void test_debug_set_epoch(void);
/* test_ops.c */
void test_reduce_scatter(void);
void test_reduce_scatter_f32(void);
void test_all_reduce_norm(void);
void test_all_reduce_norm_quant(void);
void test_norm_quant_check(void);
void test_all_reduce_validation(void);
void test_all_reduce_algo_and_args(void);
void test_quantized_validation(void);
void test_all_gather(void);
void test_stream_switch(void);
void test_launch_device(void);
void test_id_all_reduce(void);
void test_args_control(void);
/* test_errors.c */
void test_result_strings(void);
void test_async_error(void);
void test_describe(void);
/* test_registry.c */
void test_ids(void);
void test_pool_chunks(void);
void test_acquire(void);
void test_destroy_control_slot(void);
void test_abort(void);
void test_acquire_threads(void);

#endif /* TPCOMM_TESTS_HARNESS_H */
