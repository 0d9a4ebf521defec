/*
 * What the C core's files share (not part of the public API): the
 * communicator's host state and the error slots every function reports into.
 *
 *   lifecycle.c  create, export, open_peer, ready, destroy, abort, ids, probe
 *   errors.c     result strings, last-error slots, the device error record
 *   ops.c        each collective: its checks, its arguments, its launch
 */
#ifndef TPCOMM_COMM_INTERNAL_H
#define TPCOMM_COMM_INTERNAL_H

#include <stdint.h>

#include "../tpcomm.h"
#include "layout.h"
#include "registry.h"
#include "runtime.h"

#define TPC_ERROR_BYTES 512 /* longest message kept, with its terminator */

struct tpc_comm {
  tpc_config cfg;
  const tpc_runtime *rt;
  tpc_layout layout;
  char *bufs[TPC_MAX_RANKS];    /* own buffer at [rank], peers' opened handles */
  uint32_t opened_mask;         /* peers whose handles are open (buffer and control chunk) */
  char *peer_chunks[TPC_MAX_RANKS];        /* peers' control pool chunks, as opened */
  tpc_control *peer_control[TPC_MAX_RANKS]; /* peers' control slots inside them */
  tpc_entry *entry;             /* comm_id, control slot, error record (registry.c) */
  int ready;
  int failed;
  int multiprocessors;          /* of the device: the packet kernels' block cap */
  void *last_stream;            /* where the previous eager op was enqueued */
  int have_last_stream;         /* the default stream is NULL: can't be the marker */
  char last_error[TPC_ERROR_BYTES];
};

/* Formats the message into comm's slot (NULL: this thread's slot, what
 * tpc_comm_last_error(NULL) reads) and returns `code`. */
tpc_result tpc_fail(tpc_comm *comm, tpc_result code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A runtime call that failed: TPC_ERR_RUNTIME naming `what` and the runtime's reason. */
tpc_result tpc_runtime_fail(tpc_comm *comm, const tpc_runtime *rt, int code, const char *what);
/* Copies comm's message of a failure to this thread's slot, for a caller
 * that will not hold comm to read it; returns r. */
tpc_result tpc_to_thread_slot(const tpc_comm *comm, tpc_result r);

/* The device error record as the device left it (no synchronisation). */
tpc_async_error tpc_read_record(const tpc_async_error *record);

#endif /* TPCOMM_COMM_INTERNAL_H */
