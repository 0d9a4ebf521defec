/*
 * The FP8 epilogue's local cost on one GPU: the fused
 * all-reduce + add + RMSNorm kernel (launch.cu's tpc_launch_all_reduce_norm,
 * ADD_NORM, bf16) without an epilogue and with each (per_tensor, per_token,
 * per_token_group), at 8, 32 and 256 tokens of 4096 and 8192 values (the
 * row widths of 2 and 4 units a data thread; others on the command line).
 *
 * One process drives every rank (probe_ranks.h): graphs replayed together,
 * so no rank waits out another's replay skew. The kernel's rules
 * (csrc/core/limits.c, linked in) take two ranks or more, so the default is
 * two ranks on GPU 0: a time is both ranks' kernels side by side on the one
 * GPU, each grid capped at a quarter of the multiprocessors (probe_ranks.h:
 * 1 / (2 x ranks sharing a GPU), so that every rank's kernel and the next
 * one, started early, are resident at once), their pushes
 * landing in the same GPU's memory. It is the local work of a pair, not the
 * time of a rank with a GPU of its own.
 *
 * Checked, every rank (after the timed graphs, on their last op's outputs):
 * the stream output z = round(sum in rank order + residual) bit for bit and
 * the normed output within a bf16 rounding of a double-precision norm, both
 * computed on the host; the same bits on every rank; with an epilogue, a
 * second run that also writes the 16-bit normed output gives the timed run's
 * codes, that normed output is the no-epilogue kernel's bit for bit, and the
 * codes and scales are the host's e4m3 of it (tpcomm.fp8's math, quant.cuh's
 * software encoder). Any mismatch exits 1.
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/norm_fp8_probe.cu csrc/core/limits.c -o build/norm_fp8_probe
 *   (the same with -shared -Xcompiler -fPIC -DNORM_FP8_PROBE_LIBRARY -o build/libnorm_fp8_probe.so:
 *   the library benchmarks/norm_fp8_probe.py drives)
 *   build/norm_fp8_probe [ranks [hidden ...]]   (default 2 ranks, every rank on GPU 0 where there is
 *                                    one GPU; hidden 4096 8192; 16384 takes the 8-unit kernel)
 *   build/norm_fp8_probe list       the rows, without a GPU
 *
 * Phase build (-DNORM_FP8_PROBE_PHASES, the same sources): where a row's
 * time goes, not how long a call takes. The kernel's marks (TPC_NORM_MARK,
 * all_reduce_norm.cuh) clock block 0's first row on each rank, thread 0,
 * in SM cycles from the kernel's start: 0 past the prologue, 1 the row's
 * sum exchanged, 2 the norm's scale, 3 the outputs written, 4 the codes
 * written, 5 the last row done, 6 the op ended. It prints, per shape and
 * epilogue, each mark's mean over PROBE_OPS untimed calls of every rank,
 * after the timed build's checks of that shape.
 *
 * Output: a header, then one row per shape and epilogue:
 *   tokens hidden epilogue us
 */
#include <cmath>
#include <string>

#ifdef NORM_FP8_PROBE_PHASES
#define NFP_MARKS 7
__device__ unsigned long long nfp_cycles[8][NFP_MARKS]; /* [rank][mark]: summed over calls */
__device__ unsigned nfp_calls[8];
/* thread 0 of block 0 only; atomics: a call's next may start before it ends */
#define TPC_NORM_MARK_START const long long nfp_t0 = clock64()
#define TPC_NORM_MARK(phase, first_row)                                                       \
  do {                                                                                         \
    if (blockIdx.x == 0 && threadIdx.x == 0 && (first_row)) {                                  \
      atomicAdd(&nfp_cycles[a.rank][phase], (unsigned long long)(clock64() - nfp_t0));         \
      if ((phase) == 0) atomicAdd(&nfp_calls[a.rank], 1u);                                     \
    }                                                                                          \
  } while (0)
#endif
#include "probe_ranks.h"

static const int QUANTS[] = {TPC_QUANT_NONE, TPC_QUANT_PER_TENSOR, TPC_QUANT_PER_TOKEN, TPC_QUANT_PER_TOKEN_GROUP};
static const char *const QUANT_NAMES[] = {"none", "per_tensor", "per_token", "per_token_group"};
static const float EPS = 1e-5f;
static const float PER_TENSOR_SCALE = 0.02f; /* benchmarks/norm_fp8_local.py's */
/* tpcomm.fp8.DEFAULT_FLOOR's values (vLLM's per-token floor; DeepSeek's 1e-10 / 448 per group) */
static const float FLOOR_PER_TOKEN = 1.0f / (448.0f * 512.0f);
static const float FLOOR_PER_TOKEN_GROUP = 1e-10f / 448.0f;

static const int MAX_TOKENS = 256;
/* The row widths timed; the buffers hold MAX_TOKENS rows of the widest. */
static std::vector<int> shape_hidden = {4096, 8192};
static int max_hidden() {
  int m = 0;
  for (int h : shape_hidden) m = h > m ? h : m;
  return m;
}
static size_t max_bytes() { return (size_t)MAX_TOKENS * max_hidden() * 2; } /* the largest shape's input per rank */

/* The fused norm's buffers of a rank beside probe_ranks.h's (its in is the kernel's input). */
struct NormBufs {
  char *residual, *weight, *stream_out, *normed, *codes;
  float *scales, *tensor_scale;
};
static NormBufs norm_bufs[TPC_MAX_RANKS];

/* Host copies of what every rank reads: inputs per rank, the residual and
 * weight all ranks share (so every rank computes the same bits). */
static std::vector<uint16_t> host_in[TPC_MAX_RANKS], host_residual, host_weight;

static float bf16_value(uint16_t b) { return tpc_float_of((uint32_t)b << 16); }

/* Round to nearest even (no NaN occurs here). */
static uint16_t bf16_of(float f) {
  uint32_t u = tpc_bits_of(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* A value in [lo, hi) from i and a seed (the same on every run). */
static float hashed(uint32_t i, uint32_t seed, float lo, float hi) {
  uint32_t h = (i + 0x9e3779b9u * (seed + 1)) * 2654435761u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return lo + (hi - lo) * (float)(h & 0xffffu) / 65536.0f;
}

static void open_norm_buffers() {
  const size_t values = max_bytes() / 2;
  host_residual.resize(values);
  host_weight.resize(max_hidden());
  for (size_t i = 0; i < values; ++i) host_residual[i] = bf16_of(hashed((uint32_t)i, 100, -1.0f, 1.0f));
  for (size_t i = 0; i < host_weight.size(); ++i) host_weight[i] = bf16_of(hashed((uint32_t)i, 101, 0.5f, 1.5f));
  for (int r = 0; r < world; ++r) {
    host_in[r].resize(values);
    for (size_t i = 0; i < values; ++i) host_in[r][i] = bf16_of(hashed((uint32_t)i, (uint32_t)r, -2.0f, 2.0f));
    CHECK(cudaSetDevice(device_of(r)));
    NormBufs &b = norm_bufs[r];
    CHECK(cudaMalloc(&b.residual, max_bytes()));
    CHECK(cudaMalloc(&b.weight, host_weight.size() * 2));
    CHECK(cudaMalloc(&b.stream_out, max_bytes()));
    CHECK(cudaMalloc(&b.normed, max_bytes()));
    CHECK(cudaMalloc(&b.codes, max_bytes() / 2));
    CHECK(cudaMalloc(&b.scales, values / TPC_FP8_GROUP * sizeof(float)));
    CHECK(cudaMalloc(&b.tensor_scale, sizeof(float)));
    CHECK(cudaMemcpy(ranks[r].in, host_in[r].data(), max_bytes(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b.residual, host_residual.data(), max_bytes(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b.weight, host_weight.data(), host_weight.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b.tensor_scale, &PER_TENSOR_SCALE, sizeof(float), cudaMemcpyHostToDevice));
  }
}

static size_t groups_of(int quant, int hidden) {
  return quant == TPC_QUANT_PER_TOKEN_GROUP ? (size_t)hidden / TPC_FP8_GROUP : 1;
}

static float floor_of(int quant) {
  return quant == TPC_QUANT_PER_TOKEN ? FLOOR_PER_TOKEN : quant == TPC_QUANT_PER_TOKEN_GROUP ? FLOOR_PER_TOKEN_GROUP : 0.0f;
}

/* The fused norm's fields of rank r's arguments, as ops.c's
 * tpc_all_reduce_norm_quant fills them: ADD_NORM, bf16, weight w, row-major
 * scales; with_normed: the epilogue also writes the 16-bit normed output. */
static void set_norm(int r, int tokens, int hidden, int quant, bool with_normed) {
  tpc_kernel_args &a = ranks[r].args;
  const NormBufs &b = norm_bufs[r];
  const bool quantizing = quant != TPC_QUANT_NONE;
  a.nbytes = (uint64_t)tokens * hidden * 2;
  a.row_bytes = (uint64_t)hidden * 2;
  a.out_bytes = quantizing ? a.nbytes / 2 : a.nbytes;
  a.op = TPC_OP_ALL_REDUCE_NORM;
  a.kind = tpc_kind_word(TPC_KIND_NORM_QUANT_OP(TPC_OP_ALL_REDUCE_NORM, TPC_PATTERN_ADD_NORM, quant), TPC_ALGO_PACKET,
                         TPC_BFLOAT16, a.row_bytes);
  a.poison = quantizing ? TPC_E4M3_NAN_BYTES : 0x7fc07fc07fc07fc0ull;
  a.poison2 = 0x7fc07fc07fc07fc0ull;
  a.residual = b.residual;
  a.weight = b.weight;
  a.out2 = b.stream_out;
  a.eps = EPS;
  a.pattern = TPC_PATTERN_ADD_NORM;
  a.weight_offset = -0.0f; /* weight w: ops.c's offset 0 */
  a.residual_scale = 1.0f;
  a.bias = a.next_bias = nullptr;
  a.quant = quant;
  a.out = quantizing ? (void *)b.codes : (void *)b.normed;
  a.out3 = quantizing && with_normed ? b.normed : nullptr;
  a.scales = quant == TPC_QUANT_PER_TENSOR ? b.tensor_scale : b.scales;
  a.scale_row_stride = groups_of(quant, hidden);
  a.scale_group_stride = quant == TPC_QUANT_PER_TOKEN_GROUP ? 1 : 0;
  a.scale_floor = floor_of(quant);
}

/* limits.c's answer for this call: exits naming the rule where the kernel declines it. */
static void check_rules(int tokens, int hidden, int quant) {
  tpc_kernel_limits limits;
  char why[256] = "";
  const size_t nbytes = (size_t)tokens * hidden * 2;
  const void *const ptrs[] = {ranks[0].in, norm_bufs[0].residual, norm_bufs[0].weight, norm_bufs[0].codes,
                              norm_bufs[0].stream_out, norm_bufs[0].normed};
  tpc_result r = tpc_kernel_limits_of(TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, world, max_bytes(), max_bytes(),
                                      TPC_PLATFORM_CUDA, &limits);
  if (r == TPC_OK)
    r = tpc_kernel_check(&limits, TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, TPC_BFLOAT16, nbytes, (size_t)hidden * 2,
                         ptrs, 6, why, sizeof why);
  if (r == TPC_OK)
    r = tpc_norm_quant_check(quant, (size_t)hidden, groups_of(quant, hidden), 1, quant ? floor_of(quant) : 0.0f, 0,
                             why, sizeof why);
  if (r != TPC_OK) {
    fprintf(stderr, "%d x %d, %s: the kernel's rules decline it (result %d): %s\n", tokens, hidden,
            QUANT_NAMES[quant], (int)r, why);
    exit(1);
  }
}

template <typename T>
static std::vector<T> fetch(int r, const void *dev, size_t count) {
  std::vector<T> host(count);
  if (!count) return host;
  CHECK(cudaSetDevice(device_of(r)));
  CHECK(cudaMemcpy(host.data(), dev, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

[[noreturn]] static void mismatch(const char *what, int tokens, int hidden, int quant, int r, size_t i, double got,
                                  double want) {
  fprintf(stderr, "%d x %d, %s: rank %d %s [%zu] is %.9g, not %.9g\n", tokens, hidden, QUANT_NAMES[quant], r, what, i,
          got, want);
  exit(1);
}

/* The no-epilogue run's outputs against the host: z bit for bit, the normed
 * output within a bf16 rounding (2^-8 relative, 1 % more for the fp32 steps)
 * of the norm in double; every rank's normed output rank 0's bits. Returns
 * rank 0's normed output. */
static std::vector<uint16_t> check_plain(int tokens, int hidden) {
  const size_t n = (size_t)tokens * hidden;
  std::vector<uint16_t> normed0;
  for (int r = 0; r < world; ++r) {
    const std::vector<uint16_t> z = fetch<uint16_t>(r, norm_bufs[r].stream_out, n),
                                normed = fetch<uint16_t>(r, norm_bufs[r].normed, n);
    for (int row = 0; row < tokens; ++row) {
      std::vector<float> zf(hidden);
      double squares = 0;
      for (int c = 0; c < hidden; ++c) {
        const size_t i = (size_t)row * hidden + c;
        float s = -0.0f; /* the sum in rank order, fp32, as the kernel adds */
        for (int q = 0; q < world; ++q) s += bf16_value(host_in[q][i]);
        zf[c] = s + bf16_value(host_residual[i]);
        if (z[i] != bf16_of(zf[c])) mismatch("stream output", tokens, hidden, 0, r, i, bf16_value(z[i]), zf[c]);
        squares += (double)zf[c] * zf[c];
      }
      const double scale = 1.0 / std::sqrt(squares / hidden + EPS);
      for (int c = 0; c < hidden; ++c) {
        const size_t i = (size_t)row * hidden + c;
        const double want = zf[c] * scale * bf16_value(host_weight[c]), got = bf16_value(normed[i]);
        if (!(std::fabs(got - want) <= std::fabs(want) * (1.0 / 256) * 1.01 + 1e-30))
          mismatch("normed output", tokens, hidden, 0, r, i, got, want);
      }
    }
    if (r == 0) normed0 = normed;
    else if (normed != normed0) mismatch("normed output (not rank 0's)", tokens, hidden, 0, r, 0, 0, 0);
  }
  return normed0;
}

/* e4m3 of x / s as tpcomm.fp8 defines it (the kernel's inputs hold no NaN). */
static uint8_t e4m3_code(float x, float s) { return (uint8_t)tpc_e4m3_sat_of(x / s); }

/* The epilogue's run: the timed codes (normed not written) against a run that
 * writes normed too, that normed output against the no-epilogue kernel's,
 * the codes and scales against the host's quantization of it; every rank's
 * codes and scales rank 0's. */
static void check_epilogue(int tokens, int hidden, int quant, const std::vector<uint16_t> &plain_normed,
                           const Launcher &launch) {
  const size_t n = (size_t)tokens * hidden, groups = groups_of(quant, hidden);
  const size_t nscales = quant == TPC_QUANT_PER_TENSOR ? 0 : (size_t)tokens * groups;
  std::vector<std::vector<uint8_t>> timed(world);
  for (int r = 0; r < world; ++r) timed[r] = fetch<uint8_t>(r, norm_bufs[r].codes, n);
  for (int r = 0; r < world; ++r) set_norm(r, tokens, hidden, quant, true);
  run_untimed(launch);
  const size_t group_values = quant == TPC_QUANT_PER_TOKEN_GROUP ? TPC_FP8_GROUP : (size_t)hidden;
  std::vector<uint8_t> codes0;
  std::vector<float> scales0;
  for (int r = 0; r < world; ++r) {
    const std::vector<uint8_t> codes = fetch<uint8_t>(r, norm_bufs[r].codes, n);
    const std::vector<float> scales = fetch<float>(r, norm_bufs[r].scales, nscales);
    const std::vector<uint16_t> normed = fetch<uint16_t>(r, norm_bufs[r].normed, n);
    for (size_t i = 0; i < n; ++i) {
      if (codes[i] != timed[r][i]) mismatch("code (without the normed output)", tokens, hidden, quant, r, i, timed[r][i], codes[i]);
      if (normed[i] != plain_normed[i])
        mismatch("normed output (not the plain kernel's)", tokens, hidden, quant, r, i, bf16_value(normed[i]),
                 bf16_value(plain_normed[i]));
    }
    for (size_t g = 0; g < n / group_values; ++g) { /* a row (PER_TENSOR, PER_TOKEN) or a group of one */
      const size_t first = g * group_values;
      float s = PER_TENSOR_SCALE;
      if (quant != TPC_QUANT_PER_TENSOR) {
        float amax = 0.0f;
        for (size_t i = first; i < first + group_values; ++i) amax = std::fmax(amax, std::fabs(bf16_value(normed[i])));
        s = amax / 448.0f;
        if (s < floor_of(quant)) s = floor_of(quant);
        if (tpc_bits_of(scales[g]) != tpc_bits_of(s)) mismatch("scale", tokens, hidden, quant, r, g, scales[g], s);
      }
      for (size_t i = first; i < first + group_values; ++i) {
        const uint8_t want = e4m3_code(bf16_value(normed[i]), s);
        if (codes[i] != want) mismatch("code", tokens, hidden, quant, r, i, codes[i], want);
      }
    }
    if (r == 0) codes0 = codes, scales0 = scales;
    else if (codes != codes0 || scales != scales0)
      mismatch("codes or scales (not rank 0's)", tokens, hidden, quant, r, 0, 0, 0);
  }
}

static void launch_rank(int r) {
  CHECK((cudaError_t)tpc_launch_all_reduce_norm(&ranks[r].args, ranks[r].stream));
}

/* One shape's kernels, the one without an epilogue first (the others'
 * normed output is checked against its), each on every rank, then checked;
 * timed: by time_us, the µs into us[quant]; else once, by run_untimed. */
static void run_shape(int tokens, int hidden, bool timed, double *us) {
  std::vector<uint16_t> plain_normed;
  for (int quant : QUANTS) {
    check_rules(tokens, hidden, quant);
    for (int r = 0; r < world; ++r) set_norm(r, tokens, hidden, quant, false);
    if (timed) us[quant] = time_us(launch_rank);
    else run_untimed(launch_rank);
    if (quant == TPC_QUANT_NONE) plain_normed = check_plain(tokens, hidden);
    else check_epilogue(tokens, hidden, quant, plain_normed, launch_rank);
  }
}

/* Whether the kernel's rules (limits.c) take n ranks at all. */
static bool rules_take(int n) {
  tpc_kernel_limits limits;
  return tpc_kernel_limits_of(TPC_OP_ALL_REDUCE_NORM, TPC_ALGO_PACKET, n, max_bytes(), max_bytes(), TPC_PLATFORM_CUDA,
                              &limits) == TPC_OK &&
         limits.refused == TPC_KERNEL_TAKES;
}

#ifdef NORM_FP8_PROBE_LIBRARY
/* The same ranks and kernels for benchmarks/norm_fp8_probe.py (ctypes),
 * which times them in one CUDA graph with torch's quantization kernel. Built
 * with -shared -Xcompiler -fPIC -DNORM_FP8_PROBE_LIBRARY; a failed CUDA call
 * exits the process (probe_check.h). */

/* Opens n ranks on the GPUs present (GPU 0 alone: every rank on it); 2 where the rules refuse n. */
extern "C" int nfp_open(int n) {
  if (!rules_take(n)) return 2;
  timing_shared = true;
  open_ranks(n, max_bytes(), false);
  open_norm_buffers();
  return 0;
}

/* Every rank's arguments for the shape and epilogue (checked against the
 * rules, as the probe's rows are); normed[r]: rank r's normed output where
 * quant is NONE (the caller's tensor, which its quantization kernel reads),
 * or NULL for the probe's own buffer. */
extern "C" void nfp_set(int tokens, int hidden, int quant, void *const *normed) {
  check_rules(tokens, hidden, quant);
  for (int r = 0; r < world; ++r) {
    set_norm(r, tokens, hidden, quant, false);
    if (normed && quant == TPC_QUANT_NONE) ranks[r].args.out = normed[r];
  }
}

/* run_shape untimed: every check of the probe's rows at this shape (exits on a mismatch). */
extern "C" void nfp_check_shape(int tokens, int hidden) { run_shape(tokens, hidden, false, nullptr); }

/* Rank r's kernel on `stream` (a cudaStream_t of the caller's): the launch's result, 0 or a cudaError_t. */
extern "C" int nfp_launch(int r, void *stream) { return tpc_launch_all_reduce_norm(&ranks[r].args, stream); }

/* 0, or exits naming the first rank whose kernels recorded an error (call outside a capture). */
extern "C" int nfp_check_errors(void) {
  for (int r = 0; r < world; ++r) exit_on_recorded_error(r);
  return 0;
}
#else
static const int SHAPE_TOKENS[] = {8, 32, MAX_TOKENS};

#ifdef NORM_FP8_PROBE_PHASES
/* The phase build's output (the header comment): every shape and epilogue,
 * each rank's mean cycles to each mark. */
static void print_phases() {
  static_assert(TPC_MAX_RANKS <= 8, "nfp_cycles holds 8 ranks");
  printf("phase build: SM cycles from the kernel's start to each mark, block 0's first row, mean over calls\n");
  printf("tokens hidden epilogue rank calls m0 m1 m2 m3 m4 m5 m6\n");
  for (int tokens : SHAPE_TOKENS)
    for (int hidden : shape_hidden) {
      run_shape(tokens, hidden, false, nullptr); /* the timed build's checks, and a warm-up */
      for (int quant : QUANTS) {
        for (int r = 0; r < world; ++r) set_norm(r, tokens, hidden, quant, false);
        static const unsigned long long zero_cycles[8][NFP_MARKS] = {};
        static const unsigned zero_calls[8] = {};
        CHECK(cudaMemcpyToSymbol(nfp_cycles, zero_cycles, sizeof zero_cycles));
        CHECK(cudaMemcpyToSymbol(nfp_calls, zero_calls, sizeof zero_calls));
        run_untimed(launch_rank);
        unsigned long long cycles[8][NFP_MARKS];
        unsigned calls[8];
        CHECK(cudaMemcpyFromSymbol(cycles, nfp_cycles, sizeof cycles));
        CHECK(cudaMemcpyFromSymbol(calls, nfp_calls, sizeof calls));
        for (int r = 0; r < world; ++r) {
          printf("%d %d %s %d %u", tokens, hidden, QUANT_NAMES[quant], r, calls[r]);
          for (int m = 0; m < NFP_MARKS; ++m) printf(" %.0f", calls[r] ? (double)cycles[r][m] / calls[r] : 0.0);
          printf("\n");
        }
        fflush(stdout);
      }
    }
}
#endif

int main(int argc, char **argv) {
  listing = argc > 1 && !strcmp(argv[1], "list");
  const int n = !listing && argc > 1 ? atoi(argv[1]) : 2;
  if (listing) {
    for (int tokens : SHAPE_TOKENS)
      for (int hidden : shape_hidden)
        for (int quant : QUANTS) printf("%d %d %s\n", tokens, hidden, QUANT_NAMES[quant]);
    return 0;
  }
  if (argc > 2) shape_hidden.clear();
  for (int i = 2; i < argc; ++i) {
    const int hidden = atoi(argv[i]);
    if (hidden <= 0 || hidden % TPC_FP8_GROUP) {
      fprintf(stderr, "usage: norm_fp8_probe [list | ranks [hidden ...]]: hidden %s is not a positive multiple of %d\n",
              argv[i], TPC_FP8_GROUP);
      return 2;
    }
    shape_hidden.push_back(hidden);
  }
  if (!rules_take(n)) {
    fprintf(stderr,
            "usage: norm_fp8_probe [list | ranks [hidden ...]]: the fused norm kernel takes 2..%d ranks (limits.c), "
            "not %d\n",
            TPC_MAX_RANKS, n);
    return 2;
  }
  timing_shared = true;
  open_ranks(n, max_bytes(), false);
  printf("norm_fp8_probe: ADD_NORM bf16, eps %g, weight w, each rank's grid at most %d blocks\n", (double)EPS,
         ranks[0].args.max_blocks);
  open_norm_buffers();
#ifdef NORM_FP8_PROBE_PHASES
  print_phases();
  return 0;
#else
  printf("tokens hidden epilogue us\n");
  for (int tokens : SHAPE_TOKENS)
    for (int hidden : shape_hidden) {
      double us[4];
      run_shape(tokens, hidden, true, us);
      for (int quant : QUANTS) printf("%d %d %s %.3f\n", tokens, hidden, QUANT_NAMES[quant], us[quant]);
      fflush(stdout);
    }
  printf("check: every output as computed on the host\n");
  return 0;
#endif
}
#endif /* NORM_FP8_PROBE_LIBRARY */
