// The internal torch ops (_tpcomm::*), registered through torch's stable ABI
// (STABLE_TORCH_LIBRARY and the aoti_torch_* C shim), so one build loads in
// later torch versions. This file only turns tensors into what the C API
// takes (pointers, byte sizes, a tpc_dtype, 16-byte aligned copies of
// misaligned views) and results into exceptions: it checks only what that
// translation needs (device, contiguity, matching sizes); what the kernel
// needs is checked by the C core, once. The fused norm's ops are
// norm_ops.cpp's (their schemas are here, with every op's).
#include "common.h"

namespace {

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

Tensor all_reduce_not_cuda(Tensor input, int64_t, int64_t) { needs_cuda("all_reduce", input); }
void all_reduce_out_not_cuda(Tensor input, Tensor, int64_t, int64_t) { needs_cuda("all_reduce_out", input); }
Tensor all_gather_not_cuda(Tensor input, int64_t, int64_t, int64_t) { needs_cuda("all_gather", input); }
Tensor reduce_scatter_not_cuda(Tensor input, int64_t, int64_t) { needs_cuda("reduce_scatter", input); }
Tensor reduce_scatter_f32_not_cuda(Tensor input, int64_t, int64_t) { needs_cuda("reduce_scatter_f32", input); }
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
}

STABLE_TORCH_LIBRARY_IMPL(_tpcomm, CPU, m) {
  m.impl("all_reduce", TORCH_BOX(&all_reduce_not_cuda));
  m.impl("all_reduce_out", TORCH_BOX(&all_reduce_out_not_cuda));
  m.impl("all_gather", TORCH_BOX(&all_gather_not_cuda));
  m.impl("reduce_scatter", TORCH_BOX(&reduce_scatter_not_cuda));
  m.impl("reduce_scatter_f32", TORCH_BOX(&reduce_scatter_f32_not_cuda));
}
