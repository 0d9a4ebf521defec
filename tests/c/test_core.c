/*
 * Tests of the C core (csrc/core/comm.c) over the fake runtime: no CUDA, no GPU.
 * Several fake ranks live in this one process and open each other's buffers.
 *
 * Prints every failed check as file:line, then exactly one line
 * "N passed, M failed"; exits 1 when M > 0.

 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/tpcomm.h"
#include "fake_runtime.h"
#include "layout.h"

/* ------------------------------------------------------------ checking */

static int n_pass, n_fail;
static const char *current_test = "";

static void failed(const char *file, int line, const char *what) {
  n_fail++;
  fprintf(stderr, "%s:%d: [%s] FAILED: %s\n", file, line, current_test, what);
}

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

static void *const STREAM_A = (void *)(uintptr_t)0x1000;
static void *const STREAM_B = (void *)(uintptr_t)0x2000;
static void *const STREAM_C = (void *)(uintptr_t)0x3000;

static tpc_config config(int rank, int world) {
  tpc_config c;
  memset(&c, 0, sizeof c);
  c.rank = rank;
  c.world_size = world;
  c.device = rank;
  c.max_bytes = MAX_BYTES;
  c.packet_max_bytes = PACKET_MAX;
  c.timeout_ns = TIMEOUT_NS;
  return c;
}

/* A group of fake ranks in this process. */
typedef struct {
  int n;
  tpc_comm *comm[TPC_MAX_RANKS];
  char *buf[TPC_MAX_RANKS];                /* each rank's registered buffer */
  tpc_async_error *err_host[TPC_MAX_RANKS];
  void *err_device[TPC_MAX_RANKS];
  unsigned char handle[TPC_MAX_RANKS][TPC_IPC_HANDLE_BYTES];
} world;

/* Creates and exports n ranks; opens peers and readies them when `connect`. */
static int quiet_make_world; /* failures are expected: do not print them */

static int make_world(world *w, int n, int connect) {
  memset(w, 0, sizeof *w);
  w->n = n;
  for (int r = 0; r < n; ++r) {
    tpc_config c = config(r, n);
    if (tpc_comm_create(&c, &w->comm[r]) != TPC_OK) {
      if (!quiet_make_world)
        fprintf(stderr, "make_world: create of rank %d failed: %s\n", r, tpc_comm_last_error(NULL));
      return 0;
    }
    w->err_host[r] = fake.last_mapped_host;
    w->err_device[r] = fake.last_mapped_device;
    if (tpc_comm_export(w->comm[r], w->handle[r]) != TPC_OK) return 0;
    w->buf[r] = fake_handle_pointer(w->handle[r]);
  }
  if (!connect) return 1;
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < n; ++p)
      if (p != r && tpc_comm_open_peer(w->comm[r], p, w->handle[p]) != TPC_OK) return 0;
    if (tpc_comm_ready(w->comm[r]) != TPC_OK) return 0;
  }
  return 1;
}

static void destroy_world(world *w) {
  for (int r = 0; r < w->n; ++r) {
    CHECK_RC(NULL, tpc_comm_destroy(w->comm[r]), TPC_OK);
    w->comm[r] = NULL;
  }
}

/* Everything the fake handed out was given back, and nothing bogus was freed. */
static void check_all_released(const char *file, int line) {
  const int ok = fake.live_device == 0 && fake.live_host == 0 && fake.live_opens == 0 &&
                 fake.device_allocs == fake.device_frees && fake.host_allocs == fake.host_frees &&
                 fake.ipc_opens == fake.ipc_closes && fake.bad_device_frees == 0 &&
                 fake.bad_host_frees == 0 && fake.bad_closes == 0;
  if (ok) {
    n_pass++;
    return;
  }
  char msg[512];
  snprintf(msg, sizeof msg,
           "not all released: device %d allocs / %d frees (live %d), host %d / %d (live %d), "
           "ipc %d opens / %d closes (live %d), bad frees %d device %d host, bad closes %d",
           fake.device_allocs, fake.device_frees, fake.live_device, fake.host_allocs,
           fake.host_frees, fake.live_host, fake.ipc_opens, fake.ipc_closes, fake.live_opens,
           fake.bad_device_frees, fake.bad_host_frees, fake.bad_closes);
  failed(file, line, msg);
}
#define CHECK_ALL_RELEASED() check_all_released(__FILE__, __LINE__)

/* 64-byte aligned scratch memory the ops are pointed at (never touched by the
 * fake launches). */
static unsigned char *scratch_in, *scratch_out;
#define SCRATCH_BYTES (4 * MAX_BYTES)

/* ---------------------------------------------------------------- tests */

static void test_result_strings(void) {
  const char *seen[8];
  for (int code = 0; code < 8; ++code) {
    const char *s = tpc_result_string((tpc_result)code);
    CHECK(s != NULL && s[0] != '\0');
    for (int j = 0; j < code; ++j) CHECK(s && strcmp(s, seen[j]) != 0);
    seen[code] = s;
  }
  CHECK(strstr(tpc_result_string((tpc_result)99), "unknown") != NULL);
  CHECK(strstr(tpc_result_string(TPC_ERR_TIMEOUT), "time") != NULL);
}

static void test_layout(void) {
  /* sizeof the signal block fits its reserved space */
  CHECK(sizeof(tpc_signals) <= TPC_SIGNALS_BYTES);
  /* one configuration worked out by hand: world 2, max 4096, packet 1024 */
  tpc_layout l = tpc_layout_for(2, 4096, 1024);
  CHECK_EQ(l.packet_off, 16384);
  CHECK_EQ(l.packet_slot_bytes, 4096);             /* round_up(2 * 1024, 4096) */
  CHECK_EQ(l.data_off, 16384 + 2 * 2 * 4096);      /* 32768 */
  CHECK_EQ(l.data_bytes, 12288);                   /* round_up(2 * 4096 + 32, 4096) */
  CHECK_EQ(l.total_bytes, 45056);
  /* regions do not overlap, are page aligned, and packet slots hold 2x the input */
  for (int n = 2; n <= TPC_MAX_RANKS; ++n) {
    tpc_layout m = tpc_layout_for(n, 1u << 20, 64u << 10);
    CHECK(m.packet_off >= sizeof(tpc_signals));
    CHECK(m.packet_slot_bytes >= 2 * (64u << 10));
    CHECK_EQ(m.data_off, m.packet_off + 2 * (size_t)n * m.packet_slot_bytes);
    CHECK(m.data_bytes >= 2 * (1u << 20) + 16 * (size_t)n);
    CHECK_EQ(m.data_off % 4096, 0);
    CHECK_EQ(m.total_bytes, m.data_off + m.data_bytes);
  }
}

static void test_config_validation(void) {
  struct {
    tpc_config cfg;
    const char *needle;
  } bad[16];
  int nb = 0;
  tpc_config c;
  c = config(0, 2); c.world_size = 1; bad[nb].cfg = c; bad[nb++].needle = "world_size 1 is outside 2..8";
  c = config(0, 2); c.world_size = 9; bad[nb].cfg = c; bad[nb++].needle = "world_size 9 is outside 2..8";
  c = config(0, 2); c.world_size = 0; bad[nb].cfg = c; bad[nb++].needle = "world_size 0";
  c = config(0, 2); c.rank = 2; bad[nb].cfg = c; bad[nb++].needle = "rank 2 is outside 0..1";
  c = config(0, 4); c.rank = -1; bad[nb].cfg = c; bad[nb++].needle = "rank -1 is outside 0..3";
  c = config(0, 2); c.device = -1; bad[nb].cfg = c; bad[nb++].needle = "device -1";
  c = config(0, 2); c.max_bytes = 24; bad[nb].cfg = c; bad[nb++].needle = "max_bytes 24 is not a positive multiple of 16";
  c = config(0, 2); c.max_bytes = 0; bad[nb].cfg = c; bad[nb++].needle = "max_bytes 0";
  c = config(0, 2); c.max_bytes = 8; bad[nb].cfg = c; bad[nb++].needle = "max_bytes 8";
  c = config(0, 2); c.packet_max_bytes = 40; bad[nb].cfg = c; bad[nb++].needle = "packet_max_bytes 40";
  c = config(0, 2); c.max_bytes = ((size_t)1 << 32) + 16; bad[nb].cfg = c; bad[nb++].needle = "4 GiB";
  c = config(0, 2); c.timeout_ns = 0; bad[nb].cfg = c; bad[nb++].needle = "timeout_ns is 0";

  for (int i = 0; i < nb; ++i) {
    fake_reset();
    tpc_comm *comm = (tpc_comm *)&bad[i]; /* must be overwritten with NULL */
    CHECK_RC(NULL, tpc_comm_create(&bad[i].cfg, &comm), TPC_ERR_INVALID_ARG);
    CHECK_PTR(comm, NULL);
    CHECK_MSG(NULL, bad[i].needle);
    /* validation happens before the runtime is touched */
    CHECK_EQ(fake.calls[FK_SET_DEVICE] + fake.calls[FK_DEVICE_MALLOC] + fake.calls[FK_HOST_ALLOC_MAPPED], 0);
  }

  tpc_comm *comm = NULL;
  CHECK_RC(NULL, tpc_comm_create(NULL, &comm), TPC_ERR_INVALID_ARG);
  CHECK_MSG(NULL, "config is NULL");
  c = config(0, 2);
  CHECK_RC(NULL, tpc_comm_create(&c, NULL), TPC_ERR_INVALID_ARG);
  CHECK_MSG(NULL, "comm_out");

  /* the boundaries themselves are accepted */
  fake_reset();
  c = config(7, 8);
  c.max_bytes = 16;
  c.packet_max_bytes = 16;
  c.timeout_ns = 1;
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_OK);
  CHECK(comm != NULL);
  CHECK_EQ(tpc_comm_world_size(comm), 8);
  CHECK_EQ(tpc_comm_rank(comm), 7);
  CHECK_RC(NULL, tpc_comm_destroy(comm), TPC_OK);
  c = config(1, 2);
  c.max_bytes = (size_t)1 << 32;
  c.packet_max_bytes = (size_t)1 << 31;
  /* the largest caps pass validation (the allocation is made to fail before
   * the fake asks for 12 GiB of host memory) */
  fake_fail_nth(FK_DEVICE_MALLOC, 1, 2);
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_ERR_RUNTIME);
  CHECK_MSG(NULL, "allocating the registered buffer");
  CHECK_ALL_RELEASED();
}

static void test_create_destroy(void) {
  fake_reset();
  tpc_config c = config(1, 4);
  c.device = 3;
  tpc_comm *comm = NULL;
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_OK);
  CHECK(comm != NULL);
  if (!comm) return;
  tpc_layout l = tpc_layout_for(4, MAX_BYTES, PACKET_MAX);
  CHECK_EQ(fake.last_device, 3);
  CHECK_EQ(tpc_comm_device(comm), 3);
  CHECK_EQ(tpc_comm_rank(comm), 1);
  CHECK_EQ(tpc_comm_world_size(comm), 4);
  CHECK_EQ(tpc_comm_buffer_bytes(comm), l.total_bytes);
  CHECK_EQ(fake.last_malloc_bytes, l.total_bytes);
  CHECK_EQ(fake.device_allocs, 1);
  CHECK_EQ(fake.host_allocs, 1);
  CHECK_EQ(tpc_comm_open_peer_count(comm), 0);
  /* the whole buffer was cleared (the fake fills fresh memory with garbage) */
  const unsigned char *buf = fake.last_malloc;
  size_t nonzero = 0;
  for (size_t i = 0; i < l.total_bytes; ++i) nonzero += buf[i] != 0;
  CHECK_EQ(nonzero, 0);
  /* and so was the error record */
  tpc_async_error e;
  memset(&e, 0x5a, sizeof e);
  CHECK_RC(comm, tpc_comm_async_error(comm, &e), TPC_OK);
  CHECK_EQ(e.code, TPC_OK);
  CHECK_EQ(e.peer, 0);
  /* export writes a handle of the registered buffer */
  unsigned char handle[TPC_IPC_HANDLE_BYTES];
  CHECK_RC(comm, tpc_comm_export(comm, handle), TPC_OK);
  CHECK_PTR(fake_handle_pointer(handle), fake.last_malloc);
  CHECK_RC(comm, tpc_comm_export(comm, NULL), TPC_ERR_INVALID_ARG);
  fake_fail_nth(FK_IPC_EXPORT, 1, 31);
  CHECK_RC(comm, tpc_comm_export(comm, handle), TPC_ERR_RUNTIME);
  CHECK_MSG(comm, "exporting the IPC handle failed: fake error 31");

  const int syncs = fake.calls[FK_DEVICE_SYNCHRONIZE];
  CHECK_RC(NULL, tpc_comm_destroy(comm), TPC_OK);
  CHECK(fake.calls[FK_DEVICE_SYNCHRONIZE] > syncs); /* waits before freeing */
  CHECK_EQ(fake.device_frees, 1);
  CHECK_EQ(fake.host_frees, 1);
  CHECK_ALL_RELEASED();
  CHECK_RC(NULL, tpc_comm_destroy(NULL), TPC_OK);

  /* getters on NULL */
  CHECK_EQ(tpc_comm_world_size(NULL), 0);
  CHECK_EQ(tpc_comm_rank(NULL), -1);
  CHECK_EQ(tpc_comm_device(NULL), -1);
  CHECK_EQ(tpc_comm_buffer_bytes(NULL), 0);
  CHECK_EQ(tpc_comm_open_peer_count(NULL), 0);
}

/* Every runtime call of create failing in turn: the error names the step and
 * the runtime's message, and nothing leaks. */
static void test_create_failures(void) {
  static const struct {
    fake_entry entry;
    const char *step;
  } steps[] = {
      {FK_SET_DEVICE, "selecting the device failed"},
      {FK_DEVICE_MALLOC, "allocating the registered buffer failed"},
      {FK_DEVICE_MEMSET, "clearing the registered buffer failed"},
      {FK_HOST_ALLOC_MAPPED, "allocating the host-mapped error record failed"},
      {FK_DEVICE_SYNCHRONIZE, "synchronising after set-up failed"},
  };
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; ++i) {
    fake_reset();
    fake_fail_nth(steps[i].entry, 1, 700 + (int)i);
    tpc_config c = config(0, 2);
    tpc_comm *comm = (tpc_comm *)&c;
    CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_ERR_RUNTIME);
    CHECK_PTR(comm, NULL);
    CHECK_MSG(NULL, steps[i].step);
    char code_text[32];
    snprintf(code_text, sizeof code_text, "fake error %d", 700 + (int)i);
    CHECK_MSG(NULL, code_text);
    CHECK_EQ(fake.calls[steps[i].entry], 1);
    CHECK_ALL_RELEASED();
  }

  /* After a failed create, a good one works and the message of the failed
   * one stays until the next failure. */
  fake_reset();
  tpc_config c = config(0, 2);
  tpc_comm *comm = NULL;
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_OK);
  CHECK_RC(NULL, tpc_comm_destroy(comm), TPC_OK);
  CHECK_ALL_RELEASED();

  /* runtime_gpu.c's host_alloc_mapped: cudaHostAlloc succeeds,
   * cudaHostGetDevicePointer fails; it frees the block and returns the error
   * with *host still set. create's clean-up must not free it a second time. */
  fake_reset();
  fake.host_alloc_fails_after_alloc = 1;
  fake_fail_nth(FK_HOST_ALLOC_MAPPED, 1, 46);
  comm = NULL;
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_ERR_RUNTIME);
  CHECK_PTR(comm, NULL);
  CHECK_EQ(fake.live_device, 0);
  /* tpc_comm_create frees the error record a second time when host_alloc_mapped fails after allocating (comm.c trusts *host of a failed call) */
  CHECK(fake.bad_host_frees == 0);
  fake.host_alloc_fails_after_alloc = 0;
}

static void test_open_peer(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 3, 0));
  tpc_comm *c0 = w.comm[0];

  CHECK_RC(c0, tpc_comm_open_peer(c0, 0, w.handle[0]), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c0, "peer 0 is this rank itself");
  CHECK_RC(c0, tpc_comm_open_peer(c0, 3, w.handle[1]), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c0, "peer 3 is outside 0..2");
  CHECK_RC(c0, tpc_comm_open_peer(c0, -1, w.handle[1]), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c0, "peer -1 is outside 0..2");
  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, NULL), TPC_ERR_INVALID_ARG);
  CHECK_RC(NULL, tpc_comm_open_peer(NULL, 1, w.handle[1]), TPC_ERR_INVALID_ARG);
  CHECK_EQ(fake.calls[FK_IPC_OPEN], 0); /* none of those reached the runtime */

  CHECK_RC(c0, tpc_comm_ready(c0), TPC_ERR_STATE);
  CHECK_MSG(c0, "peer 1 has not been opened");

  /* peers in any order: 2 first */
  CHECK_RC(c0, tpc_comm_open_peer(c0, 2, w.handle[2]), TPC_OK);
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  CHECK_RC(c0, tpc_comm_open_peer(c0, 2, w.handle[2]), TPC_ERR_STATE);
  CHECK_MSG(c0, "peer 2 is already open");
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  CHECK_EQ(fake.ipc_opens, 1);

  CHECK_RC(c0, tpc_comm_ready(c0), TPC_ERR_STATE);
  CHECK_MSG(c0, "peer 1 has not been opened");

  /* an open that fails in the runtime: TPC_ERR_PEER naming the peer and the
   * runtime's message; the peer stays closed and can be retried */
  fake_fail_nth(FK_IPC_OPEN, 1, 217);
  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, w.handle[1]), TPC_ERR_PEER);
  CHECK_MSG(c0, "peer 1");
  CHECK_MSG(c0, "fake error 217");
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  /* a handle that is not one (garbage bytes) */
  unsigned char junk[TPC_IPC_HANDLE_BYTES];
  memset(junk, 0x3c, sizeof junk);
  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, junk), TPC_ERR_PEER);
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  fake.bad_opens = 0;

  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, w.handle[1]), TPC_OK);
  CHECK_EQ(tpc_comm_open_peer_count(c0), 2);
  CHECK_RC(c0, tpc_comm_ready(c0), TPC_OK);
  CHECK_RC(c0, tpc_comm_ready(c0), TPC_OK); /* idempotent */

  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, w.handle[1]), TPC_ERR_STATE);
  CHECK_MSG(c0, "ready was called");
  CHECK_EQ(tpc_comm_open_peer_count(c0), 2);

  /* rank 1 opened only one peer before being destroyed: that one handle is
   * closed, nothing else */
  CHECK_RC(w.comm[1], tpc_comm_open_peer(w.comm[1], 0, w.handle[0]), TPC_OK);
  CHECK_RC(NULL, tpc_comm_ready(NULL), TPC_ERR_INVALID_ARG);

  const int closes_before = fake.ipc_closes;
  CHECK_RC(NULL, tpc_comm_destroy(w.comm[1]), TPC_OK);
  CHECK_EQ(fake.ipc_closes - closes_before, 1);
  w.comm[1] = NULL;
  CHECK_RC(NULL, tpc_comm_destroy(w.comm[0]), TPC_OK);
  CHECK_EQ(fake.ipc_closes - closes_before, 3);
  w.comm[0] = NULL;
  CHECK_RC(NULL, tpc_comm_destroy(w.comm[2]), TPC_OK);
  w.comm[2] = NULL;
  CHECK_EQ(fake.bad_opens, 0);
  CHECK_ALL_RELEASED();
}

/* destroy keeps releasing after a failing call and reports the first failure. */
static void test_destroy_failures(void) {
  static const struct {
    fake_entry entry;
    const char *step;
  } steps[] = {
      {FK_DEVICE_SYNCHRONIZE, "synchronising before destroy failed"},
      {FK_IPC_CLOSE, "closing a peer handle failed"},
  };
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; ++i) {
    fake_reset();
    world w;
    CHECK(make_world(&w, 3, 1));
    fake_fail_nth(steps[i].entry, 1, 90);
    CHECK_RC(NULL, tpc_comm_destroy(w.comm[0]), TPC_ERR_RUNTIME);
    CHECK_MSG(NULL, steps[i].step); /* the message outlives the communicator */
    CHECK_MSG(NULL, "fake error 90");
    w.comm[0] = NULL;
    CHECK_RC(NULL, tpc_comm_destroy(w.comm[1]), TPC_OK);
    CHECK_RC(NULL, tpc_comm_destroy(w.comm[2]), TPC_OK);
    /* the failed close is the one handle not closed; everything else is */
    CHECK_EQ(fake.live_device, 0);
    CHECK_EQ(fake.live_host, 0);
    CHECK_EQ(fake.live_opens, steps[i].entry == FK_IPC_CLOSE ? 1 : 0);
    CHECK_EQ(fake.bad_device_frees + fake.bad_host_frees + fake.bad_closes, 0);
  }
}

static void test_probe(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 3, 0));
  uint32_t mask = 0xffffffffu;
  CHECK_RC(w.comm[0], tpc_comm_probe_write(w.comm[0]), TPC_ERR_STATE);
  CHECK_RC(w.comm[0], tpc_comm_probe_read(w.comm[0], &mask), TPC_ERR_STATE);
  CHECK_RC(NULL, tpc_comm_probe_write(NULL), TPC_ERR_STATE);
  destroy_world(&w);

  /* every rank writes, every rank sees every other rank's token */
  CHECK(make_world(&w, 4, 1));
  for (int r = 0; r < 4; ++r) CHECK_RC(w.comm[r], tpc_comm_probe_write(w.comm[r]), TPC_OK);
  for (int r = 0; r < 4; ++r) {
    /* the tokens really landed in this rank's buffer, in the writer's slot */
    const tpc_signals *s = (const tpc_signals *)w.buf[r];
    for (int p = 0; p < 4; ++p) {
      if (p == r) CHECK_EQ(s->probe[p], 0);
      else CHECK(s->probe[p] != 0 && (s->probe[p] & 0xffu) == (uint32_t)p);
    }
    mask = 0xffffffffu;
    CHECK_RC(w.comm[r], tpc_comm_probe_read(w.comm[r], &mask), TPC_OK);
    CHECK_EQ(mask, 0xfu & ~(1u << r));
  }
  CHECK_RC(w.comm[0], tpc_comm_probe_read(w.comm[0], NULL), TPC_ERR_STATE);
  destroy_world(&w);
  CHECK_ALL_RELEASED();

  /* only ranks 0 and 2 write: rank 1 sees {0, 2}, rank 3 sees {0, 2}, rank 0 sees {2} */
  fake_reset();
  CHECK(make_world(&w, 4, 1));
  CHECK_RC(w.comm[0], tpc_comm_probe_write(w.comm[0]), TPC_OK);
  CHECK_RC(w.comm[2], tpc_comm_probe_write(w.comm[2]), TPC_OK);
  CHECK_RC(w.comm[1], tpc_comm_probe_read(w.comm[1], &mask), TPC_OK);
  CHECK_EQ(mask, (1u << 0) | (1u << 2));
  CHECK_RC(w.comm[3], tpc_comm_probe_read(w.comm[3], &mask), TPC_OK);
  CHECK_EQ(mask, (1u << 0) | (1u << 2));
  CHECK_RC(w.comm[0], tpc_comm_probe_read(w.comm[0], &mask), TPC_OK);
  CHECK_EQ(mask, 1u << 2);

  /* a corrupted token is not counted */
  tpc_signals *s1 = (tpc_signals *)w.buf[1];
  s1->probe[0] ^= 0x00010000u;
  CHECK_RC(w.comm[1], tpc_comm_probe_read(w.comm[1], &mask), TPC_OK);
  CHECK_EQ(mask, 1u << 2);
  /* nor is a valid token in the wrong slot: rank 2's token in rank 3's slot */
  s1->probe[3] = s1->probe[2];
  CHECK_RC(w.comm[1], tpc_comm_probe_read(w.comm[1], &mask), TPC_OK);
  CHECK_EQ(mask, 1u << 2);
  /* nor a token in this rank's own slot */
  tpc_signals *s0 = (tpc_signals *)w.buf[0];
  s0->probe[0] = s1->probe[2] - 2; /* rank 0's token value */
  CHECK_RC(w.comm[0], tpc_comm_probe_read(w.comm[0], &mask), TPC_OK);
  CHECK_EQ(mask, 1u << 2);

  /* a write that fails names the peer */
  fake_fail_nth(FK_MEMCPY_ANY, 2, 55);
  CHECK_RC(w.comm[3], tpc_comm_probe_write(w.comm[3]), TPC_ERR_PEER);
  CHECK_MSG(w.comm[3], "peer 1");
  CHECK_MSG(w.comm[3], "fake error 55");
  fake_fail_nth(FK_MEMCPY_ANY, 1, 56);
  CHECK_RC(w.comm[3], tpc_comm_probe_read(w.comm[3], &mask), TPC_ERR_RUNTIME);
  CHECK_MSG(w.comm[3], "fake error 56");
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* The recorded launch got this world's buffers, keyed by rank, and the layout. */
static void check_args(const world *w, int rank, const void *in, void *out, size_t nbytes,
                       size_t row_bytes, int dtype, int op) {
  const tpc_kernel_args *a = &fake.last_args;
  const tpc_layout l = tpc_layout_for(w->n, MAX_BYTES, PACKET_MAX);
  for (int p = 0; p < TPC_MAX_RANKS; ++p) CHECK_PTR(a->bufs[p], p < w->n ? w->buf[p] : NULL);
  CHECK_PTR(a->err, w->err_device[rank]); /* the device view, not the host one */
  CHECK(a->err != (void *)w->err_host[rank]);
  CHECK_PTR(a->in, in);
  CHECK_PTR(a->out, out);
  CHECK_EQ(a->nbytes, nbytes);
  CHECK_EQ(a->row_bytes, row_bytes);
  CHECK_EQ(a->timeout_ns, TIMEOUT_NS);
  CHECK_EQ(a->packet_off, l.packet_off);
  CHECK_EQ(a->packet_slot_bytes, l.packet_slot_bytes);
  CHECK_EQ(a->data_off, l.data_off);
  CHECK_EQ(a->rank, rank);
  CHECK_EQ(a->world, w->n);
  CHECK_EQ(a->dtype, dtype);
  CHECK_EQ(a->op, op);
}

static void test_all_reduce_validation(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 0));
  tpc_comm *c = w.comm[0];
  unsigned char *in = scratch_in, *out = scratch_out;

  /* not ready */
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_STATE);
  CHECK_MSG(c, "not ready");
  CHECK_RC(NULL, tpc_all_reduce(NULL, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A),
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
      {0, 0, 0, TPC_FLOAT32, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {24, 0, 0, TPC_FLOAT32, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "all_reduce of 24 bytes"},
      {72, 0, 0, TPC_FLOAT16, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {64, 4, 0, TPC_FLOAT32, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      {64, 0, 8, TPC_FLOAT32, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      {64, 2, 2, TPC_BFLOAT16, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      {64, 0, 0, 3, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "dtype 3"},
      {64, 0, 0, -1, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "dtype -1"},
      {MAX_BYTES + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_AUTO, TPC_ERR_TOO_LARGE, "over the cap of 4096"},
      {MAX_BYTES + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_BULK, TPC_ERR_TOO_LARGE, "over the cap of 4096"},
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "over the packet cap of 1024"},
      {64, 0, 0, TPC_FLOAT32, 3, TPC_ERR_INVALID_ARG, "unknown algorithm 3"},
      {64, 0, 0, TPC_FLOAT32, -2, TPC_ERR_INVALID_ARG, "unknown algorithm -2"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    CHECK_RC(c, tpc_all_reduce(c, in + cases[i].in_off, out + cases[i].out_off, cases[i].nbytes,
                               (tpc_dtype)cases[i].dtype, (tpc_algo)cases[i].algo, STREAM_A),
             cases[i].want);
    CHECK_MSG(c, cases[i].needle);
  }
  CHECK_RC(c, tpc_all_reduce(c, NULL, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_RC(c, tpc_all_reduce(c, in, NULL, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_EQ(fake.launches, 0); /* nothing invalid reached a kernel */

  /* the limits themselves are fine; in == out is allowed */
  CHECK_RC(c, tpc_all_reduce(c, in, in, MAX_BYTES, TPC_BFLOAT16, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX, TPC_FLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in + 16, out + 48, 16, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launches, 3);
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_GATHER], 0);

  /* a launch the runtime refuses */
  fake_fail_nth(FK_LAUNCH_ALL_REDUCE, 1, 98);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching all_reduce failed: fake error 98");
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

static void test_all_reduce_algo_and_args(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 4, 1));
  const int r = 2;
  tpc_comm *c = w.comm[r];
  unsigned char *in = scratch_in, *out = scratch_out;

  /* default cutover: packet_max_bytes */
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX + 16, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);

  /* the cutover set by tpc_comm_set_cutover decides AUTO, byte for byte */
  CHECK_RC(c, tpc_comm_set_cutover(c, 256, 512), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 16, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 256, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 272, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, MAX_BYTES, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  /* an explicit algorithm overrides the cutover */
  CHECK_RC(c, tpc_all_reduce(c, in, out, 512, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 32, TPC_FLOAT32, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  /* cutover 0: AUTO is always bulk */
  CHECK_RC(c, tpc_comm_set_cutover(c, 0, 0), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 16, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  /* cutovers above packet_max_bytes are refused and change nothing */
  CHECK_RC(c, tpc_comm_set_cutover(c, PACKET_MAX + 16, 0), TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "packet_max_bytes (1024)");
  CHECK_RC(c, tpc_comm_set_cutover(c, 0, PACKET_MAX + 1), TPC_ERR_INVALID_ARG);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 16, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  CHECK_RC(NULL, tpc_comm_set_cutover(NULL, 0, 0), TPC_ERR_INVALID_ARG);
  CHECK_RC(c, tpc_comm_set_cutover(c, PACKET_MAX, PACKET_MAX), TPC_OK);

  /* what the kernel is given */
  const int launches = fake.launches;
  CHECK_RC(c, tpc_all_reduce(c, in + 32, out + 64, 96, TPC_BFLOAT16, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launches, launches + 1);
  CHECK_EQ(fake.last_op_entry, FK_LAUNCH_ALL_REDUCE);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  CHECK_PTR(fake.last_stream, STREAM_A);
  check_args(&w, r, in + 32, out + 64, 96, 96, TPC_BFLOAT16, TPC_OP_ALL_REDUCE);

  /* every rank gets the same table of buffers, and its own rank */
  for (int q = 0; q < 4; ++q) {
    CHECK_RC(w.comm[q], tpc_all_reduce(w.comm[q], in, out, 4096, TPC_FLOAT16, TPC_ALGO_AUTO, STREAM_B), TPC_OK);
    CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
    check_args(&w, q, in, out, 4096, 4096, TPC_FLOAT16, TPC_OP_ALL_REDUCE);
  }
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

static void test_all_gather(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 0));
  tpc_comm *c = w.comm[1];
  unsigned char *in = scratch_in, *out = scratch_out;
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_STATE);
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
      {0, 4, 0, 0, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "all_gather of 0 bytes"},
      {6, 6, 0, 0, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "multiple of 4"},
      {64, 0, 0, 0, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "row of 0 bytes"},
      {64, 6, 0, 0, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "row of 6 bytes"},
      {48, 32, 0, 0, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "dividing 48"},
      {64, 128, 0, 0, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "dividing 64"},
      {64, 64, 2, 0, TPC_ALGO_AUTO, TPC_ERR_INVALID_ARG, "4-byte aligned"},
      {64, 64, 0, 2, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "4-byte aligned"},
      /* bulk needs 16-byte sizes, rows and pointers */
      {20, 20, 0, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "bulk all_gather needs 16-byte"},
      {64, 8, 0, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "bulk all_gather needs 16-byte"},
      {64, 64, 4, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "bulk all_gather needs 16-byte"},
      {64, 64, 0, 8, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "bulk all_gather needs 16-byte"},
      /* caps: bulk on the output (world * nbytes), packet on the input */
      {MAX_BYTES / 2 + 16, 16, 0, 0, TPC_ALGO_BULK, TPC_ERR_TOO_LARGE, "output of 4128 bytes is over the cap of 4096"},
      {PACKET_MAX + 4, 4, 0, 0, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "1028 bytes per rank is over the packet cap of 1024"},
      /* AUTO past the packet cap where bulk is impossible: too large */
      {PACKET_MAX + 8, 8, 0, 0, TPC_ALGO_AUTO, TPC_ERR_TOO_LARGE, "over the packet cap"},
      {MAX_BYTES / 2 + 16, 16, 0, 0, TPC_ALGO_AUTO, TPC_ERR_TOO_LARGE, "over the packet cap"},
      {64, 64, 0, 0, 5, TPC_ERR_INVALID_ARG, "unknown algorithm 5"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    CHECK_RC(c, tpc_all_gather(c, in + cases[i].in_off, out + cases[i].out_off, cases[i].nbytes,
                               cases[i].row, (tpc_algo)cases[i].algo, STREAM_A),
             cases[i].want);
    CHECK_MSG(c, cases[i].needle);
  }
  CHECK_RC(c, tpc_all_gather(c, NULL, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_INVALID_ARG);
  CHECK_EQ(fake.launches, 0);

  /* AUTO: packet up to the all-gather cutover, bulk above when possible,
   * packet when bulk is impossible */
  CHECK_RC(c, tpc_comm_set_cutover(c, 16, 64), TPC_OK);
  struct {
    size_t nbytes, row, in_off, out_off;
    int want_algo;
  } autos[] = {
      {64, 64, 0, 0, TPC_ALGO_PACKET},   /* at the cutover */
      {80, 80, 0, 0, TPC_ALGO_BULK},     /* just above */
      {80, 16, 0, 0, TPC_ALGO_BULK},     /* 16-byte rows are fine */
      {MAX_BYTES / 2, MAX_BYTES / 2, 0, 0, TPC_ALGO_BULK}, /* output exactly max_bytes */
      {128, 8, 0, 0, TPC_ALGO_PACKET},   /* row not a multiple of 16 */
      {132, 132, 0, 0, TPC_ALGO_PACKET}, /* size not a multiple of 16 */
      {128, 128, 4, 0, TPC_ALGO_PACKET}, /* input only 4-byte aligned */
      {128, 128, 0, 4, TPC_ALGO_PACKET}, /* output only 4-byte aligned */
      {PACKET_MAX, 4, 0, 0, TPC_ALGO_PACKET},
  };
  for (size_t i = 0; i < sizeof autos / sizeof autos[0]; ++i) {
    const int before = fake.launches;
    CHECK_RC(c, tpc_all_gather(c, in + autos[i].in_off, out + autos[i].out_off, autos[i].nbytes,
                               autos[i].row, TPC_ALGO_AUTO, STREAM_A),
             TPC_OK);
    CHECK_EQ(fake.launches, before + 1);
    CHECK_EQ(fake.last_op_entry, FK_LAUNCH_ALL_GATHER);
    CHECK_EQ(fake.last_algo, autos[i].want_algo);
    CHECK_EQ(fake.last_args.nbytes, autos[i].nbytes);
    CHECK_EQ(fake.last_args.row_bytes, autos[i].row);
  }
  CHECK_RC(c, tpc_comm_set_cutover(c, 16, 16), TPC_OK);
  CHECK_RC(c, tpc_all_gather(c, in, out, 32, 32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);

  /* the all-reduce cutover does not move the all-gather one */
  CHECK_RC(c, tpc_comm_set_cutover(c, PACKET_MAX, 0), TPC_OK);
  CHECK_RC(c, tpc_all_gather(c, in, out, 16, 16, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 16, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);

  /* arguments */
  CHECK_RC(c, tpc_all_gather(c, in + 4, out + 8, 120, 12, TPC_ALGO_PACKET, STREAM_C), TPC_OK);
  CHECK_PTR(fake.last_stream, STREAM_C);
  check_args(&w, 1, in + 4, out + 8, 120, 12, 0, TPC_OP_ALL_GATHER);
  CHECK_RC(c, tpc_all_gather(c, in, out, 2048, 2048, TPC_ALGO_BULK, STREAM_C), TPC_OK);
  check_args(&w, 1, in, out, 2048, 2048, 0, TPC_OP_ALL_GATHER);

  fake_fail_nth(FK_LAUNCH_ALL_GATHER, 1, 97);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_C), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching all_gather failed: fake error 97");
  destroy_world(&w);
  CHECK_ALL_RELEASED();

  /* world 8: 1024 bytes per rank is within the packet cap but its 8192-byte
   * output is over max_bytes, so AUTO stays on packet past the cutover and
   * a forced bulk is too large */
  CHECK(make_world(&w, 8, 1));
  c = w.comm[5];
  CHECK_RC(c, tpc_comm_set_cutover(c, 16, 16), TPC_OK);
  CHECK_RC(c, tpc_all_gather(c, in, out, 512, 512, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK); /* 4096 bytes out: fits */
  CHECK_RC(c, tpc_all_gather(c, in, out, 1024, 1024, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  check_args(&w, 5, in, out, 1024, 1024, 0, TPC_OP_ALL_GATHER);
  CHECK_RC(c, tpc_all_gather(c, in, out, 1024, 1024, TPC_ALGO_BULK, STREAM_A), TPC_ERR_TOO_LARGE);
  CHECK_MSG(c, "output of 8192 bytes");
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

static void test_async_error(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[0];
  unsigned char *in = scratch_in, *out = scratch_out;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);

  /* the device records a timeout waiting for peer 1 */
  volatile tpc_async_error *rec = w.err_host[0];
  rec->peer = 1;
  rec->epoch = 7;
  rec->detail = 0;
  rec->code = TPC_ERR_TIMEOUT;
  tpc_async_error e;
  memset(&e, 0, sizeof e);
  CHECK_RC(c, tpc_comm_async_error(c, &e), TPC_ERR_TIMEOUT);
  CHECK_EQ(e.code, TPC_ERR_TIMEOUT);
  CHECK_EQ(e.peer, 1);
  CHECK_EQ(e.epoch, 7);
  CHECK_MSG(c, "peer 1");
  CHECK_MSG(c, "rank 0");
  CHECK_MSG(c, "2.000 s");
  CHECK_MSG(c, "op #7");
  CHECK_RC(c, tpc_comm_async_error(c, NULL), TPC_ERR_TIMEOUT);

  /* the communicator refuses further work, without launching */
  const int launches = fake.launches;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_TIMEOUT);
  CHECK_MSG(c, "peer 1");
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_TIMEOUT);
  CHECK_EQ(fake.launches, launches);
  /* and keeps refusing even if the record is cleared: the failure is sticky */
  rec->code = TPC_OK;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_STATE);
  CHECK_MSG(c, "failed earlier");
  CHECK_EQ(fake.launches, launches);

  /* the other rank is unaffected */
  CHECK_RC(w.comm[1], tpc_all_reduce(w.comm[1], in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_RC(w.comm[1], tpc_comm_async_error(w.comm[1], &e), TPC_OK);
  CHECK_EQ(e.code, TPC_OK);

  /* a mismatch names the peer and the size it sent */
  rec = w.err_host[1];
  rec->peer = 0;
  rec->epoch = 3;
  rec->detail = 96;
  rec->code = TPC_ERR_MISMATCH;
  CHECK_RC(w.comm[1], tpc_all_gather(w.comm[1], in, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_MISMATCH);
  CHECK_MSG(w.comm[1], "peer 0");
  CHECK_MSG(w.comm[1], "96 bytes");
  CHECK_MSG(w.comm[1], "op #3");
  CHECK_RC(w.comm[1], tpc_comm_async_error(w.comm[1], &e), TPC_ERR_MISMATCH);
  CHECK_EQ(e.detail, 96);
  CHECK_RC(NULL, tpc_comm_async_error(NULL, &e), TPC_ERR_INVALID_ARG);
  destroy_world(&w);
  CHECK_ALL_RELEASED();

  /* any other device code is passed through */
  CHECK(make_world(&w, 2, 1));
  rec = w.err_host[1];
  rec->peer = 0;
  rec->code = TPC_ERR_PEER;
  CHECK_RC(w.comm[1], tpc_comm_async_error(w.comm[1], &e), TPC_ERR_PEER);
  CHECK_MSG(w.comm[1], "device error 3 from peer 0");
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

static void test_stream_switch(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[0];
  unsigned char *in = scratch_in, *out = scratch_out;

  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 0); /* same stream: nothing to wait for */

  /* a new stream: the previous stream's op must finish first */
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_B), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 1);
  CHECK_PTR(fake.last_synced_stream, STREAM_A);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_B), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 1);

  /* while capturing: no synchronisation (illegal during capture), and the
   * captured stream does not become the eager one */
  fake.capturing = 1;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_C), TPC_OK);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 1);
  fake.capturing = 0;
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_B), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 1); /* B was the last eager stream */
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_C), TPC_OK);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], 2);
  CHECK_PTR(fake.last_synced_stream, STREAM_B);

  /* failures of the stream queries are reported and nothing is launched */
  int launches = fake.launches;
  fake_fail_nth(FK_STREAM_SYNCHRONIZE, 1, 81);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "waiting for the previous stream failed: fake error 81");
  fake_fail_nth(FK_STREAM_IS_CAPTURING, 1, 82);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_RUNTIME);
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
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, NULL), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  /* an op on the NULL (default) stream followed by one on another stream does not synchronise the NULL stream (comm.c uses last_stream == NULL as 'no previous op') */
  CHECK(fake.calls[FK_STREAM_SYNCHRONIZE] == 1 && fake.last_synced_stream == NULL);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, NULL), TPC_OK);
  CHECK_PTR(fake.last_synced_stream, STREAM_A); /* the other direction works */
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* Ops launch on the communicator's device, whatever the caller's current
 * device is, and leave the caller's current device as it was. */
static void test_launch_device(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1)); /* devices 0 and 1 */
  unsigned char *in = scratch_in, *out = scratch_out;
  tpc_comm *c = w.comm[1];

  fake.current_device = 6;
  int set_calls = fake.calls[FK_SET_DEVICE];
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launch_device, 1);
  CHECK_EQ(fake.current_device, 6);
  CHECK_EQ(fake.calls[FK_SET_DEVICE] - set_calls, 2);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launch_device, 1);
  CHECK_EQ(fake.current_device, 6);

  /* already on the right device: no switching */
  fake.current_device = 1;
  set_calls = fake.calls[FK_SET_DEVICE];
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launch_device, 1);
  CHECK_EQ(fake.calls[FK_SET_DEVICE], set_calls);

  /* the other rank's communicator goes to its own device */
  CHECK_RC(w.comm[0], tpc_all_reduce(w.comm[0], in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_B), TPC_OK);
  CHECK_EQ(fake.launch_device, 0);
  CHECK_EQ(fake.current_device, 1);

  /* failures: nothing launched, the caller's device kept */
  fake.current_device = 4;
  int launches = fake.launches;
  fake_fail_nth(FK_GET_DEVICE, 1, 61);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "fake error 61");
  fake_fail_nth(FK_SET_DEVICE, 1, 62);
  CHECK_RC(c, tpc_all_gather(c, in, out, 64, 64, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "fake error 62");
  CHECK_EQ(fake.launches, launches);
  CHECK_EQ(fake.current_device, 4);
  /* a failed launch still puts the caller's device back */
  fake_fail_nth(FK_LAUNCH_ALL_REDUCE, 1, 63);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_AUTO, STREAM_A), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching all_reduce failed: fake error 63");
  CHECK_EQ(fake.current_device, 4);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* Many communicators created and destroyed in a loop, with failures injected
 * at every runtime call of the set-up in turn: never a leak. */
static void test_no_leaks_under_failures(void) {
  static const fake_entry entries[] = {FK_SET_DEVICE, FK_DEVICE_MALLOC, FK_DEVICE_MEMSET,
                                       FK_HOST_ALLOC_MAPPED, FK_DEVICE_SYNCHRONIZE, FK_IPC_EXPORT,
                                       FK_IPC_OPEN};
  for (size_t i = 0; i < sizeof entries / sizeof entries[0]; ++i) {
    for (int nth = 1; nth <= 3; ++nth) {
      fake_reset();
      fake_fail_nth(entries[i], nth, 5);
      world w;
      quiet_make_world = 1;
      const int ok = make_world(&w, 3, 1);
      quiet_make_world = 0;
      CHECK(!ok || fake.calls[entries[i]] < nth); /* either the failure hit, or it was never reached */
      for (int r = 0; r < 3; ++r) tpc_comm_destroy(w.comm[r]);
      if (fake.live_device || fake.live_host || fake.live_opens || fake.bad_device_frees ||
          fake.bad_host_frees || fake.bad_closes)
        fprintf(stderr, "  (failing %s, call %d)\n", fake_entry_name(entries[i]), nth);
      CHECK_ALL_RELEASED();
    }
  }
}

/* ----------------------------------------------------------------- main */

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
  RUN(test_destroy_failures);
  RUN(test_probe);
  RUN(test_all_reduce_validation);
  RUN(test_all_reduce_algo_and_args);
  RUN(test_all_gather);
  RUN(test_async_error);
  RUN(test_stream_switch);
  RUN(test_launch_device);
  RUN(test_no_leaks_under_failures);

  free(scratch_in);
  free(scratch_out);
  printf("%d passed, %d failed\n", n_pass, n_fail);
  return n_fail ? 1 : 0;
}
