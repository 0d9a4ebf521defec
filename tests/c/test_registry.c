/*
 * Ids and the registry: ids never reused, the control pool, acquire and
 * release (from several threads too), destroy's control slot, abort.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "harness.h"

/* Ids are 1, 2, 3, ... across create/destroy cycles, never reused, and each
 * has its own control slot that is never handed out again. */
void test_ids(void) {
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
    CHECK(e != NULL && e->comm_id == ids[i] && e->state == TPC_ENTRY_CLOSED && e->comm == NULL);
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
void test_pool_chunks(void) {
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

void test_acquire(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  unsigned char *in = scratch_in, *out = scratch_out;
  const uint64_t id = w.comm_id[0];
  char id_text[64];
  snprintf(id_text, sizeof id_text, "id %" PRIu64, id);

  /* an open id: the communicator, marked in use */
  tpc_comm *got = NULL;
  CHECK_RC(NULL, tpc_comm_acquire(id, &got), TPC_OK);
  CHECK_PTR(got, w.comm[0]);
  CHECK_EQ(entry_of(id)->in_use, 1);
  CHECK_EQ(entry_of(w.comm_id[1])->in_use, 0); /* only that one */
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
  CHECK_RC(NULL, tpc_comm_acquire(w.comm_id[1], &other), TPC_OK);
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
  CHECK_EQ(fake.last_args.comm_id, (uint32_t)id);
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
  const uint64_t never = w.comm_id[1] + 1000;
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
  CHECK_RC(NULL, tpc_id_async_error(w.comm_id[0], &e), TPC_OK);
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
void test_destroy_control_slot(void) {
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
  CHECK_EQ(w.control[0]->alive, (uint32_t)w.comm_id[0]);
  CHECK_EQ(w.control[2]->alive, (uint32_t)w.comm_id[2]);
  CHECK_EQ(w.control[0]->stopped, 0);
  CHECK_EQ(w.control[2]->stopped, 0);
  /* the device's failure is still readable by id after close */
  CHECK_RC(NULL, tpc_id_async_error(w.comm_id[1], NULL), TPC_ERR_CLOSED);
  destroy_world(&w);
  CHECK_ALL_RELEASED();
}

/* abort: never blocks; marks the slot failed and dead, tells every open peer,
 * retires the id and frees the host state, but leaves the buffer allocated
 * and the peers' handles open. */
void test_abort(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 4, 1));
  unsigned char *in = scratch_in, *out = scratch_out;
  const int r = 2;
  const uint64_t id = w.comm_id[r];
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
    CHECK_PTR(entry_of(w.comm_id[p])->control, w.control[p]);
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
    if (p != r) CHECK_RC(NULL, tpc_id_async_error(w.comm_id[p], NULL), TPC_OK);
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
  CHECK_RC(NULL, tpc_comm_acquire(w.comm_id[1], &got), TPC_ERR_CLOSED);
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

/* ------------------------------------------------------------- threads */

typedef struct {
  uint64_t comm_id;
  int do_acquire, do_release;
  tpc_comm *release_this;
  tpc_result rc;
  tpc_comm *got;
  char msg[512];
} thread_job;

static void *thread_run(void *arg) {
  thread_job *j = arg;
  if (j->do_acquire) {
    j->rc = tpc_comm_acquire(j->comm_id, &j->got);
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
  uint64_t comm_id;
  int rounds;
} hammer_job;

static void *hammer(void *arg) {
  const hammer_job *j = arg;
  for (int i = 0; i < j->rounds; ++i) {
    tpc_comm *c = NULL;
    const tpc_result r = tpc_comm_acquire(j->comm_id, &c);
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
void test_acquire_threads(void) {
  fake_reset();
  world w;
  CHECK(make_world(&w, 2, 1));
  const uint64_t id = w.comm_id[0];
  char id_text[64];
  snprintf(id_text, sizeof id_text, "id %" PRIu64, id);

  tpc_comm *mine = NULL;
  CHECK_RC(NULL, tpc_comm_acquire(id, &mine), TPC_OK);
  /* another thread while this one holds it */
  thread_job a = {.comm_id = id, .do_acquire = 1};
  run_thread(&a);
  CHECK_EQ(a.rc, TPC_ERR_STATE);
  CHECK_PTR(a.got, NULL);
  CHECK(strstr(a.msg, id_text) != NULL && strstr(a.msg, "another thread") != NULL);
  /* released here: the other thread gets it and keeps it */
  tpc_comm_release(mine);
  thread_job b = {.comm_id = id, .do_acquire = 1};
  run_thread(&b);
  CHECK_EQ(b.rc, TPC_OK);
  CHECK_PTR(b.got, w.comm[0]);
  /* now this thread is refused, and cannot destroy it */
  CHECK_RC(NULL, tpc_comm_acquire(id, &mine), TPC_ERR_STATE);
  CHECK_RC(w.comm[0], tpc_comm_destroy(w.comm[0]), TPC_ERR_STATE);
  /* the holder releases from its thread */
  thread_job c = {.comm_id = id, .do_release = 1, .release_this = b.got};
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
