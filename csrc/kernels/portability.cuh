/*
 * Everything vendor-specific the kernels use: cross-GPU loads and stores with
 * their memory order, fences, the nanosecond clock, half/bfloat16 conversion.
 * The rest of csrc/kernels is written only in terms of these. It is the one
 * kernel header longer than the others' ~350 lines, by design: a port to
 * another vendor reads and changes this file alone, so it holds every
 * difference, each primitive with its CUDA and HIP spelling side by side.
 *
 * Memory-order choices (each use says why it is enough):
 *  - packets are stored and loaded as two 8-byte elements ({data, flag} each)
 *    with relaxed system-scope ordering: an aligned 8-byte element access is
 *    single-copy atomic, so a reader that sees the flag sees the data beside
 *    it, with no fence on either side; a flag publishes nothing else;
 *  - flags that publish other memory (barrier flags, bulk releases, stream
 *    counts, stop words) use release stores and acquire loads at system
 *    scope, so what was written before a flag is visible to whoever reads
 *    it (peers are other GPUs: device scope would not cover them);
 *  - the stream counts one warp hands another in shared memory use release
 *    and acquire at block scope: both sides are in one block;
 *  - the control slot is loaded relaxed at GPU scope: it is written by this
 *    GPU's kernels, by the host (before the work that reads it is enqueued)
 *    and by peers' stop words, which only ever end an op early.
 */
#ifndef TPCOMM_PORTABILITY_CUH
#define TPCOMM_PORTABILITY_CUH

#include <stdint.h>

#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#define TPC_HIP 1
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#endif

#define TPC_DEVICE static __device__ __forceinline__
/* Arithmetic the launch and the kernels share (one statement of a rule). */
#define TPC_HOST_DEVICE static __host__ __device__ __forceinline__
/* Rare paths (recording an error, refusing an op, the epoch wrap): one
 * out-of-line copy, so the hot path of every kernel stays a few hundred
 * instructions and its first run on each SM misses the instruction cache less. */
#define TPC_COLD static __device__ __noinline__
/* Kernel arguments whose address the kernel takes (the rare paths above get
 * a pointer to them) without a copy into local memory. */
#ifdef TPC_HIP
#define TPC_GRID_CONSTANT
#else
#define TPC_GRID_CONSTANT __grid_constant__
#endif

TPC_DEVICE void tpc_store_packet(uint64_t *addr, uint64_t lo, uint64_t hi) {
#ifdef TPC_HIP
  __hip_atomic_store(addr, lo, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  __hip_atomic_store(addr + 1, hi, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(addr), "l"(lo), "l"(hi)
               : "memory");
#endif
}

TPC_DEVICE void tpc_load_packet(const uint64_t *addr, uint64_t *lo, uint64_t *hi) {
#ifdef TPC_HIP
  *lo = __hip_atomic_load(addr, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  *hi = __hip_atomic_load(addr + 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(*lo), "=l"(*hi)
               : "l"(addr)
               : "memory");
#endif
}

TPC_DEVICE void tpc_store_release(uint32_t *addr, uint32_t value) {
#ifdef TPC_HIP
  __hip_atomic_store(addr, value, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
#endif
}

TPC_DEVICE uint32_t tpc_load_acquire(const uint32_t *addr) {
  uint32_t value;
#ifdef TPC_HIP
  value = __hip_atomic_load(addr, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
#endif
  return value;
}

/* 64-bit flags (an epoch and a step count in one word: stream.cuh). */
TPC_DEVICE void tpc_store_release64(uint64_t *addr, uint64_t value) {
#ifdef TPC_HIP
  __hip_atomic_store(addr, value, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
#endif
}

TPC_DEVICE uint64_t tpc_load_acquire64(const uint64_t *addr) {
  uint64_t value;
#ifdef TPC_HIP
  value = __hip_atomic_load(addr, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
#endif
  return value;
}

/* Shared-memory words one warp of a block hands to another (stream.cuh):
 * release and acquire at block scope. */
TPC_DEVICE void tpc_store_release_block(uint32_t *addr, uint32_t value) {
#ifdef TPC_HIP
  __hip_atomic_store(addr, value, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_WORKGROUP);
#else
  asm volatile("st.release.cta.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
#endif
}

TPC_DEVICE uint32_t tpc_load_acquire_block(const uint32_t *addr) {
  uint32_t value;
#ifdef TPC_HIP
  value = __hip_atomic_load(addr, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_WORKGROUP);
#else
  asm volatile("ld.acquire.cta.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
#endif
  return value;
}

/* Words other agents write and this GPU polls: a volatile read, never served
 * from a stale L1 line. */
TPC_DEVICE uint32_t tpc_load_relaxed(const uint32_t *addr) {
  return *(const volatile uint32_t *)addr;
}

/* The 16-byte control slot in one load (see layout.h: alive, epoch, failed,
 * stopped), past the L1: peers, the host and other blocks write it. */
TPC_DEVICE uint4 tpc_load_control(const void *p) {
  uint4 v;
#ifdef TPC_HIP
  const uint32_t *w = (const uint32_t *)p;
  v.x = __hip_atomic_load(w, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
  v.y = __hip_atomic_load(w + 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
  v.z = __hip_atomic_load(w + 2, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
  v.w = __hip_atomic_load(w + 3, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
#endif
  return v;
}

/* 16-byte load of data a peer wrote into our buffer: served from L2 (or, on
 * AMD, from the buffer itself: it is allocated uncached, and the load follows
 * an acquire of the barrier flag, so a plain load sees the peer's data; HIP's
 * uint4 cannot be copied from a volatile one). */
TPC_DEVICE uint4 tpc_load16_from_peer(const void *p) {
#ifdef TPC_HIP
  return *(const uint4 *)p;
#else
  return __ldcg((const uint4 *)p);
#endif
}

/* The same for 8 bytes (a pair of words): the quantized all-reduce's
 * payloads. The PTX spelled out, as clang's CUDA headers may lack __ldcg. */
TPC_DEVICE uint2 tpc_load8_from_peer(const void *p) {
#ifdef TPC_HIP
  return *(const uint2 *)p;
#else
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
#endif
}

TPC_DEVICE uint32_t tpc_load4_from_peer(const void *p) {
#ifdef TPC_HIP
  return *(const uint32_t *)p;
#else
  uint32_t v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

/* Orders this thread's earlier stores (to any GPU) before its later ones. */
TPC_DEVICE void tpc_fence_system(void) {
#ifdef TPC_HIP
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}

/* Programmatic dependent launch (Hopper and later): kernels are launched
 * allowed to start before the previous kernel on the stream has finished, so
 * their launch overlaps its tail. tpc_grid_wait() blocks until that kernel has
 * completed and its writes are visible: called before anything reads memory.
 * tpc_grid_release() lets the next kernel start launching now. No-ops where
 * the hardware lacks it (the launch then behaves as an ordinary one). */
TPC_DEVICE void tpc_grid_wait(void) {
#if !defined(TPC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

TPC_DEVICE void tpc_grid_release(void) {
#if !defined(TPC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Ends the calling thread, as returning from the kernel would, from inside
 * an inlined helper (tpc_packet_prologue's refusal): the compiler then lays
 * out the rest of the kernel as if the refusal were written in it, with no
 * join of the refused path into the kernel's own end. Only for a path every
 * thread of the block takes. HIP: a no-op; the caller returns instead. */
TPC_DEVICE void tpc_thread_exit(void) {
#ifndef TPC_HIP
  asm volatile("exit;" ::: "memory");
  __builtin_unreachable();
#endif
}

/* Orders the memory accesses of a warp's lanes before what each lane does
 * next (CUDA's __syncwarp, a barrier among the warp's lanes). A no-op on
 * HIP: a wavefront's lanes issue each instruction together, and the
 * barrier or release that follows every use waits for all of their
 * accesses. */
TPC_DEVICE void tpc_warp_sync(void) {
#ifndef TPC_HIP
  __syncwarp();
#endif
}

/* Nonzero in every lane of the warp (CUDA) or wavefront (AMD) when v is
 * nonzero in any. */
TPC_DEVICE int tpc_warp_any(int v) {
#ifdef TPC_HIP
  return __any(v);
#else
  return __any_sync(0xffffffffu, v);
#endif
}

/* Nonzero in every lane when v is nonzero in all of them. */
TPC_DEVICE int tpc_warp_all(int v) {
#ifdef TPC_HIP
  return __all(v);
#else
  return __all_sync(0xffffffffu, v);
#endif
}

/* A split block barrier (named barrier 1, every thread of the block): the
 * givers (the control warp) arrive without waiting, the others wait for
 * them. Shared memory the givers wrote before arriving is visible to the
 * waiters. HIP has no split barrier, and AMD's barrier is per wavefront (a
 * 32-thread control "warp" shares its wavefront with data threads), so there
 * every thread meets at one full barrier. */
TPC_DEVICE void tpc_block_handoff(int giver) {
#ifdef TPC_HIP
  (void)giver;
  __syncthreads();
#else
  if (giver)
    asm volatile("bar.arrive 1, %0;" ::"r"(blockDim.x) : "memory");
  else
    asm volatile("bar.sync 1, %0;" ::"r"(blockDim.x) : "memory");
#endif
}

/* Lanes of a warp (CUDA) or wavefront (AMD: 64 on CDNA, 32 on RDNA; HIP's
 * warpSize, which every ROCm version has), and the sum of v over them, the
 * same bits in every lane: a butterfly, so the order of the additions is
 * fixed. */
#ifdef TPC_HIP
#define TPC_WARP_LANES warpSize
#else
#define TPC_WARP_LANES 32
#endif

TPC_DEVICE float tpc_warp_sum(float v) {
  for (int offset = TPC_WARP_LANES / 2; offset > 0; offset /= 2) {
#ifdef TPC_HIP
    v += __shfl_xor(v, offset, TPC_WARP_LANES);
#else
    v += __shfl_xor_sync(0xffffffffu, v, offset);
#endif
  }
  return v;
}

/* a + b rounded once, never fused with the product that made either into an
 * fma: code held to a reference that rounds the product first (the fused
 * norm's o = r + s * scale * w). CUDA's __fadd_rn is an instruction the
 * compiler does not contract; HIP's is a plain `+`, which hipcc's default
 * (-ffp-contract=fast-honor-pragmas) would fuse but for the pragma. */
TPC_DEVICE float tpc_add_rn(float a, float b) {
#ifdef TPC_HIP
#pragma clang fp contract(off)
  return a + b;
#else
  return __fadd_rn(a, b);
#endif
}

/* a * b rounded once, never fused with an add that follows into an fma: the
 * fused norm's z = r + m*s, where the add is tpc_accumulate's plain `+`. */
TPC_DEVICE float tpc_mul_rn(float a, float b) {
#ifdef TPC_HIP
#pragma clang fp contract(off)
  return a * b;
#else
  return __fmul_rn(a, b);
#endif
}

/* v of the lane whose index differs from this one's in the bits of `mask`
 * (within 32 lanes); every lane of the warp takes part. */
TPC_DEVICE float tpc_shfl_xor_float(float v, int mask) {
#ifdef TPC_HIP
  return __shfl_xor(v, mask, TPC_WARP_LANES);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

/* v of lane `src` (0-31) of this lane's 32 (the same half of a 64-lane
 * wavefront); every lane of those 32 takes part. */
TPC_DEVICE float tpc_shfl32_float(float v, int src) {
#ifdef TPC_HIP
  return __shfl(v, src, 32);
#else
  return __shfl_sync(0xffffffffu, v, src);
#endif
}

/* The maximum of v over the 32 lanes of a warp (each half of a 64-lane
 * wavefront apart), the same in each; every lane takes part. One redux
 * instruction from sm_80, a butterfly of shuffles before. */
TPC_DEVICE uint32_t tpc_max32_u32(uint32_t v) {
#if !defined(TPC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint32_t other = __float_as_uint(tpc_shfl_xor_float(__uint_as_float(v), offset));
    v = other > v ? other : v;
  }
  return v;
#endif
}

TPC_DEVICE uint64_t tpc_clock_ns(void) {
#ifdef TPC_HIP
#if defined(__HIP_DEVICE_COMPILE__)
  /* The 100 MHz constant clock of CDNA (wall_clock64() is not declared for
   * the host pass before ROCm 5.6; the builtin is the same counter). */
  return __builtin_amdgcn_s_memrealtime() * 10;
#else
  return 0; /* the host pass of a device function: never runs */
#endif
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

TPC_DEVICE float tpc_half_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }
TPC_DEVICE uint16_t tpc_float_to_half(float f) { return __half_as_ushort(__float2half_rn(f)); }

/* bfloat16 is the top half of a float; rounding to nearest even, NaN stays NaN. */
TPC_DEVICE float tpc_bf16_to_float(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }
TPC_DEVICE uint16_t tpc_float_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Pairs of 16-bit values, one 32-bit word each (the first value in the low
 * half); bf16 selects bfloat16 over fp16. The instructions are sm_80's
 * (cvt to a pair) and sm_90's (bf16 pair add; fp16's is older); the software
 * forms serve ROCm and older GPUs with the same bits. */
#if !defined(TPC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TPC_PAIR_ADD_INSTRUCTIONS 1
#endif
#if !defined(TPC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define TPC_PAIR_CVT_INSTRUCTIONS 1
#endif

TPC_DEVICE float tpc_16_to_float(uint32_t v, int bf16) {
  return bf16 ? tpc_bf16_to_float((uint16_t)v) : tpc_half_to_float((uint16_t)v);
}

/* Two fp32 sums rounded to nearest even, as tpc_float_to_half / _bf16 round
 * them, in one instruction: bfloat16's rounding above takes about six integer
 * instructions a value, enough to make the bulk all_reduce of bf16 slower
 * than the same bytes of fp16. The hardware's NaN is the canonical one. */
TPC_DEVICE uint32_t tpc_pack2(float lo, float hi, int bf16) {
#ifdef TPC_PAIR_CVT_INSTRUCTIONS
  uint32_t w;
  if (bf16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
#else
  const uint32_t l = bf16 ? tpc_float_to_bf16(lo) : tpc_float_to_half(lo);
  const uint32_t h = bf16 ? tpc_float_to_bf16(hi) : tpc_float_to_half(hi);
  return l | h << 16;
#endif
}

/* The pairwise sum of two words, rounded once: exactly what fp32 addition and
 * tpc_pack2 give. Rounding the exact sum twice, to fp32 (24 bits) and then to
 * a format of p <= 11 bits, equals rounding it once whenever 24 >= 2p + 2
 * (Figueroa's theorem on double rounding): fp16 has p = 11, bf16 p = 8. And
 * addition commutes, so both ranks of a pair get the same bits. */
TPC_DEVICE uint32_t tpc_add2(uint32_t a, uint32_t b, int bf16) {
#ifdef TPC_PAIR_ADD_INSTRUCTIONS
  uint32_t w;
  if (bf16) asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(w) : "r"(a), "r"(b));
  else asm("add.rn.f16x2 %0, %1, %2;" : "=r"(w) : "r"(a), "r"(b));
  return w;
#else
  return tpc_pack2(tpc_16_to_float(a, bf16) + tpc_16_to_float(b, bf16),
                   tpc_16_to_float(a >> 16, bf16) + tpc_16_to_float(b >> 16, bf16), bf16);
#endif
}

#endif /* TPCOMM_PORTABILITY_CUH */
