/*
 * The communicator's life cycle: create, export, open_peer, ready, destroy,
 * abort; ids looked up and claimed for one op; the P2P probe. Plain C over
 * the runtime table: nothing here touches a GPU directly, so all of it is
 * tested on the CPU (tests/c).
 */
#include <stdlib.h>
#include <string.h>

#include "comm_internal.h"

/* What a rank writes into each peer's probe slot, with its rank in the low
 * byte so a token landing in the wrong slot is noticed. The buffer starts
 * zeroed, so the tag must be nonzero: a slot nobody wrote never matches. */
#define TPC_PROBE_TAG 0x7c0a0000u
#define TPC_PROBE_TOKEN(rank) (TPC_PROBE_TAG | (uint32_t)(rank))

int tpc_comm_world_size(const tpc_comm *comm) { return comm ? comm->cfg.world_size : 0; }
int tpc_comm_rank(const tpc_comm *comm) { return comm ? comm->cfg.rank : -1; }
int tpc_comm_device(const tpc_comm *comm) { return comm ? comm->cfg.device : -1; }

size_t tpc_comm_buffer_bytes(const tpc_comm *comm) { return comm ? comm->layout.total_bytes : 0; }

int tpc_comm_open_peer_count(const tpc_comm *comm) {
  int count = 0;
  for (int p = 0; comm && p < TPC_MAX_RANKS; ++p) count += (comm->opened_mask >> p) & 1u;
  return count;
}

static tpc_result check_config(const tpc_config *c) {
  if (!c) return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "config is NULL");
  if (c->world_size < 2 || c->world_size > TPC_MAX_RANKS)
    return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "world_size %d is outside 2..%d", c->world_size,
                    TPC_MAX_RANKS);
  if (c->rank < 0 || c->rank >= c->world_size)
    return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "rank %d is outside 0..%d", c->rank,
                    c->world_size - 1);
  if (c->device < 0 || c->device >= TPC_MAX_DEVICES)
    return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "device %d is outside 0..%d", c->device, TPC_MAX_DEVICES - 1);
  if (c->max_bytes < 16 || c->max_bytes % 16)
    return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "max_bytes %zu is not a positive multiple of 16",
                    c->max_bytes);
  if (c->packet_max_bytes < 16 || c->packet_max_bytes % 16)
    return tpc_fail(NULL, TPC_ERR_INVALID_ARG,
                    "packet_max_bytes %zu is not a positive multiple of 16", c->packet_max_bytes);
  if ((uint64_t)c->max_bytes > TPC_MAX_BYTES_LIMIT)
    return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "max_bytes %zu is over %llu", c->max_bytes,
                    (unsigned long long)TPC_MAX_BYTES_LIMIT);
  if ((uint64_t)c->packet_max_bytes > TPC_PACKET_MAX_BYTES_LIMIT)
    return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "packet_max_bytes %zu is over %llu", c->packet_max_bytes,
                    (unsigned long long)TPC_PACKET_MAX_BYTES_LIMIT);
  if (c->timeout_ns == 0) return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "timeout_ns is 0");
  return TPC_OK;
}

tpc_result tpc_comm_create(const tpc_config *config, tpc_comm **comm_out) {
  if (!comm_out) return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "comm_out is NULL");
  *comm_out = NULL;
  tpc_result r = check_config(config);
  if (r != TPC_OK) return r;

  const tpc_runtime *rt = tpc_runtime_get();
  tpc_comm *comm = calloc(1, sizeof *comm);
  if (!comm) return tpc_fail(NULL, TPC_ERR_RUNTIME, "out of host memory");
  comm->cfg = *config;
  comm->rt = rt;
  comm->layout = tpc_layout_for(config->world_size, config->max_bytes, config->packet_max_bytes);

  int code;
  void *own = NULL;
  if ((code = rt->set_device(config->device)) != 0) {
    r = tpc_runtime_fail(NULL, rt, code, "selecting the device");
    goto undo;
  }
  if ((code = rt->multiprocessor_count(config->device, &comm->multiprocessors)) != 0) {
    r = tpc_runtime_fail(NULL, rt, code, "reading the device's multiprocessor count");
    goto undo;
  }
  if ((code = rt->device_malloc(&own, comm->layout.total_bytes)) != 0) {
    r = tpc_runtime_fail(NULL, rt, code, "allocating the registered buffer");
    goto undo;
  }
  comm->bufs[config->rank] = own;
  /* Zero flags are "never written": epochs start at 1, so nothing stale matches. */
  if ((code = rt->device_memset(own, 0, comm->layout.total_bytes)) != 0) {
    r = tpc_runtime_fail(NULL, rt, code, "clearing the registered buffer");
    goto undo;
  }
  if ((code = rt->device_synchronize()) != 0) {
    r = tpc_runtime_fail(NULL, rt, code, "synchronising after set-up");
    goto undo;
  }
  /* Last: a comm_id is only handed out to a communicator that exists. */
  if ((code = tpc_registry_add(rt, config->device, &comm->entry)) != 0) {
    r = code < 0 ? tpc_fail(NULL, TPC_ERR_RUNTIME, "out of host memory for the communicator registry")
                 : tpc_runtime_fail(NULL, rt, code, "allocating the control pool");
    goto undo;
  }
  /* The slot is fresh (never used by another communicator): epoch and failed
   * are 0; alive becomes this comm_id, which the kernels compare with theirs. */
  const tpc_control control = {(uint32_t)comm->entry->comm_id, 0, 0, 0};
  if ((code = rt->memcpy_any(comm->entry->control, &control, sizeof control)) != 0) {
    r = tpc_runtime_fail(NULL, rt, code, "initialising the control slot");
    goto undo; /* the comm_id stays retired: it was never open */
  }
  tpc_registry_lock();
  comm->entry->rank = config->rank;
  comm->entry->timeout_ns = config->timeout_ns;
  comm->entry->comm = comm;
  comm->entry->state = TPC_ENTRY_OPEN;
  tpc_registry_unlock();
  *comm_out = comm;
  return TPC_OK;

undo:
  if (own) rt->device_free(own);
  free(comm);
  return r;
}

uint64_t tpc_comm_id(const tpc_comm *comm) { return comm ? comm->entry->comm_id : 0; }

/* The exported blob: [0, 64) the buffer's handle, [64, 128) the control
 * chunk's handle, [128, 136) the control slot's offset in that chunk. */
#define TPC_CHUNK_HANDLE_AT TPC_ALLOC_HANDLE_BYTES
#define TPC_CONTROL_OFFSET_AT (2 * TPC_ALLOC_HANDLE_BYTES)

tpc_result tpc_comm_export(tpc_comm *comm, void *handle_out) {
  if (!comm || !handle_out) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "NULL argument");
  unsigned char *out = handle_out;
  memset(out, 0, TPC_IPC_HANDLE_BYTES);
  int code = comm->rt->ipc_export(out, comm->bufs[comm->cfg.rank]);
  if (code) return tpc_runtime_fail(comm, comm->rt, code, "exporting the IPC handle");
  code = comm->rt->ipc_export(out + TPC_CHUNK_HANDLE_AT, comm->entry->control_chunk);
  if (code) return tpc_runtime_fail(comm, comm->rt, code, "exporting the control slot's IPC handle");
  const uint64_t offset = (uint64_t)((char *)comm->entry->control - (char *)comm->entry->control_chunk);
  memcpy(out + TPC_CONTROL_OFFSET_AT, &offset, sizeof offset);
  return TPC_OK;
}

tpc_result tpc_comm_open_peer(tpc_comm *comm, int peer, const void *handle) {
  if (!comm || !handle) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "NULL argument");
  if (comm->ready) return tpc_fail(comm, TPC_ERR_STATE, "peers are already fixed (ready was called)");
  if (peer < 0 || peer >= comm->cfg.world_size)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "peer %d is outside 0..%d", peer,
                    comm->cfg.world_size - 1);
  if (peer == comm->cfg.rank)
    return tpc_fail(comm, TPC_ERR_INVALID_ARG, "peer %d is this rank itself", peer);
  if (comm->opened_mask & (1u << peer))
    return tpc_fail(comm, TPC_ERR_STATE, "peer %d is already open", peer);
  const unsigned char *in = handle;
  uint64_t offset;
  memcpy(&offset, in + TPC_CONTROL_OFFSET_AT, sizeof offset);
  if (offset % sizeof(tpc_control) || offset > TPC_CONTROL_CHUNK_BYTES - sizeof(tpc_control))
    return tpc_fail(comm, TPC_ERR_PEER, "peer %d sent a control slot offset of %llu", peer,
                    (unsigned long long)offset);
  void *ptr = NULL, *chunk = NULL;
  int code = comm->rt->ipc_open(&ptr, in);
  if (code)
    return tpc_fail(comm, TPC_ERR_PEER, "opening the IPC handle of peer %d failed: %s", peer,
                    comm->rt->error_string(code));
  /* The same chunk may already be open for another communicator: the
   * runtime counts the opens and returns the same address. */
  code = comm->rt->ipc_open(&chunk, in + TPC_CHUNK_HANDLE_AT);
  if (code) {
    comm->rt->ipc_close(ptr);
    return tpc_fail(comm, TPC_ERR_PEER, "opening the control slot of peer %d failed: %s", peer,
                    comm->rt->error_string(code));
  }
  comm->bufs[peer] = ptr;
  comm->peer_chunks[peer] = chunk;
  comm->peer_control[peer] = (tpc_control *)((char *)chunk + offset);
  comm->opened_mask |= 1u << peer;
  return TPC_OK;
}

tpc_result tpc_comm_ready(tpc_comm *comm) {
  if (!comm) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  for (int p = 0; p < comm->cfg.world_size; ++p)
    if (p != comm->cfg.rank && !(comm->opened_mask & (1u << p)))
      return tpc_fail(comm, TPC_ERR_STATE, "peer %d has not been opened", p);
  comm->ready = 1;
  return TPC_OK;
}

/* Retires the comm_id: later lookups say "closed". Refused while another thread
 * holds the communicator for an op. */
static tpc_result retire(tpc_comm *comm, tpc_entry_state state) {
  tpc_registry_lock();
  const int busy = comm->entry->in_use;
  if (!busy) {
    comm->entry->comm = NULL;
    comm->entry->state = state;
  }
  tpc_registry_unlock();
  return busy ? tpc_fail(comm, TPC_ERR_STATE, "comm_id %llu is running an op (from another thread?)",
                         (unsigned long long)comm->entry->comm_id)
              : TPC_OK;
}

/* The host state of a communicator that is going: its last error moves to
 * the thread's slot before it is freed. */
static tpc_result free_host_state(tpc_comm *comm, tpc_result r) {
  tpc_to_thread_slot(comm, r);
  free(comm);
  return r;
}

tpc_result tpc_comm_destroy(tpc_comm *comm) {
  if (!comm) return TPC_OK;
  tpc_result r = retire(comm, TPC_ENTRY_CLOSED);
  if (r != TPC_OK) return r;
  const tpc_runtime *rt = comm->rt;
  int code = rt->device_synchronize();
  if (code) r = tpc_runtime_fail(comm, rt, code, "synchronising before destroy");
  /* Before anything is freed: kernels of graphs replayed from now on find
   * the slot dead and touch no buffer. Only the alive word is written, so a
   * failure the device recorded stays readable (tpc_id_async_error). */
  const uint32_t dead = 0;
  code = rt->memcpy_any(&comm->entry->control->alive, &dead, sizeof dead);
  if (code) {
    /* A replayed graph would still pass the alive check: keep the buffer and
     * the mappings it would touch (as abort does) rather than free them. */
    return free_host_state(comm, tpc_runtime_fail(comm, rt, code,
                                                  "marking the control slot closed (the GPU memory is kept)"));
  }
  for (int p = 0; p < comm->cfg.world_size; ++p) {
    if (!(comm->opened_mask & (1u << p))) continue;
    code = rt->ipc_close(comm->bufs[p]);
    if (code && r == TPC_OK) r = tpc_runtime_fail(comm, rt, code, "closing a peer handle");
    code = rt->ipc_close(comm->peer_chunks[p]);
    if (code && r == TPC_OK) r = tpc_runtime_fail(comm, rt, code, "closing a peer's control slot");
  }
  code = rt->device_free(comm->bufs[comm->cfg.rank]);
  if (code && r == TPC_OK) r = tpc_runtime_fail(comm, rt, code, "freeing the registered buffer");
  return free_host_state(comm, r);
}

tpc_result tpc_comm_abort(tpc_comm *comm) {
  if (!comm) return TPC_OK;
  tpc_result r = retire(comm, TPC_ENTRY_ABORTED);
  if (r != TPC_OK) return r;
  const tpc_runtime *rt = comm->rt;
  /* Device first: ops still queued or spinning see `failed` and stop; a
   * graph replayed later sees the slot dead. Then every peer's stop word, so
   * their waits for this rank end now instead of at their timeout. Static
   * sources: the copies may still be in flight when this returns. */
  static const uint32_t aborted = TPC_ERR_CLOSED, dead = 0;
  static uint32_t stop_words[TPC_MAX_RANKS];
  const int me = comm->cfg.rank;
  stop_words[me] = ((uint32_t)TPC_ERR_CLOSED << 8) | (uint32_t)(me + 1);
  int current = -1;
  rt->get_device(&current);
  if (current != comm->cfg.device) rt->set_device(comm->cfg.device);
  int code = rt->write_async(&comm->entry->control->failed, &aborted, sizeof aborted);
  const int dead_code = rt->write_async(&comm->entry->control->alive, &dead, sizeof dead);
  if (code || dead_code)
    r = tpc_runtime_fail(comm, rt, code ? code : dead_code, "marking the communicator aborted on the device");
  for (int p = 0; p < comm->cfg.world_size; ++p) {
    if (p == me || !(comm->opened_mask & (1u << p))) continue;
    /* a dead peer may refuse */
    rt->write_async(&comm->peer_control[p]->stopped, &stop_words[me], sizeof stop_words[me]);
  }
  if (current >= 0 && current != comm->cfg.device) rt->set_device(current);
  /* The registered buffer and the peers' mappings stay: a kernel may still be
   * running on them, and freeing would wait for it. */
  return free_host_state(comm, r);
}

tpc_result tpc_comm_acquire(uint64_t comm_id, tpc_comm **comm_out) {
  if (!comm_out) return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "comm_out is NULL");
  *comm_out = NULL;
  tpc_registry_lock();
  tpc_entry *e = tpc_registry_find(comm_id);
  tpc_result r = TPC_OK;
  if (!e)
    r = tpc_fail(NULL, TPC_ERR_CLOSED, "comm_id %llu is unknown (never created in this process)",
                 (unsigned long long)comm_id);
  else if (e->state != TPC_ENTRY_OPEN)
    r = tpc_fail(NULL, TPC_ERR_CLOSED, "comm_id %llu is %s", (unsigned long long)comm_id,
                 e->state == TPC_ENTRY_ABORTED ? "aborted" : "closed");
  else if (e->in_use)
    r = tpc_fail(NULL, TPC_ERR_STATE,
                 "comm_id %llu is already running an op (from another thread?): ops of one "
                 "communicator must come from one thread at a time, in the same order on every rank",
                 (unsigned long long)comm_id);
  else {
    e->in_use = 1;
    *comm_out = e->comm;
  }
  tpc_registry_unlock();
  return r;
}

void tpc_comm_release(tpc_comm *comm) {
  if (!comm) return;
  tpc_registry_lock();
  comm->entry->in_use = 0;
  tpc_registry_unlock();
}

tpc_result tpc_comm_probe_write(tpc_comm *comm) {
  if (!comm || !comm->ready) return tpc_fail(comm, TPC_ERR_STATE, "probe needs a ready communicator");
  const uint32_t token = TPC_PROBE_TOKEN(comm->cfg.rank);
  for (int p = 0; p < comm->cfg.world_size; ++p) {
    if (p == comm->cfg.rank) continue;
    tpc_signals *peer = (tpc_signals *)comm->bufs[p];
    int code = comm->rt->memcpy_any(&peer->probe[comm->cfg.rank], &token, sizeof token);
    if (code) return tpc_fail(comm, TPC_ERR_PEER, "writing into peer %d's buffer failed: %s", p,
                              comm->rt->error_string(code));
  }
  int code = comm->rt->device_synchronize();
  return code ? tpc_runtime_fail(comm, comm->rt, code, "synchronising the probe") : TPC_OK;
}

tpc_result tpc_comm_probe_read(tpc_comm *comm, uint32_t *arrived_mask) {
  if (!comm || !comm->ready || !arrived_mask)
    return tpc_fail(comm, TPC_ERR_STATE, "probe needs a ready communicator");
  uint32_t probe[TPC_MAX_RANKS];
  tpc_signals *own = (tpc_signals *)comm->bufs[comm->cfg.rank];
  int code = comm->rt->memcpy_any(probe, own->probe, sizeof probe);
  if (code) return tpc_runtime_fail(comm, comm->rt, code, "reading the probe tokens");
  *arrived_mask = 0;
  for (int p = 0; p < comm->cfg.world_size; ++p)
    if (p != comm->cfg.rank && probe[p] == TPC_PROBE_TOKEN(p)) *arrived_mask |= 1u << p;
  return TPC_OK;
}

tpc_result tpc_comm_debug_set_epoch(tpc_comm *comm, uint32_t epoch) {
  if (!comm) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  int code = comm->rt->device_synchronize();
  if (!code) code = comm->rt->memcpy_any(&comm->entry->control->epoch, &epoch, sizeof epoch);
  return code ? tpc_runtime_fail(comm, comm->rt, code, "setting the epoch") : TPC_OK;
}
