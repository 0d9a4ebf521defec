/*
 * Errors: the result strings, the last-error slots (one per communicator,
 * one per thread for calls without one) and the device's error record, read
 * without synchronising and turned into a code and a message.
 */
#include <stdarg.h>
#include <stdio.h>

#include "comm_internal.h"

/* The message of a failed call that has no communicator to hold it (create,
 * acquire, a comm_id's op): per thread, so threads do not read each other's. */
static _Thread_local char thread_error[TPC_ERROR_BYTES];

tpc_result tpc_fail(tpc_comm *comm, tpc_result code, const char *fmt, ...) {
  char *dst = comm ? comm->last_error : thread_error;
  size_t cap = comm ? sizeof comm->last_error : sizeof thread_error;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(dst, cap, fmt, ap);
  va_end(ap);
  return code;
}

tpc_result tpc_runtime_fail(tpc_comm *comm, const tpc_runtime *rt, int code, const char *what) {
  return tpc_fail(comm, TPC_ERR_RUNTIME, "%s failed: %s (runtime error %d)", what, rt->error_string(code), code);
}

tpc_result tpc_to_thread_slot(const tpc_comm *comm, tpc_result r) {
  if (r != TPC_OK) snprintf(thread_error, sizeof thread_error, "%s", comm->last_error);
  return r;
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
  return comm ? comm->last_error : thread_error;
}

/* The op of a kind word, named into buf (a fused norm by its pattern and FP8 epilogue). */
static const char *op_name(uint32_t kind, char *buf, size_t len) {
  static const char *const patterns[] = {"ADD_NORM",       "NORM_ADD",       "NORM_ADD_NORM",
                                         "ADD_LAYER_NORM", "LAYER_NORM_ADD", "LAYER_NORM_ADD_LAYER_NORM"};
  static const char *const quants[] = {"", " fp8 PER_TENSOR", " fp8 PER_TOKEN", " fp8 PER_TOKEN_GROUP"};
  if (TPC_KIND_BASE_OP(kind) == TPC_OP_ALL_REDUCE_NORM && TPC_KIND_PATTERN(kind) < 6) {
    snprintf(buf, len, "all_reduce_norm %s%s", patterns[TPC_KIND_PATTERN(kind)], quants[TPC_KIND_QUANT(kind)]);
    return buf;
  }
  switch (TPC_KIND_OP(kind)) {
    case TPC_OP_ALL_REDUCE: return "all_reduce";
    case TPC_OP_ALL_GATHER: return "all_gather";
    case TPC_OP_REDUCE_SCATTER: return "reduce_scatter";
  }
  return "an unknown op";
}

static const char *algo_name(uint32_t kind) {
  switch (TPC_KIND_ALGO(kind)) {
    case TPC_ALGO_PACKET: return "packet";
    case TPC_ALGO_BULK: return "bulk";
    case TPC_ALGO_LINE: return "line";
    case TPC_ALGO_TWO_SHOT: return "two_shot";
  }
  return "?";
}

/* The first field in which two header announcements differ. */
static const char *differing_field(const tpc_async_error *e) {
  if (TPC_KIND_OP(e->peer_kind) != TPC_KIND_OP(e->own_kind)) return "op";
  if (e->peer_bytes != e->own_bytes) return "size";
  if (TPC_KIND_ALGO(e->peer_kind) != TPC_KIND_ALGO(e->own_kind)) return "algorithm";
  if (TPC_KIND_DTYPE(e->peer_kind) != TPC_KIND_DTYPE(e->own_kind)) return "dtype";
  return "layout (all_gather dim)";
}

/* Turns a device error record into the error's code and message. */
static tpc_result describe(tpc_comm *comm, int rank, uint64_t comm_id, uint64_t timeout_ns,
                           const tpc_async_error *e) {
  const char *tail = "the communicator is unusable: abort() or close() it and create a new one";
  switch (e->code) {
    case TPC_OK:
      return TPC_OK;
    case TPC_ERR_TIMEOUT:
      if (e->reported)
        return tpc_fail(comm, TPC_ERR_TIMEOUT,
                        "rank %d: peer %d gave up op #%u on comm_id %llu (a rank did not arrive "
                        "within %.3f s); this rank's output of that op is NaN; %s",
                        rank, e->peer, e->epoch, (unsigned long long)comm_id, timeout_ns / 1e9, tail);
      return tpc_fail(comm, TPC_ERR_TIMEOUT,
                      "rank %d: peer %d did not arrive within %.3f s (op #%u on comm_id %llu); %s",
                      rank, e->peer, timeout_ns / 1e9, e->epoch, (unsigned long long)comm_id, tail);
    case TPC_ERR_MISMATCH: {
      char peer_op[64], own_op[64];
      if (e->reported)
        return tpc_fail(comm, TPC_ERR_MISMATCH,
                        "rank %d: peer %d found that the ranks called different ops at op #%u on "
                        "comm_id %llu; %s", rank, e->peer, e->epoch, (unsigned long long)comm_id, tail);
      return tpc_fail(comm, TPC_ERR_MISMATCH,
                      "rank %d: peer %d called a different op at op #%u on comm_id %llu: the %s "
                      "differs (peer: %s %s of %u bytes, this rank: %s %s of %u bytes); %s",
                      rank, e->peer, e->epoch, (unsigned long long)comm_id, differing_field(e),
                      op_name(e->peer_kind, peer_op, sizeof peer_op), algo_name(e->peer_kind), e->peer_bytes,
                      op_name(e->own_kind, own_op, sizeof own_op), algo_name(e->own_kind), e->own_bytes, tail);
    }
    case TPC_ERR_CLOSED:
      if (e->reported)
        return tpc_fail(comm, TPC_ERR_CLOSED,
                        "rank %d: peer %d aborted comm_id %llu (noticed at op #%u); %s", rank,
                        e->peer, (unsigned long long)comm_id, e->epoch, tail);
      return tpc_fail(comm, TPC_ERR_CLOSED,
                      "rank %d: an op of comm_id %llu ran after it was closed or aborted (a CUDA "
                      "graph captured on it was replayed): it wrote nothing but NaN into a floating-point output",
                      rank, (unsigned long long)comm_id);
  }
  return tpc_fail(comm, (tpc_result)e->code, "rank %d: device error %d involving peer %d (op #%u)", rank,
                  e->code, e->peer, e->epoch);
}

/* The device writes the record's code last, after a system fence; a
 * volatile read sees it without synchronising any stream. */
tpc_async_error tpc_read_record(const tpc_async_error *record) {
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
  if (!comm) return tpc_fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  const tpc_async_error copy = tpc_read_record(comm->entry->record);
  if (out) *out = copy;
  if (copy.code == TPC_OK) return TPC_OK;
  comm->failed = 1;
  return describe(comm, comm->cfg.rank, comm->entry->comm_id, comm->cfg.timeout_ns, &copy);
}

tpc_result tpc_id_async_error(uint64_t comm_id, tpc_async_error *out) {
  tpc_registry_lock();
  tpc_entry *e = tpc_registry_find(comm_id);
  const tpc_entry_state state = e ? e->state : TPC_ENTRY_CLOSED;
  const tpc_async_error copy = e ? tpc_read_record(e->record) : (tpc_async_error){0};
  tpc_registry_unlock();
  if (out) *out = copy;
  if (!e) return tpc_fail(NULL, TPC_ERR_INVALID_ARG, "comm_id %llu is unknown", (unsigned long long)comm_id);
  if (copy.code != TPC_OK) return describe(NULL, e->rank, comm_id, e->timeout_ns, &copy);
  if (state != TPC_ENTRY_OPEN)
    return tpc_fail(NULL, TPC_ERR_CLOSED, "comm_id %llu is %s", (unsigned long long)comm_id,
                    state == TPC_ENTRY_ABORTED ? "aborted" : "closed");
  return TPC_OK;
}
