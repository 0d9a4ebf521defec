// What the binding's translation units share: failing with a message, the
// held communicator of a comm_id, and the checks and copies that turn tensors
// into what the C API takes (csrc/binding/ops.cpp says what the binding checks).
#ifndef TPCOMM_BINDING_COMMON_H
#define TPCOMM_BINDING_COMMON_H

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <vector>
#include "../tpcomm.h"

namespace {


using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// Errors leave as std::runtime_error (RuntimeError in Python) with a message
// built by snprintf, not by the torch check macro: its iostream formatting
// crashes inside this library when built with g++ 13
// (std::ostream::_M_insert<long>).
[[noreturn]] inline void fail(const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  throw std::runtime_error(msg);
}

// Errors carry their tpc_result at the end ("[tpc_result 5]"), so the Python
// layer raises the matching tpcomm exception class.
inline void check(tpc_comm *comm, tpc_result r) {
  if (r != TPC_OK)
    fail("tpcomm: %s: %s [tpc_result %d]", tpc_result_string(r), tpc_comm_last_error(comm), static_cast<int>(r));
}

// Holds the communicator of a comm_id for one op (tpc_comm_acquire): a closed or
// unknown comm_id (0 and negative ones included) raises naming it, and the
// communicator cannot be destroyed by another thread while the op runs.
class Held {
 public:
  explicit Held(int64_t comm_id) { check(nullptr, tpc_comm_acquire(static_cast<uint64_t>(comm_id), &comm_)); }
  ~Held() { tpc_comm_release(comm_); }
  Held(const Held &) = delete;
  Held &operator=(const Held &) = delete;
  tpc_comm *get() const { return comm_; }

 private:
  tpc_comm *comm_ = nullptr;
};

inline void check_tensor(tpc_comm *comm, const Tensor &t, const char *what) {
  if (!t.is_cuda()) fail("tpcomm: %s must be a CUDA tensor", what);
  if (t.get_device_index() != tpc_comm_device(comm))
    fail("tpcomm: %s is on cuda:%d but the communicator is on cuda:%d", what,
         static_cast<int>(t.get_device_index()), tpc_comm_device(comm));
}

void *current_stream(int32_t device) {
  void *stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return stream;
}

// The tpc_dtype of a tensor; which of them an op takes is the C core's check.
inline tpc_dtype reduce_dtype(const Tensor &t, const char *op) {
  switch (t.scalar_type()) {
    case ScalarType::Float: return TPC_FLOAT32;
    case ScalarType::Half: return TPC_FLOAT16;
    case ScalarType::BFloat16: return TPC_BFLOAT16;
    default: break;
  }
  fail("tpcomm: %s takes float32, float16 or bfloat16 tensors", op);
}

// 8 bytes of the dtype's NaN, which a failed op writes over its output; 0 for
// dtypes without one (their output is left as is).
inline uint64_t nan_pattern(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
    case ScalarType::ComplexFloat: return 0x7fc000007fc00000ull;
    case ScalarType::Double:
    case ScalarType::ComplexDouble: return 0x7ff8000000000000ull;
    case ScalarType::Half:
    case ScalarType::ComplexHalf: return 0x7e007e007e007e00ull;
    case ScalarType::BFloat16: return 0x7fc07fc07fc07fc0ull;
    case ScalarType::Float8_e4m3fn:
    case ScalarType::Float8_e5m2: return TPC_E4M3_NAN_BYTES;  // 0x7f is e5m2's NaN too
    case ScalarType::Float8_e4m3fnuz:
    case ScalarType::Float8_e5m2fnuz: return 0x8080808080808080ull;
    default: return 0;
  }
}

// The kernels move 16-byte words. A view at an odd offset is copied to an
// aligned tensor here, on whichever rank holds it, so the route (and the
// header every rank sends) never depends on a pointer.
inline bool aligned16(const Tensor &t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }
inline Tensor aligned_input(const Tensor &t) { return aligned16(t) ? t : torch::stable::clone(t); }

// The op's int as the C API's tpc_algo. Whether it names a kernel is the C
// core's check; a value beyond int would be truncated into one that might,
// so it is refused here.
inline tpc_algo to_algo(int64_t algo) {
  if (algo < INT32_MIN || algo > INT32_MAX)
    fail("tpcomm: unknown algorithm %lld [tpc_result %d]", static_cast<long long>(algo),
         static_cast<int>(TPC_ERR_INVALID_ARG));
  return static_cast<tpc_algo>(algo);
}

// The eager path allocates its outputs through the shim's empty_strided, one
// dispatcher call (new_empty goes through two: new_empty, then empty), and a
// contiguous input is not "made contiguous": the stable empty_like and
// contiguous look their aten op up by name in the boxed dispatcher on every
// call, a host cost the eager path does not need to pay.
inline std::vector<int64_t> sizes_of(const Tensor &t) {
  std::vector<int64_t> sizes(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) sizes[d] = t.size(d);
  return sizes;
}
// A contiguous tensor of `sizes` with like's device and dtype, or float32.
inline Tensor new_output(const Tensor &like, const std::vector<int64_t> &sizes, bool float32 = false) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= sizes[d] > 1 ? sizes[d] : 1;  // torch's contiguous strides treat size 0 as 1
  }
  int32_t dtype = 0, device_type = 0;
  if (float32) dtype = aoti_torch_dtype_float32();
  else TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dtype));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  AtenTensorHandle handle = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                                                  dtype, device_type, like.get_device_index(), &handle));
  return Tensor(handle);
}
inline Tensor contiguous_input(const Tensor &t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

// Each tensor of all[0 .. n) that is given (nullptr: absent) on the
// communicator's device, contiguous and of the input's dtype.
inline void check_like_input(tpc_comm *comm, const char *op, const Tensor &input, const Tensor *const *all,
                      const char *const *names, int n) {
  for (int i = 0; i < n; ++i) {
    if (!all[i]) continue;
    check_tensor(comm, *all[i], names[i]);
    if (!all[i]->is_contiguous()) fail("tpcomm: %s: %s must be contiguous", op, names[i]);
    if (all[i]->scalar_type() != input.scalar_type())
      fail("tpcomm: %s: %s has another dtype than the input", op, names[i]);
  }
}

// Refuses a tensor that is not on a CUDA device with tpcomm's own message
// (the dispatcher's own would list every backend it has no kernel for).
[[noreturn]] inline void needs_cuda(const char *op, const Tensor &t) {
  const char *where = t.is_cpu() ? "cpu" : "non-CUDA";
  fail("tpcomm: _tpcomm::%s needs CUDA tensors, got a %s tensor", op, where);
}

}  // namespace

#endif  // TPCOMM_BINDING_COMMON_H
