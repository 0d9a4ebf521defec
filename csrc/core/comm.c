/*
 * Communicator life cycle and op validation: plain C over the runtime table.
 * Nothing here touches a GPU directly, so all of it is tested on the CPU.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tpcomm.h"
#include "layout.h"
#include "registry.h"
#include "runtime.h"

/* Token a rank writes into each peer's probe slot; the rank is folded in so
 * a token landing in the wrong slot is noticed. */
#define TPC_PROBE_TOKEN(rank) (0x7c0a0000u | (uint32_t)(rank))

struct tpc_comm {
  tpc_config cfg;
  const tpc_runtime *rt;
  tpc_layout layout;
  char *bufs[TPC_MAX_RANKS];    /* own buffer at [rank], peers' opened handles */
  uint32_t opened_mask;         /* peers whose handles are open (buffer and control chunk) */
  char *peer_chunks[TPC_MAX_RANKS];        /* peers' control pool chunks, as opened */
  tpc_control *peer_control[TPC_MAX_RANKS]; /* peers' control slots inside them */
  tpc_entry *entry;             /* id, control slot, error record (registry.c) */
  int ready;
  int failed;
  int multiprocessors;          /* of the device: the packet kernels' block cap */
  void *last_stream;            /* where the previous eager op was enqueued */
  int have_last_stream;         /* the default stream is NULL: can't be the marker */
  char last_error[512];
};

static _Thread_local char create_error[512];

static tpc_result fail(tpc_comm *comm, tpc_result code, const char *fmt, ...) {
  char *dst = comm ? comm->last_error : create_error;
  size_t cap = comm ? sizeof comm->last_error : sizeof create_error;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(dst, cap, fmt, ap);
  va_end(ap);
  return code;
}

static tpc_result runtime_fail(tpc_comm *comm, const tpc_runtime *rt, int code, const char *what) {
  return fail(comm, TPC_ERR_RUNTIME, "%s failed: %s (runtime error %d)", what,
              rt->error_string(code), code);
}

const char *tpc_result_string(tpc_result result) {
  switch (result) {
    case TPC_OK: return "success";
    case TPC_ERR_INVALID_ARG: return "invalid argument";
    case TPC_ERR_RUNTIME: return "GPU runtime error";
    case TPC_ERR_PEER: return "peer handle could not be opened";
    case TPC_ERR_STATE: return "communicator not usable in this state";
    case TPC_ERR_TIMEOUT: return "a peer did not arrive in time";
    case TPC_ERR_MISMATCH: return "peers disagree on the op or its size";
    case TPC_ERR_TOO_LARGE: return "larger than the registered buffers";
    case TPC_ERR_CLOSED: return "communicator closed";
  }
  return "unknown tpcomm result";
}

const char *tpc_comm_last_error(const tpc_comm *comm) {
  return comm ? comm->last_error : create_error;
}

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
  if (!c) return fail(NULL, TPC_ERR_INVALID_ARG, "config is NULL");
  if (c->world_size < 2 || c->world_size > TPC_MAX_RANKS)
    return fail(NULL, TPC_ERR_INVALID_ARG, "world_size %d is outside 2..%d", c->world_size,
                TPC_MAX_RANKS);
  if (c->rank < 0 || c->rank >= c->world_size)
    return fail(NULL, TPC_ERR_INVALID_ARG, "rank %d is outside 0..%d", c->rank,
                c->world_size - 1);
  if (c->device < 0 || c->device >= TPC_MAX_DEVICES)
    return fail(NULL, TPC_ERR_INVALID_ARG, "device %d is outside 0..%d", c->device, TPC_MAX_DEVICES - 1);
  if (c->max_bytes < 16 || c->max_bytes % 16)
    return fail(NULL, TPC_ERR_INVALID_ARG, "max_bytes %zu is not a positive multiple of 16",
                c->max_bytes);
  if (c->packet_max_bytes < 16 || c->packet_max_bytes % 16)
    return fail(NULL, TPC_ERR_INVALID_ARG,
                "packet_max_bytes %zu is not a positive multiple of 16", c->packet_max_bytes);
  if (c->max_bytes > ((size_t)1 << 32) || c->packet_max_bytes > ((size_t)1 << 31))
    return fail(NULL, TPC_ERR_INVALID_ARG, "max_bytes or packet_max_bytes over 4 GiB / 2 GiB");
  if (c->timeout_ns == 0) return fail(NULL, TPC_ERR_INVALID_ARG, "timeout_ns is 0");
  return TPC_OK;
}

tpc_result tpc_comm_create(const tpc_config *config, tpc_comm **comm_out) {
  if (!comm_out) return fail(NULL, TPC_ERR_INVALID_ARG, "comm_out is NULL");
  *comm_out = NULL;
  tpc_result r = check_config(config);
  if (r != TPC_OK) return r;

  const tpc_runtime *rt = tpc_runtime_get();
  tpc_comm *comm = calloc(1, sizeof *comm);
  if (!comm) return fail(NULL, TPC_ERR_RUNTIME, "out of host memory");
  comm->cfg = *config;
  comm->rt = rt;
  comm->layout = tpc_layout_for(config->world_size, config->max_bytes, config->packet_max_bytes);

  int code;
  void *own = NULL;
  if ((code = rt->set_device(config->device)) != 0) {
    r = runtime_fail(NULL, rt, code, "selecting the device");
    goto undo;
  }
  if ((code = rt->multiprocessor_count(config->device, &comm->multiprocessors)) != 0) {
    r = runtime_fail(NULL, rt, code, "reading the device's multiprocessor count");
    goto undo;
  }
  if ((code = rt->device_malloc(&own, comm->layout.total_bytes)) != 0) {
    r = runtime_fail(NULL, rt, code, "allocating the registered buffer");
    goto undo;
  }
  comm->bufs[config->rank] = own;
  /* Zero flags are "never written": epochs start at 1, so nothing stale matches. */
  if ((code = rt->device_memset(own, 0, comm->layout.total_bytes)) != 0) {
    r = runtime_fail(NULL, rt, code, "clearing the registered buffer");
    goto undo;
  }
  if ((code = rt->device_synchronize()) != 0) {
    r = runtime_fail(NULL, rt, code, "synchronising after set-up");
    goto undo;
  }
  /* Last: an id is only handed out to a communicator that exists. */
  if ((code = tpc_registry_add(rt, config->device, &comm->entry)) != 0) {
    r = code < 0 ? fail(NULL, TPC_ERR_RUNTIME, "out of host memory for the communicator registry")
                 : runtime_fail(NULL, rt, code, "allocating the control pool");
    goto undo;
  }
  /* The slot is fresh (never used by another communicator): epoch and failed
   * are 0; alive becomes this id, which the kernels compare with theirs. */
  const tpc_control control = {(uint32_t)comm->entry->id, 0, 0, 0};
  if ((code = rt->memcpy_any(comm->entry->control, &control, sizeof control)) != 0) {
    r = runtime_fail(NULL, rt, code, "initialising the control slot");
    goto undo; /* the id stays retired: it was never open */
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

uint64_t tpc_comm_id(const tpc_comm *comm) { return comm ? comm->entry->id : 0; }

/* The exported blob: [0, 64) the buffer's handle, [64, 128) the control
 * chunk's handle, [128, 136) the control slot's offset in that chunk. */
#define TPC_CHUNK_HANDLE_AT TPC_ALLOC_HANDLE_BYTES
#define TPC_CONTROL_OFFSET_AT (2 * TPC_ALLOC_HANDLE_BYTES)

tpc_result tpc_comm_export(tpc_comm *comm, void *handle_out) {
  if (!comm || !handle_out) return fail(comm, TPC_ERR_INVALID_ARG, "NULL argument");
  unsigned char *out = handle_out;
  memset(out, 0, TPC_IPC_HANDLE_BYTES);
  int code = comm->rt->ipc_export(out, comm->bufs[comm->cfg.rank]);
  if (code) return runtime_fail(comm, comm->rt, code, "exporting the IPC handle");
  code = comm->rt->ipc_export(out + TPC_CHUNK_HANDLE_AT, comm->entry->control_chunk);
  if (code) return runtime_fail(comm, comm->rt, code, "exporting the control slot's IPC handle");
  const uint64_t offset = (uint64_t)((char *)comm->entry->control - (char *)comm->entry->control_chunk);
  memcpy(out + TPC_CONTROL_OFFSET_AT, &offset, sizeof offset);
  return TPC_OK;
}

tpc_result tpc_comm_open_peer(tpc_comm *comm, int peer, const void *handle) {
  if (!comm || !handle) return fail(comm, TPC_ERR_INVALID_ARG, "NULL argument");
  if (comm->ready) return fail(comm, TPC_ERR_STATE, "peers are already fixed (ready was called)");
  if (peer < 0 || peer >= comm->cfg.world_size)
    return fail(comm, TPC_ERR_INVALID_ARG, "peer %d is outside 0..%d", peer,
                comm->cfg.world_size - 1);
  if (peer == comm->cfg.rank)
    return fail(comm, TPC_ERR_INVALID_ARG, "peer %d is this rank itself", peer);
  if (comm->opened_mask & (1u << peer))
    return fail(comm, TPC_ERR_STATE, "peer %d is already open", peer);
  const unsigned char *in = handle;
  uint64_t offset;
  memcpy(&offset, in + TPC_CONTROL_OFFSET_AT, sizeof offset);
  if (offset % sizeof(tpc_control) || offset > TPC_CONTROL_CHUNK_BYTES - sizeof(tpc_control))
    return fail(comm, TPC_ERR_PEER, "peer %d sent a control slot offset of %llu", peer,
                (unsigned long long)offset);
  void *ptr = NULL, *chunk = NULL;
  int code = comm->rt->ipc_open(&ptr, in);
  if (code)
    return fail(comm, TPC_ERR_PEER, "opening the IPC handle of peer %d failed: %s", peer,
                comm->rt->error_string(code));
  /* The same chunk may already be open for another communicator: the
   * runtime counts the opens and returns the same address. */
  code = comm->rt->ipc_open(&chunk, in + TPC_CHUNK_HANDLE_AT);
  if (code) {
    comm->rt->ipc_close(ptr);
    return fail(comm, TPC_ERR_PEER, "opening the control slot of peer %d failed: %s", peer,
                comm->rt->error_string(code));
  }
  comm->bufs[peer] = ptr;
  comm->peer_chunks[peer] = chunk;
  comm->peer_control[peer] = (tpc_control *)((char *)chunk + offset);
  comm->opened_mask |= 1u << peer;
  return TPC_OK;
}

tpc_result tpc_comm_ready(tpc_comm *comm) {
  if (!comm) return fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  for (int p = 0; p < comm->cfg.world_size; ++p)
    if (p != comm->cfg.rank && !(comm->opened_mask & (1u << p)))
      return fail(comm, TPC_ERR_STATE, "peer %d has not been opened", p);
  comm->ready = 1;
  return TPC_OK;
}

/* Retires the id: later lookups say "closed". Refused while another thread
 * holds the communicator for an op. */
static tpc_result retire(tpc_comm *comm, tpc_entry_state state) {
  tpc_registry_lock();
  const int busy = comm->entry->in_use;
  if (!busy) {
    comm->entry->comm = NULL;
    comm->entry->state = state;
  }
  tpc_registry_unlock();
  return busy ? fail(comm, TPC_ERR_STATE, "communicator %llu is running an op (from another thread?)",
                     (unsigned long long)comm->entry->id)
              : TPC_OK;
}

/* A failure's message, moved to the thread's slot (tpc_comm_last_error(NULL))
 * for a caller that will not hold the communicator to read it from. */
static tpc_result to_thread_slot(const tpc_comm *comm, tpc_result r) {
  if (r != TPC_OK) snprintf(create_error, sizeof create_error, "%s", comm->last_error);
  return r;
}

/* The host state of a communicator that is going: its last error moves to
 * the thread's slot before it is freed. */
static tpc_result free_host_state(tpc_comm *comm, tpc_result r) {
  to_thread_slot(comm, r);
  free(comm);
  return r;
}

tpc_result tpc_comm_destroy(tpc_comm *comm) {
  if (!comm) return TPC_OK;
  tpc_result r = retire(comm, TPC_ENTRY_CLOSED);
  if (r != TPC_OK) return r;
  const tpc_runtime *rt = comm->rt;
  int code = rt->device_synchronize();
  if (code) r = runtime_fail(comm, rt, code, "synchronising before destroy");
  /* Before anything is freed: kernels of graphs replayed from now on find
   * the slot dead and touch no buffer. Only the alive word is written, so a
   * failure the device recorded stays readable (tpc_id_async_error). */
  const uint32_t dead = 0;
  code = rt->memcpy_any(&comm->entry->control->alive, &dead, sizeof dead);
  if (code) {
    /* A replayed graph would still pass the alive check: keep the buffer and
     * the mappings it would touch (as abort does) rather than free them. */
    return free_host_state(comm, runtime_fail(comm, rt, code,
                                              "marking the control slot closed (the GPU memory is kept)"));
  }
  for (int p = 0; p < comm->cfg.world_size; ++p) {
    if (!(comm->opened_mask & (1u << p))) continue;
    code = rt->ipc_close(comm->bufs[p]);
    if (code && r == TPC_OK) r = runtime_fail(comm, rt, code, "closing a peer handle");
    code = rt->ipc_close(comm->peer_chunks[p]);
    if (code && r == TPC_OK) r = runtime_fail(comm, rt, code, "closing a peer's control slot");
  }
  code = rt->device_free(comm->bufs[comm->cfg.rank]);
  if (code && r == TPC_OK) r = runtime_fail(comm, rt, code, "freeing the registered buffer");
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
    r = runtime_fail(comm, rt, code ? code : dead_code, "marking the communicator aborted on the device");
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

tpc_result tpc_comm_acquire(uint64_t id, tpc_comm **comm_out) {
  if (!comm_out) return fail(NULL, TPC_ERR_INVALID_ARG, "comm_out is NULL");
  *comm_out = NULL;
  tpc_registry_lock();
  tpc_entry *e = tpc_registry_find(id);
  tpc_result r = TPC_OK;
  if (!e)
    r = fail(NULL, TPC_ERR_CLOSED, "communicator id %llu is unknown (never created in this process)",
             (unsigned long long)id);
  else if (e->state != TPC_ENTRY_OPEN)
    r = fail(NULL, TPC_ERR_CLOSED, "communicator id %llu is %s", (unsigned long long)id,
             e->state == TPC_ENTRY_ABORTED ? "aborted" : "closed");
  else if (e->in_use)
    r = fail(NULL, TPC_ERR_STATE,
             "communicator id %llu is already running an op (from another thread?): ops of one "
             "communicator must come from one thread at a time, in the same order on every rank",
             (unsigned long long)id);
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
  if (!comm || !comm->ready) return fail(comm, TPC_ERR_STATE, "probe needs a ready communicator");
  const uint32_t token = TPC_PROBE_TOKEN(comm->cfg.rank);
  for (int p = 0; p < comm->cfg.world_size; ++p) {
    if (p == comm->cfg.rank) continue;
    tpc_signals *peer = (tpc_signals *)comm->bufs[p];
    int code = comm->rt->memcpy_any(&peer->probe[comm->cfg.rank], &token, sizeof token);
    if (code) return fail(comm, TPC_ERR_PEER, "writing into peer %d's buffer failed: %s", p,
                          comm->rt->error_string(code));
  }
  int code = comm->rt->device_synchronize();
  return code ? runtime_fail(comm, comm->rt, code, "synchronising the probe") : TPC_OK;
}

tpc_result tpc_comm_probe_read(tpc_comm *comm, uint32_t *arrived_mask) {
  if (!comm || !comm->ready || !arrived_mask)
    return fail(comm, TPC_ERR_STATE, "probe needs a ready communicator");
  uint32_t probe[TPC_MAX_RANKS];
  tpc_signals *own = (tpc_signals *)comm->bufs[comm->cfg.rank];
  int code = comm->rt->memcpy_any(probe, own->probe, sizeof probe);
  if (code) return runtime_fail(comm, comm->rt, code, "reading the probe tokens");
  *arrived_mask = 0;
  for (int p = 0; p < comm->cfg.world_size; ++p)
    if (p != comm->cfg.rank && probe[p] == TPC_PROBE_TOKEN(p)) *arrived_mask |= 1u << p;
  return TPC_OK;
}

static const char *op_name(uint32_t kind) {
  switch (kind & 0xffu) {
    case TPC_OP_ALL_REDUCE: return "all_reduce";
    case TPC_OP_ALL_GATHER: return "all_gather";
    case TPC_OP_REDUCE_SCATTER: return "reduce_scatter";
  }
  return "an unknown op";
}

static const char *algo_name(uint32_t kind) {
  switch ((kind >> 8) & 0xffu) {
    case TPC_ALGO_PACKET: return "packet";
    case TPC_ALGO_BULK: return "bulk";
    case TPC_ALGO_LINE: return "line";
  }
  return "?";
}

/* The first field in which two header announcements differ. */
static const char *differing_field(const tpc_async_error *e) {
  if ((e->peer_kind ^ e->own_kind) & 0xffu) return "op";
  if (e->peer_bytes != e->own_bytes) return "size";
  if ((e->peer_kind ^ e->own_kind) & 0xff00u) return "algorithm";
  if ((e->peer_kind ^ e->own_kind) & 0xff0000u) return "dtype";
  return "layout (all_gather dim)";
}

/* Turns a device error record into the error's code and message. */
static tpc_result describe(tpc_comm *comm, int rank, uint64_t id, uint64_t timeout_ns,
                           const tpc_async_error *e) {
  const char *tail = "the communicator is unusable: abort() or close() it and create a new one";
  switch (e->code) {
    case TPC_OK:
      return TPC_OK;
    case TPC_ERR_TIMEOUT:
      if (e->reported)
        return fail(comm, TPC_ERR_TIMEOUT,
                    "rank %d: peer %d gave up op #%u on communicator %llu (a rank did not arrive "
                    "within %.3f s); this rank's output of that op is NaN; %s",
                    rank, e->peer, e->epoch, (unsigned long long)id, timeout_ns / 1e9, tail);
      return fail(comm, TPC_ERR_TIMEOUT,
                  "rank %d: peer %d did not arrive within %.3f s (op #%u on communicator %llu); %s",
                  rank, e->peer, timeout_ns / 1e9, e->epoch, (unsigned long long)id, tail);
    case TPC_ERR_MISMATCH:
      if (e->reported)
        return fail(comm, TPC_ERR_MISMATCH,
                    "rank %d: peer %d found that the ranks called different ops at op #%u on "
                    "communicator %llu; %s", rank, e->peer, e->epoch, (unsigned long long)id, tail);
      return fail(comm, TPC_ERR_MISMATCH,
                  "rank %d: peer %d called a different op at op #%u on communicator %llu: the %s "
                  "differs (peer: %s %s of %u bytes, this rank: %s %s of %u bytes); %s",
                  rank, e->peer, e->epoch, (unsigned long long)id, differing_field(e),
                  op_name(e->peer_kind), algo_name(e->peer_kind), e->peer_bytes,
                  op_name(e->own_kind), algo_name(e->own_kind), e->own_bytes, tail);
    case TPC_ERR_CLOSED:
      if (e->reported)
        return fail(comm, TPC_ERR_CLOSED,
                    "rank %d: peer %d aborted communicator %llu (noticed at op #%u); %s", rank,
                    e->peer, (unsigned long long)id, e->epoch, tail);
      return fail(comm, TPC_ERR_CLOSED,
                  "rank %d: an op of communicator %llu ran after it was closed or aborted (a CUDA "
                  "graph captured on it was replayed): it wrote nothing but NaN into a floating-point output",
                  rank, (unsigned long long)id);
  }
  return fail(comm, (tpc_result)e->code, "rank %d: device error %d involving peer %d (op #%u)", rank,
              e->code, e->peer, e->epoch);
}

/* The device writes the record's code last, after a system fence; a
 * volatile read sees it without synchronising any stream. */
static tpc_async_error read_record(const tpc_async_error *record) {
  const volatile tpc_async_error *rec = record;
  tpc_async_error copy;
  copy.code = rec->code;
  copy.peer = rec->peer;
  copy.epoch = rec->epoch;
  copy.reported = rec->reported;
  copy.peer_bytes = rec->peer_bytes;
  copy.peer_kind = rec->peer_kind;
  copy.own_bytes = rec->own_bytes;
  copy.own_kind = rec->own_kind;
  return copy;
}

tpc_result tpc_comm_async_error(tpc_comm *comm, tpc_async_error *out) {
  if (!comm) return fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  const tpc_async_error copy = read_record(comm->entry->record);
  if (out) *out = copy;
  if (copy.code == TPC_OK) return TPC_OK;
  comm->failed = 1;
  return describe(comm, comm->cfg.rank, comm->entry->id, comm->cfg.timeout_ns, &copy);
}

tpc_result tpc_id_async_error(uint64_t id, tpc_async_error *out) {
  tpc_registry_lock();
  tpc_entry *e = tpc_registry_find(id);
  const tpc_entry_state state = e ? e->state : TPC_ENTRY_CLOSED;
  const tpc_async_error copy = e ? read_record(e->record) : (tpc_async_error){0};
  tpc_registry_unlock();
  if (out) *out = copy;
  if (!e) return fail(NULL, TPC_ERR_INVALID_ARG, "communicator id %llu is unknown", (unsigned long long)id);
  if (copy.code != TPC_OK) return describe(NULL, e->rank, id, e->timeout_ns, &copy);
  if (state != TPC_ENTRY_OPEN)
    return fail(NULL, TPC_ERR_CLOSED, "communicator id %llu is %s", (unsigned long long)id,
                state == TPC_ENTRY_ABORTED ? "aborted" : "closed");
  return TPC_OK;
}

tpc_result tpc_comm_debug_set_epoch(tpc_comm *comm, uint32_t epoch) {
  if (!comm) return fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  int code = comm->rt->device_synchronize();
  if (!code) code = comm->rt->memcpy_any(&comm->entry->control->epoch, &epoch, sizeof epoch);
  return code ? runtime_fail(comm, comm->rt, code, "setting the epoch") : TPC_OK;
}

/* Shared preconditions of every op: usable communicator, async errors surfaced,
 * and ops of one communicator serialised even across streams. */
static tpc_result begin_op(tpc_comm *comm, const void *in, void *out, void *stream) {
  if (!comm) return fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  if (!comm->ready) return fail(comm, TPC_ERR_STATE, "communicator is not ready (peers not opened)");
  tpc_result r = tpc_comm_async_error(comm, NULL);
  if (r != TPC_OK) return r;
  if (comm->failed) return fail(comm, TPC_ERR_STATE, "communicator failed earlier: %s", comm->last_error);
  if (!in || !out) return fail(comm, TPC_ERR_INVALID_ARG, "NULL input or output");
  /* One op in flight per communicator: its buffers and epoch are shared, so
   * an op on a new stream must not overlap the previous stream's op. On the
   * previous op's stream (the common case) nothing needs waiting for, captured
   * or not, so the capture query (a driver call) is made only when the stream
   * changed: one call fewer on the host path of every op. */
  if (comm->have_last_stream && comm->last_stream == stream) return TPC_OK;
  int capturing = 0;
  int code = comm->rt->stream_is_capturing(stream, &capturing);
  if (code) return runtime_fail(comm, comm->rt, code, "querying the stream's capture state");
  if (!capturing) {
    if (comm->have_last_stream) {
      code = comm->rt->stream_synchronize(comm->last_stream);
      if (code) return runtime_fail(comm, comm->rt, code, "waiting for the previous stream");
    }
    comm->last_stream = stream;
    comm->have_last_stream = 1;
  }
  return TPC_OK;
}

static void fill_args(const tpc_comm *comm, tpc_kernel_args *a, const void *in, void *out,
                      size_t nbytes, size_t out_bytes, size_t row_bytes, int dtype, int op,
                      int algo, uint64_t nan_pattern) {
  memset(a, 0, sizeof *a);
  for (int p = 0; p < comm->cfg.world_size; ++p) a->bufs[p] = comm->bufs[p];
  a->control = comm->entry->control;
  for (int p = 0; p < comm->cfg.world_size; ++p)
    if (p != comm->cfg.rank) a->peer_control[p] = comm->peer_control[p];
  a->err = comm->entry->record_device;
  a->alive_id = (uint32_t)comm->entry->id;
  a->kind = tpc_kind_word(op, algo, dtype, row_bytes);
  a->poison = nan_pattern;
  a->poison_out = nan_pattern != 0;
  a->in = in;
  a->out = out;
  a->nbytes = nbytes;
  a->out_bytes = out_bytes;
  a->row_bytes = row_bytes;
  a->timeout_ns = comm->cfg.timeout_ns;
  a->packet_off = comm->layout.packet_off;
  a->packet_slot_bytes = comm->layout.packet_slot_bytes;
  a->data_off = comm->layout.data_off;
  a->data_bytes = comm->layout.data_bytes;
  a->rank = comm->cfg.rank;
  a->world = comm->cfg.world_size;
  a->dtype = dtype;
  a->op = op;
  a->max_blocks = comm->multiprocessors;
}

/* Launches on the communicator's device whatever the caller's current device
 * is, and puts the caller's back: the binding needs no device guard. */
static tpc_result launch_on_device(tpc_comm *comm, int op, const tpc_kernel_args *a, int algo,
                                   void *stream) {
  const tpc_runtime *rt = comm->rt;
  int current = -1;
  int code = rt->get_device(&current);
  if (code) return runtime_fail(comm, rt, code, "reading the current device");
  if (current != comm->cfg.device && (code = rt->set_device(comm->cfg.device)) != 0)
    return runtime_fail(comm, rt, code, "selecting the communicator's device");
  const char *what = "launching reduce_scatter";
  if (op == TPC_OP_ALL_REDUCE_NORM) {
    code = rt->launch_all_reduce_norm(a, stream);
    what = "launching all_reduce_add_rms_norm";
  } else if (op == TPC_OP_ALL_REDUCE) {
    code = rt->launch_all_reduce(a, algo, stream);
    what = "launching all_reduce";
  } else if (op == TPC_OP_ALL_GATHER) {
    code = rt->launch_all_gather(a, algo, stream);
    what = "launching all_gather";
  } else {
    code = rt->launch_reduce_scatter(a, algo, stream);
  }
  if (current != comm->cfg.device) rt->set_device(current);
  return code ? runtime_fail(comm, rt, code, what) : TPC_OK;
}

static int misaligned(const void *p, size_t to) { return ((uintptr_t)p % to) != 0; }

/* NaN of each reducible dtype, repeated over 8 bytes. */
static const uint64_t reduce_nan[] = {0x7fc000007fc00000ull, 0x7e007e007e007e00ull, 0x7fc07fc07fc07fc0ull};

/* The kernel the caller chose, one of the three: the core never picks one. */
static tpc_result check_algo(tpc_comm *comm, const char *name, tpc_algo algo) {
  if (algo == TPC_ALGO_PACKET || algo == TPC_ALGO_BULK || algo == TPC_ALGO_LINE) return TPC_OK;
  return fail(comm, TPC_ERR_INVALID_ARG, "%s: unknown algorithm %d (packet %d, bulk %d or line %d)", name,
              (int)algo, TPC_ALGO_PACKET, TPC_ALGO_BULK, TPC_ALGO_LINE);
}

/* all_reduce and reduce_scatter: `nbytes` is what each rank reduces per
 * chunk (the whole input for all_reduce, one chunk for reduce_scatter),
 * `in_bytes` the whole input; out_f32: out takes the fp32 sums (reduce_scatter
 * only). Checks what the chosen kernel needs, launches. */
static tpc_result reduce_op(tpc_comm *comm, int op, const char *name, const void *in, void *out,
                            size_t nbytes, size_t in_bytes, tpc_dtype dtype, tpc_algo algo, int out_f32,
                            void *stream) {
  tpc_result r = begin_op(comm, in, out, stream);
  if (r == TPC_OK) r = check_algo(comm, name, algo);
  if (r != TPC_OK) return r;
  if (dtype != TPC_FLOAT32 && dtype != TPC_FLOAT16 && dtype != TPC_BFLOAT16)
    return fail(comm, TPC_ERR_INVALID_ARG, "dtype %d is not float32, float16 or bfloat16", dtype);
  if (nbytes == 0 || nbytes % 16)
    return fail(comm, TPC_ERR_INVALID_ARG, "%s of %zu bytes: a positive multiple of 16 is needed", name, nbytes);
  if (misaligned(in, 16) || misaligned(out, 16))
    return fail(comm, TPC_ERR_INVALID_ARG, "%s input and output must be 16-byte aligned", name);
  if (algo == TPC_ALGO_LINE && op != TPC_OP_ALL_REDUCE)
    return fail(comm, TPC_ERR_INVALID_ARG, "%s has no line kernel", name);
  /* lines live in the packet slots: 112 data bytes in 128, within the cap */
  if (algo != TPC_ALGO_BULK && nbytes > comm->cfg.packet_max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "%s of %zu bytes is over the packet cap of %zu", name, nbytes,
                comm->cfg.packet_max_bytes);
  if (algo == TPC_ALGO_BULK && in_bytes > comm->cfg.max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "%s of %zu bytes is over the cap of %zu", name, in_bytes,
                comm->cfg.max_bytes);
  /* fp32 sums take 4 bytes a value: twice the chunk of a 16-bit dtype */
  const size_t out_bytes = out_f32 && dtype != TPC_FLOAT32 ? 2 * nbytes : nbytes;
  tpc_kernel_args a;
  fill_args(comm, &a, in, out, nbytes, out_bytes, nbytes, dtype, op, algo,
            reduce_nan[out_f32 ? TPC_FLOAT32 : dtype]);
  a.out_f32 = out_f32;
  return launch_on_device(comm, op, &a, algo, stream);
}

tpc_result tpc_all_reduce(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          tpc_dtype dtype, tpc_algo algo, void *stream) {
  return reduce_op(comm, TPC_OP_ALL_REDUCE, "all_reduce", in, out, nbytes, nbytes, dtype, algo, 0, stream);
}

tpc_result tpc_id_all_reduce(uint64_t id, const void *in, void *out, size_t nbytes, tpc_dtype dtype,
                             tpc_algo algo, void *stream) {
  tpc_comm *comm = NULL;
  tpc_result r = tpc_comm_acquire(id, &comm);
  if (r != TPC_OK) return r;
  r = to_thread_slot(comm, tpc_all_reduce(comm, in, out, nbytes, dtype, algo, stream));
  tpc_comm_release(comm);
  return r;
}

static tpc_result reduce_scatter(tpc_comm *comm, const void *in, void *out, size_t chunk_bytes,
                                 tpc_dtype dtype, tpc_algo algo, int out_f32, void *stream) {
  const size_t world = comm ? (size_t)comm->cfg.world_size : 0;
  if (comm && chunk_bytes > ((size_t)1 << 40))
    return fail(comm, TPC_ERR_TOO_LARGE, "reduce_scatter chunk of %zu bytes", chunk_bytes);
  return reduce_op(comm, TPC_OP_REDUCE_SCATTER, "reduce_scatter", in, out, chunk_bytes, chunk_bytes * world,
                   dtype, algo, out_f32, stream);
}

tpc_result tpc_reduce_scatter(tpc_comm *comm, const void *in, void *out, size_t chunk_bytes,
                              tpc_dtype dtype, tpc_algo algo, void *stream) {
  return reduce_scatter(comm, in, out, chunk_bytes, dtype, algo, 0, stream);
}

tpc_result tpc_reduce_scatter_f32(tpc_comm *comm, const void *in, float *out, size_t chunk_bytes,
                                  tpc_dtype dtype, tpc_algo algo, void *stream) {
  return reduce_scatter(comm, in, out, chunk_bytes, dtype, algo, 1, stream);
}

tpc_result tpc_all_reduce_add_rms_norm(tpc_comm *comm, const void *in, const void *residual, const void *weight,
                                       void *normed, void *residual_out, size_t nbytes, size_t row_bytes,
                                       tpc_dtype dtype, float eps, void *stream) {
  static const char name[] = "all_reduce_add_rms_norm";
  tpc_result r = begin_op(comm, in, normed, stream);
  if (r != TPC_OK) return r;
  if (!residual || !weight || !residual_out)
    return fail(comm, TPC_ERR_INVALID_ARG, "%s: NULL residual, weight or residual output", name);
  if (dtype != TPC_FLOAT16 && dtype != TPC_BFLOAT16)
    return fail(comm, TPC_ERR_INVALID_ARG, "%s: dtype %d is not float16 or bfloat16", name, dtype);
  if (row_bytes == 0 || row_bytes % 16 || row_bytes > TPC_NORM_MAX_ROW_BYTES)
    return fail(comm, TPC_ERR_INVALID_ARG, "%s: a row of %zu bytes: a multiple of 16 up to %d is needed", name,
                row_bytes, TPC_NORM_MAX_ROW_BYTES);
  if (nbytes == 0 || nbytes % row_bytes)
    return fail(comm, TPC_ERR_INVALID_ARG, "%s of %zu bytes: a positive number of %zu-byte rows is needed", name,
                nbytes, row_bytes);
  if (nbytes > comm->cfg.packet_max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "%s of %zu bytes is over the packet cap of %zu", name, nbytes,
                comm->cfg.packet_max_bytes);
  if (misaligned(in, 16) || misaligned(residual, 16) || misaligned(weight, 16) || misaligned(normed, 16) ||
      misaligned(residual_out, 16))
    return fail(comm, TPC_ERR_INVALID_ARG, "%s: every tensor must be 16-byte aligned", name);
  if (!(eps >= 0.0f) || eps > 1.0f)
    return fail(comm, TPC_ERR_INVALID_ARG, "%s: eps %g is not in [0, 1]", name, (double)eps);
  tpc_kernel_args a;
  fill_args(comm, &a, in, normed, nbytes, nbytes, row_bytes, dtype, TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET,
            reduce_nan[dtype]);
  a.residual = residual;
  a.weight = weight;
  a.out2 = residual_out;
  a.eps = eps;
  return launch_on_device(comm, TPC_OP_ALL_REDUCE_NORM, &a, TPC_ALGO_PACKET, stream);
}

tpc_result tpc_all_gather(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          size_t row_bytes, tpc_algo algo, uint64_t nan_pattern, void *stream) {
  static const char name[] = "all_gather";
  tpc_result r = begin_op(comm, in, out, stream);
  if (r == TPC_OK) r = check_algo(comm, name, algo);
  if (r != TPC_OK) return r;
  if (nbytes == 0 || nbytes % 4)
    return fail(comm, TPC_ERR_INVALID_ARG, "all_gather of %zu bytes: a positive multiple of 4 is needed", nbytes);
  if (row_bytes == 0 || row_bytes % 4 || nbytes % row_bytes)
    return fail(comm, TPC_ERR_INVALID_ARG, "row of %zu bytes must be a positive multiple of 4 dividing %zu",
                row_bytes, nbytes);
  /* every kernel variant is chosen by shape; none may depend on a pointer */
  if (misaligned(in, 16) || misaligned(out, 16))
    return fail(comm, TPC_ERR_INVALID_ARG, "all_gather input and output must be 16-byte aligned");
  const size_t out_bytes = nbytes * (size_t)comm->cfg.world_size;
  if (algo != TPC_ALGO_PACKET && (nbytes % 16 || row_bytes % 16)) /* line and bulk move 16-byte units */
    return fail(comm, TPC_ERR_INVALID_ARG, "%s all_gather needs 16-byte sizes and rows",
                algo == TPC_ALGO_BULK ? "bulk" : "line");
  if (algo != TPC_ALGO_BULK && nbytes > comm->cfg.packet_max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "all_gather of %zu bytes per rank is over the packet cap of %zu",
                nbytes, comm->cfg.packet_max_bytes);
  if (algo == TPC_ALGO_BULK && out_bytes > comm->cfg.max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "all_gather output of %zu bytes is over the cap of %zu",
                out_bytes, comm->cfg.max_bytes);
  tpc_kernel_args a;
  fill_args(comm, &a, in, out, nbytes, out_bytes, row_bytes, 0, TPC_OP_ALL_GATHER, algo, nan_pattern);
  return launch_on_device(comm, TPC_OP_ALL_GATHER, &a, algo, stream);
}
