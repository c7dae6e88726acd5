// Few-row products with quantized weights for XLA's CPU backend, as XLA FFI
// handlers.
//
// Decoding at batch 1 reads every weight once per step, so its speed is set by
// the bytes a weight takes: 4 for float32, 1 for int8, 5/8 for 4 bits with a
// float16 scale and minimum per 32. These kernels read the quantized weights
// in place and dequantize them in registers, exactly (q * scale [+ min] in
// float32, the value the XLA reference dequantizes to), then multiply-add
// them with the float32 activations. Keeping the activations in float32 costs
// a few instructions per weight where llama.cpp quantizes them to 8 bits, but
// it keeps the result the float product of the dequantized weights: the
// quantized model is one model, whatever kernel or platform computes it.
//
// Both weight layouts are [N, K], one output per row, contiguous along the
// input (the layout of GGUF files), with one scale (and minimum) per group of
// G inputs, G = K for per-channel int8:
//
// specjax_qmatmul_i8: y[M, N] = x[M, K] @ (q[N, K] * d[N, K/G])^T,  q int8
// specjax_qmatmul_q4: y[M, N] = x[M, K] @ (q[N, K/2] * d + m)^T,    q 4 bits
//
// The 4-bit layout is GGUF's Q4_1 (Q4_0 with m = -8 d): each block of 32
// inputs is 16 bytes, byte i holding input i in its low nibble and input
// i + 16 in its high nibble.
//
// Activations stay float32 where llama.cpp rounds them to int8 per 32 inputs
// for integer dot products (AVX-512 VNNI). That route was built and measured
// here: on SmolLM2-135M it left target-only decoding as fast (the kernels are
// not all of a step) and broke speculative decoding's exactness (0 of 6
// prompts equal to target-only greedy output, against 6 of 6): rounding turns
// the last-bit differences between a 1-token and a (K+1)-token program into
// whole grid steps, which flip near-ties.
//
// Every output element is summed in one order (vector lanes along K, group by
// group, then the lanes), whatever the number of rows or the tile that
// computes it, so a row's logits do not depend on the rows it is batched with.
// The processor is asked once what it has: AVX-512 (F, BW), else AVX2 with
// FMA and F16C, else portable C++.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_columns.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECJAX_X86 1
#endif

namespace ffi = xla::ffi;

namespace {

struct QProblem {
  const float* x;     // [m, k]
  const uint8_t* q;   // [n, row_bytes]
  const uint16_t* d;  // [n, groups], float16
  const uint16_t* mn;  // [n, groups], float16 (4-bit only)
  float* y;           // [m, n]
  int64_t m, n, k, groups, group, row_bytes;
};

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---------------------------------------------------------------- portable --

void Int8ColumnsPortable(const QProblem& p, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p.q + j * p.row_bytes);
    for (int64_t i = 0; i < p.m; ++i) {
      const float* x = p.x + i * p.k;
      float s = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g) {
        const float d = HalfToFloat(p.d[j * p.groups + g]);
        for (int64_t c = g * p.group; c < (g + 1) * p.group; ++c) s += x[c] * (static_cast<float>(q[c]) * d);
      }
      p.y[i * p.n + j] = s;
    }
  }
}

void Q4ColumnsPortable(const QProblem& p, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* q = p.q + j * p.row_bytes;
    for (int64_t i = 0; i < p.m; ++i) {
      const float* x = p.x + i * p.k;
      float s = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g) {
        const float d = HalfToFloat(p.d[j * p.groups + g]);
        const float mn = HalfToFloat(p.mn[j * p.groups + g]);
        for (int64_t b = g * p.group; b < (g + 1) * p.group; b += 32) {
          const uint8_t* block = q + b / 2;
          for (int c = 0; c < 16; ++c) s += x[b + c] * (static_cast<float>(block[c] & 0xf) * d + mn);
          for (int c = 0; c < 16; ++c) s += x[b + 16 + c] * (static_cast<float>(block[c] >> 4) * d + mn);
        }
      }
      p.y[i * p.n + j] = s;
    }
  }
}

#ifdef SPECJAX_X86
// ---------------------------------------------------------- vector kernels --
//
// cpu_qmatmul_body.inc holds one body for both instruction sets; it is
// compiled twice, each time for its own target (a template takes the target
// of the region it is defined in), with `Ops` giving the vector type, its
// width W and how a chunk of weights becomes W-wide float vectors.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
struct Ops {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRegisters = 32;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Set(float v) { return _mm512_set1_ps(v); }
  static V Load(const float* x) { return _mm512_loadu_ps(x); }
  static void Store(float* out, V v) { _mm512_storeu_ps(out, v); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static float Sum(V v) { return _mm512_reduce_add_ps(v); }
  // 16 int8 weights.
  static void Int8(const int8_t* q, V* out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  }
  // One 32-input block's weights q * d + m: inputs 0-15 (low nibbles), 16-31
  // (high ones). The group's 16 possible values fill one vector, computed
  // by the same fma as one weight, so each weight is a lane of it: two
  // permutations where converting the nibbles took six instructions.
  // vpermps reads an index's low 4 bits only: the low nibble needs no mask.
  static void Q4Block(const uint8_t* block, V d, V m, V* out) {
    const V table = _mm512_fmadd_ps(_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), d, m);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    out[0] = _mm512_permutexvar_ps(bytes, table);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
};
#include "cpu_qmatmul_body.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct Ops {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRegisters = 16;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Set(float v) { return _mm256_set1_ps(v); }
  static V Load(const float* x) { return _mm256_loadu_ps(x); }
  static void Store(float* out, V v) { _mm256_storeu_ps(out, v); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static float Sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
  }
  // 8 int8 weights.
  static void Int8(const int8_t* q, V* out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  }
  // One 32-input block's weights q * d + m as four vectors, in input order;
  // each half of the bytes is widened once, then split.
  static void Q4Block(const uint8_t* block, V d, V m, V* out) {
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8)));
    out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
    out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
    out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
    for (int v = 0; v < 4; ++v) out[v] = _mm256_fmadd_ps(out[v], d, m);
  }
};
#include "cpu_qmatmul_body.inc"
}  // namespace avx2
#pragma GCC pop_options

enum class Isa { kPortable, kAvx2, kAvx512 };

// The widest instruction set the processor reports, or a narrower one named
// by $SPECJAX_CPU_ISA (portable, avx2, avx512), which the tests use to run
// every path on one machine.
Isa DetectIsa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    Isa best = Isa::kPortable;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c"))
      best = Isa::kAvx512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      best = Isa::kAvx2;
    const char* asked = std::getenv("SPECJAX_CPU_ISA");
    if (asked == nullptr) return best;
    const std::string name(asked);
    const Isa wanted = name == "avx512" ? Isa::kAvx512 : name == "avx2" ? Isa::kAvx2 : Isa::kPortable;
    return std::min(wanted, best);
  }();
  return isa;
}
#endif  // SPECJAX_X86

using ColumnsFn = void (*)(const QProblem&, int64_t, int64_t);

// The column kernel for this processor. An int8 group must be a whole number
// of vectors for the vector kernels (the handler checks 16).
ColumnsFn PickColumns(bool q4) {
#ifdef SPECJAX_X86
  switch (DetectIsa()) {
    case Isa::kAvx512: return q4 ? avx512::Q4Columns : avx512::Int8Columns;
    case Isa::kAvx2: return q4 ? avx2::Q4Columns : avx2::Int8Columns;
    case Isa::kPortable: break;
  }
#endif
  return q4 ? Q4ColumnsPortable : Int8ColumnsPortable;
}

// Columns per chunk: about four chunks per thread, a multiple of 24 (every
// register tile's width, 8, 6, 4 and 3, divides it), at least 48. A quantized
// product is bound by its instructions, not by memory streams, so short chunks
// cost little; with one chunk per thread (cpu_matmul.cc's split) the caller
// waited for a helper that started late (about 5 us after the call, against a
// 20-40 us product), a 576-output matrix split 320 / 256, and a 192-output one
// ran on one thread. Claimed from a shared counter, short chunks balance the
// threads whenever each starts: SmolLM2-135M's products of one forward fell
// from 8.7-9.5 ms to 8.3-8.6 at one row and 11.4-12.2 to 10.5-10.9 at four
// (2-core Xeon). Which thread computes a column does not change its sums.
int64_t QuantizedChunk(int64_t n, int64_t threads) {
  const int64_t parts = 4 * std::max<int64_t>(1, threads);
  const int64_t chunk = (n + parts - 1) / parts;
  return std::max<int64_t>(48, (chunk + 23) / 24 * 24);
}

ffi::Error Run(ffi::ThreadPool& pool, QProblem& p, bool q4) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const ColumnsFn columns = PickColumns(q4);
  specjax::ParallelColumns(pool, p.n, QuantizedChunk(p.n, pool.num_threads()),
                           [&p, columns](int64_t j0, int64_t j1) { columns(p, j0, j1); });
  return ffi::Error::Success();
}

ffi::Error Shapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> qd, ffi::Span<const int64_t> dd,
                  ffi::Span<const int64_t> yd, int64_t inputs_per_byte, int64_t group_multiple, QProblem* p) {
  if (xd.size() != 2 || qd.size() != 2 || dd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("specjax qmatmul: operands must be 2-D");
  const int64_t m = xd[0], k = xd[1], n = qd[0];
  if (qd[1] * inputs_per_byte != k || dd[0] != n || dd[1] <= 0 || k % dd[1] != 0 || yd[0] != m || yd[1] != n)
    return ffi::Error::InvalidArgument("specjax qmatmul: inconsistent shapes");
  const int64_t group = k / dd[1];
  if (group % group_multiple != 0)
    return ffi::Error::InvalidArgument("specjax qmatmul: the group size is not a multiple of the block");
  p->m = m;
  p->n = n;
  p->k = k;
  p->groups = dd[1];
  p->group = group;
  p->row_bytes = qd[1];
  return ffi::Error::Success();
}

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F16> d, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  QProblem p{};
  if (auto err = Shapes(x.dimensions(), q.dimensions(), d.dimensions(), y->dimensions(), 1, 16, &p);
      !err.success())
    return err;
  p.x = x.typed_data();
  p.q = static_cast<const uint8_t*>(q.untyped_data());
  p.d = static_cast<const uint16_t*>(d.untyped_data());
  p.y = y->typed_data();
  return Run(pool, p, false);
}

ffi::Error Q4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F16> d,
                  ffi::Buffer<ffi::F16> mn, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  QProblem p{};
  if (auto err = Shapes(x.dimensions(), q.dimensions(), d.dimensions(), y->dimensions(), 2, 32, &p);
      !err.success())
    return err;
  const auto md = mn.dimensions();
  if (md.size() != 2 || md[0] != p.n || md[1] != p.groups)
    return ffi::Error::InvalidArgument("specjax qmatmul: the minimums' shape differs from the scales'");
  p.x = x.typed_data();
  p.q = static_cast<const uint8_t*>(q.untyped_data());
  p.d = static_cast<const uint16_t*>(d.untyped_data());
  p.mn = static_cast<const uint16_t*>(mn.untyped_data());
  p.y = y->typed_data();
  return Run(pool, p, true);
}

// The same products with one expert of a stack, each array [E, ...] read at
// expert e where it lies: a dynamic index would copy the expert's arrays out
// first (cpu_matmul.cc's expert handler says why that matters). The index is
// clamped into the stack, as XLA clamps a dynamic index.
//
// Fills p for expert `index` (clamped) of the stacks q[E, N, K'] and d[E, N, G]: the
// shapes without their leading axis, the pointers at that expert's arrays. *offset: the
// expert's first element in an [E, N, G] array (the 4-bit minimums).
ffi::Error ExpertProblem(const ffi::Buffer<ffi::F32>& x, ffi::Span<const int64_t> qd, const void* q,
                         ffi::Span<const int64_t> dd, const void* d, const ffi::Buffer<ffi::S32>& index,
                         ffi::Result<ffi::Buffer<ffi::F32>>& y, int64_t inputs_per_byte, int64_t group_multiple,
                         QProblem* p, int64_t* offset) {
  if (qd.size() != 3 || dd.size() != 3 || qd[0] != dd[0] || qd[0] == 0 || index.element_count() != 1)
    return ffi::Error::InvalidArgument("specjax qmatmul expert: stacks [E, N, ...] and a scalar index");
  if (auto err = Shapes(x.dimensions(), qd.last(2), dd.last(2), y->dimensions(), inputs_per_byte, group_multiple, p);
      !err.success())
    return err;
  const int64_t e = std::clamp<int64_t>(index.typed_data()[0], 0, qd[0] - 1);
  *offset = e * p->n * p->groups;
  p->x = x.typed_data();
  p->q = static_cast<const uint8_t*>(q) + e * p->n * p->row_bytes;
  p->d = static_cast<const uint16_t*>(d) + *offset;
  p->y = y->typed_data();
  return ffi::Error::Success();
}

ffi::Error Int8ExpertImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::S32> index, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  QProblem p{};
  int64_t offset = 0;
  if (auto err = ExpertProblem(x, q.dimensions(), q.untyped_data(), d.dimensions(), d.untyped_data(), index, y, 1,
                               16, &p, &offset);
      !err.success())
    return err;
  return Run(pool, p, false);
}

ffi::Error Q4ExpertImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                        ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> mn, ffi::Buffer<ffi::S32> index,
                        ffi::Result<ffi::Buffer<ffi::F32>> y) {
  QProblem p{};
  int64_t offset = 0;
  if (auto err = ExpertProblem(x, q.dimensions(), q.untyped_data(), d.dimensions(), d.untyped_data(), index, y, 2,
                               32, &p, &offset);
      !err.success())
    return err;
  const auto md = mn.dimensions();
  if (md.size() != 3 || md[0] != q.dimensions()[0] || md[1] != p.n || md[2] != p.groups)
    return ffi::Error::InvalidArgument("specjax qmatmul: the minimums' shape differs from the scales'");
  p.mn = static_cast<const uint16_t*>(mn.untyped_data()) + offset;
  return Run(pool, p, true);
}

}  // namespace

// Every handler: XLA's intra-op thread pool and x, then the weight's arrays
// (and, for one expert of a stack, its index) -> y.
#define SPECJAX_QMATMUL_HANDLER(name, impl, weight_args) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                        \
      name, impl,                                       \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>() weight_args.Ret<ffi::Buffer<ffi::F32>>())

#define SPECJAX_INT8_ARGS .Arg<ffi::Buffer<ffi::S8>>().Arg<ffi::Buffer<ffi::F16>>()
#define SPECJAX_Q4_ARGS .Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::F16>>().Arg<ffi::Buffer<ffi::F16>>()
#define SPECJAX_INDEX_ARG .Arg<ffi::Buffer<ffi::S32>>()

SPECJAX_QMATMUL_HANDLER(SpecjaxQMatmulInt8, Int8Impl, SPECJAX_INT8_ARGS);
SPECJAX_QMATMUL_HANDLER(SpecjaxQMatmulQ4, Q4Impl, SPECJAX_Q4_ARGS);
SPECJAX_QMATMUL_HANDLER(SpecjaxQMatmulInt8Expert, Int8ExpertImpl, SPECJAX_INT8_ARGS SPECJAX_INDEX_ARG);
SPECJAX_QMATMUL_HANDLER(SpecjaxQMatmulQ4Expert, Q4ExpertImpl, SPECJAX_Q4_ARGS SPECJAX_INDEX_ARG);
