// minispeed.inference's fused CPU kernels, fp32, in one extension (one JIT build per machine).
//
// Kernels: add + LayerNorm, add + RMSNorm, bias + GeLU (erf), masked softmax, rotary embedding
// (rotate-half), single-token decode attention over a paged KV cache, and an int8 weight-only
// linear with per-output-channel scales. Each has a pure-PyTorch reference with the same
// contract in minispeed/inference/kernels_reference.py; the tests compare the two.
//
// SIMD: the vector helpers (dot and axpy from minispeed/simd.h; sum, sum of squares and the int8
// widening load below) are chosen at compile time by the define the builder passes
// (-DMINISPEED_SIMD_AVX512 / _AVX2 / _SCALAR), as in core's cast op; every helper ends in the
// same scalar tail loop.
// Threads: OpenMP over rows (or over output channels / (sequence, head) pairs), GIL released
// around every kernel.
//
// Note [raw pointers, no torch headers]: like core's cast op, the bindings take data pointers and
// sizes, not at::Tensor, so this file compiles in seconds. The Python wrapper
// (minispeed.inference.kernels) checks dtype, device, shape and contiguity before it passes a
// pointer here; a zero pointer means "absent" for optional inputs (residual, bias, mask).

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels.h"         // this file's entry points, which decode_step.cpp also calls
#include "minispeed/simd.h"  // dot, axpy, hsum256, MINISPEED_HAS_* (core/csrc/include)
#include "vec.h"             // exp_nonpos (see Note [vector exp])

namespace minispeed_kernels {

template <typename T>
inline T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

using minispeed::simd::axpy;
#if defined(MINISPEED_HAS_AVX2)
using minispeed_inference::exp_nonpos;
#endif
using minispeed::simd::dot;
#if defined(MINISPEED_HAS_AVX2)
using minispeed::simd::hsum256;
#endif

// h = x + r (r may be null), written to h; returns sum(h).
inline float add_into(const float* x, const float* r, float* h, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
#if defined(MINISPEED_HAS_AVX512)
  __m512 s = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (r) v = _mm512_add_ps(v, _mm512_loadu_ps(r + i));
    _mm512_storeu_ps(h + i, v);
    s = _mm512_add_ps(s, v);
  }
  acc = _mm512_reduce_add_ps(s);
#elif defined(MINISPEED_HAS_AVX2)
  __m256 s = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    if (r) v = _mm256_add_ps(v, _mm256_loadu_ps(r + i));
    _mm256_storeu_ps(h + i, v);
    s = _mm256_add_ps(s, v);
  }
  acc = hsum256(s);
#endif
  for (; i < n; ++i) {
    h[i] = r ? x[i] + r[i] : x[i];
    acc += h[i];
  }
  return acc;
}

// sum_i (h[i] - mean)^2
inline float centered_sq(const float* h, float mean, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
#if defined(MINISPEED_HAS_AVX512)
  const __m512 m = _mm512_set1_ps(mean);
  __m512 s = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(h + i), m);
    s = _mm512_fmadd_ps(d, d, s);
  }
  acc = _mm512_reduce_add_ps(s);
#elif defined(MINISPEED_HAS_AVX2)
  const __m256 m = _mm256_set1_ps(mean);
  __m256 s = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(h + i), m);
    s = _mm256_fmadd_ps(d, d, s);
  }
  acc = hsum256(s);
#endif
  for (; i < n; ++i) acc += (h[i] - mean) * (h[i] - mean);
  return acc;
}

// out[i] = (h[i] - shift) * inv * g[i] + (b ? b[i] : 0)
inline void scale_affine(const float* h, float shift, float inv, const float* g, const float* b,
                         float* out, int64_t n) {
  int64_t i = 0;
#if defined(MINISPEED_HAS_AVX512)
  const __m512 sh = _mm512_set1_ps(shift), iv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(h + i), sh), iv),
                             _mm512_loadu_ps(g + i));
    if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + i));
    _mm512_storeu_ps(out + i, v);
  }
#elif defined(MINISPEED_HAS_AVX2)
  const __m256 sh = _mm256_set1_ps(shift), iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(h + i), sh), iv),
                             _mm256_loadu_ps(g + i));
    if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + i));
    _mm256_storeu_ps(out + i, v);
  }
#endif
  for (; i < n; ++i) out[i] = (h[i] - shift) * inv * g[i] + (b ? b[i] : 0.f);
}

// Note [vector erf]: erf has no vector intrinsic, so the SIMD paths use Abramowitz & Stegun 7.1.26,
//   erf(x) = sign(x) · (1 − (a1 t + a2 t² + a3 t³ + a4 t⁴ + a5 t⁵) · exp(−x²)),  t = 1 / (1 + p|x|),
// absolute error ≤ 1.5e-7, with exp(−x²) from vec.h's exp_nonpos (see Note [vector exp]: relative
// error ~1e-7). GeLU then differs from the exact-erf reference by
// at most 0.5 · |v| · 2e-7. The scalar path and every tail use std::erf.
constexpr float kErfP = 0.3275911f, kErfA1 = 0.254829592f, kErfA2 = -0.284496736f,
                kErfA3 = 1.421413741f, kErfA4 = -1.453152027f, kErfA5 = 1.061405429f;

#if defined(MINISPEED_HAS_AVX512)
inline __m512 erf_vec(__m512 x) {
  const __m512 sign = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x80000000)));
  const __m512 a = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(kErfP), a, one));
  __m512 poly = _mm512_set1_ps(kErfA5);
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kErfA4));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kErfA3));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kErfA2));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kErfA1));
  poly = _mm512_mul_ps(poly, t);
  const __m512 y = _mm512_fnmadd_ps(poly, exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(a, a))), one);
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(y), _mm512_castps_si512(sign)));
}

// tanh(x) = sign(x) · (1 − e) / (1 + e) with e = exp(−2|x|) <= 1 (see Note [vector erf]).
inline __m512 tanh_vec(__m512 x) {
  const __m512 sign = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x80000000)));
  const __m512 a = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp_nonpos(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 y = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(y), _mm512_castps_si512(sign)));
}
#elif defined(MINISPEED_HAS_AVX2)
inline __m256 erf_vec(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(kErfP), a, one));
  __m256 poly = _mm256_set1_ps(kErfA5);
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kErfA4));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kErfA3));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kErfA2));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kErfA1));
  poly = _mm256_mul_ps(poly, t);
  const __m256 y = _mm256_fnmadd_ps(poly, exp_nonpos(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(a, a))), one);
  return _mm256_or_ps(y, sign);
}

inline __m256 tanh_vec(__m256 x) {  // as the AVX-512 form
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e = exp_nonpos(_mm256_mul_ps(a, _mm256_set1_ps(-2.f)));
  return _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), sign);
}
#endif

// v[i] = exp(v[i]) in place for v[i] <= 0, with -inf (a masked entry) giving exactly 0; returns
// the sum. The SIMD paths use exp_nonpos (see Note [vector erf]); the scalar path std::exp.
inline float exp_row_sum(float* v, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(MINISPEED_HAS_AVX512)
  __m512 acc = _mm512_setzero_ps();
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(v + i);
    const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpos(x));
    _mm512_storeu_ps(v + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(MINISPEED_HAS_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    const __m256 e = _mm256_and_ps(_mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ), exp_nonpos(x));
    _mm256_storeu_ps(v + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum256(acc);
#endif
  for (; i < n; ++i) {
    v[i] = std::exp(v[i]);  // exp(-inf) == 0
    total += v[i];
  }
  return total;
}

// o[i] = gelu(x[i] + b[i]) (b may be null); see Note [vector erf]. Exact (erf) GeLU, or with
// Tanh the tanh approximation (GPT-2's "gelu_new"): 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v³))).
template <bool Tanh>
inline void gelu_row(const float* x, const float* b, float* o, int64_t n) {
  constexpr float kInvSqrt2 = 0.70710678118654752440f;
  constexpr float kSqrt2OverPi = 0.79788456080286535588f, kCubic = 0.044715f;
  int64_t i = 0;
#if defined(MINISPEED_HAS_AVX512)
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + i));
    __m512 e;
    if (Tanh) {
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
      e = tanh_vec(_mm512_mul_ps(_mm512_set1_ps(kSqrt2OverPi),
                                 _mm512_fmadd_ps(_mm512_set1_ps(kCubic), cube, v)));
    } else {
      e = erf_vec(_mm512_mul_ps(v, _mm512_set1_ps(kInvSqrt2)));
    }
    _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v),
                                          _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  }
#elif defined(MINISPEED_HAS_AVX2)
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + i));
    __m256 e;
    if (Tanh) {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
      e = tanh_vec(_mm256_mul_ps(_mm256_set1_ps(kSqrt2OverPi),
                                 _mm256_fmadd_ps(_mm256_set1_ps(kCubic), cube, v)));
    } else {
      e = erf_vec(_mm256_mul_ps(v, _mm256_set1_ps(kInvSqrt2)));
    }
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v),
                                          _mm256_add_ps(_mm256_set1_ps(1.f), e)));
  }
#endif
  for (; i < n; ++i) {
    const float v = b ? x[i] + b[i] : x[i];
    const float e = Tanh ? std::tanh(kSqrt2OverPi * (v + kCubic * v * v * v))
                         : std::erf(v * kInvSqrt2);
    o[i] = 0.5f * v * (1.f + e);
  }
}

// Runs body(row) for row in [0, rows) on OpenMP threads; serial when the work is small, so a
// decode step's tiny kernels pay no thread wake-up.
template <typename Body>
void parallel_rows(int64_t rows, int64_t work_per_row, const Body& body) {
  const bool big = rows > 1 && rows * work_per_row >= (1 << 14);
#pragma omp parallel for schedule(static) if (big)
  for (int64_t r = 0; r < rows; ++r) body(r);
}

// Note [fused residual norm]: h = x + residual is written once (res_out) and normalized in the
// same pass over the row, so a transformer block reads its residual stream once per norm instead
// of three times (add, then mean/var, then scale). Per row of C: reads 2C (or C) floats, writes 2C.
void layer_norm(uintptr_t x, uintptr_t residual, uintptr_t gamma, uintptr_t beta, uintptr_t out,
                uintptr_t res_out, int64_t rows, int64_t cols, double eps) {
  pybind11::gil_scoped_release nogil;
  parallel_rows(rows, cols, [&](int64_t r) {
    const float* xr = ptr<const float>(x) + r * cols;
    const float* rr = residual ? ptr<const float>(residual) + r * cols : nullptr;
    float* h = ptr<float>(res_out) + r * cols;
    const float mean = add_into(xr, rr, h, cols) / static_cast<float>(cols);
    const float var = centered_sq(h, mean, cols) / static_cast<float>(cols);
    const float inv = 1.f / std::sqrt(var + static_cast<float>(eps));
    scale_affine(h, mean, inv, ptr<const float>(gamma), beta ? ptr<const float>(beta) : nullptr,
                 ptr<float>(out) + r * cols, cols);
  });
}

// RMSNorm: out = h / sqrt(mean(h^2) + eps) * gamma, h = x + residual. See Note [fused residual norm].
void rms_norm(uintptr_t x, uintptr_t residual, uintptr_t gamma, uintptr_t out, uintptr_t res_out,
              int64_t rows, int64_t cols, double eps) {
  pybind11::gil_scoped_release nogil;
  parallel_rows(rows, cols, [&](int64_t r) {
    const float* xr = ptr<const float>(x) + r * cols;
    const float* rr = residual ? ptr<const float>(residual) + r * cols : nullptr;
    float* h = ptr<float>(res_out) + r * cols;
    add_into(xr, rr, h, cols);
    const float ms = dot(h, h, cols) / static_cast<float>(cols);
    const float inv = 1.f / std::sqrt(ms + static_cast<float>(eps));
    scale_affine(h, 0.f, inv, ptr<const float>(gamma), nullptr, ptr<float>(out) + r * cols, cols);
  });
}

// out = gelu(x + bias), the erf GeLU of torch.nn.functional.gelu (see Note [vector erf]), in one
// pass instead of two (add, then gelu).
void bias_gelu(uintptr_t x, uintptr_t bias, uintptr_t out, int64_t rows, int64_t cols) {
  pybind11::gil_scoped_release nogil;
  parallel_rows(rows, cols * 8, [&](int64_t r) {
    gelu_row<false>(ptr<const float>(x) + r * cols, bias ? ptr<const float>(bias) : nullptr,
                    ptr<float>(out) + r * cols, cols);
  });
}

// The same with the tanh GeLU (F.gelu(approximate="tanh"), GPT-2's gelu_new); CPU only.
void bias_gelu_tanh(uintptr_t x, uintptr_t bias, uintptr_t out, int64_t rows, int64_t cols) {
  pybind11::gil_scoped_release nogil;
  parallel_rows(rows, cols * 8, [&](int64_t r) {
    gelu_row<true>(ptr<const float>(x) + r * cols, bias ? ptr<const float>(bias) : nullptr,
                   ptr<float>(out) + r * cols, cols);
  });
}

// out = softmax(scale * x) over each row, with mask[i] == 0 excluded (probability 0). A row with
// every entry masked gives all zeros, not NaN. mask is uint8 (rows, cols) or absent.
void masked_softmax(uintptr_t x, uintptr_t mask, uintptr_t out, int64_t rows, int64_t cols,
                    double scale) {
  pybind11::gil_scoped_release nogil;
  const float s = static_cast<float>(scale);
  parallel_rows(rows, cols * 4, [&](int64_t r) {
    const float* xr = ptr<const float>(x) + r * cols;
    const uint8_t* m = mask ? ptr<const uint8_t>(mask) + r * cols : nullptr;
    float* o = ptr<float>(out) + r * cols;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < cols; ++i)
      if (!m || m[i]) mx = std::max(mx, xr[i] * s);
    if (mx == -std::numeric_limits<float>::infinity()) {
      std::fill(o, o + cols, 0.f);
      return;
    }
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < cols; ++i) o[i] = (!m || m[i]) ? xr[i] * s - mx : ninf;
    const float inv = 1.f / exp_row_sum(o, cols);
    for (int64_t i = 0; i < cols; ++i) o[i] *= inv;
  });
}

// Rotate-half rotary embedding (GPT-NeoX / LLaMA layout): for each token t, head h, and
// i < D/2 with c = cos[pos[t], i], s = sin[pos[t], i]:
//   out[i] = x[i] * c - x[i + D/2] * s,   out[i + D/2] = x[i + D/2] * c + x[i] * s.
// x and out are (tokens, heads, D); cos and sin are (max_pos, D/2) tables built by Python.
void rotary(uintptr_t x, uintptr_t cos_t, uintptr_t sin_t, uintptr_t positions, uintptr_t out,
            int64_t tokens, int64_t heads, int64_t dim) {
  pybind11::gil_scoped_release nogil;
  const int64_t half = dim / 2;
  parallel_rows(tokens, heads * dim, [&](int64_t t) {
    const int64_t p = ptr<const int64_t>(positions)[t];
    const float* c = ptr<const float>(cos_t) + p * half;
    const float* s = ptr<const float>(sin_t) + p * half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = ptr<const float>(x) + (t * heads + h) * dim;
      float* o = ptr<float>(out) + (t * heads + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = xr[i], b = xr[i + half];
        o[i] = a * c[i] - b * s[i];
        o[i + half] = b * c[i] + a * s[i];
      }
    }
  });
}

// Note [paged decode attention]: one new query token per sequence attends over the L cached
// positions of its sequence. Position t lives in block block_table[t / block_size] at slot
// t % block_size; caches are (num_blocks, block_size, kv_heads, D). Per (sequence, head):
// L dot products of D (scores), one softmax, L axpys of D: 4 L D FLOPs, reading 2 L D floats of
// cache, which is why decode is memory-bound. Threads split the (sequence, head) pairs.
// Grouped-query attention (LLaMA's num_key_value_heads): the heads / kv_heads query heads of a
// group read one cached K/V head, h / (heads / kv_heads), so the cache holds each K/V head once
// (kv_heads = heads: ordinary multi-head attention).
void decode_attention(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables,
                      uintptr_t seq_lens, uintptr_t out, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks,
                      double scale) {
  pybind11::gil_scoped_release nogil;
  const float sc = static_cast<float>(scale);
  const int64_t row = kv_heads * dim;  // floats per cached position
  const int64_t group = heads / kv_heads;  // query heads per cached K/V head
  const int64_t pairs = batch * heads;
  const bool big = pairs > 1 && pairs * dim * 64 >= (1 << 14);
#pragma omp parallel if (big)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < pairs; ++bh) {
      const int64_t b = bh / heads, h = bh % heads / group;  // h: the cached head
      const int64_t len = ptr<const int32_t>(seq_lens)[b];
      const int32_t* table = ptr<const int32_t>(block_tables) + b * max_blocks;
      const float* qv = ptr<const float>(q) + bh * dim;
      float* o = ptr<float>(out) + bh * dim;
      std::fill(o, o + dim, 0.f);
      if (len <= 0) continue;
      scores.resize(len);
      // Block by block: positions t0 .. t0 + n of one block are consecutive rows of the pool.
      auto at = [&](const float* cache, int64_t blk) {
        return cache + static_cast<int64_t>(table[blk]) * block_size * row + h * dim;
      };
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t blk = 0, t0 = 0; t0 < len; ++blk, t0 += block_size) {
        const float* kb = at(ptr<const float>(k_cache), blk);
        for (int64_t j = 0, n = std::min(block_size, len - t0); j < n; ++j) {
          scores[t0 + j] = dot(qv, kb + j * row, dim) * sc;
          mx = std::max(mx, scores[t0 + j]);
        }
      }
      for (int64_t t = 0; t < len; ++t) scores[t] -= mx;
      const float inv = 1.f / exp_row_sum(scores.data(), len);
      for (int64_t blk = 0, t0 = 0; t0 < len; ++blk, t0 += block_size) {
        const float* vb = at(ptr<const float>(v_cache), blk);
        for (int64_t j = 0, n = std::min(block_size, len - t0); j < n; ++j)
          axpy(scores[t0 + j] * inv, vb + j * row, o, dim);
      }
    }
  }
}

// ---- int8 weight-only linear ----------------------------------------------------------------
//
// Note [int8 linear: each weight byte read once for every row]
// y (M, N) = x (M, K) @ (w_q (N, K) int8 * scales (N, 1))^T + bias. A decode step has M = batch
// rows (often 1) and is bound by reading the weight, N K bytes here against fp32's 4 N K, so the
// kernel must read each weight byte once per call, not once per row, and widen it to fp32 in
// registers only (never dequantize in memory). As linear.cpp's nk kernel (Note [reading the
// weights once at full bandwidth] there), it walks NR output channels side by side and keeps the
// NR x M partial sums in vector registers: each 16 (AVX-512) or 8 (AVX2) weights are loaded and
// widened int8 -> int32 -> fp32 once (two instructions) and feed M fused multiply-adds. The
// scale is applied once per output, after the reduction. M > 8 (a prefill) runs in chunks of 8
// rows over each 64-channel task, whose weight (64 K bytes) then comes from L2, not memory.
//
// Numerics: an output is width partial sums over k (one fused multiply-add each), reduced once,
// plus the scalar tail, times its scale, plus its bias: the same order for every M, NR and thread
// count (a prefill row and a decode row of the same input agree bit for bit); it agrees with the
// reference (F.linear over the dequantized weight) to fp32 rounding.
// Threads: tasks of 64 output channels (a y row's cache lines never shared), static schedule, and
// only for weights of 2^16 bytes or more (Note [threads only when the weight is large] in
// linear.cpp).
//
// Note [int8 linear: two prefetch distances]
// At M = 1 the loop's own work (widen, convert, one multiply-add per 16 weights) runs at ~27 GB/s
// of weight from L1 but ~15 GB/s from L2, and one core reads memory at ~11-12 GB/s: with the
// weight prefetched into L2 only (16 KiB ahead), the loads then waited on L2 and the two rates
// added up rather than overlapped (9.0-9.7 GB/s). A second prefetch of each line 256 bytes
// ahead moves it from L2 into L1 just before use: 10.4-11.2 GB/s over GPT-2's 49 int8 weights
// (119 MiB) in a scratch C++ harness against 10.4-12.1 GB/s for a plain AVX-512 read of the same
// bytes in the same runs (1 thread, best of 7, load 6-7). 8 or 24 KiB far, 128-384 bytes near:
// within that noise; L1 only (16 KiB ahead with the L1 hint) or no prefetch: slower.

using minispeed_inference::Vec;  // one register of fp32 lanes at the build's level (vec.h)

// kWidth int8 weights widened to one register of fp32.
inline Vec load_i8(const int8_t* p) {
#if defined(MINISPEED_HAS_AVX512)
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))};
#elif defined(MINISPEED_HAS_AVX2)
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))};
#else
  return {static_cast<float>(*p)};
#endif
}

constexpr int kInt8MaxRows = 8;   // rows of x per pass over the weight
constexpr int kInt8Task = 64;     // output channels per thread task
constexpr int kInt8Regs = Vec::kWidth == 8 ? 16 : 32;  // vector registers (AVX2: 16)
constexpr int64_t kInt8PrefetchBytes = 16384;  // memory -> L2: how far ahead of the reads
constexpr int64_t kInt8NearBytes = 256;        // L2 -> L1: how far ahead of the reads

// Channels side by side for M rows: NR · M accumulators + NR weights + one input fit in the
// registers with two to spare; at most 8 (M = 1 read 0.7-0.8 of the copy bandwidth with 4 rows
// side by side, 0.8-0.95 with 8: more independent streams and sum chains in flight).
constexpr int int8_channels(int m) {
  return std::max(1, std::min(8, (kInt8Regs - 3) / (m + 1)));
}

// y[m, n .. n + NR) for M rows, from NR consecutive weight rows.
template <int M, int NR>
inline void int8_block(const float* x, const int8_t* w, const float* scales, const float* bias,
                       float* y, int64_t N, int64_t K, int64_t n) {
  constexpr int kW = Vec::kWidth;
  const int64_t kv = K / kW * kW;  // the vector part of K; the rest is the scalar tail
  Vec acc[NR][M];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = Vec::zero();
  for (int64_t k = 0; k < kv; k += kW) {
    // The block's NR rows are one contiguous run of NR K bytes, so each row prefetching the line
    // kInt8PrefetchBytes past its own read covers every line once, that far ahead (see Note
    // [prefetch the next block] in linear.cpp; past the end of the weight it is a mere hint),
    // and again kInt8NearBytes ahead into L1: see Note [int8 linear: two prefetch distances].
    if (k % 64 == 0)
      for (int r = 0; r < NR; ++r) {
        __builtin_prefetch(w + (n + r) * K + k + kInt8PrefetchBytes, 0, 2);
        __builtin_prefetch(w + (n + r) * K + k + kInt8NearBytes, 0, 3);
      }
    Vec wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load_i8(w + (n + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const Vec xv = Vec::load(x + m * K + k);
      for (int r = 0; r < NR; ++r) acc[r][m].fma(wv[r], xv);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int8_t* wr = w + (n + r) * K;
    const float s = scales[n + r], b = bias ? bias[n + r] : 0.f;
    for (int m = 0; m < M; ++m) {
      float a = acc[r][m].sum();
      for (int64_t k = kv; k < K; ++k) a += x[m * K + k] * static_cast<float>(wr[k]);
      y[m * N + n + r] = a * s + b;
    }
  }
}

// Channels [n0, n1) of y for M rows.
template <int M>
void int8_rows(const float* x, const int8_t* w, const float* scales, const float* bias, float* y,
               int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int NR = int8_channels(M);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) int8_block<M, NR>(x, w, scales, bias, y, N, K, n);
  for (; n < n1; ++n) int8_block<M, 1>(x, w, scales, bias, y, N, K, n);
}

using Int8RowsFn = void (*)(const float*, const int8_t*, const float*, const float*, float*,
                            int64_t, int64_t, int64_t, int64_t);
const Int8RowsFn kInt8Rows[kInt8MaxRows] = {int8_rows<1>, int8_rows<2>, int8_rows<3>,
                                            int8_rows<4>, int8_rows<5>, int8_rows<6>,
                                            int8_rows<7>, int8_rows<8>};

// See Note [int8 linear: each weight byte read once for every row]. 2 M N K FLOPs; reads N K
// weight bytes once (a quarter of fp32's 4 N K) plus 4 N scales, 4 M K input bytes per task.
void int8_linear(uintptr_t x, uintptr_t w_q, uintptr_t scales, uintptr_t bias, uintptr_t out,
                 int64_t m, int64_t n, int64_t k) {
  pybind11::gil_scoped_release nogil;
  const int64_t tasks = (n + kInt8Task - 1) / kInt8Task;
  const bool big = tasks > 1 && n * k >= (int64_t{1} << 16);
#pragma omp parallel for schedule(static) if (big)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n0 = t * kInt8Task, n1 = std::min(n, n0 + kInt8Task);
    for (int64_t m0 = 0; m0 < m; m0 += kInt8MaxRows) {
      const int64_t rows = std::min<int64_t>(kInt8MaxRows, m - m0);
      kInt8Rows[rows - 1](ptr<const float>(x) + m0 * k, ptr<const int8_t>(w_q),
                          ptr<const float>(scales), bias ? ptr<const float>(bias) : nullptr,
                          ptr<float>(out) + m0 * n, n, k, n0, n1);
    }
  }
}

// Note [greedy argmax]: a greedy decode step picks argmax over the vocabulary for each of its B
// rows; torch 2.13's CPU argmax carries (value, index) pairs through its reduction framework and
// took 1.96 ms for 8 rows of 50257 here (load 19 on 2 cores), more than all 25 layer norms of a
// GPT-2 step. One pass per row with a rarely taken branch took 0.77 ms in the same run. Semantics
// are torch.argmax's: the first index of the maximum, and the first NaN if there is one (NaN
// counts as the largest value).
void argmax_rows(uintptr_t x, uintptr_t out, int64_t rows, int64_t cols) {
  pybind11::gil_scoped_release nogil;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = ptr<const float>(x) + r * cols;
    float best = xr[0];
    int64_t at = 0;
    if (best == best) {  // a NaN first entry is already the answer
      for (int64_t i = 1; i < cols; ++i) {
        const float v = xr[i];
        if (!(v <= best)) {  // larger, or NaN
          best = v;
          at = i;
          if (v != v) break;  // the first NaN wins
        }
      }
    }
    ptr<int64_t>(out)[r] = at;
  }
}

std::string simd_level() { return minispeed::simd::compiled_simd_name(); }

}  // namespace minispeed_kernels

void register_sparse_attention(pybind11::module_& m);  // sparse_attention.cpp
void register_linear(pybind11::module_& m);             // linear.cpp
void register_decode_step(pybind11::module_& m);        // decode_step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace minispeed_kernels;
  m.doc() = "minispeed.inference fused CPU kernels (fp32; raw pointers, checked by the wrapper)";
  m.def("simd_level", &simd_level, "the SIMD level this build was compiled for");
  m.def("layer_norm", &layer_norm);
  m.def("rms_norm", &rms_norm);
  m.def("bias_gelu", &bias_gelu);
  m.def("bias_gelu_tanh", &bias_gelu_tanh);
  m.def("masked_softmax", &masked_softmax);
  m.def("rotary", &rotary);
  m.def("decode_attention", &decode_attention);
  m.def("int8_linear", &int8_linear);
  m.def("argmax_rows", &argmax_rows);
  register_sparse_attention(m);
  register_linear(m);
  register_decode_step(m);
}
