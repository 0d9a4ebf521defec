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
#include "runtime.h"

/* Token a rank writes into each peer's probe slot; the rank is folded in so
 * a token landing in the wrong slot is noticed. */
#define TPC_PROBE_TOKEN(rank) (0x7c0a0000u | (uint32_t)(rank))

struct tpc_comm {
  tpc_config cfg;
  const tpc_runtime *rt;
  tpc_layout layout;
  char *bufs[TPC_MAX_RANKS];    /* own buffer at [rank], peers' opened handles */
  uint32_t opened_mask;         /* peers whose handle is open */
  tpc_async_error *err_host;    /* host view of the device error record */
  void *err_device;
  int ready;
  int failed;
  size_t all_reduce_packet_max; /* TPC_ALGO_AUTO cutovers */
  size_t all_gather_packet_max;
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
  if (c->device < 0) return fail(NULL, TPC_ERR_INVALID_ARG, "device %d is negative", c->device);
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
  comm->all_reduce_packet_max = config->packet_max_bytes;
  comm->all_gather_packet_max = config->packet_max_bytes;

  int code;
  void *own = NULL, *err_host = NULL, *err_device = NULL;
  if ((code = rt->set_device(config->device)) != 0) {
    r = runtime_fail(NULL, rt, code, "selecting the device");
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
  if ((code = rt->host_alloc_mapped(&err_host, &err_device, sizeof(tpc_async_error))) != 0) {
    r = runtime_fail(NULL, rt, code, "allocating the host-mapped error record");
    goto undo;
  }
  comm->err_host = err_host;
  comm->err_device = err_device;
  memset(comm->err_host, 0, sizeof(tpc_async_error));
  if ((code = rt->device_synchronize()) != 0) {
    r = runtime_fail(NULL, rt, code, "synchronising after set-up");
    goto undo;
  }
  *comm_out = comm;
  return TPC_OK;

undo:
  if (comm->err_host) rt->host_free(comm->err_host);
  if (own) rt->device_free(own);
  free(comm);
  return r;
}

tpc_result tpc_comm_export(tpc_comm *comm, void *handle_out) {
  if (!comm || !handle_out) return fail(comm, TPC_ERR_INVALID_ARG, "NULL argument");
  int code = comm->rt->ipc_export(handle_out, comm->bufs[comm->cfg.rank]);
  return code ? runtime_fail(comm, comm->rt, code, "exporting the IPC handle") : TPC_OK;
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
  void *ptr = NULL;
  int code = comm->rt->ipc_open(&ptr, handle);
  if (code)
    return fail(comm, TPC_ERR_PEER, "opening the IPC handle of peer %d failed: %s", peer,
                comm->rt->error_string(code));
  comm->bufs[peer] = ptr;
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

tpc_result tpc_comm_destroy(tpc_comm *comm) {
  if (!comm) return TPC_OK;
  const tpc_runtime *rt = comm->rt;
  tpc_result r = TPC_OK;
  int code = rt->device_synchronize();
  if (code) r = runtime_fail(comm, rt, code, "synchronising before destroy");
  for (int p = 0; p < comm->cfg.world_size; ++p) {
    if (!(comm->opened_mask & (1u << p))) continue;
    code = rt->ipc_close(comm->bufs[p]);
    if (code && r == TPC_OK) r = runtime_fail(comm, rt, code, "closing a peer handle");
  }
  code = rt->device_free(comm->bufs[comm->cfg.rank]);
  if (code && r == TPC_OK) r = runtime_fail(comm, rt, code, "freeing the registered buffer");
  code = rt->host_free(comm->err_host);
  if (code && r == TPC_OK) r = runtime_fail(comm, rt, code, "freeing the error record");
  if (r != TPC_OK) snprintf(create_error, sizeof create_error, "%s", comm->last_error);
  free(comm);
  return r;
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

tpc_result tpc_comm_set_cutover(tpc_comm *comm, size_t all_reduce_packet_max,
                                size_t all_gather_packet_max) {
  if (!comm) return fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  if (all_reduce_packet_max > comm->cfg.packet_max_bytes ||
      all_gather_packet_max > comm->cfg.packet_max_bytes)
    return fail(comm, TPC_ERR_INVALID_ARG, "cutover above packet_max_bytes (%zu)",
                comm->cfg.packet_max_bytes);
  comm->all_reduce_packet_max = all_reduce_packet_max;
  comm->all_gather_packet_max = all_gather_packet_max;
  return TPC_OK;
}

tpc_result tpc_comm_async_error(tpc_comm *comm, tpc_async_error *out) {
  if (!comm) return fail(comm, TPC_ERR_INVALID_ARG, "NULL communicator");
  /* The device writes the record with a system-scope atomic; a volatile read
   * sees it without synchronising the stream. */
  volatile tpc_async_error *rec = comm->err_host;
  tpc_async_error copy = {rec->code, rec->peer, rec->epoch, rec->detail};
  if (out) *out = copy;
  if (copy.code == TPC_OK) return TPC_OK;
  comm->failed = 1;
  if (copy.code == TPC_ERR_TIMEOUT)
    return fail(comm, TPC_ERR_TIMEOUT,
                "rank %d: peer %d did not arrive within %.3f s (op #%u on this communicator); "
                "the communicator is unusable, create a new one",
                comm->cfg.rank, copy.peer, comm->cfg.timeout_ns / 1e9, copy.epoch);
  if (copy.code == TPC_ERR_MISMATCH)
    return fail(comm, TPC_ERR_MISMATCH,
                "rank %d: peer %d called a different op or size (it sent %u bytes, op #%u); "
                "the communicator is unusable, create a new one",
                comm->cfg.rank, copy.peer, copy.detail, copy.epoch);
  return fail(comm, (tpc_result)copy.code, "rank %d: device error %d from peer %d (op #%u)",
              comm->cfg.rank, copy.code, copy.peer, copy.epoch);
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
  int capturing = 0;
  int code = comm->rt->stream_is_capturing(stream, &capturing);
  if (code) return runtime_fail(comm, comm->rt, code, "querying the stream's capture state");
  if (!capturing) {
    /* One op in flight per communicator: its buffers and epoch are shared, so
     * an op on a new stream must not overlap the previous stream's op. */
    if (comm->have_last_stream && comm->last_stream != stream) {
      code = comm->rt->stream_synchronize(comm->last_stream);
      if (code) return runtime_fail(comm, comm->rt, code, "waiting for the previous stream");
    }
    comm->last_stream = stream;
    comm->have_last_stream = 1;
  }
  return TPC_OK;
}

static void fill_args(const tpc_comm *comm, tpc_kernel_args *a, const void *in, void *out,
                      size_t nbytes, size_t row_bytes, int dtype, int op) {
  memset(a, 0, sizeof *a);
  for (int p = 0; p < comm->cfg.world_size; ++p) a->bufs[p] = comm->bufs[p];
  a->err = (tpc_async_error *)comm->err_device;
  a->in = in;
  a->out = out;
  a->nbytes = nbytes;
  a->row_bytes = row_bytes;
  a->timeout_ns = comm->cfg.timeout_ns;
  a->packet_off = comm->layout.packet_off;
  a->packet_slot_bytes = comm->layout.packet_slot_bytes;
  a->data_off = comm->layout.data_off;
  a->rank = comm->cfg.rank;
  a->world = comm->cfg.world_size;
  a->dtype = dtype;
  a->op = op;
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
  code = op == TPC_OP_ALL_REDUCE ? rt->launch_all_reduce(a, algo, stream)
                                 : rt->launch_all_gather(a, algo, stream);
  if (current != comm->cfg.device) rt->set_device(current);
  return code ? runtime_fail(comm, rt, code, op == TPC_OP_ALL_REDUCE ? "launching all_reduce"
                                                                     : "launching all_gather")
              : TPC_OK;
}

static int misaligned(const void *p, size_t to) { return ((uintptr_t)p % to) != 0; }

tpc_result tpc_all_reduce(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          tpc_dtype dtype, tpc_algo algo, void *stream) {
  tpc_result r = begin_op(comm, in, out, stream);
  if (r != TPC_OK) return r;
  if (dtype != TPC_FLOAT32 && dtype != TPC_FLOAT16 && dtype != TPC_BFLOAT16)
    return fail(comm, TPC_ERR_INVALID_ARG, "dtype %d is not float32, float16 or bfloat16", dtype);
  if (nbytes == 0 || nbytes % 16)
    return fail(comm, TPC_ERR_INVALID_ARG, "all_reduce of %zu bytes: a positive multiple of 16 is needed", nbytes);
  if (misaligned(in, 16) || misaligned(out, 16))
    return fail(comm, TPC_ERR_INVALID_ARG, "all_reduce input and output must be 16-byte aligned");
  if (algo == TPC_ALGO_AUTO)
    algo = nbytes <= comm->all_reduce_packet_max ? TPC_ALGO_PACKET : TPC_ALGO_BULK;
  if (algo == TPC_ALGO_PACKET && nbytes > comm->cfg.packet_max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "all_reduce of %zu bytes is over the packet cap of %zu",
                nbytes, comm->cfg.packet_max_bytes);
  if (algo == TPC_ALGO_BULK && nbytes > comm->cfg.max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "all_reduce of %zu bytes is over the cap of %zu",
                nbytes, comm->cfg.max_bytes);
  if (algo != TPC_ALGO_PACKET && algo != TPC_ALGO_BULK)
    return fail(comm, TPC_ERR_INVALID_ARG, "unknown algorithm %d", algo);
  tpc_kernel_args a;
  fill_args(comm, &a, in, out, nbytes, nbytes, dtype, TPC_OP_ALL_REDUCE);
  return launch_on_device(comm, TPC_OP_ALL_REDUCE, &a, algo, stream);
}

tpc_result tpc_all_gather(tpc_comm *comm, const void *in, void *out, size_t nbytes,
                          size_t row_bytes, tpc_algo algo, void *stream) {
  tpc_result r = begin_op(comm, in, out, stream);
  if (r != TPC_OK) return r;
  if (nbytes == 0 || nbytes % 4)
    return fail(comm, TPC_ERR_INVALID_ARG, "all_gather of %zu bytes: a positive multiple of 4 is needed", nbytes);
  if (row_bytes == 0 || row_bytes % 4 || nbytes % row_bytes)
    return fail(comm, TPC_ERR_INVALID_ARG, "row of %zu bytes must be a positive multiple of 4 dividing %zu",
                row_bytes, nbytes);
  if (misaligned(in, 4) || misaligned(out, 4))
    return fail(comm, TPC_ERR_INVALID_ARG, "all_gather input and output must be 4-byte aligned");
  const size_t out_bytes = nbytes * (size_t)comm->cfg.world_size;
  const int bulk_ok = nbytes % 16 == 0 && row_bytes % 16 == 0 && !misaligned(in, 16) &&
                      !misaligned(out, 16) && out_bytes <= comm->cfg.max_bytes;
  if (algo == TPC_ALGO_AUTO)
    algo = (nbytes <= comm->all_gather_packet_max || !bulk_ok) ? TPC_ALGO_PACKET : TPC_ALGO_BULK;
  if (algo == TPC_ALGO_PACKET && nbytes > comm->cfg.packet_max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "all_gather of %zu bytes per rank is over the packet cap of %zu",
                nbytes, comm->cfg.packet_max_bytes);
  if (algo == TPC_ALGO_BULK && out_bytes > comm->cfg.max_bytes)
    return fail(comm, TPC_ERR_TOO_LARGE, "all_gather output of %zu bytes is over the cap of %zu",
                out_bytes, comm->cfg.max_bytes);
  if (algo == TPC_ALGO_BULK && !bulk_ok)
    return fail(comm, TPC_ERR_INVALID_ARG, "bulk all_gather needs 16-byte sizes, rows and alignment");
  if (algo != TPC_ALGO_PACKET && algo != TPC_ALGO_BULK)
    return fail(comm, TPC_ERR_INVALID_ARG, "unknown algorithm %d", algo);
  tpc_kernel_args a;
  fill_args(comm, &a, in, out, nbytes, row_bytes, 0, TPC_OP_ALL_GATHER);
  return launch_on_device(comm, TPC_OP_ALL_GATHER, &a, algo, stream);
}
