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
// On processors with AVX-512 VNNI, blocks of 32 (int8/32, q4) and int8 per
// channel take another route, llama.cpp's: each row of activations is rounded
// to int8 per block of 32 (scale = max |x| / 127), and the weights' integers
// meet the activations' in 8-bit integer dot products (vpdpbusd, 64 a
// instruction), scaled per block in float32. That is about half the
// instructions of dequantizing to float32, which kept these kernels behind
// memory; the price is the activations' rounding, below the weights' own.
// The result is the float product of the dequantized weights with the
// dequantized activations, so the two roundings are what a reader must allow.
//
// Every output element is summed in one order (vector lanes along K, group by
// group, then the lanes), whatever the number of rows or the tile that
// computes it, so a row's logits do not depend on the rows it is batched with.
// The processor is asked once what it has: AVX-512 (F, BW), else AVX2 with
// FMA and F16C, else portable C++.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
  // The activations rounded to int8 per 32 inputs, for the VNNI kernels
  // (QuantizeActivations): values [m, k]; per row, for each pair of blocks,
  // 16 lanes of their scales (8 of the first's, 8 of the second's); per row
  // and block, the correction the kernels add outside the integer dot.
  const int8_t* xq = nullptr;
  const float* xscale = nullptr;  // [m, pairs, 16]
  const float* xcorr = nullptr;   // [m, blocks]
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
  static V Zero() { return _mm512_setzero_ps(); }
  static V Set(float v) { return _mm512_set1_ps(v); }
  static V Load(const float* x) { return _mm512_loadu_ps(x); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static float Sum(V v) { return _mm512_reduce_add_ps(v); }
  // 16 int8 weights.
  static void Int8(const int8_t* q, V* out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  }
  // One 32-input block: inputs 0-15 (low nibbles), 16-31 (high nibbles).
  static void Nibbles(const uint8_t* block, V* out) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
    const __m128i mask = _mm_set1_epi8(0x0f);
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
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
  static V Zero() { return _mm256_setzero_ps(); }
  static V Set(float v) { return _mm256_set1_ps(v); }
  static V Load(const float* x) { return _mm256_loadu_ps(x); }
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
  // One 32-input block as four vectors, in input order.
  static void Nibbles(const uint8_t* block, V* out) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
};
#include "cpu_qmatmul_body.inc"
}  // namespace avx2
#pragma GCC pop_options


// --------------------------------------------------------- AVX-512 VNNI --
//
// vpdpbusd multiplies unsigned by signed bytes: 4-bit weights are unsigned
// already (0..15); int8 weights are read as w + 128 (one xor), and the
// -128 * sum(x) that adds is taken back with the per-block correction.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace vnni {

// 64 weights (blocks 2p and 2p + 1) as unsigned bytes in input order.
inline __m512i Q4Pair(const uint8_t* row, int64_t pair) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + pair * 32));
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i lo = _mm256_and_si256(bytes, mask);                         // [b0 0-15 | b1 0-15]
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);  // [b0 16-31 | b1 16-31]
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));  // [b0 lo, b0 hi, b1 lo, b1 hi]
}

inline __m512i Int8Pair(const uint8_t* row, int64_t pair) {
  const __m512i bytes = _mm512_loadu_si512(row + pair * 64);
  return _mm512_xor_si512(bytes, _mm512_set1_epi8(static_cast<char>(0x80)));
}

inline __m256i Q4Block(const uint8_t* row, int64_t block) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + block * 16));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

inline __m256i Int8Block(const uint8_t* row, int64_t block) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + block * 32));
  return _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));
}

// Sixteen float16 values from p (fewer, zero-filled, where fewer are left).
inline __m512 LoadHalves(const uint16_t* p, int64_t count) {
  const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// y[MR rows, NR outputs from j]. kQ4: 4-bit weights, else int8. kPerRow:
// one weight scale per output row (int8 per channel), applied at the end;
// else one per block, applied to each block's integer dot.
template <bool kQ4, bool kPerRow, int MR, int NR>
inline void Tile(const QProblem& p, int64_t i0, int64_t j) {
  const int64_t blocks = p.k / 32, pairs = blocks / 2;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  const uint8_t* rows[NR];
  const uint16_t* scales[NR];
  for (int r = 0; r < NR; ++r) {
    rows[r] = p.q + (j + r) * p.row_bytes;
    scales[r] = p.d + (j + r) * p.groups;
  }
  const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 d16[NR];
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = 2 * pair;
    if (!kPerRow && b % 16 == 0) {
      for (int r = 0; r < NR; ++r) d16[r] = LoadHalves(scales[r] + b, blocks - b);
    }
    __m512i w[NR];
    __m512 dv[NR];
    for (int r = 0; r < NR; ++r) {
      w[r] = kQ4 ? Q4Pair(rows[r], pair) : Int8Pair(rows[r], pair);
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + NR * p.row_bytes + pair * (kQ4 ? 32 : 64)), _MM_HINT_T0);
      if (!kPerRow) dv[r] = _mm512_permutexvar_ps(_mm512_add_epi32(half, _mm512_set1_epi32(b % 16)), d16[r]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i x = _mm512_loadu_si512(p.xq + (i0 + i) * p.k + b * 32);
      const __m512 sx = _mm512_loadu_ps(p.xscale + ((i0 + i) * ((blocks + 1) / 2) + pair) * 16);
      for (int r = 0; r < NR; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], x));
        acc[i][r] = _mm512_fmadd_ps(dot, kPerRow ? sx : _mm512_mul_ps(dv[r], sx), acc[i][r]);
      }
    }
  }
  if (blocks % 2) {  // the last block alone, in the low half of the vectors
    const int64_t b = blocks - 1;
    for (int r = 0; r < NR; ++r) {
      const __m256i w = kQ4 ? Q4Block(rows[r], b) : Int8Block(rows[r], b);
      const float d = kPerRow ? 1.0f : _cvtsh_ss(scales[r][b]);
      for (int i = 0; i < MR; ++i) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq + (i0 + i) * p.k + b * 32));
        const __m256 sx = _mm256_loadu_ps(p.xscale + ((i0 + i) * ((blocks + 1) / 2) + b / 2) * 16);
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
        const __m256 part = _mm256_mul_ps(dot, _mm256_mul_ps(sx, _mm256_set1_ps(d)));
        acc[i][r] = _mm512_add_ps(acc[i][r], _mm512_zextps256_ps512(part));
      }
    }
  }
  // sum_b coefficient[r, b] * correction[i, b]: the 4-bit minimums times the
  // block sums, or int8's -128 * sum(x) taken back.
  for (int r = 0; r < NR; ++r) {
    const uint16_t* coef = kQ4 ? p.mn + (j + r) * p.groups : scales[r];
    for (int i = 0; i < MR; ++i) {
      const float* corr = p.xcorr + (i0 + i) * blocks;
      __m512 c = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; b += 16) {
        const int64_t left = blocks - b;
        const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        const __m512 coefs = kPerRow ? _mm512_set1_ps(1.0f) : LoadHalves(coef + b, left);
        c = _mm512_fmadd_ps(coefs, _mm512_maskz_loadu_ps(mask, corr + b), c);
      }
      float y = _mm512_reduce_add_ps(acc[i][r]) + _mm512_reduce_add_ps(c);
      if (kPerRow) y *= _cvtsh_ss(scales[r][0]);
      p.y[(i0 + i) * p.n + j + r] = y;
    }
  }
}

template <bool kQ4, bool kPerRow, int NR>
inline void Rows(const QProblem& p, int64_t j) {
  int64_t i = 0;
  for (; i + 4 <= p.m; i += 4) Tile<kQ4, kPerRow, 4, NR>(p, i, j);
  for (; i < p.m; ++i) Tile<kQ4, kPerRow, 1, NR>(p, i, j);
}

template <bool kQ4, bool kPerRow>
void Columns(const QProblem& p, int64_t j0, int64_t j1) {
  int64_t j = j0;
  if (p.m == 1) {
    for (; j + 4 <= j1; j += 4) Rows<kQ4, kPerRow, 4>(p, j);
  } else {
    for (; j + 2 <= j1; j += 2) Rows<kQ4, kPerRow, 2>(p, j);
  }
  for (; j < j1; ++j) Rows<kQ4, kPerRow, 1>(p, j);
}

// One block of 32 activations to int8 (round to nearest even, as
// std::nearbyint): returns the scale, writes the values and their sum.
inline float QuantizeBlock(const float* x, int8_t* out, int32_t* sum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qb));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return amax / 127.0f;
}

void Q4Columns(const QProblem& p, int64_t j0, int64_t j1) { Columns<true, false>(p, j0, j1); }
void Int8BlockColumns(const QProblem& p, int64_t j0, int64_t j1) { Columns<false, false>(p, j0, j1); }
void Int8ChannelColumns(const QProblem& p, int64_t j0, int64_t j1) { Columns<false, true>(p, j0, j1); }

}  // namespace vnni
#pragma GCC pop_options

enum class Isa { kPortable, kAvx2, kAvx512, kAvx512Vnni };

Isa DetectIsa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c"))
      return __builtin_cpu_supports("avx512vnni") ? Isa::kAvx512Vnni : Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Isa::kAvx2;
    return Isa::kPortable;
  }();
  return isa;
}
#endif  // SPECJAX_X86

using ColumnsFn = void (*)(const QProblem&, int64_t, int64_t);

// Whether the VNNI kernels take this problem: blocks of 32 inputs, and a
// weight scale per block or per output row.
bool TakesVnni(const QProblem& p, bool q4) {
#ifdef SPECJAX_X86
  if (DetectIsa() != Isa::kAvx512Vnni || p.k % 32) return false;
  return p.group == 32 || (!q4 && p.groups == 1);
#else
  (void)p;
  (void)q4;
  return false;
#endif
}

// The column kernel for this processor. An int8 group must be a whole number
// of vectors for the vector kernels (the handler checks 16).
ColumnsFn PickColumns(const QProblem& p, bool q4) {
#ifdef SPECJAX_X86
  if (TakesVnni(p, q4)) return q4 ? vnni::Q4Columns : (p.groups == 1 ? vnni::Int8ChannelColumns : vnni::Int8BlockColumns);
  switch (DetectIsa()) {
    case Isa::kAvx512Vnni:
    case Isa::kAvx512: return q4 ? avx512::Q4Columns : avx512::Int8Columns;
    case Isa::kAvx2: return q4 ? avx2::Q4Columns : avx2::Int8Columns;
    case Isa::kPortable: break;
  }
#endif
  return q4 ? Q4ColumnsPortable : Int8ColumnsPortable;
}

// Rounds each row of x to int8 per block of 32 (scale max |x| / 127, to
// nearest), and writes what the VNNI kernels read beside the values: each
// pair of blocks' scales as 16 lanes, and per block the correction term
// (4-bit: the dequantized block's sum, which the minimum multiplies; int8:
// -128 times it, for the +128 the kernel reads its weights with).
struct Activations {
  std::vector<int8_t> values;
  std::vector<float> scales, corrections;
};

void QuantizeActivations(QProblem& p, bool q4, Activations& a) {
#ifdef SPECJAX_X86  // TakesVnni is false elsewhere
  const int64_t blocks = p.k / 32, pair_slots = (blocks + 1) / 2;
  a.values.resize(p.m * p.k);
  a.scales.assign(p.m * pair_slots * 16, 0.0f);
  a.corrections.resize(p.m * blocks);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sum;
      const float scale = vnni::QuantizeBlock(p.x + i * p.k + b * 32, a.values.data() + i * p.k + b * 32, &sum);
      float* lanes = a.scales.data() + (i * pair_slots + b / 2) * 16 + (b % 2) * 8;
      std::fill(lanes, lanes + 8, scale);
      a.corrections[i * blocks + b] = (q4 ? 1.0f : -128.0f) * scale * static_cast<float>(sum);
    }
  }
  p.xq = a.values.data();
  p.xscale = a.scales.data();
  p.xcorr = a.corrections.data();
#else
  (void)p;
  (void)q4;
  (void)a;
#endif
}

ffi::Error Run(ffi::ThreadPool& pool, QProblem& p, bool q4) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  Activations activations;
  if (TakesVnni(p, q4)) QuantizeActivations(p, q4, activations);
  const ColumnsFn columns = PickColumns(p, q4);
  specjax::ParallelColumns(pool, p.n, specjax::ChunkColumns(p.n, pool.num_threads()),
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQMatmulInt8, Int8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQMatmulQ4, Q4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 8 where the VNNI kernels run on this processor (activations rounded to int8
// per 32 inputs for the formats they take), else 32.
extern "C" int specjax_qmatmul_activation_bits() {
#ifdef SPECJAX_X86
  return DetectIsa() == Isa::kAvx512Vnni ? 8 : 32;
#else
  return 32;
#endif
}
