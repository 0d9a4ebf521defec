/*
 * Communicator ids and the memory that outlives every communicator.
 *
 * Each communicator gets a process-unique comm_id (1, 2, 3, ...; never reused) and
 * a control slot + error record from a per-device pool that is never freed.
 * The torch ops carry the comm_id: looking it up under the registry lock turns a
 * closed or unknown comm_id into an error instead of a dangling pointer, and the
 * kernels of a graph replayed after close() still find their control slot
 * (now marked dead) and their error record.
 */
#ifndef TPCOMM_REGISTRY_H
#define TPCOMM_REGISTRY_H

#include <stdint.h>

#include "layout.h"
#include "runtime.h"

/* Devices the control pool covers (tpc_config.device must be below). */
#define TPC_MAX_DEVICES 64
/* Control slots per pool chunk, and the bytes of one chunk (what peers map). */
#define TPC_CHUNK_SLOTS 256
#define TPC_CONTROL_CHUNK_BYTES (TPC_CHUNK_SLOTS * sizeof(tpc_control))

typedef enum { TPC_ENTRY_OPEN = 0, TPC_ENTRY_CLOSED = 1, TPC_ENTRY_ABORTED = 2 } tpc_entry_state;

typedef struct {
  uint64_t comm_id;
  struct tpc_comm *comm;            /* NULL once closed or aborted */
  tpc_entry_state state;
  int in_use;                       /* an op holds it (tpc_comm_acquire) */
  int rank;                         /* for messages about a closed comm_id */
  uint64_t timeout_ns;
  tpc_control *control;             /* device memory */
  void *control_chunk;              /* the pool chunk holding it (what peers map) */
  tpc_async_error *record;          /* host view of the error record */
  tpc_async_error *record_device;   /* the kernels' view of it */
} tpc_entry;

/* Takes a fresh comm_id and control slot on `device` (the current device).
 * Returns 0, the runtime's error code, or -1 when host memory ran out. The
 * entry is not open yet: the caller initialises the slot, then sets comm and
 * state under the lock. */
int tpc_registry_add(const tpc_runtime *rt, int device, tpc_entry **entry_out);

/* The registry lock: held around every lookup and state change. */
void tpc_registry_lock(void);
void tpc_registry_unlock(void);
/* The entry of a comm_id ever handed out, or NULL. Call with the lock held. */
tpc_entry *tpc_registry_find(uint64_t comm_id);

#endif /* TPCOMM_REGISTRY_H */
