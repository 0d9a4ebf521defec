/*
 * Communicator ids and the never-freed control pool (see registry.h).
 */
#include "registry.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Entries and control slots come in chunks, so their addresses never move. */
#define TPC_CHUNK TPC_CHUNK_SLOTS
#define TPC_MAX_CHUNKS 4096  /* ids up to 2^20: far beyond any process */

typedef struct {
  tpc_control *control;            /* TPC_CHUNK slots, device memory */
  tpc_async_error *records;        /* TPC_CHUNK records, host-mapped */
  tpc_async_error *records_device;
  int used;
} tpc_pool_chunk;

static pthread_mutex_t registry_mutex = PTHREAD_MUTEX_INITIALIZER;
static tpc_entry *entry_chunks[TPC_MAX_CHUNKS];
static uint64_t entries_used;
static tpc_pool_chunk pools[TPC_MAX_DEVICES];

void tpc_registry_lock(void) { pthread_mutex_lock(&registry_mutex); }
void tpc_registry_unlock(void) { pthread_mutex_unlock(&registry_mutex); }

tpc_entry *tpc_registry_find(uint64_t comm_id) {
  if (comm_id == 0 || comm_id > entries_used) return NULL;
  const uint64_t index = comm_id - 1;
  return &entry_chunks[index / TPC_CHUNK][index % TPC_CHUNK];
}

/* A device's current chunk, or a new one once it is full. A full chunk is
 * simply dropped: its slots stay allocated for the communicators that hold
 * them (graphs may still read them), and it is never freed. */
static int pool_slot(const tpc_runtime *rt, int device, tpc_control **control, void **chunk,
                     tpc_async_error **record, tpc_async_error **record_device) {
  if (device < 0 || device >= TPC_MAX_DEVICES) return -1;
  tpc_pool_chunk *pool = &pools[device];
  if (!pool->control || pool->used == TPC_CHUNK) {
    void *ctl = NULL, *rec = NULL, *rec_dev = NULL;
    int code = rt->alloc_control_chunk(&ctl, &rec, &rec_dev, TPC_CHUNK);
    if (code) return code;
    pool->control = ctl;
    pool->records = rec;
    pool->records_device = rec_dev;
    pool->used = 0;
  }
  const int i = pool->used++;
  *control = pool->control + i;
  *chunk = pool->control;
  *record = pool->records + i;
  *record_device = pool->records_device + i;
  return 0;
}

int tpc_registry_add(const tpc_runtime *rt, int device, tpc_entry **entry_out) {
  tpc_registry_lock();
  int code = 0;
  const uint64_t index = entries_used;
  if (index / TPC_CHUNK >= TPC_MAX_CHUNKS) {
    code = -1;
    goto out;
  }
  if (!entry_chunks[index / TPC_CHUNK]) {
    entry_chunks[index / TPC_CHUNK] = calloc(TPC_CHUNK, sizeof(tpc_entry));
    if (!entry_chunks[index / TPC_CHUNK]) {
      code = -1;
      goto out;
    }
  }
  tpc_entry *e = &entry_chunks[index / TPC_CHUNK][index % TPC_CHUNK];
  memset(e, 0, sizeof *e);
  code = pool_slot(rt, device, &e->control, &e->control_chunk, &e->record, &e->record_device);
  if (code) goto out;
  entries_used++;
  e->comm_id = index + 1;
  /* Not open until the caller has initialised the slot (tpc_comm_create). */
  e->comm = NULL;
  e->state = TPC_ENTRY_CLOSED;
  *entry_out = e;
out:
  tpc_registry_unlock();
  return code;
}
