/*
 * The real runtime table: CUDA runtime calls, or their HIP twins on ROCm.
 * Host-side portability lives here and nowhere else in the C core.
 */
#include "runtime.h"

#include <string.h>

#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime_api.h>
typedef hipError_t gpu_error;
typedef hipIpcMemHandle_t gpu_ipc_handle;
typedef hipStream_t gpu_stream;
#define GPU(name) hip##name
/* Signals polled across GPUs must bypass the non-coherent caches on AMD:
 * uncached memory from ROCm 5.5, fine-grained (coherent) memory before. */
#if HIP_VERSION >= 50500000
#define TPC_HIP_SHARED_FLAG hipDeviceMallocUncached
#else
#define TPC_HIP_SHARED_FLAG hipDeviceMallocFinegrained
#endif
static int alloc_shared(void **ptr, size_t bytes) {
  return (int)hipExtMallocWithFlags(ptr, bytes, TPC_HIP_SHARED_FLAG);
}
/* Mapped host memory: hipHostAlloc / hipHostAllocMapped / hipFreeHost from
 * ROCm 6.3 (deprecated before it), hipHostMalloc / hipHostFree earlier. */
#if HIP_VERSION >= 60300000
static hipError_t host_alloc(void **host, size_t bytes) { return hipHostAlloc(host, bytes, hipHostAllocMapped); }
static hipError_t host_release(void *host) { return hipFreeHost(host); }
#else
static hipError_t host_alloc(void **host, size_t bytes) { return hipHostMalloc(host, bytes, hipHostMallocMapped); }
static hipError_t host_release(void *host) { return hipHostFree(host); }
#endif
#else
#include <cuda_runtime_api.h>
typedef cudaError_t gpu_error;
typedef cudaIpcMemHandle_t gpu_ipc_handle;
typedef cudaStream_t gpu_stream;
#define GPU(name) cuda##name
static int alloc_shared(void **ptr, size_t bytes) { return (int)cudaMalloc(ptr, bytes); }
static cudaError_t host_alloc(void **host, size_t bytes) { return cudaHostAlloc(host, bytes, cudaHostAllocMapped); }
static cudaError_t host_release(void *host) { return cudaFreeHost(host); }
#endif

_Static_assert(sizeof(gpu_ipc_handle) <= TPC_ALLOC_HANDLE_BYTES, "IPC handle larger than the API's");

int tpc_launch_all_reduce(const tpc_kernel_args *args, int algo, void *stream);
int tpc_launch_all_gather(const tpc_kernel_args *args, int algo, void *stream);
int tpc_launch_reduce_scatter(const tpc_kernel_args *args, int algo, void *stream);
int tpc_launch_all_reduce_norm(const tpc_kernel_args *args, void *stream);

static int set_device(int device) { return (int)GPU(SetDevice)(device); }
static int get_device(int *device) { return (int)GPU(GetDevice)(device); }
static int device_free(void *ptr) { return (int)GPU(Free)(ptr); }
static int device_memset(void *ptr, int value, size_t bytes) {
  return (int)GPU(Memset)(ptr, value, bytes);
}
static int memcpy_any(void *dst, const void *src, size_t bytes) {
  return (int)GPU(Memcpy)(dst, src, bytes, GPU(MemcpyDefault));
}
static int host_alloc_mapped(void **host, void **device, size_t bytes) {
  int code = (int)host_alloc(host, bytes);
  if (code) return code;
  code = (int)GPU(HostGetDevicePointer)(device, *host, 0);
  if (code) {
    host_release(*host);
    *host = NULL;
  }
  return code;
}
static int host_free(void *host) { return (int)host_release(host); }
static int alloc_control_chunk(void **control, void **records, void **records_device, size_t n) {
  int code = alloc_shared(control, n * sizeof(tpc_control));
  if (code) return code;
  if ((code = (int)GPU(Memset)(*control, 0, n * sizeof(tpc_control))) != 0 ||
      (code = host_alloc_mapped(records, records_device, n * sizeof(tpc_async_error))) != 0) {
    GPU(Free)(*control);
    *control = NULL;
    return code;
  }
  memset(*records, 0, n * sizeof(tpc_async_error));
  return 0;
}
/* One stream per device for tpc_comm_abort's writes: non-blocking, so it
 * waits neither for the legacy default stream nor for any other. Created on
 * first use and kept (abort must not wait for a destroy to synchronise). */
#define TPC_STREAM_DEVICES 64
static int write_async(void *dst, const void *src, size_t bytes) {
  static gpu_stream streams[TPC_STREAM_DEVICES];
  int device = 0;
  int code = (int)GPU(GetDevice)(&device);
  if (code) return code;
  if (device < 0 || device >= TPC_STREAM_DEVICES) return (int)GPU(ErrorInvalidDevice);
  if (!streams[device]) {
    code = (int)GPU(StreamCreateWithFlags)(&streams[device], GPU(StreamNonBlocking));
    if (code) return code;
  }
  return (int)GPU(MemcpyAsync)(dst, src, bytes, GPU(MemcpyDefault), streams[device]);
}
static int ipc_export(void *handle_out, void *ptr) {
  gpu_ipc_handle h;
  int code = (int)GPU(IpcGetMemHandle)(&h, ptr);
  if (code) return code;
  unsigned char *dst = handle_out;
  const unsigned char *src = (const unsigned char *)&h;
  for (size_t i = 0; i < TPC_ALLOC_HANDLE_BYTES; ++i) dst[i] = i < sizeof h ? src[i] : 0;
  return 0;
}
static int ipc_open(void **ptr, const void *handle) {
  gpu_ipc_handle h;
  const unsigned char *src = handle;
  unsigned char *dst = (unsigned char *)&h;
  for (size_t i = 0; i < sizeof h; ++i) dst[i] = src[i];
  return (int)GPU(IpcOpenMemHandle)(ptr, h, GPU(IpcMemLazyEnablePeerAccess));
}
static int ipc_close(void *ptr) { return (int)GPU(IpcCloseMemHandle)(ptr); }
static int device_synchronize(void) { return (int)GPU(DeviceSynchronize)(); }
static int stream_synchronize(void *stream) { return (int)GPU(StreamSynchronize)((gpu_stream)stream); }
static int stream_is_capturing(void *stream, int *capturing) {
  enum GPU(StreamCaptureStatus) status = GPU(StreamCaptureStatusNone);
  int code = (int)GPU(StreamIsCapturing)((gpu_stream)stream, &status);
  *capturing = status != GPU(StreamCaptureStatusNone);
  return code;
}
static const char *error_string(int code) { return GPU(GetErrorString)((gpu_error)code); }
static int multiprocessor_count(int device, int *count) {
#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
  return (int)hipDeviceGetAttribute(count, hipDeviceAttributeMultiprocessorCount, device);
#else
  return (int)cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
#endif
}

static const tpc_runtime gpu_runtime = {
    set_device,         get_device,         alloc_shared,       device_free,           device_memset,
    memcpy_any,         host_alloc_mapped,  host_free,             ipc_export,
    ipc_open,           ipc_close,          device_synchronize,    stream_synchronize,
    stream_is_capturing, error_string,      multiprocessor_count,  alloc_control_chunk,   write_async,
    tpc_launch_all_reduce, tpc_launch_all_gather, tpc_launch_reduce_scatter, tpc_launch_all_reduce_norm,
};

const tpc_runtime *tpc_runtime_get(void) { return &gpu_runtime; }
