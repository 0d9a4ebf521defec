/*
 * Tests of the C core (csrc/core: life cycle, ops, errors, registry) over the fake runtime: no
 * CUDA, no GPU.
 * Several fake ranks live in this one process and open each other's buffers.
 *
 * Prints every failed check as file:line, then exactly one line
 * "N passed, M failed"; exits 1 when M > 0.

 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/tpcomm.h"
#include "fake_runtime.h"
#include "layout.h"
#include "registry.h"

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
  uint64_t id[TPC_MAX_RANKS];
  tpc_control *control[TPC_MAX_RANKS];     /* each rank's control slot */
  void *chunk[TPC_MAX_RANKS];              /* the pool chunk it lies in */
  tpc_async_error *err_host[TPC_MAX_RANKS];
  void *err_device[TPC_MAX_RANKS];
  unsigned char handle[TPC_MAX_RANKS][TPC_IPC_HANDLE_BYTES];
} world;

/* The registry entry of an id (never moves once handed out), or NULL. */
static tpc_entry *entry_of(uint64_t id) {
  tpc_registry_lock();
  tpc_entry *e = tpc_registry_find(id);
  tpc_registry_unlock();
  return e;
}

/* Creates and exports n ranks; opens peers and readies them when `connect`.
 * Rank r is on device world_device_base + r. */
static int quiet_make_world; /* failures are expected: do not print them */
static int world_device_base;

static int make_world(world *w, int n, int connect) {
  memset(w, 0, sizeof *w);
  w->n = n;
  for (int r = 0; r < n; ++r) {
    tpc_config c = config(r, n);
    c.device = world_device_base + r;
    if (tpc_comm_create(&c, &w->comm[r]) != TPC_OK) {
      if (!quiet_make_world)
        fprintf(stderr, "make_world: create of rank %d failed: %s\n", r, tpc_comm_last_error(NULL));
      return 0;
    }
    w->id[r] = tpc_comm_id(w->comm[r]);
    const tpc_entry *e = entry_of(w->id[r]);
    if (!e) return 0;
    w->control[r] = e->control;
    w->chunk[r] = e->control_chunk;
    w->err_host[r] = e->record;
    w->err_device[r] = e->record_device;
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

/* The blob tpc_comm_export writes (TPC_IPC_HANDLE_BYTES): [0, 64) the
 * buffer's handle, [64, 128) the control chunk's, [128, 136) the control
 * slot's byte offset in that chunk (uint64), the rest zero. */
#define BLOB_CHUNK_AT TPC_ALLOC_HANDLE_BYTES
#define BLOB_OFFSET_AT (2 * TPC_ALLOC_HANDLE_BYTES)
#define BLOB_USED (BLOB_OFFSET_AT + 8)

static void *blob_buffer(const unsigned char *blob) { return fake_handle_pointer(blob); }
static void *blob_chunk(const unsigned char *blob) { return fake_handle_pointer(blob + BLOB_CHUNK_AT); }
static uint64_t blob_offset(const unsigned char *blob) {
  uint64_t offset;
  memcpy(&offset, blob + BLOB_OFFSET_AT, sizeof offset);
  return offset;
}
static void blob_set_offset(unsigned char *blob, uint64_t offset) {
  memcpy(blob + BLOB_OFFSET_AT, &offset, sizeof offset);
}

/* ---------------------------------------------------------------- tests */

static void test_result_strings(void) {
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

static void test_layout(void) {
  /* sizeof the signal block fits its reserved space */
  CHECK(sizeof(tpc_signals) <= TPC_SIGNALS_BYTES);
  /* one configuration worked out by hand: world 2, max 4096, packet 1024 */
  tpc_layout l = tpc_layout_for(2, 4096, 1024);
  CHECK_EQ(TPC_STREAM_FLAGS_BYTES, 16384);         /* 2 parities x 128 blocks x 8 senders x 8 bytes */
  CHECK_EQ(l.packet_off, 16384 + 16384);           /* signals, then the stream flags */
  CHECK_EQ(l.packet_slot_bytes, 4096);             /* round_up(2 * 1024, 4096) */
  CHECK_EQ(l.data_off, 32768 + 2 * 2 * 4096);      /* 49152 */
  CHECK_EQ(l.data_bytes, 12288);                   /* round_up(2 * 4096 + 32, 4096) */
  CHECK_EQ(l.total_bytes, 61440);
  /* regions do not overlap, are page aligned, and packet slots hold 2x the input */
  for (int n = 2; n <= TPC_MAX_RANKS; ++n) {
    tpc_layout m = tpc_layout_for(n, 1u << 20, 64u << 10);
    CHECK(m.packet_off >= TPC_SIGNALS_BYTES + TPC_STREAM_FLAGS_BYTES);
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
    CHECK_EQ(fake.calls[FK_SET_DEVICE] + fake.calls[FK_DEVICE_MALLOC] + fake.calls[FK_HOST_ALLOC_MAPPED] +
                 fake.calls[FK_ALLOC_CONTROL_CHUNK] + fake.calls[FK_MEMCPY_ANY],
             0);
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
  /* the error record comes from the never-freed pool, not a per-communicator
   * host-mapped allocation */
  CHECK_EQ(fake.host_allocs, 0);
  CHECK_EQ(fake.calls[FK_HOST_ALLOC_MAPPED], 0);
  CHECK_EQ(tpc_comm_open_peer_count(comm), 0);
  /* an id, and a control slot in pool memory holding alive = id, epoch 0, failed 0 */
  const uint64_t id = tpc_comm_id(comm);
  CHECK(id != 0);
  const tpc_entry *entry = entry_of(id);
  CHECK(entry != NULL);
  if (!entry) return;
  CHECK_EQ(entry->id, id);
  CHECK_PTR(entry->comm, comm);
  CHECK_EQ(entry->state, TPC_ENTRY_OPEN);
  CHECK_EQ(entry->in_use, 0);
  CHECK_EQ(entry->rank, 1);
  CHECK_EQ(entry->timeout_ns, TIMEOUT_NS);
  tpc_control *slot = entry->control;
  CHECK(fake_is_control_memory(slot));
  CHECK_EQ(slot->alive, (uint32_t)id);
  CHECK_EQ(slot->epoch, 0);
  CHECK_EQ(slot->failed, 0);
  /* initialised with one memcpy_any of the whole slot */
  CHECK(fake_event_index(FK_MEMCPY_ANY, slot, 0) >= 0);
  CHECK(entry->record != NULL && entry->record_device != NULL);
  CHECK(entry->record != entry->record_device);
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
  /* export writes the handle of the registered buffer, then the handle of
   * the control slot's pool chunk and the slot's offset in it (see
   * test_export_blob for the layout in detail) */
  CHECK_EQ(TPC_IPC_HANDLE_BYTES, 144);
  CHECK_EQ(TPC_ALLOC_HANDLE_BYTES, 64);
  unsigned char handle[TPC_IPC_HANDLE_BYTES];
  const int exports = fake.calls[FK_IPC_EXPORT];
  CHECK_RC(comm, tpc_comm_export(comm, handle), TPC_OK);
  CHECK_EQ(fake.calls[FK_IPC_EXPORT], exports + 2);
  CHECK_PTR(fake_handle_pointer(handle), fake.last_malloc);
  CHECK_PTR(blob_chunk(handle), entry->control_chunk);
  CHECK_PTR((char *)entry->control_chunk + blob_offset(handle), slot);
  CHECK_RC(comm, tpc_comm_export(comm, NULL), TPC_ERR_INVALID_ARG);
  CHECK_RC(NULL, tpc_comm_export(NULL, handle), TPC_ERR_INVALID_ARG);
  fake_fail_nth(FK_IPC_EXPORT, 1, 31);
  CHECK_RC(comm, tpc_comm_export(comm, handle), TPC_ERR_RUNTIME);
  CHECK_MSG(comm, "exporting the IPC handle failed: fake error 31");
  /* the chunk's export failing: its own message */
  fake_fail_nth(FK_IPC_EXPORT, 2, 32);
  CHECK_RC(comm, tpc_comm_export(comm, handle), TPC_ERR_RUNTIME);
  CHECK_MSG(comm, "exporting the control slot's IPC handle failed: fake error 32");

  const int syncs = fake.calls[FK_DEVICE_SYNCHRONIZE];
  CHECK_RC(NULL, tpc_comm_destroy(comm), TPC_OK);
  CHECK(fake.calls[FK_DEVICE_SYNCHRONIZE] > syncs); /* waits before freeing */
  CHECK_EQ(fake.device_frees, 1);
  CHECK_EQ(fake.host_frees, 0);
  CHECK_ALL_RELEASED();
  CHECK_RC(NULL, tpc_comm_destroy(NULL), TPC_OK);
  /* the entry outlives the communicator, closed; the slot is dead */
  CHECK_EQ(entry->state, TPC_ENTRY_CLOSED);
  CHECK_PTR(entry->comm, NULL);
  CHECK_EQ(slot->alive, 0);
  CHECK_RC(NULL, tpc_comm_abort(NULL), TPC_OK);
  CHECK_EQ(tpc_comm_id(NULL), 0);

  /* getters on NULL */
  CHECK_EQ(tpc_comm_world_size(NULL), 0);
  CHECK_EQ(tpc_comm_rank(NULL), -1);
  CHECK_EQ(tpc_comm_device(NULL), -1);
  CHECK_EQ(tpc_comm_buffer_bytes(NULL), 0);
  CHECK_EQ(tpc_comm_open_peer_count(NULL), 0);
}

/* Every runtime call of create failing in turn: the error names the step and
 * the runtime's message, and nothing leaks. */
#define FRESH_POOL_DEVICE 50 /* no other test creates on it: its pool is not allocated yet */
static void test_create_failures(void) {
  static const struct {
    fake_entry entry;
    const char *step;
    int device;
    int consumes_id; /* the failure comes after the id was handed out */
  } steps[] = {
      {FK_SET_DEVICE, "selecting the device failed", 0, 0},
      {FK_DEVICE_MALLOC, "allocating the registered buffer failed", 0, 0},
      {FK_DEVICE_MEMSET, "clearing the registered buffer failed", 0, 0},
      {FK_DEVICE_SYNCHRONIZE, "synchronising after set-up failed", 0, 0},
      /* the pool of a device is allocated by its first communicator */
      {FK_ALLOC_CONTROL_CHUNK, "allocating the control pool failed", FRESH_POOL_DEVICE, 0},
      {FK_MEMCPY_ANY, "initialising the control slot failed", 0, 1},
  };
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; ++i) {
    fake_reset();
    /* the id the next successful create gets, before this failure */
    tpc_config c = config(0, 2);
    tpc_comm *probe = NULL;
    CHECK_RC(NULL, tpc_comm_create(&c, &probe), TPC_OK);
    const uint64_t before = tpc_comm_id(probe);
    CHECK_RC(NULL, tpc_comm_destroy(probe), TPC_OK);
    const int chunks = fake_control_chunk_total();

    const int calls_before = fake.calls[steps[i].entry];
    fake_fail_nth(steps[i].entry, 1, 700 + (int)i);
    c.device = steps[i].device;
    tpc_comm *comm = (tpc_comm *)&c;
    CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_ERR_RUNTIME);
    CHECK_PTR(comm, NULL);
    CHECK_MSG(NULL, steps[i].step);
    char code_text[32];
    snprintf(code_text, sizeof code_text, "fake error %d", 700 + (int)i);
    CHECK_MSG(NULL, code_text);
    CHECK_EQ(fake.calls[steps[i].entry], calls_before + 1);
    CHECK_EQ(fake.calls[FK_HOST_ALLOC_MAPPED], 0);
    CHECK_EQ(fake_control_chunk_total(), chunks); /* a failed chunk is not kept */
    CHECK_ALL_RELEASED();

    /* ids: one taken by a create that failed after getting it is retired
     * (closed, never handed out again); earlier failures take none */
    CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_OK);
    const uint64_t next = tpc_comm_id(comm);
    CHECK_EQ(next, before + 1 + (uint64_t)steps[i].consumes_id);
    if (steps[i].consumes_id) {
      tpc_comm *got = (tpc_comm *)&c;
      CHECK_RC(NULL, tpc_comm_acquire(before + 1, &got), TPC_ERR_CLOSED);
      CHECK_PTR(got, NULL);
      CHECK_MSG(NULL, "closed");
      CHECK_RC(NULL, tpc_id_async_error(before + 1, NULL), TPC_ERR_CLOSED);
      const tpc_entry *e = entry_of(before + 1);
      CHECK(e != NULL && e->comm == NULL && e->state == TPC_ENTRY_CLOSED && e->control->alive == 0);
    }
    if (steps[i].entry == FK_ALLOC_CONTROL_CHUNK) {
      /* the retry allocated the device's pool */
      CHECK_EQ(fake.calls[FK_ALLOC_CONTROL_CHUNK], calls_before + 2);
      CHECK_EQ(fake_control_chunk_total(), chunks + 1);
    }
    CHECK_RC(NULL, tpc_comm_destroy(comm), TPC_OK);
    CHECK_ALL_RELEASED();
  }

  /* After a failed create, a good one works and the message of the failed
   * one stays until the next failure. */
  fake_reset();
  tpc_config c = config(0, 2);
  fake_fail_nth(FK_DEVICE_MALLOC, 1, 44);
  tpc_comm *comm = NULL;
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_ERR_RUNTIME);
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_OK);
  CHECK_MSG(NULL, "fake error 44");
  CHECK_RC(NULL, tpc_comm_destroy(comm), TPC_OK);
  CHECK_MSG(NULL, "fake error 44");
  CHECK_ALL_RELEASED();

  /* The pool covers devices 0..63: a higher ordinal is refused with the
   * reason (no id, nothing allocated) instead of indexing past the pool. */
  fake_reset();
  c = config(0, 2);
  c.device = 64;
  comm = (tpc_comm *)&c;
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_ERR_INVALID_ARG);
  CHECK_MSG(NULL, "device 64 is outside 0..63");
  CHECK_PTR(comm, NULL);
  CHECK_EQ(fake.calls[FK_ALLOC_CONTROL_CHUNK], 0);
  CHECK_ALL_RELEASED();
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

  /* peers in any order: 2 first; its buffer, then its control chunk */
  int from = fake.n_events;
  CHECK_RC(c0, tpc_comm_open_peer(c0, 2, w.handle[2]), TPC_OK);
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  const int open_buf = fake_event_index(FK_IPC_OPEN, w.buf[2], from);
  const int open_chunk = fake_event_index(FK_IPC_OPEN, w.chunk[2], from);
  CHECK(open_buf >= 0 && open_chunk > open_buf);
  CHECK_EQ(fake_open_count(w.buf[2]), 1);
  CHECK_EQ(fake_open_count(w.chunk[2]), 1);
  CHECK_RC(c0, tpc_comm_open_peer(c0, 2, w.handle[2]), TPC_ERR_STATE);
  CHECK_MSG(c0, "peer 2 is already open");
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  CHECK_EQ(fake.ipc_opens, 2);
  CHECK_EQ(fake.live_opens, 2);

  CHECK_RC(c0, tpc_comm_ready(c0), TPC_ERR_STATE);
  CHECK_MSG(c0, "peer 1 has not been opened");

  /* an open that fails in the runtime: TPC_ERR_PEER naming the peer and the
   * runtime's message; the peer stays closed and can be retried */
  fake_fail_nth(FK_IPC_OPEN, 1, 217);
  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, w.handle[1]), TPC_ERR_PEER);
  CHECK_MSG(c0, "opening the IPC handle of peer 1 failed");
  CHECK_MSG(c0, "fake error 217");
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  CHECK_EQ(fake.live_opens, 2);
  CHECK_EQ(fake.calls[FK_IPC_CLOSE], 0); /* nothing was open to close */

  /* the control chunk's open failing: the buffer, already open, is closed
   * again (no open leaked), TPC_ERR_PEER names the peer and the step */
  from = fake.n_events;
  const int opens = fake.ipc_opens, closes = fake.ipc_closes;
  fake_fail_nth(FK_IPC_OPEN, 2, 218);
  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, w.handle[1]), TPC_ERR_PEER);
  CHECK_MSG(c0, "opening the control slot of peer 1 failed");
  CHECK_MSG(c0, "fake error 218");
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  CHECK_EQ(fake.ipc_opens, opens + 1);
  CHECK_EQ(fake.ipc_closes, closes + 1);
  CHECK_EQ(fake.live_opens, 2);
  CHECK_EQ(fake_open_count(w.buf[1]), 0);
  CHECK_EQ(fake_open_count(w.chunk[1]), 0);
  CHECK_EQ(fake.bad_closes, 0);
  {
    const int buf_open = fake_event_index(FK_IPC_OPEN, w.buf[1], from);
    const int chunk_open = fake_event_index(FK_IPC_OPEN, w.chunk[1], from);
    const int buf_close = fake_event_index(FK_IPC_CLOSE, w.buf[1], from);
    CHECK(buf_open >= 0 && chunk_open > buf_open && buf_close > chunk_open);
    if (chunk_open >= 0) CHECK(fake.events[chunk_open].failed);
  }

  /* a handle that is not one (garbage bytes): its offset (0x3c3c...) is not
   * a multiple of 16, refused before the runtime is asked */
  unsigned char junk[TPC_IPC_HANDLE_BYTES];
  memset(junk, 0x3c, sizeof junk);
  int open_calls = fake.calls[FK_IPC_OPEN];
  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, junk), TPC_ERR_PEER);
  CHECK_MSG(c0, "control slot offset");
  CHECK_EQ(fake.calls[FK_IPC_OPEN], open_calls);
  /* garbage with a plausible offset: the runtime refuses the buffer's handle */
  blob_set_offset(junk, 0);
  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, junk), TPC_ERR_PEER);
  CHECK_MSG(c0, "opening the IPC handle of peer 1 failed");
  CHECK_EQ(fake.bad_opens, 1);
  /* a good buffer handle with a garbage chunk handle: refused, the buffer
   * closed again */
  memcpy(junk, w.handle[1], BLOB_CHUNK_AT);
  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, junk), TPC_ERR_PEER);
  CHECK_MSG(c0, "opening the control slot of peer 1 failed");
  CHECK_EQ(fake.bad_opens, 2);
  CHECK_EQ(fake_open_count(w.buf[1]), 0);
  CHECK_EQ(fake.live_opens, 2);
  CHECK_EQ(tpc_comm_open_peer_count(c0), 1);
  fake.bad_opens = 0;

  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, w.handle[1]), TPC_OK);
  CHECK_EQ(tpc_comm_open_peer_count(c0), 2);
  CHECK_EQ(fake.live_opens, 4);
  CHECK_EQ(fake_open_count(w.buf[1]), 1);
  CHECK_EQ(fake_open_count(w.chunk[1]), 1);
  CHECK_RC(c0, tpc_comm_ready(c0), TPC_OK);
  CHECK_RC(c0, tpc_comm_ready(c0), TPC_OK); /* idempotent */

  CHECK_RC(c0, tpc_comm_open_peer(c0, 1, w.handle[1]), TPC_ERR_STATE);
  CHECK_MSG(c0, "ready was called");
  CHECK_EQ(tpc_comm_open_peer_count(c0), 2);

  /* rank 1 opened only one peer before being destroyed: that peer's two
   * handles are closed, nothing else */
  CHECK_RC(w.comm[1], tpc_comm_open_peer(w.comm[1], 0, w.handle[0]), TPC_OK);
  CHECK_RC(NULL, tpc_comm_ready(NULL), TPC_ERR_INVALID_ARG);

  const int closes_before = fake.ipc_closes;
  from = fake.n_events;
  CHECK_RC(NULL, tpc_comm_destroy(w.comm[1]), TPC_OK);
  CHECK_EQ(fake.ipc_closes - closes_before, 2);
  CHECK(fake_event_index(FK_IPC_CLOSE, w.buf[0], from) >= 0);
  CHECK(fake_event_index(FK_IPC_CLOSE, w.chunk[0], from) >= 0);
  w.comm[1] = NULL;
  CHECK_RC(NULL, tpc_comm_destroy(w.comm[0]), TPC_OK);
  CHECK_EQ(fake.ipc_closes - closes_before, 6);
  w.comm[0] = NULL;
  CHECK_RC(NULL, tpc_comm_destroy(w.comm[2]), TPC_OK);
  w.comm[2] = NULL;
  CHECK_EQ(fake.bad_opens, 0);
  CHECK_ALL_RELEASED();
}

/* A control slot offset in the blob that is not a multiple of 16 (the size
 * of a slot) or lies past the last slot of a chunk is refused with
 * TPC_ERR_PEER before anything is opened; the peer can still be opened with a
 * good blob. */
static void test_open_peer_bad_offset(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 0));
  tpc_comm *c = w.comm[0];
  static const uint64_t bad[] = {1, 4, 8, 12, 15, 17, 24, TPC_CONTROL_CHUNK_BYTES, TPC_CONTROL_CHUNK_BYTES + 16,
                                 0x8000000000000008ull, 0xfffffffffffffff0ull, UINT64_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    unsigned char blob[TPC_IPC_HANDLE_BYTES];
    memcpy(blob, w.handle[1], sizeof blob);
    blob_set_offset(blob, bad[i]);
    CHECK_RC(c, tpc_comm_open_peer(c, 1, blob), TPC_ERR_PEER);
    CHECK_MSG(c, "peer 1 sent a control slot offset of");
    char text[64];
    snprintf(text, sizeof text, "offset of %" PRIu64, bad[i]);
    CHECK_MSG(c, text);
  }
  CHECK_EQ(fake.calls[FK_IPC_OPEN], 0);
  CHECK_EQ(fake.live_opens, 0);
  CHECK_EQ(tpc_comm_open_peer_count(c), 0);
  /* the refusals left nothing behind: the good blob opens */
  CHECK_RC(c, tpc_comm_open_peer(c, 1, w.handle[1]), TPC_OK);
  CHECK_EQ(tpc_comm_open_peer_count(c), 1);
  CHECK_EQ(fake.live_opens, 2);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* destroy keeps releasing after a failing call and reports the first failure. */
static void test_destroy_failures(void) {
  /* rank 0 of 3 closes, in order: peer 1's buffer, peer 1's control chunk,
   * peer 2's buffer, peer 2's control chunk */
  static const struct {
    fake_entry entry;
    int nth;
    const char *step;
    int left_open; /* which handle stays open: 1 peer 1's buffer, 2 its chunk, 3 peer 2's buffer, 4 its chunk */
  } steps[] = {
      {FK_DEVICE_SYNCHRONIZE, 1, "synchronising before destroy failed", 0},
      {FK_IPC_CLOSE, 1, "closing a peer handle failed", 1},
      {FK_IPC_CLOSE, 2, "closing a peer's control slot failed", 2},
      {FK_IPC_CLOSE, 3, "closing a peer handle failed", 3},
      {FK_IPC_CLOSE, 4, "closing a peer's control slot failed", 4},
      {FK_MEMCPY_ANY, 1, "marking the control slot closed", 0},
  };
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; ++i) {
    fake_reset();
    world w;
    CHECK(make_world(&w, 3, 1));
    const int closes = fake.calls[FK_IPC_CLOSE];
    fake_fail_nth(steps[i].entry, steps[i].nth, 90);
    CHECK_RC(NULL, tpc_comm_destroy(w.comm[0]), TPC_ERR_RUNTIME);
    CHECK_MSG(NULL, steps[i].step); /* the message outlives the communicator */
    CHECK_MSG(NULL, "fake error 90");
    w.comm[0] = NULL;
    const int kept = steps[i].entry == FK_MEMCPY_ANY;
    /* every close is still attempted after a failing one (none when kept) */
    CHECK_EQ(fake.calls[FK_IPC_CLOSE] - closes, kept ? 0 : 4);
    /* what rank 0 still holds open (each of these is also open once by the
     * third rank) */
    void *const handles[4] = {w.buf[1], w.chunk[1], w.buf[2], w.chunk[2]};
    for (int h = 0; h < 4; ++h)
      CHECK_EQ(fake_open_count(handles[h]), 1 + (kept || steps[i].left_open == h + 1));
    CHECK_RC(NULL, tpc_comm_destroy(w.comm[1]), TPC_OK);
    CHECK_RC(NULL, tpc_comm_destroy(w.comm[2]), TPC_OK);
    /* the failed close is the one handle not closed; everything else is,
     * except when the slot could not be marked dead: a replayed graph would
     * still run, so the buffer and both peers' mappings (buffer and control
     * chunk each) are kept */
    CHECK_EQ(fake.live_device, kept ? 1 : 0);
    CHECK_EQ(fake.live_host, 0);
    CHECK_EQ(fake.live_opens, steps[i].left_open ? 1 : kept ? 4 : 0);
    CHECK_EQ(fake.bad_device_frees + fake.bad_host_frees + fake.bad_closes, 0);
    if (kept) CHECK_MSG(NULL, "the GPU memory is kept");
    if (kept) CHECK_EQ(fake_release_leftovers(), 1 + 4);
    /* the id is retired whatever failed; the slot is dead unless writing it
     * was the step that failed */
    tpc_comm *got = NULL;
    CHECK_RC(NULL, tpc_comm_acquire(w.id[0], &got), TPC_ERR_CLOSED);
    CHECK_MSG(NULL, "closed");
    CHECK_EQ(w.control[0]->alive, steps[i].entry == FK_MEMCPY_ANY ? (uint32_t)w.id[0] : 0u);
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

/* NaN patterns of the all-reduce dtypes, 8 bytes each. */
#define NAN_F32 0x7fc000007fc00000ull
#define NAN_F16 0x7e007e007e007e00ull
#define NAN_BF16 0x7fc07fc07fc07fc0ull

/* The recorded launch got this world's buffers, keyed by rank, the layout,
 * the rank's control slot and id, the op's kind word and its NaN pattern. */
static void check_args(const world *w, int rank, const void *in, void *out, size_t nbytes,
                       size_t row_bytes, int dtype, int op, int algo, uint64_t poison) {
  const tpc_kernel_args *a = &fake.last_args;
  const tpc_layout l = tpc_layout_for(w->n, MAX_BYTES, PACKET_MAX);
  for (int p = 0; p < TPC_MAX_RANKS; ++p) CHECK_PTR(a->bufs[p], p < w->n ? w->buf[p] : NULL);
  CHECK_PTR(a->err, w->err_device[rank]); /* the device view, not the host one */
  CHECK(a->err != (void *)w->err_host[rank]);
  CHECK_PTR(a->control, w->control[rank]);
  /* every peer's control slot, as mapped here (the fake maps at the peer's
   * own address); none for this rank or past the world */
  for (int p = 0; p < TPC_MAX_RANKS; ++p)
    CHECK_PTR(a->peer_control[p], p < w->n && p != rank ? w->control[p] : NULL);
  CHECK_EQ(a->alive_id, (uint32_t)w->id[rank]);
  CHECK_EQ(a->alive_id, w->control[rank]->alive); /* the open slot matches */
  CHECK_EQ(a->max_blocks, FAKE_MULTIPROCESSORS); /* the device's count, read at creation */
  CHECK_EQ(fake.last_algo, algo);
  CHECK_EQ(a->kind, tpc_kind_word(op, algo, dtype, row_bytes));
  CHECK_EQ(a->kind & 0xffu, (uint32_t)op);
  CHECK_EQ((a->kind >> 8) & 0xffu, (uint32_t)algo);
  CHECK_EQ(a->poison, poison);
  CHECK_EQ(a->poison_out, poison != 0);
  CHECK_EQ(a->out_bytes, op == TPC_OP_ALL_GATHER ? nbytes * (size_t)w->n : nbytes);
  CHECK_EQ(a->out_f32, 0);
  CHECK_PTR(a->in, in);
  CHECK_PTR(a->out, out);
  CHECK_EQ(a->nbytes, nbytes);
  CHECK_EQ(a->row_bytes, row_bytes);
  CHECK_EQ(a->timeout_ns, TIMEOUT_NS);
  CHECK_EQ(a->packet_off, l.packet_off);
  CHECK_EQ(a->packet_slot_bytes, l.packet_slot_bytes);
  CHECK_EQ(a->data_off, l.data_off);
  CHECK_EQ(a->data_bytes, l.data_bytes);
  CHECK_EQ(a->rank, rank);
  CHECK_EQ(a->world, w->n);
  CHECK_EQ(a->dtype, dtype);
  CHECK_EQ(a->op, op);
}

/* reduce_scatter: the checks of all_reduce on the chunk (packet cap on one
 * chunk, bulk cap on the whole input of world chunks), and the arguments its
 * kernels get. */
static void test_reduce_scatter(void) {
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
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_BULK, TPC_ERR_TOO_LARGE, "reduce_scatter of 4 x 1040 bytes is over the cap of 4096"},
      {64, 0, 0, TPC_FLOAT32, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "reduce_scatter has no line kernel"},
      {64, 0, 0, TPC_FLOAT32, 5, TPC_ERR_INVALID_ARG, "reduce_scatter: unknown algorithm 5 (packet 1, bulk 2 or line 3)"},
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
  CHECK_EQ(fake.calls[FK_LAUNCH_REDUCE_SCATTER], 3);
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
static void test_reduce_scatter_f32(void) {
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

static void test_all_reduce_add_rms_norm(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[1];
  unsigned char *in = scratch_in, *res = scratch_in + MAX_BYTES, *weight = scratch_in + 2 * MAX_BYTES;
  unsigned char *normed = scratch_out, *res_out = scratch_out + MAX_BYTES;
  static const struct {
    size_t nbytes, row_bytes;
    int dtype;
    size_t misalign; /* added to the weight pointer */
    float eps;
    tpc_result want;
    const char *needle;
  } cases[] = {
      {64, 64, TPC_FLOAT32, 0, 1e-6f, TPC_ERR_INVALID_ARG, "all_reduce_add_rms_norm: dtype 0 (float32) is not float16 or bfloat16"},
      {64, 24, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG, "a row of 24 bytes: a multiple of 16 up to 32768"},
      {64, 0, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG, "a row of 0 bytes"},
      {TPC_NORM_MAX_ROW_BYTES + 16, TPC_NORM_MAX_ROW_BYTES + 16, TPC_FLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG,
       "up to 32768"},
      {96, 64, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG, "of 96 bytes: a positive number of 64-byte rows"},
      {0, 64, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_INVALID_ARG, "of 0 bytes"},
      {PACKET_MAX + 64, 64, TPC_BFLOAT16, 0, 1e-6f, TPC_ERR_TOO_LARGE, "of 1088 bytes is over the packet cap of 1024"},
      {64, 64, TPC_BFLOAT16, 8, 1e-6f, TPC_ERR_INVALID_ARG, "every tensor must be 16-byte aligned"},
      {64, 64, TPC_BFLOAT16, 0, -1.0f, TPC_ERR_INVALID_ARG, "eps -1 is not in [0, 1]"},
      {64, 64, TPC_BFLOAT16, 0, 0.0f / 0.0f, TPC_ERR_INVALID_ARG, "is not in [0, 1]"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    CHECK_RC(c, tpc_all_reduce_add_rms_norm(c, in, res, weight + cases[i].misalign, normed, res_out, cases[i].nbytes,
                                            cases[i].row_bytes, (tpc_dtype)cases[i].dtype, cases[i].eps, STREAM_A),
             cases[i].want);
    CHECK_MSG(c, cases[i].needle);
  }
  CHECK_RC(c, tpc_all_reduce_add_rms_norm(c, in, NULL, weight, normed, res_out, 64, 64, TPC_BFLOAT16, 1e-6f, STREAM_A),
           TPC_ERR_INVALID_ARG);
  CHECK_MSG(c, "NULL residual, weight or residual output");
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_REDUCE_NORM], 0);
  /* 16 rows of 64 bytes (32 bf16 values), the packet cap exactly; in place */
  CHECK_RC(c, tpc_all_reduce_add_rms_norm(c, in, res, weight, in, res, PACKET_MAX, 64, TPC_BFLOAT16, 1e-5f, STREAM_A),
           TPC_OK);
  CHECK_EQ(fake.last_op_entry, FK_LAUNCH_ALL_REDUCE_NORM);
  check_args(&w, 1, in, in, PACKET_MAX, 64, TPC_BFLOAT16, TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, NAN_BF16);
  CHECK_PTR(fake.last_args.residual, res);
  CHECK_PTR(fake.last_args.weight, weight);
  CHECK_PTR(fake.last_args.out2, res);
  CHECK(fake.last_args.eps == 1e-5f);
  CHECK_RC(c, tpc_all_reduce_add_rms_norm(c, in, res, weight, normed, res_out, 128, 128, TPC_FLOAT16, 0.0f, STREAM_A),
           TPC_OK);
  check_args(&w, 1, in, normed, 128, 128, TPC_FLOAT16, TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, NAN_F16);
  CHECK_PTR(fake.last_args.out2, res_out);
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_REDUCE_NORM], 2);
  /* the other ops leave the norm's fields empty */
  CHECK_RC(c, tpc_all_reduce(c, in, normed, 64, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_PTR(fake.last_args.residual, NULL);
  CHECK_PTR(fake.last_args.out2, NULL);
  fake_fail_nth(FK_LAUNCH_ALL_REDUCE_NORM, 1, 78);
  CHECK_RC(c, tpc_all_reduce_add_rms_norm(c, in, res, weight, normed, res_out, 64, 64, TPC_BFLOAT16, 1e-6f, STREAM_A),
           TPC_ERR_RUNTIME);
  CHECK_MSG(c, "launching all_reduce_add_rms_norm failed");
  CHECK_RC(NULL, tpc_all_reduce_add_rms_norm(NULL, in, res, weight, normed, res_out, 64, 64, TPC_BFLOAT16, 1e-6f,
                                             STREAM_A),
           TPC_ERR_INVALID_ARG);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

static void test_all_reduce_validation(void) {
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
      {64, 2, 2, TPC_BFLOAT16, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      {64, 0, 0, 3, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "all_reduce: dtype 3 (no tpc_dtype) is not float32"},
      {64, 0, 0, -1, TPC_ALGO_PACKET, TPC_ERR_INVALID_ARG, "dtype -1"},
      {MAX_BYTES + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_BULK, TPC_ERR_TOO_LARGE, "over the cap of 4096"},
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "over the packet cap of 1024"},
      /* lines live in the packet slots: the packet cap, 16-byte sizes and pointers */
      {PACKET_MAX + 16, 0, 0, TPC_FLOAT32, TPC_ALGO_LINE, TPC_ERR_TOO_LARGE, "over the packet cap of 1024"},
      {40, 0, 0, TPC_BFLOAT16, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "multiple of 16"},
      {64, 8, 0, TPC_BFLOAT16, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "16-byte aligned"},
      /* the caller picks the kernel: 0 (no choice) and unknown values are refused, naming them */
      {64, 0, 0, TPC_FLOAT32, 0, TPC_ERR_INVALID_ARG, "all_reduce: unknown algorithm 0 (packet 1, bulk 2 or line 3)"},
      {64, 0, 0, TPC_FLOAT32, 4, TPC_ERR_INVALID_ARG, "all_reduce: unknown algorithm 4"},
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
  CHECK_RC(c, tpc_all_reduce(c, in, in, MAX_BYTES, TPC_BFLOAT16, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX, TPC_FLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in + 16, out + 48, 16, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_RC(c, tpc_all_reduce(c, in, in, PACKET_MAX, TPC_BFLOAT16, TPC_ALGO_LINE, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_LINE);
  CHECK_EQ(fake.last_args.kind, tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_LINE, TPC_BFLOAT16, PACKET_MAX));
  CHECK_EQ(fake.launches, 4);
  CHECK_EQ(fake.calls[FK_LAUNCH_ALL_GATHER], 0);

  /* a launch the runtime refuses */
  fake_fail_nth(FK_LAUNCH_ALL_REDUCE, 1, 98);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_ERR_RUNTIME);
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

  /* the kernel asked for runs, whatever the size (within its cap) */
  CHECK_RC(c, tpc_all_reduce(c, in, out, PACKET_MAX, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_PACKET);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 16, TPC_FLOAT32, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, MAX_BYTES, TPC_FLOAT32, TPC_ALGO_BULK, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_BULK);
  CHECK_RC(c, tpc_all_reduce(c, in, out, 512, TPC_FLOAT32, TPC_ALGO_LINE, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_algo, TPC_ALGO_LINE);
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

static void test_all_gather(void) {
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
      {20, 20, 0, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "bulk all_gather needs 16-byte"},
      {64, 8, 0, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "bulk all_gather needs 16-byte"},
      {64, 64, 4, 0, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      {64, 64, 0, 8, TPC_ALGO_BULK, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      /* caps: bulk on the output (world * nbytes), packet on the input */
      {MAX_BYTES / 2 + 16, 16, 0, 0, TPC_ALGO_BULK, TPC_ERR_TOO_LARGE, "output of 2 x 2064 bytes is over the cap of 4096"},
      {PACKET_MAX + 4, 4, 0, 0, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "1028 bytes per rank is over the packet cap of 1024"},
      {PACKET_MAX + 8, 8, 0, 0, TPC_ALGO_PACKET, TPC_ERR_TOO_LARGE, "over the packet cap"},
      /* line: 16-byte sizes, rows and pointers, up to the packet cap */
      {20, 20, 0, 0, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "line all_gather needs 16-byte sizes and rows"},
      {64, 8, 0, 0, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "line all_gather needs 16-byte sizes and rows"},
      {64, 64, 0, 8, TPC_ALGO_LINE, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned"},
      {PACKET_MAX + 16, 16, 0, 0, TPC_ALGO_LINE, TPC_ERR_TOO_LARGE, "1040 bytes per rank is over the packet cap of 1024"},
      {64, 64, 0, 0, 5, TPC_ERR_INVALID_ARG, "all_gather: unknown algorithm 5 (packet 1, bulk 2 or line 3)"},
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

static void test_async_error(void) {
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

static void test_describe(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 3, 1));
  const int r = 2;
  tpc_comm *c = w.comm[r];
  volatile tpc_async_error *rec = w.err_host[r];
  char id_text[64];
  snprintf(id_text, sizeof id_text, "communicator %" PRIu64, w.id[r]);
  const uint32_t ar_pk_f32 = tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, TPC_FLOAT32, 256);
  const uint32_t ar_bk_f32 = tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_BULK, TPC_FLOAT32, 256);
  const uint32_t ar_ln_f32 = tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_LINE, TPC_FLOAT32, 256);
  const uint32_t ar_pk_bf16 = tpc_kind_word(TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, TPC_BFLOAT16, 256);
  const uint32_t ag_pk_256 = tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0, 256);
  const uint32_t ag_pk_64 = tpc_kind_word(TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0, 64);

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
    CHECK_RC(NULL, tpc_id_async_error(w.id[r], &e), (tpc_result)cases[i].code);
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
  const uint64_t id = w.id[r];
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

static void test_stream_switch(void) {
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
static void test_launch_device(void) {
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

/* Many communicators created and destroyed in a loop, with failures injected
 * at every runtime call of the set-up in turn: never a leak. */
static void test_no_leaks_under_failures(void) {
  /* each entry and how often the set-up of 3 connected ranks calls it */
  static const struct {
    fake_entry entry;
    int calls;
  } entries[] = {
      {FK_SET_DEVICE, 3},         {FK_DEVICE_MALLOC, 3}, {FK_DEVICE_MEMSET, 3},
      {FK_DEVICE_SYNCHRONIZE, 3}, {FK_MEMCPY_ANY, 3},
      {FK_IPC_EXPORT, 3 * 2},     /* the buffer and the control chunk of each rank */
      {FK_IPC_OPEN, 3 * 2 * 2},   /* both, of each peer of each rank */
  };
  for (size_t i = 0; i < sizeof entries / sizeof entries[0]; ++i) {
    for (int nth = 1; nth <= entries[i].calls; ++nth) {
      fake_reset();
      fake_fail_nth(entries[i].entry, nth, 5);
      world w;
      quiet_make_world = 1;
      const int ok = make_world(&w, 3, 1);
      quiet_make_world = 0;
      CHECK(!ok); /* every one of those calls is made, and its failure fails the set-up */
      CHECK(fake.calls[entries[i].entry] >= nth);
      for (int r = 0; r < 3; ++r) tpc_comm_destroy(w.comm[r]);
      if (fake.live_device || fake.live_host || fake.live_opens || fake.bad_device_frees ||
          fake.bad_host_frees || fake.bad_closes)
        fprintf(stderr, "  (failing %s, call %d)\n", fake_entry_name(entries[i].entry), nth);
      CHECK_ALL_RELEASED();
    }
  }
}

/* ------------------------------------------- ids, registry, abort, control */

/* Ids are 1, 2, 3, ... across create/destroy cycles, never reused, and each
 * has its own control slot that is never handed out again. */
static void test_ids(void) {
  fake_reset();
  tpc_config c = config(0, 2);
  enum { CYCLES = 6 };
  uint64_t ids[CYCLES * 2];
  tpc_control *slots[CYCLES * 2];
  int n = 0;
  for (int cycle = 0; cycle < CYCLES; ++cycle) {
    /* two alive at once, then both destroyed: the next ones still get new ids */
    tpc_comm *a = NULL, *b = NULL;
    CHECK_RC(NULL, tpc_comm_create(&c, &a), TPC_OK);
    CHECK_RC(NULL, tpc_comm_create(&c, &b), TPC_OK);
    if (!a || !b) return;
    ids[n] = tpc_comm_id(a);
    slots[n++] = entry_of(tpc_comm_id(a))->control;
    ids[n] = tpc_comm_id(b);
    slots[n++] = entry_of(tpc_comm_id(b))->control;
    CHECK_RC(NULL, tpc_comm_destroy(cycle % 2 ? a : b), TPC_OK);
    CHECK_RC(NULL, tpc_comm_destroy(cycle % 2 ? b : a), TPC_OK);
  }
  CHECK(ids[0] != 0);
  for (int i = 1; i < n; ++i) CHECK_EQ(ids[i], ids[i - 1] + 1);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < i; ++j) CHECK(slots[i] != slots[j]);
  /* every retired slot stays dead, and says which id it was never again */
  for (int i = 0; i < n; ++i) {
    CHECK_EQ(slots[i]->alive, 0);
    const tpc_entry *e = entry_of(ids[i]);
    CHECK(e != NULL && e->id == ids[i] && e->state == TPC_ENTRY_CLOSED && e->comm == NULL);
  }
  CHECK(entry_of(0) == NULL);
  CHECK(entry_of(ids[n - 1] + 1) == NULL); /* not handed out yet */
  CHECK_ALL_RELEASED();
  /* a communicator made on another device gets the next id too (one id space) */
  c = config(1, 2);
  tpc_comm *d = NULL;
  CHECK_RC(NULL, tpc_comm_create(&c, &d), TPC_OK);
  CHECK_EQ(tpc_comm_id(d), ids[n - 1] + 1);
  CHECK_RC(NULL, tpc_comm_destroy(d), TPC_OK);
  CHECK_ALL_RELEASED();
}

/* A chunk holds 256 slots; the 257th communicator of a device gets a new
 * chunk, the old one is kept (never freed), and a failed chunk allocation
 * fails create cleanly and is retried by the next create. */
#define CHUNK_DEVICE 60
static void test_pool_chunks(void) {
  fake_reset();
  tpc_config c = config(0, 2);
  c.device = CHUNK_DEVICE;
  const int total = fake_control_chunk_total();
  tpc_control *first = NULL, *prev = NULL;
  int contiguous = 1, in_first_chunk = 1, offsets_ok = 1;
  for (int i = 0; i < 256; ++i) {
    tpc_comm *comm = NULL;
    if (tpc_comm_create(&c, &comm) != TPC_OK) {
      CHECK(0);
      return;
    }
    const tpc_entry *entry = entry_of(tpc_comm_id(comm));
    tpc_control *slot = entry->control;
    if (i == 0) first = slot;
    else contiguous &= slot == prev + 1;
    prev = slot;
    /* every slot records the chunk it is in; the export says where */
    in_first_chunk &= entry->control_chunk == (void *)first;
    unsigned char blob[TPC_IPC_HANDLE_BYTES];
    offsets_ok &= tpc_comm_export(comm, blob) == TPC_OK && blob_chunk(blob) == (void *)first &&
                  blob_offset(blob) == (uint64_t)i * sizeof(tpc_control);
    tpc_comm_destroy(comm);
  }
  CHECK(contiguous);
  CHECK(in_first_chunk);
  CHECK(offsets_ok);
  CHECK_EQ(fake.calls[FK_ALLOC_CONTROL_CHUNK], 1);
  CHECK_EQ(fake_control_chunk_total(), total + 1);
  CHECK_PTR(first, fake.last_control);
  CHECK_EQ(fake.last_chunk_n, 256);

  /* the chunk is full: the next create needs a new one; make it fail */
  fake_fail_nth(FK_ALLOC_CONTROL_CHUNK, 1, 88);
  tpc_comm *comm = (tpc_comm *)&c;
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_ERR_RUNTIME);
  CHECK_PTR(comm, NULL);
  CHECK_MSG(NULL, "allocating the control pool failed: fake error 88");
  CHECK_ALL_RELEASED();
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_OK);
  CHECK_EQ(fake.calls[FK_ALLOC_CONTROL_CHUNK], 3);
  CHECK_EQ(fake_control_chunk_total(), total + 2);
  const tpc_entry *e = comm ? entry_of(tpc_comm_id(comm)) : NULL;
  CHECK(e != NULL && e->control == fake.last_control && e->record == fake.last_records &&
        e->record_device == fake.last_records_device);
  /* the new slot is the first of the new chunk, and says so */
  CHECK(e != NULL && e->control_chunk == fake.last_control && e->control_chunk != (void *)first);
  unsigned char blob[TPC_IPC_HANDLE_BYTES];
  CHECK_RC(comm, tpc_comm_export(comm, blob), TPC_OK);
  CHECK_PTR(blob_chunk(blob), fake.last_control);
  CHECK_EQ(blob_offset(blob), 0);
  /* the old chunk's slots stay readable (graphs may still look at them) */
  CHECK_EQ(first->alive, 0);
  CHECK_EQ(prev->alive, 0);
  CHECK_RC(NULL, tpc_comm_destroy(comm), TPC_OK);
  CHECK_ALL_RELEASED();
}

/* tpc_id_all_reduce: acquire, the op, release, with every failure's message
 * in the thread's slot. */
static void test_id_all_reduce(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  unsigned char *in = scratch_in, *out = scratch_out;
  const uint64_t id = w.id[0];

  /* an open id: one launch, with that communicator's arguments, and released */
  int launches = fake.launches;
  CHECK_RC(NULL, tpc_id_all_reduce(id, in, out, 64, TPC_BFLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_EQ(fake.launches, launches + 1);
  CHECK_EQ(fake.last_args.alive_id, (uint32_t)id);
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

static void test_acquire(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  unsigned char *in = scratch_in, *out = scratch_out;
  const uint64_t id = w.id[0];
  char id_text[64];
  snprintf(id_text, sizeof id_text, "id %" PRIu64, id);

  /* an open id: the communicator, marked in use */
  tpc_comm *got = NULL;
  CHECK_RC(NULL, tpc_comm_acquire(id, &got), TPC_OK);
  CHECK_PTR(got, w.comm[0]);
  CHECK_EQ(entry_of(id)->in_use, 1);
  CHECK_EQ(entry_of(w.id[1])->in_use, 0); /* only that one */
  /* it runs ops while held */
  CHECK_RC(got, tpc_all_reduce(got, in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);

  /* a second acquire before release: TPC_ERR_STATE naming the id */
  tpc_comm *again = (tpc_comm *)&w;
  CHECK_RC(NULL, tpc_comm_acquire(id, &again), TPC_ERR_STATE);
  CHECK_PTR(again, NULL);
  CHECK_MSG(NULL, id_text);
  CHECK_MSG(NULL, "running an op (from another thread?)");
  CHECK_EQ(entry_of(id)->in_use, 1);
  /* the other rank's id is independent */
  tpc_comm *other = NULL;
  CHECK_RC(NULL, tpc_comm_acquire(w.id[1], &other), TPC_OK);
  CHECK_PTR(other, w.comm[1]);
  tpc_comm_release(other);

  /* destroy and abort while held: refused, and the communicator stays usable */
  CHECK_RC(w.comm[0], tpc_comm_destroy(w.comm[0]), TPC_ERR_STATE);
  CHECK_MSG(w.comm[0], "running an op (from another thread?)");
  CHECK_EQ(entry_of(id)->state, TPC_ENTRY_OPEN);
  CHECK_PTR(entry_of(id)->comm, w.comm[0]);
  CHECK_EQ(w.control[0]->alive, (uint32_t)id);
  CHECK_EQ(fake.live_device, 2);
  const int writes = fake.calls[FK_WRITE_ASYNC];
  CHECK_RC(w.comm[0], tpc_comm_abort(w.comm[0]), TPC_ERR_STATE);
  CHECK_EQ(fake.calls[FK_WRITE_ASYNC], writes); /* nothing written */
  CHECK_EQ(w.control[0]->alive, (uint32_t)id);
  CHECK_EQ(w.control[0]->failed, 0);
  CHECK_RC(w.comm[0], tpc_all_gather(w.comm[0], in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_OK);
  CHECK_EQ(fake.last_args.alive_id, (uint32_t)id);
  CHECK_RC(NULL, tpc_id_async_error(id, NULL), TPC_OK);

  /* release, then acquire works again */
  tpc_comm_release(got);
  CHECK_EQ(entry_of(id)->in_use, 0);
  CHECK_RC(NULL, tpc_comm_acquire(id, &got), TPC_OK);
  CHECK_PTR(got, w.comm[0]);
  tpc_comm_release(got);
  tpc_comm_release(NULL); /* harmless */
  CHECK_RC(NULL, tpc_comm_acquire(id, NULL), TPC_ERR_INVALID_ARG);

  /* unknown ids: 0 and one never issued */
  got = (tpc_comm *)&w;
  CHECK_RC(NULL, tpc_comm_acquire(0, &got), TPC_ERR_CLOSED);
  CHECK_PTR(got, NULL);
  CHECK_MSG(NULL, "id 0 is unknown");
  const uint64_t never = w.id[1] + 1000;
  char never_text[64];
  snprintf(never_text, sizeof never_text, "id %" PRIu64 " is unknown", never);
  CHECK_RC(NULL, tpc_comm_acquire(never, &got), TPC_ERR_CLOSED);
  CHECK_MSG(NULL, never_text);
  CHECK_RC(NULL, tpc_comm_acquire(UINT64_MAX, &got), TPC_ERR_CLOSED);
  CHECK_MSG(NULL, "unknown");

  /* a destroyed id: closed, naming it */
  destroy_world(&w);
  CHECK_ALL_RELEASED();
  got = (tpc_comm *)&w;
  CHECK_RC(NULL, tpc_comm_acquire(id, &got), TPC_ERR_CLOSED);
  CHECK_PTR(got, NULL);
  CHECK_MSG(NULL, id_text);
  CHECK_MSG(NULL, "closed");

  /* tpc_id_async_error on open, closed and unknown ids */
  CHECK(make_world(&w, 2, 1));
  tpc_async_error e;
  memset(&e, 0x5a, sizeof e);
  CHECK_RC(NULL, tpc_id_async_error(w.id[0], &e), TPC_OK);
  CHECK_EQ(e.code, TPC_OK);
  CHECK_EQ(e.peer, 0);
  CHECK_EQ(e.peer_kind, 0);
  memset(&e, 0x5a, sizeof e);
  CHECK_RC(NULL, tpc_id_async_error(id, &e), TPC_ERR_CLOSED);
  CHECK_EQ(e.code, TPC_OK);
  CHECK_MSG(NULL, id_text);
  CHECK_MSG(NULL, "is closed");
  memset(&e, 0x5a, sizeof e);
  CHECK_RC(NULL, tpc_id_async_error(0, &e), TPC_ERR_INVALID_ARG);
  CHECK_EQ(e.code, TPC_OK); /* zeroed */
  CHECK_MSG(NULL, "unknown");
  CHECK_RC(NULL, tpc_id_async_error(never, NULL), TPC_ERR_INVALID_ARG);
  CHECK_MSG(NULL, never_text);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* destroy: retires the id, synchronises, writes alive = 0 (and nothing else)
 * into the control slot before any handle is closed or the buffer freed. */
static void test_destroy_control_slot(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 3, 1));
  tpc_control *slot = w.control[1];
  /* the device recorded a failure and advanced the epoch */
  slot->failed = TPC_ERR_TIMEOUT;
  slot->epoch = 41;
  const int from = fake.n_events;
  CHECK_RC(NULL, tpc_comm_destroy(w.comm[1]), TPC_OK);
  w.comm[1] = NULL;
  CHECK_EQ(slot->alive, 0);
  CHECK_EQ(slot->failed, TPC_ERR_TIMEOUT); /* kept */
  CHECK_EQ(slot->epoch, 41);
  CHECK(fake.n_events <= FAKE_MAX_EVENTS);
  const int sync = fake_event_index(FK_DEVICE_SYNCHRONIZE, NULL, from);
  const int dead = fake_event_index(FK_MEMCPY_ANY, &slot->alive, from);
  const int freed = fake_event_index(FK_DEVICE_FREE, w.buf[1], from);
  const int close0 = fake_event_index(FK_IPC_CLOSE, w.buf[0], from);
  const int close2 = fake_event_index(FK_IPC_CLOSE, w.buf[2], from);
  /* the peers' control chunks are closed too, each after its buffer */
  const int chunk0 = fake_event_index(FK_IPC_CLOSE, w.chunk[0], from);
  const int chunk2 = fake_event_index(FK_IPC_CLOSE, w.chunk[2], from);
  CHECK(sync >= 0 && dead >= 0 && freed >= 0 && close0 >= 0 && close2 >= 0);
  CHECK(chunk0 > close0 && chunk2 > close2);
  CHECK(sync < dead);
  CHECK(dead < freed);
  CHECK(dead < close0 && dead < close2);
  if (dead >= 0) CHECK_EQ(fake.events[dead].bytes, sizeof slot->alive);
  /* one write into the slot, the alive word only */
  int slot_writes = 0;
  for (int i = from; i < fake.n_events && i < FAKE_MAX_EVENTS; ++i)
    if (fake.events[i].entry == FK_MEMCPY_ANY || fake.events[i].entry == FK_WRITE_ASYNC)
      slot_writes += fake_is_control_memory(fake.events[i].ptr);
  CHECK_EQ(slot_writes, 1);
  CHECK_EQ(fake.calls[FK_WRITE_ASYNC], 0); /* destroy blocks: no async writes */
  /* the other ranks' slots are untouched */
  CHECK_EQ(w.control[0]->alive, (uint32_t)w.id[0]);
  CHECK_EQ(w.control[2]->alive, (uint32_t)w.id[2]);
  CHECK_EQ(w.control[0]->stopped, 0);
  CHECK_EQ(w.control[2]->stopped, 0);
  /* the device's failure is still readable by id after close */
  CHECK_RC(NULL, tpc_id_async_error(w.id[1], NULL), TPC_ERR_CLOSED);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* abort: never blocks; marks the slot failed and dead, tells every open peer,
 * retires the id and frees the host state, but leaves the buffer allocated
 * and the peers' handles open. */
static void test_abort(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 4, 1));
  unsigned char *in = scratch_in, *out = scratch_out;
  const int r = 2;
  const uint64_t id = w.id[r];
  tpc_control *slot = w.control[r];
  CHECK_RC(w.comm[r], tpc_all_reduce(w.comm[r], in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  CHECK_RC(w.comm[r], tpc_all_reduce(w.comm[r], in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_B), TPC_OK);
  slot->epoch = 9;

  fake.current_device = 5; /* the caller is on another device */
  const int syncs = fake.calls[FK_DEVICE_SYNCHRONIZE];
  const int stream_syncs = fake.calls[FK_STREAM_SYNCHRONIZE];
  const int memcpys = fake.calls[FK_MEMCPY_ANY];
  const int live_device = fake.live_device, live_opens = fake.live_opens;
  const int frees = fake.calls[FK_DEVICE_FREE], closes = fake.calls[FK_IPC_CLOSE];
  /* the registered buffers' signals, to see that abort leaves them alone */
  static unsigned char signals_before[4][TPC_SIGNALS_BYTES];
  for (int p = 0; p < 4; ++p) memcpy(signals_before[p], w.buf[p], TPC_SIGNALS_BYTES);
  const tpc_control peer_slots_before[4] = {*w.control[0], *w.control[1], *w.control[2], *w.control[3]};
  CHECK_RC(NULL, tpc_comm_abort(w.comm[r]), TPC_OK);
  w.comm[r] = NULL;
  /* nothing that waits */
  CHECK_EQ(fake.calls[FK_DEVICE_SYNCHRONIZE], syncs);
  CHECK_EQ(fake.calls[FK_STREAM_SYNCHRONIZE], stream_syncs);
  CHECK_EQ(fake.calls[FK_MEMCPY_ANY], memcpys);
  /* nothing freed or closed */
  CHECK_EQ(fake.calls[FK_DEVICE_FREE], frees);
  CHECK_EQ(fake.calls[FK_IPC_CLOSE], closes);
  CHECK_EQ(fake.live_device, live_device);
  CHECK_EQ(fake.live_opens, live_opens);
  /* the slot: failed = TPC_ERR_CLOSED, alive = 0, epoch kept */
  CHECK_EQ(slot->failed, TPC_ERR_CLOSED);
  CHECK_EQ(slot->alive, 0);
  CHECK_EQ(slot->epoch, 9);
  /* every other rank's stop word, in its control slot (as its own registry
   * entry sees it, through the mapping of its chunk):
   * (TPC_ERR_CLOSED << 8) | (rank + 1); the rest of those slots untouched */
  const uint32_t stop = ((uint32_t)TPC_ERR_CLOSED << 8) | (uint32_t)(r + 1);
  for (int p = 0; p < 4; ++p) {
    CHECK_EQ(w.control[p]->stopped, p == r ? 0u : stop);
    CHECK_PTR(entry_of(w.id[p])->control, w.control[p]);
    if (p == r) continue;
    CHECK_EQ(w.control[p]->alive, peer_slots_before[p].alive);
    CHECK_EQ(w.control[p]->epoch, peer_slots_before[p].epoch);
    CHECK_EQ(w.control[p]->failed, 0);
  }
  /* the registered buffers are not written (the stop word left them) */
  for (int p = 0; p < 4; ++p) CHECK_EQ(memcmp(signals_before[p], w.buf[p], TPC_SIGNALS_BYTES), 0);
  /* all of it by write_async, on the communicator's device, failed before
   * alive, every write into control memory */
  CHECK_EQ(fake.calls[FK_WRITE_ASYNC], 2 + 3);
  CHECK_EQ(fake.n_writes, 5);
  int failed_at = -1, alive_at = -1, stop_writes = 0;
  for (int i = 0; i < fake.n_writes && i < FAKE_MAX_WRITES; ++i) {
    CHECK_EQ(fake.writes[i].device, r);
    CHECK_EQ(fake.writes[i].bytes, 4);
    CHECK(fake_is_control_memory(fake.writes[i].dst));
    for (int p = 0; p < 4; ++p)
      if (p != r && fake.writes[i].dst == &w.control[p]->stopped) {
        stop_writes++;
        CHECK_EQ(fake.writes[i].value, stop);
      }
    if (fake.writes[i].dst == &slot->failed) {
      failed_at = i;
      CHECK_EQ(fake.writes[i].value, TPC_ERR_CLOSED);
    }
    if (fake.writes[i].dst == &slot->alive) {
      alive_at = i;
      CHECK_EQ(fake.writes[i].value, 0);
    }
  }
  CHECK(failed_at >= 0 && alive_at >= 0);
  CHECK(failed_at < alive_at);
  CHECK_EQ(stop_writes, 3);
  /* the caller's device is put back */
  CHECK_EQ(fake.current_device, 5);

  /* the id is aborted */
  char id_text[64];
  snprintf(id_text, sizeof id_text, "id %" PRIu64, id);
  tpc_comm *got = (tpc_comm *)&w;
  CHECK_RC(NULL, tpc_comm_acquire(id, &got), TPC_ERR_CLOSED);
  CHECK_PTR(got, NULL);
  CHECK_MSG(NULL, "aborted");
  CHECK_MSG(NULL, id_text);
  tpc_async_error e;
  memset(&e, 0x5a, sizeof e);
  CHECK_RC(NULL, tpc_id_async_error(id, &e), TPC_ERR_CLOSED);
  CHECK_EQ(e.code, TPC_OK);
  CHECK_MSG(NULL, "aborted");
  CHECK_EQ(entry_of(id)->state, TPC_ENTRY_ABORTED);
  CHECK_PTR(entry_of(id)->comm, NULL);
  /* the other ranks still work, and close normally */
  for (int p = 0; p < 4; ++p)
    if (p != r) CHECK_RC(NULL, tpc_id_async_error(w.id[p], NULL), TPC_OK);
  CHECK_RC(w.comm[0], tpc_all_reduce(w.comm[0], in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
  destroy_world(&w); /* comm[r] is NULL: a no-op for it */
  /* what abort left: its own buffer and its three peers' handles (buffer and
   * control chunk each) */
  CHECK_EQ(fake.live_device, 1);
  CHECK_EQ(fake.live_opens, 6);
  for (int p = 0; p < 4; ++p) {
    CHECK_EQ(fake_open_count(w.buf[p]), p == r ? 0 : 1);
    CHECK_EQ(fake_open_count(w.chunk[p]), p == r ? 0 : 1);
  }
  CHECK_EQ(fake_release_leftovers(), 7);
  CHECK_ALL_RELEASED();

  /* a rank that opened only some peers tells only those; before any op, on
   * its own device (no set_device needed) */
  fake_reset();
  CHECK(make_world(&w, 3, 0));
  CHECK_RC(w.comm[0], tpc_comm_open_peer(w.comm[0], 2, w.handle[2]), TPC_OK);
  fake.current_device = 0;
  const int set_calls = fake.calls[FK_SET_DEVICE];
  CHECK_RC(NULL, tpc_comm_abort(w.comm[0]), TPC_OK);
  w.comm[0] = NULL;
  CHECK_EQ(fake.calls[FK_SET_DEVICE], set_calls);
  CHECK_EQ(w.control[1]->stopped, 0);
  CHECK_EQ(w.control[2]->stopped, ((uint32_t)TPC_ERR_CLOSED << 8) | 1u);
  CHECK_EQ(fake.calls[FK_WRITE_ASYNC], 3);
  destroy_world(&w);
  CHECK_EQ(fake_release_leftovers(), 1 + 2);
  CHECK_ALL_RELEASED();

  /* the slot write refused: TPC_ERR_RUNTIME naming the step (message through
   * NULL, the communicator is gone), the id is still retired */
  fake_reset();
  CHECK(make_world(&w, 2, 1));
  fake_fail_nth(FK_WRITE_ASYNC, 1, 71);
  CHECK_RC(NULL, tpc_comm_abort(w.comm[1]), TPC_ERR_RUNTIME);
  w.comm[1] = NULL;
  CHECK_MSG(NULL, "marking the communicator aborted on the device failed: fake error 71");
  CHECK_RC(NULL, tpc_comm_acquire(w.id[1], &got), TPC_ERR_CLOSED);
  CHECK_MSG(NULL, "aborted");
  /* a peer that refuses its stop word is not an error */
  fake_fail_nth(FK_WRITE_ASYNC, 3, 72);
  CHECK_RC(NULL, tpc_comm_abort(w.comm[0]), TPC_OK);
  w.comm[0] = NULL;
  CHECK_EQ(w.control[0]->failed, TPC_ERR_CLOSED);
  CHECK_EQ(w.control[0]->alive, 0);
  /* rank 1's stop word reached rank 0's slot; rank 0's was refused */
  CHECK_EQ(w.control[0]->stopped, ((uint32_t)TPC_ERR_CLOSED << 8) | 2u);
  CHECK_EQ(w.control[1]->stopped, 0);
  CHECK_EQ(fake_release_leftovers(), 2 * (1 + 2));
  CHECK_ALL_RELEASED();
}

/* The kernel arguments name the control slot and its id; a slot that is dead
 * (after close) no longer matches them. */
static void test_args_control(void) {
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
  CHECK(saved.control->alive != saved.alive_id);
  CHECK_ALL_RELEASED();
}

/* tpc_comm_debug_set_epoch synchronises, then writes the slot's epoch. */
static void test_debug_set_epoch(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[1];
  tpc_control *slot = w.control[1];
  const int syncs = fake.calls[FK_DEVICE_SYNCHRONIZE];
  const int from = fake.n_events;
  CHECK_RC(c, tpc_comm_debug_set_epoch(c, TPC_EPOCH_LAST - 2), TPC_OK);
  CHECK_EQ(slot->epoch, TPC_EPOCH_LAST - 2);
  CHECK_EQ(slot->alive, (uint32_t)w.id[1]);
  CHECK_EQ(slot->failed, 0);
  CHECK_EQ(w.control[0]->epoch, 0);
  CHECK_EQ(fake.calls[FK_DEVICE_SYNCHRONIZE], syncs + 1);
  const int sync = fake_event_index(FK_DEVICE_SYNCHRONIZE, NULL, from);
  const int write = fake_event_index(FK_MEMCPY_ANY, &slot->epoch, from);
  CHECK(sync >= 0 && write > sync);
  CHECK_RC(c, tpc_comm_debug_set_epoch(c, 0), TPC_OK);
  CHECK_EQ(slot->epoch, 0);
  /* failures: the epoch is left as it was */
  fake_fail_nth(FK_DEVICE_SYNCHRONIZE, 1, 51);
  CHECK_RC(c, tpc_comm_debug_set_epoch(c, 77), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "setting the epoch failed: fake error 51");
  CHECK_EQ(slot->epoch, 0);
  fake_fail_nth(FK_MEMCPY_ANY, 1, 52);
  CHECK_RC(c, tpc_comm_debug_set_epoch(c, 78), TPC_ERR_RUNTIME);
  CHECK_MSG(c, "fake error 52");
  CHECK_EQ(slot->epoch, 0);
  CHECK_RC(NULL, tpc_comm_debug_set_epoch(NULL, 1), TPC_ERR_INVALID_ARG);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* ------------------------------------------- export blob, peers' control slots */

/* tpc_comm_export's blob: [0, 64) the buffer's handle, [64, 128) the handle of
 * the control slot's pool chunk (its base: what the runtime can export),
 * [128, 136) the slot's byte offset in the chunk, the rest zero. */
#define EXPORT_DEVICE 40 /* no other test creates on it: a fresh chunk */
static void test_export_blob(void) {
  fake_reset();
  CHECK(BLOB_USED <= TPC_IPC_HANDLE_BYTES);
  tpc_config c = config(0, 2);
  c.device = EXPORT_DEVICE;
  enum { N = 3 };
  tpc_comm *comm[N] = {NULL};
  void *bufs[N];
  unsigned char blob[N][TPC_IPC_HANDLE_BYTES];
  for (int i = 0; i < N; ++i) {
    CHECK_RC(NULL, tpc_comm_create(&c, &comm[i]), TPC_OK);
    if (!comm[i]) return;
    bufs[i] = fake.last_malloc;
    const tpc_entry *e = entry_of(tpc_comm_id(comm[i]));
    memset(blob[i], 0xee, sizeof blob[i]); /* what export does not write would show */
    const int from = fake.n_events;
    CHECK_RC(comm[i], tpc_comm_export(comm[i], blob[i]), TPC_OK);
    /* two exports: the buffer, then the chunk by its base address */
    const int ex_buf = fake_event_index(FK_IPC_EXPORT, bufs[i], from);
    const int ex_chunk = fake_event_index(FK_IPC_EXPORT, e->control_chunk, from);
    CHECK(ex_buf >= 0 && ex_chunk > ex_buf);
    /* both handles decode: to the buffer, and to the chunk base */
    CHECK_PTR(blob_buffer(blob[i]), bufs[i]);
    CHECK_PTR(blob_chunk(blob[i]), e->control_chunk);
    CHECK(fake_is_control_chunk(blob_chunk(blob[i])));
    CHECK(blob_chunk(blob[i]) != (void *)bufs[i]);
    /* the offset points at this communicator's slot */
    const uint64_t offset = blob_offset(blob[i]);
    CHECK_EQ(offset % sizeof(tpc_control), 0);
    CHECK_PTR((char *)blob_chunk(blob[i]) + offset, e->control);
    CHECK_EQ(offset, (uint64_t)i * sizeof(tpc_control)); /* a fresh chunk: slots 0, 1, 2 */
    /* each handle fills its own 64 bytes (the fake's uses 16, the rest is
     * zero) and the bytes after the offset are zero */
    size_t nonzero = 0;
    for (size_t b = 16; b < BLOB_CHUNK_AT; ++b) nonzero += blob[i][b] != 0;
    for (size_t b = BLOB_CHUNK_AT + 16; b < BLOB_OFFSET_AT; ++b) nonzero += blob[i][b] != 0;
    for (size_t b = BLOB_USED; b < TPC_IPC_HANDLE_BYTES; ++b) nonzero += blob[i][b] != 0;
    CHECK_EQ(nonzero, 0);
    /* exporting again writes the same bytes */
    unsigned char again[TPC_IPC_HANDLE_BYTES];
    memset(again, 0x11, sizeof again);
    CHECK_RC(comm[i], tpc_comm_export(comm[i], again), TPC_OK);
    CHECK_EQ(memcmp(again, blob[i], sizeof again), 0);
  }
  /* one chunk, three slots */
  CHECK_PTR(blob_chunk(blob[0]), blob_chunk(blob[1]));
  CHECK_PTR(blob_chunk(blob[1]), blob_chunk(blob[2]));
  CHECK(memcmp(blob[0] + BLOB_CHUNK_AT, blob[2] + BLOB_CHUNK_AT, TPC_ALLOC_HANDLE_BYTES) == 0);
  CHECK(memcmp(blob[0], blob[1], TPC_ALLOC_HANDLE_BYTES) != 0);
  /* an export is never an open */
  CHECK_EQ(fake.calls[FK_IPC_OPEN], 0);
  for (int i = 0; i < N; ++i) CHECK_RC(NULL, tpc_comm_destroy(comm[i]), TPC_OK);
  CHECK_ALL_RELEASED();
  /* the slots outlive the communicators; a blob of a closed one still says
   * where its (now dead) slot is */
  CHECK_EQ(((tpc_control *)((char *)blob_chunk(blob[1]) + blob_offset(blob[1])))->alive, 0);
}

/* open_peer maps each peer's control slot: exactly the slot the peer's own
 * registry entry holds (the fake's memory is shared host memory, mapped at
 * the same address), so a stop word written through the mapping is what the
 * peer reads in its own slot. The kernel arguments carry those slots for
 * every peer, and this rank's own slot in `control`. */
static void test_peer_control(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 4, 1));
  unsigned char *in = scratch_in, *out = scratch_out;
  for (int r = 0; r < 4; ++r) {
    CHECK_RC(w.comm[r], tpc_all_reduce(w.comm[r], in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
    check_args(&w, r, in, out, 64, 64, TPC_FLOAT32, TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, NAN_F32);
    const tpc_kernel_args a = fake.last_args;
    CHECK_PTR(a.control, w.control[r]);
    CHECK_PTR(a.peer_control[r], NULL);
    for (int p = 0; p < 4; ++p) {
      if (p == r) continue;
      /* chunk (as opened) + offset (from the blob) */
      CHECK_EQ((char *)a.peer_control[p] - (char *)w.chunk[p], (long long)blob_offset(w.handle[p]));
      CHECK_PTR(a.peer_control[p], entry_of(w.id[p])->control);
      CHECK(a.peer_control[p] != a.control);
      if (a.peer_control[p] != w.control[p]) continue; /* not a slot to write through */
      /* a write through the mapping lands in the peer's own slot, and only
       * in its stop word */
      const uint32_t word = 0xab000000u | (uint32_t)(r << 8) | (uint32_t)(p + 1);
      a.peer_control[p]->stopped = word;
      CHECK_EQ(w.control[p]->stopped, word);
      CHECK_EQ(entry_of(w.id[p])->control->stopped, word);
      CHECK_EQ(w.control[p]->alive, (uint32_t)w.id[p]);
      CHECK_EQ(w.control[p]->failed, 0);
      for (int q = 0; q < 4; ++q)
        if (q != p) CHECK_EQ(w.control[q]->stopped, 0);
      a.peer_control[p]->stopped = 0;
    }
    /* the all-gather's arguments carry the same table */
    CHECK_RC(w.comm[r], tpc_all_gather(w.comm[r], in, out, 64, 16, TPC_ALGO_BULK, 0, STREAM_A), TPC_OK);
    for (int p = 0; p < TPC_MAX_RANKS; ++p) CHECK_PTR(fake.last_args.peer_control[p], a.peer_control[p]);
  }
  /* every rank mapped every other rank's chunk once, and its buffer once */
  for (int p = 0; p < 4; ++p) {
    CHECK_EQ(fake_open_count(w.buf[p]), 3);
    CHECK_EQ(fake_open_count(w.chunk[p]), 3);
  }
  CHECK_EQ(fake.ipc_opens, 4 * 3 * 2);
  destroy_world(&w);
  CHECK_ALL_RELEASED();

  /* world 8: every entry of the table is filled */
  fake_reset();
  CHECK(make_world(&w, 8, 1));
  for (int r = 0; r < 8; r += 7) {
    CHECK_RC(w.comm[r], tpc_all_reduce(w.comm[r], in, out, 32, TPC_FLOAT16, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
    check_args(&w, r, in, out, 32, 32, TPC_FLOAT16, TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, NAN_F16);
  }
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* Two communicators of the same ranks (on the same devices) take neighbouring
 * slots of one pool chunk per device: every rank's peers open that chunk
 * once per communicator (the runtime counts the opens of one handle and
 * returns the same address), and each communicator closes its own open. */
#define SHARED_CHUNK_DEVICE 44 /* 44, 45, 46: no other test creates there */
static void test_shared_chunk(void) {
  fake_reset();
  world a, b;
  world_device_base = SHARED_CHUNK_DEVICE;
  CHECK(make_world(&a, 3, 1));
  CHECK(make_world(&b, 3, 1));
  world_device_base = 0;
  unsigned char *in = scratch_in, *out = scratch_out;
  for (int p = 0; p < 3; ++p) {
    CHECK_PTR(a.chunk[p], b.chunk[p]);
    CHECK(a.chunk[p] != NULL);
    CHECK_PTR(b.control[p], a.control[p] + 1); /* the next slot of that chunk */
    CHECK_PTR(blob_chunk(a.handle[p]), blob_chunk(b.handle[p]));
    CHECK_EQ(blob_offset(b.handle[p]), blob_offset(a.handle[p]) + sizeof(tpc_control));
    if (p > 0) CHECK(a.chunk[p] != a.chunk[0]); /* one chunk per device */
    /* the chunk is open twice per other rank: once for each communicator */
    CHECK_EQ(fake_open_count(a.chunk[p]), 2 * 2);
    CHECK_EQ(fake_open_count(a.buf[p]), 2);
    CHECK_EQ(fake_open_count(b.buf[p]), 2);
  }
  CHECK_EQ(fake.ipc_opens, 2 * 3 * 2 * 2);
  CHECK_EQ(fake.bad_opens, 0);
  /* both map the same chunk, each its own slot in it */
  for (int r = 0; r < 3; ++r) {
    CHECK_RC(a.comm[r], tpc_all_reduce(a.comm[r], in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
    check_args(&a, r, in, out, 64, 64, TPC_FLOAT32, TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, NAN_F32);
    CHECK_RC(b.comm[r], tpc_all_reduce(b.comm[r], in, out, 64, TPC_FLOAT32, TPC_ALGO_PACKET, STREAM_A), TPC_OK);
    check_args(&b, r, in, out, 64, 64, TPC_FLOAT32, TPC_OP_ALL_REDUCE, TPC_ALGO_PACKET, NAN_F32);
  }

  /* communicator a closes: one open of each chunk goes, b's stays */
  int from = fake.n_events;
  destroy_world(&a);
  for (int p = 0; p < 3; ++p) {
    CHECK_EQ(fake_open_count(a.chunk[p]), 2);
    CHECK_EQ(fake_open_count(a.buf[p]), 0);
    CHECK_EQ(fake_open_count(b.buf[p]), 2);
    CHECK(fake_event_index(FK_IPC_CLOSE, a.chunk[p], from) >= 0);
  }
  CHECK_EQ(fake.bad_closes, 0);
  /* b still works through its mapping: rank 1 aborting tells ranks 0 and 2
   * in b's slots, not in a's */
  CHECK_RC(b.comm[0], tpc_all_gather(b.comm[0], in, out, 64, 64, TPC_ALGO_PACKET, 0, STREAM_A), TPC_OK);
  check_args(&b, 0, in, out, 64, 64, 0, TPC_OP_ALL_GATHER, TPC_ALGO_PACKET, 0);
  CHECK_RC(NULL, tpc_comm_abort(b.comm[1]), TPC_OK);
  b.comm[1] = NULL;
  const uint32_t stop = ((uint32_t)TPC_ERR_CLOSED << 8) | 2u;
  CHECK_EQ(b.control[0]->stopped, stop);
  CHECK_EQ(b.control[2]->stopped, stop);
  CHECK_EQ(a.control[0]->stopped, 0);
  CHECK_EQ(a.control[2]->stopped, 0);

  /* b closes: the rest of the opens go, except the aborted rank's (its two
   * peers' buffer and chunk), which abort leaves */
  from = fake.n_events;
  destroy_world(&b);
  CHECK_EQ(fake_open_count(b.chunk[0]), 1);
  CHECK_EQ(fake_open_count(b.chunk[1]), 0);
  CHECK_EQ(fake_open_count(b.chunk[2]), 1);
  CHECK_EQ(fake.live_opens, 4);
  CHECK_EQ(fake.bad_closes, 0);
  CHECK_EQ(fake_release_leftovers(), 1 + 4);
  CHECK_ALL_RELEASED();
}

/* ------------------------------------------------------------- threads */

typedef struct {
  uint64_t id;
  int do_acquire, do_release;
  tpc_comm *release_this;
  tpc_result rc;
  tpc_comm *got;
  char msg[512];
} thread_job;

static void *thread_run(void *arg) {
  thread_job *j = arg;
  if (j->do_acquire) {
    j->rc = tpc_comm_acquire(j->id, &j->got);
    /* the message of a failed acquire is this thread's own */
    snprintf(j->msg, sizeof j->msg, "%s", tpc_comm_last_error(NULL));
  }
  if (j->do_release) tpc_comm_release(j->release_this);
  return NULL;
}

static void run_thread(thread_job *j) {
  pthread_t t;
  if (pthread_create(&t, NULL, thread_run, j) != 0) {
    CHECK(0);
    return;
  }
  pthread_join(t, NULL);
}

static atomic_int holders, max_holders, total_ok, total_busy;
typedef struct {
  uint64_t id;
  int rounds;
} hammer_job;

static void *hammer(void *arg) {
  const hammer_job *j = arg;
  for (int i = 0; i < j->rounds; ++i) {
    tpc_comm *c = NULL;
    const tpc_result r = tpc_comm_acquire(j->id, &c);
    if (r == TPC_OK) {
      const int h = atomic_fetch_add(&holders, 1) + 1;
      int m = atomic_load(&max_holders);
      while (h > m && !atomic_compare_exchange_weak(&max_holders, &m, h)) {
      }
      atomic_fetch_add(&total_ok, 1);
      atomic_fetch_sub(&holders, 1);
      tpc_comm_release(c);
    } else if (r == TPC_ERR_STATE) {
      atomic_fetch_add(&total_busy, 1);
    }
  }
  return NULL;
}

/* Acquire across threads, in a fixed order (each step joins before the
 * next), then a free-for-all that checks no two threads ever hold it. */
static void test_acquire_threads(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  const uint64_t id = w.id[0];
  char id_text[64];
  snprintf(id_text, sizeof id_text, "id %" PRIu64, id);

  tpc_comm *mine = NULL;
  CHECK_RC(NULL, tpc_comm_acquire(id, &mine), TPC_OK);
  /* another thread while this one holds it */
  thread_job a = {.id = id, .do_acquire = 1};
  run_thread(&a);
  CHECK_EQ(a.rc, TPC_ERR_STATE);
  CHECK_PTR(a.got, NULL);
  CHECK(strstr(a.msg, id_text) != NULL && strstr(a.msg, "another thread") != NULL);
  /* released here: the other thread gets it and keeps it */
  tpc_comm_release(mine);
  thread_job b = {.id = id, .do_acquire = 1};
  run_thread(&b);
  CHECK_EQ(b.rc, TPC_OK);
  CHECK_PTR(b.got, w.comm[0]);
  /* now this thread is refused, and cannot destroy it */
  CHECK_RC(NULL, tpc_comm_acquire(id, &mine), TPC_ERR_STATE);
  CHECK_RC(w.comm[0], tpc_comm_destroy(w.comm[0]), TPC_ERR_STATE);
  /* the holder releases from its thread */
  thread_job c = {.id = id, .do_release = 1, .release_this = b.got};
  run_thread(&c);
  CHECK_RC(NULL, tpc_comm_acquire(id, &mine), TPC_OK);
  tpc_comm_release(mine);

  /* contention */
  enum { THREADS = 4, ROUNDS = 2000 };
  atomic_store(&holders, 0);
  atomic_store(&max_holders, 0);
  atomic_store(&total_ok, 0);
  atomic_store(&total_busy, 0);
  pthread_t t[THREADS];
  hammer_job hj = {id, ROUNDS};
  int started = 0;
  for (int i = 0; i < THREADS; ++i) started += pthread_create(&t[i], NULL, hammer, &hj) == 0;
  CHECK_EQ(started, THREADS);
  for (int i = 0; i < started; ++i) pthread_join(t[i], NULL);
  CHECK_EQ(atomic_load(&max_holders), 1);
  CHECK_EQ(atomic_load(&total_ok) + atomic_load(&total_busy), started * ROUNDS);
  CHECK(atomic_load(&total_ok) > 0);
  CHECK_EQ(entry_of(id)->in_use, 0);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
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
  RUN(test_open_peer_bad_offset);
  RUN(test_destroy_failures);
  RUN(test_probe);
  RUN(test_all_reduce_validation);
  RUN(test_reduce_scatter);
  RUN(test_reduce_scatter_f32);
  RUN(test_all_reduce_add_rms_norm);
  RUN(test_all_reduce_algo_and_args);
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
