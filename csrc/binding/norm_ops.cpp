// The fused norm family's internal ops (_tpcomm::all_reduce_norm_out,
// all_reduce_norm_quant_out; their schemas in ops.cpp's STABLE_TORCH_LIBRARY):
// the norm's vectors and scalars as one tpc_norm_spec, the outputs as the C
// API takes them.
#include "common.h"

namespace {

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

STABLE_TORCH_LIBRARY_IMPL(_tpcomm, CUDA, m) {
  m.impl("all_reduce_norm_out", TORCH_BOX(&all_reduce_norm_out));
  m.impl("all_reduce_norm_quant_out", TORCH_BOX(&all_reduce_norm_quant_out));
}

STABLE_TORCH_LIBRARY_IMPL(_tpcomm, CPU, m) {
  m.impl("all_reduce_norm_out", TORCH_BOX(&all_reduce_norm_out_not_cuda));
  m.impl("all_reduce_norm_quant_out", TORCH_BOX(&all_reduce_norm_quant_out_not_cuda));
}
