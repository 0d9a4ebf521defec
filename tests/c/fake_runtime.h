/*
 * A fake GPU runtime for testing the C core (csrc/core) on the CPU.
 *
 * "Device" memory is host memory, the IPC handle of an allocation (a buffer
 * or a control chunk; TPC_ALLOC_HANDLE_BYTES, a magic and the pointer)
 * carries its pointer, so several fake ranks in one process can open each
 * other's buffers and control slots and really move bytes between them, and
 * every call is counted. A test can make any entry fail on a chosen call, and
 * reads back what the launch entries were given.
 */
#ifndef TPCOMM_TEST_FAKE_RUNTIME_H
#define TPCOMM_TEST_FAKE_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "runtime.h"

#define FAKE_MULTIPROCESSORS 77 /* what every fake device reports (the packet kernels' block cap) */

typedef enum {
  FK_SET_DEVICE,
  FK_GET_DEVICE,
  FK_DEVICE_MALLOC,
  FK_DEVICE_FREE,
  FK_DEVICE_MEMSET,
  FK_MEMCPY_ANY,
  FK_HOST_ALLOC_MAPPED,
  FK_HOST_FREE,
  FK_IPC_EXPORT,
  FK_IPC_OPEN,
  FK_IPC_CLOSE,
  FK_DEVICE_SYNCHRONIZE,
  FK_STREAM_SYNCHRONIZE,
  FK_STREAM_IS_CAPTURING,
  FK_MULTIPROCESSOR_COUNT,
  FK_ALLOC_CONTROL_CHUNK,
  FK_WRITE_ASYNC,
  FK_LAUNCH_ALL_REDUCE,
  FK_LAUNCH_ALL_GATHER,
  FK_LAUNCH_REDUCE_SCATTER,
  FK_LAUNCH_ALL_REDUCE_NORM,
  FK_COUNT
} fake_entry;

/* Byte the fake fills fresh allocations with, so "was it cleared" is testable. */
#define FAKE_GARBAGE 0xA5

/* One runtime call, in call order (failed calls included): the entry and the
 * pointer it was given (the destination of copies, the block freed, exported
 * or closed, the address an opened handle carries; NULL for entries without
 * one). */
typedef struct {
  fake_entry entry;
  const void *ptr;
  size_t bytes;
  int failed;
} fake_event;
#define FAKE_MAX_EVENTS 1024

/* What one write_async call copied (successful calls only). */
typedef struct {
  void *dst;
  size_t bytes;
  uint32_t value;            /* the first 4 bytes written (0 if fewer) */
  int device;                /* the current device when it was issued */
} fake_write;
#define FAKE_MAX_WRITES 64

typedef struct {
  int calls[FK_COUNT];       /* every call of every entry, failed ones included */
  int fail_at[FK_COUNT];     /* the calls[] value whose call fails; 0: none */
  int fail_code[FK_COUNT];

  /* Life cycle bookkeeping (successful calls only). */
  int device_allocs, device_frees, live_device;
  int host_allocs, host_frees, live_host;
  int ipc_opens, ipc_closes, live_opens;
  /* Calls the real runtime would reject: freeing or closing something that is
   * not live, opening a handle of a buffer that does not exist. */
  int bad_device_frees, bad_host_frees, bad_closes, bad_opens;

  /* host_alloc_mapped fails the way runtime_gpu.c does when
   * cudaHostGetDevicePointer fails: it allocated, freed again, and returns
   * the error with *host still holding the freed pointer. */
  int host_alloc_fails_after_alloc;

  int last_device;           /* set_device's last argument */
  int current_device;        /* what get_device reports; set_device changes it */
  int launch_device;         /* the current device when the last launch ran */
  int synchronized_device;   /* the current device at the last device_synchronize */
  size_t last_malloc_bytes;
  void *last_malloc;         /* device pointer of the last device_malloc */
  void *last_mapped_host;    /* the two views of the last host_alloc_mapped */
  void *last_mapped_device;

  /* alloc_control_chunk: chunks handed out since the last fake_reset (the
   * chunks themselves are never freed and survive fake_reset), and the last
   * one's three views. */
  int control_chunks;
  void *last_control;
  void *last_records;          /* host view of the records */
  void *last_records_device;   /* device view: a separate block, never dereferenced */
  size_t last_chunk_n;

  /* write_async calls (successful ones; calls[FK_WRITE_ASYNC] counts all). */
  int n_writes;
  fake_write writes[FAKE_MAX_WRITES];

  /* Every call in order (up to FAKE_MAX_EVENTS; n_events keeps counting). */
  int n_events;
  fake_event events[FAKE_MAX_EVENTS];

  /* Streams. */
  int capturing;             /* what stream_is_capturing reports */
  void *last_synced_stream;

  /* What the last launch received. */
  int launches;              /* all_reduce + all_gather launches */
  tpc_kernel_args last_args;
  int last_algo;
  int last_op_entry;         /* FK_LAUNCH_ALL_REDUCE, _ALL_GATHER or _REDUCE_SCATTER */
  void *last_stream;
} fake_state;

extern fake_state fake;

/* Forgets all counters, failure plans and open handles. Live allocations are
 * still tracked (tests free what they created before resetting). */
void fake_reset(void);

/* The nth call of `entry` from now on (1 = the next one) returns `code`. */
void fake_fail_nth(fake_entry entry, int nth, int code);

/* The device pointer carried by a handle that ipc_export wrote (one
 * allocation's TPC_ALLOC_HANDLE_BYTES); NULL if the bytes are not a fake
 * handle. */
void *fake_handle_pointer(const void *handle);

/* How many times ptr is open now (ipc_open minus ipc_close; a handle may be
 * open several times at once). */
int fake_open_count(const void *ptr);

const char *fake_entry_name(fake_entry entry);

/* Index in fake.events of the first call of `entry` at or after `from` whose
 * pointer is `ptr`, or -1. */
int fake_event_index(fake_entry entry, const void *ptr, int from);

/* Releases what tpc_comm_abort deliberately leaves behind: frees every live
 * device allocation and forgets every open handle, counted as a successful
 * device_free / ipc_close (no runtime call is counted). Tests call it after
 * an abort, once the other ranks are destroyed, so the "everything released"
 * checks hold again. Returns how many allocations plus handles it released. */
int fake_release_leftovers(void);

/* Every control chunk alloc_control_chunk ever handed out in this process
 * (never freed: the registry keeps its slots forever). */
int fake_control_chunk_total(void);
/* Whether ptr lies inside one of those chunks' control slots. */
int fake_is_control_memory(const void *ptr);
/* Whether ptr is the base of one of those chunks (what ipc_export takes). */
int fake_is_control_chunk(const void *ptr);

/* Index of the first tpc_runtime entry the fake leaves NULL (runtime.h grew
 * and the fake was not updated), or -1. */
int fake_runtime_missing_entry(void);

#endif /* TPCOMM_TEST_FAKE_RUNTIME_H */
