// The vector helpers the inference op's C++ files share (kernels.cpp, linear.cpp,
// sparse_attention.cpp: one extension, one SIMD level per build).
//
// - `Vec`: one register of fp32 lanes at the build's level (16 for AVX-512, 8 for AVX2, 1 for the
//   scalar build), so a kernel written once over Vec compiles for every level;
// - `exp_nonpos`: e^x for x <= 0 on a whole register (softmax after subtracting the row max).
//
// Note [vector exp]: exp has no vector intrinsic. x = n·ln2 + r with n = round(x / ln2) and
// |r| <= ln2 / 2 (ln2 split in two constants, Cody-Waite, so r keeps its low bits); e^r is a
// degree-7 polynomial (Cephes' expf coefficients), and 2^n goes straight into the exponent bits.
// Relative error ~1e-7 (about one ulp); inputs below -87 are clamped there (e^-87 ~ 1.6e-38), so
// no denormal or zero comes out of the polynomial path; Vec::exp masks -inf (a masked score) to
// an exact 0. The scalar build and every tail use std::exp.

#pragma once

#include <cmath>
#include <cstdint>

#include "minispeed/simd.h"  // MINISPEED_HAS_*, hsum256 (core/csrc/include)

namespace minispeed_inference {

constexpr float kExpC[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(MINISPEED_HAS_AVX512)
inline __m512 exp_nonpos(__m512 x) {  // See Note [vector exp].
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(kExpC[0]);
  for (int c = 1; c < 6; ++c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC[c]));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#elif defined(MINISPEED_HAS_AVX2)
inline __m256 exp_nonpos(__m256 x) {  // See Note [vector exp].
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(kExpC[0]);
  for (int c = 1; c < 6; ++c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC[c]));
  const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// One register of fp32 lanes; every operation is one instruction (or a short fixed sequence).
#if defined(MINISPEED_HAS_AVX512)
struct Vec {
  static constexpr int kWidth = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec splat(float a) { return {_mm512_set1_ps(a)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void fma(Vec a, Vec b) { v = _mm512_fmadd_ps(a.v, b.v, v); }  // this += a * b
  Vec operator*(Vec o) const { return {_mm512_mul_ps(v, o.v)}; }
  Vec operator-(Vec o) const { return {_mm512_sub_ps(v, o.v)}; }
  Vec operator+(Vec o) const { return {_mm512_add_ps(v, o.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float hmax() const { return _mm512_reduce_max_ps(v); }
  Vec exp() const {  // e^v for lanes <= 0, exactly 0 for -inf (a masked score); Note [vector exp]
    const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return {_mm512_maskz_mov_ps(live, exp_nonpos(v))};
  }
};
#elif defined(MINISPEED_HAS_AVX2)
struct Vec {
  static constexpr int kWidth = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec splat(float a) { return {_mm256_set1_ps(a)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void fma(Vec a, Vec b) { v = _mm256_fmadd_ps(a.v, b.v, v); }
  Vec operator*(Vec o) const { return {_mm256_mul_ps(v, o.v)}; }
  Vec operator-(Vec o) const { return {_mm256_sub_ps(v, o.v)}; }
  Vec operator+(Vec o) const { return {_mm256_add_ps(v, o.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  float sum() const { return minispeed::simd::hsum256(v); }
  float hmax() const {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 0x55)));
  }
  Vec exp() const {  // as the AVX-512 form
    const __m256 live = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return {_mm256_and_ps(live, exp_nonpos(v))};
  }
};
#else
struct Vec {
  static constexpr int kWidth = 1;
  float v;
  static Vec zero() { return {0.f}; }
  static Vec load(const float* p) { return {*p}; }
  static Vec splat(float a) { return {a}; }
  void store(float* p) const { *p = v; }
  void fma(Vec a, Vec b) { v += a.v * b.v; }
  Vec operator*(Vec o) const { return {v * o.v}; }
  Vec operator-(Vec o) const { return {v - o.v}; }
  Vec operator+(Vec o) const { return {v + o.v}; }
  static Vec max(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
  float sum() const { return v; }
  float hmax() const { return v; }
  Vec exp() const { return {std::exp(v)}; }  // exp(-inf) == 0
};
#endif

// dst[j * ldd + i] = src[i * lds + j] for a kWidth x kWidth block: in registers at the vector
// levels (the standard unpack / shuffle network: 4 stages of 16 shuffles for AVX-512, 3 of 8 for
// AVX2), so a transpose costs a few instructions per vector instead of a scalar store per element.
inline void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
#if defined(MINISPEED_HAS_AVX512)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {  // (a0 b0 a1 b1 | a4 b4 a5 b5 | ...), (a2 b2 a3 b3 | ...)
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c] = (a_c b_c c_c d_c | a_c+4 ... | a_c+8 ... | a_c+12 ...)
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // then the 128-bit lanes, in two rounds
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    _mm512_storeu_ps(dst + i * ldd, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
    _mm512_storeu_ps(dst + (8 + i) * ldd, _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD));
    _mm512_storeu_ps(dst + (4 + i) * ldd, _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88));
    _mm512_storeu_ps(dst + (12 + i) * ldd, _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD));
  }
#elif defined(MINISPEED_HAS_AVX2)
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
    _mm256_storeu_ps(dst + (4 + i) * ldd, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
  }
#else
  *dst = *src;  // a 1 x 1 block
  (void)lds, (void)ldd;
#endif
}

}  // namespace minispeed_inference
