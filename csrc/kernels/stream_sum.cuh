/*
 * The sums of streamed steps (stream.cuh) over the ranks: this rank's units
 * and the peers' from its slots, in fp32 in rank order, rounded once (or NaN
 * once the op broke). The one-shot all-reduce, the two-shot's owner sums and
 * reduce-scatter use them.
 */
#ifndef TPCOMM_STREAM_SUM_CUH
#define TPCOMM_STREAM_SUM_CUH

#include "reduce.cuh"
#include "stream.cuh"

/* The fp32 sums of step t's units below `limit` into acc, not rounded, in
 * rank order from -0.0 (tpc_add_rank): this rank's values from `own`, peer
 * q's from its slot `slot_of(q)` of this rank, already waited for (units
 * from `limit` on add 0). Ranks are the outer loop so that a peer's
 * TPC_STREAM_UNITS loads are in flight together (summing unit by unit, with
 * the rank loop inside, leaves one load in flight, and the large ops wait on
 * each). The slots are read after tpc_stream_wait's acquire of the peer's
 * flag, which the peer's control warp released after these units landed
 * (the memory order above). DTYPE: a tpc_dtype, the kernel's. */
template <int DTYPE, typename SlotOf>
TPC_DEVICE void tpc_stream_accumulate(const tpc_kernel_args *a, const tpc_steps *s, uint32_t t, uint64_t limit,
                                      const uint4 own[TPC_STREAM_UNITS], SlotOf slot_of,
                                      float acc[TPC_STREAM_UNITS][8]) {
  for (int q = 0; q < a->world; ++q) {
    const char *slot = q == a->rank ? NULL : slot_of(q);
    uint4 v[TPC_STREAM_UNITS];
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
      const uint64_t u = tpc_stream_unit(s, t, k);
      v[k] = !slot ? own[k] : u < limit ? tpc_load16_from_peer(slot + u * 16) : make_uint4(0, 0, 0, 0);
    }
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
      const uint32_t words[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
      tpc_add_rank(acc[k], words, 4, DTYPE, q);
    }
  }
}

/* The same over every unit of the steps (below s->units), the peers'
 * values from this rank's slots of the op's half (tpc_stream_slot: the
 * one-shot all-reduce's inputs, reduce-scatter's chunks), each unit's sums
 * handed to store(u, sums, broken) (broken: the op broke, so the sums are
 * not to be written as they are). */
template <int DTYPE, typename Store>
TPC_DEVICE void tpc_stream_sum(const tpc_op *op, const tpc_steps *s, uint32_t t, const uint4 own[TPC_STREAM_UNITS],
                               Store store) {
  const tpc_kernel_args *a = op->args;
  float acc[TPC_STREAM_UNITS][8];
  tpc_stream_accumulate<DTYPE>(a, s, t, s->units, own, [&](int q) { return tpc_stream_slot(a, s, a->rank, q); }, acc);
  const int broken = tpc_op_broken(op);
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t u = tpc_stream_unit(s, t, k);
    if (u < s->units) store(u, acc[k], broken);
  }
}

/* Those sums of step t rounded once (own values from `own`, the peers' from
 * this rank's slots, already waited for), or NaN once the op broke, into
 * out: the one-shot all-reduce's result, reduce-scatter's in the input's
 * dtype. */
template <int DTYPE>
TPC_DEVICE void tpc_stream_reduce(const tpc_op *op, const tpc_steps *s, uint32_t t,
                                  const uint4 own[TPC_STREAM_UNITS], char *out) {
  const tpc_kernel_args *a = op->args;
  if (a->world == 2) { /* the same bits in packed arithmetic: 16-bit sums cost as much as fp32 */
    uint4 v[TPC_STREAM_UNITS];
    tpc_stream_load_slot(s, tpc_stream_slot(a, s, a->rank, 1 - a->rank), t, s->units, v);
    const int broken = tpc_op_broken(op);
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
      const uint64_t u = tpc_stream_unit(s, t, k);
      if (u < s->units) tpc_store16(out + u * 16, broken ? tpc_poison16(a) : tpc_sum_pair16(own[k], v[k], DTYPE));
    }
    return;
  }
  tpc_stream_sum<DTYPE>(op, s, t, own, [&](uint64_t u, const float *sums, int broken) {
    uint32_t w[4];
    tpc_round(sums, w, 4, DTYPE);
    tpc_store16(out + u * 16, broken ? tpc_poison16(a) : make_uint4(w[0], w[1], w[2], w[3]));
  });
}

#endif /* TPCOMM_STREAM_SUM_CUH */
