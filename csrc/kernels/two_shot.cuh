/*
 * The streamed two-shot's schedule and chunking, shared by the kernels that
 * run it: the bulk all-reduce of three or more ranks (all_reduce.cuh) and
 * the quantized all-reduce (all_reduce_quant.cuh).
 */
#ifndef TPCOMM_TWO_SHOT_CUH
#define TPCOMM_TWO_SHOT_CUH

#include "stream_sum.cuh"

/* C, the 16-byte units of one rank's chunk: ceil(units / world). The launch
 * sizes the grid from it and the kernel lays its steps over it. */
TPC_HOST_DEVICE uint64_t tpc_two_shot_chunk(uint64_t units, int world) {
  return (units + (uint64_t)world - 1) / (uint64_t)world;
}

/* The streamed two-shot (tpc_all_reduce_bulk_kernel), three or more ranks.
 *
 * Chunks: of the input's `units` 16-byte units, rank o owns chunk o, global
 * units [o*C, (o+1)*C) with C = ceil(units / n), clipped to `units` (the last
 * chunks may be short or empty). The stream's steps (stream.cuh) are laid
 * over one chunk: chunk-local units x in [0, C), so the grid
 * (tpc_stream_geometry(C)) depends on the size and the world only. A warp's
 * step covers the same x of every chunk, and every step pushes one piece to
 * every peer, so every link carries the same load in both phases.
 *
 * Slots, in rank p's part of the bulk region, for each sender q != p (packed
 * as q - (q > p), as tpc_stream_slot): a scatter slot, q's input of chunk p,
 * and a gather slot, q's sums of chunk q, C units each at offset x:
 * 2 (n-1) C 16 bytes. They take the op's half of the region where that fits
 * (TPC_BULK_HALF: the next op may start while a peer still reads this one),
 * else the whole region (TPC_BULK_WHOLE: tpc_bulk_acquire waits until the
 * peers released the previous op); the choice is made from the kernel's
 * arguments alone, so every rank makes the same one.
 * It always fits in the whole region: the core caps nbytes at max_bytes
 * (ops.c) and data_bytes = round_up(2 max_bytes + 16 n, 4096) (layout.h).
 * With nC <= units + n - 1, 2 (n-1) C 16 = 32 (nC - C) <= 32 (units + n - 1
 * - C) = 2 nbytes + 32 (n - 1 - C). Where C >= (n - 2) / 2 that is at most
 * 2 nbytes + 16 n <= data_bytes; else C < 3 (n <= 8), so C <= 2 and it is at
 * most 32 * 7 * 2 = 448 < 4096 <= data_bytes. */
typedef struct {
  uint64_t units;  /* 16-byte units of the input */
  uint64_t chunk;  /* C: units of a chunk */
  int use;         /* TPC_BULK_HALF or TPC_BULK_WHOLE */
} tpc_two_shot;

TPC_DEVICE tpc_two_shot tpc_two_shot_of(const tpc_kernel_args *a) {
  tpc_two_shot c;
  c.units = a->nbytes / 16;
  c.chunk = tpc_two_shot_chunk(c.units, a->world);
  const uint64_t slots_bytes = 2 * (uint64_t)(a->world - 1) * c.chunk * 16;
  c.use = slots_bytes <= tpc_stream_half_bytes(a) ? TPC_BULK_HALF : TPC_BULK_WHOLE;
  return c;
}

/* Units of chunk o, of `units` cut in chunks of `chunk` (every two-shot
 * kernel): chunk-local x exists only below this. */
TPC_DEVICE uint64_t tpc_chunk_units(uint64_t units, uint64_t chunk, int o) {
  const uint64_t begin = (uint64_t)o * chunk;
  if (begin >= units) return 0;
  return units - begin < chunk ? units - begin : chunk;
}

/* Sender's scatter slot (gather = 0) or gather slot (gather = 1), of
 * slot_bytes each, in rank owner's part of the region (every two-shot
 * kernel): the n-1 scatter slots, then the n-1 gather slots. */
TPC_DEVICE char *tpc_shot_slot(const tpc_kernel_args *a, const tpc_steps *s, int use, uint64_t slot_bytes,
                               int owner, int sender, int gather) {
  const char *region = owner == a->rank ? s->slots : tpc_stream_region(a, owner, s->parity, use);
  const uint64_t index = (uint64_t)gather * (uint64_t)(a->world - 1) + (uint64_t)(sender - (sender > owner));
  return (char *)region + index * slot_bytes;
}

TPC_DEVICE uint64_t tpc_two_shot_units(const tpc_two_shot *c, int o) { return tpc_chunk_units(c->units, c->chunk, o); }

TPC_DEVICE char *tpc_two_shot_slot(const tpc_kernel_args *a, const tpc_steps *s, const tpc_two_shot *c, int owner,
                                   int sender, int gather) {
  return tpc_shot_slot(a, s, c->use, c->chunk * 16, owner, sender, gather);
}

/* Phase one of step t: this rank's input of every peer o's chunk into o's
 * scatter slot for this sender (tpc_stream_scatter). */
TPC_DEVICE void tpc_two_shot_scatter(const tpc_op *op, const tpc_steps *s, const tpc_two_shot *c, uint32_t t) {
  const tpc_kernel_args *a = op->args;
  tpc_stream_scatter(
      op, s, t, c->chunk * 16, [&](int o) { return tpc_two_shot_units(c, o); },
      [&](int o) { return tpc_two_shot_slot(a, s, c, o, a->rank, 0); });
}

/* Phase two of step t, once every peer signalled its phase one of it: the
 * sums of this rank's chunk in rank order (tpc_stream_accumulate: this
 * rank's input, the peers' scatter slots), rounded once, pushed into every
 * peer's gather slot for this sender (unless the op broke) and written to
 * out (NaN once broken). DTYPE: a tpc_dtype, the kernel's. */
template <int DTYPE>
TPC_DEVICE void tpc_two_shot_reduce(const tpc_op *op, const tpc_steps *s, const tpc_two_shot *c, uint32_t t) {
  const tpc_kernel_args *a = op->args;
  const int me = a->rank;
  const uint64_t limit = tpc_two_shot_units(c, me), offset = (uint64_t)me * c->chunk * 16;
  uint4 own[TPC_STREAM_UNITS], sum[TPC_STREAM_UNITS];
  float acc[TPC_STREAM_UNITS][8];
  tpc_stream_load_below(s, (const char *)a->in + offset, t, limit, own);
  tpc_stream_accumulate<DTYPE>(a, s, t, limit, own, [&](int q) { return tpc_two_shot_slot(a, s, c, me, q, 0); }, acc);
  const int broken = tpc_op_broken(op);
  for (int k = 0; k < TPC_STREAM_UNITS; ++k) {
    uint32_t w[4];
    tpc_round(acc[k], w, 4, DTYPE);
    sum[k] = broken ? tpc_poison16(a) : make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (!broken) {
    for (int i = 1; i < a->world; ++i)
      tpc_stream_store(s, tpc_two_shot_slot(a, s, c, (me + i) % a->world, me, 1), t, limit, sum);
  }
  tpc_stream_store(s, (char *)a->out + offset, t, limit, sum);
}

/* The gather of step t, once every peer signalled its phase two of it:
 * every peer o's sums from this rank's gather slot of o to o's chunk of out
 * (NaN once broken). */
TPC_DEVICE void tpc_two_shot_gather(const tpc_op *op, const tpc_steps *s, const tpc_two_shot *c, uint32_t t) {
  const tpc_kernel_args *a = op->args;
  const int broken = tpc_op_broken(op);
  for (int i = 1; i < a->world; ++i) {
    const int o = (a->rank + i) % a->world;
    const uint64_t limit = tpc_two_shot_units(c, o);
    uint4 v[TPC_STREAM_UNITS];
    if (broken) {
      for (int k = 0; k < TPC_STREAM_UNITS; ++k) v[k] = tpc_poison16(a);
    } else {
      tpc_stream_load_slot(s, tpc_two_shot_slot(a, s, c, a->rank, o, 1), t, limit, v);
    }
    tpc_stream_store(s, (char *)a->out + (uint64_t)o * c->chunk * 16, t, limit, v);
  }
}

/* The two-shot's schedule, one for every kernel that runs it (this bulk
 * all-reduce, the quantized one): the control warp signals every step; each
 * data warp scatters step 0, then for step i scatters i+1, sums i and
 * gathers i-1, and gathers the last step after the loop. The counts it marks
 * and waits for are the ones the comment below shows to neither deadlock nor
 * let a wait pass early. C is the kernel's chunking, Scatter / Reduce /
 * Gather its three phases of one step. */
template <typename C, void (*Scatter)(const tpc_op *, const tpc_steps *, const C *, uint32_t),
          void (*Reduce)(const tpc_op *, const tpc_steps *, const C *, uint32_t),
          void (*Gather)(const tpc_op *, const tpc_steps *, const C *, uint32_t)>
TPC_DEVICE void tpc_two_shot_run(tpc_op *op, const tpc_steps *s, const C *c) {
  if (s->warp == s->data_warps) {
    tpc_stream_signal_all(op, s, s->block_steps ? 2 * s->block_steps + 1 : 0);
  } else if (s->block_steps != 0) {
    Scatter(op, s, c, 0);
    tpc_stream_mark(op, s, 1);
    for (uint32_t i = 0; i < s->block_steps; ++i) {
      if (i + 1 < s->block_steps) Scatter(op, s, c, i + 1);
      tpc_stream_mark(op, s, 2 * i + 2);
      tpc_stream_wait(op, s, i == 0 ? 1 : 2 * i, i == 0);
      Reduce(op, s, c, i);
      tpc_stream_mark(op, s, 2 * i + 3);
      if (i > 0) {
        tpc_stream_wait(op, s, 2 * i + 1, 0);
        Gather(op, s, c, i - 1);
      }
    }
    tpc_stream_wait(op, s, 2 * s->block_steps + 1, 0);
    Gather(op, s, c, s->block_steps - 1);
  }
}

#endif /* TPCOMM_TWO_SHOT_CUH */
