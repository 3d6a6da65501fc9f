// Symmetric absmax block quantization to int8 or int4 on the CPU, and its inverse.
// Format and SIMD policy: see compression.h (Note [SIMD paths]).
//
// Bit-exactness with the PyTorch reference holds because every step is an exactly rounded IEEE
// operation in both: absmax (order-free), s = absmax / qmax (one division), x / s (one division,
// not x * (1/s)), round-half-even, clamp, and q * s on the way back.
//
// Note [non-finite blocks]: a block holding a NaN gets the canonical quiet NaN as its scale (the
// max of |x| is NaN, as torch.amax says); one holding +-inf and no NaN gets +inf. Where x / s is
// NaN (a NaN element, any element of a NaN block, +-inf / inf) the code is 0, never the integer
// conversion of a NaN (undefined in C++, INT_MIN from cvtps2dq). Every code of such a block is
// then 0 (finite / inf = +-0), so the whole block dequantizes to 0 * NaN or 0 * inf = NaN: a
// non-finite gradient arrives non-finite, which is what an fp16 overflow check looks for. Each
// SIMD path keeps a NaN flag beside its running max, because maxps returns its second operand
// when either is NaN and so forgets a NaN seen earlier.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compression.h"

namespace minispeed_compression {
namespace {

inline int qmax_of(int bits) { return bits == 8 ? 127 : 7; }

inline int quantize_one(float x, float s, int qmax) {
  const float r = std::nearbyint(x / s);  // default rounding mode: half to even, like torch.round
  if (std::isnan(r)) return 0;            // See Note [non-finite blocks]
  return static_cast<int>(std::min(std::max(r, static_cast<float>(-qmax)), static_cast<float>(qmax)));
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline int nibble_to_int(uint8_t nib) { return static_cast<int>(nib ^ 8u) - 8; }  // sign-extend

// Elements [begin, end) of one block, one at a time (the scalar path and every vector tail).
// For int4, begin is even (vector steps cover 8 or 16 elements, blocks are even).
void quantize_range_scalar(const float* x, int64_t begin, int64_t end, float s, int bits,
                           uint8_t* q) {
  const int qmax = qmax_of(bits);
  for (int64_t i = begin; i < end; ++i) {
    const int v = s == 0.0f ? 0 : quantize_one(x[i], s, qmax);
    if (bits == 8) {
      q[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
    } else if ((i & 1) == 0) {
      q[i / 2] = static_cast<uint8_t>(v & 0xF);  // low nibble; also clears a stale high nibble
    } else {
      q[i / 2] |= static_cast<uint8_t>((v & 0xF) << 4);
    }
  }
}

void dequantize_range_scalar(const uint8_t* q, int64_t begin, int64_t end, float s, int bits,
                             float* out) {
  for (int64_t i = begin; i < end; ++i) {
    const int v = bits == 8 ? static_cast<int>(static_cast<int8_t>(q[i]))
                            : nibble_to_int((i & 1) ? (q[i / 2] >> 4) : (q[i / 2] & 0xF));
    out[i] = static_cast<float>(v) * s;
  }
}

// max |x| over the range, NaN if any element is NaN (See Note [non-finite blocks]).
float absmax_scalar(const float* x, int64_t len) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < len; ++i) {
    const float v = std::fabs(x[i]);
    nan |= std::isnan(v);
    m = std::max(m, v);  // ignores a NaN v (m < NaN is false): the flag remembers it
  }
  return nan ? kNaN : m;
}

#if defined(MINISPEED_HAS_AVX2)
// 16 int8 lanes (low 8 used when `count` = 8) -> count / 2 bytes of nibble pairs.
inline void store_nibbles(__m128i v8, uint8_t* dst, int count) {
  // As 16-bit lanes each pair is (odd << 8 | even) once both are masked to 4 bits; OR-ing with the
  // lane shifted right by 4 puts odd into bits 4-7, so the low byte is the packed pair.
  const __m128i nib = _mm_and_si128(v8, _mm_set1_epi8(0x0F));
  const __m128i pair = _mm_and_si128(_mm_or_si128(nib, _mm_srli_epi16(nib, 4)), _mm_set1_epi16(0xFF));
  const __m128i packed = _mm_packus_epi16(pair, pair);  // low count/2 bytes hold the result
  alignas(16) uint8_t tmp[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
  std::memcpy(dst, tmp, static_cast<size_t>(count / 2));
}

// count / 2 bytes of nibble pairs -> `count` sign-extended int8 lanes, in element order.
inline __m128i load_nibbles(const uint8_t* src, int count) {
  alignas(16) uint8_t tmp[16] = {0};
  std::memcpy(tmp, src, static_cast<size_t>(count / 2));
  const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  const __m128i eight = _mm_set1_epi8(8);
  const __m128i v = _mm_unpacklo_epi8(lo, hi);  // lo0, hi0, lo1, hi1, ... = elements 0, 1, 2, ...
  return _mm_sub_epi8(_mm_xor_si128(v, eight), eight);
}

float absmax_avx2(const float* x, int64_t len) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();  // all-ones lanes where a NaN was seen
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  const float r_tail = absmax_scalar(x + i, len - i);
  if (_mm256_movemask_ps(nan) != 0 || std::isnan(r_tail)) return kNaN;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float r = r_tail;
  for (float v : lanes) r = std::max(r, v);
  return r;
}

void quantize_block_avx2(const float* x, int64_t begin, int64_t end, float s, int bits, uint8_t* q) {
  int64_t i = begin;
  if (s != 0.0f) {
    const __m256 sv = _mm256_set1_ps(s);
    const __m256i hi = _mm256_set1_epi32(qmax_of(bits)), lo = _mm256_set1_epi32(-qmax_of(bits));
    for (; i + 8 <= end; i += 8) {
      __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), sv),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));  // NaN -> 0: Note [non-finite blocks]
      const __m256i v = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), lo), hi);
      // 8 x int32 -> 8 x int16 -> 8 x int8 (values fit, so the saturating packs are exact).
      const __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      const __m128i v8 = _mm_packs_epi16(v16, v16);
      if (bits == 8) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), v8);
      } else {
        store_nibbles(v8, q + i / 2, 8);
      }
    }
  }
  quantize_range_scalar(x, i, end, s, bits, q);
}

void dequantize_block_avx2(const uint8_t* q, int64_t begin, int64_t end, float s, int bits,
                           float* out) {
  int64_t i = begin;
  const __m256 sv = _mm256_set1_ps(s);
  for (; i + 8 <= end; i += 8) {
    const __m128i v8 = bits == 8 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i))
                                 : load_nibbles(q + i / 2, 8);
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v8));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(f, sv));
  }
  dequantize_range_scalar(q, i, end, s, bits, out);
}
#endif

#if defined(MINISPEED_HAS_AVX512)
float absmax_avx512(const float* x, int64_t len) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;  // lanes where a NaN was seen
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  const float r_tail = absmax_scalar(x + i, len - i);
  if (nan != 0 || std::isnan(r_tail)) return kNaN;
  return std::max(_mm512_reduce_max_ps(m), r_tail);
}

void quantize_block_avx512(const float* x, int64_t begin, int64_t end, float s, int bits,
                           uint8_t* q) {
  int64_t i = begin;
  if (s != 0.0f) {
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i hi = _mm512_set1_epi32(qmax_of(bits)), lo = _mm512_set1_epi32(-qmax_of(bits));
    for (; i + 16 <= end; i += 16) {
      __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), sv),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);  // NaN -> 0
      const __m512i v = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(r), lo), hi);
      const __m128i v8 = _mm512_cvtepi32_epi8(v);  // truncating narrow; values already in range
      if (bits == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), v8);
      } else {
        store_nibbles(v8, q + i / 2, 16);
      }
    }
  }
  quantize_range_scalar(x, i, end, s, bits, q);
}

void dequantize_block_avx512(const uint8_t* q, int64_t begin, int64_t end, float s, int bits,
                             float* out) {
  int64_t i = begin;
  const __m512 sv = _mm512_set1_ps(s);
  for (; i + 16 <= end; i += 16) {
    const __m128i v8 = bits == 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))
                                 : load_nibbles(q + i / 2, 16);
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v8));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(f, sv));
  }
  dequantize_range_scalar(q, i, end, s, bits, out);
}
#endif

float absmax(const float* x, int64_t len, [[maybe_unused]] Simd simd) {
#if defined(MINISPEED_HAS_AVX512)
  if (simd == Simd::kAvx512) return absmax_avx512(x, len);
#endif
#if defined(MINISPEED_HAS_AVX2)
  if (simd == Simd::kAvx2) return absmax_avx2(x, len);
#endif
  return absmax_scalar(x, len);
}

}  // namespace

void quantize_blocks(const float* x, int64_t n, int64_t block, int bits, uint8_t* q, float* scales,
                     Simd simd) {
  const float qmax = static_cast<float>(qmax_of(bits));
  const int64_t n_blocks = (n + block - 1) / block;
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t begin = b * block;
    const int64_t end = std::min(begin + block, n);
    const float s = absmax(x + begin, end - begin, simd) / qmax;
    scales[b] = s;
#if defined(MINISPEED_HAS_AVX512)
    if (simd == Simd::kAvx512) {
      quantize_block_avx512(x, begin, end, s, bits, q);
      continue;
    }
#endif
#if defined(MINISPEED_HAS_AVX2)
    if (simd == Simd::kAvx2) {
      quantize_block_avx2(x, begin, end, s, bits, q);
      continue;
    }
#endif
    quantize_range_scalar(x, begin, end, s, bits, q);
  }
}

void dequantize_blocks(const uint8_t* q, const float* scales, int64_t n, int64_t block, int bits,
                       float* out, [[maybe_unused]] Simd simd) {
  const int64_t n_blocks = (n + block - 1) / block;
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t begin = b * block;
    const int64_t end = std::min(begin + block, n);
#if defined(MINISPEED_HAS_AVX512)
    if (simd == Simd::kAvx512) {
      dequantize_block_avx512(q, begin, end, scales[b], bits, out);
      continue;
    }
#endif
#if defined(MINISPEED_HAS_AVX2)
    if (simd == Simd::kAvx2) {
      dequantize_block_avx2(q, begin, end, scales[b], bits, out);
      continue;
    }
#endif
    dequantize_range_scalar(q, begin, end, scales[b], bits, out);
  }
}

}  // namespace minispeed_compression
