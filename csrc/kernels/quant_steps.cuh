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

/* One job of the encoder: step t of the 16-bit units at `in` below
 * `limit`, quantized into `to`. */
typedef struct {
  uint32_t t;
  const char *in;
  uint64_t limit;
  tpc_quant_at to;
} tpc_quant_job;

/* A job's input, every load issued before any is used (units from `limit`
 * on read as 0). */
template <bool Whole>
TPC_DEVICE void tpc_quant_load_in_units(const tpc_steps *s, const tpc_quant_job *j, uint4 v[TPC_STREAM_UNITS]) {
  const uint64_t x0 = tpc_stream_unit(s, j->t, 0); /* unit k: x0 + k * TPC_STREAM_LANES */
  const char *in = j->in + x0 * 16;
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const bool load = Whole || x0 + (uint64_t)k * TPC_STREAM_LANES < j->limit;
    v[k] = load ? tpc_load16(in + k * TPC_STREAM_LANES * 16) : make_uint4(0u, 0u, 0u, 0u);
  }
}

TPC_DEVICE void tpc_quant_load_in(const tpc_steps *s, const tpc_quant_job *j, uint4 v[TPC_STREAM_UNITS]) {
  if (tpc_quant_whole_step(s, j->t, j->limit)) tpc_quant_load_in_units<true>(s, j, v);
  else tpc_quant_load_in_units<false>(s, j, v);
}

template <int Dtype, int Mode, bool Whole>
TPC_DEVICE void tpc_quant_encode_units(const tpc_steps *s, const tpc_quant_job *j, const uint4 v[TPC_STREAM_UNITS]) {
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    float f[8], scale;
    uint2 payload;
    tpc_unit_floats<Dtype>(v[k], f);
    tpc_quant_unit<Mode>(f, &payload, &scale);
    const uint64_t x = tpc_stream_unit(s, j->t, k);
    if (Whole || x < j->limit) tpc_quant_store<Mode>(j->to, x, payload, scale);
  }
}

/* Jobs 0 .. jobs-1 (jobs >= 1) of job_of(i) in turn, each's input loaded
 * (tpc_quant_load_in) and handed to use(job, v). Job i+1's loads are issued
 * before job i is used (two buffers), so a warp's loads are in flight while
 * it does its arithmetic. */
template <typename JobOf, typename Use>
TPC_DEVICE void tpc_quant_walk_jobs(const tpc_steps *s, int jobs, JobOf job_of, Use use) {
  uint4 v[TPC_STREAM_UNITS], w[TPC_STREAM_UNITS];
  const tpc_quant_job first = job_of(0);
  tpc_quant_load_in(s, &first, v);
  for (int i = 0; i < jobs; ++i) {
    if (i + 1 < jobs) {
      const tpc_quant_job next = job_of(i + 1);
      tpc_quant_load_in(s, &next, w);
    }
    use(job_of(i), v); /* the job asked again, not kept: fewer registers live across the loads */
#pragma unroll
    for (int k = 0; k < TPC_STREAM_UNITS; ++k) v[k] = w[k];
  }
}

/* Jobs 0 .. jobs-1 (jobs >= 1) of job_of(i), each quantized (every lane
 * runs every group's shuffles, lanes past a job's limit with zeros): the
 * scatter's work on the peers' chunks of a step, two jobs' loads in flight
 * (tpc_quant_walk_jobs). */
template <int Dtype, int Mode, typename JobOf>
TPC_DEVICE void tpc_quant_encode_jobs(const tpc_steps *s, int jobs, JobOf job_of) {
  tpc_quant_walk_jobs(s, jobs, job_of, [&](const tpc_quant_job &j, const uint4 *v) {
    if (tpc_quant_whole_step(s, j.t, j.limit)) tpc_quant_encode_units<Dtype, Mode, true>(s, &j, v);
    else tpc_quant_encode_units<Dtype, Mode, false>(s, &j, v);
  });
}

/* Step t's codes of the units below `limit` (written by a peer whose flag
 * was acquired), every load issued before any is used, past the L1; units
 * from `limit` on read as codes 0 of scale 0, which decode to 0. */
typedef struct {
  uint2 payload[TPC_STREAM_UNITS];
  float scale[TPC_STREAM_UNITS];
} tpc_quant_codes;

/* Unit k of a step is its unit 0 plus k * TPC_STREAM_LANES (tpc_stream_unit),
 * so its payload lies at a fixed distance from unit 0's: one address a
 * step, the rest immediate offsets. (The scales' addresses are computed per
 * unit: the same for them pushes the kernel past its 168 registers.) */
template <int Mode, bool Whole>
TPC_DEVICE tpc_quant_codes tpc_quant_load_units(const tpc_steps *s, tpc_quant_at from, uint32_t t, uint64_t limit) {
  constexpr uint32_t bytes = tpc_quant_unit_bytes(Mode);
  const uint64_t x0 = tpc_stream_unit(s, t, 0);
  const char *payload = from.payload + x0 * bytes;
  tpc_quant_codes q;
#pragma unroll
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    const bool in = Whole || x0 + (uint64_t)k * TPC_STREAM_LANES < limit;
    const char *p = payload + k * TPC_STREAM_LANES * bytes;
    if constexpr (bytes == 8) q.payload[k] = in ? tpc_load8_from_peer(p) : make_uint2(0u, 0u);
    else q.payload[k] = make_uint2(in ? tpc_load4_from_peer(p) : 0u, 0u);
    const float *scale = from.scales + (x0 + (uint64_t)k * TPC_STREAM_LANES) / TPC_QUANT_LANES;
    q.scale[k] = in ? __uint_as_float(tpc_load4_from_peer(scale)) : 0.0f;
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
