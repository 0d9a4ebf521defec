/* The standalone probes' error check: a failed CUDA call prints where and
 * why, and the probe exits. */
#ifndef TPCOMM_PROBE_CHECK_H
#define TPCOMM_PROBE_CHECK_H

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

#endif /* TPCOMM_PROBE_CHECK_H */
