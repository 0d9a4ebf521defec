/*
 * Included first when clang (TPCOMM_CUDA_CLANG) compiles the kernels: the two
 * things nvcc has that clang's CUDA support lacks, given the same meaning.
 *  - __grid_constant__: clang has no such attribute and warns on it. Without
 *    it, a kernel that takes a parameter's address gets a local copy of it:
 *    the same values, on the rare paths that take addresses.
 *  - __ldcg(const uint4 *): clang's CUDA headers have no 16-byte overload.
 *    This is the same PTX load (ld.global.cg: cached in L2, not L1). The asm
 *    is volatile with a memory clobber, so the compiler cannot move it above
 *    the acquire load of the flag that guards the data it reads.
 */
#ifndef TPCOMM_COMPAT_CLANG_CUDA_H
#define TPCOMM_COMPAT_CLANG_CUDA_H
#if defined(__clang__) && defined(__CUDA__)
#include <cuda_runtime.h>

#undef __grid_constant__
#define __grid_constant__

static __device__ __forceinline__ uint4 __ldcg(const uint4 *p) {
  uint4 r;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p)
               : "memory");
  return r;
}
#endif
#endif
