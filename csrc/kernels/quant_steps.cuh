/*
 * The quantized all-reduce's local work on one step (all_reduce_quant.cuh),
 * on plain pointers: a step of 16-bit values quantized into codes, a step of
 * codes loaded, decoded and summed. The kernel's phases call these with its
 * slots; benchmarks/quant_local.cu times them on device memory. Templated
 * on the dtype and mode, as the kernel is.
 *
 * Memory order is the caller's: the kernel publishes its stores into a
 * peer's slot by its counts, and reads a slot (tpc_quant_load: past the L1)
 * only after acquiring the writer's flag at system scope
 * (all_reduce_quant.cuh).
 */
#ifndef TPCOMM_QUANT_STEPS_CUH
#define TPCOMM_QUANT_STEPS_CUH

#include "quant.cuh"
#include "two_shot.cuh"

/* C, the units of a chunk: the two-shot's chunk rounded up to a group's
 * units. The launch sizes its grid by it, the kernel its slots. */
TPC_HOST_DEVICE uint64_t tpc_quant_chunk(uint64_t units, int world) {
  return (tpc_two_shot_chunk(units, world) + TPC_QUANT_LANES - 1) / TPC_QUANT_LANES * TPC_QUANT_LANES;
}

/* Where the codes of a chunk lie: unit x's payload at payload + x *
 * tpc_quant_unit_bytes(Mode), its group's scale at scales[x / TPC_QUANT_LANES]. */
typedef struct {
  char *payload;
  float *scales;
} tpc_quant_at;

/* Unit x's codes into `to`: the payload, and the group's scale by the
 * group's first lane. */
template <int Mode>
TPC_DEVICE void tpc_quant_store(tpc_quant_at to, uint64_t x, uint2 payload, float scale) {
  if constexpr (tpc_quant_unit_bytes(Mode) == 8) *(uint2 *)(to.payload + x * 8) = payload;
  else *(uint32_t *)(to.payload + x * 4) = payload.x;
  if (x % TPC_QUANT_LANES == 0) to.scales[x / TPC_QUANT_LANES] = scale;
}

/* Whether all of step t's units lie below `limit`: the same on every lane,
 * so a warp takes one path, and the steps of a chunk but its last skip the
 * per-unit checks. */
TPC_DEVICE bool tpc_quant_whole_step(const tpc_steps *s, uint32_t t, uint64_t limit) {
  return tpc_stream_unit(s, t, 0) - s->lane + TPC_STREAM_STEP_UNITS <= limit;
}

template <int Dtype, int Mode, bool Whole>
TPC_DEVICE void tpc_quant_encode_units(const tpc_steps *s, uint32_t t, const char *in, uint64_t limit,
                                       tpc_quant_at to) {
  uint4 v[TPC_STREAM_UNITS];
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t x = tpc_stream_unit(s, t, k);
    v[k] = Whole || x < limit ? tpc_load16(in + x * 16) : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    float f[8], scale;
    uint2 payload;
    tpc_unit_floats<Dtype>(v[k], f);
    tpc_quant_unit<Mode>(f, &payload, &scale);
    const uint64_t x = tpc_stream_unit(s, t, k);
    if (Whole || x < limit) tpc_quant_store<Mode>(to, x, payload, scale);
  }
}

/* Step t of the 16-byte units at `in`, quantized into `to` (units below
 * `limit`; every lane runs every group's shuffles, lanes past it with
 * zeros): the scatter's work on one peer's chunk. */
template <int Dtype, int Mode>
TPC_DEVICE void tpc_quant_encode_step(const tpc_steps *s, uint32_t t, const char *in, uint64_t limit,
                                      tpc_quant_at to) {
  if (tpc_quant_whole_step(s, t, limit)) tpc_quant_encode_units<Dtype, Mode, true>(s, t, in, limit, to);
  else tpc_quant_encode_units<Dtype, Mode, false>(s, t, in, limit, to);
}

/* Step t's codes of the units below `limit` (written by a peer whose flag
 * was acquired), every load issued before any is used, past the L1; units
 * from `limit` on read as codes 0 of scale 0, which decode to 0. */
typedef struct {
  uint2 payload[TPC_STREAM_UNITS];
  float scale[TPC_STREAM_UNITS];
} tpc_quant_codes;

template <int Mode, bool Whole>
TPC_DEVICE tpc_quant_codes tpc_quant_load_units(const tpc_steps *s, tpc_quant_at from, uint32_t t, uint64_t limit) {
  tpc_quant_codes q;
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const uint64_t x = tpc_stream_unit(s, t, k);
    const bool in = Whole || x < limit;
    if constexpr (tpc_quant_unit_bytes(Mode) == 8)
      q.payload[k] = in ? tpc_load8_from_peer(from.payload + x * 8) : make_uint2(0u, 0u);
    else q.payload[k] = make_uint2(in ? tpc_load4_from_peer(from.payload + x * 4) : 0u, 0u);
    q.scale[k] = in ? __uint_as_float(tpc_load4_from_peer(from.scales + x / TPC_QUANT_LANES)) : 0.0f;
  }
  return q;
}

template <int Mode>
TPC_DEVICE tpc_quant_codes tpc_quant_load(const tpc_steps *s, tpc_quant_at from, uint32_t t, uint64_t limit) {
  return tpc_quant_whole_step(s, t, limit) ? tpc_quant_load_units<Mode, true>(s, from, t, limit)
                                           : tpc_quant_load_units<Mode, false>(s, from, t, limit);
}

/* A rank's values f of a unit into its fp32 sum, kept in rank order from
 * -0.0 (`first`: rank 0, which starts it). */
TPC_DEVICE void tpc_quant_add(float acc[8], const float f[8], bool first) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = first ? -0.0f + f[i] : acc[i] + f[i];
}

/* A rank's codes of a step, decoded, into the step's sums. */
template <int Mode>
TPC_DEVICE void tpc_quant_add_codes(float acc[TPC_STREAM_UNITS][8], const tpc_quant_codes *codes, bool first) {
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    float f[8];
    tpc_quant_decode<Mode>(codes->payload[k], codes->scale[k], f);
    tpc_quant_add(acc[k], f, first);
  }
}

/* A rank's own 16-bit values of a step (exact in fp32) into its sums. */
template <int Dtype>
TPC_DEVICE void tpc_quant_add_own(float acc[TPC_STREAM_UNITS][8], const uint4 own[TPC_STREAM_UNITS], bool first) {
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    float f[8];
    tpc_unit_floats<Dtype>(own[k], f);
    tpc_quant_add(acc[k], f, first);
  }
}

/* Rank q's part of step t's sums: `own` where q is own_rank, else `codes`. */
template <int Dtype, int Mode, bool First>
TPC_DEVICE void tpc_quant_add_rank(float acc[TPC_STREAM_UNITS][8], int q, int own_rank,
                                   const uint4 own[TPC_STREAM_UNITS], const tpc_quant_codes *codes) {
  if (q == own_rank) tpc_quant_add_own<Dtype>(acc, own, First);
  else tpc_quant_add_codes<Mode>(acc, codes, First);
}

/* Step t's sums over ranks 0 .. n-1 (n >= 1), in rank order from -0.0:
 * rank own_rank's values from `own` (-1: none), every other rank q's codes
 * from slot_of(q) (tpc_quant_load: units below `limit`). Rank q+1's loads
 * are issued before rank q's codes are decoded (two buffers), so a warp's
 * loads are in flight while it does its arithmetic; the order of the adds
 * is unchanged, and so are the sums' bits. */
template <int Dtype, int Mode, typename SlotOf>
TPC_DEVICE void tpc_quant_sum_step(const tpc_steps *s, uint32_t t, uint64_t limit, int n, int own_rank,
                                   const uint4 own[TPC_STREAM_UNITS], SlotOf slot_of,
                                   float acc[TPC_STREAM_UNITS][8]) {
  tpc_quant_codes cur = {}, next = {};
  if (own_rank != 0) cur = tpc_quant_load<Mode>(s, slot_of(0), t, limit);
  if (n > 1 && own_rank != 1) next = tpc_quant_load<Mode>(s, slot_of(1), t, limit);
  tpc_quant_add_rank<Dtype, Mode, true>(acc, 0, own_rank, own, &cur);
  for (int q = 1; q < n; ++q) {
    cur = next;
    if (q + 1 < n && q + 1 != own_rank) next = tpc_quant_load<Mode>(s, slot_of(q + 1), t, limit);
    tpc_quant_add_rank<Dtype, Mode, false>(acc, q, own_rank, own, &cur);
  }
}

#endif /* TPCOMM_QUANT_STEPS_CUH */
