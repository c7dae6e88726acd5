// Few-row float32 matrix products for XLA's CPU backend, as XLA FFI handlers.
//
// Speculative verification multiplies a handful of rows (K + 1 tokens, or a
// tree's nodes) by every weight matrix of the target. At batch 1 those
// products should cost what a one-row product costs: the weights are read
// from memory once either way, and a few more multiply-adds per weight are
// free. The GEMM libraries XLA calls for two or more rows (YNNPACK, Eigen; and
// OpenBLAS for NumPy) first copy ("pack") the weight matrix into a blocked
// layout, which at this size triples the memory traffic: on a 2-core AMD EPYC
// a 4-row product of SmolLM2-135M's 30 MLP matrices took 9-14 ms against 4-5
// ms for one row. The kernels below read the weights where they are, once,
// and keep every partial sum in registers.
//
// specjax_matmul:    y[M, N] = x[M, K] @ w[K, N]    (Dense kernels, [in, out])
// specjax_matmul_nt: y[M, N] = x[M, K] @ w[N, K]^T  (a tied LM head, [V, H])
// specjax_matmul_expert: y[M, N] = x[M, K] @ w[e][K, N]  (one expert of a stack)
//
// XLA's intra-op thread pool and the calling thread claim work from a shared
// counter, so a task never waits for a pool thread that is busy elsewhere.
// specjax_matmul_nt splits the output columns (each a contiguous row of w);
// specjax_matmul splits w's rows, the contraction, where K allows (see
// SplitPlan), and the columns otherwise.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"
#include "parallel_columns.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECJAX_X86 1
#endif

namespace ffi = xla::ffi;
using specjax::ChunkColumns;
using specjax::ParallelColumns;

namespace {

// Rows of w read per register pass of the [K, N] kernel: 8 rows of 16-64
// columns keep 4-8 independent cache-line streams in flight and amortise the
// load and store of the partial sums over 8 multiply-adds each.
constexpr int kBand = 8;

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t m, n, k;
};

// ---------------------------------------------------------------- portable --

// The same loop order as the AVX2 kernels, in plain C++ for other CPUs.
void MatmulColumnsPortable(const Problem& p, int64_t j0, int64_t j1) {
  for (int64_t r = 0; r < p.m; ++r) {
    float* yr = p.y + r * p.n;
    std::fill(yr + j0, yr + j1, 0.0f);
    const float* xr = p.x + r * p.k;
    for (int64_t c = 0; c < p.k; ++c) {
      const float a = xr[c];
      const float* wc = p.w + c * p.n;
      for (int64_t j = j0; j < j1; ++j) yr[j] += a * wc[j];
    }
  }
}

void MatmulNtColumnsPortable(const Problem& p, int64_t j0, int64_t j1) {
  for (int64_t r = 0; r < p.m; ++r) {
    const float* xr = p.x + r * p.k;
    for (int64_t j = j0; j < j1; ++j) {
      const float* wj = p.w + j * p.k;
      float s = 0.0f;
      for (int64_t c = 0; c < p.k; ++c) s += xr[c] * wj[c];
      p.y[r * p.n + j] = s;
    }
  }
}

#ifdef SPECJAX_X86
// ------------------------------------------------------------ AVX2 + FMA ----
#define SPECJAX_AVX2 __attribute__((target("avx2,fma")))

// y[MR rows, NR x 8 columns] += x[MR, BAND] @ w[BAND, NR x 8]. BAND is a
// compile-time constant so that the loop unrolls and GCC keeps every partial
// sum in a register (with a run-time trip count it spilled them each step).
template <int MR, int NR, int BAND>
SPECJAX_AVX2 inline void BandTile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                                  int64_t ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_loadu_ps(y + i * ldy + 8 * r);
#pragma GCC unroll 8
  for (int c = 0; c < BAND; ++c) {
    const float* wc = w + c * ldw;
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm256_loadu_ps(wc + 8 * r);
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + c);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_fmadd_ps(a, wv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(y + i * ldy + 8 * r, acc[i][r]);
}

// Rows [0, m) of one column block, four rows per register tile.
template <int NR, int BAND>
SPECJAX_AVX2 inline void BandRows(const Problem& p, int64_t c0, int64_t j) {
  const float* x = p.x + c0;
  const float* w = p.w + c0 * p.n + j;
  float* y = p.y + j;
  // The next band's rows of this block, one request per cache line: the
  // hardware prefetcher alone leaves the loads waiting on memory.
  if (c0 + 2 * BAND <= p.k) {
    for (int c = 0; c < BAND; ++c)
      for (int r = 0; r < NR; r += 2)
        _mm_prefetch(reinterpret_cast<const char*>(w + (BAND + c) * p.n + 8 * r), _MM_HINT_T0);
  }
  int64_t i = 0;
  for (; i + 4 <= p.m; i += 4) BandTile<4, NR, BAND>(x + i * p.k, p.k, w, p.n, y + i * p.n, p.n);
  switch (p.m - i) {
    case 3: BandTile<3, NR, BAND>(x + i * p.k, p.k, w, p.n, y + i * p.n, p.n); break;
    case 2: BandTile<2, NR, BAND>(x + i * p.k, p.k, w, p.n, y + i * p.n, p.n); break;
    case 1: BandTile<1, NR, BAND>(x + i * p.k, p.k, w, p.n, y + i * p.n, p.n); break;
    default: break;
  }
}

// One band of BAND rows of w over columns [j0, j1).
template <int BAND>
SPECJAX_AVX2 void MatmulBand(const Problem& p, int64_t c0, int64_t j0, int64_t j1) {
  int64_t j = j0;
  if (p.m == 1) {
    for (; j + 64 <= j1; j += 64) BandRows<8, BAND>(p, c0, j);
  } else if (p.m == 2) {
    for (; j + 32 <= j1; j += 32) BandRows<4, BAND>(p, c0, j);
  } else {
    for (; j + 24 <= j1; j += 24) BandRows<3, BAND>(p, c0, j);
  }
  for (; j + 8 <= j1; j += 8) BandRows<1, BAND>(p, c0, j);
}

// Rows [k0, k1) of w over columns [j0, j1), into out ([M, N], its columns
// [j0, j1) zeroed here): a whole product (k0 = 0, k1 = K, out = y) or one
// task of a split contraction (SplitMatmul). One row: 8 vectors of w per band
// row (a 256-byte run); more rows share each loaded vector among up to 4
// rows. Columns past the last multiple of 8 are summed in the same order.
SPECJAX_AVX2 void MatmulBlockAvx2(const Problem& p, int64_t k0, int64_t k1, int64_t j0, int64_t j1, float* out) {
  Problem q = p;
  q.y = out;
  for (int64_t i = 0; i < p.m; ++i) std::fill(out + i * p.n + j0, out + i * p.n + j1, 0.0f);
  const int64_t vector_end = j0 + ((j1 - j0) & ~int64_t{7});
  int64_t c0 = k0;
  for (; c0 + kBand <= k1; c0 += kBand) MatmulBand<kBand>(q, c0, j0, vector_end);
  for (; c0 < k1; ++c0) MatmulBand<1>(q, c0, j0, vector_end);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t c = k0; c < k1; ++c)
      for (int64_t j = vector_end; j < j1; ++j) out[i * p.n + j] += p.x[i * p.k + c] * p.w[c * p.n + j];
}

SPECJAX_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// y[MR rows, NR columns] = x[MR, K] . w[NR rows of K]: dot products along K,
// which is contiguous in both operands.
template <int MR, int NR>
SPECJAX_AVX2 inline void DotTile(const Problem& p, const float* x, const float* w, float* y) {
  const int64_t k8 = p.k & ~int64_t{7};
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k8; c += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) {
      wv[r] = _mm256_loadu_ps(w + r * p.k + c);
      // The next tile's rows: the hardware prefetcher does not start those
      // streams early enough on its own.
      _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * p.k + c), _MM_HINT_T0);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_loadu_ps(x + i * p.k + c);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_fmadd_ps(a, wv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) {
      float s = HorizontalSum(acc[i][r]);
      for (int64_t c = k8; c < p.k; ++c) s += x[i * p.k + c] * w[r * p.k + c];
      y[i * p.n + r] = s;
    }
}

template <int NR>
SPECJAX_AVX2 inline void DotRows(const Problem& p, int64_t j) {
  const float* w = p.w + j * p.k;
  int64_t i = 0;
  for (; i + 3 <= p.m; i += 3) DotTile<3, NR>(p, p.x + i * p.k, w, p.y + i * p.n + j);
  for (; i < p.m; ++i) DotTile<1, NR>(p, p.x + i * p.k, w, p.y + i * p.n + j);
}

SPECJAX_AVX2 void MatmulNtColumnsAvx2(const Problem& p, int64_t j0, int64_t j1) {
  int64_t j = j0;
  if (p.m == 1) {
    for (; j + 8 <= j1; j += 8) DotRows<8>(p, j);
  } else {
    for (; j + 4 <= j1; j += 4) DotRows<4>(p, j);
  }
  for (; j < j1; ++j) DotRows<1>(p, j);
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif  // SPECJAX_X86

void MatmulColumns(const Problem& p, int64_t j0, int64_t j1) {
#ifdef SPECJAX_X86
  if (HasAvx2()) return MatmulBlockAvx2(p, 0, p.k, j0, j1, p.y);
#endif
  MatmulColumnsPortable(p, j0, j1);
}

void MatmulNtColumns(const Problem& p, int64_t j0, int64_t j1) {
#ifdef SPECJAX_X86
  if (HasAvx2()) return MatmulNtColumnsAvx2(p, j0, j1);
#endif
  MatmulNtColumnsPortable(p, j0, j1);
}

#ifdef SPECJAX_X86
// How the threads share y = x @ w: k_parts blocks of w's rows (a multiple of
// kBand each, the last takes the rest) times col_parts chunks of columns.
//
// Splitting the columns alone, each thread reads, for every row of w, only
// its chunk of that row: at SmolLM2-135M's widths 288-768 floats at a stride
// of 576-1536, many short runs that the hardware prefetcher follows badly.
// Splitting the rows gives each thread one contiguous run of w (a band of
// kBand rows is kBand x N consecutive floats) and costs a [M, N] partial sum
// per extra block, added at the end. On a 2-core AMD EPYC VM (AVX-512) the
// 30 chained MLP products at 7 rows took 5.2-6.8 ms against 6.1-7.1 ms
// (paired median 1.06x), and a cached 7-token forward of SmolLM2-135M fell
// from 1.37 to 1.13 one-token forwards, both versions alternating in one
// process (benchmarks/results/2026-11-28-contraction-split-kernel.md).
struct SplitPlan {
  int64_t k_parts, rows_per_part, col_parts, col_chunk;
};

// At least this many rows of w per block: fewer leave a thread too little
// to stream for its partial sums to pay.
constexpr int64_t kMinRowsPerPart = 64;

SplitPlan PlanSplit(const Problem& p, int64_t threads) {
  const int64_t k_parts = std::min(threads, p.k / kMinRowsPerPart);
  if (k_parts < 2) return SplitPlan{1, p.k, 1, p.n};
  const int64_t rows_per_part = ((p.k + k_parts - 1) / k_parts + kBand - 1) / kBand * kBand;
  const int64_t col_parts = std::max<int64_t>(1, std::min((threads + k_parts - 1) / k_parts, p.n / 64));
  const int64_t col_chunk = ((p.n + col_parts - 1) / col_parts + 7) / 8 * 8;
  // Rounding the rows up can leave the last blocks empty: count the blocks that hold rows.
  return SplitPlan{(p.k + rows_per_part - 1) / rows_per_part, rows_per_part,
                   (p.n + col_chunk - 1) / col_chunk, col_chunk};
}

void SplitMatmul(ffi::ThreadPool& pool, const Problem& p, const SplitPlan& plan) {
  const int64_t size = p.m * p.n;
  std::unique_ptr<float[]> partial(new float[(plan.k_parts - 1) * size]);
  const int64_t tasks = plan.k_parts * plan.col_parts;
  ParallelColumns(pool, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kp = t / plan.col_parts, cp = t % plan.col_parts;
      const int64_t k0 = kp * plan.rows_per_part, k1 = std::min(p.k, k0 + plan.rows_per_part);
      const int64_t j0 = cp * plan.col_chunk, j1 = std::min(p.n, j0 + plan.col_chunk);
      MatmulBlockAvx2(p, k0, k1, j0, j1, kp == 0 ? p.y : partial.get() + (kp - 1) * size);
    }
  });
  // Block 0 wrote y itself; add the others' partial sums, columns split among the threads.
  ParallelColumns(pool, p.n, ChunkColumns(p.n, pool.num_threads()), [&](int64_t j0, int64_t j1) {
    for (int64_t kp = 1; kp < plan.k_parts; ++kp) {
      const float* part = partial.get() + (kp - 1) * size;
      for (int64_t i = 0; i < p.m; ++i)
        for (int64_t j = j0; j < j1; ++j) p.y[i * p.n + j] += part[i * p.n + j];
    }
  });
}
#endif  // SPECJAX_X86

ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w,
                       ffi::Result<ffi::Buffer<ffi::F32>>& y, bool transposed, Problem* p) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("specjax matmul: operands must be 2-D");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = transposed ? wd[0] : wd[1];
  const int64_t wk = transposed ? wd[1] : wd[0];
  if (wk != k || yd[0] != m || yd[1] != n)
    return ffi::Error::InvalidArgument("specjax matmul: inconsistent shapes");
  *p = Problem{x.typed_data(), w.typed_data(), y->typed_data(), m, n, k};
  return ffi::Error::Success();
}

// y = x @ w (kTransposed: x @ w^T). Both column kernels zero y first, so an
// empty contraction (K = 0) gives zeros.
template <bool kTransposed>
ffi::Error Run(ffi::ThreadPool& pool, const Problem& p) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
#ifdef SPECJAX_X86
  if (!kTransposed && HasAvx2()) {
    const SplitPlan plan = PlanSplit(p, pool.num_threads());
    if (plan.k_parts > 1) {
      SplitMatmul(pool, p, plan);
      return ffi::Error::Success();
    }
  }
#endif
  ParallelColumns(pool, p.n, ChunkColumns(p.n, pool.num_threads()), [&p](int64_t j0, int64_t j1) {
    if (kTransposed) {
      MatmulNtColumns(p, j0, j1);
    } else {
      MatmulColumns(p, j0, j1);
    }
  });
  return ffi::Error::Success();
}

template <bool kTransposed>
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p;
  if (auto err = CheckShapes(x, w, y, kTransposed, &p); !err.success()) return err;
  return Run<kTransposed>(pool, p);
}

// y = x @ w[e]: one expert's [K, N] matrix of a stack w[E, K, N], read where
// it lies. The same product through a dynamic index would first copy the
// expert's matrix out of the stack, a copy as large as the read itself, for
// every routed expert of every token (a mixture of experts' decode step).
// The index is clamped into the stack, as XLA clamps a dynamic index.
ffi::Error ExpertMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::Buffer<ffi::S32> index, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || index.element_count() != 1)
    return ffi::Error::InvalidArgument("specjax expert matmul: x[M, K], w[E, K, N] and a scalar index");
  const int64_t m = xd[0], k = xd[1], experts = wd[0], n = wd[2];
  if (wd[1] != k || yd[0] != m || yd[1] != n || experts == 0)
    return ffi::Error::InvalidArgument("specjax expert matmul: inconsistent shapes");
  const int64_t e = std::clamp<int64_t>(index.typed_data()[0], 0, experts - 1);
  return Run<false>(pool, Problem{x.typed_data(), w.typed_data() + e * k * n, y->typed_data(), m, n, k});
}

}  // namespace

// Both handlers: XLA's intra-op thread pool, x, w -> y.
#define SPECJAX_MATMUL_BINDING                                                                 \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Ret< \
      ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmul, MatmulImpl<false>, SPECJAX_MATMUL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulNt, MatmulImpl<true>, SPECJAX_MATMUL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulExpert, ExpertMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
