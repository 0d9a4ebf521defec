/*
 * The GPU runtime calls the C core makes, as a table. The real one
 * (runtime_gpu.c) forwards to CUDA or HIP; the C tests link a fake that
 * records what the core asked for, so the life cycle (every handle closed,
 * every buffer freed, peers keyed by rank) is tested without a GPU.
 * Each entry returns 0 on success or the runtime's error code.
 */
#ifndef TPCOMM_RUNTIME_H
#define TPCOMM_RUNTIME_H

#include <stddef.h>

#include "layout.h"

/* Bytes of one allocation's IPC handle (the C API's handle carries two). */
#define TPC_ALLOC_HANDLE_BYTES 64

typedef struct {
  int (*set_device)(int device);
  int (*get_device)(int *device);
  int (*device_malloc)(void **ptr, size_t bytes);
  int (*device_free)(void *ptr);
  int (*device_memset)(void *ptr, int value, size_t bytes);
  int (*memcpy_any)(void *dst, const void *src, size_t bytes); /* unified addressing */
  int (*host_alloc_mapped)(void **host, void **device, size_t bytes);
  int (*host_free)(void *host);
  int (*ipc_export)(void *handle_out, void *ptr);
  int (*ipc_open)(void **ptr, const void *handle);
  int (*ipc_close)(void *ptr);
  int (*device_synchronize)(void);
  int (*stream_synchronize)(void *stream);
  int (*stream_is_capturing)(void *stream, int *capturing);
  const char *(*error_string)(int code);
  /* Streaming multiprocessors (CUDA) or compute units (AMD) of a device. */
  int (*multiprocessor_count)(int device, int *count);
  /* n control slots (device memory, zeroed) and n error records (host-mapped,
   * zeroed, with their device view) that are never freed (registry.c). */
  int (*alloc_control_chunk)(void **control, void **records, void **records_device, size_t n);
  /* Copies bytes host-to-device (or to a peer's mapped memory) on a private
   * stream that waits for nothing: never blocks on the work of other streams.
   * Does not wait for the copy either. */
  int (*write_async)(void *dst, const void *src, size_t bytes);
  int (*launch_all_reduce)(const tpc_kernel_args *args, int algo, void *stream);
  int (*launch_all_gather)(const tpc_kernel_args *args, int algo, void *stream);
  int (*launch_reduce_scatter)(const tpc_kernel_args *args, int algo, void *stream);
  int (*launch_all_reduce_norm)(const tpc_kernel_args *args, void *stream);
} tpc_runtime;

/* Defined by whichever runtime the library is linked with. */
const tpc_runtime *tpc_runtime_get(void);

#endif /* TPCOMM_RUNTIME_H */
