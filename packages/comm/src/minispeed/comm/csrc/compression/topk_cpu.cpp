// Top-k sparsification on the CPU: select the k largest magnitudes, and scatter-add them back.
// Format and SIMD policy: see compression.h (Note [SIMD paths]).
//
// Selection in three passes over n floats:
//   1. |x| into a scratch copy (and a NaN check: NaN has no place in an order);
//   2. std::nth_element on the copy: t = the k-th largest magnitude, in O(n) on average;
//   3. compaction: emit every |x| > t, then the first (k - #{|x| > t}) elements with |x| == t,
//      so ties go to the lower index and the result is unique. For k << n most vectors hold no
//      survivor, and the vector paths skip them with one compare.

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "compression.h"

namespace minispeed_compression {
namespace {

// Emits elements of [begin, end) that survive the threshold; `eq_left` counts the ties still
// allowed. Returns the new output count.
int64_t compact_scalar(const float* x, int64_t begin, int64_t end, float t, int64_t& eq_left,
                       float* values, int32_t* indices, int64_t out) {
  for (int64_t i = begin; i < end; ++i) {
    const float a = std::fabs(x[i]);
    if (a > t || (a == t && eq_left > 0)) {
      if (a == t) --eq_left;
      values[out] = x[i];
      indices[out] = static_cast<int32_t>(i);
      ++out;
    }
  }
  return out;
}

#if defined(MINISPEED_HAS_AVX2)
int64_t compact_avx2(const float* x, int64_t n, float t, int64_t eq_left, float* values,
                     int32_t* indices) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 tv = _mm256_set1_ps(t);
  int64_t out = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(a, tv, _CMP_EQ_OQ));
    if (eq != 0 && eq_left > 0) {  // ties here still compete: decide them one by one
      out = compact_scalar(x, i, i + 8, t, eq_left, values, indices, out);
      continue;
    }
    for (int gt = _mm256_movemask_ps(_mm256_cmp_ps(a, tv, _CMP_GT_OQ)); gt != 0; gt &= gt - 1) {
      const int64_t j = i + __builtin_ctz(static_cast<unsigned>(gt));
      values[out] = x[j];
      indices[out] = static_cast<int32_t>(j);
      ++out;
    }
  }
  return compact_scalar(x, i, n, t, eq_left, values, indices, out);
}
#endif

#if defined(MINISPEED_HAS_AVX512)
int64_t compact_avx512(const float* x, int64_t n, float t, int64_t eq_left, float* values,
                       int32_t* indices) {
  const __m512 tv = _mm512_set1_ps(t);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t out = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 a = _mm512_abs_ps(v);
    if (_mm512_cmp_ps_mask(a, tv, _CMP_EQ_OQ) != 0 && eq_left > 0) {
      out = compact_scalar(x, i, i + 16, t, eq_left, values, indices, out);
      continue;
    }
    const __mmask16 gt = _mm512_cmp_ps_mask(a, tv, _CMP_GT_OQ);
    if (gt == 0) continue;
    // Compress-store writes only the selected lanes, packed, in lane order (ascending index).
    _mm512_mask_compressstoreu_ps(values + out, gt, v);
    const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i)));
    _mm512_mask_compressstoreu_epi32(indices + out, gt, idx);
    out += __builtin_popcount(static_cast<unsigned>(gt));
  }
  return compact_scalar(x, i, n, t, eq_left, values, indices, out);
}
#endif

}  // namespace

int topk_select(const float* x, int64_t n, int64_t k, float* values, int32_t* indices,
                [[maybe_unused]] Simd simd) {
  if (k <= 0) return 0;
  // Pass 1: magnitudes.
  std::vector<float> mag(static_cast<size_t>(n));
  bool has_nan = false;
  for (int64_t i = 0; i < n; ++i) {
    mag[i] = std::fabs(x[i]);
    has_nan |= std::isnan(x[i]);
  }
  if (has_nan) return -1;
  // Pass 2: t = k-th largest magnitude; afterwards mag[0..k) >= t >= mag[k..n).
  std::nth_element(mag.begin(), mag.begin() + (k - 1), mag.end(), std::greater<float>());
  const float t = mag[k - 1];
  int64_t greater = 0;  // only mag[0..k-1) can exceed t
  for (int64_t i = 0; i + 1 < k; ++i) greater += mag[i] > t;
  const int64_t eq_left = k - greater;
  // Pass 3: compaction in index order.
#if defined(MINISPEED_HAS_AVX512)
  if (simd == Simd::kAvx512) {
    compact_avx512(x, n, t, eq_left, values, indices);
    return 0;
  }
#endif
#if defined(MINISPEED_HAS_AVX2)
  if (simd == Simd::kAvx2) {
    compact_avx2(x, n, t, eq_left, values, indices);
    return 0;
  }
#endif
  int64_t eq = eq_left;
  compact_scalar(x, 0, n, t, eq, values, indices, 0);
  return 0;
}

int64_t sparse_accumulate(float* out, int64_t n, const float* values, const int32_t* indices,
                          int64_t k) {
  // Random access into `out`: memory latency, not arithmetic, sets the speed, so one scalar loop
  // serves every SIMD level.
  // Check every index before writing any, so a bad call leaves `out` untouched.
  for (int64_t j = 0; j < k; ++j) {
    if (indices[j] < 0 || indices[j] >= n) return -1 - j;
  }
  for (int64_t j = 0; j < k; ++j) out[indices[j]] += values[j];
  return 0;
}

}  // namespace minispeed_compression
