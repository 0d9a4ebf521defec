/*
 * The communicator's life cycle: config checks, create (and every way it
 * fails), peers, the export blob, destroy, the probe, the epoch hook.
 */
#include "harness.h"

void test_layout(void) {
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

void test_config_validation(void) {
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
  c = config(0, 2); c.max_bytes = TPC_MAX_BYTES_LIMIT + 16; bad[nb].cfg = c; bad[nb++].needle = "max_bytes 4294967312 is over 4294967296";
  c = config(0, 2); c.packet_max_bytes = TPC_PACKET_MAX_BYTES_LIMIT + 16; bad[nb].cfg = c;
  bad[nb++].needle = "packet_max_bytes 2147483664 is over 2147483648";
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
  c.max_bytes = TPC_MAX_BYTES_LIMIT;
  c.packet_max_bytes = TPC_PACKET_MAX_BYTES_LIMIT;
  /* the largest caps pass validation (the allocation is made to fail before
   * the fake asks for 12 GiB of host memory) */
  fake_fail_nth(FK_DEVICE_MALLOC, 1, 2);
  CHECK_RC(NULL, tpc_comm_create(&c, &comm), TPC_ERR_RUNTIME);
  CHECK_MSG(NULL, "allocating the registered buffer");
  CHECK_ALL_RELEASED();
}

void test_create_destroy(void) {
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
  CHECK_EQ(entry->comm_id, id);
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
void test_create_failures(void) {
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

void test_open_peer(void) {
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
void test_open_peer_bad_offset(void) {
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
void test_destroy_failures(void) {
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
    CHECK_RC(NULL, tpc_comm_acquire(w.comm_id[0], &got), TPC_ERR_CLOSED);
    CHECK_MSG(NULL, "closed");
    CHECK_EQ(w.control[0]->alive, steps[i].entry == FK_MEMCPY_ANY ? (uint32_t)w.comm_id[0] : 0u);
  }
}

void test_probe(void) {
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

/* Many communicators created and destroyed in a loop, with failures injected
 * at every runtime call of the set-up in turn: never a leak. */
void test_no_leaks_under_failures(void) {
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

/* tpc_comm_export's blob: [0, 64) the buffer's handle, [64, 128) the handle of
 * the control slot's pool chunk (its base: what the runtime can export),
 * [128, 136) the slot's byte offset in the chunk, the rest zero. */
void test_export_blob(void) {
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
void test_peer_control(void) {
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
      CHECK_PTR(a.peer_control[p], entry_of(w.comm_id[p])->control);
      CHECK(a.peer_control[p] != a.control);
      if (a.peer_control[p] != w.control[p]) continue; /* not a slot to write through */
      /* a write through the mapping lands in the peer's own slot, and only
       * in its stop word */
      const uint32_t word = 0xab000000u | (uint32_t)(r << 8) | (uint32_t)(p + 1);
      a.peer_control[p]->stopped = word;
      CHECK_EQ(w.control[p]->stopped, word);
      CHECK_EQ(entry_of(w.comm_id[p])->control->stopped, word);
      CHECK_EQ(w.control[p]->alive, (uint32_t)w.comm_id[p]);
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
void test_shared_chunk(void) {
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

/* tpc_comm_debug_set_epoch synchronises, then writes the slot's epoch. */
void test_debug_set_epoch(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  tpc_comm *c = w.comm[1];
  tpc_control *slot = w.control[1];
  const int syncs = fake.calls[FK_DEVICE_SYNCHRONIZE];
  const int from = fake.n_events;
  CHECK_RC(c, tpc_comm_debug_set_epoch(c, TPC_EPOCH_LAST - 2), TPC_OK);
  CHECK_EQ(slot->epoch, TPC_EPOCH_LAST - 2);
  CHECK_EQ(slot->alive, (uint32_t)w.comm_id[1]);
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
