// 1-bit sign compression on the CPU: pack signs into bits, per-chunk mean-|x| scales, unpack.
// Format and SIMD policy: see compression.h (Note [SIMD paths]).

#include <cmath>
#include <cstring>

#include "compression.h"

namespace minispeed_compression {
namespace {

// ---- bits: element i -> byte i / 8, bit i % 8; 1 iff x < 0 --------------------------------------

// Bytes [first_byte, ceil(n / 8)) one element at a time; also the tail of the vector paths.
void pack_bits_scalar(const float* x, int64_t n, int64_t first_byte, uint8_t* bits) {
  const int64_t n_bytes = (n + 7) / 8;
  for (int64_t b = first_byte; b < n_bytes; ++b) {
    uint8_t byte = 0;
    for (int j = 0; j < 8; ++j) {
      const int64_t i = b * 8 + j;
      if (i < n && x[i] < 0.0f) byte |= static_cast<uint8_t>(1u << j);
    }
    bits[b] = byte;
  }
}

#if defined(MINISPEED_HAS_AVX2)
void pack_bits_avx2(const float* x, int64_t n, uint8_t* bits) {
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    // An ordered "<" compare, not the raw sign bit: -0.0 and NaN must count as positive.
    const __m256 neg = _mm256_cmp_ps(_mm256_loadu_ps(x + i), zero, _CMP_LT_OQ);
    bits[i / 8] = static_cast<uint8_t>(_mm256_movemask_ps(neg));
  }
  pack_bits_scalar(x, n, i / 8, bits);
}
#endif

#if defined(MINISPEED_HAS_AVX512)
void pack_bits_avx512(const float* x, int64_t n, uint8_t* bits) {
  const __m512 zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __mmask16 neg = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), zero, _CMP_LT_OQ);
    // Lane j is mask bit j; stored little-endian, lanes 0-7 land in the first byte as required.
    std::memcpy(bits + i / 8, &neg, 2);
  }
  pack_bits_scalar(x, n, i / 8, bits);
}
#endif

void pack_bits(const float* x, int64_t n, uint8_t* bits, [[maybe_unused]] Simd simd) {
#if defined(MINISPEED_HAS_AVX512)
  if (simd == Simd::kAvx512) return pack_bits_avx512(x, n, bits);
#endif
#if defined(MINISPEED_HAS_AVX2)
  if (simd == Simd::kAvx2) return pack_bits_avx2(x, n, bits);
#endif
  pack_bits_scalar(x, n, 0, bits);
}

// ---- scales: mean |x| per chunk, summed in double ---------------------------------------------

double abs_sum_scalar(const float* x, int64_t len) {
  double sum = 0.0;
  for (int64_t i = 0; i < len; ++i) sum += std::fabs(static_cast<double>(x[i]));
  return sum;
}

#if defined(MINISPEED_HAS_AVX2)
double abs_sum_avx2(const float* x, int64_t len) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
    acc_hi = _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc_lo, acc_hi));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + abs_sum_scalar(x + i, len - i);
}
#endif

#if defined(MINISPEED_HAS_AVX512)
double abs_sum_avx512(const float* x, int64_t len) {
  __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    // Split 16 floats into two halves of 8 and widen each to double (AVX-512F only, no DQ).
    const __m256 lo = _mm512_castps512_ps256(a);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    acc_lo = _mm512_add_pd(acc_lo, _mm512_cvtps_pd(lo));
    acc_hi = _mm512_add_pd(acc_hi, _mm512_cvtps_pd(hi));
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi)) + abs_sum_scalar(x + i, len - i);
}
#endif

double abs_sum(const float* x, int64_t len, [[maybe_unused]] Simd simd) {
#if defined(MINISPEED_HAS_AVX512)
  if (simd == Simd::kAvx512) return abs_sum_avx512(x, len);
#endif
#if defined(MINISPEED_HAS_AVX2)
  if (simd == Simd::kAvx2) return abs_sum_avx2(x, len);
#endif
  return abs_sum_scalar(x, len);
}

// ---- unpack: out[i] = bit ? -s : s --------------------------------------------------------------

inline float signed_scale(const uint8_t* bits, int64_t i, float s) {
  return ((bits[i >> 3] >> (i & 7)) & 1u) ? -s : s;
}

// One chunk [begin, end) sharing scale s. Vector steps start at multiples of the vector width,
// where a whole number of bytes of `bits` lines up with the lanes.
void unpack_chunk(const uint8_t* bits, int64_t begin, int64_t end, float s, float* out,
                  [[maybe_unused]] Simd simd) {
  int64_t i = begin;
#if defined(MINISPEED_HAS_AVX512)
  if (simd == Simd::kAvx512) {
    for (; i < end && (i & 15) != 0; ++i) out[i] = signed_scale(bits, i, s);
    const __m512 pos = _mm512_set1_ps(s), neg = _mm512_set1_ps(-s);
    for (; i + 16 <= end; i += 16) {
      __mmask16 m;
      std::memcpy(&m, bits + i / 8, 2);
      _mm512_storeu_ps(out + i, _mm512_mask_blend_ps(m, pos, neg));  // bit set -> neg
    }
  }
#endif
#if defined(MINISPEED_HAS_AVX2)
  if (simd == Simd::kAvx2) {
    for (; i < end && (i & 7) != 0; ++i) out[i] = signed_scale(bits, i, s);
    const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (; i + 8 <= end; i += 8) {
      // Broadcast the byte, keep lane j's bit, compare: lane j is all-ones iff bit j is set.
      const __m256i sel = _mm256_and_si256(_mm256_set1_epi32(bits[i / 8]), lane_bit);
      const __m256 m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(sel, lane_bit));
      _mm256_storeu_ps(out + i, _mm256_blendv_ps(pos, neg, m));
    }
  }
#endif
  for (; i < end; ++i) out[i] = signed_scale(bits, i, s);
}

}  // namespace

void sign_pack(const float* x, int64_t n, int64_t chunk, uint8_t* bits, float* scales, Simd simd) {
  pack_bits(x, n, bits, simd);
  const int64_t n_chunks = (n + chunk - 1) / chunk;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t begin = c * chunk;
    const int64_t len = (begin + chunk <= n ? chunk : n - begin);
    scales[c] = static_cast<float>(abs_sum(x + begin, len, simd) / static_cast<double>(len));
  }
}

void sign_unpack(const uint8_t* bits, const float* scales, int64_t n, int64_t chunk, float* out,
                 Simd simd) {
  const int64_t n_chunks = (n + chunk - 1) / chunk;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t begin = c * chunk;
    const int64_t end = (begin + chunk <= n ? begin + chunk : n);
    unpack_chunk(bits, begin, end, scales[c], out, simd);
  }
}

}  // namespace minispeed_compression
