/*
 * The fake runtime table the C tests link instead of csrc/core/runtime_gpu.c.
 * See fake_runtime.h.
 */
#include "fake_runtime.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

fake_state fake;

/* Live allocations and open handles, so bad frees and closes are noticed
 * instead of crashing (a pointer the fake does not know is never freed). */
#define FAKE_MAX_LIVE 256
static void *live_device[FAKE_MAX_LIVE];
static void *live_host[FAKE_MAX_LIVE];
static void *live_host_device_view[FAKE_MAX_LIVE];
static void *live_opens[FAKE_MAX_LIVE];
static void *zombie; /* a block the fake pretends to have freed */

/* Control chunks: never freed (like the real pool), kept reachable here so
 * LeakSanitizer does not report them, and kept apart from the per-communicator
 * allocations above so "everything freed after destroy" still holds. */
#define FAKE_MAX_CHUNKS 64
static struct {
  tpc_control *control;
  tpc_async_error *records;
  tpc_async_error *records_device;
  size_t n;
} chunks[FAKE_MAX_CHUNKS];
static int n_chunks;

static const char handle_magic[8] = {'t', 'p', 'c', 'f', 'a', 'k', 'e', 0};

static int track_add(void **table, void *ptr) {
  for (int i = 0; i < FAKE_MAX_LIVE; ++i)
    if (!table[i]) {
      table[i] = ptr;
      return i;
    }
  fprintf(stderr, "fake runtime: more than %d live objects\n", FAKE_MAX_LIVE);
  abort();
}

static int track_find(void *const *table, const void *ptr) {
  if (!ptr) return -1;
  for (int i = 0; i < FAKE_MAX_LIVE; ++i)
    if (table[i] == ptr) return i;
  return -1;
}

void fake_reset(void) {
  memset(&fake, 0, sizeof fake);
  fake.last_device = -1;
  fake.launch_device = -1;
  fake.synchronized_device = -1;
  /* Opens own no memory: a handle left open by a test that made ipc_close
   * fail is forgotten here, so it cannot match a later buffer's address. */
  memset(live_opens, 0, sizeof live_opens);
  free(zombie);
  zombie = NULL;
}

void fake_fail_nth(fake_entry entry, int nth, int code) {
  fake.fail_at[entry] = fake.calls[entry] + nth;
  fake.fail_code[entry] = code;
}

/* Counts and logs the call; returns the planned error code for it, or 0. */
static int enter_ptr(fake_entry entry, const void *ptr, size_t bytes) {
  fake.calls[entry]++;
  const int code =
      (fake.fail_at[entry] && fake.calls[entry] == fake.fail_at[entry]) ? fake.fail_code[entry] : 0;
  if (fake.n_events < FAKE_MAX_EVENTS) {
    fake_event *ev = &fake.events[fake.n_events];
    ev->entry = entry;
    ev->ptr = ptr;
    ev->bytes = bytes;
    ev->failed = code != 0;
  }
  fake.n_events++;
  return code;
}

static int enter(fake_entry entry) { return enter_ptr(entry, NULL, 0); }

int fake_event_index(fake_entry entry, const void *ptr, int from) {
  const int n = fake.n_events < FAKE_MAX_EVENTS ? fake.n_events : FAKE_MAX_EVENTS;
  for (int i = from < 0 ? 0 : from; i < n; ++i)
    if (fake.events[i].entry == entry && fake.events[i].ptr == ptr) return i;
  return -1;
}

int fake_release_leftovers(void) {
  int released = 0;
  for (int i = 0; i < FAKE_MAX_LIVE; ++i) {
    if (live_device[i]) {
      free(live_device[i]);
      live_device[i] = NULL;
      fake.device_frees++;
      fake.live_device--;
      released++;
    }
    if (live_opens[i]) {
      live_opens[i] = NULL;
      fake.ipc_closes++;
      fake.live_opens--;
      released++;
    }
  }
  return released;
}

int fake_control_chunk_total(void) { return n_chunks; }

int fake_is_control_memory(const void *ptr) {
  const char *p = ptr;
  for (int i = 0; i < n_chunks; ++i) {
    const char *lo = (const char *)chunks[i].control;
    if (p >= lo && p < lo + chunks[i].n * sizeof(tpc_control)) return 1;
  }
  return 0;
}

const char *fake_entry_name(fake_entry entry) {
  static const char *const names[FK_COUNT] = {
      "set_device",         "get_device",         "device_malloc",      "device_free",     "device_memset",
      "memcpy_any",         "host_alloc_mapped",  "host_free",       "ipc_export",
      "ipc_open",           "ipc_close",          "device_synchronize", "stream_synchronize",
      "stream_is_capturing", "multiprocessor_count", "alloc_control_chunk", "write_async", "launch_all_reduce",
      "launch_all_gather",  "launch_reduce_scatter", "launch_all_reduce_norm",
  };
  return (unsigned)entry < FK_COUNT ? names[entry] : "?";
}

void *fake_handle_pointer(const void *handle) {
  const unsigned char *h = handle;
  if (memcmp(h, handle_magic, sizeof handle_magic) != 0) return NULL;
  void *ptr;
  memcpy(&ptr, h + sizeof handle_magic, sizeof ptr);
  return ptr;
}

/* ------------------------------------------------------------- entries */

static int f_set_device(int device) {
  int code = enter(FK_SET_DEVICE);
  if (code) return code;
  fake.last_device = device;
  fake.current_device = device;
  return 0;
}

static int f_get_device(int *device) {
  int code = enter(FK_GET_DEVICE);
  if (code) return code;
  *device = fake.current_device;
  return 0;
}

static int f_device_malloc(void **ptr, size_t bytes) {
  int code = enter(FK_DEVICE_MALLOC);
  if (code) return code;
  /* 16-byte aligned like cudaMalloc (which gives 256). */
  void *p = aligned_alloc(256, tpc_round_up(bytes ? bytes : 1, 256));
  if (!p) return 2;
  memset(p, FAKE_GARBAGE, bytes);
  track_add(live_device, p);
  fake.device_allocs++;
  fake.live_device++;
  fake.last_malloc = p;
  fake.last_malloc_bytes = bytes;
  *ptr = p;
  return 0;
}

static int f_device_free(void *ptr) {
  int code = enter_ptr(FK_DEVICE_FREE, ptr, 0);
  if (code) return code;
  int i = track_find(live_device, ptr);
  if (i < 0) {
    fake.bad_device_frees++;
    return 1;
  }
  live_device[i] = NULL;
  free(ptr);
  fake.device_frees++;
  fake.live_device--;
  return 0;
}

static int f_device_memset(void *ptr, int value, size_t bytes) {
  int code = enter_ptr(FK_DEVICE_MEMSET, ptr, bytes);
  if (code) return code;
  memset(ptr, value, bytes);
  return 0;
}

static int f_memcpy_any(void *dst, const void *src, size_t bytes) {
  int code = enter_ptr(FK_MEMCPY_ANY, dst, bytes);
  if (code) return code;
  memcpy(dst, src, bytes);
  return 0;
}

/* The device view is a different address from the host view (as it can be on
 * a real system), so passing the host pointer to a kernel is noticed. It
 * points just past the host block and must never be dereferenced. */
static int f_host_alloc_mapped(void **host, void **device, size_t bytes) {
  int code = enter(FK_HOST_ALLOC_MAPPED);
  if (code && !fake.host_alloc_fails_after_alloc) return code;
  char *p = malloc(bytes);
  if (!p) return 2;
  if (code) {
    /* runtime_gpu.c: cudaHostAlloc succeeded, cudaHostGetDevicePointer
     * failed, cudaFreeHost(*host), return the error with *host set. The
     * block counts as freed (host_free of it is a bad free); the fake keeps
     * the memory until the next fake_reset so nothing really dangles. */
    free(zombie);
    zombie = p;
    *host = p;
    return code;
  }
  memset(p, FAKE_GARBAGE, bytes);
  int i = track_add(live_host, p);
  live_host_device_view[i] = p + bytes + 4096;
  fake.host_allocs++;
  fake.live_host++;
  *host = p;
  *device = live_host_device_view[i];
  fake.last_mapped_host = p;
  fake.last_mapped_device = *device;
  return 0;
}

static int f_host_free(void *host) {
  int code = enter(FK_HOST_FREE);
  if (code) return code;
  int i = track_find(live_host, host);
  if (i < 0) {
    fake.bad_host_frees++;
    return 1;
  }
  live_host[i] = NULL;
  live_host_device_view[i] = NULL;
  free(host);
  fake.host_frees++;
  fake.live_host--;
  return 0;
}

/* Whether ptr is the base of a control chunk: the only part of one that can
 * be exported (cudaIpcGetMemHandle takes an allocation's base). */
static int chunk_index(const void *ptr) {
  if (!ptr) return -1;
  for (int i = 0; i < n_chunks; ++i)
    if ((const void *)chunks[i].control == ptr) return i;
  return -1;
}

int fake_is_control_chunk(const void *ptr) { return chunk_index(ptr) >= 0; }

/* Exportable: a live device allocation, or a control chunk (device memory
 * too, never freed), by its base address. Writes TPC_ALLOC_HANDLE_BYTES,
 * like runtime_gpu.c: the core places two of them in its own blob. */
static int f_ipc_export(void *handle_out, void *ptr) {
  int code = enter_ptr(FK_IPC_EXPORT, ptr, 0);
  if (code) return code;
  if (track_find(live_device, ptr) < 0 && chunk_index(ptr) < 0) return 400; /* not an allocation */
  unsigned char *h = handle_out;
  memset(h, 0, TPC_ALLOC_HANDLE_BYTES);
  memcpy(h, handle_magic, sizeof handle_magic);
  memcpy(h + sizeof handle_magic, &ptr, sizeof ptr);
  return 0;
}

/* Reads TPC_ALLOC_HANDLE_BYTES. Like the CUDA runtime, a handle may be opened
 * again while it is open: every open returns the same address and counts,
 * and each needs its own close (control chunks are opened by every
 * communicator of a peer whose slot lies in them). The event logs the
 * address the handle carries (NULL if it is not a fake handle). */
static int f_ipc_open(void **ptr, const void *handle) {
  void *p = fake_handle_pointer(handle);
  int code = enter_ptr(FK_IPC_OPEN, p, 0);
  if (code) return code;
  if (!p || (track_find(live_device, p) < 0 && chunk_index(p) < 0)) {
    fake.bad_opens++;
    return 400;
  }
  track_add(live_opens, p);
  fake.ipc_opens++;
  fake.live_opens++;
  *ptr = p;
  return 0;
}

int fake_open_count(const void *ptr) {
  int n = 0;
  for (int i = 0; ptr && i < FAKE_MAX_LIVE; ++i) n += live_opens[i] == ptr;
  return n;
}

static int f_ipc_close(void *ptr) {
  int code = enter_ptr(FK_IPC_CLOSE, ptr, 0);
  if (code) return code;
  int i = track_find(live_opens, ptr);
  if (i < 0) {
    fake.bad_closes++;
    return 400;
  }
  live_opens[i] = NULL;
  fake.ipc_closes++;
  fake.live_opens--;
  return 0;
}

static int f_device_synchronize(void) {
  int code = enter(FK_DEVICE_SYNCHRONIZE);
  if (code) return code;
  fake.synchronized_device = fake.current_device;
  return 0;
}

static int f_stream_synchronize(void *stream) {
  int code = enter(FK_STREAM_SYNCHRONIZE);
  if (code) return code;
  fake.last_synced_stream = stream;
  return 0;
}

static int f_stream_is_capturing(void *stream, int *capturing) {
  (void)stream;
  int code = enter(FK_STREAM_IS_CAPTURING);
  if (code) return code;
  *capturing = fake.capturing;
  return 0;
}

/* Every fake device has FAKE_MULTIPROCESSORS. */
static int f_multiprocessor_count(int device, int *count) {
  (void)device;
  int code = enter(FK_MULTIPROCESSOR_COUNT);
  if (code) return code;
  *count = FAKE_MULTIPROCESSORS;
  return 0;
}

/* Like runtime_gpu.c: n zeroed control slots and n zeroed records, with a
 * device view of the records at another address (a separate block filled
 * with garbage, never read by the core: passing it where the host view
 * belongs is noticed). Never freed. */
static int f_alloc_control_chunk(void **control, void **records, void **records_device, size_t n) {
  int code = enter(FK_ALLOC_CONTROL_CHUNK);
  if (code) return code;
  if (n_chunks == FAKE_MAX_CHUNKS) {
    fprintf(stderr, "fake runtime: more than %d control chunks\n", FAKE_MAX_CHUNKS);
    abort();
  }
  tpc_control *ctl = aligned_alloc(256, tpc_round_up(n * sizeof(tpc_control), 256));
  tpc_async_error *rec = malloc(n * sizeof(tpc_async_error));
  tpc_async_error *rec_dev = malloc(n * sizeof(tpc_async_error));
  if (!ctl || !rec || !rec_dev) {
    free(ctl);
    free(rec);
    free(rec_dev);
    return 2;
  }
  memset(ctl, 0, n * sizeof(tpc_control));
  memset(rec, 0, n * sizeof(tpc_async_error));
  memset(rec_dev, FAKE_GARBAGE, n * sizeof(tpc_async_error));
  chunks[n_chunks].control = ctl;
  chunks[n_chunks].records = rec;
  chunks[n_chunks].records_device = rec_dev;
  chunks[n_chunks].n = n;
  n_chunks++;
  fake.control_chunks++;
  fake.last_control = ctl;
  fake.last_records = rec;
  fake.last_records_device = rec_dev;
  fake.last_chunk_n = n;
  *control = ctl;
  *records = rec;
  *records_device = rec_dev;
  return 0;
}

/* Performs the copy at once (the test reads the result) and logs it. */
static int f_write_async(void *dst, const void *src, size_t bytes) {
  int code = enter_ptr(FK_WRITE_ASYNC, dst, bytes);
  if (code) return code;
  memcpy(dst, src, bytes);
  if (fake.n_writes < FAKE_MAX_WRITES) {
    fake_write *w = &fake.writes[fake.n_writes];
    w->dst = dst;
    w->bytes = bytes;
    w->value = 0;
    if (bytes >= sizeof w->value) memcpy(&w->value, src, sizeof w->value);
    w->device = fake.current_device;
  }
  fake.n_writes++;
  return 0;
}

static const char *f_error_string(int code) {
  static _Thread_local char buf[64];
  snprintf(buf, sizeof buf, "fake error %d", code);
  return buf;
}

static int record_launch(fake_entry entry, const tpc_kernel_args *args, int algo, void *stream) {
  int code = enter(entry);
  if (code) return code;
  fake.launches++;
  fake.last_args = *args;
  fake.last_algo = algo;
  fake.last_op_entry = entry;
  fake.last_stream = stream;
  fake.launch_device = fake.current_device;
  return 0;
}

static int f_launch_all_reduce(const tpc_kernel_args *args, int algo, void *stream) {
  return record_launch(FK_LAUNCH_ALL_REDUCE, args, algo, stream);
}

static int f_launch_all_gather(const tpc_kernel_args *args, int algo, void *stream) {
  return record_launch(FK_LAUNCH_ALL_GATHER, args, algo, stream);
}

static int f_launch_reduce_scatter(const tpc_kernel_args *args, int algo, void *stream) {
  return record_launch(FK_LAUNCH_REDUCE_SCATTER, args, algo, stream);
}

static int f_launch_all_reduce_norm(const tpc_kernel_args *args, void *stream) {
  return record_launch(FK_LAUNCH_ALL_REDUCE_NORM, args, TPC_ALGO_PACKET, stream);
}

static const tpc_runtime fake_runtime = {
    .set_device = f_set_device,
    .get_device = f_get_device,
    .device_malloc = f_device_malloc,
    .device_free = f_device_free,
    .device_memset = f_device_memset,
    .memcpy_any = f_memcpy_any,
    .host_alloc_mapped = f_host_alloc_mapped,
    .host_free = f_host_free,
    .ipc_export = f_ipc_export,
    .ipc_open = f_ipc_open,
    .ipc_close = f_ipc_close,
    .device_synchronize = f_device_synchronize,
    .stream_synchronize = f_stream_synchronize,
    .stream_is_capturing = f_stream_is_capturing,
    .error_string = f_error_string,
    .multiprocessor_count = f_multiprocessor_count,
    .alloc_control_chunk = f_alloc_control_chunk,
    .write_async = f_write_async,
    .launch_all_reduce = f_launch_all_reduce,
    .launch_all_gather = f_launch_all_gather,
    .launch_reduce_scatter = f_launch_reduce_scatter,
    .launch_all_reduce_norm = f_launch_all_reduce_norm,
};

const tpc_runtime *tpc_runtime_get(void) { return &fake_runtime; }

int fake_runtime_missing_entry(void) {
  typedef void (*any_fn)(void);
  const size_t n = sizeof fake_runtime / sizeof(any_fn);
  for (size_t i = 0; i < n; ++i) {
    any_fn fn;
    memcpy(&fn, (const char *)&fake_runtime + i * sizeof fn, sizeof fn);
    if (!fn) return (int)i;
  }
  return -1;
}
