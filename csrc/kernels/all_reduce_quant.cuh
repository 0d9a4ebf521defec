/*
 * The quantized all-reduce (TPC_ALGO_QUANTIZED_FP8, _INT8, _INT4): the streamed
 * two-shot of all_reduce.cuh (tpc_all_reduce_bulk_kernel: its chunks, steps,
 * counts, waits and memory order) with quantized groups on the wire
 * (quant.cuh) instead of the 16-bit values, at any world size 2..8.
 *
 * Chunks: of the input's `units` 16-byte units, rank o owns chunk o, units
 * [o*C, (o+1)*C), with C = ceil(units / n) rounded up to a group (4 units),
 * clipped to `units`: groups are the 32 consecutive values from every
 * multiple of 32 of the input, whatever the world size, and the last one is
 * zero-padded (zeros do not change an absmax).
 *
 * Phase one (scatter of step t): each rank quantizes its units of every peer
 * o's chunk and writes them into its scatter slot in o's region. Phase two
 * (sums of step t, once the peers signalled their scatter of it): the owner
 * sums its chunk in fp32, in rank order from -0.0: its own values as they
 * are (exact), each peer's decoded from its slot; quantizes the sums
 * (groups of the sums' absmax) and writes them into its gather slot in every
 * peer's region; and decodes those very codes into its own output. Gather of
 * step t (once the peers signalled their sums): every peer o's codes from
 * this rank's gather slot of o, decoded into o's chunk of out. Every rank
 * decodes the same bytes with the same arithmetic (tpc_quant_decode, then
 * the one rounding to the dtype), so every rank ends with the same bits, and
 * the same input gives the same bits on every run. A value NaN or +-inf
 * makes its group NaN, in the sums too (quant.cuh), never another group.
 *
 * Slots, in rank p's part of the bulk region, per sender q != p (packed as
 * q - (q > p)): n-1 scatter slots, then n-1 gather slots, each `slot` bytes:
 * the payloads of C units (8 or 4 bytes a unit, at x * payload), then the
 * fp32 scales of C/4 groups, rounded up to 16 bytes. It always fits in the
 * whole region: slot <= 9C + 15 and C <= units/n + 4, so 2 (n-1) slot <=
 * 18 units + 8 (n-1) 9 + 30 (n-1) <= 18 units + 714, which is at most
 * 32 units = 2 nbytes <= data_bytes from 51 units on, and below 4096 <=
 * data_bytes under it (layout.h). It takes the op's half where it fits
 * (TPC_BULK_HALF), as the two-shot does, chosen from the arguments alone.
 *
 * Memory order: the two-shot's chain, unchanged (all_reduce.cuh): the codes
 * a warp writes into a peer's slots -> __syncwarp and the block-scope
 * release of its count -> the control warp's acquire and its system-scope
 * release of the peer's flag -> the peer warp's system-scope acquire of the
 * flag -> its loads of the slot (past the L1, tpc_load8_from_peer). System
 * scope because the reader is another GPU; every slot byte is written once
 * per op, and tpc_bulk_acquire orders the peers' reads of the previous op
 * before this op's writes.
 *
 * Warps: a group spans 4 lanes, so every lane of a warp runs every
 * quantization (lanes past the data with zeros) and a warp skips a phase
 * only as a whole (tpc_warp_any of the failure).
 *
 * in == out is safe, as in the two-shot: a unit is touched by one lane only,
 * which reads its input before it writes its output.
 */
#ifndef TPCOMM_ALL_REDUCE_QUANT_CUH
#define TPCOMM_ALL_REDUCE_QUANT_CUH

#include "two_shot.cuh"
#include "quant_steps.cuh"

typedef struct {
  uint64_t units;   /* 16-byte units of the input */
  uint64_t chunk;   /* C: units of a chunk, whole groups */
  uint64_t slot;    /* bytes of one slot: payloads, then scales */
  uint64_t scales;  /* offset of the scales in a slot */
  int use;          /* TPC_BULK_HALF or TPC_BULK_WHOLE */
} tpc_quant_shot;

template <int Mode>
TPC_DEVICE tpc_quant_shot tpc_quant_shot_of(const tpc_kernel_args *a) {
  tpc_quant_shot c;
  c.units = a->nbytes / 16;
  c.chunk = tpc_quant_chunk(c.units, a->world);
  c.scales = c.chunk * tpc_quant_unit_bytes(Mode);
  c.slot = (c.scales + c.chunk / TPC_QUANT_LANES * 4 + 15) / 16 * 16;
  c.use = 2 * (uint64_t)(a->world - 1) * c.slot <= tpc_stream_half_bytes(a) ? TPC_BULK_HALF : TPC_BULK_WHOLE;
  return c;
}

TPC_DEVICE uint64_t tpc_quant_units(const tpc_quant_shot *c, int o) { return tpc_chunk_units(c->units, c->chunk, o); }

TPC_DEVICE tpc_quant_at tpc_quant_slot(const tpc_kernel_args *a, const tpc_steps *s, const tpc_quant_shot *c,
                                       int owner, int sender, int gather) {
  char *slot = tpc_shot_slot(a, s, c->use, c->slot, owner, sender, gather);
  return tpc_quant_at{slot, (float *)(slot + c->scales)};
}

/* Phase one of step t: this rank's units of every peer o's chunk, quantized,
 * into its scatter slot of o. */
template <int Dtype, int Mode>
TPC_DEVICE void tpc_quant_scatter(const tpc_op *op, const tpc_steps *s, const tpc_quant_shot *c, uint32_t t) {
  const tpc_kernel_args *a = op->args;
  if (tpc_warp_any(op->failed)) return; /* a peer may still read its slots */
  tpc_quant_encode_jobs<Dtype, Mode>(s, a->world - 1, [&](int i) {
    const int o = (a->rank + 1 + i) % a->world;
    return tpc_quant_job{t, (const char *)a->in + (uint64_t)o * c->chunk * 16, tpc_quant_units(c, o),
                         tpc_quant_slot(a, s, c, o, a->rank, 0)};
  });
}

/* Phase two of step t: the sums of this rank's chunk (its own values, the
 * peers' decoded), quantized into every peer's gather slot (unless the op
 * broke) and decoded into out (NaN once broken). */
template <int Dtype, int Mode>
TPC_DEVICE void tpc_quant_reduce(const tpc_op *op, const tpc_steps *s, const tpc_quant_shot *c, uint32_t t) {
  const tpc_kernel_args *a = op->args;
  const int me = a->rank;
  const uint64_t limit = tpc_quant_units(c, me), offset = (uint64_t)me * c->chunk * 16;
  uint4 own[TPC_STREAM_UNITS];
  float acc[TPC_STREAM_UNITS][8];
  tpc_stream_load_below(s, (const char *)a->in + offset, t, limit, own);
  tpc_quant_sum_step<Dtype, Mode>(
      s, t, limit, a->world, me, own, [&](int q) { return tpc_quant_slot(a, s, c, me, q, 0); }, acc);
  const int broken = tpc_warp_any(tpc_op_broken(op));
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t x = tpc_stream_unit(s, t, k);
    uint2 payload;
    float scale;
    tpc_quant_unit<Mode>(acc[k], &payload, &scale);
    if (x < limit) {
      if (!broken) {
        for (int i = 1; i < a->world; ++i)
          tpc_quant_store<Mode>(tpc_quant_slot(a, s, c, (me + i) % a->world, me, 1), x, payload, scale);
      }
      float f[8];
      tpc_quant_decode<Mode>(payload, scale, f);
      tpc_store16((char *)a->out + offset + x * 16, broken ? tpc_poison16(a) : tpc_unit_of_floats<Dtype>(f));
    }
  }
}

/* The gather of step t: every peer o's codes from this rank's gather slot
 * of o, decoded into o's chunk of out (NaN once broken). */
template <int Dtype, int Mode>
TPC_DEVICE void tpc_quant_gather(const tpc_op *op, const tpc_steps *s, const tpc_quant_shot *c, uint32_t t) {
  const tpc_kernel_args *a = op->args;
  const int broken = tpc_op_broken(op);
  auto load = [&](int i) {
    const int o = (a->rank + i) % a->world;
    return tpc_quant_load<Mode>(s, tpc_quant_slot(a, s, c, a->rank, o, 1), t, tpc_quant_units(c, o));
  };
  /* peer i+1's loads are issued before peer i's codes are decoded */
  tpc_quant_codes cur = {}, next = {};
  if (!broken) cur = load(1);
  for (int i = 1; i < a->world; ++i) {
    const int o = (a->rank + i) % a->world;
    const uint64_t limit = tpc_quant_units(c, o);
    if (!broken && i + 1 < a->world) next = load(i + 1);
#pragma unroll
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
      const uint64_t x = tpc_stream_unit(s, t, k);
      if (x >= limit) continue;
      uint4 v = tpc_poison16(a);
      if (!broken) {
        float f[8];
        tpc_quant_decode<Mode>(cur.payload[k], cur.scale[k], f);
        v = tpc_unit_of_floats<Dtype>(f);
      }
      tpc_store16((char *)a->out + ((uint64_t)o * c->chunk + x) * 16, v);
    }
    cur = next;
  }
}

/* The two-shot's schedule and counts (tpc_two_shot_run, two_shot.cuh),
 * with the quantized phases, one instantiation per 16-bit dtype and mode
 * (launch.cu picks it from the op's dtype and algorithm). */
template <int Dtype, int Mode>
__global__ void __launch_bounds__(TPC_STREAM_MAX_THREADS, 1)
    tpc_all_reduce_quant_kernel(const TPC_GRID_CONSTANT tpc_kernel_args a) {
  tpc_op op = tpc_stream_op_begin(&a);
  if (op.refused) return tpc_op_refuse(&a, op.refused, op.epoch);
  const tpc_quant_shot c = tpc_quant_shot_of<Mode>(&a);
  const tpc_steps s = tpc_stream_of(&a, tpc_bulk_acquire(&a, &op, c.use), c.chunk, c.use);
  tpc_two_shot_run<tpc_quant_shot, tpc_quant_scatter<Dtype, Mode>, tpc_quant_reduce<Dtype, Mode>,
                   tpc_quant_gather<Dtype, Mode>>(&op, &s, &c);
  tpc_op_end(&a, &op, c.use);
}

#endif /* TPCOMM_ALL_REDUCE_QUANT_CUH */
