// minispeed/simd.h: the SIMD helpers every minispeed CPU op shares, in one place.
//
// How an op gets it: minispeed.core.op_builder puts core's csrc/include on every op's include path
// and hashes this file into every op's cache key, so `#include "minispeed/simd.h"` works in any
// package's csrc/ and editing this file rebuilds every op on its next load. It ships with
// minispeed-core (a declared dependency of every package) as package data, like the .cpp files.
//
// What is here, each with its own comment below:
//   1. platform and level macros  MINISPEED_X86, MINISPEED_HAS_AVX2, MINISPEED_HAS_AVX512,
//                                 MINISPEED_TARGET_AVX2, MINISPEED_TARGET_AVX512
//   2. the level enum             Simd, best_compiled_simd(), compiled_simd_name(),
//                                 compiled_simd_levels()
//   3. 16-bit float conversions   f32_to_bf16_rne, bf16_to_f32, f32_to_fp16_rne (scalar);
//                                 f32x8_to_bf16_lanes, f32x8_to_bf16, bf16x8_to_f32 (AVX2);
//                                 f32x16_to_bf16, bf16x16_to_f32 (AVX-512)
//   4. reductions and BLAS-1      hsum256, dot, axpy (level fixed at compile time);
//                                 axpy_scalar / axpy_avx2 / axpy_avx512 (chosen at run time)
//
// Only helpers that two or more ops use, or that are the other half of such a pair (a conversion's
// inverse), live here; a helper one op needs stays in that op's file.
//
// Note [one level per build, every lower level callable]
// minispeed.core.op_builder compiles an op for ONE level, passing its -m flags and one define
// (-DMINISPEED_SIMD_AVX512, _AVX2 or _SCALAR; see minispeed/core/op_builder/simd.py). Code that
// picks its path at compile time tests MINISPEED_HAS_AVX512 / MINISPEED_HAS_AVX2; code that lets
// the caller pick at run time (a `Simd` argument) compiles every path up to best_compiled_simd().
// An AVX-512 build also has AVX2, FMA and F16C (the builder passes those flags too), so
// MINISPEED_HAS_AVX512 implies MINISPEED_HAS_AVX2.
//
// No torch or pybind11 headers: an op that includes only this stays a seconds-long compile.
// Under nvcc (__CUDACC__) only the scalar conversions are visible, as __host__ __device__
// functions, so a .cu kernel can share them with the CPU code.

#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

// ---- 1. platform and level macros ---------------------------------------------------------------

// MINISPEED_X86: this is an x86-64 target (intrinsics and target attributes exist). Other targets
// build only the scalar paths, whatever level define is passed.
#if defined(__x86_64__) || defined(_M_X64)
#define MINISPEED_X86 1
#endif

// MINISPEED_HAS_AVX2 / MINISPEED_HAS_AVX512: the build's level reaches AVX2 (AVX2 + FMA + F16C)
// or AVX-512 (F, BW, VL), so intrinsics of that level may be used anywhere in the file.
#if defined(MINISPEED_X86) && !defined(__CUDACC__)
#if defined(MINISPEED_SIMD_AVX512) || defined(MINISPEED_SIMD_AVX2)
#define MINISPEED_HAS_AVX2 1
#endif
#if defined(MINISPEED_SIMD_AVX512)
#define MINISPEED_HAS_AVX512 1
#endif
#endif

// MINISPEED_TARGET_AVX2 / MINISPEED_TARGET_AVX512: put before a function to compile it for that
// level whatever the build's flags (GCC/Clang target attributes). Such a function may only be
// CALLED when its level is <= best_compiled_simd(); compiling it everywhere means every x86 build
// compile-checks every path.
#if defined(MINISPEED_X86) && !defined(__CUDACC__)
#include <immintrin.h>
#define MINISPEED_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define MINISPEED_TARGET_AVX512 __attribute__((target("avx512f")))
#endif

// Scalar conversions run on the host and, under nvcc, on the device too.
#if defined(__CUDACC__)
#define MINISPEED_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MINISPEED_HOST_DEVICE inline
#endif

namespace minispeed {
namespace simd {

// ---- 2. the level enum --------------------------------------------------------------------------

// Vector instruction sets, ordered: a CPU (and a build) that has one level has every lower one.
// The integer values are the `simd` / `level` arguments of every op's Python binding and match
// minispeed.core.op_builder.SimdLevel.
enum class Simd : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The widest level this build contains (from the -DMINISPEED_SIMD_* define; scalar off x86).
inline Simd best_compiled_simd() {
#if defined(MINISPEED_HAS_AVX512)
  return Simd::kAvx512;
#elif defined(MINISPEED_HAS_AVX2)
  return Simd::kAvx2;
#else
  return Simd::kScalar;
#endif
}

// "avx512", "avx2" or "scalar": best_compiled_simd() as the label MINISPEED_SIMD accepts.
inline const char* compiled_simd_name() {
  switch (best_compiled_simd()) {
    case Simd::kAvx512:
      return "avx512";
    case Simd::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

// Every level a caller may pick in this build: 0, 1, ... best_compiled_simd().
inline std::vector<int64_t> compiled_simd_levels() {
  std::vector<int64_t> levels;
  for (int64_t l = 0; l <= static_cast<int64_t>(best_compiled_simd()); ++l) levels.push_back(l);
  return levels;
}

// ---- 3. 16-bit float conversions ----------------------------------------------------------------

// Note [bf16 round-to-nearest-even]
// bf16 is the top 16 bits of an fp32. Adding 0x7FFF plus the lowest kept bit, then truncating,
// rounds to nearest with ties to even: below half rounds down, above half carries into the kept
// bits, exactly half carries only when the kept lsb is odd. Denormals round like any value; the
// largest finite values round up to +-inf, as IEEE requires. NaN must not be rounded (the carry
// could turn it into inf), so every NaN becomes the canonical quiet NaN 0x7FC0 (as c10 does).
// Cost: 5 integer operations and a compare per element; the vector forms do the same per lane.
MINISPEED_HOST_DEVICE uint16_t f32_to_bf16_rne(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return 0x7FC0;
  }
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// bf16 -> fp32 is exact: the 16 bits become the top half of the fp32, the low half is zero.
MINISPEED_HOST_DEVICE float bf16_to_f32(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// fp32 -> IEEE fp16, round-to-nearest-even, without F16C (the scalar path and vector tails; the
// vector paths use _mm256_cvtps_ph / _mm512_cvtps_ph, which round the same way). NaN keeps its sign
// and becomes the quiet NaN 0x7E00; |x| >= 65520 (half-way past the largest fp16, 65504) is inf.
MINISPEED_HOST_DEVICE uint16_t f32_to_fp16_rne(float value) {
  uint32_t x;
  std::memcpy(&x, &value, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t abs_bits = x & 0x7FFFFFFFu;
  if (abs_bits >= 0x7F800000u) return sign | (abs_bits > 0x7F800000u ? 0x7E00 : 0x7C00);
  if (abs_bits >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to inf
  if (abs_bits < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5 puts the value where one fp32 ulp is one
    // fp16 subnormal unit (2^-24), so the hardware add rounds it to nearest even for us.
    float a;
    std::memcpy(&a, &abs_bits, sizeof(a));
    a += 0.5f;
    uint32_t r;
    std::memcpy(&r, &a, sizeof(r));
    return sign | static_cast<uint16_t>(r - 0x3F000000u);
  }
  const uint32_t odd = (abs_bits >> 13) & 1u;
  abs_bits += 0xC8000FFFu + odd;  // rebias the exponent (127 -> 15) and round half to even
  return sign | static_cast<uint16_t>(abs_bits >> 13);
}

#if defined(MINISPEED_HAS_AVX2)
// 8 fp32 -> 8 bf16 (Note [bf16 round-to-nearest-even]), each in the LOW half of a 32-bit lane:
// the form to pack two of (_mm256_packus_epi32) into 16 values.
inline __m256i f32x8_to_bf16_lanes(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
}

// 8 fp32 -> 8 packed bf16 (16 bytes, element order): f32x8_to_bf16_lanes narrowed. Every lane is
// < 2^16, so the unsigned-saturating pack is exact.
inline __m128i f32x8_to_bf16(__m256 value) {
  const __m256i lanes = f32x8_to_bf16_lanes(value);
  return _mm_packus_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
}

// 8 packed bf16 (16 bytes) -> 8 fp32, exact: widen each to 32 bits and shift it to the top half.
inline __m256 bf16x8_to_f32(__m128i half) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

#if defined(MINISPEED_HAS_AVX512)
// 16 fp32 -> 16 packed bf16 (32 bytes, element order); see Note [bf16 round-to-nearest-even].
// Every lane is < 2^16 before the narrow, so the truncating _mm512_cvtepi32_epi16 is exact.
inline __m256i f32x16_to_bf16(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// 16 packed bf16 (32 bytes) -> 16 fp32, exact.
inline __m512 bf16x16_to_f32(__m256i half) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

// ---- 4. reductions and BLAS-1 -------------------------------------------------------------------

#if defined(MINISPEED_HAS_AVX2)
// Sum of the 8 lanes of v: ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)), a fixed order, so a result
// depends only on the lanes (not on the caller). AVX-512 code uses _mm512_reduce_add_ps instead.
inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 0x55)));
}
#endif

// sum_i a[i] * b[i] at the build's level: 16 or 8 partial sums (one fused multiply-add each per
// step), reduced once, then the scalar tail. The order of additions depends on the level, so
// levels agree to rounding, not bit for bit. 2 n FLOPs, reads 8 n bytes.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
#if defined(MINISPEED_HAS_AVX512)
  __m512 v = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v);
  }
  acc = _mm512_reduce_add_ps(v);
#elif defined(MINISPEED_HAS_AVX2)
  __m256 v = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    v = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v);
  }
  acc = hsum256(v);
#endif
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// y[i] += alpha * x[i], one level per run-time choice (MoE's combine picks with a `level`
// argument). The vector forms fuse the multiply-add (one rounding); the scalar form and every
// tail round the product and the sum separately, so levels agree to an ulp, not bit for bit.
// 2 n FLOPs, reads 8 n bytes, writes 4 n bytes.
inline void axpy_scalar(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

#if defined(MINISPEED_TARGET_AVX2)
MINISPEED_TARGET_AVX2 inline void axpy_avx2(float alpha, const float* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}

MINISPEED_TARGET_AVX512 inline void axpy_avx512(float alpha, const float* x, float* y, int64_t n) {
  const __m512 a = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}
#endif

// y[i] += alpha * x[i] at the build's level (the compile-time choice of the axpy_* above).
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#if defined(MINISPEED_HAS_AVX512)
  axpy_avx512(alpha, x, y, n);
#elif defined(MINISPEED_HAS_AVX2)
  axpy_avx2(alpha, x, y, n);
#else
  axpy_scalar(alpha, x, y, n);
#endif
}

}  // namespace simd
}  // namespace minispeed
