// The internal torch ops (_tpcomm::*), registered through torch's stable ABI
// (STABLE_TORCH_LIBRARY and the aoti_torch_* C shim), so one build loads in
// later torch versions. This file only turns tensors into what the C API
// takes (pointers, byte sizes, a tpc_dtype, 16-byte aligned copies of
// misaligned views) and results into exceptions: it checks only what that
// translation needs (device, contiguity, matching sizes); what the kernel
// needs is checked by the C core, once.
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
[[noreturn]] void fail(const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  throw std::runtime_error(msg);
}

// Errors carry their tpc_result at the end ("[tpc_result 5]"), so the Python
// layer raises the matching tpcomm exception class.
void check(tpc_comm *comm, tpc_result r) {
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

void check_tensor(tpc_comm *comm, const Tensor &t, const char *what) {
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
tpc_dtype reduce_dtype(const Tensor &t, const char *op) {
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
uint64_t nan_pattern(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
    case ScalarType::ComplexFloat: return 0x7fc000007fc00000ull;
    case ScalarType::Double:
    case ScalarType::ComplexDouble: return 0x7ff8000000000000ull;
    case ScalarType::Half:
    case ScalarType::ComplexHalf: return 0x7e007e007e007e00ull;
    case ScalarType::BFloat16: return 0x7fc07fc07fc07fc0ull;
    case ScalarType::Float8_e4m3fn:
    case ScalarType::Float8_e5m2: return 0x7f7f7f7f7f7f7f7full;
    case ScalarType::Float8_e4m3fnuz:
    case ScalarType::Float8_e5m2fnuz: return 0x8080808080808080ull;
    default: return 0;
  }
}

// The kernels move 16-byte words. A view at an odd offset is copied to an
// aligned tensor here, on whichever rank holds it, so the route (and the
// header every rank sends) never depends on a pointer.
bool aligned16(const Tensor &t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }
Tensor aligned_input(const Tensor &t) { return aligned16(t) ? t : torch::stable::clone(t); }

// The op's int as the C API's tpc_algo. Whether it names a kernel is the C
// core's check; a value beyond int would be truncated into one that might,
// so it is refused here.
tpc_algo to_algo(int64_t algo) {
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
std::vector<int64_t> sizes_of(const Tensor &t) {
  std::vector<int64_t> sizes(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) sizes[d] = t.size(d);
  return sizes;
}
// A contiguous tensor of `sizes` with like's device and dtype, or float32.
Tensor new_output(const Tensor &like, const std::vector<int64_t> &sizes, bool float32 = false) {
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
Tensor contiguous_input(const Tensor &t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

void all_reduce_into(const Tensor &input, Tensor out, int64_t comm_id, int64_t algo) {
  Held held(comm_id);
  tpc_comm *comm = held.get();
  check_tensor(comm, input, "input");
  check_tensor(comm, out, "out");
  if (!input.is_contiguous() || !out.is_contiguous()) fail("tpcomm: all_reduce needs contiguous tensors");
  if (input.scalar_type() != out.scalar_type() || input.numel() != out.numel())
    fail("tpcomm: all_reduce output must match the input's dtype and size");
  const tpc_dtype dtype = reduce_dtype(input, "all_reduce");
  const size_t nbytes = static_cast<size_t>(input.numel()) * input.element_size();
  const Tensor in = aligned_input(input);
  Tensor dst = aligned16(out) ? out : new_output(out, sizes_of(out));
  check(comm, tpc_all_reduce(comm, in.const_data_ptr(), dst.mutable_data_ptr(), nbytes, dtype,
                             to_algo(algo), current_stream(input.get_device_index())));
  if (!aligned16(out)) torch::stable::copy_(out, dst);
}

Tensor all_reduce(Tensor input, int64_t comm_id, int64_t algo) {
  Tensor out = new_output(input, sizes_of(input));
  all_reduce_into(input, out, comm_id, algo);
  return out;
}

void all_reduce_out(Tensor input, Tensor out, int64_t comm_id, int64_t algo) {
  all_reduce_into(input, out, comm_id, algo);
}

// Each tensor of all[0 .. n) that is given (nullptr: absent) on the
// communicator's device, contiguous and of the input's dtype.
void check_like_input(tpc_comm *comm, const char *op, const Tensor &input, const Tensor *const *all,
                      const char *const *names, int n) {
  for (int i = 0; i < n; ++i) {
    if (!all[i]) continue;
    check_tensor(comm, *all[i], names[i]);
    if (!all[i]->is_contiguous()) fail("tpcomm: %s: %s must be contiguous", op, names[i]);
    if (all[i]->scalar_type() != input.scalar_type())
      fail("tpcomm: %s: %s has another dtype than the input", op, names[i]);
  }
}

// The norm of a fused call (tpc_norm_spec): its vectors (weight, bias,
// next_weight, next_bias; each absent or one row of the input's dtype, copied
// where misaligned and held here) and scalars. Which vectors a pattern takes,
// and every scalar's range, are the C core's rules (tpc_norm_check).
struct Norm {
  std::optional<Tensor> held[4];
  tpc_norm_spec spec;
};

Norm norm_of(tpc_comm *comm, const char *op, const Tensor &input, const std::optional<Tensor> (&vectors)[4],
             int64_t pattern, double eps, double next_eps, double weight_offset, double residual_scale) {
  static const char *const names[] = {"weight", "bias", "next_weight", "next_bias"};
  const Tensor *given[4];
  for (int i = 0; i < 4; ++i) given[i] = vectors[i].has_value() ? &vectors[i].value() : nullptr;
  check_like_input(comm, op, input, given, names, 4);
  const int64_t hidden = input.size(input.dim() - 1);
  for (int i = 0; i < 4; ++i)
    if (given[i] && given[i]->numel() != hidden)
      fail("tpcomm: %s: %s has %lld values, the last dimension %lld", op, names[i],
           static_cast<long long>(given[i]->numel()), static_cast<long long>(hidden));
  if (pattern < INT32_MIN || pattern > INT32_MAX) fail("tpcomm: %s: unknown pattern %lld", op,
                                                      static_cast<long long>(pattern));
  Norm n;
  const void *ptrs[4];
  for (int i = 0; i < 4; ++i) {
    if (given[i]) n.held[i] = aligned_input(*given[i]);
    ptrs[i] = given[i] ? n.held[i]->const_data_ptr() : nullptr;
  }
  n.spec = tpc_norm_spec{static_cast<tpc_norm_pattern>(pattern), ptrs[0], ptrs[1], ptrs[2], ptrs[3],
                         static_cast<float>(eps), static_cast<float>(next_eps), static_cast<float>(weight_offset),
                         static_cast<float>(residual_scale)};
  return n;
}

// The fused norm family (tpc_all_reduce_norm): pattern `pattern` (a
// tpc_norm_pattern) over the sum of input over the ranks, residual and the
// norm's vectors (Norm), into normed and stream_out (which may be input and
// residual themselves: the in-place variant). Misaligned views are copied, as
// for all_reduce, so the kernel's choice never depends on a pointer.
void all_reduce_norm_out(Tensor input, Tensor residual, std::optional<Tensor> weight,
                         std::optional<Tensor> next_weight, double eps, double next_eps, double weight_offset,
                         int64_t pattern, Tensor normed, Tensor stream_out, int64_t comm_id,
                         std::optional<Tensor> bias, std::optional<Tensor> next_bias, double residual_scale) {
  Held held(comm_id);
  tpc_comm *comm = held.get();
  const Tensor *all[] = {&input, &residual, &normed, &stream_out};
  const char *names[] = {"input", "residual", "normed", "stream_out"};
  check_like_input(comm, "all_reduce_norm", input, all, names, 4);
  const tpc_dtype dtype = reduce_dtype(input, "all_reduce_norm");
  if (input.dim() < 1) fail("tpcomm: all_reduce_norm needs a tensor with at least one dimension");
  if (residual.numel() != input.numel() || normed.numel() != input.numel() || stream_out.numel() != input.numel())
    fail("tpcomm: all_reduce_norm: residual and the outputs must have the input's size");
  const Norm norm = norm_of(comm, "all_reduce_norm", input, {weight, bias, next_weight, next_bias}, pattern, eps,
                            next_eps, weight_offset, residual_scale);
  const size_t nbytes = static_cast<size_t>(input.numel()) * input.element_size();
  const size_t row_bytes = static_cast<size_t>(input.size(input.dim() - 1)) * input.element_size();
  const Tensor in = aligned_input(input), res = aligned_input(residual);
  Tensor normed_dst = aligned16(normed) ? normed : new_output(normed, sizes_of(normed));
  Tensor stream_dst = aligned16(stream_out) ? stream_out : new_output(stream_out, sizes_of(stream_out));
  check(comm, tpc_all_reduce_norm(comm, &norm.spec, in.const_data_ptr(), res.const_data_ptr(),
                                  normed_dst.mutable_data_ptr(), stream_dst.mutable_data_ptr(), nbytes, row_bytes,
                                  dtype, current_stream(input.get_device_index())));
  if (!aligned16(normed)) torch::stable::copy_(normed, normed_dst);
  if (!aligned16(stream_out)) torch::stable::copy_(stream_out, stream_dst);
}

// The fused norm family with its FP8 epilogue (tpc_all_reduce_norm_quant):
// quant a tpc_norm_quant other than NONE; codes float8_e4m3fn of the input's
// shape; normed (the 16-bit normed output) written only where given; scales
// float32: PER_TENSOR's one given scale (read), else one per row (PER_TOKEN,
// contiguous) or per row and group (PER_TOKEN_GROUP: contiguous, or the 2-D
// (rows, groups) view of any strides, e.g. column-major), whose strides the
// kernel writes by.
void all_reduce_norm_quant_out(Tensor input, Tensor residual, std::optional<Tensor> weight,
                               std::optional<Tensor> next_weight, double eps, double next_eps, double weight_offset,
                               int64_t pattern, int64_t quant, double scale_floor, std::optional<Tensor> normed,
                               Tensor stream_out, Tensor codes, Tensor scales, int64_t comm_id,
                               std::optional<Tensor> bias, std::optional<Tensor> next_bias, double residual_scale) {
  Held held(comm_id);
  tpc_comm *comm = held.get();
  const Tensor *all[] = {&input, &residual, &stream_out, normed.has_value() ? &normed.value() : nullptr};
  const char *names[] = {"input", "residual", "stream_out", "normed"};
  check_like_input(comm, "all_reduce_norm_quant", input, all, names, 4);
  check_tensor(comm, codes, "codes");
  check_tensor(comm, scales, "scales");
  const tpc_dtype dtype = reduce_dtype(input, "all_reduce_norm_quant");
  if (input.dim() < 1) fail("tpcomm: all_reduce_norm_quant needs a tensor with at least one dimension");
  const int64_t hidden = input.size(input.dim() - 1), rows = hidden ? input.numel() / hidden : 0;
  if (residual.numel() != input.numel() || stream_out.numel() != input.numel() ||
      (normed.has_value() && normed->numel() != input.numel()) || codes.numel() != input.numel())
    fail("tpcomm: all_reduce_norm_quant: residual and the outputs must have the input's size");
  if (codes.scalar_type() != ScalarType::Float8_e4m3fn || !codes.is_contiguous() || !aligned16(codes))
    fail("tpcomm: all_reduce_norm_quant: codes must be a contiguous, 16-byte aligned float8_e4m3fn tensor");
  if (scales.scalar_type() != ScalarType::Float) fail("tpcomm: all_reduce_norm_quant: scales must be float32");
  if (quant < INT32_MIN || quant > INT32_MAX)
    fail("tpcomm: all_reduce_norm_quant: unknown quant %lld", static_cast<long long>(quant));
  const Norm norm = norm_of(comm, "all_reduce_norm_quant", input, {weight, bias, next_weight, next_bias}, pattern,
                            eps, next_eps, weight_offset, residual_scale);
  // the scales' strides, in floats; the C core checks the quant and the rows' fit
  const int64_t groups = quant == TPC_QUANT_PER_TOKEN_GROUP ? hidden / TPC_FP8_GROUP : 1;
  const int64_t wanted = quant == TPC_QUANT_PER_TENSOR ? 1 : rows * groups;
  if (scales.numel() != wanted)
    fail("tpcomm: all_reduce_norm_quant: scales has %lld values, the quantization writes or reads %lld",
         static_cast<long long>(scales.numel()), static_cast<long long>(wanted));
  int64_t row_stride = groups, group_stride = 1;
  if (!scales.is_contiguous()) {
    if (quant != TPC_QUANT_PER_TOKEN_GROUP || scales.dim() != 2 || scales.size(0) != rows || scales.size(1) != groups)
      fail("tpcomm: all_reduce_norm_quant: scales must be contiguous, or the (rows, groups) view of PER_TOKEN_GROUP");
    row_stride = scales.stride(0);
    group_stride = scales.stride(1);
    if (row_stride < 1 || group_stride < 1) fail("tpcomm: all_reduce_norm_quant: scales' strides must be positive");
  }
  const size_t nbytes = static_cast<size_t>(input.numel()) * input.element_size();
  const size_t row_bytes = static_cast<size_t>(hidden) * input.element_size();
  const Tensor in = aligned_input(input), res = aligned_input(residual);
  std::optional<Tensor> normed_dst = normed;
  if (normed.has_value() && !aligned16(*normed)) normed_dst = new_output(*normed, sizes_of(*normed));
  Tensor stream_dst = aligned16(stream_out) ? stream_out : new_output(stream_out, sizes_of(stream_out));
  check(comm, tpc_all_reduce_norm_quant(
                  comm, &norm.spec, static_cast<tpc_norm_quant>(quant), in.const_data_ptr(), res.const_data_ptr(),
                  normed_dst.has_value() ? normed_dst->mutable_data_ptr() : nullptr, stream_dst.mutable_data_ptr(),
                  codes.mutable_data_ptr(), static_cast<float *>(scales.mutable_data_ptr()),
                  static_cast<size_t>(row_stride), static_cast<size_t>(group_stride), static_cast<float>(scale_floor),
                  nbytes, row_bytes, dtype, current_stream(input.get_device_index())));
  if (normed.has_value() && !aligned16(*normed)) torch::stable::copy_(*normed, *normed_dst);
  if (!aligned16(stream_out)) torch::stable::copy_(stream_out, stream_dst);
}

// Rank r's share of the sum: the input's dim 0 holds world_size equal parts
// (NCCL's reduce_scatter_tensor layout); the output is the sum of part r, in
// the input's dtype or (float32) as the fp32 sums, not rounded.
Tensor reduce_scatter_into(const Tensor &input, int64_t comm_id, int64_t algo, bool float32) {
  Held held(comm_id);
  tpc_comm *comm = held.get();
  check_tensor(comm, input, "input");
  const tpc_dtype dtype = reduce_dtype(input, "reduce_scatter");
  const int64_t world = tpc_comm_world_size(comm);
  if (input.dim() < 1 || input.size(0) % world != 0)
    fail("tpcomm: reduce_scatter needs dim 0 divisible by the world size %lld", static_cast<long long>(world));
  const Tensor x = aligned_input(contiguous_input(input));
  std::vector<int64_t> sizes = sizes_of(x);
  sizes[0] /= world;
  Tensor out = new_output(x, sizes, float32);
  const size_t chunk = static_cast<size_t>(x.numel() / world) * x.element_size();
  void *stream = current_stream(x.get_device_index());
  const tpc_algo how = to_algo(algo);
  check(comm, float32 ? tpc_reduce_scatter_f32(comm, x.const_data_ptr(), static_cast<float *>(out.mutable_data_ptr()),
                                               chunk, dtype, how, stream)
                      : tpc_reduce_scatter(comm, x.const_data_ptr(), out.mutable_data_ptr(), chunk, dtype, how,
                                           stream));
  return out;
}

Tensor reduce_scatter(Tensor input, int64_t comm_id, int64_t algo) { return reduce_scatter_into(input, comm_id, algo, false); }

Tensor reduce_scatter_f32(Tensor input, int64_t comm_id, int64_t algo) {
  return reduce_scatter_into(input, comm_id, algo, true);
}

// Concatenation of every rank's input along `dim`, contiguous: what NCCL's
// all_gather_into_tensor along dim 0 followed by a move to `dim` returns.
Tensor all_gather(Tensor input, int64_t dim, int64_t comm_id, int64_t algo) {
  Held held(comm_id);
  tpc_comm *comm = held.get();
  check_tensor(comm, input, "input");
  const int64_t ndim = input.dim();
  if (ndim < 1) fail("tpcomm: all_gather needs a tensor with at least one dimension");
  if (dim < -ndim || dim >= ndim)
    fail("tpcomm: dim %lld is out of range for %lld dimensions", static_cast<long long>(dim),
         static_cast<long long>(ndim));
  if (dim < 0) dim += ndim;
  Tensor x = aligned_input(contiguous_input(input));
  std::vector<int64_t> sizes(ndim);
  int64_t row = static_cast<int64_t>(x.element_size());
  for (int64_t d = 0; d < ndim; ++d) {
    sizes[d] = x.size(d);
    if (d >= dim) row *= sizes[d];
  }
  sizes[dim] *= tpc_comm_world_size(comm);
  Tensor out = new_output(x, sizes);
  const size_t nbytes = static_cast<size_t>(x.numel()) * x.element_size();
  if (nbytes == 0) return out;
  check(comm, tpc_all_gather(comm, x.const_data_ptr(), out.mutable_data_ptr(), nbytes,
                             static_cast<size_t>(row), to_algo(algo),
                             nan_pattern(x.scalar_type()), current_stream(x.get_device_index())));
  return out;
}

// Refuses a tensor that is not on a CUDA device with tpcomm's own message
// (the dispatcher's own would list every backend it has no kernel for).
[[noreturn]] void needs_cuda(const char *op, const Tensor &t) {
  const char *where = t.is_cpu() ? "cpu" : "non-CUDA";
  fail("tpcomm: _tpcomm::%s needs CUDA tensors, got a %s tensor", op, where);
}

Tensor all_reduce_not_cuda(Tensor input, int64_t, int64_t) { needs_cuda("all_reduce", input); }
void all_reduce_out_not_cuda(Tensor input, Tensor, int64_t, int64_t) { needs_cuda("all_reduce_out", input); }
Tensor all_gather_not_cuda(Tensor input, int64_t, int64_t, int64_t) { needs_cuda("all_gather", input); }
Tensor reduce_scatter_not_cuda(Tensor input, int64_t, int64_t) { needs_cuda("reduce_scatter", input); }
Tensor reduce_scatter_f32_not_cuda(Tensor input, int64_t, int64_t) { needs_cuda("reduce_scatter_f32", input); }
void all_reduce_norm_out_not_cuda(Tensor input, Tensor, std::optional<Tensor>, std::optional<Tensor>, double, double,
                                  double, int64_t, Tensor, Tensor, int64_t, std::optional<Tensor>,
                                  std::optional<Tensor>, double) {
  needs_cuda("all_reduce_norm_out", input);
}

void all_reduce_norm_quant_out_not_cuda(Tensor input, Tensor, std::optional<Tensor>, std::optional<Tensor>, double,
                                        double, double, int64_t, int64_t, double, std::optional<Tensor>, Tensor,
                                        Tensor, Tensor, int64_t, std::optional<Tensor>, std::optional<Tensor>,
                                        double) {
  needs_cuda("all_reduce_norm_quant_out", input);
}

}  // namespace

// Internal ops: the Communicator (Python) picks `algo`, a tpc_algo; model code
// uses the group-name ops torch.ops.tpcomm.* instead. `comm` is a
// comm_id (Communicator.comm_id), looked up on every call.
STABLE_TORCH_LIBRARY(_tpcomm, m) {
  m.def("all_reduce(Tensor input, int comm_id, int algo) -> Tensor");
  m.def("all_reduce_out(Tensor input, Tensor(a!) out, int comm_id, int algo) -> ()");
  m.def("all_gather(Tensor input, int dim, int comm_id, int algo) -> Tensor");
  m.def("reduce_scatter(Tensor input, int comm_id, int algo) -> Tensor");
  m.def("reduce_scatter_f32(Tensor input, int comm_id, int algo) -> Tensor");
  m.def("all_reduce_norm_out(Tensor input, Tensor residual, Tensor? weight, Tensor? next_weight, float eps, "
        "float next_eps, float weight_offset, int pattern, Tensor(a!) normed, Tensor(b!) stream_out, "
        "int comm_id, Tensor? bias=None, Tensor? next_bias=None, float residual_scale=1.0) -> ()");
  m.def("all_reduce_norm_quant_out(Tensor input, Tensor residual, Tensor? weight, Tensor? next_weight, float eps, "
        "float next_eps, float weight_offset, int pattern, int quant, float scale_floor, Tensor(a!)? normed, "
        "Tensor(b!) stream_out, Tensor(c!) codes, Tensor(d!) scales, int comm_id, Tensor? bias=None, "
        "Tensor? next_bias=None, float residual_scale=1.0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(_tpcomm, CUDA, m) {
  m.impl("all_reduce", TORCH_BOX(&all_reduce));
  m.impl("all_reduce_out", TORCH_BOX(&all_reduce_out));
  m.impl("all_gather", TORCH_BOX(&all_gather));
  m.impl("reduce_scatter", TORCH_BOX(&reduce_scatter));
  m.impl("reduce_scatter_f32", TORCH_BOX(&reduce_scatter_f32));
  m.impl("all_reduce_norm_out", TORCH_BOX(&all_reduce_norm_out));
  m.impl("all_reduce_norm_quant_out", TORCH_BOX(&all_reduce_norm_quant_out));
}

STABLE_TORCH_LIBRARY_IMPL(_tpcomm, CPU, m) {
  m.impl("all_reduce", TORCH_BOX(&all_reduce_not_cuda));
  m.impl("all_reduce_out", TORCH_BOX(&all_reduce_out_not_cuda));
  m.impl("all_gather", TORCH_BOX(&all_gather_not_cuda));
  m.impl("reduce_scatter", TORCH_BOX(&reduce_scatter_not_cuda));
  m.impl("reduce_scatter_f32", TORCH_BOX(&reduce_scatter_f32_not_cuda));
  m.impl("all_reduce_norm_out", TORCH_BOX(&all_reduce_norm_out_not_cuda));
  m.impl("all_reduce_norm_quant_out", TORCH_BOX(&all_reduce_norm_quant_out_not_cuda));
}
